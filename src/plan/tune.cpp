// The tuner's search (see tpipe/tune.h): candidates, the resolver's
// partition for each, the calibrated simulation, the ranking.
#include "tpipe/tune.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <iomanip>
#include <map>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "statistics.h"
#include "tpipe/plan.h"

namespace tpipe {

double SizeCurve::at(double samples) const {
  if (sizes.empty())
    return 0.0;
  const double n = std::max(samples, 1e-9);
  if (sizes.size() == 1)
    return ms[0] * n / sizes[0];
  auto point = [&](size_t i) {
    return std::make_pair(std::log(sizes[i]), std::log(std::max(ms[i], 1e-9)));
  };
  size_t i = 0; // the interval [i, i + 1] holding n, or the end one
  while (i + 2 < sizes.size() && n > sizes[i + 1])
    ++i;
  const auto [x0, y0] = point(i);
  const auto [x1, y1] = point(i + 1);
  double slope = (y1 - y0) / (x1 - x0);
  const double x = std::log(n);
  if (x < x0 || x > x1)
    slope = std::clamp(slope, 0.0, 1.2);
  const auto [xa, ya] =
      x > x1 ? std::make_pair(x1, y1) : std::make_pair(x0, y0);
  return std::exp(ya + slope * (x - xa));
}

SizeCurve SizeCurve::proportional(double size, double ms) {
  SizeCurve curve;
  curve.sizes = {size};
  curve.ms = {ms};
  return curve;
}

LayerCost layerCostAt(
    LayerCost cost,
    const SizeCurve& forward,
    const SizeCurve& backward,
    double activationBytesPerSample,
    double stashBytesPerSample,
    double n) {
  cost.forwardMs = std::max(0.0, forward.at(n));
  cost.backwardMs = std::max(0.0, backward.at(n));
  cost.activationBytes =
      static_cast<int64_t>(std::llround(activationBytesPerSample * n));
  cost.stashBytes = static_cast<int64_t>(std::llround(stashBytesPerSample * n));
  return cost;
}

std::vector<LayerCost> CostModel::costsAt(double size, int threadCount) const {
  const auto found = std::find(threads.begin(), threads.end(), threadCount);
  if (found == threads.end()) {
    throw UserError(
        "the cost model has no times at " + std::to_string(threadCount) +
        " threads");
  }
  const size_t t = static_cast<size_t>(found - threads.begin());
  std::vector<LayerCost> costs;
  for (const auto& layer : layers) {
    LayerCost cost;
    cost.name = layer.name;
    cost.paramBytes = layer.paramBytes;
    cost.weightGradientInPlace = layer.weightGradientInPlace;
    costs.push_back(layerCostAt(
        cost,
        layer.forward[t],
        layer.backward[t],
        layer.activationBytesPerSample,
        layer.stashBytesPerSample,
        size));
  }
  return costs;
}

double CostModel::instructionMsAt(int threadCount) const {
  for (size_t t = 0; t < threads.size() && t < threadInstructionMs.size();
       ++t) {
    if (threads[t] == threadCount)
      return threadInstructionMs[t];
  }
  return instructionMs;
}

std::string TuneCandidate::label() const {
  std::string text =
      std::to_string(ranks) + (ranks == 1 ? " stage" : " stages");
  if (virtualStages > 1)
    text += " (x" + std::to_string(virtualStages) + ")";
  if (dataParallel > 1)
    text += " x " + std::to_string(dataParallel) + " dp";
  if (threadsPerStage > 0)
    text += ", " + std::to_string(threadsPerStage) + " thr";
  text += ", " + std::to_string(microBatches) + " mb, " +
      scheduleKindName(schedule) + ", " + checkpointModeName(checkpoint);
  return text;
}

int TuneResult::feasible() const {
  int count = 0;
  for (const auto& candidate : candidates)
    count += candidate.infeasible.empty() ? 1 : 0;
  return count;
}

namespace {

const std::vector<ScheduleKind>& allSchedules() {
  static const std::vector<ScheduleKind> kinds{
      ScheduleKind::kGpipe,
      ScheduleKind::kOneFOneB,
      ScheduleKind::kInterleaved,
      ScheduleKind::kZeroBubbleH1,
      ScheduleKind::kZeroBubbleH2,
      ScheduleKind::kZeroBubbleV,
      ScheduleKind::kZeroBubbleVHalf,
      ScheduleKind::kZeroBubbleVMin,
      ScheduleKind::kAuto,
      ScheduleKind::kDualPipeV,
      ScheduleKind::kDualPipe};
  return kinds;
}

int virtualStagesOf(ScheduleKind kind) {
  return kind == ScheduleKind::kInterleaved || isVShaped(kind) ? 2 : 1;
}

// Simplest first: what the choice prefers among plans within the noise.
int scheduleRank(ScheduleKind kind) {
  const auto& kinds = allSchedules();
  return static_cast<int>(
      std::find(kinds.begin(), kinds.end(), kind) - kinds.begin());
}

int checkpointRank(CheckpointMode mode) {
  switch (mode) {
    case CheckpointMode::kNever:
      return 0;
    case CheckpointMode::kExceptLast:
      return 1;
    case CheckpointMode::kAlways:
      return 2;
  }
  return 3;
}

} // namespace

bool holdsLess(const TuneCandidate& a, const TuneCandidate& b, int cores) {
  const int threads = a.devices() * a.threadsPerStage;
  if (cores > 0 && a.threadsPerStage > 1 && threads >= cores)
    return false;
  return a.devices() < b.devices() && threads < b.devices() * b.threadsPerStage;
}

bool isSimplerPlan(const TuneCandidate& a, const TuneCandidate& b) {
  // DualPipe runs a copy of every stage, the other chain's, on each device:
  // as many stages a device as a V, with its weights held twice.
  auto stagesPerDevice = [](const TuneCandidate& c) {
    return c.schedule == ScheduleKind::kDualPipe ? 2 * c.virtualStages
                                                 : c.virtualStages;
  };
  auto key = [&](const TuneCandidate& c) {
    return std::make_tuple(
        c.devices(),
        stagesPerDevice(c),
        scheduleRank(c.schedule),
        checkpointRank(c.checkpoint),
        c.microBatches);
  };
  return key(a) < key(b);
}

namespace {

// The ranking's order: feasible first, fastest predicted first.
bool rankedBefore(const TuneCandidate& a, const TuneCandidate& b) {
  if (a.infeasible.empty() != b.infeasible.empty())
    return a.infeasible.empty();
  return a.infeasible.empty() && a.predictedStepMs < b.predictedStepMs;
}

} // namespace

namespace {

// Per round: whether a neighbour's burst slowed it (the plans ran, by
// their median, more than 15% above their own lower quartiles together).
std::vector<bool> burstRounds(
    const std::vector<std::vector<double>>& roundSteps) {
  if (roundSteps.empty())
    return {};
  std::vector<double> quartiles;
  for (const auto& steps : roundSteps)
    quartiles.push_back(lowerQuartile(steps));
  std::vector<bool> slowed;
  for (size_t r = 0; r < roundSteps.front().size(); ++r) {
    std::vector<double> slowness;
    for (size_t k = 0; k < roundSteps.size(); ++k) {
      if (r < roundSteps[k].size() && quartiles[k] > 0.0)
        slowness.push_back(roundSteps[k][r] / quartiles[k]);
    }
    slowed.push_back(!slowness.empty() && median(slowness) > 1.15);
  }
  return slowed;
}

// Bursts in at least 4 rounds of 15: a neighbour, not a quiet machine's
// jitter (two or three of 15 rounds of tiny steps can look slowed).
bool neighbourShows(const std::vector<bool>& slowed) {
  return 15 * std::count(slowed.begin(), slowed.end(), true) >=
      4 * static_cast<std::ptrdiff_t>(slowed.size()) &&
      !slowed.empty();
}

} // namespace

int roundsSlowedByBursts(const std::vector<std::vector<double>>& roundSteps) {
  const std::vector<bool> slowed = burstRounds(roundSteps);
  return static_cast<int>(std::count(slowed.begin(), slowed.end(), true));
}

bool aNeighbourShows(
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads) {
  if (neighbourShows(burstRounds(roundSteps)))
    return true;
  const std::optional<LoadSummary> load = loadOver(roundSteps, roundLoads);
  return load && load->overTime >= kNeighbourCores;
}

std::optional<LoadSummary> loadOver(
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads) {
  if (roundLoads.size() != roundSteps.size() || roundSteps.empty())
    return std::nullopt;
  std::vector<double> every;
  // The load training meets: the neighbour's over the time every plan's
  // turns took, which chance spread over the plans unevenly. Each turn
  // weighs as long as it ran (its steps, as many in every turn): a burst
  // lengthens the turns it meets, and a mean over turns counted the
  // quiet ones more often than their share of the time.
  double loadTime = 0.0, span = 0.0;
  for (size_t k = 0; k < roundSteps.size(); ++k) {
    const auto& loads = roundLoads[k];
    if (loads.size() != roundSteps[k].size())
      return std::nullopt;
    for (size_t r = 0; r < loads.size(); ++r) {
      if (!(loads[r] >= 0.0))
        return std::nullopt;
      loadTime += loads[r] * roundSteps[k][r];
      span += roundSteps[k][r];
    }
    every.insert(every.end(), loads.begin(), loads.end());
  }
  if (every.empty())
    return std::nullopt;
  LoadSummary load;
  load.mean = mean(every);
  load.overTime = span > 0.0 ? loadTime / span : load.mean;
  double squares = 0.0;
  for (double x : every)
    squares += (x - load.mean) * (x - load.mean);
  load.spread = std::sqrt(squares / static_cast<double>(every.size()));
  load.least = *std::min_element(every.begin(), every.end());
  load.most = *std::max_element(every.begin(), every.end());
  return load;
}

StepsAtALoad stepsAtTheLoadTrainingMeets(
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads) {
  StepsAtALoad out;
  const std::optional<LoadSummary> load = loadOver(roundSteps, roundLoads);
  // A tenth of a core: below it the load says nothing of the steps.
  if (!load || load->spread <= 0.1 || !aNeighbourShows(roundSteps, roundLoads))
    return out;
  for (const auto& steps : roundSteps) {
    if (steps.size() < 3)
      return out;
  }
  const double trainingLoad = load->overTime;
  for (size_t k = 0; k < roundSteps.size(); ++k) {
    std::vector<double> rates; // steps a ms
    for (double step : roundSteps[k]) {
      if (!(step > 0.0))
        return StepsAtALoad{};
      rates.push_back(1.0 / step);
    }
    const auto& loads = roundLoads[k];
    const double n = static_cast<double>(rates.size());
    const double meanLoad = mean(loads), meanRate = mean(rates);
    double sxx = 0.0, sxy = 0.0;
    for (size_t r = 0; r < rates.size(); ++r) {
      sxx += (loads[r] - meanLoad) * (loads[r] - meanLoad);
      sxy += (loads[r] - meanLoad) * (rates[r] - meanRate);
    }
    const double slope = sxx > 0.0 ? sxy / sxx : 0.0;
    // The fit where the plan's turns are, moved to the load training meets:
    // its intercept, a step with no neighbour, lay 10-20% from one plan's
    // to another's of the same work (the slowing is not quite linear). The
    // line stops at the plan's slowest turn: past its turns' loads it says
    // nothing, and it may reach a rate of nothing.
    const double rate = std::max(
        meanRate + slope * (trainingLoad - meanLoad),
        *std::min_element(rates.begin(), rates.end()));
    const double figure = 1.0 / rate;
    double squares = 0.0;
    for (size_t r = 0; r < rates.size(); ++r) {
      const double residual =
          rates[r] - meanRate - slope * (loads[r] - meanLoad);
      squares += residual * residual;
    }
    const double error = std::sqrt(squares / (n - 2.0)) / std::sqrt(n);
    out.stepMs.push_back(figure);
    out.relativeError.push_back(error / rate);
  }
  out.fittedToTheLoad = true;
  return out;
}

StepsAtALoad stepsBesideANeighbour(
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads) {
  if (!aNeighbourShows(roundSteps, roundLoads))
    return {};
  StepsAtALoad steps = stepsAtTheLoadTrainingMeets(roundSteps, roundLoads);
  if (!steps.stepMs.empty())
    return steps;
  // A load too steady to fit a line to: turns long enough to average the
  // bursts out meet about the same share of them, and each plan's figure
  // settles as its mean does.
  steps.stepMs = stepsAsTrainingMeetsThem(roundSteps);
  for (const auto& plan : roundSteps)
    steps.relativeError.push_back(relativeStandardError(plan));
  return steps;
}

std::vector<double> stepsAsTrainingMeetsThem(
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads) {
  StepsAtALoad atLoad = stepsAtTheLoadTrainingMeets(roundSteps, roundLoads);
  if (!atLoad.stepMs.empty())
    return atLoad.stepMs;
  const std::vector<bool> slowed = burstRounds(roundSteps);
  // Beside a neighbour a burst of 0.1-0.9 s may slow one plan's turn and
  // spare the others': each plan's own rounds above its calm ones are its
  // bursts. Held only against whole rounds, a reference job's rounds of 2 s
  // lost most of them, and its busy tunes predicted the one-stage plan 8%
  // under training.
  const bool neighbour = neighbourShows(slowed);
  std::vector<double> out;
  for (const auto& steps : roundSteps) {
    const double calmest = lowerQuartile(steps);
    std::vector<double> calm, burst;
    for (size_t r = 0; r < steps.size(); ++r) {
      const bool hit = neighbour ? steps[r] > 1.15 * calmest
                                 : r < slowed.size() && slowed[r];
      (hit ? burst : calm).push_back(steps[r]);
    }
    if (calm.empty()) {
      out.push_back(mean(burst));
      continue;
    }
    const double share =
        static_cast<double>(burst.size()) / static_cast<double>(steps.size());
    out.push_back((1.0 - share) * median(calm) + share * mean(burst));
  }
  return out;
}

std::string anchorToMeasured(TuneResult& result) {
  auto& all = result.candidates;
  std::map<int, std::vector<double>> ratios;
  std::vector<double> every;
  for (const auto& c : all) {
    if (c.measuredStepMs < 0 || !c.infeasible.empty() || c.predictedStepMs <= 0)
      continue;
    ratios[c.devices()].push_back(c.measuredStepMs / c.predictedStepMs);
    every.push_back(c.measuredStepMs / c.predictedStepMs);
  }
  if (every.empty())
    return "";
  const double overall = median(every);
  std::map<int, double> factors;
  for (const auto& [count, r] : ratios)
    factors[count] = median(r);
  for (auto& c : all) {
    if (!c.infeasible.empty())
      continue;
    const auto found = factors.find(c.devices());
    // A measured plan's best estimate is its own measurement.
    const double factor = c.measuredStepMs >= 0 && c.predictedStepMs > 0
        ? c.measuredStepMs / c.predictedStepMs
        : found == factors.end() ? overall
                                 : found->second;
    c.predictedStepMs *= factor;
    c.samplesPerSecond /= factor;
  }
  // Re-ranked by the anchored predictions; the choice found again by place.
  std::vector<size_t> order(all.size());
  for (size_t i = 0; i < order.size(); ++i)
    order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return rankedBefore(all[a], all[b]);
  });
  std::vector<TuneCandidate> ranked;
  ranked.reserve(all.size());
  size_t choice = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    if (order[i] == result.choice)
      choice = i;
    ranked.push_back(std::move(all[order[i]]));
  }
  all = std::move(ranked);
  result.choice = choice;
  std::ostringstream note;
  note << std::fixed << std::setprecision(2) << "predictions anchored to the "
       << every.size() << " plans measured in turn:";
  const char* separator = " ";
  for (const auto& [count, factor] : factors) {
    note << separator << count << (count == 1 ? " device" : " devices") << " x"
         << factor << " (" << ratios[count].size() << " measured)";
    separator = ", ";
  }
  note << ", others x" << overall;
  return note.str();
}

