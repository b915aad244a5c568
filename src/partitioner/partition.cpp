#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>

#include "tpipe/partition.h"

namespace tpipe {
namespace {

void requireSplittable(int layers, int stages) {
  if (stages < 1) {
    throw PartitionError("stages must be >= 1, got " + std::to_string(stages));
  }
  if (layers < stages) {
    throw PartitionError(
        "cannot split " + std::to_string(layers) + " layers into " +
        std::to_string(stages) +
        " stages: every stage needs at least one layer");
  }
}

} // namespace

std::vector<int> uniformBoundaries(int layers, int stages) {
  requireSplittable(layers, stages);
  std::vector<int> boundaries{0};
  for (int k = 0; k < stages; ++k) {
    const int size = layers / stages + (k < layers % stages ? 1 : 0);
    boundaries.push_back(boundaries.back() + size);
  }
  return boundaries;
}

std::vector<int> balanceBoundaries(
    const std::vector<int>& balance,
    int layers) {
  if (balance.empty())
    throw PartitionError("balance is empty");
  std::vector<int> boundaries{0};
  for (size_t k = 0; k < balance.size(); ++k) {
    if (balance[k] < 1) {
      throw PartitionError(
          "balance[" + std::to_string(k) +
          "]: every stage needs at least one layer, got " +
          std::to_string(balance[k]));
    }
    boundaries.push_back(boundaries.back() + balance[k]);
  }
  if (boundaries.back() != layers) {
    throw PartitionError(
        "balance sums to " + std::to_string(boundaries.back()) +
        " layers, but the model has " + std::to_string(layers));
  }
  return boundaries;
}

// Dynamic programming over (stages used, layers covered); O(stages x
// layers^2), ample for the layer counts of a model handed over by hand.
std::vector<int> minMaxBoundaries(
    const std::vector<double>& weights,
    int stages) {
  const int layers = static_cast<int>(weights.size());
  requireSplittable(layers, stages);
  std::vector<double> prefix(layers + 1, 0.0);
  for (int i = 0; i < layers; ++i)
    prefix[i + 1] = prefix[i] + weights[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][j]: smallest bottleneck covering layers [0, j) with k stages.
  std::vector<std::vector<double>> best(
      stages + 1, std::vector<double>(layers + 1, inf));
  std::vector<std::vector<int>> cut(
      stages + 1, std::vector<int>(layers + 1, -1));
  best[0][0] = 0.0;
  for (int k = 1; k <= stages; ++k) {
    for (int j = k; j <= layers - (stages - k); ++j) {
      for (int i = k - 1; i < j; ++i) {
        const double candidate =
            std::max(best[k - 1][i], prefix[j] - prefix[i]);
        if (candidate < best[k][j]) {
          best[k][j] = candidate;
          cut[k][j] = i;
        }
      }
    }
  }
  std::vector<int> boundaries(stages + 1);
  boundaries[stages] = layers;
  for (int k = stages; k > 0; --k)
    boundaries[k - 1] = cut[k][boundaries[k]];
  return boundaries;
}

std::vector<int> balanceOf(const std::vector<int>& boundaries) {
  std::vector<int> balance;
  for (size_t k = 1; k < boundaries.size(); ++k) {
    balance.push_back(boundaries[k] - boundaries[k - 1]);
  }
  return balance;
}

} // namespace tpipe

// ---------------------------------------------------------------------------
// The optimal, memory-aware partitioner.

