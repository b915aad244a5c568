// `tpipe tune` on this machine: calibrate a cost model for the config's job,
// search (src/plan/tune.cpp), and measure candidates by running them.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <thread>

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include "train/parts.h"

namespace tpipe {
namespace {

using Clock = std::chrono::steady_clock;

double msSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start)
      .count();
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

bool onCpu(const Config& config) {
  for (const auto& device : config.pipeline.devices) {
    if (device.name.rfind("cpu", 0) != 0)
      return false;
  }
  return true;
}

int machineCores() {
  return static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
}

// The micro-batch counts the search tries: powers of two up to the batch
// (at most 64), and the sizes they give.
std::vector<int> microBatchCounts(int64_t batch) {
  std::vector<int> counts;
  for (int m = 1; m <= batch && m <= 64; m *= 2)
    counts.push_back(m);
  return counts;
}

int64_t sizeFor(int64_t batch, int microBatches) {
  return (batch + microBatches - 1) / microBatches;
}

// Thread counts the search can give a stage: the cores shared by 1, 2, ...
// stage workers.
std::vector<int> threadCounts(const Config& config) {
  if (!onCpu(config))
    return {1};
  const int cores = machineCores();
  const int most = std::min<int>(cores, config.pipeline.devices.size());
  std::vector<int> counts;
  for (int p = 1; p <= most; ++p) {
    if (std::find(counts.begin(), counts.end(), cores / p) == counts.end())
      counts.push_back(cores / p);
  }
  return counts;
}

// One training step's parts, timed.
struct StepTiming {
  double stepMs = 0.0;     // batch, zero_grad, pipeline, optimizer
  double pipelineMs = 0.0; // Pipeline::trainStep alone
};

// Runs candidates on the config's data from the config's initial weights.
class StepMeter {
 public:
  explicit StepMeter(const Config& config)
      : config_(config),
        shapes_(buildModel(config)),
        data_(loadDataset(config, shapes_)),
        loss_(makeLoss(config.train.loss)) {}

  std::vector<StepTiming> run(const TuneCandidate& c, int warmup, int steps) {
    BuiltModel model = buildModel(config_);
    setBatchNormMicroBatches(model, c.microBatches);
    Pipeline pipe(model.layers, optionsFor(model, c));
    auto optimizer = makeOptimizer(config_.train.optimizer, pipe.parameters());
    BatchSource batches(
        data_,
        config_.train.batchSize,
        config_.data.shuffle,
        config_.train.seed);
    std::vector<StepTiming> timings;
    for (int step = 0; step < warmup + steps; ++step) {
      const auto start = Clock::now();
      auto [x, y] = batches.batch(step);
      optimizer->zero_grad();
      const auto pipeStart = Clock::now();
      pipe.trainStep(x, y, loss_);
      const double pipelineMs = msSince(pipeStart);
      optimizer->step();
      if (step >= warmup)
        timings.push_back({msSince(start), pipelineMs});
    }
    return timings;
  }

  const BuiltModel& model() const {
    return shapes_;
  }

 private:
  PipelineOptions optionsFor(const BuiltModel& model, const TuneCandidate& c) {
    PlanRequest request;
    request.layers = parameterCosts(model.layers);
    for (int r = 0; r < c.ranks; ++r)
      request.devices.push_back({config_.pipeline.devices[r].name});
    request.stages = c.stages;
    request.partition = PartitionMethod::kBalance;
    request.balance = balanceOf(c.boundaries);
    request.schedule = c.schedule;
    request.microBatches = c.microBatches;
    request.virtualStages = c.virtualStages;
    request.checkpoint = c.checkpoint;
    PipelineOptions options;
    options.devices.clear();
    for (const auto& device : request.devices)
      options.devices.push_back(device.name);
    options.plan = std::make_shared<const Plan>(resolvePlan(request));
    options.threadsPerDevice = c.threadsPerStage;
    options.seed = config_.train.seed;
    options.layerOutputShapes.assign(
        model.shapes.begin() + 1, model.shapes.end());
    return options;
  }