namespace {

// One-stage plans at one micro-batch count (on one stage every schedule is
// fill-drain or 1F1B, as the search lists them) run the same layers on one
// device and differ only in the activations held: one's measurement tells
// the other's step, within the noise (2-3% apart in every busy reference
// tune), so the two need not take two places.
bool runAlike(const TuneCandidate& a, const TuneCandidate& b) {
  auto oneStage = [](const TuneCandidate& c) {
    return c.stages == 1 && c.ranks == 1;
  };
  return oneStage(a) && oneStage(b) && a.microBatches == b.microBatches &&
      a.checkpoint == b.checkpoint && a.threadsPerStage == b.threadsPerStage &&
      a.dataParallel == b.dataParallel;
}

// Whether a plan other than all[i] among `plans` runs alike with it.
bool aTwinAmong(
    const std::vector<TuneCandidate>& all,
    const std::vector<size_t>& plans,
    size_t i) {
  return std::any_of(plans.begin(), plans.end(), [&](size_t k) {
    return k != i && runAlike(all[i], all[k]);
  });
}

// Whether a schedule runs some backward as an input pass and a weight pass.
bool splitsTheBackward(ScheduleKind kind) {
  return kind != ScheduleKind::kGpipe && kind != ScheduleKind::kOneFOneB &&
      kind != ScheduleKind::kInterleaved;
}

} // namespace

std::vector<size_t> measurementContenders(const TuneResult& result) {
  std::vector<size_t> picked;
  auto pick = [&](size_t i) {
    if (std::find(picked.begin(), picked.end(), i) == picked.end())
      picked.push_back(i);
  };
  const auto& all = result.candidates;
  if (all.empty() || !all.front().infeasible.empty())
    return picked;
  auto aTwinIsPicked = [&](size_t i) { return aTwinAmong(all, picked, i); };
  const double fastest = all.front().predictedStepMs;
  // At most two of one device count among the top four: a neighbour slows
  // each shape unequally, so the calm ranking says least about the order of
  // device counts. Busy reference tunes whose top four were one-stage plans
  // measured one two-stage plan, never zb-v or ZB-H1 at 2 micro-batches
  // (the grid's two fastest), and chose one stage, 6-7.5% behind them.
  std::map<int, int> topOfCount;
  for (size_t i = 0; i < all.size() && picked.size() < 4; ++i) {
    if (!all[i].infeasible.empty() || all[i].predictedStepMs > 1.25 * fastest)
      break;
    if (aTwinIsPicked(i) || topOfCount[all[i].devices()] >= 2)
      continue;
    pick(i);
    ++topOfCount[all[i].devices()];
  }
  // The prediction's choice is measured whatever was picked, in place of
  // its twin: a busy reference tune measured both, one stage at 2
  // micro-batches under 1F1B in the top four and under gpipe as the choice.
  picked.erase(
      std::remove_if(
          picked.begin(),
          picked.end(),
          [&](size_t k) {
            return k != result.choice && runAlike(all[result.choice], all[k]);
          }),
      picked.end());
  pick(result.choice);
  // Each device count's fastest within 4x: a calibration a burst spoiled
  // put every two-device plan of a busy reference tune over 2x the fastest
  // (that tune's predictions missed the grid by 121%), so it measured three
  // one-stage plans and chose one that trained 12% behind the best.
  // With it, the next of its count where predicted within 10% of it: a
  // neighbour reorders the plans of a count the prediction puts close.
  // Three busy reference tunes measured one two-device plan, dualpipe at 4
  // micro-batches (predicted 0.1% from zb-v at 2 calm; trained 10% behind it
  // beside the neighbour), and chose one stage.
  std::map<int, size_t> countsFastest;
  std::map<int, int> nearItsCountsFastest;
  size_t simplest = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const int devices = all[i].devices();
    if (!all[i].infeasible.empty() || all[i].predictedStepMs > 4.0 * fastest)
      break;
    if (all[i].predictedStepMs <= 2.0 * fastest &&
        isSimplerPlan(all[i], all[simplest]))
      simplest = i;
    const auto first = countsFastest.emplace(devices, i).first->second;
    if (nearItsCountsFastest[devices] >= 2 || aTwinIsPicked(i) ||
        all[i].predictedStepMs > 1.10 * all[first].predictedStepMs)
      continue;
    pick(i);
    ++nearItsCountsFastest[devices];
  }
  if (!aTwinIsPicked(simplest))
    pick(simplest);
  // Plans that split the backward and plans that do not are each measured,
  // the fastest of either kind within 1.5x of the fastest: the calibration
  // times the input and weight passes apart from the whole backward, so its
  // noise moves the two kinds apart.
  // A busy reference tune in a slow window (stop 87; its predictions 39%
  // off the grid) measured one stage, 1F1B and interleaved 1F1B, none that
  // splits it, and chose one stage, 7.8% behind ZB-H1 at 2 micro-batches
  // and 11.7% behind zb-v at 2, the plans the other four tunes chose.
  for (const bool split : {false, true}) {
    if (std::any_of(picked.begin(), picked.end(), [&](size_t k) {
          return splitsTheBackward(all[k].schedule) == split;
        }))
      continue;
    for (size_t i = 0; i < all.size(); ++i) {
      if (!all[i].infeasible.empty() || all[i].predictedStepMs > 1.5 * fastest)
        break;
      if (splitsTheBackward(all[i].schedule) == split && !aTwinIsPicked(i)) {
        pick(i);
        break;
      }
    }
  }
  return picked;
}

