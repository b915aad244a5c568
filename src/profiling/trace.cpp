// Bubble reports, Chrome traces and SVG timelines from recorded steps.
#include "tpipe/trace.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <map>
#include <ostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "overloaded.h"
#include "tpipe/errors.h"

namespace tpipe {
namespace {

const Instruction& instructionOf(const Trace& trace, const TraceEvent& event) {
  return trace.schedule.perRank.at(event.rank).at(event.index);
}

bool isSend(const Instruction& instruction) {
  return std::holds_alternative<SendActivation>(instruction) ||
      std::holds_alternative<SendGrad>(instruction);
}

// Mean duration per (stage, kind), in ms, over every step.
std::vector<StageCosts> meanCosts(const Trace& trace) {
  const int stages = trace.schedule.stages();
  struct Sum {
    double total = 0.0;
    int count = 0;
    double mean() const {
      return count ? total / count : 0.0;
    }
  };
  std::vector<std::map<std::string, Sum>> sums(stages);
  for (const auto& step : trace.steps) {
    // Per rank, its events by list position: an overlapped pair's backward
    // is the rank's next compute event after its forward.
    std::map<std::pair<int, int>, const TraceEvent*> at;
    for (const auto& event : step.events) {
      const Instruction& instruction = instructionOf(trace, event);
      Sum& sum = sums[stageOf(instruction)][opName(instruction)];
      sum.total += (event.endUs - event.startUs) / 1000.0;
      ++sum.count;
      at[{event.rank, event.index}] = &event;
    }
    // How much of a pair's shorter part ran under the other: (F + B - span)
    // / min(F, B), 0 for one after the other, 1 when the shorter hid
    // entirely; the simulator's StageCosts::overlap, on the forward's stage.
    for (auto it = at.begin(); it != at.end(); ++it) {
      const TraceEvent& forward = *it->second;
      const auto* f = std::get_if<Forward>(&instructionOf(trace, forward));
      if (!f || !f->overlapsBackward)
        continue;
      auto next = std::next(it);
      while (next != at.end() && next->first.first == forward.rank &&
             !isCompute(instructionOf(trace, *next->second)))
        ++next;
      if (next == at.end() || next->first.first != forward.rank)
        continue;
      const TraceEvent& backward = *next->second;
      const double fUs = forward.endUs - forward.startUs;
      const double bUs = backward.endUs - backward.startUs;
      const double span = std::max(forward.endUs, backward.endUs) -
          std::min(forward.startUs, backward.startUs);
      if (std::min(fUs, bUs) <= 0.0)
        continue;
      Sum& sum = sums[f->stage]["overlap"];
      sum.total +=
          std::clamp((fUs + bUs - span) / std::min(fUs, bUs), 0.0, 1.0);
      ++sum.count;
    }
  }
  std::vector<StageCosts> costs(stages);
  for (int s = 0; s < stages; ++s) {
    auto& c = costs[s];
    auto mean = [&](const char* op) { return sums[s][op].mean(); };
    c.forward = mean("forward");
    c.backward = mean("backward");
    c.backwardInput = mean("backward_input");
    c.backwardWeight = mean("backward_weight");
    c.recompute = mean("recompute");
    c.transfer = std::max(mean("send_activation"), mean("send_grad"));
    c.overlap = mean("overlap");
  }
  return costs;
}

} // namespace

BubbleReport bubbleReport(const Trace& trace) {
  BubbleReport report;
  const int ranks = trace.schedule.ranks;
  report.steps = static_cast<int>(trace.steps.size());
  report.ranks.resize(ranks);
  for (int r = 0; r < ranks; ++r)
    report.ranks[r].device =
        r < static_cast<int>(trace.devices.size()) ? trace.devices[r] : "";
  report.theoreticalBubble = theoreticalBubble(trace.schedule);
  report.theoreticalFormula = theoreticalBubbleFormula(trace.schedule);
  if (trace.steps.empty())
    return report;
  for (const auto& step : trace.steps) {
    report.stepMs += step.wallUs / 1000.0;
    for (int r = 0; r < ranks; ++r)
      report.ranks[r].wallMs += step.wallUs / 1000.0;
    for (const auto& event : step.events) {
      const Instruction& instruction = instructionOf(trace, event);
      const double ms = (event.endUs - event.startUs) / 1000.0;
      RankBubble& rank = report.ranks[event.rank];
      if (isCompute(instruction)) {
        rank.computeMs += ms;
        if (std::holds_alternative<Recompute>(instruction))
          rank.recomputeMs += ms;
      } else if (isSend(instruction)) {
        rank.communicationMs += ms;
      }
    }
  }
  const double n = static_cast<double>(trace.steps.size());
  report.stepMs /= n;
  double idle = 0.0, wall = 0.0;
  for (auto& rank : report.ranks) {
    rank.wallMs /= n;
    rank.computeMs /= n;
    rank.recomputeMs /= n;
    rank.communicationMs /= n;
    rank.busyMs = rank.computeMs + rank.communicationMs;
    rank.idleMs = rank.wallMs - rank.busyMs;
    idle += rank.idleMs;
    wall += rank.wallMs;
  }
  report.measuredBubble = wall > 0 ? idle / wall : 0.0;
  report.measuredCosts = meanCosts(trace);
  const Simulation simulation = simulate(trace.schedule, report.measuredCosts);
  report.simulatedBubble = simulation.bubbleFraction;
  report.simulatedStepMs = simulation.makespan;
  if (simulation.finished)
    report.simulatedSteadyStepMs =
        steadyStepTime(trace.schedule, report.measuredCosts);
  if (trace.steps.size() > 1) {
    report.measuredStartToStartMs =
        (trace.steps.back().originUs - trace.steps.front().originUs) /
        (1000.0 * static_cast<double>(trace.steps.size() - 1));
  }
  return report;
}

void printBubbleReport(std::ostream& out, const BubbleReport& report) {
  const auto flags = out.flags();
  out << std::fixed << std::setprecision(3);
  out << "bubble report (mean of " << report.steps << " recorded step(s), step "
      << report.stepMs << " ms)\n";
  out << "rank device      wall ms  compute ms  recompute ms  comm ms   idle ms\n";
  for (size_t r = 0; r < report.ranks.size(); ++r) {
    const auto& rank = report.ranks[r];
    out << std::setw(4) << r << ' ' << std::left << std::setw(9) << rank.device
        << std::right << std::setw(10) << rank.wallMs << std::setw(12)
        << rank.computeMs << std::setw(14) << rank.recomputeMs << std::setw(9)
        << rank.communicationMs << std::setw(10) << rank.idleMs << '\n';
  }
  out << std::setprecision(1);
  out << "bubble: measured " << 100 * report.measuredBubble
      << "%  (sum idle / (ranks x wall); idle includes "
      << "waiting in receives)\n";
  out << "        simulated " << 100 * report.simulatedBubble
      << "%  (the schedule replayed with the measured mean "
      << "instruction times: step " << std::setprecision(3)
      << report.simulatedStepMs << " ms)\n";
  if (report.simulatedSteadyStepMs > 0.0) {
    out << "        back to back " << report.simulatedSteadyStepMs
        << " ms per step simulated without a barrier";
    if (report.measuredStartToStartMs > 0.0)
      out << "; measured " << report.measuredStartToStartMs
          << " ms from one step's start to the next's";
    out << '\n';
  }
  out << std::setprecision(1) << "        theory "
      << 100 * report.theoreticalBubble << "%  (" << report.theoreticalFormula
      << ")\n";
  out.flags(flags);
}

nlohmann::json bubbleReportToJson(const BubbleReport& report) {
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& rank : report.ranks) {
    ranks.push_back(
        {{"device", rank.device},
         {"wall_ms", rank.wallMs},
         {"compute_ms", rank.computeMs},
         {"recompute_ms", rank.recomputeMs},
         {"communication_ms", rank.communicationMs},
         {"busy_ms", rank.busyMs},
         {"idle_ms", rank.idleMs}});
  }
  nlohmann::json costs = nlohmann::json::array();
  for (const auto& c : report.measuredCosts) {
    costs.push_back(
        {{"forward_ms", c.forward},
         {"backward_ms", c.backward},
         {"backward_input_ms", c.backwardInput},
         {"backward_weight_ms", c.backwardWeight},
         {"recompute_ms", c.recompute},
         {"transfer_ms", c.transfer},
         {"overlap", c.overlap}});
  }
  return {
      {"steps", report.steps},
      {"step_ms", report.stepMs},
      {"ranks", ranks},
      {"measured_bubble", report.measuredBubble},
      {"simulated_bubble", report.simulatedBubble},
      {"simulated_step_ms", report.simulatedStepMs},
      {"simulated_steady_step_ms", report.simulatedSteadyStepMs},
      {"measured_start_to_start_ms", report.measuredStartToStartMs},
      {"theoretical_bubble", report.theoreticalBubble},
      {"definitions",
       {{"measured_bubble",
         "sum over ranks of idle / (ranks x wall); idle = wall - compute - sends"},
        {"simulated_bubble",
         "the same, from the schedule simulated with the measured mean times"},
        {"theoretical_bubble", report.theoreticalFormula}}},
      {"stage_costs", costs}};
}

