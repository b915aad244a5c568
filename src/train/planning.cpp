// From a config to the plan resolver's request: costs (saved, measured or
// parameter bytes) and the config's pipeline options. The decision itself is
// resolvePlan's (src/plan/).
#include <algorithm>
#include <cstring>

#include <nlohmann/json.hpp>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/types.h>

#include "host_memory.h"
#include "json_input.h"
#include "model/layer_types.h"
#include "train/parts.h"

namespace tpipe {
namespace {

Profile readProfile(const std::string& path) {
  const nlohmann::json json = readJsonFile(path, "--profile " + path);
  try {
    return profileFromJson(json);
  } catch (const nlohmann::json::exception& error) {
    throw ConfigError(
        "--profile: " + path + " is not a profile (a value of the wrong type)");
  }
}

int64_t microBatchSize(const Config& config) {
  const int64_t m = config.pipeline.microBatches;
  return (config.train.batchSize + m - 1) / m;
}

TrainingCosts savedCosts(
    const Config& config,
    const BuiltModel& model,
    const std::string& path) {
  const Profile profile = readProfile(path);
  if (profile.layers.size() != model.layers.size()) {
    throw ConfigError(
        "--profile: " + path + " holds " +
        std::to_string(profile.layers.size()) + " layers, the config's model " +
        std::to_string(model.layers.size()) + " (a profile of another model?)");
  }
  // Profiles name each layer "<name> <module kind>", as profileLayers
  // writes them; a hand-written one may give the name alone.
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const std::string& saved = profile.layers[i].cost.name;
    const std::string ours = saved.find(' ') == std::string::npos
        ? model.layers[i].name
        : model.layers[i].name + " " + model.layers[i].module.ptr()->name();
    if (saved != ours) {
      throw ConfigError(
          "--profile: " + path + " names layer " + std::to_string(i) + " '" +
          saved + "', the config's model '" + ours +
          "' (a profile of another model?)");
    }
  }
  TrainingCosts costs = costsFromProfile(
      config,
      profile,
      path + " (profiled at " + std::to_string(profile.microBatchSize) +
          " samples per micro-batch)");
  // A fact of the model the saved numbers do not carry.
  for (size_t i = 0; i < model.layers.size(); ++i)
    costs.layers[i].weightGradientInPlace =
        addsWeightGradientInPlace(model.layers[i]);
  return costs;
}

// Measured costs are measured once, on rank 0, and sent to every rank as
// raw numbers, so every process resolves the same plan.
TrainingCosts sharedCosts(const TrainingCosts& mine, Communicator& world) {
  auto bits = [](double value) {
    int64_t out;
    std::memcpy(&out, &value, sizeof out);
    return out;
  };
  auto number = [](int64_t value) {
    double out;
    std::memcpy(&out, &value, sizeof out);
    return out;
  };
  std::vector<int64_t> packed{
      static_cast<int64_t>(mine.layers.size()),
      mine.inputBytes,
      bits(mine.noise)};
  for (const auto& layer : mine.layers) {
    packed.insert(
        packed.end(),
        {bits(layer.forwardMs),
         bits(layer.backwardMs),
         layer.paramBytes,
         layer.activationBytes,
         layer.stashBytes});
  }
  packed = world.broadcast(packed);
  TrainingCosts costs = mine;
  if (world.rank() == 0)
    return costs;
  costs.inputBytes = packed[1];
  costs.noise = number(packed[2]);
  for (size_t l = 0; l < costs.layers.size(); ++l) {
    const int64_t* item = &packed[3 + 5 * l];
    costs.layers[l].forwardMs = number(item[0]);
    costs.layers[l].backwardMs = number(item[1]);
    costs.layers[l].paramBytes = item[2];
    costs.layers[l].activationBytes = item[3];
    costs.layers[l].stashBytes = item[4];
  }
  costs.source = "measured on rank 0";
  return costs;
}

} // namespace