namespace {

// A plan a step simpler than `fastest`: on as many devices or one fewer, at
// its micro-batch count or half, with no more stages a device, and the
// backward split as it is. Plans that split it and plans that do not read
// differently in turn beside a neighbour: Fashion CNN's two-stage 1F1B at
// 2 micro-batches read 4% fast against its training, ZB-H1 at 2 as it
// trained.
bool isASimplerNeighbour(const TuneCandidate& c, const TuneCandidate& fastest) {
  return c.infeasible.empty() && isSimplerPlan(c, fastest) &&
      (c.devices() == fastest.devices() ||
       c.devices() + 1 == fastest.devices()) &&
      (c.microBatches == fastest.microBatches ||
       2 * c.microBatches == fastest.microBatches) &&
      c.virtualStages <= fastest.virtualStages &&
      c.checkpoint == fastest.checkpoint &&
      splitsTheBackward(c.schedule) == splitsTheBackward(fastest.schedule);
}

// How far behind the fastest a plan may read, measured or predicted, and
// still be measured beside a neighbour where it is the fastest's simpler
// neighbour or the next by prediction: the first rounds and a busy
// calibration both miss by that much.
constexpr double kWithinReach = 1.25;

} // namespace

std::vector<size_t> contendersBesideANeighbour(
    const TuneResult& result,
    const std::vector<size_t>& measured,
    const std::vector<double>& figures) {
  if (figures.size() != measured.size() || measured.empty())
    throw std::invalid_argument(
        "contendersBesideANeighbour: one figure per measured plan");
  const auto& all = result.candidates;
  const size_t fastestAt = static_cast<size_t>(
      std::min_element(figures.begin(), figures.end()) - figures.begin());
  const double fastest = figures[fastestAt];
  std::vector<size_t> next;
  std::map<int, std::vector<double>> ratios; // per device count
  // A simpler neighbour of the fastest measured within 25% of it stays: its
  // first rounds' figure is no surer than the prediction that lets an
  // unmeasured one join in that band. A busy Fashion tune (stop 87) read
  // two-stage ZB-H1 at 2 micro-batches 14% behind dualpipe at 4, let it
  // make way for ZB-H1 at 4, and chose that, 5.8% behind ZB-H1 at 2 in
  // training.
  const TuneCandidate& fastestPlan = all[measured[fastestAt]];
  for (size_t k = 0; k < measured.size(); ++k) {
    const TuneCandidate& c = all[measured[k]];
    if (figures[k] <= kClearlyBehind * fastest ||
        (isASimplerNeighbour(c, fastestPlan) &&
         figures[k] <= kWithinReach * fastest))
      next.push_back(measured[k]);
    if (c.predictedStepMs > 0.0)
      ratios[c.devices()].push_back(figures[k] / c.predictedStepMs);
  }
  // A plan measured, kept or not, or its twin (runAlike) waits for
  // nothing: its figure is known. Two of ten busy reference tunes measured
  // one stage under 1F1B beside its gpipe twin; in one it took the place of
  // the only two-device plan, and that tune chose one stage.
  auto inOrATwinIn = [&](size_t i, const std::vector<size_t>& plans) {
    return std::find(plans.begin(), plans.end(), i) != plans.end() ||
        aTwinAmong(all, plans, i);
  };
  // The next plans by their predictions anchored to their device count's
  // figures: where no plan of a count was measured, nothing says how the
  // neighbour treats that shape.
  std::vector<std::pair<double, size_t>> waiting;
  for (size_t i = 0; i < all.size(); ++i) {
    const auto found = ratios.find(all[i].devices());
    if (!all[i].infeasible.empty() || found == ratios.end() ||
        inOrATwinIn(i, measured))
      continue;
    const double anchored = all[i].predictedStepMs * median(found->second);
    if (anchored <= kWithinReach * fastest)
      waiting.emplace_back(anchored, i);
  }
  std::stable_sort(
      waiting.begin(), waiting.end(), [](const auto& a, const auto& b) {
        return a.first < b.first;
      });
  // First the fastest plan's simpler neighbours that the prediction puts
  // within 25% of it, the simplest first: the choice is the simplest plan
  // within the noise of the fastest, and one not measured cannot be it.
  // Ranked by their predictions alone, other plans took every free place in
  // three of five reference tunes and three of five Fashion tunes, which
  // then chose among near ties by noise; the four that measured two-stage
  // ZB-H1 at 2 micro-batches chose it. A tighter band let the prediction
  // leave the neighbour out again: held within 10% of the fastest figure
  // through their device count's measured plans, DualPipe, the only
  // two-device plan measured, put every two-stage ZB plan out of three
  // Fashion tunes (the grid trained two-stage ZB-H2 the fastest); within
  // 10% of the fastest's own prediction, ZB-H1 at 2 micro-batches (12%
  // behind zb-v at 4) was out of three reference tunes.
  //
  // The simplest within 50% joins too, first, where it is simpler than
  // every neighbour within 25% (alone where none is): a calibration beside
  // the neighbour misses by that much (stop 86: a busy Fashion tune in a
  // slow minute, 21.8% from the grid, put each simpler neighbour of
  // dualpipe at 4 micro-batches past 25%, never measured ZB-H1 at 2, the
  // grid's best, and chose one stage), and the calm model puts ZB-H1 at 2
  // 25% behind zb-v at 2 on `auto_memory_mlp`, where the two train within
  // 1.5% beside the neighbour. Beside near ones too: a busy
  // `auto_memory_mlp` tune (stop 88) let ZB-H1 and ZB-H2 at 4, dualpipe at
  // 4's neighbours within 25%, join, never measured ZB-H1 at 2, and chose
  // ZB-H2 at 4, 5.3% behind it in training.
  auto simplerNeighboursOf = [&](const TuneCandidate& plan, int leastDevices) {
    std::vector<size_t> near, further;
    for (size_t i = 0; i < all.size(); ++i) {
      if (!isASimplerNeighbour(all[i], plan) ||
          all[i].devices() < leastDevices || inOrATwinIn(i, measured))
        continue;
      if (all[i].predictedStepMs <= kWithinReach * plan.predictedStepMs)
        near.push_back(i);
      else if (all[i].predictedStepMs <= 1.5 * plan.predictedStepMs)
        further.push_back(i);
    }
    if (further.empty())
      return near;
    const size_t simplestFurther = *std::min_element(
        further.begin(), further.end(), [&](size_t a, size_t b) {
          return isSimplerPlan(all[a], all[b]);
        });
    if (std::all_of(near.begin(), near.end(), [&](size_t i) {
          return isSimplerPlan(all[simplestFurther], all[i]);
        }))
      near.push_back(simplestFurther);
    return near;
  };
  std::vector<size_t> neighbours = simplerNeighboursOf(fastestPlan, 1);
  // One stage has no simpler neighbour: where it reads the fastest, the
  // simpler neighbours on several devices of the fastest plan on several
  // devices come in, the plan the choice comes to if one stage's lead was
  // luck. Two busy tunes of `auto_memory_mlp` in stop 85 and one in stop 86
  // read one stage the fastest, never measured two-stage ZB-H1 at 2
  // micro-batches (the grid's best; the calm model puts it 6-25% behind
  // dualpipe at 4 and zb-v at 2), and chose one stage, 2-5% behind it in
  // training.
  if (neighbours.empty() && fastestPlan.devices() == 1) {
    std::optional<size_t> pipelined;
    for (size_t k = 0; k < measured.size(); ++k) {
      if (all[measured[k]].devices() > 1 &&
          (!pipelined || figures[k] < figures[*pipelined]))
        pipelined = k;
    }
    if (pipelined)
      neighbours = simplerNeighboursOf(all[measured[*pipelined]], 2);
  }
  std::stable_sort(
      neighbours.begin(), neighbours.end(), [&](size_t a, size_t b) {
        return isSimplerPlan(all[a], all[b]);
      });
  // Where no plan is clearly behind, the slowest that stays makes way all
  // the same: for the simplest neighbour, or where the fastest has none,
  // the next plan waiting. The simplest plan measured stays, the fallback
  // the choice may come to. A busy reference tune kept four plans within
  // 10%, never measured ZB-H1 or zb-v at 2 micro-batches (the grid's two
  // fastest), and chose one stage, 3.7% behind zb-v at 4 there and 12%
  // behind the best in training. Two more, on a machine where a step took
  // 250 ms, read one stage at 1 micro-batch the fastest, which has no
  // simpler neighbour; they kept three one-stage plans and dualpipe, and
  // chose one stage, 6% behind zb-v at 2 in training.
  if (next.size() == measured.size() &&
      (!neighbours.empty() || !waiting.empty())) {
    size_t simplest = 0;
    for (size_t k = 1; k < measured.size(); ++k) {
      if (isSimplerPlan(all[measured[k]], all[measured[simplest]]))
        simplest = k;
    }
    std::optional<size_t> slowest;
    for (size_t k = 0; k < measured.size(); ++k) {
      if (k != fastestAt && k != simplest &&
          (!slowest || figures[k] > figures[*slowest]))
        slowest = k;
    }
    if (slowest)
      next.erase(std::find(next.begin(), next.end(), measured[*slowest]));
  }
  auto join = [&](size_t i) {
    if (next.size() < measured.size() && !inOrATwinIn(i, next))
      next.push_back(i);
  };
  for (size_t i : neighbours)
    join(i);
  for (const auto& [anchored, i] : waiting)
    join(i);
  return next;
}