  const Config& config_;
  BuiltModel shapes_;
  Dataset data_;
  LossFunction loss_;
};

// The first seconds of a process run large steps slower than the rest
// (the allocator and thread pools are still growing); timing starts after
// a few untimed steps of the whole model.
void warmUp(StepMeter& meter, const TuneOptions& options) {
  if (options.log)
    *options.log << "tune: warming up" << std::endl;
  TuneCandidate whole;
  whole.threadsPerStage = machineCores();
  whole.boundaries = {0, static_cast<int>(meter.model().layers.size())};
  meter.run(whole, 0, 8);
}

// One stage holding every layer: the calibration runs.
TuneCandidate wholeModel(
    const CostModel& model,
    int threads,
    int microBatches,
    ScheduleKind schedule) {
  TuneCandidate c;
  c.threadsPerStage = threads;
  c.microBatches = microBatches;
  c.schedule = schedule;
  c.checkpoint = CheckpointMode::kNever;
  c.boundaries = {0, static_cast<int>(model.layers.size())};
  return c;
}

std::string fixed(double value, int digits) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(digits) << value;
  return out.str();
}

} // namespace

// ---- the cost model -------------------------------------------------------

namespace {

TuneRequest requestFor(const Config& config);

// Every layer at every micro-batch size the search uses, per thread count.
void profileCurves(
    const Config& config,
    const BuiltModel& built,
    const TuneOptions& options,
    CostModel& model,
    std::vector<std::string>& lines) {
  const int64_t batch = config.train.batchSize;
  ProfileOptions profile;
  profile.microBatchSize = batch;
  for (int m : microBatchCounts(batch))
    profile.fitSizes.push_back(sizeFor(batch, m));
  profile.warmup = 1;
  profile.repeats = options.quick ? 3 : 5;
  profile.maxRounds = options.quick ? 2 : 3;
  model.threads = threadCounts(config);
  model.layers.assign(built.layers.size(), LayerModel{});
  double worst = 0.0, noise = 0.0, weighted = 0.0, total = 0.0;
  for (int threads : model.threads) {
    if (options.log)
      *options.log << "tune: profiling " << built.layers.size() << " layers at "
                   << profile.fitSizes.size() << " micro-batch sizes, "
                   << threads << " thread(s)" << std::endl;
    profile.threads = threads;
    const Profile measured = profileModelWith(config, built, profile);
    noise = std::max(noise, measured.noise);
    model.inputBytesPerSample =
        static_cast<double>(measured.inputBytes) / static_cast<double>(batch);
    for (size_t l = 0; l < built.layers.size(); ++l) {
      const LayerProfile& layer = measured.layers[l];
      LayerModel& out = model.layers[l];
      out.name = layer.cost.name;
      out.forward.push_back(layer.forward);
      out.backward.push_back(layer.backward);
      out.paramBytes = layer.cost.paramBytes;
      out.activationBytesPerSample =
          static_cast<double>(layer.cost.activationBytes) / batch;
      out.stashBytesPerSample =
          static_cast<double>(layer.cost.stashBytes) / batch;
      worst = std::max(
          {worst, layer.forward.worstResidual, layer.backward.worstResidual});
      weighted += layer.forward.worstResidual * layer.cost.forwardMs +
          layer.backward.worstResidual * layer.cost.backwardMs;
      total += layer.cost.forwardMs + layer.cost.backwardMs;
    }
  }
  model.noise = noise;
  lines.push_back(
      "size curves: residual " + fixed(100.0 * weighted / total, 1) +
      "% weighted by time, worst " + fixed(100.0 * worst, 1) + "% (over " +
      std::to_string(model.layers.size()) + " layers x " +
      std::to_string(profile.fitSizes.size()) + " sizes x " +
      std::to_string(model.threads.size()) + " thread count(s)); noise " +
      fixed(100.0 * noise, 1) + "%");
}

// The whole model's predicted compute at `microBatches`, from the curves.
double layerSum(
    const CostModel& model,
    int64_t batch,
    int microBatches,
    int threads,
    bool backwardOnly) {
  double total = 0.0;
  for (const auto& cost :
       model.costsAt(static_cast<double>(batch) / microBatches, threads)) {
    total += backwardOnly ? cost.backwardMs : cost.forwardMs + cost.backwardMs;
  }
  return total * microBatches;
}

// The runtime's cost per compute instruction: a one-stage pipeline of one
// tiny layer and many micro-batches is nothing but dispatch.
double instructionCostMs() {
  torch::manual_seed(0);
  LayerList tiny{{"0", torch::nn::AnyModule(torch::nn::Linear(4, 4))}};
  PipelineOptions options;
  options.microBatches = 32;
  options.threadsPerDevice = 1;
  options.checkpoint = CheckpointMode::kNever;
  Pipeline pipe(tiny, options);
  const torch::Tensor x = torch::randn({32, 4}), y = torch::randn({32, 4});
  const LossFunction loss = makeLoss("mse");
  std::vector<double> times;
  for (int step = 0; step < 12; ++step) {
    const auto start = Clock::now();
    pipe.trainStep(x, y, loss);
    if (step >= 2)
      times.push_back(msSince(start));
  }
  return median(times) / (2.0 * options.microBatches);
}

// Stage workers computing at once share memory bandwidth and caches: a
// two-stage 1F1B run, against its prediction with no slowdown, gives the
// factor for every multi-stage plan.
void calibrateConcurrency(
    const Config& config,
    StepMeter& meter,
    const TuneRequest& request,
    int microBatches,
    CostModel& model,
    std::vector<std::string>& lines) {
  const int cores = request.cores;
  if (config.pipeline.devices.size() < 2 || model.layers.size() < 2 ||
      (cores > 0 && cores < 2))
    return;
  TuneCandidate shape;
  shape.ranks = 2;
  shape.threadsPerStage = cores > 0 ? cores / 2 : 1;
  shape.microBatches = microBatches;
  shape.schedule = ScheduleKind::kOneFOneB;
  shape.checkpoint = CheckpointMode::kNever;
  model.concurrentSlowdown = 1.0;
  const TuneCandidate predicted = predictCandidate(model, request, shape);
  if (!predicted.infeasible.empty())
    return;
  std::vector<double> steps;
  for (const auto& timing : meter.run(predicted, 2, 5))
    steps.push_back(timing.stepMs);
  const double measured = median(steps);
  model.concurrentSlowdown = std::clamp(
      (measured - model.stepMs) / (predicted.predictedStepMs - model.stepMs),
      0.5,
      3.0);
  lines.push_back(
      "two stages at once: measured " + fixed(measured, 2) + " ms against " +
      fixed(predicted.predictedStepMs, 2) +
      " ms predicted from layers alone; " + "multi-stage plans scaled by x" +
      fixed(model.concurrentSlowdown, 2));
}

// Scales the curves of one thread count by `factor`.
void scaleCurves(CostModel& model, size_t threadIndex, double factor) {
  for (auto& layer : model.layers) {
    for (double& ms : layer.forward[threadIndex].ms)
      ms *= factor;
    for (double& ms : layer.backward[threadIndex].ms)
      ms *= factor;
  }
}

// GPipe holds every micro-batch's activations where 1F1B holds one: the
// time it loses over the same instructions, per byte more held.
void calibrateHeldBytes(
    const TuneRequest& request,
    int microBatches,
    double extraMs,
    CostModel& model,
    std::vector<std::string>& lines) {
  if (microBatches < 2)
    return;
  TuneCandidate shape;
  shape.threadsPerStage = model.threads.front();
  shape.microBatches = microBatches;
  shape.checkpoint = CheckpointMode::kNever;
  shape.schedule = ScheduleKind::kGpipe;
  const TuneCandidate all = predictCandidate(model, request, shape);
  shape.schedule = ScheduleKind::kOneFOneB;
  const TuneCandidate one = predictCandidate(model, request, shape);
  const double bytes =
      static_cast<double>(all.peakActivationBytes - one.peakActivationBytes);
  if (!all.infeasible.empty() || !one.infeasible.empty() || bytes <= 0)
    return;
  model.heldByteMs = std::max(0.0, extraMs) / bytes;
  lines.push_back(
      "held activations: GPipe ran " + fixed(extraMs, 2) + " ms slower than " +
      "1F1B on one stage at " + std::to_string(microBatches) +
      " micro-batches, holding " + fixed(bytes / (1 << 20), 1) + " MiB more: " +
      fixed(model.heldByteMs * (1 << 20), 3) + " ms per MiB held");
}

// One stage at micro-batch counts M: pipeline ms = scale x (its layers'
// curves) + 2 M x instruction, least squares relative to each run. Less
// dispatch than the bare runtime's is not believed: then the scale alone is
// fitted on top of the bare dispatch.
struct PipelineFit {
  double scale = 1.0, instructionMs = 0.0;
};

PipelineFit fitPipeline(
    const std::vector<int>& counts,
    const std::vector<double>& measured,
    const std::vector<double>& layers,
    double leastInstructionMs) {
  double aa = 0, ab = 0, bb = 0, ay = 0, by = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    const double a = layers[i] / measured[i];
    const double b = 2.0 * counts[i] / measured[i];
    aa += a * a;
    ab += a * b;
    bb += b * b;
    ay += a;
    by += b;
  }
  PipelineFit fit;
  const double det = aa * bb - ab * ab;
  if (det > 0) {
    fit.scale = (ay * bb - by * ab) / det;
    fit.instructionMs = (aa * by - ab * ay) / det;
  }
  if (det <= 0 || fit.instructionMs < leastInstructionMs || !(fit.scale > 0)) {
    fit.instructionMs = leastInstructionMs;
    double num = 0, den = 0;
    for (size_t i = 0; i < counts.size(); ++i) {
      const double a = layers[i] / measured[i];
      num += a * (1.0 - 2.0 * counts[i] * leastInstructionMs / measured[i]);
      den += a * a;
    }
    fit.scale = num / den;
  }
  fit.scale = std::clamp(fit.scale, 0.25, 4.0);
  return fit;
}

