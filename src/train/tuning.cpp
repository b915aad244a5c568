// `tpipe tune` on this machine: calibrate a cost model for the config's job,
// search (src/plan/tune.cpp), and measure candidates by running them.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <functional>
#include <iomanip>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>

#include <ATen/Parallel.h>
#include <nlohmann/json.hpp>
#include <torch/nn/modules/linear.h>
#include <torch/types.h>

#include "train/machine_load.h"
#include "train/parts.h"
#include "statistics.h"

namespace tpipe {
namespace {

using Clock = std::chrono::steady_clock;

double msSince(Clock::time_point start) {
  return std::chrono::duration<double, std::milli>(Clock::now() - start)
      .count();
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
  // Cores other processes wanted meanwhile; negative where unknown.
  double othersCores = -1.0;
};

// One candidate built and ready to step: its pipeline, optimizer and batches
// live as long as it does, so several can take turns, step by step.
class PlanRun {
 public:
  PlanRun(
      const Config& config,
      const Dataset& data,
      PipelineOptions options,
      int microBatches)
      : model_(buildModel(config)),
        batches_(
            data,
            config.train.batchSize,
            config.data.shuffle,
            config.train.seed) {
    setBatchNormMicroBatches(model_, microBatches);
    pipe_ = std::make_unique<Pipeline>(model_.layers, std::move(options));
    optimizer_ = makeOptimizer(config.train.optimizer, pipe_->parameters());
    if (config.pipeline.overlapSteps && pipe_->canOverlapSteps()) {
      rankOptimizers_ = makeRankOptimizers(config.train.optimizer, *pipe_);
      update_.apply = [this](int rank) { rankOptimizers_[rank]->step(); };
    }
  }

  // `count` steps in a row as training runs them, timed together: the mean
  // step. With overlapping steps training posts each step before the one
  // ahead of it finishes, so the stream starts with two posted, is timed
  // from the first's finish, posts one and finishes one `count` times, and
  // finishes the last one posted untimed. Timing from the first post, as
  // this once did, added half a pipeline fill that overlapping hides (a
  // two-stage dualpipe measured 24.8 ms here and trained at 18.6); timing
  // to the last finish added half a drain, which training hides behind the
  // next step's fill.
  StepTiming steps(const LossFunction& loss, int count) {
    if (update_.apply) {
      auto post = [&] {
        auto [x, y] = batches_.batch(step_++);
        pipe_->postStep(x, y, loss, update_);
      };
      post();
      post();
      pipe_->finishStep();
      const auto start = Clock::now();
      for (int n = 0; n < count; ++n) {
        post();
        pipe_->finishStep();
      }
      const double ms = msSince(start) / count;
      pipe_->finishStep();
      return {ms, ms};
    }
    const auto start = Clock::now();
    double pipelineMs = 0.0;
    for (int n = 0; n < count; ++n) {
      auto [x, y] = batches_.batch(step_++);
      optimizer_->zero_grad();
      const auto pipeStart = Clock::now();
      pipe_->trainStep(x, y, loss);
      pipelineMs += msSince(pipeStart);
      optimizer_->step();
    }
    return {msSince(start) / count, pipelineMs / count};
  }

 private:
  BuiltModel model_;
  BatchSource batches_;
  std::unique_ptr<Pipeline> pipe_;
  std::unique_ptr<torch::optim::Optimizer> optimizer_;
  RankOptimizers rankOptimizers_; // with overlapping steps
  Pipeline::Update update_;
  int64_t step_ = 0;
};

// How candidates take turns on this machine (StepMeter::interleave).
struct Turns {
  int warmup = 2; // untimed steps each, once built
  int rounds = 1;
  int stream = 1; // steps in a row a turn, timed together: their mean
  bool warmEachTurn = false; // an untimed step opens each turn
};

// Rounds past Turns::rounds, while `wanted` says so, up to `maxRounds` in
// all.
struct MoreRounds {
  std::function<bool(const std::vector<std::vector<StepTiming>>&)> wanted;
  int maxRounds = 0;
};

// Steps each candidate runs in a row per turn when plans are compared.
constexpr int kStepsPerTurn = 4;

// How long plans compared in turn are measured when a neighbour's bursts
// slow some of the rounds: at least long enough that the share of the time
// they slowed is near the share a training run meets (bursts and pauses of
// 0.1-0.9 s each: about a second a cycle, the share within 0.05 after 10),
// then on while a plan's mean over its rounds is known no closer than
// kBurstAveragingError, up to kBurstAveragingMostMs. Ten seconds of Fashion
// CNN rounds left the one-stage plan's figure 8% uncertain, and five busy
// tunes predicted it 11.7-19.6 ms.
constexpr double kBurstAveragingMs = 10000.0;
constexpr double kBurstAveragingMostMs = 30000.0;
constexpr double kBurstAveragingError = 0.04;

// How long the choice and its rivals are measured alone in turn beside a
// neighbour (measureAFinal): until their figures settle what the final
// decides (aFinalIsSettled); at tens of milliseconds a turn, 5 s are some
// hundreds of turns. At least 8 rounds whatever they take: on a 2 GHz
// AVX2 machine a reference job's round of two plans took 5 s, and 5 rounds
// left zb-v's figure uncertain by 4.2%. At most 40 s: 15 s had held the
// reference job's duels of two to their 8 rounds, and 8 rounds of its three
// finalists take about 40 s (their figures known within 0.5-3.5%).
constexpr int kFinalLeastRounds = 8;
constexpr double kFinalLeastMs = 5000.0;
constexpr double kFinalMostMs = 40000.0;

void stopIfAsked(const std::function<bool()>& stopRequested) {
  if (stopRequested && stopRequested())
    throw TuneStopped();
}

// Runs candidates on the config's data from the config's initial weights.
class StepMeter {
 public:
  explicit StepMeter(
      const Config& config,
      std::function<bool()> stopRequested = {})
      : config_(config),
        shapes_(buildModel(config)),
        data_(loadDataset(config, shapes_)),
        loss_(makeLoss(config.train.loss)),
        stopRequested_(std::move(stopRequested)) {}