namespace {

// a's step over b's, round by round.
std::vector<double> perRoundRatios(
    const std::vector<double>& a,
    const std::vector<double>& b) {
  std::vector<double> ratios;
  for (size_t k = 0; k < std::min(a.size(), b.size()); ++k) {
    if (b[k] > 0.0)
      ratios.push_back(a[k] / b[k]);
  }
  return ratios;
}

// Every measured plan's figure, and what other processes wanted meanwhile:
// what a user needs to see why the choice fell where it did.
std::string measuredFiguresNote(
    const std::vector<TuneCandidate>& all,
    const std::vector<size_t>& measured,
    const std::vector<double>& figures,
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads) {
  std::ostringstream note;
  note << std::fixed << std::setprecision(2) << "measured ms:";
  for (size_t k = 0; k < measured.size(); ++k)
    note << (k == 0 ? " " : "; ") << all[measured[k]].label() << " "
         << figures[k];
  const std::optional<LoadSummary> load = loadOver(roundSteps, roundLoads);
  if (load)
    note << "; other processes wanted " << load->overTime
         << " cores over the turns' time (each turn " << load->least << " to "
         << load->most << ")";
  return note.str();
}

} // namespace

void chooseByMeasurement(
    TuneResult& result,
    const std::vector<size_t>& measured,
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads) {
  const bool paired = !measured.empty() &&
      measured.size() == roundSteps.size() &&
      std::all_of(roundSteps.begin(), roundSteps.end(), [&](const auto& steps) {
        return !steps.empty() && steps.size() == roundSteps.front().size();
      });
  if (!paired)
    throw std::invalid_argument(
        "chooseByMeasurement: one list of steps per measured plan, all as "
        "long");
  auto& all = result.candidates;
  for (size_t k = 0; k < measured.size(); ++k)
    all[measured[k]].measuredStepMs = lowerQuartile(roundSteps[k]);
  // Beside a neighbour, plans meet its bursts unequally, and training meets
  // them in their share: one stage on two threads, whose every operation
  // waits for both cores, ran the reference job 1.57x its calm step while
  // two one-thread stages ran 1.13x theirs. Calm, the one stage was the
  // fastest; as trained beside the neighbour it was 13% slower. So there
  // the plans are held against each other as training meets them.
  const StepsAtALoad beside = stepsBesideANeighbour(roundSteps, roundLoads);
  const bool neighbour = !beside.stepMs.empty();
  const bool byLoad = beside.fittedToTheLoad;
  const std::vector<double>& met = beside.stepMs;
  auto figure = [&](size_t k) {
    return neighbour ? met[k] : all[measured[k]].measuredStepMs;
  };
  size_t fastest = 0; // position in `measured`
  for (size_t k = 0; k < measured.size(); ++k) {
    if (figure(k) < figure(fastest))
      fastest = k;
  }
  std::vector<double> ratios(measured.size(), 1.0), spreads;
  std::vector<double> noise(measured.size(), 0.0);
  for (size_t k = 0; k < measured.size(); ++k) {
    if (k == fastest)
      continue;
    const std::vector<double> perRound =
        perRoundRatios(roundSteps[k], roundSteps[fastest]);
    ratios[k] = neighbour ? met[k] / met[fastest] : median(perRound);
    spreads.push_back(
        relativeSpread(perRound) /
        std::sqrt(static_cast<double>(std::max<size_t>(perRound.size(), 1))));
    // Bursts spread each plan's rounds: its figure is known as closely as
    // its mean (measuring goes on until that is within 4%, or 30 s), or,
    // where the neighbour's load was measured, as what the load leaves.
    if (neighbour)
      noise[k] =
          std::hypot(beside.relativeError[k], beside.relativeError[fastest]);
  }
  // At least 5%: in-turn steps and training's put two such plans in either
  // order (2 stages at 4 micro-batches measured 3% faster than 1 stage in
  // turn, and trained 4% slower), and a choice that flips between them
  // from run to run is worse than the 5% it may leave.
  const double tolerance = std::max(0.05, 2.0 * median(spreads));
  // On a calm machine, against a fastest plan on more devices, at least
  // 10%: one-thread stages are each bound to a core, so a neighbour that
  // comes later slows the whole pipeline (two stages at 4 micro-batches
  // trained 1.44x the one stage they had matched calm), and calm in-turn
  // steps put the two shapes 5-10% apart in either order. Beside a
  // neighbour, what it does to each shape is in the figures, and the
  // noise is the figures' own.
  auto allowed = [&](size_t k) {
    if (neighbour)
      return std::max(0.05, noise[k]);
    return all[measured[k]].devices() < all[measured[fastest]].devices()
        ? std::max(tolerance, 0.10)
        : tolerance;
  };
  // Calm, a plan whose figure is no slower than that of a plan within the
  // noise is within it too. The figure (a lower quartile) and the
  // round-by-round ratio are two statistics of one plan's rounds, and one
  // stage on two threads runs in two modes: a calm Fashion tune held one
  // stage at 2 micro-batches (11.93 ms) 6.3% behind dualpipe round by round
  // and one stage at 1 (11.38 ms) over 10%, and chose the one at 2, which
  // trained 6.8% slower than the one at 1. Beside a neighbour the figure is
  // the ratio's own, and each plan is held to its own noise.
  // Beside a neighbour, only a plan that holds less of the machine than the
  // fastest is let off its lead: holding as much, a simpler plan saves the
  // user nothing, and the neighbour's noise (5% and more) spans the gaps
  // between them. A busy reference tune kept two-stage ZB-H2 at 4
  // micro-batches within it of zb-v at 2, which trained 8.9% faster.
  auto mayLag = [&](size_t k) {
    return !neighbour ||
        holdsLess(all[measured[k]], all[measured[fastest]], result.cores);
  };
  constexpr size_t kNone = static_cast<size_t>(-1);
  std::vector<size_t> withinBy(measured.size(), kNone); // the plan it passed
  for (size_t k = 0; k < measured.size(); ++k) {
    if (k == fastest || (mayLag(k) && ratios[k] <= 1.0 + allowed(k)))
      withinBy[k] = k;
  }
  if (!neighbour) {
    for (size_t k = 0; k < measured.size(); ++k) {
      for (size_t j = 0; j < measured.size() && withinBy[k] == kNone; ++j) {
        if (withinBy[j] == j && figure(k) <= figure(j))
          withinBy[k] = j;
      }
    }
  }
  size_t best = fastest;
  for (size_t k = 0; k < measured.size(); ++k) {
    if (withinBy[k] != kNone &&
        isSimplerPlan(all[measured[k]], all[measured[best]]))
      best = k;
  }
  const TuneCandidate& chosen = all[measured[best]];
  const TuneCandidate& quickest = all[measured[fastest]];
  std::ostringstream note;
  note << std::fixed << std::setprecision(2) << "measured " << measured.size()
       << " plans in turn: " << chosen.label() << " ran " << figure(best)
       << (byLoad ? " ms per step at the load a neighbour put on training"
               : neighbour
               ? " ms per step as training meets a neighbour's bursts"
               : " ms per step (lower quartile)");
  if (best != fastest && withinBy[best] != best) {
    const size_t passed = withinBy[best];
    note << std::setprecision(1)
         << ", the simplest within the noise of the fastest: no slower than "
         << all[measured[passed]].label() << " (" << std::setprecision(2)
         << figure(passed) << " ms), itself within " << std::setprecision(1)
         << 100.0 * allowed(passed) << "% of " << quickest.label() << " ("
         << std::setprecision(2) << figure(fastest) << " ms; "
         << (neighbour ? "" : "round by round ") << std::setprecision(1)
         << 100.0 * (ratios[passed] - 1.0) << "% faster)";
  } else if (best != fastest) {
    note << std::setprecision(1) << ", the simplest within "
         << 100.0 * allowed(best) << "% (the noise) of the fastest, "
         << quickest.label() << " (" << std::setprecision(2) << figure(fastest)
         << " ms; " << (neighbour ? "" : "round by round ")
         << std::setprecision(1) << 100.0 * (ratios[best] - 1.0) << "% faster)";
  } else {
    note << ", the fastest";
  }
  if (measured[best] != result.choice) {
    // Its measured step, as the chosen plan's above: not its prediction,
    // which the ranking shows.
    const size_t predicted = static_cast<size_t>(
        std::find(measured.begin(), measured.end(), result.choice) -
        measured.begin());
    note << std::setprecision(2) << "; chosen over the prediction's choice, "
         << all[result.choice].label() << " (measured "
         << (predicted < measured.size() ? figure(predicted)
                                         : all[result.choice].measuredStepMs)
         << " ms)";
  }
  // The figures first: the choice's note stays the last word.
  std::vector<double> figures;
  for (size_t k = 0; k < measured.size(); ++k)
    figures.push_back(figure(k));
  result.notes.push_back(
      measuredFiguresNote(all, measured, figures, roundSteps, roundLoads));
  result.notes.push_back(note.str());
  result.choice = measured[best];
}