Profile profileModelWith(
    const Config& config,
    const BuiltModel& model,
    ProfileOptions options) {
  const std::string& first = config.pipeline.devices.front().name;
  options.device = first.rfind("cuda", 0) == 0 ? first : "cpu";
  // The sample inputs draw from their own generator: the caller's stream of
  // random numbers stays as it was.
  at::Generator generator =
      at::make_generator<at::CPUGeneratorImpl>(config.train.seed);
  const std::vector<int64_t>& shape = model.shapes.front();
  auto sample = [&](int64_t n) {
    std::vector<int64_t> sizes{n};
    sizes.insert(sizes.end(), shape.begin(), shape.end());
    if (!model.integerInput)
      return torch::randn(sizes, generator);
    return torch::randint(
        model.inputVocabulary, sizes, generator, torch::kLong);
  };
  return profileLayers(model.layers, sample, options);
}

namespace {

// Bytes from shapes at micro-batch size n (see shapeCosts).
TrainingCosts shapeCostsAt(
    const Config& config,
    const BuiltModel& model,
    int64_t n) {
  TrainingCosts costs;
  costs.layers = parameterCosts(model.layers);
  costs.source = "parameter bytes and shapes (no times measured)";
  auto elements = [](const std::vector<int64_t>& shape) {
    int64_t count = 1;
    for (int64_t d : shape)
      count *= d;
    return count;
  };
  constexpr int64_t kValueBytes = 4; // float: parameters and activations
  costs.inputBytes = n * elements(model.shapes.front()) *
      (model.integerInput ? 8 : kValueBytes);
  std::vector<LayerFacts> facts;
  if (config.model.torchscript.empty() &&
      config.model.layers.size() == model.layers.size())
    facts = modelFacts(config.model);
  for (size_t l = 0; l < costs.layers.size(); ++l) {
    LayerCost& cost = costs.layers[l];
    const int64_t output = elements(model.shapes[l + 1]);
    if (facts.empty()) {
      cost.activationBytes = n * output * kValueBytes;
      cost.stashBytes = cost.activationBytes;
    } else {
      cost.activationBytes = n * kValueBytes *
          (output + static_cast<int64_t>(facts[l].skipElements));
      cost.stashBytes =
          n * kValueBytes * static_cast<int64_t>(facts[l].savedElements);
    }
  }
  return costs;
}

// What profiling at micro-batch size n adds at its peak (the parameters
// exist already): the largest layer's input, output and saved activations
// at the largest fit size (2n), and its parameters' gradients.
int64_t profilingBytes(const TrainingCosts& perSample, int64_t n) {
  int64_t largest = 0, input = perSample.inputBytes;
  for (const auto& layer : perSample.layers) {
    largest = std::max(
        largest,
        2 * n * (input + layer.activationBytes + layer.stashBytes) +
            layer.paramBytes);
    input = layer.activationBytes;
  }
  return largest;
}

// The largest micro-batch size up to the config's whose profiling fits
// within the smallest device cap and half the host's available memory (at
// least 1); the profile is then scaled to the config's size (bytes
// linearly, times along the fitted curves). Whether the plan then fits is
// checkFeasibility's to say.
int64_t profilingSize(const Config& config, const BuiltModel& model) {
  int64_t budget = hostAvailableBytes() / 2;
  for (const auto& device : config.pipeline.devices) {
    if (device.memoryBytes > 0)
      budget = budget > 0 ? std::min(budget, device.memoryBytes)
                          : device.memoryBytes;
  }
  int64_t n = microBatchSize(config);
  if (budget <= 0)
    return n;
  const TrainingCosts perSample = shapeCostsAt(config, model, 1);
  while (n > 1 && profilingBytes(perSample, n) > budget)
    n = (n + 1) / 2;
  return n;
}

} // namespace

TrainingCosts shapeCosts(const Config& config, const BuiltModel& model) {
  return shapeCostsAt(config, model, microBatchSize(config));
}

int64_t hostAvailableBytes() {
  return availableMemoryBytes();
}

Feasibility configFeasibility(
    const Config& config,
    const TrainingCosts& costs,
    bool oneProcess) {
  return checkFeasibility(
      planRequest(config, costs), oneProcess ? hostAvailableBytes() : 0);
}