std::vector<StageCosts> stageCostsFromJson(
    const nlohmann::json& json,
    int stages,
    const std::string& what) {
  if (!json.is_object() || !json.contains("stage_costs") ||
      !json["stage_costs"].is_array()) {
    throw ConfigError(
        what + ": expected {\"stage_costs\": [...]} (a report from --report)");
  }
  const auto& items = json["stage_costs"];
  if (static_cast<int>(items.size()) != stages) {
    throw ConfigError(
        what + ": " + std::to_string(items.size()) + " stages of costs for " +
        std::to_string(stages) + " stages");
  }
  std::vector<StageCosts> costs;
  for (size_t k = 0; k < items.size(); ++k) {
    // Bounded so that a schedule's sums of them stay finite: 1e300 had
    // overflowed the zero-bubble scheduler's clock ("no rank can make
    // progress").
    auto number = [&](const char* key) {
      const auto& value = items[k].value(key, nlohmann::json(0.0));
      if (!value.is_number() || !(value.get<double>() >= 0) ||
          value.get<double>() > 1e9) {
        throw ConfigError(
            what + ": stage_costs[" + std::to_string(k) + "]." + key +
            ": expected a non-negative number up to 1e9, got " + value.dump());
      }
      return value.get<double>();
    };
    StageCosts c;
    c.forward = number("forward_ms");
    c.backwardInput = number("backward_input_ms");
    c.backwardWeight = number("backward_weight_ms");
    const double fused = number("backward_ms");
    if (c.backwardInput + c.backwardWeight == 0.0)
      c.backwardInput = c.backwardWeight = fused / 2;
    c.backward = fused > 0 ? fused : c.backwardInput + c.backwardWeight;
    c.recompute = c.forward;
    c.transfer = number("transfer_ms");
    c.overlap = number("overlap");
    if (c.overlap > 1.0) {
      throw ConfigError(
          what + ": stage_costs[" + std::to_string(k) +
          "].overlap: expected a fraction from 0 to 1");
    }
    costs.push_back(c);
  }
  return costs;
}