namespace {

// Fewer devices and cores, or the same devices with as many threads each.
// One stage on two threads against two one-thread stages is not: both hold
// both cores.
bool holdsNoMoreThan(
    const TuneCandidate& c,
    const TuneCandidate& other,
    int cores) {
  return holdsLess(c, other, cores) ||
      (c.devices() == other.devices() &&
       c.threadsPerStage == other.threadsPerStage);
}

// Whether a plan may be let off `fastest`'s lead for being simpler beside a
// neighbour: it holds no more of the machine, and it does not keep the
// backward whole on several devices where `fastest` splits it. Such a plan
// reads faster in turn against one that splits it than it trains: Fashion
// CNN's two-stage 1F1B at 2 micro-batches read 4% fast (stop 66; a tune
// chose it, 10% behind the grid's best), and a busy `auto_memory_mlp` tune
// (stop 88) read it within 2% of zb-v and ZB-H1 at 2 in its final, chose
// it, and trained it 13% behind ZB-H1 at 2.
bool letOffAgainst(
    const TuneCandidate& c,
    const TuneCandidate& fastest,
    int cores) {
  const bool keepsWholeWhereTheFastestSplits = c.devices() > 1 &&
      !splitsTheBackward(c.schedule) && splitsTheBackward(fastest.schedule);
  return holdsNoMoreThan(c, fastest, cores) && !keepsWholeWhereTheFastestSplits;
}

// Position in `plans` (of `all`) of the simplest plan within `margin` of the
// fastest (`figures`, one per plan) that may be let off its lead
// (letOffAgainst); the fastest where no such plan is simpler.
size_t simplestNearTheFastest(
    const std::vector<TuneCandidate>& all,
    const std::vector<size_t>& plans,
    const std::vector<double>& figures,
    double margin,
    int cores) {
  const size_t fastest = static_cast<size_t>(
      std::min_element(figures.begin(), figures.end()) - figures.begin());
  size_t simplest = fastest;
  for (size_t k = 0; k < plans.size(); ++k) {
    const TuneCandidate& c = all[plans[k]];
    if (letOffAgainst(c, all[plans[fastest]], cores) &&
        figures[k] / figures[fastest] - 1.0 <= margin &&
        isSimplerPlan(c, all[plans[simplest]]))
      simplest = k;
  }
  return simplest;
}

} // namespace

std::vector<size_t> rivalsOfTheChoice(
    const TuneResult& result,
    const std::vector<size_t>& measured,
    const std::vector<double>& figures) {
  if (figures.size() != measured.size())
    throw std::invalid_argument(
        "rivalsOfTheChoice: one figure per measured plan");
  if (std::find(measured.begin(), measured.end(), result.choice) ==
      measured.end())
    return {};
  // However far ahead the choice reads: among plans that meet bursts
  // unequally a lead past 10% may be one plan's luck. A busy Fashion tune
  // read three-stage ZB-H1 at 8 micro-batches 36.3 ms a step, 11% ahead of
  // the next, chose it without a duel, and trained it 13% behind three-stage
  // ZB-H2 at 4 (52.1 ms against 46.0).
  std::vector<size_t> others; // positions in `measured`
  for (size_t k = 0; k < measured.size(); ++k) {
    if (measured[k] != result.choice)
      others.push_back(k);
  }
  std::stable_sort(others.begin(), others.end(), [&](size_t a, size_t b) {
    return figures[a] < figures[b];
  });
  std::vector<size_t> rivals;
  for (size_t k = 0; k < std::min(others.size(), kRivalsInTheFinal); ++k)
    rivals.push_back(measured[others[k]]);
  // The final names the simplest plan near the fastest, so that plan must
  // be in it, though it read only third or fourth in turn: two busy tunes
  // of ten left two-stage ZB-H1 at 2 micro-batches out (2.6% and 6.2%
  // behind in turn) and named a plan each that other tunes did not.
  auto join = [&](size_t plan) {
    if (plan != result.choice &&
        std::find(rivals.begin(), rivals.end(), plan) == rivals.end())
      rivals.push_back(plan);
  };
  const size_t simplest = measured[simplestNearTheFastest(
      result.candidates, measured, figures, kFinalAdmission, result.cores)];
  join(simplest);
  // A choice that is itself that plan but holds more of the machine than a
  // rival (one stage on two threads against two one-thread stages) is let
  // off nothing against it, and a final it loses names the simplest of the
  // others near their fastest: that plan must be in it too. Two busy
  // Fashion tunes of five chose one stage in turn, lost it to two-stage
  // ZB-H2 at 4 in the final, and named that plan, where the other three
  // named two-stage ZB-H1 at 2 (3.9% behind in turn; trained 1.3% ahead).
  const TuneCandidate& chosen = result.candidates[result.choice];
  const bool notLetOffAgainstARival =
      std::any_of(rivals.begin(), rivals.end(), [&](size_t rival) {
        return !letOffAgainst(chosen, result.candidates[rival], result.cores);
      });
  if (simplest == result.choice && notLetOffAgainstARival) {
    std::vector<size_t> plans;
    std::vector<double> theirFigures;
    for (size_t k : others) {
      plans.push_back(measured[k]);
      theirFigures.push_back(figures[k]);
    }
    join(plans[simplestNearTheFastest(
        result.candidates,
        plans,
        theirFigures,
        kFinalAdmission,
        result.cores)]);
  }
  return rivals;
}

namespace {

// The finalists' figures of the final and of the rounds in turn before it,
// pooled. The machine runs a few percent faster or slower from one window
// of seconds to the next (the same plan read 3.7-7% apart between a busy
// tune's two windows), and alike for every plan within one: so each
// plan's log step is its own time plus its window's, fitted by weighted
// least squares, each figure weighted by its inverse variance. The
// windows' difference is the weighted mean of the plans' differences
// between them, and the level the pooled figures stand at is both
// windows', weighted by how closely each knew its plans. Taken alone, a
// busy reference final read zb-v at 4 micro-batches 1.2% ahead of zb-v at
// 2, within their combined error of 2.4%; the rounds in turn just before
// had read it 6.8% behind, and the grid trained it 6.4% behind.
// `inTurnSlower` becomes how much slower the rounds in turn ran, where they
// were pooled.
StepsAtALoad pooledWithTheRoundsInTurn(
    const StepsAtALoad& final,
    const StepsAtALoad& inTurn,
    std::optional<double>& inTurnSlower) {
  const size_t n = final.stepMs.size();
  auto usable = [n](const StepsAtALoad& figures) {
    if (figures.stepMs.size() != n || figures.relativeError.size() != n)
      return false;
    for (size_t k = 0; k < n; ++k) {
      if (!(figures.stepMs[k] > 0.0) || !(figures.relativeError[k] > 0.0))
        return false;
    }
    return true;
  };
  if (n == 0 || !usable(final) || !usable(inTurn))
    return final;
  auto weight = [](double relativeError) {
    return 1.0 / (relativeError * relativeError);
  };
  // The in-turn window's offset from the final's, in log step.
  double offsetSum = 0.0, offsetWeights = 0.0;
  double finalWeights = 0.0, inTurnWeights = 0.0;
  for (size_t k = 0; k < n; ++k) {
    const double e = final.relativeError[k], f = inTurn.relativeError[k];
    const double w = 1.0 / (e * e + f * f);
    offsetSum += w * std::log(inTurn.stepMs[k] / final.stepMs[k]);
    offsetWeights += w;
    finalWeights += weight(e);
    inTurnWeights += weight(f);
  }
  const double offset = offsetSum / offsetWeights;
  inTurnSlower = std::exp(offset) - 1.0;
  const double level = offset * inTurnWeights / (finalWeights + inTurnWeights);
  StepsAtALoad pooled;
  pooled.fittedToTheLoad = final.fittedToTheLoad;
  for (size_t k = 0; k < n; ++k) {
    const double w = weight(final.relativeError[k]);
    const double v = weight(inTurn.relativeError[k]);
    const double logStep = (w * std::log(final.stepMs[k]) +
                            v * (std::log(inTurn.stepMs[k]) - offset)) /
        (w + v);
    pooled.stepMs.push_back(std::exp(logStep + level));
    pooled.relativeError.push_back(1.0 / std::sqrt(w + v));
  }
  return pooled;
}

} // namespace

