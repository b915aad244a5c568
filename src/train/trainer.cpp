// The training loop behind `tpipe train`: one TrainingRun sets up the model,
// data, plan and pipeline, then steps, reports, evaluates and checkpoints.
// Its parts live beside it: optimization.cpp, planning.cpp, reports.cpp and
// checkpoint.cpp.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tpipe/curves.h"
#include "tpipe/schedule.h"
#include "train/checkpoint.h"
#include "train/files.h"
#include "data/tensor_files.h"
#include "train/parts.h"

namespace tpipe {
namespace {

using Clock = std::chrono::steady_clock;

StepHook& stepHook() {
  static StepHook hook;
  return hook;
}

// The first SIGINT or SIGTERM asks the loop to stop after the current step
// (and checkpoint, with --save); a second one ends the process at once.
std::atomic<int> requestedStop{0};

void onStopSignal(int signal) {
  if (requestedStop.exchange(signal) != 0)
    ::_exit(128 + signal);
}

class StopSignals {
 public:
  StopSignals() {
    requestedStop = 0;
    struct sigaction action {};
    action.sa_handler = onStopSignal;
    ::sigaction(SIGINT, &action, &previousInt_);
    ::sigaction(SIGTERM, &action, &previousTerm_);
  }
  ~StopSignals() {
    ::sigaction(SIGINT, &previousInt_, nullptr);
    ::sigaction(SIGTERM, &previousTerm_, nullptr);
  }
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  struct sigaction previousInt_ {
  }, previousTerm_{};
};

void setTraining(const LayerList& layers, bool on) {
  for (const auto& layer : layers)
    layer.module.ptr()->train(on);
}

struct Evaluation {
  double loss = 0.0;
  double accuracy = -1.0;
};

// Across processes only the last stage's process sees outputs; replica 0's
// counts are summed over the world so every process agrees.
Evaluation evaluate(
    Pipeline& pipe,
    const Dataset& data,
    const LossFunction& lossFn,
    bool classification,
    int64_t chunk,
    Communicator* communicator) {
  setTraining(pipe.layers(), false);
  const int64_t n = data.evalInputs.size(0);
  double lossSum = 0.0, correct = 0.0, positions = 0.0;
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t size = std::min(chunk, n - start);
    const torch::Tensor forwarded =
        pipe.forward(data.evalInputs.narrow(0, start, size));
    if (!forwarded.defined() || (communicator && communicator->replica() != 0))
      continue;
    const torch::Tensor out = forwarded.to(torch::kCPU);
    const torch::Tensor y = data.evalTargets.narrow(0, start, size);
    lossSum += lossFn(out, y).item<double>() * static_cast<double>(size);
    if (classification) {
      correct += out.argmax(-1).eq(y).sum().item<double>();
      positions += static_cast<double>(y.numel());
    }
  }
  setTraining(pipe.layers(), true);
  if (communicator) {
    const auto sums = communicator->sum({lossSum, correct, positions});
    lossSum = sums[0];
    correct = sums[1];
    positions = sums[2];
  }
  Evaluation result;
  result.loss = lossSum / static_cast<double>(n);
  if (classification)
    result.accuracy = correct / positions;
  return result;
}

// pipeline.auto tunes in this process, over costs it measures itself.
const Config& checkedAuto(const Config& config, const TrainOptions& options) {
  if (!config.pipeline.autoTune)
    return config;
  if (!options.profilePath.empty()) {
    throw ConfigError(
        "--profile fixes the costs of a hand-set plan; with pipeline.auto the "
        "tuner measures its own (or write its choice with `tpipe tune --write`)");
  }
  if (worldFromEnvironment().worldSize > 1) {
    throw ConfigError(
        "pipeline.auto tunes within one process; for a multi-process run, "
        "write the choice with `tpipe tune CONFIG --write OUT` and launch OUT");
  }
  return config;
}

// pipeline.auto: tune briefly and train with the choice's plan as it was
// predicted.
ResolvedPlan tunedPlan(const Config& config, std::ostream& log) {
  TuneOptions tune;
  tune.quick = true;
  tune.log = &log;
  tune.stopRequested = [] { return requestedStop.load() != 0; };
  const TuneOutcome outcome = tuneConfig(config, tune);
  const TuneCandidate& choice =
      outcome.result.candidates[outcome.result.choice];
  log << "tune: chose " << choice.label() << " of " << outcome.result.feasible()
      << " feasible plans; " << std::fixed << std::setprecision(2);
  if (choice.measuredStepMs >= 0)
    log << "measured " << choice.measuredStepMs << " ms per step (predicted "
        << choice.predictedStepMs << ")";
  else
    log << "predicted " << choice.predictedStepMs << " ms per step";
  log << std::defaultfloat << "\n";
  for (const auto& note : outcome.result.notes)
    log << "tune: " << note << "\n";
  ResolvedPlan resolved;
  resolved.request =
      candidatePlanRequest(outcome.model, outcome.request, choice);
  resolved.plan = resolvePlan(resolved.request);
  resolved.tunedStepMs = choice.predictedStepMs;
  return resolved;
}

// --resume auto: the --save directory's last committed checkpoint if it
// has one, else a fresh start there, so a restart policy (torchrun's,
// SLURM's, a shell loop's) reruns the same command line.
TrainOptions withAutoResume(TrainOptions options, std::string& note) {
  if (options.resumeDir != "auto")
    return options;
  if (options.saveDir.empty()) {
    throw ConfigError(
        "--resume auto needs --save DIR: it resumes from DIR's last checkpoint, or starts "
        "fresh and checkpoints there");
  }
  if (committedStep(options.saveDir)) {
    options.resumeDir = options.saveDir;
    note = "--resume auto: resuming from " + options.saveDir +
        "'s last checkpoint";
  } else {
    options.resumeDir.clear();
    note = "--resume auto: no checkpoint in " + options.saveDir +
        " yet, starting fresh";
  }
  return options;
}

class TrainingRun {
 public:
  TrainingRun(const Config& config, const TrainOptions& options)
      : config_(fittedToWorld(checkedAuto(config, options))),
        options_(withAutoResume(options, autoResumeNote_)),
        world_(joinWorld(config_)) {
    if (world_) {
      // Rank 0 speaks for the world: every rank records its trace and
      // memory, and rank 0 gathers one report of all of them.
      if (world_->rank() != 0) {
        options_.log = &silent_;
        options_.metricsPath.clear();
        options_.plotPath.clear();
      }
    }
    log_ = options_.log ? options_.log : &std::cout;
    live_ = options_.log == nullptr && ::isatty(STDOUT_FILENO);
    identity_ = {
        runFingerprint(config_),
        config_.train.optimizer.type,
        runDescription(config_),
        options_.resumeChanged};
  }