void describeRuntime(
    const CostModel& model,
    double scale,
    double o,
    int threads,
    int many,
    int most,
    std::vector<std::string>& lines) {
  lines.push_back(
      "runtime: " + fixed(1000.0 * model.instructionMs, 1) +
      " us per compute instruction (" + fixed(1000.0 * o, 1) + " with " +
      std::to_string(threads) + " threads), " + fixed(model.stepMs, 2) +
      " ms per step (optimizer, batch), split backward x" +
      fixed(model.splitBackward, 2) + "; one stage with " +
      std::to_string(threads) + " thread(s) runs at x" + fixed(scale, 2) +
      " of its layers profiled alone (fitted at 1, " + std::to_string(many) +
      " and " + std::to_string(most) + " micro-batches)");
}

// The runtime's own costs and the profile's scale inside a pipeline, from
// real steps of one stage with every core: at 1, 8 and the most
// micro-batches, the curves' scale and the cost per compute instruction
// (tiny micro-batches pay it most); the per-step cost of optimizer and
// batch; ZB-H1's split backward; and, with two or more stage workers, the
// slowdown of stages computing at once.
void calibrateRuntime(
    const Config& config,
    StepMeter& meter,
    const TuneOptions& options,
    const TuneRequest& request,
    CostModel& model,
    std::vector<std::string>& lines) {
  const int64_t batch = config.train.batchSize;
  const int threads = model.threads.front();
  const int most = microBatchCounts(batch).back();
  const int many = std::min(8, most);
  if (options.log)
    *options.log << "tune: timing real steps to calibrate" << std::endl;
  auto measure = [&](int m, ScheduleKind kind, double* step) {
    std::vector<double> steps, pipes;
    for (const auto& t : meter.run(wholeModel(model, threads, m, kind), 2, 4)) {
      steps.push_back(t.stepMs);
      pipes.push_back(t.pipelineMs);
    }
    if (step)
      *step = median(steps);
    return median(pipes);
  };
  double step = 0.0;
  std::vector<int> counts{1};
  std::vector<double> measured{measure(1, ScheduleKind::kOneFOneB, &step)};
  for (int m : {many, most}) {
    if (m > counts.back()) {
      counts.push_back(m);
      measured.push_back(measure(m, ScheduleKind::kOneFOneB, nullptr));
    }
  }
  const double split = measure(many, ScheduleKind::kZeroBubbleH1, nullptr);
  // Noise only ever adds time: the smaller of two differences is the one
  // believed.
  const double held = std::min(
      measure(many, ScheduleKind::kGpipe, nullptr) -
          measured[counts.size() > 1],
      measure(many, ScheduleKind::kGpipe, nullptr) -
          measure(many, ScheduleKind::kOneFOneB, nullptr));
  const size_t at = counts.size() > 1 ? 1 : 0;
  calibrateHeldBytes(request, many, held, model, lines);
  std::vector<double> layers, computed = measured;
  for (size_t i = 0; i < counts.size(); ++i)
    layers.push_back(layerSum(model, batch, counts[i], threads, false));
  model.instructionMs = instructionCostMs();
  const PipelineFit fit =
      fitPipeline(counts, computed, layers, model.instructionMs);
  model.threadInstructionMs.assign(model.threads.size(), model.instructionMs);
  model.threadInstructionMs[0] = fit.instructionMs;
  model.stepMs = std::max(0.0, step - measured[0]);
  scaleCurves(model, 0, fit.scale);
  const double o = fit.instructionMs;
  const double backward = layerSum(model, batch, counts[at], threads, true);
  model.splitBackward = std::clamp(
      1.0 + (split - measured[at] - counts[at] * o) / backward, 1.0, 2.0);
  describeRuntime(model, fit.scale, o, threads, many, most, lines);
  calibrateConcurrency(config, meter, request, many, model, lines);
}

} // namespace

