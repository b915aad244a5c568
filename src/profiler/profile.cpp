// Runs layers to measure their costs (see tpipe/profile.h).
#include "tpipe/profile.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <mutex>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <Eigen/Dense>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include "layers/skips.h"
#include "runtime/memory.h"
#include "statistics.h"

namespace tpipe {
namespace {

using Clock = std::chrono::steady_clock;

void synchronize(const at::Tensor& tensor) {
  if (tensor.is_cuda())
    torch::cuda::synchronize(tensor.device().index());
}

struct Measurement {
  std::vector<double> forwardMs, backwardMs; // one per measured run
  at::Tensor output;
  SkipStore after; // the skips alive after the layer, detached
};

// A detached copy that a backward can start a walk at.
at::Tensor leaf(const at::Tensor& x) {
  at::Tensor input = x.detach();
  if (input.is_floating_point())
    input.requires_grad_(true);
  return input;
}

// The layer with its skips: each run takes its pops from a copy of `live`.
Measurement measure(
    const NamedLayer& layer,
    const at::Tensor& x,
    const SkipStore& live,
    const ProfileOptions& options) {
  at::Tensor input = leaf(x);
  std::vector<double> forward, backward;
  Measurement result;
  for (int run = 0; run < options.warmup + options.repeats; ++run) {
    synchronize(input);
    SkipStore skips = live;
    const auto t0 = Clock::now();
    at::Tensor y = runLayer(layer, input, skips);
    synchronize(y);
    const auto t1 = Clock::now();
    if (y.requires_grad())
      torch::autograd::backward({y}, {at::ones_like(y)});
    synchronize(y);
    const auto t2 = Clock::now();
    if (run >= options.warmup) {
      forward.push_back(
          std::chrono::duration<double, std::milli>(t1 - t0).count());
      backward.push_back(
          std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
    result.output = y.detach();
    for (auto& item : skips.items())
      item.second = leaf(item.second);
    result.after = std::move(skips);
  }
  for (auto& parameter : layer.module.ptr()->parameters())
    parameter.mutable_grad() = at::Tensor();
  result.forwardMs = std::move(forward);
  result.backwardMs = std::move(backward);
  return result;
}

double quantile(std::vector<double> values, double q) {
  std::sort(values.begin(), values.end());
  const double position = q * static_cast<double>(values.size() - 1);
  const size_t below = static_cast<size_t>(position);
  const size_t above = std::min(below + 1, values.size() - 1);
  return values[below] +
      (position - static_cast<double>(below)) * (values[above] - values[below]);
}

// About two standard errors of the summed per-layer medians, relative to
// the sum: the standard error of a median is about 0.93 IQR / sqrt(n).
double relativeNoise(const std::vector<std::vector<double>>& runTimes) {
  double total = 0.0, uncertainty = 0.0;
  for (const auto& times : runTimes) {
    if (times.empty())
      continue;
    total += median(times);
    const double iqr = quantile(times, 0.75) - quantile(times, 0.25);
    uncertainty +=
        2.0 * 0.93 * iqr / std::sqrt(static_cast<double>(times.size()));
  }
  return total > 0.0 ? uncertainty / total : 0.0;
}

// What the caller's modules hold, put back after profiling.
class ModuleSnapshot {
 public:
  explicit ModuleSnapshot(const LayerList& layers)
      : cpuGenerator_(at::detail::getDefaultCPUGenerator().clone()) {
    for (const auto& layer : layers) {
      for (const auto& parameter : layer.module.ptr()->parameters()) {
        parameters_.push_back(
            {parameter,
             parameter.device(),
             parameter.detach().clone(),
             parameter.grad()});
        parameter.mutable_grad() = at::Tensor();
      }
      for (const auto& buffer : layer.module.ptr()->buffers()) {
        buffers_.push_back(
            {buffer, buffer.device(), buffer.detach().clone(), at::Tensor()});
      }
      devices_.push_back(firstDevice(layer));
    }
  }
  ModuleSnapshot(const ModuleSnapshot&) = delete;
  ModuleSnapshot& operator=(const ModuleSnapshot&) = delete;

  void restore(const LayerList& layers) {
    for (size_t l = 0; l < layers.size(); ++l) {
      if (devices_[l])
        layers[l].module.ptr()->to(*devices_[l]);
    }
    at::NoGradGuard noGrad;
    for (auto& kept : parameters_) {
      kept.tensor.copy_(kept.values);
      kept.tensor.mutable_grad() = kept.grad;
    }
    for (auto& kept : buffers_)
      kept.tensor.copy_(kept.values);
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_state(cpuGenerator_.get_state());
  }

 private:
  struct Kept {
    at::Tensor tensor;
    c10::Device device;
    at::Tensor values, grad;
  };
  static c10::optional<c10::Device> firstDevice(const NamedLayer& layer) {
    for (const auto& parameter : layer.module.ptr()->parameters())
      return parameter.device();
    for (const auto& buffer : layer.module.ptr()->buffers())
      return buffer.device();
    return c10::nullopt;
  }
  at::Generator cpuGenerator_;
  std::vector<Kept> parameters_, buffers_;
  std::vector<c10::optional<c10::Device>> devices_;
};

// Bytes a forward with grad leaves alive (the output and whatever the graph
// saved for the backward), from the device's own allocator.
int64_t stashBytes(
    const NamedLayer& layer,
    const at::Tensor& x,
    const SkipStore& skips,
    int slot) {
  at::Tensor input = leaf(x);
  SkipStore scratch = skips;
  int64_t live = 0, peak = 0;
  const bool accelerator = memory::acceleratorStats(x.device(), &live, &peak);
  memory::DeviceScope scope(slot);
  const int64_t before = accelerator ? live : memory::liveBytes(slot);
  at::Tensor y = runLayer(layer, input, scratch);
  synchronize(y);
  if (accelerator) {
    memory::acceleratorStats(x.device(), &live, &peak);
    return live - before;
  }
  return memory::liveBytes(slot) - before;
}

} // namespace

SizeCurve fitSizeCurve(
    const std::vector<int64_t>& sizes,
    const std::vector<double>& times) {
  TORCH_CHECK(
      !sizes.empty() && sizes.size() == times.size(),
      "fitSizeCurve: needs as many times as sizes, and at least one");
  // Repeated sizes are merged (geometric mean of their times).
  std::vector<std::pair<int64_t, double>> points;
  for (size_t i = 0; i < sizes.size(); ++i)
    points.emplace_back(sizes[i], std::log(std::max(times[i], 1e-9)));
  std::sort(points.begin(), points.end());
  SizeCurve curve;
  for (size_t i = 0; i < points.size();) {
    size_t j = i;
    double sum = 0.0;
    for (; j < points.size() && points[j].first == points[i].first; ++j)
      sum += points[j].second;
    curve.sizes.push_back(static_cast<double>(points[i].first));
    curve.ms.push_back(std::exp(sum / static_cast<double>(j - i)));
    i = j;
  }
  for (size_t i = 1; i + 1 < curve.sizes.size(); ++i) {
    SizeCurve without;
    without.sizes = {curve.sizes[i - 1], curve.sizes[i + 1]};
    without.ms = {curve.ms[i - 1], curve.ms[i + 1]};
    curve.worstResidual = std::max(
        curve.worstResidual,
        std::abs(without.at(curve.sizes[i]) / curve.ms[i] - 1.0));
  }
  return curve;
}

std::vector<LayerCost> Profile::costsAt(int64_t size) const {
  std::vector<LayerCost> costs;
  const double profiled = static_cast<double>(microBatchSize);
  for (const auto& layer : layers) {
    costs.push_back(layerCostAt(
        layer.cost,
        layer.forward,
        layer.backward,
        static_cast<double>(layer.cost.activationBytes) / profiled,
        static_cast<double>(layer.cost.stashBytes) / profiled,
        static_cast<double>(size)));
  }
  return costs;
}

namespace {

// One round: every layer at every fit size, samples appended per layer.
void measureRound(
    const LayerList& layers,
    const std::function<at::Tensor(int64_t)>& sample,
    const ProfileOptions& options,
    int slot,
    Profile& profile,
    std::vector<std::vector<std::vector<double>>>& forward,
    std::vector<std::vector<std::vector<double>>>& backward) {
  const c10::Device device(options.device);
  const bool first = forward.empty();
  if (first) {
    forward.assign(
        layers.size(),
        std::vector<std::vector<double>>(profile.fitSizes.size()));
    backward = forward;
  }
  for (size_t size = 0; size < profile.fitSizes.size(); ++size) {
    const int64_t n = profile.fitSizes[size];
    at::Tensor x = sample(n).to(device);
    const bool atProfiledSize = n == profile.microBatchSize;
    if (atProfiledSize)
      profile.inputBytes = static_cast<int64_t>(x.nbytes());
    SkipStore skips;
    for (size_t l = 0; l < layers.size(); ++l) {
      if (options.beforeEachLayer)
        options.beforeEachLayer();
      auto layer = layers[l].module;
      layer.ptr()->to(device);
      Measurement m = measure(layers[l], x, skips, options);
      auto& f = forward[l][size];
      auto& b = backward[l][size];
      f.insert(f.end(), m.forwardMs.begin(), m.forwardMs.end());
      b.insert(b.end(), m.backwardMs.begin(), m.backwardMs.end());
      if (first && atProfiledSize) {
        LayerCost& cost = profile.layers[l].cost;
        cost.name = layers[l].name + " " + layer.ptr()->name();
        for (const auto& parameter : layer.ptr()->parameters()) {
          cost.paramBytes += static_cast<int64_t>(parameter.nbytes());
        }
        // A stage ending here sends, and its next keeps, the skips too.
        cost.activationBytes = static_cast<int64_t>(m.output.nbytes());
        for (const auto& item : m.after.items())
          cost.activationBytes += static_cast<int64_t>(item.second.nbytes());
        cost.stashBytes = stashBytes(layers[l], x, skips, slot);
        cost.weightGradientInPlace = addsWeightGradientInPlace(layers[l]);
      }
      x = m.output;
      skips = std::move(m.after);
    }
  }
}

// Medians at the profiled size, fits over all sizes, and the noise.
void summarize(
    const std::vector<std::vector<std::vector<double>>>& forward,
    const std::vector<std::vector<std::vector<double>>>& backward,
    Profile& profile) {
  const size_t at = static_cast<size_t>(
      std::find(
          profile.fitSizes.begin(),
          profile.fitSizes.end(),
          profile.microBatchSize) -
      profile.fitSizes.begin());
  std::vector<std::vector<double>> total(profile.layers.size());
  for (size_t l = 0; l < profile.layers.size(); ++l) {
    std::vector<double> forwardMedians, backwardMedians;
    for (size_t size = 0; size < profile.fitSizes.size(); ++size) {
      forwardMedians.push_back(median(forward[l][size]));
      backwardMedians.push_back(median(backward[l][size]));
    }
    LayerProfile& layer = profile.layers[l];
    layer.cost.forwardMs = forwardMedians[at];
    layer.cost.backwardMs = backwardMedians[at];
    layer.forward = fitSizeCurve(profile.fitSizes, forwardMedians);
    layer.backward = fitSizeCurve(profile.fitSizes, backwardMedians);
    for (size_t run = 0; run < forward[l][at].size(); ++run) {
      total[l].push_back(forward[l][at][run] + backward[l][at][run]);
    }
  }
  profile.noise = relativeNoise(total);
}

} // namespace

Profile profileLayers(
    const LayerList& layers,
    const std::function<at::Tensor(int64_t)>& sample,
    const ProfileOptions& options) {
  TORCH_CHECK(
      options.microBatchSize >= 1, "profile: micro-batch size must be >= 1");
  TORCH_CHECK(options.repeats >= 1, "profile: repeats must be >= 1");
  TORCH_CHECK(options.maxRounds >= 1, "profile: rounds must be >= 1");
  checkSkips(layers);
  memory::install();
  const int slot = memory::acquireSlot();
  ModuleSnapshot snapshot(layers);
  Profile profile;
  profile.device = options.device;
  profile.microBatchSize = options.microBatchSize;
  const int64_t n = options.microBatchSize;
  profile.fitSizes = options.fitSizes;
  if (profile.fitSizes.empty())
    profile.fitSizes = {std::max<int64_t>(1, n / 2), n, 2 * n};
  profile.fitSizes.push_back(n);
  for (int64_t size : profile.fitSizes)
    TORCH_CHECK(size >= 1, "profile: fit sizes must be >= 1, got ", size);
  std::sort(profile.fitSizes.begin(), profile.fitSizes.end());
  profile.fitSizes.erase(
      std::unique(profile.fitSizes.begin(), profile.fitSizes.end()),
      profile.fitSizes.end());
  profile.layers.resize(layers.size());
  std::vector<std::vector<std::vector<double>>> forward, backward;
  const int callerThreads = at::get_num_threads();
  if (options.threads > 0)
    at::set_num_threads(options.threads);
  try {
    at::AutoGradMode gradMode(true);
    for (profile.rounds = 1;; ++profile.rounds) {
      measureRound(layers, sample, options, slot, profile, forward, backward);
      summarize(forward, backward, profile);
      profile.settled = profile.noise <= options.noiseBound;
      if (profile.settled || profile.rounds >= options.maxRounds)
        break;
    }
  } catch (...) {
    at::set_num_threads(callerThreads);
    snapshot.restore(layers);
    memory::releaseSlot(slot);
    throw;
  }
  at::set_num_threads(callerThreads);
  snapshot.restore(layers);
  memory::releaseSlot(slot);
  profile.noise = std::max(profile.noise, options.noiseFloor);
  return profile;
}

namespace {

nlohmann::json curveToJson(const SizeCurve& curve) {
  return {
      {"sizes", curve.sizes},
      {"ms", curve.ms},
      {"worst_residual", curve.worstResidual}};
}

SizeCurve curveFromJson(const nlohmann::json& json, const std::string& path) {
  auto numbers = [&](const char* key) {
    const nlohmann::json* value =
        json.is_object() && json.contains(key) ? &json[key] : nullptr;
    bool ok = value && value->is_array() && !value->empty();
    std::vector<double> out;
    for (size_t i = 0; ok && i < value->size(); ++i) {
      ok = (*value)[i].is_number() && (*value)[i].get<double>() >= 0 &&
          (*value)[i].get<double>() <= 86400000.0;
      if (ok)
        out.push_back((*value)[i].get<double>());
    }
    if (!ok)
      throw ConfigError(path + "." + key + ": expected non-negative numbers");
    return out;
  };
  SizeCurve curve;
  curve.sizes = numbers("sizes");
  curve.ms = numbers("ms");
  bool ascending = curve.sizes.size() == curve.ms.size() && curve.sizes[0] >= 1;
  for (size_t i = 1; ascending && i < curve.sizes.size(); ++i)
    ascending = curve.sizes[i] > curve.sizes[i - 1];
  if (!ascending) {
    throw ConfigError(
        path + ": expected ascending sizes >= 1, as many as times");
  }
  curve.worstResidual = json.value("worst_residual", 0.0);
  return curve;
}

} // namespace

nlohmann::json profileToJson(const Profile& profile) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& layer : profile.layers) {
    layers.push_back(
        {{"name", layer.cost.name},
         {"forward_ms", layer.cost.forwardMs},
         {"backward_ms", layer.cost.backwardMs},
         {"param_bytes", layer.cost.paramBytes},
         {"activation_bytes", layer.cost.activationBytes},
         {"stash_bytes", layer.cost.stashBytes},
         {"forward_fit", curveToJson(layer.forward)},
         {"backward_fit", curveToJson(layer.backward)}});
  }
  return {
      {"device", profile.device},
      {"micro_batch_size", profile.microBatchSize},
      {"noise", profile.noise},
      {"rounds", profile.rounds},
      {"input_bytes", profile.inputBytes},
      {"fit_sizes", profile.fitSizes},
      {"fit", "ms at the measured sizes; straight in log-log space between"},
      {"layers", layers}};
}

Profile profileFromJson(const nlohmann::json& json) {
  if (!json.is_object() || !json.contains("layers") ||
      !json["layers"].is_array() || json["layers"].empty()) {
    throw ConfigError(
        "profile: expected {\"layers\": [{\"name\": ..., \"forward_ms\": ..., "
        "\"backward_ms\": ...}, ...]}");
  }
  Profile profile;
  profile.device = json.value("device", std::string("cpu"));
  if (json.contains("micro_batch_size") &&
      (!json["micro_batch_size"].is_number_integer() ||
       json["micro_batch_size"].get<int64_t>() < 1)) {
    throw ConfigError(
        "profile.micro_batch_size: expected a positive integer, got " +
        json["micro_batch_size"].dump());
  }
  profile.microBatchSize = json.value("micro_batch_size", int64_t{1});
  profile.inputBytes = json.value("input_bytes", int64_t{0});
  if (json.contains("noise")) {
    if (!json["noise"].is_number() || !(json["noise"].get<double>() >= 0)) {
      throw ConfigError(
          "profile.noise: expected a non-negative number, got " +
          json["noise"].dump());
    }
    profile.noise = json["noise"].get<double>();
  }
  for (size_t i = 0; i < json["layers"].size(); ++i) {
    const auto& item = json["layers"][i];
    const std::string path = "profile.layers[" + std::to_string(i) + "]";
    auto number = [&](const char* key, bool required) -> double {
      if (!item.contains(key)) {
        if (required)
          throw ConfigError(path + "." + key + ": missing");
        return 0.0;
      }
      // Bounded so that sums over layers and micro-batches stay finite: a
      // day per layer, or 2^50 bytes, is past any real measurement.
      const bool bytes = std::strstr(key, "_bytes") != nullptr;
      const double limit = bytes ? 1125899906842624.0 : 86400000.0;
      if (!item[key].is_number() || !(item[key].get<double>() >= 0) ||
          !(item[key].get<double>() <= limit)) {
        throw ConfigError(
            path + "." + key + ": expected a number from 0 to " +
            (bytes ? std::string("2^50 bytes") : std::string("86400000 ms")) +
            ", got " + item[key].dump());
      }
      return item[key].get<double>();
    };
    LayerProfile layer;
    layer.cost.name = item.value("name", std::to_string(i));
    layer.cost.forwardMs = number("forward_ms", true);
    layer.cost.backwardMs = number("backward_ms", true);
    layer.cost.paramBytes = static_cast<int64_t>(number("param_bytes", false));
    layer.cost.activationBytes =
        static_cast<int64_t>(number("activation_bytes", false));
    layer.cost.stashBytes = static_cast<int64_t>(number("stash_bytes", false));
    layer.forward =
        fitSizeCurve({profile.microBatchSize}, {layer.cost.forwardMs});
    layer.backward =
        fitSizeCurve({profile.microBatchSize}, {layer.cost.backwardMs});
    if (item.contains("forward_fit") && item.contains("backward_fit")) {
      layer.forward = curveFromJson(item["forward_fit"], path + ".forward_fit");
      layer.backward =
          curveFromJson(item["backward_fit"], path + ".backward_fit");
    }
    profile.layers.push_back(layer);
  }
  return profile;
}

} // namespace tpipe