  TrainSummary run() {
    StopSignals signals; // from the start: a signal during set-up stops before
                         // the first step
    try {
      setUp();
    } catch (const TuneStopped&) {
      summary_.stopSignal = requestedStop.load();
      *log_ << "stopped by "
            << (summary_.stopSignal == SIGINT ? "SIGINT" : "SIGTERM")
            << " while pipeline.auto tuned, before the first step (nothing "
               "trained or saved)"
            << std::endl;
      return summary_;
    }
    resume();
    startOverlap();
    openMetrics();
    logStart();
    alignClocks();
    loop();
    finish();
    writePlot();
    return summary_;
  }

 private:
  Communicator* world() const {
    return world_.get();
  }

  void setUp() {
    if (!options_.saveDir.empty()) {
      saveLock_ = prepareSaveDirectory(
          options_.saveDir,
          identity_,
          options_.overwrite,
          resumingFromSaveDir(),
          committer());
    }
    model_ = buildModel(config_);
    setBatchNormMicroBatches(model_, config_.pipeline.microBatches);
    // One process: the data first, so a bad file is named before any
    // profiling. Across processes: the plan first, so each rank reads only
    // what its stages use.
    if (!world())
      data_ = loadDataset(config_, model_);
    bool capped = false;
    for (const auto& device : config_.pipeline.devices)
      capped = capped || device.memoryBytes > 0;
    measureMemory_ = capped || options_.memoryReport;
    const ResolvedPlan resolved = config_.pipeline.autoTune
        ? tunedPlan(config_, *log_)
        : planTraining(
              config_,
              model_,
              options_.profilePath,
              needsMeasuredCosts(config_) || measureMemory_,
              world());
    planRequest_ = resolved.request;
    plan_ = resolved.plan;
    tunedStepMs_ = resolved.tunedStepMs;
    // pipeline.auto's plan chooses its own count.
    setBatchNormMicroBatches(model_, plan_.schedule.microBatches);
    if (world()) {
      const Schedule& schedule = plan_.schedule;
      const int mine = world()->stageRank();
      DataNeeds needs;
      // Micro-batches enter and end on each chain's first and last stage
      // (micro-batch c is chain c's first).
      needs.inputs = needs.targets = false;
      for (int chain = 0; chain < schedule.chains; ++chain) {
        needs.inputs = needs.inputs ||
            schedule.rankOfStage(schedule.firstStageOf(chain)) == mine;
        needs.targets = needs.targets ||
            schedule.rankOfStage(schedule.lastStageOf(chain)) == mine;
      }
      data_ = loadDataset(config_, model_, needs);
    }
    startPipeline(planRequest_, plan_);
    optimizer_ = makeOptimizer(config_.train.optimizer, pipe_->parameters());
    lossFn_ = makeLoss(config_.train.loss);
    classification_ = config_.train.loss == "cross_entropy";
    batches_ = std::make_unique<BatchSource>(
        data_,
        config_.train.batchSize,
        config_.data.shuffle,
        config_.train.seed);
  }

