// The training run: build the layer list from a Config (with shape
// inference), load its data, and train it through a Pipeline with metrics,
// evaluation and atomic checkpoints. How a config becomes a plan is
// tpipe/planning.h; choosing the plan by tuning, tpipe/tuning.h.
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
#include "tpipe/trace.h"

namespace tpipe {

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
  std::string runName; // the plot's title, e.g. the config file's name
  // The config's file, if it came from one. No output may replace it, nor
  // any file the run reads (data, a scripted model, the profile, the
  // checkpoint's own files): such a run is refused before it starts.
  std::string configPath;
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
  // Steps run again after a wrong speculative update (overlap_steps with a
  // clip or train.on_nonfinite "skip").
  int64_t rerunSteps = 0;
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

// Called at the start of every training step with (rank, step) and this
// rank's input batch, on the training thread. For tests: a hook that exits
// or stops stands in for a crashed or stuck host, one that writes a NaN
// into the batch for a bad sample. Not thread-safe to change while training.
using StepHook = std::function<void(int rank, int64_t step, at::Tensor& input)>;
void setStepHook(StepHook hook);

} // namespace tpipe