void settleByAFinal(
    TuneResult& result,
    const std::vector<size_t>& rivals,
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads,
    const StepsAtALoad& inTurn) {
  auto& all = result.candidates;
  std::vector<size_t> finalists{result.choice};
  finalists.insert(finalists.end(), rivals.begin(), rivals.end());
  bool valid = !rivals.empty() && roundSteps.size() == finalists.size() &&
      !roundSteps[0].empty();
  for (size_t k = 0; valid && k < finalists.size(); ++k) {
    valid = roundSteps[k].size() == roundSteps[0].size() &&
        finalists[k] < all.size() &&
        std::count(finalists.begin(), finalists.end(), finalists[k]) == 1;
  }
  if (!valid)
    throw std::invalid_argument(
        "settleByAFinal: rivals other than the choice and each other, and a "
        "list of steps for the choice and each rival, all as long");
  const StepsAtALoad finalAlone = stepsBesideANeighbour(roundSteps, roundLoads);
  std::optional<double> inTurnSlower;
  const StepsAtALoad atLoad =
      pooledWithTheRoundsInTurn(finalAlone, inTurn, inTurnSlower);
  std::ostringstream note;
  note << std::fixed << std::setprecision(2) << "measured "
       << all[result.choice].label() << " alone in turn with ";
  for (size_t k = 1; k < finalists.size(); ++k)
    note << (k == 1                          ? ""
                 : k + 1 == finalists.size() ? " and "
                                             : ", ")
         << all[finalists[k]].label();
  note << " (" << roundSteps[0].size() << " rounds)";
  if (atLoad.stepMs.empty()) {
    note << ": the neighbour no longer showed, and the choice stands";
    result.notes.push_back(note.str());
    return;
  }
  const std::vector<double>& figures = atLoad.stepMs;
  size_t fastest = 0; // position in `finalists`
  for (size_t k = 1; k < finalists.size(); ++k) {
    if (figures[k] < figures[fastest])
      fastest = k;
  }
  // The simplest plan within kFinalMargin of the fastest that holds no more
  // of the machine than it (holdsLess, or the same devices and threads) is
  // chosen. Beside a neighbour a busy tune knows each plan to 1-3%, and its
  // windows disagree by more: four two-device plans trained the reference
  // job within 3.0-6.4% of each other, and the fastest of them in a tune's
  // final was each of them by turns (two of five tunes agreed, and four of
  // five in a run whose fifth chose a plan 6.4% behind). Plans this close
  // are alike as far as a tune can tell, and the simplest of them is one
  // plan every tune names. A plan that holds more (one stage on two
  // threads against two one-thread stages: both cores either way) is let
  // off nothing: it trained 4.6-15% behind the best.
  const size_t winner = simplestNearTheFastest(
      all, finalists, figures, kFinalMargin, result.cores);
  auto holdsNoMore = [&](size_t k) {
    return holdsNoMoreThan(
        all[finalists[k]], all[finalists[fastest]], result.cores);
  };
  auto letOff = [&](size_t k) {
    return letOffAgainst(
        all[finalists[k]], all[finalists[fastest]], result.cores);
  };
  auto behind = [&](size_t k) { return figures[k] / figures[fastest] - 1.0; };
  for (size_t k = 0; k < finalists.size(); ++k)
    all[finalists[k]].measuredStepMs = figures[k];
  for (size_t k = 0; k < finalists.size(); ++k)
    note << (k == 0                          ? ": "
                 : k + 1 == finalists.size() ? " and "
                                             : ", ")
         << figures[k];
  note << (atLoad.fittedToTheLoad
               ? " ms per step at the load a neighbour put on training"
               : " ms per step as training meets a neighbour's bursts")
       << " (each known within " << std::setprecision(1);
  for (size_t k = 0; k < finalists.size(); ++k)
    note << (k == 0                          ? ""
                 : k + 1 == finalists.size() ? " and "
                                             : ", ")
         << 100.0 * atLoad.relativeError[k] << "%";
  note << ")";
  if (inTurnSlower) {
    note << std::setprecision(2)
         << ", pooled with their rounds in turn before it (the final alone: ";
    for (size_t k = 0; k < finalists.size(); ++k)
      note << (k == 0                          ? ""
                   : k + 1 == finalists.size() ? " and "
                                               : ", ")
           << finalAlone.stepMs[k];
    note << " ms; the rounds in turn ran " << std::setprecision(1)
         << 100.0 * std::abs(*inTurnSlower) << "% "
         << (*inTurnSlower >= 0.0 ? "slower" : "faster") << ")";
  }
  note << "; " << all[finalists[winner]].label();
  if (winner != fastest)
    note << ", the simplest within " << 100.0 * kFinalMargin
         << "% of the fastest, " << all[finalists[fastest]].label() << " ("
         << 100.0 * behind(winner) << "% behind it)";
  bool simplerBehind = false;
  for (size_t k = 0; k < finalists.size(); ++k) {
    if (k == winner ||
        !isSimplerPlan(all[finalists[k]], all[finalists[winner]]))
      continue;
    simplerBehind = true;
    const std::string label = all[finalists[k]].label();
    note << std::setprecision(1);
    if (!holdsNoMore(k))
      note << "; on as many cores, " << label << " takes " << 100.0 * behind(k)
           << "% longer a step";
    else if (!letOff(k))
      note << "; " << label << " takes " << 100.0 * behind(k)
           << "% longer a step, let off nothing: it keeps the backward whole "
              "where the fastest splits it";
    else
      note << "; the simpler " << label << " takes " << 100.0 * behind(k)
           << "% longer a step, past " << 100.0 * kFinalMargin << "%";
  }
  if (!simplerBehind && winner == fastest)
    note << ", the simplest, runs no slower";
  note
      << (finalists[winner] == result.choice ? "; the choice stands"
                                             : "; chosen instead");
  result.notes.push_back(note.str());
  result.choice = finalists[winner];
}

bool aFinalIsSettled(
    const std::vector<TuneCandidate>& finalists,
    const StepsAtALoad& figures,
    int cores) {
  const std::vector<double>& ms = figures.stepMs;
  if (ms.empty())
    return true;
  if (ms.size() != finalists.size() ||
      figures.relativeError.size() != finalists.size())
    throw std::invalid_argument(
        "aFinalIsSettled: one figure and one error per finalist");
  const size_t fastest =
      static_cast<size_t>(std::min_element(ms.begin(), ms.end()) - ms.begin());
  for (size_t k = 0; k < ms.size(); ++k) {
    if (k == fastest)
      continue;
    const double error =
        std::hypot(figures.relativeError[k], figures.relativeError[fastest]);
    if (error <= kFinalError)
      continue;
    const double lag = ms[k] / ms[fastest] - 1.0;
    if (lag <= 2.0 * error)
      return false;
    const bool letOff =
        letOffAgainst(finalists[k], finalists[fastest], cores) &&
        isSimplerPlan(finalists[k], finalists[fastest]);
    if (letOff && std::abs(lag - kFinalMargin) <= 2.0 * error)
      return false;
  }
  return true;
}

