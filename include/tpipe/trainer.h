// Config-driven training: build the layer list from a Config (with shape
// inference), load its data, and train it through a Pipeline with metrics,
// evaluation and atomic checkpoints.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tpipe/config.h"
#include "tpipe/model.h"
#include "tpipe/pipeline.h"
#include "tpipe/profile.h"
#include "tpipe/tune.h"

namespace tpipe {

// Profiles the config's model at its micro-batch size (batch / micro-batches)
// on the first pipeline device's type.
Profile profileModel(const Config& config, const BuiltModel& model);

// Per-layer costs for planning, and where they came from.
struct TrainingCosts {
  std::vector<LayerCost> layers;
  int64_t inputBytes = 0;
  double noise = 0.0;
  std::string source; // "parameter bytes", "measured now", "profile.json"
};

// Whether the config's plan needs measured times or bytes: partition `time`,
// or a device with a memory capacity.
bool needsMeasuredCosts(const Config& config);

// Costs for the config's plan: read from a saved profile (`tpipe profile
// --out`) when profilePath is given, measured now when `measure`, else
// parameter bytes alone. A profile of another model is a ConfigError.
TrainingCosts trainingCosts(
    const Config& config,
    const BuiltModel& model,
    const std::string& profilePath,
    bool measure);

// Bytes without running anything: parameters, and each layer's output and
// saved activations at the config's micro-batch size from shape inference
// (the layer facts; a TorchScript model's saved bytes are taken as its
// output's). No times.
TrainingCosts shapeCosts(const Config& config, const BuiltModel& model);

// Memory this process may still use on this host (MemAvailable); 0 when
// unknown.
int64_t hostAvailableBytes();

// checkFeasibility for a config over these costs, against its devices'
// caps and (in one process) the host's available memory; and the text a
// refusal prints: the problem, then the changes that would fit.
Feasibility configFeasibility(
    const Config& config,
    const TrainingCosts& costs,
    bool oneProcess = true);
std::string infeasibleText(const Feasibility& verdict);

// Costs from a profile, at the config's micro-batch size.
TrainingCosts costsFromProfile(
    const Config& config,
    const Profile& profile,
    const std::string& source);

// The plan resolver's request for a config: its devices (speed, memory),
// partition method, schedule, micro-batches, checkpoint mode and optimizer.
PlanRequest planRequest(const Config& config, const TrainingCosts& costs);

struct TrainOptions {
  // Plan from this saved profile instead of measuring (reproducible plans).
  std::string profilePath;
  // --save into a directory that holds another checkpoint: refused unless
  // set (or the run resumes from that directory).
  bool overwrite = false;
  std::string metricsPath; // JSON lines; empty: none
  // An SVG of the run's curves (loss, eval loss and accuracy, samples/s),
  // written when the run ends or stops; with metricsPath, of the whole
  // file (a resumed run's history included). Empty: none.
  std::string plotPath;
  std::string runName;   // the plot's title, e.g. the config file's name
  std::string saveDir;   // checkpoints; empty: none
  std::string resumeDir; // continue from this checkpoint; empty: start;
                         // "auto": saveDir's last checkpoint, if any
  // Resume a checkpoint whose run differs (a new learning rate): without
  // it, a checkpoint of another model, data or settings is refused naming
  // the first key that differs.
  bool resumeChanged = false;
  // Stop (and checkpoint, with saveDir) once this many steps are done, as a
  // preempted job would; the schedule still spans train.steps. 0: run all.
  int64_t stopAfter = 0;
  std::ostream* log = nullptr; // progress and summary; null: std::cout
  // The last recordSteps steps are recorded for the bubble report, and
  // written as a Chrome trace, an SVG timeline and a JSON report when asked.
  int recordSteps = 5;
  std::string tracePath, timelinePath, reportPath;
  bool evaluate = true; // evaluate at eval_every and at the end
  // Measure memory per device and print it next to the partitioner's
  // prediction (always on when a device declares a memory capacity).
  bool memoryReport = false;
};

// One device's memory: sized parts (parameters, optimizer state) plus what
// the allocator saw its worker hold at peak (gradients, activations,
// workspace), next to the partitioner's prediction.
struct MemoryRow {
  std::string device;
  int64_t parameterBytes = 0;
  int64_t gradientBytes = 0;
  int64_t optimizerBytes = 0;
  int64_t workerPeakBytes = 0;     // allocator peak of the worker's allocations
  int64_t activationPeakBytes = 0; // workerPeak - gradients
  int64_t measuredPeakBytes = 0;   // parameters + optimizer + workerPeak
  int64_t predictedBytes = 0;
  int64_t capacityBytes = 0;
  bool measured = false; // the worker peak was measured (by some process)
};

struct TrainSummary {
  int64_t startStep = 0;    // 0 unless resumed
  int64_t steps = 0;        // optimizer steps taken in total
  int64_t skippedSteps = 0; // non-finite, skipped (train.on_nonfinite)
  // Resumed with --metrics: steps the file recorded beyond the checkpoint,
  // which this run did again (work lost to the failure).
  int64_t redoneSteps = 0;
  double seconds = 0.0;
  double samplesPerSecond = 0.0;
  double finalLoss = 0.0;
  double evalLoss = 0.0;
  double evalAccuracy = -1.0;    // < 0: not a classification loss
  std::vector<double> losses;    // per step run in this call
  BubbleReport bubble;           // over the recorded steps
  std::vector<MemoryRow> memory; // when measured
  // SIGINT or SIGTERM stopped the run after `steps` (with a checkpoint, when
  // saving); 0: it ran to its end.
  int stopSignal = 0;
  // Where a step's time goes, medians over this call's steps (ms): taking
  // the batch, the pipeline (forwards and backwards), the update (gradient
  // norm and non-finite check, optimizer step, zeroing), and the whole step
  // from one start to the next (the rest: metrics, progress, checks).
  struct StepSplit {
    double batchMs = 0.0, pipelineMs = 0.0, updateMs = 0.0, stepMs = 0.0;
  } split;
};

// Trains the config. SIGINT and SIGTERM are handled while it runs: the first
// finishes the current step (on every rank), checkpoints with --save, and
// returns with stopSignal set; a second one exits at once.
TrainSummary train(const Config& config, const TrainOptions& options);

// ---- Tuning: `tpipe tune` and "pipeline": {"auto": true} ----------------

struct TuneOptions {
  int top = 10;                // candidates shown (and measured, with measure)
  bool measure = false;        // run the top ones and rank them by measurement
  int measureSteps = 4;        // timed steps per candidate and round (after 2)
  int measureRounds = 2;       // rounds over the candidates, in turn
  bool quick = false;          // fewer profiling repeats (for pipeline.auto)
  std::ostream* log = nullptr; // progress lines; null: none
};

struct TuneOutcome {
  CostModel model;
  TuneRequest request; // what was searched (see candidatePlanRequest)
  TuneResult result;
  // The calibration, for the reader: fit residuals, runtime overheads.
  std::vector<std::string> calibration;
};

// Calibrates a cost model on this machine for the config's job (profiles
// every layer at the micro-batch sizes and thread counts the search needs,
// then times real steps, in turn, for the runtime's own costs and the
// noise) and searches. Where the prediction cannot decide (the plans
// predicted within 25% of the fastest, at most 4, the predicted choice, and
// the fastest predicted per device count within 2x) or with measure (the
// top candidates), they run in turn, built once, one step each per round
// over 15 rounds, and the fastest measured becomes the choice, or the
// simplest within the measurement's noise of it (at least 3%). The config's
// devices are the devices a plan may use; its pipeline settings are ignored.
TuneOutcome tuneConfig(const Config& config, const TuneOptions& options);

// Plans for a described cluster, nothing measured: per-layer FLOPs and
// bytes from shape inference, device peak FLOP/s and efficiency, links and
// memory from `cluster` (format in docs/tune.md). Throws ConfigError naming
// a bad key. `source` names the file for messages.
TuneOutcome tuneForCluster(
    const Config& config,
    const nlohmann::json& cluster,
    const std::string& source);

// Runs each candidate (one process, threads) from the same initial weights:
// each built once and given 2 warm-up steps, then `rounds` rounds in which
// each takes `steps` steps in turn. The lower quartile of each one's ms per
// step (batch, forward, backward, optimizer): a busy neighbour only adds
// time, and the quartile is robust to bursts that hit one plan's steps more.
std::vector<double> measureCandidates(
    const Config& config,
    const std::vector<TuneCandidate>& candidates,
    int steps,
    int rounds,
    std::ostream* log = nullptr);

// A config file's JSON with its pipeline section set to run `candidate`
// (`tpipe tune --write`): the first `ranks` devices, partition "balance"
// with its boundaries, its schedule, micro-batches, checkpoint mode and
// threads; every other key as written. Training itself takes the
// candidate's plan (candidatePlanRequest), never a config rebuilt from it.
nlohmann::json configWithPlan(
    nlohmann::json config,
    const TuneCandidate& candidate);

// Called at the start of every training step with (rank, step) and this
// rank's input batch, on the training thread. For tests: a hook that exits
// or stops stands in for a crashed or stuck host, one that writes a NaN
// into the batch for a bad sample. Not thread-safe to change while training.
using StepHook = std::function<void(int rank, int64_t step, at::Tensor& input)>;
void setStepHook(StepHook hook);

} // namespace tpipe
