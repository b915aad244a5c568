// What a pipeline did, instruction by instruction, and what it tells about
// the bubble. A trace is a plain value: recorded by the runtime when asked
// (PipelineOptions::record), then printed, reported, drawn or saved.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tpipe/schedule.h"

namespace tpipe {

struct TraceEvent {
  int rank = 0;
  int index = 0;        // position in the schedule's list for this rank
  double startUs = 0.0; // since the step began (steady clock)
  double endUs = 0.0;
  int64_t bytes = 0; // transfers: tensor bytes sent or received
};

struct StepTrace {
  int step = 0;        // the pipeline's step counter (1-based)
  double wallUs = 0.0; // the step's wall time, first dispatch to last end
  // When the step began on the recording process's steady clock (us since
  // its epoch): what lines up the traces of several processes.
  double originUs = 0.0;
  std::vector<TraceEvent> events; // every executed instruction
};

struct Trace {
  Schedule schedule;                // what the events index into
  std::vector<std::string> devices; // per rank
  std::vector<StepTrace> steps;
  // Each rank ran in its own process (merged from several): the Chrome
  // trace then gives every rank a process track.
  bool perProcess = false;
};

// Bubble accounting of one step per rank. busy = compute (forward,
// backward, recompute) + communication (sends); idle = wall - busy, which
// includes the time receives wait. busy + idle = wall exactly.
struct RankBubble {
  std::string device;
  double wallMs = 0.0;
  double computeMs = 0.0;
  double recomputeMs = 0.0; // part of computeMs
  double communicationMs = 0.0;
  double busyMs = 0.0;
  double idleMs = 0.0;
};

struct BubbleReport {
  int steps = 0; // averaged over
  std::vector<RankBubble> ranks;
  double stepMs = 0.0;            // mean measured step
  double measuredBubble = 0.0;    // sum idle / (ranks * wall)
  double theoreticalBubble = 0.0; // theoreticalBubble(schedule)
  std::string theoreticalFormula; // which, and what it assumes
  double simulatedBubble = 0.0;   // simulator on the measured mean times
  double simulatedStepMs = 0.0;
  // Steps back to back without a barrier (overlapping steps): the
  // simulator's steady step on the measured times, and the measured mean
  // time from one recorded step's start to the next's (0: one step).
  double simulatedSteadyStepMs = 0.0;
  double measuredStartToStartMs = 0.0;
  std::vector<StageCosts> measuredCosts; // per stage, ms
};

// Averages the steps of a trace (all of them; skip warm-up steps before).
BubbleReport bubbleReport(const Trace& trace);
void printBubbleReport(std::ostream& out, const BubbleReport& report);
nlohmann::json bubbleReportToJson(const BubbleReport& report);
// The per-stage costs of a report's "stage_costs" (as bubbleReportToJson
// writes them, or a file of that shape), for `stages` stages; `what` names
// the source in errors (ConfigError). A fused backward given alone is split
// in halves, as the simulator assumes elsewhere.
std::vector<StageCosts> stageCostsFromJson(
    const nlohmann::json& report,
    int stages,
    const std::string& what);

// Chrome trace event format (Perfetto, chrome://tracing): one track per
// device, complete events named F3 / B3 / R3 / "send act 3 -> stage 2",
// args with micro-batch and stage, step boundaries as instant events.
nlohmann::json chromeTrace(const Trace& trace);

// A Gantt chart of one step as SVG: a row per device, a colour per kind,
// idle time blank, a legend and the bubble in the title.
std::string timelineSvg(const Trace& trace, int stepIndex = -1);

} // namespace tpipe