  std::unique_ptr<PlanRun> start(const TuneCandidate& c) {
    return std::make_unique<PlanRun>(
        config_, data_, optionsFor(shapes_, c), c.microBatches);
  }

  StepTiming step(PlanRun& run, int count = 1) {
    stopIfAsked(stopRequested_);
    return run.steps(loss_, count);
  }

  // A timed turn, with the cores other processes wanted meanwhile.
  StepTiming turn(PlanRun& run, int count) {
    const CpuClock before = readCpuClock();
    StepTiming timing = step(run, count);
    timing.othersCores = othersCoresBetween(before, readCpuClock());
    return timing;
  }

  // Every candidate built once and given `turns.warmup` untimed steps,
  // then `turns.rounds` rounds in which each takes its turn: a machine that
  // gets busier or quieter meanwhile slows them all alike.
  //
  // Within a round the plans that run on this thread go first, then those
  // on stage workers, and the first of the others takes one untimed step:
  // after a step on this thread with several intra-op threads, OpenMP's
  // pool spins on for a while, and a multi-stage plan timed right after it
  // shared the cores with the spin (its steps measured up to a third
  // slower than in a process of its own).
  std::vector<std::vector<StepTiming>> interleave(
      const std::vector<TuneCandidate>& candidates,
      const Turns& turns,
      std::ostream* log = nullptr,
      const MoreRounds& more = {}) {
    std::vector<std::unique_ptr<PlanRun>> runs;
    for (const auto& c : candidates) {
      runs.push_back(start(c));
      for (int i = 0; i < turns.warmup; ++i)
        step(*runs.back());
    }
    auto onThisThread = [&](size_t i) { return candidates[i].devices() == 1; };
    std::vector<size_t> order(candidates.size());
    for (size_t i = 0; i < order.size(); ++i)
      order[i] = i;
    const auto others =
        std::stable_partition(order.begin(), order.end(), onThisThread);
    std::vector<std::vector<StepTiming>> timings(candidates.size());
    for (int round = 0; round < turns.rounds ||
         (round < more.maxRounds && more.wanted && more.wanted(timings));
         ++round) {
      if (log && turns.rounds > 1)
        *log << "tune: measuring " << candidates.size()
             << " plans in turn, round " << round + 1 << "/"
             << std::max(turns.rounds, round + 1) << std::endl;
      // Each group turned by one place a round: a plan's step runs faster
      // or slower for the plan before it, so no plan keeps one neighbour
      // (with a fixed order the round's first plan measured 3% above
      // training, the other one-stage plans 6-17%).
      if (round > 0) {
        for (auto [first, last] :
             {std::pair(order.begin(), others),
              std::pair(others, order.end())}) {
          if (last - first > 1)
            std::rotate(first, first + 1, last);
        }
      }
      for (size_t k = 0; k < order.size(); ++k) {
        const size_t i = order[k];
        if (turns.warmEachTurn ||
            (k > 0 && onThisThread(order[k - 1]) && !onThisThread(i)))
          step(*runs[i]);
        timings[i].push_back(turn(*runs[i], turns.stream));
      }
    }
    return timings;
  }

  const BuiltModel& model() const {
    return shapes_;
  }

 private:
  // A candidate runs as training would run it: its plan (the candidate's
  // boundaries, schedule and threads) through the trainer's options.
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
    request.threadsPerDevice = c.threadsPerStage;
    return pipelineOptions(config_, model, resolvePlan(request), nullptr);
  }

