// Runs layers to measure their costs; the partitioner itself stays pure.
#include "tpipe/profile.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include <ATen/ATen.h>
#include <Eigen/Dense>
#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/autograd.h>
#include <torch/cuda.h>

#include "runtime/memory.h"

namespace tpipe {
namespace {

using Clock = std::chrono::steady_clock;

// Allocations made while profiling are charged to this accounting slot.
constexpr int kProfilingSlot = memory::kMaxDevices - 1;

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

void synchronize(const at::Tensor& tensor) {
  if (tensor.is_cuda()) torch::cuda::synchronize(tensor.device().index());
}

struct Measurement {
  double forwardMs = 0.0, backwardMs = 0.0;
  at::Tensor output;
};

Measurement measure(torch::nn::AnyModule& layer, const at::Tensor& x, const ProfileOptions& options) {
  at::Tensor input = x.detach();
  if (input.is_floating_point()) input.requires_grad_(true);
  std::vector<double> forward, backward;
  Measurement result;
  for (int run = 0; run < options.warmup + options.repeats; ++run) {
    synchronize(input);
    const auto t0 = Clock::now();
    at::Tensor y = layer.forward(input);
    synchronize(y);
    const auto t1 = Clock::now();
    if (y.requires_grad()) torch::autograd::backward({y}, {at::ones_like(y)});
    synchronize(y);
    const auto t2 = Clock::now();
    if (run >= options.warmup) {
      forward.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      backward.push_back(std::chrono::duration<double, std::milli>(t2 - t1).count());
    }
    result.output = y.detach();
  }
  for (auto& parameter : layer.ptr()->parameters()) parameter.mutable_grad() = at::Tensor();
  result.forwardMs = median(forward);
  result.backwardMs = median(backward);
  return result;
}

}  // namespace

LinearFit fitLine(const std::vector<int64_t>& sizes, const std::vector<double>& times) {
  Eigen::MatrixXd a(static_cast<Eigen::Index>(sizes.size()), 2);
  Eigen::VectorXd b(static_cast<Eigen::Index>(sizes.size()));
  for (size_t i = 0; i < sizes.size(); ++i) {
    a(static_cast<Eigen::Index>(i), 0) = 1.0;
    a(static_cast<Eigen::Index>(i), 1) = static_cast<double>(sizes[i]);
    b(static_cast<Eigen::Index>(i)) = times[i];
  }
  const Eigen::VectorXd solution = a.colPivHouseholderQr().solve(b);
  return {solution(0), solution(1)};
}

std::vector<LayerCost> Profile::costsAt(int64_t size) const {
  std::vector<LayerCost> costs;
  const double scale = static_cast<double>(size) / static_cast<double>(microBatchSize);
  for (const auto& layer : layers) {
    LayerCost cost = layer.cost;
    cost.forwardMs = std::max(0.0, layer.forward.at(static_cast<double>(size)));
    cost.backwardMs = std::max(0.0, layer.backward.at(static_cast<double>(size)));
    cost.activationBytes = static_cast<int64_t>(std::llround(cost.activationBytes * scale));
    cost.stashBytes = static_cast<int64_t>(std::llround(cost.stashBytes * scale));
    costs.push_back(cost);
  }
  return costs;
}

Profile profileLayers(const LayerList& layers, const std::function<at::Tensor(int64_t)>& sample,
                      const ProfileOptions& options) {
  TORCH_CHECK(options.microBatchSize >= 1, "profile: micro-batch size must be >= 1");
  TORCH_CHECK(options.repeats >= 1, "profile: repeats must be >= 1");
  memory::install();
  Profile profile;
  profile.device = options.device;
  profile.microBatchSize = options.microBatchSize;
  const int64_t n = options.microBatchSize;
  profile.fitSizes = {std::max<int64_t>(1, n / 2), n, 2 * n};
  profile.fitSizes.erase(std::unique(profile.fitSizes.begin(), profile.fitSizes.end()), profile.fitSizes.end());
  const size_t count = layers.size();
  std::vector<std::vector<double>> forward(count), backward(count);
  profile.layers.resize(count);
  at::AutoGradMode gradMode(true);
  const c10::Device device(options.device);
  for (int64_t size : profile.fitSizes) {
    at::Tensor x = sample(size).to(device);
    if (size == n) profile.inputBytes = static_cast<int64_t>(x.nbytes());
    for (size_t l = 0; l < count; ++l) {
      auto layer = layers[l].module;
      layer.ptr()->to(device);
      const Measurement m = measure(layer, x, options);
      forward[l].push_back(m.forwardMs);
      backward[l].push_back(m.backwardMs);
      if (size == n) {
        LayerCost& cost = profile.layers[l].cost;
        cost.name = layers[l].name + " " + layer.ptr()->name();
        cost.forwardMs = m.forwardMs;
        cost.backwardMs = m.backwardMs;
        for (const auto& parameter : layer.ptr()->parameters()) {
          cost.paramBytes += static_cast<int64_t>(parameter.nbytes());
        }
        cost.activationBytes = static_cast<int64_t>(m.output.nbytes());
        // What a forward with grad leaves alive: the output and whatever the
        // graph saved for the backward.
        at::Tensor input = x.detach();
        if (input.is_floating_point()) input.requires_grad_(true);
        memory::DeviceScope scope(kProfilingSlot);
        const int64_t before = memory::liveBytes(kProfilingSlot);
        {
          at::Tensor y = layer.forward(input);
          cost.stashBytes = memory::liveBytes(kProfilingSlot) - before;
        }
      }
      x = m.output;
    }
  }
  for (size_t l = 0; l < count; ++l) {
    profile.layers[l].forward = fitLine(profile.fitSizes, forward[l]);
    profile.layers[l].backward = fitLine(profile.fitSizes, backward[l]);
  }
  return profile;
}

nlohmann::json profileToJson(const Profile& profile) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& layer : profile.layers) {
    layers.push_back({{"name", layer.cost.name},
                      {"forward_ms", layer.cost.forwardMs},
                      {"backward_ms", layer.cost.backwardMs},
                      {"param_bytes", layer.cost.paramBytes},
                      {"activation_bytes", layer.cost.activationBytes},
                      {"stash_bytes", layer.cost.stashBytes},
                      {"forward_fit_ms", {layer.forward.intercept, layer.forward.slope}},
                      {"backward_fit_ms", {layer.backward.intercept, layer.backward.slope}}});
  }
  return {{"device", profile.device},
          {"micro_batch_size", profile.microBatchSize},
          {"input_bytes", profile.inputBytes},
          {"fit_sizes", profile.fitSizes},
          {"fit", "ms = intercept + slope * micro_batch_size"},
          {"layers", layers}};
}