  // The one place the run's Pipeline is built, from the plan it runs (at
  // set-up, and again when schedule auto is re-planned): the parameters
  // stay the model's, so the optimizer keeps stepping the same tensors.
  void startPipeline(const PlanRequest& request, const Plan& plan) {
    PipelineOptions options = pipelineOptions(config_, model_, plan, world_);
    options.trackMemory = measureMemory_;
    pipe_.reset(); // its workers end before the new ones start
    pipe_ = std::make_unique<Pipeline>(model_.layers, options);
    planRequest_ = request;
    plan_ = plan;
    if (measureMemory_)
      memoryRows_ = prepareMemory(config_, *pipe_);
  }

  // The process that commits checkpoints, and so holds the --save lock.
  bool committer() const {
    return !world_ || world_->rank() == 0;
  }

  bool resumingFromSaveDir() const {
    return !options_.resumeDir.empty() && !options_.saveDir.empty() &&
        sameDirectory(options_.resumeDir, options_.saveDir);
  }

  void resume() {
    if (options_.resumeDir.empty())
      return;
    // A directory another run is writing is not read mid-write; this run's
    // own --save lock covers the directory it resumes from.
    std::unique_ptr<DirectoryLock> reading;
    if (!resumingFromSaveDir()) {
      reading = std::make_unique<DirectoryLock>(
          options_.resumeDir, DirectoryLock::Mode::kRead, "--resume");
    }
    const Resumed resumed = loadCheckpoint(
        options_.resumeDir, *pipe_, *optimizer_, identity_, world());
    summary_.startStep = resumed.step;
    resumeNote_ = resumed.note;
    if (summary_.startStep > config_.train.steps) {
      throw ConfigError(
          "--resume: the checkpoint is at step " +
          std::to_string(summary_.startStep) +
          ", past train.steps = " + std::to_string(config_.train.steps));
    }
  }

  void openMetrics() {
    if (options_.metricsPath.empty())
      return;
    if (summary_.startStep > 0)
      dropMetricsAfter(summary_.startStep);
    metrics_.open(
        options_.metricsPath,
        summary_.startStep > 0 ? std::ios::app : std::ios::trunc);
    if (!metrics_)
      throw ConfigError("--metrics: cannot write " + options_.metricsPath);
  }

  // A run resumed at step s continues its metrics file: records of steps
  // after s (written before a failure, then redone) are dropped, so the
  // file keeps one record per step.
  void dropMetricsAfter(int64_t step) {
    std::error_code error;
    if (!std::filesystem::is_regular_file(options_.metricsPath, error))
      return;
    std::ifstream in(options_.metricsPath);
    std::string line, kept;
    int64_t dropped = 0;
    while (std::getline(in, line)) {
      const nlohmann::json record = nlohmann::json::parse(line, nullptr, false);
      if (record.is_object() && record.contains("step") &&
          record["step"].is_number_integer() &&
          record["step"].get<int64_t>() > step) {
        ++dropped;
        summary_.redoneSteps += record.contains("samples_per_s") ? 1 : 0;
        continue;
      }
      kept += line + "\n";
    }
    in.close();
    if (dropped == 0)
      return;
    writeOutputFile(options_.metricsPath, kept);
    *log_ << "--metrics: dropped " << dropped << " record(s) after step "
          << step << ", which this run redoes\n";
  }

  void writePlot() {
    if (options_.plotPath.empty())
      return;
    std::string lines = plotLines_;
    std::error_code error;
    if (!options_.metricsPath.empty() &&
        std::filesystem::is_regular_file(options_.metricsPath, error)) {
      std::ifstream in(options_.metricsPath);
      std::ostringstream whole;
      whole << in.rdbuf();
      lines = whole.str();
    }
    writeOutputFile(
        options_.plotPath,
        curvesSvg(
            lines,
            options_.runName.empty() ? std::string("tpipe train")
                                     : options_.runName));
    *log_ << "plot: " << options_.plotPath << "\n";
  }

  // Metrics and progress are flushed line by line: a killed run keeps them.
  void writeMetrics(const nlohmann::json& record) {
    if (!options_.plotPath.empty())
      plotLines_ += record.dump() + "\n";
    if (!metrics_.is_open())
      return;
    metrics_ << record.dump() << '\n' << std::flush;
    if (!metrics_)
      throw std::runtime_error(
          "--metrics: cannot write " + options_.metricsPath);
  }

  // How this process's activations and gradients reach other processes.
  std::string transfersText() const {
    return "transfers " + pipe_->crossProcessTransfers(world()->stageRank());
  }