  const Config& config_;
  BuiltModel shapes_;
  Dataset data_;
  LossFunction loss_;
  std::function<bool()> stopRequested_;
};

std::vector<double> stepTimes(const std::vector<StepTiming>& timings) {
  std::vector<double> ms;
  for (const auto& t : timings)
    ms.push_back(t.stepMs);
  return ms;
}

// The first seconds of a process run large steps slower than the rest (the
// allocator and thread pools are still growing, caches and clocks are
// cold): whole-model steps until they stop getting faster (the median of the
// last four no lower than 0.98 of the four before), at most 40 steps or 5 s.
void warmUp(StepMeter& meter, const TuneOptions& options) {
  if (options.log)
    *options.log << "tune: warming up" << std::endl;
  TuneCandidate whole;
  whole.threadsPerStage = machineCores();
  whole.boundaries = {0, static_cast<int>(meter.model().layers.size())};
  auto run = meter.start(whole);
  std::vector<double> ms;
  const auto began = Clock::now();
  for (int step = 0; step < 40 && msSince(began) < 5000.0; ++step) {
    ms.push_back(meter.step(*run).stepMs);
    if (ms.size() >= 8) {
      const auto end = ms.end();
      if (median({end - 4, end}) >= 0.98 * median({end - 8, end - 4}))
        break;
    }
  }
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
  // Quick tunes profile as fully as the others. At 3 repeats and 2 rounds
  // (the quick profile this replaced) the Fashion CNN's size curves missed
  // their own medians by 95-252% weighted by time (12-14% at 5 and 3), and
  // the calibration made up for it with 290-570 us per instruction: one
  // stage at 64 micro-batches was predicted at 1.5-2x its measured 60 ms.
  // 3 x 3 and 5 x 2 missed as far. The cost: 1-5 s more.
  profile.warmup = 1;
  profile.repeats = 5;
  profile.maxRounds = 3;
  // A stop ends the tune within one layer's measurement, not after every
  // layer at every size (seconds on a busy machine).
  profile.beforeEachLayer = [&] { stopIfAsked(options.stopRequested); };
  model.threads = threadCounts(config);
  model.layers.assign(built.layers.size(), LayerModel{});
  double worst = 0.0, noise = 0.0, weighted = 0.0, total = 0.0;
  for (int threads : model.threads) {
    stopIfAsked(options.stopRequested);
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
      out.weightGradientInPlace =
          layer.cost.weightGradientInPlace && !autocasts(config);
      worst = std::max(
          {worst, layer.forward.worstResidual, layer.backward.worstResidual});
      weighted += layer.forward.worstResidual * layer.cost.forwardMs +
          layer.backward.worstResidual * layer.cost.backwardMs;
      total += layer.cost.forwardMs + layer.cost.backwardMs;
    }
  }
  lines.push_back(
      "size curves: residual " + fixed(100.0 * weighted / total, 1) +
      "% weighted by time, worst " + fixed(100.0 * worst, 1) + "% (over " +
      std::to_string(model.layers.size()) + " layers x " +
      std::to_string(profile.fitSizes.size()) + " sizes x " +
      std::to_string(model.threads.size()) +
      " thread count(s)); worst layer noise " + fixed(100.0 * noise, 1) + "%");
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

// The runtime's cost per compute instruction: one device running two tiny
// layers as one stage and as two (interleaved), in turn, differ by one
// forward and one backward per micro-batch and nothing else. Timing the
// one-stage run alone and dividing by its instructions (as this did) also
// charged every instruction the tiny layers, the loss and the micro-batch's
// slicing: 21-31 us against the 4-7 us an added stage costs here, which
// over-predicted plans of many stages and micro-batches, V shapes most
// (their worst error about their device count's median, 20 Fashion plans
// in turn: 34-47% before, 17-19% after). The layers' own costs are the
// curves'; what a micro-batch costs beyond them, the calibrated scales'.
double instructionCostMs() {
  torch::manual_seed(0);
  LayerList tiny{
      {"0", torch::nn::AnyModule(torch::nn::Linear(4, 4))},
      {"1", torch::nn::AnyModule(torch::nn::Linear(4, 4))}};
  const int microBatches = 32;
  auto build = [&](int stages) {
    PipelineOptions options;
    options.microBatches = microBatches;
    options.threadsPerDevice = 1;
    options.checkpoint = CheckpointMode::kNever;
    options.virtualStages = stages;
    options.stages = stages;
    options.balance =
        stages == 1 ? std::vector<int>{2} : std::vector<int>{1, 1};
    options.schedule =
        stages == 1 ? ScheduleKind::kOneFOneB : ScheduleKind::kInterleaved;
    return std::make_unique<Pipeline>(tiny, options);
  };
  const auto one = build(1), two = build(2);
  const torch::Tensor x = torch::randn({microBatches, 4}),
                      y = torch::randn({microBatches, 4});
  const LossFunction loss = makeLoss("mse");
  std::vector<double> added;
  for (int round = 0; round < 24; ++round) {
    const auto start = Clock::now();
    one->trainStep(x, y, loss);
    const double oneMs = msSince(start);
    const auto next = Clock::now();
    two->trainStep(x, y, loss);
    if (round >= 4)
      added.push_back(msSince(next) - oneMs);
  }
  return std::max(0.001, median(added) / (2.0 * microBatches));
}

// Scales the curves of one thread count by a factor per micro-batch size,
// given at `sizes` (ascending) and interpolated in log size between them
// (the nearest beyond them): each calibrated size then predicts what it
// measured.
void scaleCurvesBySize(
    CostModel& model,
    size_t threadIndex,
    const std::vector<double>& sizes,
    const std::vector<double>& factors) {
  auto factorAt = [&](double size) {
    if (size <= sizes.front())
      return factors.front();
    for (size_t i = 1; i < sizes.size(); ++i) {
      if (size <= sizes[i]) {
        const double t =
            std::log(size / sizes[i - 1]) / std::log(sizes[i] / sizes[i - 1]);
        return factors[i - 1] + t * (factors[i] - factors[i - 1]);
      }
    }
    return factors.back();
  };
  for (auto& layer : model.layers) {
    for (SizeCurve* curve :
         {&layer.forward[threadIndex], &layer.backward[threadIndex]}) {
      for (size_t k = 0; k < curve->sizes.size(); ++k)
        curve->ms[k] *= factorAt(curve->sizes[k]);
    }
  }
}

// Several stage workers: two-stage 1F1B runs at a few micro-batches (few,
// `many` and the most), against their predictions with the layers as
// profiled alone, give the slowdown of stages computing at once on shared
// memory bandwidth and caches (every multi-stage plan: the median), and
// correct the curves of the stages' thread count at each of those sizes,
// as the one-stage runs correct theirs: a curve profiled alone in a few
// repeats misjudged two-stage plans by up to a quarter at one micro-batch
// size and not at another. Where the config has more devices than the
// machine has cores, twice as many one-thread stages as cores (1F1B, 4
// micro-batches per stage) give what oversubscription costs beyond the
// simulation's fair sharing of the cores: a worker woken for its next pass
// waits for a core among workers evicting its caches, charged per pass it
// is woken for. Without it plans of 4 stages on 2 cores predicted 15-35%
// fast at 16-64 micro-batches. All run in the same rounds, so a machine
// that slows between them moves the slowdown, not the charge.
void calibrateConcurrency(
    const Config& config,
    StepMeter& meter,
    const TuneRequest& request,
    int microBatches,
    CostModel& model,
    std::vector<std::string>& lines) {
  const int cores = request.cores;
  const int devices = static_cast<int>(config.pipeline.devices.size());
  const int layers = static_cast<int>(model.layers.size());
  if (devices < 2 || layers < 2 || (cores > 0 && cores < 2))
    return;
  model.concurrentSlowdown = 1.0;
  model.sharedWakeupMs = 0.0;
  const std::vector<int> batchCounts = microBatchCounts(config.train.batchSize);
  std::vector<int> counts;
  for (int m : batchCounts) {
    if (m >= 2) {
      counts.push_back(m);
      break;
    }
  }
  for (int m : {microBatches, batchCounts.back()}) {
    if (counts.empty() || m > counts.back())
      counts.push_back(m);
  }
  TuneCandidate two;
  two.ranks = 2;
  two.threadsPerStage = cores > 0 ? cores / 2 : 1;
  two.schedule = ScheduleKind::kOneFOneB;
  two.checkpoint = CheckpointMode::kNever;
  std::vector<TuneCandidate> runs;
  for (int m : counts) {
    two.microBatches = m;
    const TuneCandidate predicted = predictCandidate(model, request, two);
    if (predicted.infeasible.empty())
      runs.push_back(predicted);
  }
  if (runs.empty())
    return;
  const size_t pairs = runs.size();
  TuneCandidate shared = two;
  shared.ranks = std::min({2 * cores, devices, layers});
  shared.threadsPerStage = 1;
  shared.microBatches = 0;
  for (int m : batchCounts) {
    if (m <= 4 * shared.ranks)
      shared.microBatches = m;
  }
  if (cores > 0 && shared.ranks > cores &&
      shared.microBatches >= shared.ranks) {
    runs.push_back(predictCandidate(model, request, shared));
    if (!runs.back().infeasible.empty())
      runs.pop_back();
  }
  // Streams of steps, as plans are compared: two stages post each step
  // before the one ahead finishes, and a single step timed from one finish
  // to the next can find the next one done already (a two-stage run of 2
  // micro-batches measured 0.14 ms where its streams take 0.3, and no
  // curve could predict it: 26% off).
  std::vector<double> measured;
  for (const auto& timings : meter.interleave(runs, Turns{2, 4, kStepsPerTurn}))
    measured.push_back(lowerQuartile(stepTimes(timings)));
  // The same statistic as the one-stage calibration the prediction rests on.
  auto ratioAt = [&](size_t i) {
    const double predicted =
        predictCandidate(model, request, runs[i]).predictedStepMs;
    return std::clamp(
        (measured[i] - model.stepMs) / (predicted - model.stepMs), 0.5, 2.0);
  };
  const std::vector<int>& threads = model.threads;
  const auto found =
      std::find(threads.begin(), threads.end(), two.threadsPerStage);
  const size_t threadIndex = static_cast<size_t>(found - threads.begin());
  // The one-stage runs calibrated the first thread count's curves, which
  // one-stage plans use too: those only take the common slowdown.
  const bool ownCurves = found != threads.end() && threadIndex > 0;
  // Per run (ascending micro-batches) its factor so far; the curves take
  // them by size, ascending: the run of the most micro-batches first.
  std::vector<double> sizes, total(pairs, 1.0);
  for (size_t i = pairs; i-- > 0;)
    sizes.push_back(
        static_cast<double>(config.train.batchSize) / runs[i].microBatches);
  // The prediction is not linear in the curves (instructions and held
  // activations are not scaled): a few rounds of correction.
  for (int round = 0; round < (ownCurves ? 3 : 1); ++round) {
    std::vector<double> bySize(pairs);
    for (size_t i = 0; i < pairs; ++i) {
      const double ratio = ratioAt(i);
      total[i] *= ratio;
      bySize[pairs - 1 - i] = ratio;
    }
    if (ownCurves)
      scaleCurvesBySize(model, threadIndex, sizes, bySize);
  }
  // Unclamped: the curves keep total / slowdown, so a plan the calibration
  // ran predicts what it ran (each factor is bounded by its rounds).
  model.concurrentSlowdown = median(total);
  if (ownCurves)
    scaleCurvesBySize(
        model, threadIndex, {1.0}, {1.0 / model.concurrentSlowdown});
  std::string at, scaled, fits;
  double worst = 0.0;
  for (size_t i = 0; i < pairs; ++i) {
    const double predicted =
        predictCandidate(model, request, runs[i]).predictedStepMs;
    worst = std::max(worst, std::abs(predicted / measured[i] - 1.0));
    const char* separator = i == 0 ? "" : ", ";
    at += separator + fixed(measured[i], 2);
    fits += separator + std::to_string(runs[i].microBatches);
    scaled += separator + fixed(total[i] / model.concurrentSlowdown, 2);
  }
  lines.push_back(
      "two stages at once: measured " + at + " ms at " + fits +
      " micro-batches; multi-stage plans scaled by x" +
      fixed(model.concurrentSlowdown, 2) +
      (ownCurves ? ", " + std::to_string(two.threadsPerStage) +
               "-thread curves by x" + scaled + " at those sizes"
                 : std::string()) +
      "; each predicts its own run within " + fixed(100.0 * worst, 1) + "%");
  if (runs.size() == pairs)
    return;
  const size_t last = runs.size() - 1;
  // The prediction grows with the charge, though not in proportion (the
  // critical path moves): bisected within 0-2 ms.
  auto predicted = [&](double chargeMs) {
    model.sharedWakeupMs = chargeMs;
    return predictCandidate(model, request, runs[last]).predictedStepMs;
  };
  const double fair = predicted(0.0);
  double low = 0.0, high = 2.0;
  if (predicted(high) <= measured[last]) {
    low = high;
  } else if (fair < measured[last]) {
    for (int step = 0; step < 20; ++step) {
      const double middle = (low + high) / 2.0;
      (predicted(middle) < measured[last] ? low : high) = middle;
    }
  }
  model.sharedWakeupMs = low;
  lines.push_back(
      std::to_string(shared.ranks) + " stages on " + std::to_string(cores) +
      " cores: measured " + fixed(measured[last], 2) + " ms against " +
      fixed(fair, 2) + " ms predicted with the cores shared fairly; " +
      fixed(1000.0 * model.sharedWakeupMs, 1) +
      " us more per pass a worker is woken for, where stages outnumber "
      "cores");
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
  std::vector<int> counts{1};
  for (int m : {many, most}) {
    if (m > counts.back())
      counts.push_back(m);
  }
  std::vector<TuneCandidate> runs;
  for (int m : counts)
    runs.push_back(wholeModel(model, threads, m, ScheduleKind::kOneFOneB));
  const size_t split = runs.size(), fillDrain = runs.size() + 1;
  runs.push_back(wholeModel(model, threads, many, ScheduleKind::kZeroBubbleH1));
  runs.push_back(wholeModel(model, threads, many, ScheduleKind::kGpipe));
  const auto timings = meter.interleave(runs, Turns{2, options.quick ? 6 : 10});
  std::vector<double> measured, spreads;
  for (const auto& t : timings) {
    std::vector<double> pipes;
    for (const auto& one : t)
      pipes.push_back(one.pipelineMs);
    measured.push_back(lowerQuartile(pipes));
    spreads.push_back(relativeSpread(stepTimes(t)));
  }
  const double step = lowerQuartile(stepTimes(timings.front()));
  const size_t at = counts.size() > 1 ? 1 : 0; // `many` micro-batches
  // GPipe's extra time over 1F1B is believed only beyond twice the noise
  // of a median of this many steps: a busy second would otherwise charge
  // every plan for the activations it holds.
  const double heldNoise = 2.0 * median(spreads) * measured[at] /
      std::sqrt(static_cast<double>(timings[at].size()));
  const double held = measured[fillDrain] - measured[at];
  calibrateHeldBytes(
      request, many, held > heldNoise ? held : 0.0, model, lines);
  std::vector<double> layers;
  for (int m : counts)
    layers.push_back(layerSum(model, batch, m, threads, false));
  model.instructionMs = instructionCostMs();
  const std::vector<double> oneFOneB(
      measured.begin(), measured.begin() + static_cast<long>(counts.size()));
  const PipelineFit fit =
      fitPipeline(counts, oneFOneB, layers, model.instructionMs);
  model.threadInstructionMs.assign(model.threads.size(), model.instructionMs);
  model.threadInstructionMs[0] = fit.instructionMs;
  model.stepMs = std::max(0.0, step - measured[0]);
  const double o = fit.instructionMs;
  // The fit's scale, corrected at each calibrated count to what it measured.
  std::vector<double> sizes, factors;
  for (size_t i = counts.size(); i-- > 0;) {
    sizes.push_back(static_cast<double>(batch) / counts[i]);
    factors.push_back(std::clamp(
        (oneFOneB[i] - 2.0 * counts[i] * o) / layers[i],
        0.5 * fit.scale,
        2.0 * fit.scale));
  }
  scaleCurvesBySize(model, 0, sizes, factors);
  const double backward = layerSum(model, batch, counts[at], threads, true);
  model.splitBackward = std::clamp(
      1.0 + (measured[split] - measured[at] - counts[at] * o) / backward,
      1.0,
      2.0);
  // What "within noise" means for predictions: how much real steps of one
  // plan vary here and now, not the profile's worst layer.
  model.noise = median(spreads);
  describeRuntime(model, fit.scale, o, threads, many, most, lines);
  lines.push_back(
      "noise: repeated steps of one plan vary by " +
      fixed(100.0 * model.noise, 1) + "% (median absolute deviation, " +
      std::to_string(runs.size()) + " plans measured in turn)");
  calibrateConcurrency(config, meter, request, many, model, lines);
}

} // namespace