// ---- searching and measuring --------------------------------------------

namespace {

TuneRequest requestFor(const Config& config) {
  TuneRequest request;
  request.batchSize = config.train.batchSize;
  for (const auto& device : config.pipeline.devices)
    request.devices.push_back({device.name, device.speed, device.memoryBytes});
  request.cores = onCpu(config) ? machineCores() : 0;
  request.microBatches = microBatchCounts(config.train.batchSize);
  // "auto" rebuilds itself from measured stage times while training; the
  // tuner ranks the fixed schedules.
  request.schedules = {
      ScheduleKind::kGpipe,
      ScheduleKind::kOneFOneB,
      ScheduleKind::kInterleaved,
      ScheduleKind::kZeroBubbleH1,
      ScheduleKind::kZeroBubbleH2,
      ScheduleKind::kZeroBubbleV};
  const auto& o = config.train.optimizer;
  request.optimizerFactor = optimizerStateFactor(o.type, o.momentum);
  return request;
}

// With measurements, the fastest measured becomes the choice.
void chooseMeasured(TuneResult& result) {
  size_t best = result.choice;
  for (size_t i = 0; i < result.candidates.size(); ++i) {
    const auto& c = result.candidates[i];
    if (c.measuredStepMs >= 0 &&
        (result.candidates[best].measuredStepMs < 0 ||
         c.measuredStepMs < result.candidates[best].measuredStepMs))
      best = i;
  }
  if (best != result.choice) {
    result.notes.push_back(
        "measured: " + result.candidates[best].label() + " ran fastest (" +
        fixed(result.candidates[best].measuredStepMs, 2) +
        " ms per step) and is chosen over the predicted " +
        result.candidates[result.choice].label() + " (" +
        fixed(result.candidates[result.choice].measuredStepMs, 2) + " ms)");
    result.choice = best;
  }
}

} // namespace