namespace {

// What the search spans, with the request's defaults filled in.
struct Space {
  std::vector<int> stageCounts;
  std::vector<ScheduleKind> schedules;
  std::vector<CheckpointMode> checkpoints;
};

Space spaceOf(const CostModel& model, const TuneRequest& request) {
  Space space;
  space.stageCounts = request.stageCounts;
  if (space.stageCounts.empty()) {
    const int most = std::min(
        static_cast<int>(request.devices.size()),
        static_cast<int>(model.layers.size()));
    for (int p = 1; p <= most; ++p)
      space.stageCounts.push_back(p);
  }
  space.schedules =
      request.schedules.empty() ? allSchedules() : request.schedules;
  space.checkpoints = request.checkpoints;
  if (space.checkpoints.empty()) {
    space.checkpoints = {
        CheckpointMode::kNever,
        CheckpointMode::kExceptLast,
        CheckpointMode::kAlways};
  }
  return space;
}

std::vector<int> microBatchCounts(const TuneRequest& request, int64_t batch) {
  std::vector<int> counts;
  for (int m : request.microBatches) {
    if (m >= 1 && m <= batch)
      counts.push_back(m);
  }
  if (request.microBatches.empty()) {
    // Every count that splits the batch evenly (published runs use 24, 48,
    // 96, ...), up to 1024, and the powers of two up to 256.
    for (int64_t m = 1; m <= batch && m <= 1024; ++m) {
      const bool power = (m & (m - 1)) == 0 && m <= 256;
      if (batch % m == 0 || power)
        counts.push_back(static_cast<int>(m));
    }
  }
  return counts;
}

// The link after global device `device` (to device + 1).
Link linkAfter(const Topology& topology, int device) {
  if (topology.devicesPerNode <= 0)
    return topology.intraNode;
  const bool crosses = (device + 1) % topology.devicesPerNode == 0;
  return crosses ? topology.interNode : topology.intraNode;
}

// The ring all-reduce of every stage's gradients across replicas, after the
// flush: 2 (d - 1) / d of the bytes each way, 2 (d - 1) latencies.
double allReduceMs(
    const TuneRequest& request,
    const std::vector<LayerCost>& layers,
    const std::vector<int>& boundaries,
    int ranks,
    int replicas) {
  if (replicas <= 1)
    return 0.0;
  const Topology& topology = request.topology;
  const bool acrossNodes =
      topology.devicesPerNode > 0 && ranks * replicas > topology.devicesPerNode;
  const Link& link = acrossNodes ? topology.interNode : topology.intraNode;
  const double d = static_cast<double>(replicas);
  double worst = 0.0;
  for (size_t k = 0; k + 1 < boundaries.size(); ++k) {
    double bytes = 0.0;
    for (int l = boundaries[k]; l < boundaries[k + 1]; ++l)
      bytes += static_cast<double>(layers[l].paramBytes);
    const double ms = 2.0 * (d - 1.0) * link.latencyMs +
        (link.bytesPerMs > 0.0 ? 2.0 * (d - 1.0) / d * bytes / link.bytesPerMs
                               : 0.0);
    worst = std::max(worst, ms);
  }
  return worst;
}

// A candidate's settings before it is evaluated.
struct Setting {
  Setting(
      int ranks,
      int replicas,
      int threads,
      int microBatches,
      int64_t batch,
      ScheduleKind schedule,
      CheckpointMode checkpoint)
      : ranks(ranks),
        replicas(replicas),
        threads(threads),
        microBatches(microBatches),
        batch(batch),
        schedule(schedule),
        checkpoint(checkpoint) {}
  int ranks, replicas, threads, microBatches;
  int64_t batch; // per replica
  ScheduleKind schedule;
  CheckpointMode checkpoint;
  // Pinned by predictCandidate; the search leaves the defaults.
  int virtualStages = 0;       // 0: virtualStagesOf(schedule)
  int inFlightLimit = 0;       // auto's; 0: the ranks
  std::vector<int> boundaries; // empty: the time-optimal partition
};

int virtualStagesIn(const Setting& s) {
  return s.virtualStages > 0 ? s.virtualStages : virtualStagesOf(s.schedule);
}

// On CPU the stage workers share the machine's cores: the replicas run the
// same timeline at once, each computing rank with its threads. Stretching
// only the time that oversubscribes charges a plan for the workers that
// really compute together; charging every layer workers / cores as if all
// always did over-predicted plans of 3 and 4 stages on 2 cores by 30-120%,
// the more the larger their bubble. What sharing costs beyond the fair
// share is charged per pass a worker is woken for (sharedWakeupMs).
CoreSharing coreSharing(const TuneRequest& request, const Setting& s) {
  CoreSharing sharing;
  if (request.cores > 0) {
    sharing.cores = request.cores;
    sharing.coresPerRank = static_cast<double>(s.threads) * s.replicas;
  }
  return sharing;
}

PlanRequest planRequestFor(
    const CostModel& model,
    const TuneRequest& request,
    const Setting& s,
    double microBatchSize) {
  PlanRequest plan;
  plan.layers = model.costsAt(microBatchSize, s.threads);
  // Stages computing at once slow one another on shared memory bandwidth
  // and caches; sharing the cores themselves is coreSharing's.
  if (s.ranks > 1 && model.concurrentSlowdown != 1.0) {
    for (auto& layer : plan.layers) {
      layer.forwardMs *= model.concurrentSlowdown;
      layer.backwardMs *= model.concurrentSlowdown;
    }
  }
  plan.costSource = model.source;
  plan.costNoise = model.noise;
  for (int r = 0; r < s.ranks; ++r) {
    DeviceSpec device = request.devices[static_cast<size_t>(r)];
    const Link link = linkAfter(request.topology, r);
    device.linkBytesPerMs = link.bytesPerMs;
    device.linkLatencyMs = link.latencyMs;
    plan.devices.push_back(device);
  }
  plan.virtualStages = virtualStagesIn(s);
  plan.stages = s.ranks * plan.virtualStages;
  plan.partition = PartitionMethod::kTime;
  if (!s.boundaries.empty()) {
    plan.partition = PartitionMethod::kBalance;
    plan.balance = balanceOf(s.boundaries);
  }
  plan.inFlightLimit = s.inFlightLimit;
  plan.schedule = s.schedule;
  plan.microBatches = s.microBatches;
  plan.checkpoint = s.checkpoint;
  plan.optimizerFactor = request.optimizerFactor;
  plan.directWeightGradients = request.directWeightGradients;
  plan.speculativeUpdates = request.speculativeUpdates;
  plan.instructionMs = model.instructionMsAt(s.threads);
  plan.splitBackward = model.splitBackward;
  plan.inputBytes = static_cast<int64_t>(
      std::llround(model.inputBytesPerSample * microBatchSize));
  plan.threadsPerDevice = request.cores > 0 ? s.threads : 0;
  return plan;
}

// Peak bytes per device (a device holding several stages holds them all);
// false, with the reason set, when one exceeds its capacity. `beyondOne`:
// the most activations a device holds beyond one micro-batch per stage,
// which is what a working set larger than the profile's costs in time.
bool fitsDevices(
    const Plan& plan,
    const PlanRequest& request,
    TuneCandidate& c,
    double& beyondOne) {
  c.peakBytes.assign(static_cast<size_t>(c.ranks), 0);
  std::vector<int64_t> activations(static_cast<size_t>(c.ranks), 0);
  std::vector<double> extra(static_cast<size_t>(c.ranks), 0.0);
  for (int k = 0; k < plan.stageCount(); ++k) {
    const StageReport& stage = plan.stages[k];
    const int rank = plan.schedule.rankOfStage(k);
    c.peakBytes[rank] += stage.memoryBytes;
    activations[rank] += stage.activationBytes;
    if (stage.inFlight > 1)
      extra[rank] += static_cast<double>(stage.activationBytes) *
          (stage.inFlight - 1) / stage.inFlight;
  }
  c.peakActivationBytes =
      *std::max_element(activations.begin(), activations.end());
  beyondOne = *std::max_element(extra.begin(), extra.end());
  for (int r = 0; r < c.ranks; ++r) {
    const int64_t capacity = request.devices[r].memoryBytes;
    if (capacity > 0 && c.peakBytes[r] > capacity) {
      c.infeasible = "device " + std::to_string(r) + " would hold " +
          formatBytes(c.peakBytes[r]) + " of its " + formatBytes(capacity) +
          " with " + std::to_string(c.virtualStages) + " stages on it";
      return false;
    }
  }
  return true;
}

// "auto" is the list scheduler on the candidate's own stage costs: the
// resolver's unit-cost schedule only chose the partition.
PlanRequest withStageCosts(PlanRequest request, const Plan& plan) {
  std::vector<DeviceSpec> devices;
  for (int k = 0; k < plan.stageCount(); ++k)
    devices.push_back(request.devices[plan.schedule.rankOfStage(k)]);
  std::vector<StageCosts> costs = stageCostsOf(
      request.layers,
      devices,
      plan.boundaries,
      request.instructionMs,
      request.splitBackward);
  return pinnedRequest(std::move(request), plan, std::move(costs));
}

Setting settingOf(
    const CostModel& model,
    const TuneRequest& request,
    const TuneCandidate& c) {
  Setting s{
      c.ranks,
      c.dataParallel,
      request.cores > 0 ? c.threadsPerStage : model.threads.front(),
      c.microBatches,
      request.batchSize / c.dataParallel,
      c.schedule,
      c.checkpoint};
  if (c.schedule == ScheduleKind::kInterleaved && c.virtualStages > 1)
    s.virtualStages = c.virtualStages;
  s.inFlightLimit = c.inFlightLimit;
  s.boundaries = c.boundaries;
  return s;
}

// What a candidate runs: its partition, threads, micro-batches, checkpoint
// mode and every rank's instructions in order. Two plans with the same
// program train alike whatever their schedules are called (ZB-H1 and ZB-H2 at
// 2 micro-batches on 2 ranks; the three ZB-V variants there), so the search
// lists them once.
std::string programOf(
    const TuneCandidate& c,
    const Setting& s,
    const Schedule& schedule) {
  std::ostringstream key;
  key << s.ranks << ' ' << s.replicas << ' ' << s.threads << ' '
      << s.microBatches << ' ' << checkpointModeName(s.checkpoint) << " |";
  for (int b : c.boundaries)
    key << ' ' << b;
  key << " | " << schedule.virtualStages << ' ' << schedule.chains << " |";
  for (int rank : schedule.placement)
    key << ' ' << rank;
  for (const auto& list : schedule.perRank) {
    key << " |";
    for (const Instruction& instruction : list)
      key << ' ' << opName(instruction) << ':' << stageOf(instruction) << ':'
          << microBatchOf(instruction);
  }
  return key.str();
}

// `program`, where given and the plan can run: programOf the plan. `auto`
// gives none: training rebuilds its schedule from measured stage times.
TuneCandidate evaluate(
    const CostModel& model,
    const TuneRequest& request,
    const Setting& s,
    std::string* program = nullptr) {
  TuneCandidate c;
  c.ranks = s.ranks;
  c.dataParallel = s.replicas;
  c.threadsPerStage = request.cores > 0 ? s.threads : 0;
  c.microBatches = s.microBatches;
  c.schedule = s.schedule;
  c.checkpoint = s.checkpoint;
  c.virtualStages = virtualStagesIn(s);
  c.inFlightLimit = s.inFlightLimit;
  c.stages = s.ranks * c.virtualStages;
  // Uneven splits differ by one sample: the mean size stands for them.
  const double size = static_cast<double>(s.batch) / s.microBatches;
  const PlanRequest planRequest = planRequestFor(model, request, s, size);
  Plan plan;
  try {
    plan = resolvePlan(planRequest);
  } catch (const UserError& error) {
    c.infeasible = error.what();
    return c;
  }
  c.boundaries = plan.boundaries;
  double heldBeyondOne = 0.0;
  if (!fitsDevices(plan, planRequest, c, heldBeyondOne))
    return c;
  PlanRequest costed = withStageCosts(planRequest, plan);
  const CoreSharing sharing = coreSharing(request, s);
  const bool charged = model.sharedWakeupMs > 0 && sharing.cores > 0 &&
      s.ranks * sharing.coresPerRank > sharing.cores;
  if (charged) {
    // Charged to the passes a worker is woken for (a peer's activation or
    // gradient); a weight pass follows its input pass on the same worker.
    for (StageCosts& stage : costed.stageCosts) {
      stage.forward += model.sharedWakeupMs;
      stage.backward += model.sharedWakeupMs;
      stage.backwardInput += model.sharedWakeupMs;
    }
  }
  const bool resimulated = charged && s.schedule != ScheduleKind::kAuto;
  const Plan run =
      s.schedule == ScheduleKind::kAuto ? resolvePlan(costed) : plan;
  if (program && s.schedule != ScheduleKind::kAuto)
    *program = programOf(c, s, run.schedule);
  // Under calibrated costs.
  const Simulation simulation =
      resimulated ? simulate(run.schedule, costed.stageCosts) : run.simulation;
  c.bubble = simulation.bubbleFraction;
  c.allReduceMs = allReduceMs(
      request, planRequest.layers, plan.boundaries, s.ranks, s.replicas);
  const bool overlapped = request.overlapSteps && s.ranks > 1;
  const double pipelineMs = overlapped
      ? steadyStepTime(run.schedule, costed.stageCosts, sharing)
      : sharedCoresMakespan(run.schedule, simulation, sharing);
  c.predictedStepMs = pipelineMs + model.stepMs + c.allReduceMs +
      model.heldByteMs * heldBeyondOne;
  c.samplesPerSecond =
      static_cast<double>(request.batchSize) * 1000.0 / c.predictedStepMs;
  return c;
}

// Threads per stage worker: the cores shared fairly, rounded down to a
// count the model has times for. 0: the stages need more cores than exist.
int threadsFor(const CostModel& model, const TuneRequest& request, int ranks) {
  if (request.cores <= 0)
    return model.threads.front();
  const int fair = request.cores / ranks;
  int best = 0;
  for (int t : model.threads) {
    if (t <= fair)
      best = std::max(best, t);
  }
  return best;
}

TuneCandidate unrunnable(int ranks, int replicas, std::string why) {
  TuneCandidate c;
  c.ranks = c.stages = ranks;
  c.dataParallel = replicas;
  c.infeasible = std::move(why);
  return c;
}

// Returns how many plans ran the same program as a simpler one listed.
int searchStageCount(
    const CostModel& model,
    const TuneRequest& request,
    const Space& space,
    int ranks,
    std::vector<TuneCandidate>& out) {
  const int devices = static_cast<int>(request.devices.size());
  const int replicas = request.replicate ? devices / ranks : 1;
  if (request.replicate && devices % ranks != 0)
    return 0; // every device is used: only stage counts that divide them
  if (request.batchSize % replicas != 0) {
    out.push_back(unrunnable(
        ranks,
        replicas,
        "the batch (" + std::to_string(request.batchSize) +
            ") does not split evenly over " + std::to_string(replicas) +
            " replicas"));
    return 0;
  }
  std::map<std::string, size_t> listed; // program -> its place in `out`
  int merged = 0;
  // More stage workers than cores share them with their fewest threads:
  // slower, but the way to fit a model that fewer devices cannot hold.
  int threads = threadsFor(model, request, ranks * replicas);
  if (threads == 0)
    threads = *std::min_element(model.threads.begin(), model.threads.end());
  const int64_t batch = request.batchSize / replicas;
  std::vector<ScheduleKind> oneStageKinds;
  for (ScheduleKind kind : space.schedules) {
    if (scheduleRank(kind) <= 1)
      oneStageKinds.push_back(kind);
  }
  for (int m : microBatchCounts(request, batch)) {
    // Fewer micro-batches than stages leaves most stages idle most of the
    // step: never the fastest way to fill the devices, so not searched.
    if (m < ranks)
      continue;
    for (ScheduleKind kind : space.schedules) {
      // One stage: every schedule is fill-drain or 1F1B, and one
      // micro-batch makes those two the same instructions (listed once).
      if (ranks == 1 &&
          (scheduleRank(kind) > 1 || (m == 1 && kind != oneStageKinds[0])))
        continue;
      for (CheckpointMode mode : space.checkpoints) {
        // The last stage never recomputes: except_last is never there.
        if (ranks == 1 && mode == CheckpointMode::kExceptLast &&
            std::count(
                space.checkpoints.begin(),
                space.checkpoints.end(),
                CheckpointMode::kNever))
          continue;
        std::string program;
        TuneCandidate c = evaluate(
            model,
            request,
            {ranks, replicas, threads, m, batch, kind, mode},
            &program);
        const auto [found, fresh] = listed.emplace(program, out.size());
        if (program.empty() || fresh) {
          out.push_back(std::move(c));
          continue;
        }
        ++merged; // the simpler name stands for both
        if (isSimplerPlan(c, out[found->second]))
          out[found->second] = std::move(c);
      }
    }
  }
  return merged;
}

void checkRequest(const CostModel& model, const TuneRequest& request) {
  if (model.layers.empty())
    throw UserError("tune: the cost model has no layers");
  if (model.threads.empty())
    throw UserError("tune: the cost model has no thread counts");
  for (const auto& layer : model.layers) {
    if (layer.forward.size() != model.threads.size() ||
        layer.backward.size() != model.threads.size()) {
      throw UserError(
          "tune: layer " + layer.name + " lacks times for some thread count");
    }
  }
  if (request.devices.empty())
    throw UserError("tune: no devices given");
  if (request.batchSize < 1)
    throw UserError("tune: the batch size must be >= 1");
}

// The fastest first, the infeasible last; the simplest within the noise of
// the fastest is chosen.
void rank(const CostModel& model, TuneResult& result) {
  auto& all = result.candidates;
  std::stable_sort(all.begin(), all.end(), rankedBefore);
  const double bound = all.front().predictedStepMs * (1.0 + model.noise);
  result.choice = 0;
  for (size_t i = 1; i < all.size(); ++i) {
    if (!all[i].infeasible.empty() || all[i].predictedStepMs > bound)
      break;
    if (isSimplerPlan(all[i], all[result.choice]))
      result.choice = i;
  }
}

std::string percent(double fraction) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f%%", 100.0 * fraction);
  return text;
}