// ---- searching and measuring --------------------------------------------

namespace {

TuneRequest requestFor(const Config& config, const LayerList& layers) {
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
      ScheduleKind::kZeroBubbleV,
      ScheduleKind::kZeroBubbleVHalf,
      ScheduleKind::kZeroBubbleVMin,
      ScheduleKind::kDualPipeV};
  // DualPipe's second chain runs a copy of every layer (its parameters
  // counted twice in memory): searched where the layers can be copied.
  if (whyLayersCannotBeCopied(layers).empty())
    request.schedules.push_back(ScheduleKind::kDualPipe);
  const auto& o = config.train.optimizer;
  request.optimizerFactor = optimizerStateFactor(o.type, o.momentum);
  request.overlapSteps = config.pipeline.overlapSteps;
  request.directWeightGradients = config.pipeline.directWeightGradients;
  request.speculativeUpdates = speculativeUpdatesOf(config);
  return request;
}

// Each plan's ms per step a round, and the cores other processes wanted
// during each of its turns (negative where unknown).
struct InTurn {
  std::vector<std::vector<double>> steps;
  std::vector<std::vector<double>> loads;
};

InTurn inTurnOf(const std::vector<std::vector<StepTiming>>& timings) {
  InTurn out;
  for (const auto& plan : timings) {
    out.steps.push_back(stepTimes(plan));
    out.loads.emplace_back();
    for (const auto& t : plan)
      out.loads.back().push_back(t.othersCores);
  }
  return out;
}