std::vector<double> measureCandidates(
    const Config& config,
    const std::vector<TuneCandidate>& candidates,
    int steps,
    int rounds,
    std::ostream* log) {
  StepMeter meter(config);
  std::vector<std::vector<double>> samples(candidates.size());
  for (int round = 0; round < rounds; ++round) {
    for (size_t i = 0; i < candidates.size(); ++i) {
      if (log)
        *log << "tune: measuring " << candidates[i].label() << " (round "
             << round + 1 << "/" << rounds << ")" << std::endl;
      for (const auto& timing : meter.run(candidates[i], 2, steps))
        samples[i].push_back(timing.stepMs);
    }
  }
  std::vector<double> medians;
  for (const auto& values : samples)
    medians.push_back(median(values));
  return medians;
}

TuneOutcome tuneConfig(const Config& config, const TuneOptions& options) {
  TuneOutcome outcome;
  StepMeter meter(config);
  outcome.model.source = "measured now on this machine";
  warmUp(meter, options);
  profileCurves(
      config, meter.model(), options, outcome.model, outcome.calibration);
  const TuneRequest request = requestFor(config);
  calibrateRuntime(
      config, meter, options, request, outcome.model, outcome.calibration);
  outcome.result = tunePlans(outcome.model, request);
  if (!options.measure)
    return outcome;
  std::vector<TuneCandidate> top;
  const int count = std::min(options.top, outcome.result.feasible());
  for (int i = 0; i < count; ++i)
    top.push_back(outcome.result.candidates[static_cast<size_t>(i)]);
  const std::vector<double> measured = measureCandidates(
      config, top, options.measureSteps, options.measureRounds, options.log);
  for (int i = 0; i < count; ++i)
    outcome.result.candidates[static_cast<size_t>(i)].measuredStepMs =
        measured[static_cast<size_t>(i)];
  chooseMeasured(outcome.result);
  return outcome;
}