std::string infeasibleText(const Feasibility& verdict) {
  std::string text = "the plan does not fit: " + verdict.problem;
  if (verdict.fixes.empty())
    return text +
        "; no single change of schedule, checkpoint mode, "
        "partition, micro-batches or device count fits";
  text += "; these would fit:";
  for (const auto& fix : verdict.fixes)
    text += "\n  " + fix;
  return text;
}

Profile profileModel(const Config& config, const BuiltModel& model) {
  ProfileOptions options;
  options.microBatchSize = profilingSize(config, model);
  return profileModelWith(config, model, options);
}

bool needsMeasuredCosts(const Config& config) {
  if (config.pipeline.partition == PartitionMethod::kTime)
    return true;
  for (const auto& device : config.pipeline.devices) {
    if (device.memoryBytes > 0)
      return true;
  }
  return false;
}

TrainingCosts trainingCosts(
    const Config& config,
    const BuiltModel& model,
    const std::string& profilePath,
    bool measure) {
  if (!profilePath.empty())
    return savedCosts(config, model, profilePath);
  TrainingCosts costs;
  if (!measure)
    return shapeCosts(config, model);
  const Profile profile = profileModel(config, model);
  std::string source = "measured now at " +
      std::to_string(profile.microBatchSize) + " samples per micro-batch";
  if (!profile.settled)
    source +=
        ", still noisy after " + std::to_string(profile.rounds) + " rounds";
  return costsFromProfile(config, profile, source);
}

TrainingCosts costsFromProfile(
    const Config& config,
    const Profile& profile,
    const std::string& source) {
  TrainingCosts costs;
  const int64_t size = microBatchSize(config);
  costs.layers = profile.costsAt(size);
  const double scale =
      static_cast<double>(size) / static_cast<double>(profile.microBatchSize);
  costs.inputBytes =
      static_cast<int64_t>(static_cast<double>(profile.inputBytes) * scale);
  costs.noise = profile.noise;
  costs.source = source;
  return costs;
}

bool autocasts(const Config& config) {
  return config.train.precision == "bf16";
}

SpeculativeUpdates speculativeUpdatesOf(const Config& config) {
  if (!config.pipeline.overlapSteps || !config.train.checksGradients())
    return SpeculativeUpdates::kNone;
  if (worldFromEnvironment().worldSize > 1)
    return SpeculativeUpdates::kEveryPlan;
  // In one process a tied weight is one tensor, and where its copies sit on
  // two ranks (the embedding and head of a GPT) steps keep their barrier
  // (Pipeline::canOverlapSteps).
  const auto& layers = config.model.layers;
  const bool tied =
      std::any_of(layers.begin(), layers.end(), [](const auto& l) {
        return l.tiedTo >= 0;
      });
  return tied ? SpeculativeUpdates::kNone : SpeculativeUpdates::kSeveralRanks;
}

PlanRequest planRequest(const Config& config, const TrainingCosts& costs) {
  const auto& p = config.pipeline;
  PlanRequest request;
  request.layers = costs.layers;
  if (autocasts(config)) {
    for (auto& layer : request.layers)
      layer.weightGradientInPlace = false;
  }
  request.directWeightGradients = config.pipeline.directWeightGradients;
  request.costSource = costs.source;
  request.costNoise = costs.noise;
  request.inputBytes = costs.inputBytes;
  for (const auto& device : p.devices)
    request.devices.push_back({device.name, device.speed, device.memoryBytes});
  request.stages = p.stages;
  request.partition = p.partition;
  request.balance = p.balance;
  request.schedule = p.schedule;
  request.microBatches = p.microBatches;
  request.virtualStages = p.virtualStages;
  request.checkpoint = p.checkpoint;
  request.threadsPerDevice = p.threadsPerDevice;
  const auto& o = config.train.optimizer;
  request.optimizerFactor = optimizerStateFactor(o.type, o.momentum);
  request.speculativeUpdates = speculativeUpdatesOf(config);
  return request;
}