// Each candidate's ms per step, a value a round: each turn one untimed step
// (a plan's first step after another plan's runs on the caches that plan
// filled, 4-11% slower than training's steps, which follow their own), then
// `stream` steps in a row timed together. Single steps of a plan that
// overlaps its steps, timed from one finish to the next, spread widely on
// shared cores: their lower quartile put two-stage dualpipe at 8.4-8.7 ms
// where it trained at 10-12, and tunes chose four different plans in four
// runs; streams of 4 chose one plan in four.
InTurn measureInTurn(
    StepMeter& meter,
    const std::vector<TuneCandidate>& candidates,
    int rounds,
    int stream,
    std::ostream* log,
    bool averageBursts = false) {
  Turns turns;
  turns.rounds = rounds;
  turns.stream = stream;
  turns.warmEachTurn = true;
  MoreRounds more;
  if (averageBursts) {
    // A neighbour's bursts of 0.1-0.9 s slow whichever rounds they meet:
    // rounds over a few seconds catch them in the share a training run
    // does only by luck. Where a neighbour showed, measuring goes on for
    // kBurstAveragingMs, and on while some plan's mean is unsettled
    // (kBurstAveragingError, up to kBurstAveragingMostMs).
    more.maxRounds = 8 * std::max(rounds, 15);
    more.wanted = [began = Clock::now()](
                      const std::vector<std::vector<StepTiming>>& t) {
      const double span = msSince(began);
      if (span >= kBurstAveragingMostMs)
        return false;
      if (span < kBurstAveragingMs)
        return true;
      double leastSettled = 0.0;
      for (const auto& timings : t)
        leastSettled =
            std::max(leastSettled, relativeStandardError(stepTimes(timings)));
      return leastSettled > kBurstAveragingError;
    };
  }
  return inTurnOf(meter.interleave(candidates, turns, log, more));
}