namespace tpipe {

std::string formatBytes(int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (std::fabs(value) >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char text[32];
  if (unit == 0) {
    std::snprintf(text, sizeof text, "%lld B", static_cast<long long>(bytes));
  } else {
    std::snprintf(text, sizeof text, "%.2f %s", value, units[unit]);
  }
  return text;
}

int MemoryModel::stashedAt(int stage) const {
  return stage < static_cast<int>(stashed.size()) ? std::max(1, stashed[stage])
                                                  : 1;
}

int MemoryModel::liveAt(int stage) const {
  return stage < static_cast<int>(live.size()) ? std::max(1, live[stage]) : 1;
}

bool MemoryModel::keepsEverything() const {
  const size_t stages = std::max(stashed.size(), live.size());
  for (size_t k = 0; k < stages; ++k) {
    if (stashedAt(static_cast<int>(k)) != liveAt(static_cast<int>(k)))
      return false;
  }
  return true;
}

namespace {

// Prefix sums over the layers, so any stage's totals are two lookups.
struct Prefix {
  std::vector<double> time; // forward + backward
  std::vector<int64_t> params, stash;
  // Layers whose backward allocates a weight-sized gradient before adding
  // it to the parameter's (all that own parameters, but in-place ones).
  std::vector<int> gradientBuffers;

  explicit Prefix(const std::vector<LayerCost>& layers)
      : time(layers.size() + 1, 0.0),
        params(layers.size() + 1, 0),
        stash(layers.size() + 1, 0),
        gradientBuffers(layers.size() + 1, 0) {
    for (size_t i = 0; i < layers.size(); ++i) {
      time[i + 1] = time[i] + layers[i].forwardMs + layers[i].backwardMs;
      params[i + 1] = params[i] + layers[i].paramBytes;
      stash[i + 1] = stash[i] + layers[i].stashBytes;
      gradientBuffers[i + 1] = gradientBuffers[i] +
          (layers[i].paramBytes > 0 && !layers[i].weightGradientInPlace);
    }
  }
};

// Range maximum in O(1) after an O(n log n) build.
class RangeMax {
 public:
  explicit RangeMax(std::vector<int64_t> values) {
    table_.push_back(std::move(values));
    const size_t n = table_[0].size();
    for (size_t width = 2; width <= n; width *= 2) {
      const auto& previous = table_.back();
      std::vector<int64_t> next(n - width + 1);
      for (size_t i = 0; i + width <= n; ++i)
        next[i] = std::max(previous[i], previous[i + width / 2]);
      table_.push_back(std::move(next));
    }
  }
  int64_t over(int first, int end) const { // max of [first, end), end > first
    int level = 0;
    while ((2 << level) <= end - first)
      ++level;
    return std::max(table_[level][first], table_[level][end - (1 << level)]);
  }

 private:
  std::vector<std::vector<int64_t>> table_;
};

std::vector<int64_t> field(
    const std::vector<LayerCost>& layers,
    int64_t LayerCost::*member) {
  std::vector<int64_t> values;
  for (const auto& layer : layers)
    values.push_back(layer.*member);
  return values;
}

class Costs {
 public:
  Costs(const PartitionProblem& problem, int stages)
      : problem_(problem),
        prefix_(problem.layers),
        stages_(stages),
        largestParams_(field(problem.layers, &LayerCost::paramBytes)),
        largestOutput_(field(problem.layers, &LayerCost::activationBytes)) {}

  int layers() const {
    return static_cast<int>(problem_.layers.size());
  }
  const DeviceSpec& device(int stage) const {
    return problem_.devices[stage];
  }

  double compute(int first, int end, int stage) const {
    return (prefix_.time[end] - prefix_.time[first]) / device(stage).speed;
  }

  double transfer(int end, int stage) const {
    if (stage == stages_ - 1)
      return 0.0;
    const DeviceSpec& link = device(stage);
    return link.linkLatencyMs +
        (link.linkBytesPerMs > 0.0
             ? static_cast<double>(problem_.layers[end - 1].activationBytes) /
                 link.linkBytesPerMs
             : 0.0);
  }

  int64_t inputBytes(int first) const {
    return first == 0 ? problem_.memory.inputBytes
                      : problem_.layers[first - 1].activationBytes;
  }

  // The stage inputs of the micro-batches it holds, the whole activation
  // graphs of those not rematerialized, plus the backward's workspace: one
  // layer's weight gradient before it is accumulated and the gradients of one
  // layer's input and output. A stage whose every weight gradient is added
  // in place allocates none; one other layer makes autograd walk the whole
  // stage, and then any of its layers may.
  int64_t activationMemory(int first, int end, int stage) const {
    const int64_t stash = prefix_.stash[end] - prefix_.stash[first];
    const bool inPlace = problem_.memory.weightGradientsInPlace &&
        prefix_.gradientBuffers[end] == prefix_.gradientBuffers[first];
    const int64_t workspace = (inPlace ? 0 : largestParams_.over(first, end)) +
        2 * largestOutput_.over(first, end);
    const int64_t input = inputBytes(first); // each micro-batch's stage input
    return problem_.memory.stashedAt(stage) * input +
        problem_.memory.liveAt(stage) * stash + workspace;
  }

  int64_t memory(int first, int end, int stage) const {
    const double factor = // weights, grads, state
        (2.0 + problem_.memory.optimizerFactor) *
        problem_.memory.parameterCopies *
        (problem_.memory.keepsUndoCopy ? 2 : 1);
    const int64_t params = prefix_.params[end] - prefix_.params[first];
    return static_cast<int64_t>(
               std::llround(factor * static_cast<double>(params))) +
        activationMemory(first, end, stage);
  }

  bool fits(int first, int end, int stage) const {
    const int64_t capacity = device(stage).memoryBytes;
    return capacity <= 0 || memory(first, end, stage) <= capacity;
  }

  // Largest end such that [first, end) fits the stage's memory (memory
  // grows with end); first when not even one layer fits.
  int memoryEnd(int first, int stage) const {
    if (device(stage).memoryBytes <= 0)
      return layers();
    int lo = first, hi = layers();
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (fits(first, mid, stage))
        lo = mid;
      else
        hi = mid - 1;
    }
    return lo;
  }

  // Whether every sub-range of a feasible stage is feasible too and all
  // devices are alike: then packing stages greedily decides feasibility
  // exactly (the greedy cover stays ahead of any other).
  bool greedyExact() const {
    if (hasLinks())
      return false;
    for (int k = 1; k < stages_; ++k) {
      if (device(k).speed != device(0).speed ||
          device(k).memoryBytes != device(0).memoryBytes)
        return false;
    }
    // Rematerialization charges the stage input, which a shorter stage may
    // have larger: sub-ranges are not always cheaper then.
    return device(0).memoryBytes <= 0 || problem_.memory.keepsEverything();
  }

  bool hasLinks() const {
    for (int k = 0; k < stages_; ++k) {
      if (device(k).linkBytesPerMs > 0.0 || device(k).linkLatencyMs > 0.0)
        return true;
    }
    return false;
  }

 private:
  const PartitionProblem& problem_;
  Prefix prefix_;
  int stages_;
  RangeMax largestParams_, largestOutput_;
};

// Can the layers be split into `stages` stages, each within time `limit`
// and its device's memory? Fills reach[k][j]: j layers coverable by k stages.
bool feasible(
    const Costs& costs,
    int stages,
    double limit,
    const std::vector<std::vector<int>>& memoryEnd,
    std::vector<std::vector<char>>& reach) {
  const int n = costs.layers();
  const bool links = costs.hasLinks();
  reach.assign(stages + 1, std::vector<char>(n + 1, 0));
  reach[0][0] = 1;
  std::vector<int> cover(n + 2);
  for (int k = 0; k < stages; ++k) {
    const auto& from = reach[k];
    auto& to = reach[k + 1];
    if (!links) {
      // Each reachable start i covers ends (i, min(time end, memory end)];
      // the time end only grows with i, so one pointer walks it.
      std::fill(cover.begin(), cover.end(), 0);
      int timeEnd = 0;
      for (int i = 0; i < n; ++i) {
        timeEnd = std::max(timeEnd, i);
        while (timeEnd < n && costs.compute(i, timeEnd + 1, k) <= limit)
          ++timeEnd;
        if (!from[i])
          continue;
        const int end = std::min(timeEnd, memoryEnd[k][i]);
        if (end > i) {
          cover[i + 1] += 1;
          cover[end + 1] -= 1;
        }
      }
      int running = 0;
      for (int j = 1; j <= n; ++j) {
        running += cover[j];
        to[j] = running > 0;
      }
    } else {
      // A transfer cost depends on where the stage ends, so ends are tried
      // one by one (quadratic; link costs come with modest layer counts).
      for (int i = 0; i < n; ++i) {
        if (!from[i])
          continue;
        for (int j = i + 1; j <= memoryEnd[k][i]; ++j) {
          if (costs.compute(i, j, k) > limit)
            break;
          if (costs.compute(i, j, k) + costs.transfer(j, k) <= limit)
            to[j] = 1;
        }
      }
    }
  }
  return reach[stages][n] != 0;
}

// Stages packed as long as time and memory allow; feasible iff they cover
// every layer within `stages` stages. Exact when Costs::greedyExact().
bool greedyFeasible(
    const Costs& costs,
    int stages,
    double limit,
    const std::vector<std::vector<int>>& memoryEnd) {
  const int n = costs.layers();
  int start = 0;
  for (int k = 0; k < stages && start < n; ++k) {
    int end = start;
    const int cap = memoryEnd[k][start];
    while (end < cap && costs.compute(start, end + 1, k) <= limit)
      ++end;
    if (end == start)
      return false;
    start = end;
  }
  return start == n;
}

std::vector<int> reconstruct(
    const Costs& costs,
    int stages,
    double limit,
    const std::vector<std::vector<char>>& reach) {
  const int n = costs.layers();
  std::vector<int> boundaries(stages + 1, 0);
  boundaries[stages] = n;
  for (int k = stages - 1; k >= 0; --k) {
    const int end = boundaries[k + 1];
    for (int i = k; i < end; ++i) {
      if (reach[k][i] && costs.fits(i, end, k) &&
          costs.compute(i, end, k) + costs.transfer(end, k) <= limit) {
        boundaries[k] = i;
        break;
      }
    }
  }
  return boundaries;
}

// A layer too large for every device on its own, or "".
std::string layerTooLarge(const PartitionProblem& problem, int stages) {
  const Costs costs(problem, stages);
  int64_t largest = 0;
  std::string largestName;
  for (int k = 0; k < stages; ++k) {
    if (problem.devices[k].memoryBytes > largest) {
      largest = problem.devices[k].memoryBytes;
      largestName = problem.devices[k].name;
    }
  }
  for (int l = 0; l < costs.layers(); ++l) {
    int64_t smallest = std::numeric_limits<int64_t>::max();
    for (int k = 0; k < stages; ++k)
      smallest = std::min(smallest, costs.memory(l, l + 1, k));
    if (smallest > largest) {
      return "layer " + std::to_string(l) + " ('" + problem.layers[l].name +
          "') alone needs " + formatBytes(smallest) +
          " (parameters, gradients, optimizer state and activations), more than "
          "the largest device's " +
          formatBytes(largest) + " (" + largestName + ")";
    }
  }
  return "";
}

// The fewest devices like the first that would hold the model, or 0.
int devicesThatFit(const PartitionProblem& problem, int stages) {
  // Residency for stage counts nobody simulated: every stage holds as much as
  // the fullest stage of this one (conservative for the 1F1B family).
  auto fullest = [](const std::vector<int>& counts) {
    return counts.empty() ? 1 : *std::max_element(counts.begin(), counts.end());
  };
  const int stashed = fullest(problem.memory.stashed),
            live = fullest(problem.memory.live);
  const int layers = static_cast<int>(problem.layers.size());
  PartitionProblem more = problem;
  // Every stage alike: where a stage starting at layer i must end to fit is
  // the same for every stage and every count, so it is found once.
  auto alike = [&](int count) {
    more.devices.assign(count, problem.devices[0]);
    more.memory.stashed.assign(count, stashed);
    more.memory.live.assign(count, live);
    for (auto& device : more.devices) {
      device.linkBytesPerMs = 0.0;
      device.linkLatencyMs = 0.0;
    }
  };
  alike(stages + 1);
  std::vector<int> ends(layers);
  {
    const Costs first(more, stages + 1);
    for (int i = 0; i < layers; ++i)
      ends[i] = first.memoryEnd(i, 0);
  }
  for (int count = stages + 1; count <= layers; ++count) {
    alike(count);
    const Costs moreCosts(more, count);
    const std::vector<std::vector<int>> memoryEnd(count, ends);
    std::vector<std::vector<char>> reach;
    if (feasible(
            moreCosts,
            count,
            std::numeric_limits<double>::infinity(),
            memoryEnd,
            reach))
      return count;
  }
  return 0;
}

std::string explainInfeasible(const PartitionProblem& problem, int stages) {
  for (int k = 0; k < stages; ++k) {
    if (problem.devices[k].memoryBytes <= 0)
      return "no partition found"; // unlimited device
  }
  const std::string tooLarge = layerTooLarge(problem, stages);
  if (!tooLarge.empty())
    return tooLarge;
  const int layers = static_cast<int>(problem.layers.size());
  const PartitionPlan whole = evaluatePartition(problem, {0, layers});
  const std::string message = "the model needs " +
      formatBytes(whole.stages[0].memoryBytes) +
      " on one device; it does not fit in " + std::to_string(stages) +
      " stage(s) on " + std::to_string(stages) + " device(s) of " +
      formatBytes(problem.devices[0].memoryBytes);
  const int fit = devicesThatFit(problem, stages);
  if (fit > 0)
    return message + "; " + std::to_string(fit) +
        " devices of this size would fit";
  return message + "; no number of devices of this size fits (" +
      std::to_string(layers) + " layers at most)";
}

PartitionPlan optimalForStages(const PartitionProblem& problem, int stages) {
  const Costs costs(problem, stages);
  const int n = costs.layers();
  std::vector<std::vector<int>> memoryEnd(stages, std::vector<int>(n));
  for (int k = 0; k < stages; ++k) {
    for (int i = 0; i < n; ++i)
      memoryEnd[k][i] = costs.memoryEnd(i, k);
  }
  std::vector<std::vector<char>> reach;
  double hi =
      0.0; // no stage can take longer than all layers plus the worst transfer
  for (int k = 0; k < stages; ++k) {
    double worstTransfer = 0.0;
    for (int j = 1; j <= n; ++j)
      worstTransfer = std::max(worstTransfer, costs.transfer(j, k));
    hi = std::max(hi, costs.compute(0, n, k) + worstTransfer);
  }
  hi = hi * (1 + 1e-9) + 1e-12;
  if (!feasible(costs, stages, hi, memoryEnd, reach))
    throw PartitionError(explainInfeasible(problem, stages));
  double lo = 0.0;
  const bool greedy = costs.greedyExact();
  for (int iteration = 0; iteration < 200 && hi - lo > 1e-9 * std::max(1.0, hi);
       ++iteration) {
    const double mid = 0.5 * (lo + hi);
    const bool ok = greedy ? greedyFeasible(costs, stages, mid, memoryEnd)
                           : feasible(costs, stages, mid, memoryEnd, reach);
    if (ok)
      hi = mid;
    else
      lo = mid;
  }
  feasible(costs, stages, hi, memoryEnd, reach);
  return evaluatePartition(problem, reconstruct(costs, stages, hi, reach));
}

} // namespace

PartitionPlan evaluatePartition(
    const PartitionProblem& problem,
    const std::vector<int>& boundaries) {
  const int stages = static_cast<int>(boundaries.size()) - 1;
  if (stages < 1 || static_cast<int>(problem.devices.size()) < stages) {
    throw PartitionError(
        "a partition into " + std::to_string(stages) +
        " stages needs as many devices, got " +
        std::to_string(problem.devices.size()));
  }
  const Costs costs(problem, stages);
  PartitionPlan plan;
  plan.boundaries = boundaries;
  for (int k = 0; k < stages; ++k) {
    StageReport report;
    report.firstLayer = boundaries[k];
    report.endLayer = boundaries[k + 1];
    if (report.endLayer <= report.firstLayer) {
      throw PartitionError("stage " + std::to_string(k) + " has no layers");
    }
    report.device = problem.devices[k].name;
    report.computeMs = costs.compute(report.firstLayer, report.endLayer, k);
    report.transferMs = costs.transfer(report.endLayer, k);
    report.timeMs = report.computeMs + report.transferMs;
    for (int l = report.firstLayer; l < report.endLayer; ++l)
      report.paramBytes += problem.layers[l].paramBytes;
    report.memoryBytes = costs.memory(report.firstLayer, report.endLayer, k);
    report.activationBytes =
        costs.activationMemory(report.firstLayer, report.endLayer, k);
    report.capacityBytes = problem.devices[k].memoryBytes;
    report.inFlight = problem.memory.stashedAt(k);
    plan.bottleneckMs = std::max(plan.bottleneckMs, report.timeMs);
    plan.stages.push_back(report);
  }
  return plan;
}

PartitionPlan optimalPartition(const PartitionProblem& problem) {
  const int n = static_cast<int>(problem.layers.size());
  const int devices = static_cast<int>(problem.devices.size());
  if (n == 0)
    throw PartitionError("no layers to partition");
  if (devices == 0)
    throw PartitionError("no devices to partition over");
  for (const auto& device : problem.devices) {
    if (!(device.speed > 0.0))
      throw PartitionError(
          "device '" + device.name + "' has a non-positive speed");
  }
  requireSplittable(n, problem.stages);
  if (problem.stages > devices) {
    throw PartitionError(
        std::to_string(problem.stages) + " stages need " +
        std::to_string(problem.stages) + " devices, got " +
        std::to_string(devices));
  }
  return optimalForStages(problem, problem.stages);
}

} // namespace tpipe