void explain(const TuneRequest& request, TuneResult& result) {
  const TuneCandidate& choice = result.candidates[result.choice];
  const TuneCandidate& fastest = result.candidates.front();
  if (result.choice != 0) {
    result.notes.push_back(
        "chose the simpler " + choice.label() + ": the fastest (" +
        fastest.label() + ") predicts " +
        percent(1.0 - fastest.predictedStepMs / choice.predictedStepMs) +
        " less, within the cost noise");
  }
  bool oneFits = false;
  for (const auto& c : result.candidates)
    oneFits = oneFits ||
        (c.ranks == 1 && c.dataParallel == 1 && c.infeasible.empty());
  if (choice.ranks == 1 && choice.dataParallel == 1 &&
      request.devices.size() > 1) {
    result.notes.push_back(
        "pipelining does not pay here: one stage with " +
        std::to_string(choice.threadsPerStage) +
        " thread(s) is predicted fastest");
  } else if (!oneFits) {
    result.notes.push_back(
        "the model does not fit one device: the fastest plan that fits is "
        "chosen");
  }
}

} // namespace

TuneResult tunePlans(const CostModel& model, const TuneRequest& request) {
  const auto start = std::chrono::steady_clock::now();
  checkRequest(model, request);
  const Space space = spaceOf(model, request);
  TuneResult result;
  result.cores = request.cores;
  result.costSource = model.source;
  int sameProgram = 0;
  for (int ranks : space.stageCounts) {
    if (ranks >= 1 && ranks <= static_cast<int>(request.devices.size()))
      sameProgram +=
          searchStageCount(model, request, space, ranks, result.candidates);
  }
  if (result.feasible() == 0) {
    std::map<std::string, int> reasons;
    for (const auto& c : result.candidates)
      ++reasons[c.infeasible];
    std::string text = "tune: no plan can run:";
    int listed = 0;
    for (const auto& [why, count] : reasons) {
      if (++listed > 6) {
        text += "\n  ... and " + std::to_string(reasons.size() - 6) +
            " more reasons";
        break;
      }
      text += "\n  " + why + " (" + std::to_string(count) + " candidates)";
    }
    throw UserError(text);
  }
  rank(model, result);
  explain(request, result);
  if (sameProgram > 0)
    result.notes.push_back(
        std::to_string(sameProgram) +
        " plans run the same instructions as a simpler one: each is listed "
        "once, under the simpler schedule");
  result.searchMs = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - start)
                        .count();
  return result;
}

TuneCandidate predictCandidate(
    const CostModel& model,
    const TuneRequest& request,
    const TuneCandidate& shape) {
  checkRequest(model, request);
  return evaluate(model, request, settingOf(model, request, shape));
}

PlanRequest candidatePlanRequest(
    const CostModel& model,
    const TuneRequest& request,
    const TuneCandidate& c) {
  checkRequest(model, request);
  const Setting s = settingOf(model, request, c);
  PlanRequest pinned = planRequestFor(
      model, request, s, static_cast<double>(s.batch) / s.microBatches);
  pinned.partition = PartitionMethod::kBalance;
  pinned.balance = balanceOf(c.boundaries);
  if (c.schedule == ScheduleKind::kAuto)
    pinned = withStageCosts(pinned, resolvePlan(pinned));
  return pinned;
}

nlohmann::json tuneCandidateToJson(const TuneCandidate& c) {
  nlohmann::json json = {
      {"stages", c.stages},
      {"ranks", c.ranks},
      {"micro_batches", c.microBatches},
      {"schedule", scheduleKindName(c.schedule)},
      {"checkpoint", checkpointModeName(c.checkpoint)},
      {"virtual_stages", c.virtualStages},
      {"threads_per_stage", c.threadsPerStage},
      {"data_parallel", c.dataParallel},
      {"boundaries", c.boundaries}};
  if (c.inFlightLimit > 0)
    json["in_flight_limit"] = c.inFlightLimit;
  if (!c.infeasible.empty()) {
    json["infeasible"] = c.infeasible;
    return json;
  }
  json["predicted_step_ms"] = c.predictedStepMs;
  json["samples_per_s"] = c.samplesPerSecond;
  json["bubble"] = c.bubble;
  json["all_reduce_ms"] = c.allReduceMs;
  json["peak_bytes"] = c.peakBytes;
  json["peak_activation_bytes"] = c.peakActivationBytes;
  if (c.measuredStepMs >= 0)
    json["measured_step_ms"] = c.measuredStepMs;
  return json;
}

nlohmann::json tuneResultToJson(const TuneResult& result) {
  nlohmann::json candidates = nlohmann::json::array();
  for (const auto& c : result.candidates)
    candidates.push_back(tuneCandidateToJson(c));
  return {
      {"choice", tuneCandidateToJson(result.candidates[result.choice])},
      {"candidates", candidates},
      {"notes", result.notes},
      {"cost_source", result.costSource},
      {"search_ms", result.searchMs}};
}

namespace {

// One line per reason, the first few; --json has them all.
void printInfeasible(std::ostream& out, const TuneResult& result) {
  std::map<std::string, int> reasons;
  for (const auto& c : result.candidates) {
    if (!c.infeasible.empty())
      ++reasons[c.infeasible.substr(0, c.infeasible.find('\n'))];
  }
  int listed = 0;
  for (const auto& [why, count] : reasons) {
    if (++listed > 4) {
      out << "infeasible: " << reasons.size() - 4
          << " more reasons (--json lists them)\n";
      break;
    }
    out << "infeasible (" << count << "): " << why << "\n";
  }
}

} // namespace

void printTuneTable(std::ostream& out, const TuneResult& result, int top) {
  char line[256];
  std::snprintf(
      line,
      sizeof line,
      "%-4s %-56s %12s %12s %10s %8s  %s\n",
      "rank",
      "plan",
      "pred ms",
      "measured ms",
      "samples/s",
      "bubble",
      "peak memory per device");
  out << line;
  const int shown = std::min(top, result.feasible());
  for (int i = 0; i < shown; ++i) {
    const TuneCandidate& c = result.candidates[static_cast<size_t>(i)];
    std::string memory;
    if (c.peakBytes.size() <= 4) {
      for (int64_t bytes : c.peakBytes)
        memory += (memory.empty() ? "" : " ") + formatBytes(bytes);
    } else {
      memory = "max " +
          formatBytes(
                   *std::max_element(c.peakBytes.begin(), c.peakBytes.end())) +
          " over " + std::to_string(c.peakBytes.size()) + " devices";
    }
    char measured[32] = "-";
    if (c.measuredStepMs >= 0)
      std::snprintf(measured, sizeof measured, "%.2f", c.measuredStepMs);
    std::snprintf(
        line,
        sizeof line,
        "%-4d %-56s %12.2f %12s %10.0f %7.1f%%  %s%s\n",
        i + 1,
        c.label().c_str(),
        c.predictedStepMs,
        measured,
        c.samplesPerSecond,
        100.0 * c.bubble,
        memory.c_str(),
        static_cast<size_t>(i) == result.choice ? "  <- chosen" : "");
    out << line;
  }
  printInfeasible(out, result);
  const TuneCandidate& choice = result.candidates[result.choice];
  out << "choice: " << choice.label() << ", boundaries";
  for (int b : choice.boundaries)
    out << ' ' << b;
  std::snprintf(
      line,
      sizeof line,
      "; predicted %.2f ms per step, %.0f samples/s\n",
      choice.predictedStepMs,
      choice.samplesPerSecond);
  out << line;
  for (const auto& note : result.notes)
    out << "note: " << note << "\n";
}

} // namespace tpipe