  void logStart() {
    std::ostream& log = *log_;
    log << "model: " << model_.layers.size() << " layers, "
        << model_.parameterCount << " parameters; " << data_.description
        << "\n";
    if (world()) {
      log << "processes: " << world()->worldSize() << " ("
          << world()->replicas() << " replica(s) x " << world()->pipelineRanks()
          << " pipeline ranks), rendezvous over tpipe's store + Gloo, "
          << transfersText() << "\n";
    }
    log << "pipeline: " << pipe_->schedule().stages() << " stages on";
    for (const auto& device : pipe_->stageDevices())
      log << ' ' << device;
    log << ", boundaries";
    for (int b : pipe_->boundaries())
      log << ' ' << b;
    log << ", " << plan_.schedule.microBatches << " micro-batches, "
        << plan_.schedule.name << ", checkpoint "
        << checkpointModeName(plan_.checkpoint) << "\n";
    if (overlapping_ && pipe_->schedule().ranks > 1)
      log << "steps: without a barrier between them (pipeline.overlap_steps)\n";
    log << "plan: partition " << partitionMethodName(plan_.partition)
        << ", costs from " << plan_.costSource;
    // One prediction per run: the tune's where it chose the plan.
    const double predicted =
        tunedStepMs_ > 0 ? tunedStepMs_ : plan_.simulation.makespan;
    if (predicted > 0) {
      log << ", predicted step " << std::fixed << std::setprecision(2)
          << predicted << " ms" << std::defaultfloat
          << (tunedStepMs_ > 0 ? " (the tune's)" : "");
    }
    log << "\n";
    for (const auto& note : plan_.notes)
      log << "plan: " << note << "\n";
    if (summary_.startStep > 0)
      log << "resumed at step " << summary_.startStep << "\n";
    if (!autoResumeNote_.empty())
      log << autoResumeNote_ << "\n";
    if (!resumeNote_.empty())
      log << "resume: " << resumeNote_ << "\n";
    log << std::flush;
  }

  // Across processes, each rank's clock is put on rank 0's (store round
  // trips), so their recorded steps line up in one trace; rank 0 prints the
  // offsets and how far they may be off.
  void alignClocks() {
    if (!world() || options_.recordSteps <= 0)
      return;
    double errorUs = 0.0;
    clockOffsetUs_ = world()->clockOffsetUs(&errorUs);
    char mine[96];
    std::snprintf(
        mine,
        sizeof mine,
        "rank %d %+.1f us (+/- %.1f)",
        world()->rank(),
        clockOffsetUs_,
        errorUs);
    const std::vector<std::string> all = world()->gatherText(mine);
    if (world()->rank() != 0)
      return;
    *log_ << "clocks on rank 0's:";
    for (size_t r = 1; r < all.size(); ++r)
      *log_ << (r > 1 ? "," : "") << " " << all[r];
    *log_ << std::endl;
  }

  double elapsed() const {
    return std::chrono::duration<double>(Clock::now() - start_).count();
  }

  void evaluateAt(int64_t step) {
    const int64_t chunk = std::max<int64_t>(config_.train.batchSize, 256);
    const Evaluation e =
        evaluate(*pipe_, data_, lossFn_, classification_, chunk, world());
    summary_.evalLoss = e.loss;
    summary_.evalAccuracy = e.accuracy;
    nlohmann::json record = {
        {"step", step}, {"eval_loss", e.loss}, {"elapsed_s", elapsed()}};
    if (classification_)
      record["eval_accuracy"] = e.accuracy;
    writeMetrics(record);
    std::ostream& log = *log_;
    if (live_)
      log << '\n';
    log << "eval at step " << step << ": loss " << std::fixed
        << std::setprecision(4) << e.loss;
    if (classification_)
      log << ", accuracy " << e.accuracy;
    log << std::defaultfloat << std::endl;
  }

  // Steps without a barrier (pipeline.overlap_steps): one optimizer per
  // rank, each stepped on its rank's worker (Pipeline::postStep). The run's
  // optimizer_ then only carries state to and from checkpoints.
  void startOverlap() {
    rankOptimizers_.clear();
    overlapping_ = config_.pipeline.overlapSteps && pipe_->canOverlapSteps();
    if (!overlapping_)
      return;
    rankOptimizers_ = makeRankOptimizers(config_.train.optimizer, *pipe_);
    distributeOptimizerState(*optimizer_, rankOptimizers_);
  }

  // Each replica trains on its share of the global batch.
  void narrowToReplica(torch::Tensor& x, torch::Tensor& y) const {
    if (!world() || world()->replicas() == 1)
      return;
    const int64_t share = config_.train.batchSize / world()->replicas();
    x = x.narrow(0, world()->replica() * share, share);
    y = y.narrow(0, world()->replica() * share, share);
  }