// A neighbour showed in the first rounds: plans clearly behind make way
// for the next ones (contendersBesideANeighbour), which are measured, with
// those kept, as long as bursts take to count in their share; where the
// plans stay, their rounds go on. `measured` and `plans` become what the
// returned rounds measured.
InTurn measureBesideANeighbour(
    StepMeter& meter,
    TuneResult& result,
    std::vector<size_t>& measured,
    std::vector<TuneCandidate>& plans,
    InTurn first,
    std::ostream* log) {
  const std::vector<double> figures =
      stepsAsTrainingMeetsThem(first.steps, first.loads);
  const std::vector<size_t> next =
      contendersBesideANeighbour(result, measured, figures);
  if (log) {
    *log << "tune: a neighbour's bursts slowed "
         << roundsSlowedByBursts(first.steps) << " of "
         << first.steps.front().size() << " rounds";
    if (const auto load = loadOver(first.steps, first.loads))
      *log << ", other processes wanted " << fixed(load->overTime, 2)
           << " cores";
    *log << ": measuring for " << kBurstAveragingMs / 1000.0 << "-"
         << kBurstAveragingMostMs / 1000.0
         << " s more, so that they count in the share a run meets" << std::endl;
  }
  std::vector<size_t> before = measured, after = next;
  std::sort(before.begin(), before.end());
  std::sort(after.begin(), after.end());
  // Rounds of a handful of plans meet a burst whole: at least 5 more, and
  // on while measureInTurn's criteria want them.
  constexpr int kLeastRounds = 5;
  if (before == after || next.size() < 2) {
    const InTurn more =
        measureInTurn(meter, plans, kLeastRounds, kStepsPerTurn, log, true);
    for (size_t k = 0; k < plans.size(); ++k) {
      first.steps[k].insert(
          first.steps[k].end(), more.steps[k].begin(), more.steps[k].end());
      first.loads[k].insert(
          first.loads[k].end(), more.loads[k].begin(), more.loads[k].end());
    }
    return first;
  }
  // Named, with the first rounds' figures: a busy tune that never measured
  // the plan the other tunes chose is read from this note alone.
  const auto fastestAt = static_cast<size_t>(
      std::min_element(figures.begin(), figures.end()) - figures.begin());
  std::vector<std::string> madeWay, newcomers;
  for (size_t k = 0; k < measured.size(); ++k) {
    if (std::count(next.begin(), next.end(), measured[k]) == 0)
      madeWay.push_back(
          result.candidates[measured[k]].label() + " " + fixed(figures[k], 2) +
          " ms (x" + fixed(figures[k] / figures[fastestAt], 2) + ")");
  }
  for (size_t i : next) {
    if (std::count(measured.begin(), measured.end(), i) == 0)
      newcomers.push_back(result.candidates[i].label());
  }
  auto listed = [](const std::vector<std::string>& items) {
    std::string text;
    for (const std::string& item : items)
      text += (text.empty() ? " " : ", ") + item;
    return items.empty() ? std::string(" none") : text;
  };
  std::ostringstream note;
  note << "beside a neighbour, after " << first.steps.front().size()
       << " rounds: " << madeWay.size() << " plan(s) made way for "
       << newcomers.size() << " more (those over "
       << static_cast<int>(std::lround(100.0 * (kClearlyBehind - 1.0)))
       << "% behind the fastest, but its simpler neighbours within 25%, or "
          "else the slowest but the simplest, for "
          "a plan a step simpler than the fastest, or than the fastest on "
          "several devices where one stage is, or the next), and the "
       << next.size() << " were measured again; the fastest in the first "
       << "rounds: " << result.candidates[measured[fastestAt]].label() << " "
       << fixed(figures[fastestAt], 2) << " ms; made way:" << listed(madeWay)
       << "; joined:" << listed(newcomers);
  result.notes.push_back(note.str());
  if (log)
    *log << "tune: " << note.str() << std::endl;
  // A plan that made way keeps its first rounds' figure: the predictions
  // of its shape are anchored to it, and the notes say what it ran.
  for (size_t k = 0; k < measured.size(); ++k)
    result.candidates[measured[k]].measuredStepMs = figures[k];
  measured = next;
  plans.clear();
  for (size_t i : measured)
    plans.push_back(result.candidates[i]);
  return measureInTurn(meter, plans, kLeastRounds, kStepsPerTurn, log, true);
}

