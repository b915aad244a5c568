// From a config to the plan resolver's request: costs (saved, measured or
// parameter bytes) and the config's pipeline options. The decision itself is
// resolvePlan's (src/plan/).
#include <fstream>

#include <nlohmann/json.hpp>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/types.h>

#include "tpipe/trainer.h"

namespace tpipe {
namespace {

Profile readProfile(const std::string& path) {
  std::ifstream file(path);
  if (!file) throw ConfigError("--profile: cannot read " + path);
  try {
    return profileFromJson(nlohmann::json::parse(file));
  } catch (const nlohmann::json::exception& error) {
    throw ConfigError("--profile: " + path + " is not a profile (" + error.what() + ")");
  }
}

int64_t microBatchSize(const Config& config) {
  const int64_t m = config.pipeline.microBatches;
  return (config.train.batchSize + m - 1) / m;
}

TrainingCosts savedCosts(const Config& config, const BuiltModel& model, const std::string& path) {
  const Profile profile = readProfile(path);
  if (profile.layers.size() != model.layers.size()) {
    throw ConfigError("--profile: " + path + " holds " + std::to_string(profile.layers.size()) +
                      " layers, the config's model " + std::to_string(model.layers.size()) +
                      " (a profile of another model?)");
  }
  TrainingCosts costs;
  const int64_t size = microBatchSize(config);
  costs.layers = profile.costsAt(size);
  const double scale = static_cast<double>(size) / static_cast<double>(profile.microBatchSize);
  costs.inputBytes = static_cast<int64_t>(static_cast<double>(profile.inputBytes) * scale);
  costs.noise = profile.noise;
  costs.source = path + " (profiled at " + std::to_string(profile.microBatchSize) + " samples per micro-batch)";
  return costs;
}

}  // namespace

Profile profileModel(const Config& config, const BuiltModel& model) {
  ProfileOptions options;
  options.microBatchSize = microBatchSize(config);
  const std::string& first = config.pipeline.devices.front().name;
  options.device = first.rfind("cuda", 0) == 0 ? first : "cpu";
  // The sample inputs draw from their own generator: the caller's stream of
  // random numbers stays as it was.
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(config.train.seed);
  const std::vector<int64_t>& shape = model.shapes.front();
  auto sample = [&](int64_t n) {
    std::vector<int64_t> sizes{n};
    sizes.insert(sizes.end(), shape.begin(), shape.end());
    if (!model.integerInput) return torch::randn(sizes, generator);
    const int64_t vocab = config.model.layers.front().params["num_embeddings"].get<int64_t>();
    return torch::randint(vocab, sizes, generator, torch::kLong);
  };
  return profileLayers(model.layers, sample, options);
}

bool needsMeasuredCosts(const Config& config) {
  if (config.pipeline.partition == "time") return true;
  for (const auto& device : config.pipeline.devices) {
    if (device.memoryBytes > 0) return true;
  }
  return false;
}

TrainingCosts trainingCosts(const Config& config, const BuiltModel& model, const std::string& profilePath,
                            bool measure) {
  if (!profilePath.empty()) return savedCosts(config, model, profilePath);
  TrainingCosts costs;
  if (!measure) {
    costs.layers = parameterCosts(model.layers);
    costs.source = "parameter bytes (no times measured)";
    return costs;
  }
  const Profile profile = profileModel(config, model);
  costs.layers = profile.costsAt(profile.microBatchSize);
  costs.inputBytes = profile.inputBytes;
  costs.noise = profile.noise;
  costs.source = "measured now at " + std::to_string(profile.microBatchSize) + " samples per micro-batch";
  if (!profile.settled) costs.source += ", still noisy after " + std::to_string(profile.rounds) + " rounds";
  return costs;
}

PlanRequest planRequest(const Config& config, const TrainingCosts& costs) {
  const auto& p = config.pipeline;
  PlanRequest request;
  request.layers = costs.layers;
  request.costSource = costs.source;
  request.costNoise = costs.noise;
  request.inputBytes = costs.inputBytes;
  for (const auto& device : p.devices) request.devices.push_back({device.name, device.speed, device.memoryBytes});
  request.stages = p.stages;
  request.partition = parsePartitionMethod(p.partition);
  request.balance = p.balance;
  request.schedule = p.schedule;
  request.microBatches = p.microBatches;
  request.virtualStages = p.virtualStages;
  request.checkpoint = parseCheckpointMode(p.checkpoint);
  const auto& o = config.train.optimizer;
  request.optimizerFactor = optimizerStateFactor(o.type, o.momentum);
  return request;
}

}  // namespace tpipe