  // What a posted step does on each rank once its part is done.
  Pipeline::Update rankUpdate(double lr) {
    Pipeline::Update update;
    update.apply = [this, lr](int rank) {
      torch::optim::Optimizer& optimizer = *rankOptimizers_[rank];
      for (auto& group : optimizer.param_groups())
        group.options().set_lr(lr);
      optimizer.step();
    };
    update.saveState = [this](int rank) {
      return snapshotOptimizerState(*rankOptimizers_[rank]);
    };
    update.checkGradients = config_.train.checksGradients();
    update.clipGradNorm = config_.train.clipGradNorm;
    // Across processes the stop flags ride with the step's notes, sampled
    // when it is posted, as they ride with the loss sum of a step with a
    // barrier.
    if (world())
      update.agree = {static_cast<double>(requestedStop.load())};
    return update;
  }

  void postStep(int64_t step) {
    auto [x, y] = batches_->batch(step);
    narrowToReplica(x, y);
    if (stepHook())
      stepHook()(world() ? world()->rank() : 0, step, x);
    pipe_->postStep(
        x, y, lossFn_, rankUpdate(learningRate(config_.train, step)));
  }

  // Whether step `next` may start before the one before it ends: not where
  // the loop needs the pipeline quiet after that one (a checkpoint, an
  // evaluation, the auto schedule's calibration, recording's start, a stop).
  bool postsAhead(int64_t next) const {
    // Across processes every rank must post alike: only the agreed stop.
    const bool stopping =
        world() ? summary_.stopSignal != 0 : requestedStop.load() != 0;
    if (next >= lastStep_ || stopping)
      return false;
    if (calibrating() && next <= adoptAt_)
      return false;
    if (options_.recordSteps > 0 && next == recordFrom_)
      return false;
    const int64_t save = config_.train.checkpointEvery;
    if (!options_.saveDir.empty() && save > 0 && next % save == 0)
      return false;
    const int64_t eval = config_.train.evalEvery;
    return !(options_.evaluate && eval > 0 && next % eval == 0);
  }

  struct StepResult {
    double loss = 0.0;
    Pipeline::GradientNorm norm;
    bool finite = false;
    TrainSummary::StepSplit split; // but stepMs
  };

  StepResult overlappedStep(int64_t step) {
    const auto start = Clock::now();
    if (pipe_->stepsInFlight() == 0)
      postStep(step);
    if (postsAhead(step + 1))
      postStep(step + 1);
    const auto posted = Clock::now();
    const Pipeline::StepOutcome outcome = pipe_->finishStep();
    if (world())
      stopsSignalled_ = outcome.agreed;
    if (outcome.redone)
      ++summary_.rerunSteps;
    // The batch split and each rank's update run inside the pipeline's time.
    return {
        outcome.loss.item<double>(),
        outcome.norm,
        outcome.updated,
        {milliseconds(posted - start), milliseconds(Clock::now() - posted)}};
  }

  StepResult synchronousStep(int64_t step) {
    const auto start = Clock::now();
    const double lr = learningRate(config_.train, step);
    for (auto& group : optimizer_->param_groups())
      group.options().set_lr(lr);
    auto [x, y] = batches_->batch(step);
    narrowToReplica(x, y);
    if (stepHook())
      stepHook()(world() ? world()->rank() : 0, step, x);
    if (world())
      world()->rideNextSum({static_cast<double>(requestedStop.load())});
    StepResult result;
    const auto fetched = Clock::now();
    result.loss = pipe_->trainStep(x, y, lossFn_).item<double>();
    const auto piped = Clock::now();
    if (world())
      stopsSignalled_ = world()->ridersSummed();
    // Every rank sees the same summed loss and norm, so all decide alike.
    // The update runs where the first stage works, with its threads.
    pipe_->runOnWorker([&] {
      if (config_.train.checksGradients())
        result.norm = pipe_->clipGradNorm(config_.train.clipGradNorm);
      result.finite =
          std::isfinite(result.loss) && result.norm.nonFiniteStage < 0;
      if (result.finite)
        optimizer_->step();
      // Zeroed after the update rather than before the next step: the
      // same work, counted where it belongs.
      optimizer_->zero_grad();
    });
    result.split = {
        milliseconds(fetched - start),
        milliseconds(piped - fetched),
        milliseconds(Clock::now() - piped)};
    return result;
  }