// The choice and its rivals alone in turn (rivalsOfTheChoice), for at
// least kFinalLeastRounds rounds and kFinalLeastMs, then until their figures
// settle the final (aFinalIsSettled), up to kFinalMostMs.
InTurn measureAFinal(
    StepMeter& meter,
    const TuneResult& result,
    const std::vector<size_t>& rivals,
    std::ostream* log) {
  std::vector<TuneCandidate> finalists{result.candidates[result.choice]};
  for (size_t rival : rivals)
    finalists.push_back(result.candidates[rival]);
  if (log) {
    *log << "tune: measuring " << finalists[0].label()
         << " alone in turn with ";
    for (size_t k = 1; k < finalists.size(); ++k)
      *log << (k == 1                          ? ""
                   : k + 1 == finalists.size() ? " and "
                                               : ", ")
           << finalists[k].label();
    *log << " for " << kFinalLeastMs / 1000.0 << "-" << kFinalMostMs / 1000.0
         << " s, at least " << kFinalLeastRounds << " rounds" << std::endl;
  }
  Turns turns;
  turns.rounds = kFinalLeastRounds;
  turns.stream = kStepsPerTurn;
  turns.warmEachTurn = true;
  MoreRounds more;
  more.maxRounds = 100000; // time ends it
  more.wanted = [began = Clock::now(), &finalists, cores = result.cores](
                    const std::vector<std::vector<StepTiming>>& t) {
    const double span = msSince(began);
    if (span < kFinalLeastMs)
      return true;
    if (span >= kFinalMostMs)
      return false;
    const InTurn sofar = inTurnOf(t);
    return !aFinalIsSettled(
        finalists, stepsBesideANeighbour(sofar.steps, sofar.loads), cores);
  };
  return inTurnOf(meter.interleave(finalists, turns, nullptr, more));
}

} // namespace