// ---- writing the choice -------------------------------------------------

Config configWithPlan(Config config, const TuneCandidate& c) {
  auto& p = config.pipeline;
  p.devices.resize(static_cast<size_t>(c.ranks));
  p.stages = c.stages;
  p.microBatches = c.microBatches;
  p.schedule = c.schedule;
  p.virtualStages = c.virtualStages;
  p.checkpoint = c.checkpoint;
  p.partition = PartitionMethod::kBalance;
  p.balance = balanceOf(c.boundaries);
  p.threadsPerDevice = c.threadsPerStage;
  p.dataParallel = c.dataParallel;
  p.autoTune = false;
  return config;
}

nlohmann::json configWithPlan(nlohmann::json config, const TuneCandidate& c) {
  nlohmann::json& pipeline = config["pipeline"];
  nlohmann::json devices = nlohmann::json::array();
  for (int r = 0; r < c.ranks; ++r)
    devices.push_back(pipeline["devices"][static_cast<size_t>(r)]);
  pipeline["devices"] = devices;
  pipeline.erase("auto");
  pipeline["stages"] = c.stages;
  pipeline["micro_batches"] = c.microBatches;
  pipeline["schedule"] = scheduleKindName(c.schedule);
  pipeline["virtual_stages"] = c.virtualStages;
  pipeline["checkpoint"] = checkpointModeName(c.checkpoint);
  pipeline["partition"] = "balance";
  pipeline["balance"] = balanceOf(c.boundaries);
  pipeline["threads_per_device"] = c.threadsPerStage;
  if (c.dataParallel > 1)
    pipeline["data_parallel"] = c.dataParallel;
  return config;
}

} // namespace tpipe