  double trainStep(int64_t step) {
    const auto begin = Clock::now();
    const StepResult result =
        overlapping_ ? overlappedStep(step) : synchronousStep(step);
    splits_.push_back(result.split);
    if (splits_.size() > 1)
      splits_[splits_.size() - 2].stepMs = milliseconds(begin - lastStart_);
    lastStart_ = begin;
    if (result.finite)
      return result.loss;
    auto text = [](double value) -> std::string {
      return std::isnan(value) ? "NaN" : value > 0 ? "inf" : "-inf";
    };
    const Pipeline::GradientNorm& norm = result.norm;
    const std::string what = !std::isfinite(result.loss)
        ? "the loss became " + text(result.loss)
        : "the gradients of stage " + std::to_string(norm.nonFiniteStage) +
            " (" + pipe_->stageDevices()[norm.nonFiniteStage] +
            ") became non-finite (global norm " + text(norm.norm) + ")";
    if (config_.train.onNonFinite == "stop") {
      drainPostedSteps();
      throw std::runtime_error(
          what + " at step " + std::to_string(step + 1) +
          " (lower train.optimizer.lr, set train.clip_grad_norm, or "
          "train.on_nonfinite: \"skip\")");
    }
    *log_ << "step " << step + 1 << ": " << what
          << "; its update is skipped on every stage" << std::endl;
    ++summary_.skippedSteps;
    return result.loss;
  }

  // A run ending on an error leaves no step running behind it.
  void drainPostedSteps() {
    while (overlapping_ && pipe_->stepsInFlight() > 0) {
      try {
        pipe_->finishStep();
      } catch (const std::exception&) {
      }
    }
  }

  static double milliseconds(Clock::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
  }

  // Medians of the per-step split; the last step has no next start.
  void summarizeSplit() {
    auto median = [this](double TrainSummary::StepSplit::*part, size_t n) {
      std::vector<double> values;
      for (size_t i = 0; i < n; ++i)
        values.push_back(splits_[i].*part);
      if (values.empty())
        return 0.0;
      std::nth_element(
          values.begin(), values.begin() + values.size() / 2, values.end());
      return values[values.size() / 2];
    };
    const size_t all = splits_.size();
    summary_.split = {
        median(&TrainSummary::StepSplit::batchMs, all),
        median(&TrainSummary::StepSplit::pipelineMs, all),
        median(&TrainSummary::StepSplit::updateMs, all),
        median(&TrainSummary::StepSplit::stepMs, all > 0 ? all - 1 : 0)};
  }

  void report(int64_t done, double loss) {
    const int64_t total = config_.train.steps;
    const double seconds = elapsed();
    const double rate =
        static_cast<double>(
            (done - summary_.startStep) * config_.train.batchSize) /
        seconds;
    writeMetrics(
        {{"step", done},
         {"loss", loss},
         {"lr", learningRate(config_.train, done - 1)},
         {"elapsed_s", seconds},
         {"samples_per_s", rate}});
    const double eta = static_cast<double>(total - done) *
        config_.train.batchSize / std::max(rate, 1e-9);
    // Off a terminal (a pipe, a log file, mpirun): a line every few
    // seconds, or every log_every steps when set, and always the first,
    // the last and the one a --stop-after run ends at.
    const bool due = config_.train.logEvery > 0
        ? done % config_.train.logEvery == 0
        : seconds - lastProgressSeconds_ >= kProgressSeconds;
    const bool edge = done == summary_.startStep + 1 || done == total ||
        (options_.stopAfter > 0 &&
         done == summary_.startStep + options_.stopAfter);
    std::ostream& log = *log_;
    if (live_) {
      log << "\rstep " << done << "/" << total << "  loss " << std::fixed
          << std::setprecision(4) << loss << "  " << std::setprecision(0)
          << rate << " samples/s  ETA " << duration(eta) << "   "
          << std::defaultfloat << std::flush;
    } else if (due || edge) {
      lastProgressSeconds_ = seconds;
      log << "step " << done << "/" << total << " loss " << std::fixed
          << std::setprecision(4) << loss << " " << std::setprecision(0) << rate
          << " samples/s ETA " << duration(eta) << std::defaultfloat
          << std::endl;
    }
  }

  // Every rank stops at the same step: across processes the ranks agree on
  // whether any of them was signalled.
  // Within a step the stop flags rode along with the loss sum (or a posted
  // step's notes), sampled before it (a signal after it is seen a step
  // later).
  int agreedStop() {
    int mine = requestedStop.load();
    if (!world())
      return mine;
    std::vector<double> signalled = std::move(stopsSignalled_);
    stopsSignalled_.clear();
    if (signalled.empty())
      signalled = world()->sum({static_cast<double>(mine)});
    if (signalled[0] == 0.0)
      return 0;
    return mine != 0 ? mine : SIGTERM;
  }

  void save(int64_t done) {
    if (overlapping_)
      collectOptimizerState(*optimizer_, rankOptimizers_);
    saveCheckpoint(
        options_.saveDir, done, *pipe_, *optimizer_, identity_, world());
    saved_ = true;
  }

  // pipeline.schedule "auto": the first steps run the unit-cost schedule;
  // their recorded per-stage times then build the schedule the rest runs.
  static constexpr int64_t kAutoWarmupSteps = 2, kAutoRecordedSteps = 3;

  bool calibrating() const {
    return plan_.schedule.name == "auto" && !world() &&
        plan_.schedule.virtualStages == 1;
  }