std::vector<double> measureCandidates(
    const Config& config,
    const std::vector<TuneCandidate>& candidates,
    int steps,
    int rounds,
    std::ostream* log) {
  if (steps < 1 || rounds < 1)
    throw std::invalid_argument(
        "measureCandidates: steps and rounds must be at least 1, got " +
        std::to_string(steps) + " and " + std::to_string(rounds));
  StepMeter meter(config);
  std::vector<double> lowerQuartiles;
  for (const auto& times :
       measureInTurn(meter, candidates, rounds, steps, log).steps)
    lowerQuartiles.push_back(lowerQuartile(times));
  return lowerQuartiles;
}

TuneOutcome tuneConfig(const Config& config, const TuneOptions& options) {
  TuneOutcome outcome;
  stopIfAsked(options.stopRequested);
  StepMeter meter(config, options.stopRequested);
  outcome.model.source = "measured now on this machine";
  warmUp(meter, options);
  profileCurves(
      config, meter.model(), options, outcome.model, outcome.calibration);
  outcome.request = requestFor(config, meter.model().layers);
  const TuneRequest& request = outcome.request;
  calibrateRuntime(
      config, meter, options, request, outcome.model, outcome.calibration);
  outcome.result = tunePlans(outcome.model, request);
  std::vector<size_t> measured;
  if (options.measure) {
    const int count = std::min(options.top, outcome.result.feasible());
    for (int i = 0; i < count; ++i)
      measured.push_back(static_cast<size_t>(i));
    if (std::find(measured.begin(), measured.end(), outcome.result.choice) ==
        measured.end())
      measured.push_back(outcome.result.choice);
  } else {
    measured = measurementContenders(outcome.result);
  }
  if (measured.size() < 2)
    return outcome;
  std::vector<TuneCandidate> plans;
  for (size_t i : measured)
    plans.push_back(outcome.result.candidates[i]);
  if (options.log && !options.measure)
    *options.log << "tune: running " << plans.size()
                 << " plans the prediction cannot tell apart, in turn"
                 << std::endl;
  InTurn inTurn = measureInTurn(
      meter,
      plans,
      options.measure ? options.measureRounds * options.measureSteps : 15,
      kStepsPerTurn,
      options.log);
  if (!options.measure && aNeighbourShows(inTurn.steps, inTurn.loads))
    inTurn = measureBesideANeighbour(
        meter, outcome.result, measured, plans, std::move(inTurn), options.log);
  const std::vector<std::vector<double>>& steps = inTurn.steps;
  chooseByMeasurement(outcome.result, measured, steps, inTurn.loads);
  if (options.measure)
    return outcome; // --measure shows the model's own predictions
  // Predictions of the steps a user will meet: a neighbour's bursts in
  // their share, or at the load it puts on training.
  const StepsAtALoad atLoad = stepsAtTheLoadTrainingMeets(steps, inTurn.loads);
  const bool byLoad = !atLoad.stepMs.empty();
  const std::vector<double> met =
      byLoad ? atLoad.stepMs : stepsAsTrainingMeetsThem(steps);
  for (size_t k = 0; k < measured.size(); ++k)
    outcome.result.candidates[measured[k]].measuredStepMs = met[k];
  if (aNeighbourShows(steps, inTurn.loads)) {
    const std::vector<size_t> rivals =
        rivalsOfTheChoice(outcome.result, measured, met);
    if (!rivals.empty()) {
      const InTurn final =
          measureAFinal(meter, outcome.result, rivals, options.log);
      const StepsAtALoad beside = stepsBesideANeighbour(steps, inTurn.loads);
      StepsAtALoad finalistsInTurn;
      finalistsInTurn.fittedToTheLoad = beside.fittedToTheLoad;
      std::vector<size_t> finalists{outcome.result.choice};
      finalists.insert(finalists.end(), rivals.begin(), rivals.end());
      for (size_t plan : finalists) {
        const size_t k = static_cast<size_t>(
            std::find(measured.begin(), measured.end(), plan) -
            measured.begin());
        if (k < beside.stepMs.size()) {
          finalistsInTurn.stepMs.push_back(beside.stepMs[k]);
          finalistsInTurn.relativeError.push_back(beside.relativeError[k]);
        }
      }
      settleByAFinal(
          outcome.result, rivals, final.steps, final.loads, finalistsInTurn);
      if (options.log)
        *options.log << "tune: " << outcome.result.notes.back() << std::endl;
    }
  }
  const std::string anchored = anchorToMeasured(outcome.result);
  if (!anchored.empty()) {
    std::ostringstream note;
    note << anchored << "; measured ms: ";
    if (byLoad) {
      note << "at the load a neighbour put on the " << steps.front().size()
           << " rounds (the cores other processes wanted, measured each "
              "turn)";
    } else {
      note << "medians of " << steps.front().size() << " rounds";
      if (const int slowed = roundsSlowedByBursts(steps))
        note << ", the " << slowed
             << " a neighbour's bursts slowed counted in their share";
    }
    outcome.result.notes.push_back(note.str());
  }
  return outcome;
}

// ---- writing the choice -------------------------------------------------

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