Profile profileFromJson(const nlohmann::json& json) {
  if (!json.is_object() || !json.contains("layers") || !json["layers"].is_array() || json["layers"].empty()) {
    throw ConfigError("profile: expected {\"layers\": [{\"name\": ..., \"forward_ms\": ..., "
                      "\"backward_ms\": ...}, ...]}");
  }
  Profile profile;
  profile.device = json.value("device", std::string("cpu"));
  profile.microBatchSize = json.value("micro_batch_size", int64_t{1});
  profile.inputBytes = json.value("input_bytes", int64_t{0});
  for (size_t i = 0; i < json["layers"].size(); ++i) {
    const auto& item = json["layers"][i];
    const std::string path = "profile.layers[" + std::to_string(i) + "]";
    auto number = [&](const char* key, bool required) -> double {
      if (!item.contains(key)) {
        if (required) throw ConfigError(path + "." + key + ": missing");
        return 0.0;
      }
      if (!item[key].is_number() || item[key].get<double>() < 0) {
        throw ConfigError(path + "." + key + ": expected a non-negative number, got " + item[key].dump());
      }
      return item[key].get<double>();
    };
    LayerProfile layer;
    layer.cost.name = item.value("name", std::to_string(i));
    layer.cost.forwardMs = number("forward_ms", true);
    layer.cost.backwardMs = number("backward_ms", true);
    layer.cost.paramBytes = static_cast<int64_t>(number("param_bytes", false));
    layer.cost.activationBytes = static_cast<int64_t>(number("activation_bytes", false));
    layer.cost.stashBytes = static_cast<int64_t>(number("stash_bytes", false));
    layer.forward = {layer.cost.forwardMs, 0.0};
    layer.backward = {layer.cost.backwardMs, 0.0};
    if (item.contains("forward_fit_ms") && item.contains("backward_fit_ms")) {
      layer.forward = {item["forward_fit_ms"][0].get<double>(), item["forward_fit_ms"][1].get<double>()};
      layer.backward = {item["backward_fit_ms"][0].get<double>(), item["backward_fit_ms"][1].get<double>()};
    }
    profile.layers.push_back(layer);
  }
  return profile;
}

PartitionProblem partitionProblem(const Config& config, const std::vector<LayerCost>& costs, int64_t inputBytes) {
  PartitionProblem problem;
  problem.layers = costs;
  const auto& p = config.pipeline;
  const int ranks = static_cast<int>(p.devices.size());
  // `time` without a stage count may choose it: 0.
  const bool choose = p.stages == 0 && p.balance.empty() && p.partition == "time" && p.virtualStages == 1;
  const int stages = choose ? 0 : configuredStages(p);
  problem.stages = stages;
  // With virtual stages, stage k runs on device k % ranks.
  const int slots = std::max(stages, ranks);
  for (int k = 0; k < slots; ++k) {
    const DeviceConfig& device = p.devices[k % ranks];
    problem.devices.push_back({device.name, device.speed, device.memoryBytes, 0.0});
  }
  problem.memory.schedule = p.schedule;
  problem.memory.checkpoint = p.checkpoint;
  problem.memory.microBatches = p.microBatches;
  const auto& o = config.train.optimizer;
  problem.memory.optimizerFactor = o.type == "sgd" ? (o.momentum > 0 ? 1.0 : 0.0) : 2.0;
  problem.memory.inputBytes = inputBytes;
  return problem;
}

PartitionPlan planFor(const Config& config, const PartitionProblem& problem,
                      const std::vector<int64_t>& parameterCounts) {
  const std::string& method = config.pipeline.partition;
  const int layers = static_cast<int>(problem.layers.size());
  if (method == "time") return optimalPartition(problem);
  const int stages = problem.stages;
  if (method == "balance") return evaluatePartition(problem, balanceBoundaries(config.pipeline.balance, layers));
  if (method == "parameters") {
    std::vector<double> weights(parameterCounts.begin(), parameterCounts.end());
    return evaluatePartition(problem, minMaxBoundaries(weights, stages));
  }
  return evaluatePartition(problem, uniformBoundaries(layers, stages));
}

}  // namespace tpipe