Config fittedToWorld(const Config& config) {
  const auto& p = config.pipeline;
  const WorldInfo world = worldFromEnvironment();
  if (p.elasticMinRanks == 0 || world.worldSize == 1)
    return config;
  const std::string size = "a world of " + std::to_string(world.worldSize) +
      " process(es) with pipeline.data_parallel " +
      std::to_string(p.dataParallel);
  if (world.worldSize % p.dataParallel != 0) {
    throw ConfigError(
        "pipeline.elastic: " + size +
        " has no whole number of pipeline ranks per replica; start a "
        "multiple of data_parallel processes");
  }
  const int ranks = world.worldSize / p.dataParallel;
  if (ranks < p.elasticMinRanks) {
    throw ConfigError(
        "pipeline.elastic: " + size + " leaves " + std::to_string(ranks) +
        " pipeline rank(s), below min_ranks " +
        std::to_string(p.elasticMinRanks) + "; start at least " +
        std::to_string(p.elasticMinRanks * p.dataParallel) + " processes");
  }
  const int devices = static_cast<int>(p.devices.size());
  if (ranks > devices) {
    throw ConfigError(
        "pipeline.elastic: " + size + " needs " + std::to_string(ranks) +
        " devices, " + std::to_string(devices) +
        " listed in pipeline.devices; start at most " +
        std::to_string(devices * p.dataParallel) + " processes");
  }
  Config fitted = config;
  fitted.pipeline.devices.resize(ranks);
  if (fitted.model.torchscript.empty()) {
    const size_t layers = fitted.model.layers.size();
    if (static_cast<size_t>(ranks * p.virtualStages) > layers) {
      throw ConfigError(
          "pipeline.elastic: " + std::to_string(ranks) + " pipeline ranks x " +
          std::to_string(p.virtualStages) + " virtual stage(s) exceed the " +
          std::to_string(layers) + " layers of the model; start at most " +
          std::to_string(layers / p.virtualStages * p.dataParallel) +
          " processes");
    }
  }
  return fitted;
}

std::shared_ptr<Communicator> joinWorld(const Config& config) {
  const WorldInfo world = worldFromEnvironment();
  const int ranks = pipelineRanks(config.pipeline);
  const int replicas = config.pipeline.dataParallel;
  if (world.worldSize == 1) {
    if (replicas > 1) {
      throw ConfigError(
          "pipeline.data_parallel: " + std::to_string(replicas) +
          " replicas of " + std::to_string(ranks) + " pipeline ranks need " +
          std::to_string(replicas * ranks) +
          " processes; start them with `tpipe launch --nproc " +
          std::to_string(replicas * ranks) + "`");
    }
    return nullptr;
  }
  if (world.worldSize != replicas * ranks) {
    throw ConfigError(
        "WORLD_SIZE " + std::to_string(world.worldSize) +
        " is not pipeline.data_parallel (" + std::to_string(replicas) +
        ") x pipeline ranks (" + std::to_string(ranks) +
        "); pipeline.elastic lets the stage count follow the world");
  }
  const auto timeout = std::chrono::milliseconds(
      static_cast<int64_t>(config.pipeline.timeoutS * 1000));
  nlohmann::json run = describeConfig(config);
  run["world"] = {{"size", world.worldSize}, {"pipeline_ranks", ranks}};
  return std::make_shared<Communicator>(world, ranks, timeout, run.dump());
}

ResolvedPlan planTraining(
    const Config& config,
    const BuiltModel& model,
    const std::string& profilePath,
    bool measure,
    Communicator* world) {
  const bool measured = measure || !profilePath.empty();
  const bool here = !world || world->rank() == 0;
  // Ranks other than 0 start from parameter bytes and take rank 0's numbers.
  TrainingCosts costs =
      trainingCosts(config, model, here ? profilePath : "", measured && here);
  if (world && measured)
    costs = sharedCosts(costs, *world);
  // Before the first step: a plan over a device's cap (or, in one process,
  // over the host's available memory) is refused with what would fit.
  PlanRequest request = planRequest(config, costs);
  const Feasibility verdict =
      checkFeasibility(request, world == nullptr ? hostAvailableBytes() : 0);
  if (!verdict.fits)
    throw ConfigError(infeasibleText(verdict));
  return {std::move(request), verdict.plan};
}

} // namespace tpipe