  void adoptAutoSchedule(bool recordAfter) {
    const BubbleReport report = bubbleReport(pipe_->trace());
    const int p = plan_.schedule.ranks;
    PlanRequest request =
        pinnedRequest(planRequest_, plan_, report.measuredCosts);
    request.schedule = ScheduleKind::kAuto;
    const Plan plan = resolvePlan(request);
    const double h1 = simulate(
                          zeroBubbleH1Schedule(
                              p, plan.schedule.microBatches, plan.checkpoint),
                          request.stageCosts)
                          .makespan;
    const std::vector<torch::Tensor> generators = pipe_->generatorStates();
    if (overlapping_)
      collectOptimizerState(*optimizer_, rankOptimizers_);
    startPipeline(request, plan);
    startOverlap();
    pipe_->setGeneratorStates(generators);
    pipe_->setRecording(recordAfter);
    *log_ << "schedule auto: built from the measured stage times of "
          << kAutoRecordedSteps << " steps; simulated step " << std::fixed
          << std::setprecision(2) << plan.simulation.makespan
          << " ms (zb-h1: " << h1 << " ms)" << std::defaultfloat << std::endl;
  }

  void loop() {
    const int64_t total = config_.train.steps;
    const int64_t last =
        options_.stopAfter > 0 ? std::min(total, options_.stopAfter) : total;
    const int64_t recordFrom = std::max<int64_t>(
        summary_.startStep, last - std::max(0, options_.recordSteps));
    lastStep_ = last;
    recordFrom_ = recordFrom;
    const bool saving = !options_.saveDir.empty();
    if (saving && total == 0)
      save(0);
    optimizer_->zero_grad(); // each step then leaves them zeroed
    start_ = Clock::now();
    int64_t done = summary_.startStep;
    summary_.stopSignal = agreedStop();
    const bool calibrate = calibrating();
    const int64_t calibrateFrom = summary_.startStep + kAutoWarmupSteps;
    const int64_t adoptAt = calibrateFrom + kAutoRecordedSteps;
    adoptAt_ = adoptAt;
    // A stop ends the run after the step posted ahead, if one is.
    auto stopped = [&] {
      return summary_.stopSignal &&
          (!overlapping_ || pipe_->stepsInFlight() == 0);
    };
    for (int64_t step = summary_.startStep; step < last && !stopped(); ++step) {
      if ((step == recordFrom && options_.recordSteps > 0) ||
          (calibrate && step == calibrateFrom))
        pipe_->setRecording(true);
      const double loss = trainStep(step);
      summary_.losses.push_back(loss);
      summary_.finalLoss = loss;
      done = step + 1;
      report(done, loss);
      if (calibrate && done == adoptAt)
        adoptAutoSchedule(options_.recordSteps > 0 && done >= recordFrom);
      const int every = static_cast<int>(config_.train.evalEvery);
      if (options_.evaluate && every > 0 && done % every == 0 && done != total)
        evaluateAt(done);
      summary_.stopSignal = agreedStop();
      const bool periodic = config_.train.checkpointEvery > 0 &&
          done % config_.train.checkpointEvery == 0;
      if (saving && (done == last || periodic || stopped()))
        save(done);
    }
    summary_.steps = done;
    if (live_)
      *log_ << '\n';
  }

  void finish() {
    std::ostream& log = *log_;
    summarizeSplit();
    summary_.seconds = elapsed();
    summary_.samplesPerSecond =
        static_cast<double>(
            (summary_.steps - summary_.startStep) * config_.train.batchSize) /
        std::max(summary_.seconds, 1e-9);
    if (summary_.stopSignal) {
      log << "stopped by "
          << (summary_.stopSignal == SIGINT ? "SIGINT" : "SIGTERM")
          << " after step " << summary_.steps
          << (saved_ ? "; checkpoint saved to " + options_.saveDir
                     : " (nothing new saved)")
          << std::endl;
      return;
    }
    pipe_->setRecording(false);
    if (!world()) {
      writeTraceOutputs(pipe_->trace(), options_, summary_, log);
    } else if (options_.recordSteps > 0) {
      const std::vector<std::string> parts = world()->gatherText(
          traceForRoot(pipe_->trace(), *world(), clockOffsetUs_));
      if (world()->rank() == 0)
        writeTraceOutputs(
            mergeTraces(pipe_->trace(), parts), options_, summary_, log);
    }
    if (measureMemory_) {
      summary_.memory = finishMemory(*pipe_, memoryRows_);
      if (world()) {
        summary_.memory = mergeMemory(
            summary_.memory,
            world()->gatherText(memoryForRoot(summary_.memory, *world())));
      }
      printMemory(log, summary_.memory);
    }
    if (!options_.evaluate)
      return;
    evaluateAt(summary_.steps);
    log << "done: " << summary_.steps << " steps in " << std::fixed
        << std::setprecision(1) << summary_.seconds << " s, "
        << std::setprecision(0) << summary_.samplesPerSecond
        << " samples/s, final loss " << std::setprecision(4)
        << summary_.finalLoss << ", eval loss " << summary_.evalLoss;
    if (classification_)
      log << ", eval accuracy " << summary_.evalAccuracy;
    if (summary_.skippedSteps > 0)
      log << ", " << summary_.skippedSteps << " non-finite step(s) skipped";
    if (summary_.rerunSteps > 0)
      log << ", " << summary_.rerunSteps
          << " step(s) run again after a wrong speculative update";
    if (summary_.redoneSteps > 0)
      log << ", " << summary_.redoneSteps
          << " step(s) redone after the last failure";
    log << std::defaultfloat << std::endl;
  }