nlohmann::json chromeTrace(const Trace& trace) {
  nlohmann::json events = nlohmann::json::array();
  auto pid = [&](int rank) { return trace.perProcess ? rank : 0; };
  for (int r = 0; r < (trace.perProcess ? trace.schedule.ranks : 1); ++r) {
    events.push_back(
        {{"name", "process_name"},
         {"ph", "M"},
         {"pid", r},
         {"args",
          {{"name",
            trace.perProcess ? "rank " + std::to_string(r)
                             : std::string("tpipe pipeline")}}}});
  }
  for (int r = 0; r < trace.schedule.ranks; ++r) {
    std::string stages;
    for (int s : trace.schedule.stagesOfRank(r)) {
      stages += (stages.empty() ? "" : ",") + std::to_string(s);
    }
    const std::string device =
        r < static_cast<int>(trace.devices.size()) ? trace.devices[r] : "rank";
    events.push_back(
        {{"name", "thread_name"},
         {"ph", "M"},
         {"pid", pid(r)},
         {"tid", r},
         {"args", {{"name", device + " (stage " + stages + ")"}}}});
  }
  double offset = 0.0;
  for (const auto& step : trace.steps) {
    events.push_back(
        {{"name", "step " + std::to_string(step.step)},
         {"ph", "i"},
         {"s", "g"},
         {"ts", offset},
         {"pid", 0},
         {"tid", 0}});
    for (const auto& event : step.events) {
      const Instruction& instruction = instructionOf(trace, event);
      nlohmann::json args = {
          {"micro_batch", microBatchOf(instruction)},
          {"stage", stageOf(instruction)},
          {"step", step.step}};
      if (event.bytes > 0)
        args["bytes"] = event.bytes;
      events.push_back(
          {{"name", shortLabel(instruction)},
           {"cat", opName(instruction)},
           {"ph", "X"},
           {"ts", offset + event.startUs},
           {"dur", event.endUs - event.startUs},
           {"pid", pid(event.rank)},
           {"tid", event.rank},
           {"args", args}});
    }
    offset += step.wallUs * 1.02; // a small gap between steps
  }
  events.push_back(
      {{"name", "end"},
       {"ph", "i"},
       {"s", "g"},
       {"ts", offset},
       {"pid", 0},
       {"tid", 0}});
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

namespace {

struct SvgStyle {
  const char* op;
  const char* colour;
  const char* label;
};

const SvgStyle kSvgStyles[] = {
    {"forward", "#4e79a7", "forward"},
    {"backward", "#e15759", "backward"},
    {"backward_input", "#f28e2b", "backward input (B)"},
    {"backward_weight", "#b07aa1", "backward weight (W)"},
    {"recompute", "#59a14f", "recompute"},
    {"send_activation", "#9c9c9c", "send"},
    {"send_grad", "#9c9c9c", "send"}};

const char* colourOf(const std::string& op) {
  for (const auto& style : kSvgStyles) {
    if (op == style.op)
      return style.colour;
  }
  return nullptr;
}

// The geometry of one timeline picture.
struct SvgLayout {
  double left = 120, top = 56, rowHeight = 34, width = 1100, right = 20;
  double scale = 1.0; // pixels per microsecond
};

void svgRows(std::ostream& svg, const Trace& trace, const SvgLayout& g) {
  for (int r = 0; r < trace.schedule.ranks; ++r) {
    const double y = g.top + r * g.rowHeight;
    svg << "<rect x=\"" << g.left << "\" y=\"" << y << "\" width=\"" << g.width
        << "\" height=\"" << g.rowHeight - 6
        << "\" fill=\"#f4f4f4\" stroke=\"#ddd\"/>\n";
    const std::string device =
        r < static_cast<int>(trace.devices.size()) ? trace.devices[r] : "rank";
    svg << "<text x=\"8\" y=\"" << y + g.rowHeight / 2 << "\">" << device
        << "</text>\n";
  }
}

void svgEvents(
    std::ostream& svg,
    const Trace& trace,
    const StepTrace& step,
    const SvgLayout& g) {
  for (const auto& event : step.events) {
    const Instruction& instruction = instructionOf(trace, event);
    const char* colour = colourOf(opName(instruction));
    if (colour == nullptr)
      continue; // receives: waiting shows as blank
    const double x = g.left + event.startUs * g.scale;
    const double w = std::max(0.5, (event.endUs - event.startUs) * g.scale);
    const double y = g.top + event.rank * g.rowHeight;
    const bool send = isSend(instruction);
    svg << "<rect x=\"" << x << "\" y=\"" << y + (send ? g.rowHeight - 12 : 0)
        << "\" width=\"" << w << "\" height=\"" << (send ? 6 : g.rowHeight - 6)
        << "\" fill=\"" << colour
        << "\" stroke=\"white\" stroke-width=\"0.5\"><title>"
        << shortLabel(instruction) << " (stage " << stageOf(instruction)
        << "): " << (event.endUs - event.startUs) / 1000.0
        << " ms</title></rect>\n";
    const std::string label = shortLabel(instruction);
    if (!send && w > 8.0 * label.size()) {
      svg << "<text x=\"" << x + w / 2 << "\" y=\"" << y + g.rowHeight / 2 + 1
          << "\" text-anchor=\"middle\" fill=\"white\" font-size=\"11\">"
          << label << "</text>\n";
    }
  }
}

void svgAxisAndLegend(
    std::ostream& svg,
    const StepTrace& step,
    int ranks,
    const SvgLayout& g) {
  const double axis = g.top + ranks * g.rowHeight + 4;
  for (int tick = 0; tick <= 10; ++tick) {
    const double x = g.left + g.width * tick / 10.0;
    svg << "<line x1=\"" << x << "\" y1=\"" << axis - 4 << "\" x2=\"" << x
        << "\" y2=\"" << axis + 2 << "\" stroke=\"#333\"/><text x=\"" << x
        << "\" y=\"" << axis + 15 << "\" text-anchor=\"middle\">"
        << step.wallUs / 1000.0 * tick / 10.0 << "</text>\n";
  }
  svg << "<text x=\"" << g.left + g.width << "\" y=\"" << axis + 29
      << "\" text-anchor=\"end\">ms</text>\n";
  double x = g.left;
  const double legend = axis + 45;
  for (size_t i = 0; i + 1 < sizeof(kSvgStyles) / sizeof(kSvgStyles[0]); ++i) {
    const auto& style = kSvgStyles[i];
    svg << "<rect x=\"" << x << "\" y=\"" << legend - 10
        << "\" width=\"12\" height=\"12\" fill=\"" << style.colour
        << "\"/><text x=\"" << x + 16 << "\" y=\"" << legend << "\">"
        << style.label << "</text>\n";
    x += 30 + 7.0 * std::string(style.label).size();
  }
}

} // namespace

std::string timelineSvg(const Trace& trace, int stepIndex) {
  if (trace.steps.empty()) {
    return "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"400\" height=\"40\"><text x=\"10\" y=\"25\">"
           "no recorded steps</text></svg>\n";
  }
  const int index =
      stepIndex < 0 ? static_cast<int>(trace.steps.size()) - 1 : stepIndex;
  const StepTrace& step = trace.steps.at(index);
  Trace one = trace;
  one.steps = {step};
  const BubbleReport report = bubbleReport(one);
  const int ranks = trace.schedule.ranks;
  SvgLayout g;
  g.scale = g.width / std::max(step.wallUs, 1e-9);
  const double height = g.top + ranks * g.rowHeight + 70;
  std::ostringstream svg;
  svg << std::fixed << std::setprecision(2);
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\""
      << g.left + g.width + g.right << "\" height=\"" << height
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n";
  svg << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  svg << "<text x=\"" << g.left
      << "\" y=\"22\" font-size=\"15\" font-weight=\"bold\">"
      << trace.schedule.name << ", " << trace.schedule.stages() << " stages, "
      << trace.schedule.microBatches << " micro-batches: step " << step.step
      << " took " << step.wallUs / 1000.0 << " ms, bubble "
      << std::setprecision(1) << 100 * report.measuredBubble << "% (theory "
      << 100 * report.theoreticalBubble << "%)</text>\n";
  svg << std::setprecision(2);
  svg << "<text x=\"" << g.left
      << "\" y=\"40\" fill=\"#555\">idle time is blank; bubble = idle / (devices x step)"
      << "</text>\n";
  svgRows(svg, trace, g);
  svgEvents(svg, trace, step, g);
  svgAxisAndLegend(svg, step, ranks, g);
  svg << "</svg>\n";
  return svg.str();
}

} // namespace tpipe