  const Config config_;
  std::string autoResumeNote_; // declared before options_, which fills it
  TrainOptions options_;
  std::shared_ptr<Communicator> world_;
  std::ostringstream silent_;
  std::ostream* log_ = nullptr;
  bool live_ = false;
  static constexpr double kProgressSeconds = 5.0;
  double lastProgressSeconds_ = 0.0;
  std::string plotLines_; // this run's metrics records, for --plot
  CheckpointIdentity identity_;
  std::unique_ptr<DirectoryLock> saveLock_;
  BuiltModel model_;
  Dataset data_;
  PlanRequest planRequest_; // what plan_ was resolved from
  Plan plan_;
  double tunedStepMs_ = -1.0; // ResolvedPlan::tunedStepMs
  bool measureMemory_ = false;
  // Before pipe_: a posted step's update steps these on the workers, which
  // end when pipe_ does.
  RankOptimizers rankOptimizers_; // with overlapping_ (see startOverlap)
  bool overlapping_ = false;
  int64_t lastStep_ = 0, recordFrom_ = 0, adoptAt_ = 0; // see loop()
  std::unique_ptr<Pipeline> pipe_;
  std::vector<MemoryRow> memoryRows_;
  std::vector<double> stopsSignalled_; // summed with the last step's loss
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  LossFunction lossFn_;
  bool classification_ = false;
  std::unique_ptr<BatchSource> batches_;
  std::vector<TrainSummary::StepSplit> splits_;
  Clock::time_point lastStart_;
  std::ofstream metrics_;
  std::string resumeNote_;
  bool saved_ = false;
  double clockOffsetUs_ = 0.0;
  Clock::time_point start_ = Clock::now();
  TrainSummary summary_;
};

} // namespace

void setStepHook(StepHook hook) {
  stepHook() = std::move(hook);
}

PipelineOptions pipelineOptions(
    const Config& config,
    const BuiltModel& model,
    const Plan& plan,
    const std::shared_ptr<Communicator>& communicator) {
  const auto& p = config.pipeline;
  PipelineOptions options;
  options.devices.clear();
  for (const auto& device : p.devices)
    options.devices.push_back(device.name);
  // The plan carries the schedule, micro-batches, checkpoint mode and
  // threads.
  options.plan = std::make_shared<const Plan>(plan);
  options.seed = config.train.seed;
  options.layerOutputShapes.assign(
      model.shapes.begin() + 1, model.shapes.end());
  options.communicator = communicator;
  options.tiedParameters = model.tiedParameters;
  if (autocasts(config))
    options.autocast = at::kBFloat16;
  options.overlapGradientSync = p.overlapGradSync;
  options.directWeightGradients = p.directWeightGradients;
  options.nccl = p.nccl;
  for (const auto& device : p.devices) {
    if (device.memoryBytes > 0)
      options.receivesAhead = 2 * plan.schedule.ranks;
  }
  return options;
}

TrainSummary train(const Config& config, const TrainOptions& options) {
  // Before tuning, planning or the rendezvous: a bad output path costs no
  // training, and every rank of a launch refuses it alike.
  checkOutputPath("--metrics", options.metricsPath);
  checkOutputPath("--trace", options.tracePath);
  checkOutputPath("--timeline", options.timelinePath);
  checkOutputPath("--report", options.reportPath);
  checkOutputPath("--plot", options.plotPath);
  std::vector<RunInput> inputs = inputsOf(config);
  inputs.push_back({"the config", options.configPath});
  inputs.push_back({"--profile", options.profilePath});
  inputs.push_back({"--save", options.saveDir, RunInput::Kind::kCheckpoint});
  if (options.resumeDir != "auto")
    inputs.push_back(
        {"--resume", options.resumeDir, RunInput::Kind::kCheckpoint});
  refuseOutputsOverInputs(
      {{"--metrics", options.metricsPath},
       {"--trace", options.tracePath},
       {"--timeline", options.timelinePath},
       {"--report", options.reportPath},
       {"--plot", options.plotPath}},
      inputs);
  return TrainingRun(config, options).run();
}

} // namespace tpipe
