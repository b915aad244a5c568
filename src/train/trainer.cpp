// The training loop behind `tpipe train`: batches, optimizer and learning
// rate schedule, progress, metrics, evaluation and checkpoints.
#include <unistd.h>

#include <thread>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <sstream>

#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include "tpipe/distributed.h"
#include "tpipe/trainer.h"

namespace tpipe {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

LossFunction makeLoss(const std::string& name) {
  if (name == "mse") {
    return [](const torch::Tensor& out, const torch::Tensor& target) {
      return torch::nn::functional::mse_loss(out, target);
    };
  }
  // Sequences ([batch, time, classes]) are flattened to one prediction per
  // position; the mean over positions and samples is the per-token loss.
  return [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(out.reshape({-1, out.size(-1)}), target.reshape({-1}));
  };
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(const OptimizerConfig& o,
                                                       std::vector<torch::Tensor> parameters) {
  if (o.type == "adam") {
    return std::make_unique<torch::optim::Adam>(
        parameters, torch::optim::AdamOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weightDecay));
  }
  if (o.type == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        parameters, torch::optim::AdamWOptions(o.lr).betas({o.beta1, o.beta2}).eps(o.eps).weight_decay(o.weightDecay));
  }
  return std::make_unique<torch::optim::SGD>(
      parameters, torch::optim::SGDOptions(o.lr).momentum(o.momentum).weight_decay(o.weightDecay));
}

// Linear warm-up over warmupSteps, then constant or cosine decay to minLr
// at the final step. `step` counts from 0.
double learningRate(const TrainConfig& t, int64_t step) {
  const auto& o = t.optimizer;
  if (step < o.warmupSteps) return o.lr * static_cast<double>(step + 1) / static_cast<double>(o.warmupSteps);
  if (o.decay != "cosine") return o.lr;
  const double span = std::max<int64_t>(1, t.steps - o.warmupSteps);
  const double progress = std::min(1.0, static_cast<double>(step - o.warmupSteps) / span);
  return o.minLr + 0.5 * (o.lr - o.minLr) * (1.0 + std::cos(M_PI * progress));
}

// Batch k of the run: epoch k / batchesPerEpoch; with shuffle the epoch's
// order is a permutation drawn from (seed, epoch) alone, so any step's batch
// can be found again on resume.
class BatchSource {
 public:
  BatchSource(const Dataset& data, int64_t batchSize, bool shuffle, uint64_t seed)
      : data_(data), batchSize_(batchSize), shuffle_(shuffle), seed_(seed) {
    const int64_t n = data.trainInputs.size(0);
    if (n < batchSize) {
      throw ConfigError("train.batch_size: " + std::to_string(batchSize) + " exceeds the " +
                        std::to_string(n) + " training samples");
    }
    batchesPerEpoch_ = n / batchSize;
  }

  std::pair<torch::Tensor, torch::Tensor> batch(int64_t step) {
    const int64_t epoch = step / batchesPerEpoch_;
    const int64_t offset = (step % batchesPerEpoch_) * batchSize_;
    if (!shuffle_) {
      return {data_.trainInputs.narrow(0, offset, batchSize_), data_.trainTargets.narrow(0, offset, batchSize_)};
    }
    if (epoch != epoch_) {
      at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003ULL + 7919ULL * (epoch + 1));
      order_ = torch::randperm(data_.trainInputs.size(0), generator, torch::kLong);
      epoch_ = epoch;
    }
    const torch::Tensor index = order_.narrow(0, offset, batchSize_);
    return {data_.trainInputs.index_select(0, index), data_.trainTargets.index_select(0, index)};
  }

 private:
  const Dataset& data_;
  int64_t batchSize_;
  bool shuffle_;
  uint64_t seed_;
  int64_t batchesPerEpoch_ = 1;
  int64_t epoch_ = -1;
  torch::Tensor order_;
};

void setTraining(const LayerList& layers, bool on) {
  for (const auto& layer : layers) layer.module.ptr()->train(on);
}

struct Evaluation {
  double loss = 0.0;
  double accuracy = -1.0;
};

// Across processes only the last stage's process sees outputs; replica 0's
// counts are summed over the world so every process agrees.
Evaluation evaluate(Pipeline& pipe, const Dataset& data, const LossFunction& lossFn, bool classification,
                    int64_t chunk, Communicator* communicator) {
  setTraining(pipe.layers(), false);
  Evaluation result;
  const int64_t n = data.evalInputs.size(0);
  double lossSum = 0.0, correct = 0.0, positions = 0.0;
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t size = std::min(chunk, n - start);
    const torch::Tensor x = data.evalInputs.narrow(0, start, size);
    const torch::Tensor y = data.evalTargets.narrow(0, start, size);
    const torch::Tensor forwarded = pipe.forward(x);
    if (!forwarded.defined() || (communicator && communicator->replica() != 0)) continue;
    const torch::Tensor out = forwarded.to(torch::kCPU);
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
  result.loss = lossSum / static_cast<double>(n);
  if (classification) result.accuracy = correct / positions;
  return result;
}

// Writes `bytes` to `path` through a temporary file and a rename, so a crash
// leaves either the old file or the new one.
void writeAtomically(const fs::path& path, const std::function<void(const fs::path&)>& write) {
  const fs::path temporary = path.string() + ".tmp";
  write(temporary);
  fs::rename(temporary, path);
}

void writeBytes(const fs::path& path, const std::vector<char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  out.close();
  if (!out) throw std::runtime_error("cannot write " + path.string());
}

std::vector<char> readBytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("--resume: cannot read " + path.string());
  return std::vector<char>((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The tensors a checkpoint holds: every parameter and buffer, named as
// nn.Sequential's state_dict; across processes only this rank's stages.
std::vector<std::pair<std::string, torch::Tensor>> checkpointTensors(const Pipeline& pipe,
                                                                     Communicator* communicator) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  const auto& boundaries = pipe.boundaries();
  const int ranks = pipe.schedule().ranks;
  for (size_t s = 0; s + 1 < boundaries.size(); ++s) {
    if (communicator && static_cast<int>(s) % ranks != communicator->stageRank()) continue;
    for (int l = boundaries[s]; l < boundaries[s + 1]; ++l) {
      const auto& layer = pipe.layers()[l];
      for (const auto& item : layer.module.ptr()->named_parameters()) {
        tensors.emplace_back(layer.name + "." + item.key(), item.value());
      }
      for (const auto& item : layer.module.ptr()->named_buffers()) {
        tensors.emplace_back(layer.name + "." + item.key(), item.value());
      }
    }
  }
  return tensors;
}

// A checkpoint directory holds state-<step>/ (model.pt, optimizer.pt,
// generators.pt) and checkpoint.json naming the newest complete one; the
// rename of checkpoint.json is the commit point. DIR/model.pt is the newest
// weights too, for Python's torch.load.
// Across processes each pipeline rank of replica 0 writes its own stages
// under DIR/rank-<r>/, and rank 0 commits checkpoint.json after a barrier;
// DIR/model.pt then holds rank 0's stages only.
void saveCheckpoint(const fs::path& root, int64_t step, Pipeline& pipe, torch::optim::Optimizer& optimizer,
                    Communicator* communicator = nullptr) {
  const bool distributed = communicator != nullptr;
  const fs::path dir = distributed ? root / ("rank-" + std::to_string(communicator->stageRank())) : root;
  const bool writer = !distributed || communicator->replica() == 0;
  if (!writer) {
    communicator->barrier();
    communicator->barrier();
    return;
  }
  fs::create_directories(dir);
  const std::string name = "state-" + std::to_string(step);
  const fs::path staging = dir / (name + ".tmp");
  fs::remove_all(staging);
  fs::create_directories(staging);
  c10::Dict<std::string, torch::Tensor> weights;
  for (const auto& item : checkpointTensors(pipe, communicator)) {
    weights.insert(item.first, item.second.detach().to(torch::kCPU).contiguous());
  }
  writeBytes(staging / "model.pt", torch::pickle_save(weights));
  torch::save(optimizer, (staging / "optimizer.pt").string());
  c10::List<torch::Tensor> generators;
  for (const auto& state : pipe.generatorStates()) generators.push_back(state);
  writeBytes(staging / "generators.pt", torch::pickle_save(generators));
  const fs::path state = dir / name;
  fs::remove_all(state);
  fs::rename(staging, state);
  writeAtomically(dir / "model.pt", [&](const fs::path& temporary) {
    fs::remove(temporary);
    fs::create_hard_link(state / "model.pt", temporary);
  });
  if (distributed) communicator->barrier();  // every rank's state is written
  if (!distributed || communicator->rank() == 0) {
    nlohmann::json pointer = {{"step", step}, {"state", name}};
    if (distributed) pointer["pipeline_ranks"] = communicator->pipelineRanks();
    writeAtomically(root / "checkpoint.json", [&](const fs::path& temporary) {
      std::ofstream out(temporary);
      out << pointer.dump() << '\n';
    });
  }
  if (distributed) communicator->barrier();  // committed
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    if (file.rfind("state-", 0) == 0 && file != name) fs::remove_all(entry.path());
  }
}

int64_t loadCheckpoint(const fs::path& root, Pipeline& pipe, torch::optim::Optimizer& optimizer,
                       Communicator* communicator = nullptr) {
  const fs::path pointer = root / "checkpoint.json";
  const fs::path dir = communicator ? root / ("rank-" + std::to_string(communicator->stageRank())) : root;
  if (!fs::exists(pointer)) throw ConfigError("--resume: " + pointer.string() + " not found");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(std::ifstream(pointer));
  } catch (const std::exception& error) {
    throw ConfigError("--resume: " + pointer.string() + " is not valid JSON");
  }
  if (communicator && json.value("pipeline_ranks", 0) != communicator->pipelineRanks()) {
    throw ConfigError("--resume: the checkpoint was written by " + std::to_string(json.value("pipeline_ranks", 1)) +
                      " pipeline rank(s) in one process each; resume with the same layout");
  }
  if (!communicator && json.contains("pipeline_ranks")) {
    throw ConfigError("--resume: the checkpoint was written across " + std::to_string(json.value("pipeline_ranks", 0)) +
                      " processes; resume it with `tpipe launch`");
  }
  const int64_t step = json.at("step").get<int64_t>();
  const fs::path state = dir / json.at("state").get<std::string>();
  const auto weights = torch::pickle_load(readBytes(state / "model.pt")).toGenericDict();
  torch::NoGradGuard noGrad;
  auto restore = [&](const std::string& name, torch::Tensor target) {
    if (!weights.contains(name)) throw ConfigError("--resume: the checkpoint has no '" + name + "'");
    const torch::Tensor saved = weights.at(name).toTensor();
    if (saved.sizes() != target.sizes()) {
      throw ConfigError("--resume: '" + name + "' has a different shape in the checkpoint");
    }
    target.copy_(saved);
  };
  for (const auto& item : checkpointTensors(pipe, communicator)) restore(item.first, item.second);
  torch::load(optimizer, (state / "optimizer.pt").string());
  std::vector<torch::Tensor> generators;
  for (const auto& value : torch::pickle_load(readBytes(state / "generators.pt")).toTensorList()) {
    generators.push_back(value);
  }
  pipe.setGeneratorStates(generators);
  return step;
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
  std::vector<int64_t> packed{static_cast<int64_t>(mine.layers.size()), mine.inputBytes, bits(mine.noise)};
  for (const auto& layer : mine.layers) {
    packed.insert(packed.end(), {bits(layer.forwardMs), bits(layer.backwardMs), layer.paramBytes,
                                 layer.activationBytes, layer.stashBytes});
  }
  packed = world.broadcast(packed);
  TrainingCosts costs = mine;
  if (world.rank() == 0) return costs;
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
  costs.source += " (on rank 0)";
  return costs;
}

Plan planFor(const Config& config, const BuiltModel& model, const TrainOptions& options, bool measure,
             Communicator* world) {
  const bool measured = measure || !options.profilePath.empty();
  const bool here = !world || world->rank() == 0;
  // Ranks other than 0 start from parameter bytes and take rank 0's numbers.
  TrainingCosts costs = trainingCosts(config, model, here ? options.profilePath : "", measured && here);
  if (world && measured) costs = sharedCosts(costs, *world);
  return resolvePlan(planRequest(config, costs));
}

PipelineOptions pipelineOptions(const Config& config, const BuiltModel& model, const Plan& plan,
                                const std::shared_ptr<Communicator>& communicator) {
  const auto& p = config.pipeline;
  PipelineOptions options;
  options.devices.clear();
  for (const auto& device : p.devices) options.devices.push_back(device.name);
  options.plan = std::make_shared<const Plan>(plan);
  options.microBatches = p.microBatches;
  options.schedule = p.schedule;
  options.virtualStages = p.virtualStages;
  options.checkpoint = plan.checkpoint;
  options.threadsPerDevice = p.threadsPerDevice;
  options.seed = config.train.seed;
  options.layerOutputShapes.assign(model.shapes.begin() + 1, model.shapes.end());
  options.communicator = communicator;
  return options;
}

std::shared_ptr<Communicator> joinWorld(const Config& config) {
  const WorldInfo world = worldFromEnvironment();
  const int ranks = pipelineRanks(config.pipeline);
  const int replicas = config.pipeline.dataParallel;
  if (world.worldSize == 1) {
    if (replicas > 1) {
      throw ConfigError("pipeline.data_parallel: " + std::to_string(replicas) + " replicas of " +
                        std::to_string(ranks) + " pipeline ranks need " + std::to_string(replicas * ranks) +
                        " processes; start them with `tpipe launch --nproc " + std::to_string(replicas * ranks) +
                        "`");
    }
    return nullptr;
  }
  if (world.worldSize != replicas * ranks) {
    throw ConfigError("WORLD_SIZE " + std::to_string(world.worldSize) + " is not pipeline.data_parallel (" +
                      std::to_string(replicas) + ") x pipeline ranks (" + std::to_string(ranks) + ")");
  }
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(config.pipeline.timeoutS * 1000));
  nlohmann::json run = describeConfig(config);
  run["world"] = {{"size", world.worldSize}, {"pipeline_ranks", ranks}};
  return std::make_shared<Communicator>(world, ranks, timeout, run.dump());
}

// TPIPE_FAULT=rank:step:exit|hang makes one process die or stop answering
// at a step: how the fault tests stand in for a crashed or stuck host.
void injectFault(const Communicator* communicator, int64_t step) {
  static const char* fault = std::getenv("TPIPE_FAULT");
  if (fault == nullptr || communicator == nullptr) return;
  int rank = -1;
  long long at = -1;
  char kind[16] = {0};
  if (std::sscanf(fault, "%d:%lld:%15s", &rank, &at, kind) != 3) return;
  if (rank != communicator->rank() || at != step) return;
  std::fprintf(stderr, "TPIPE_FAULT: rank %d %s at step %lld\n", rank, kind, at);
  if (std::string(kind) == "exit") std::_Exit(17);
  if (std::string(kind) == "hang") {
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

std::string duration(double seconds) {
  std::ostringstream out;
  if (seconds >= 3600) out << static_cast<int>(seconds / 3600) << "h";
  if (seconds >= 60) out << static_cast<int>(std::fmod(seconds, 3600) / 60) << "m";
  out << static_cast<int>(std::fmod(seconds, 60)) << "s";
  return out.str();
}

// Sized parts per device and the caps on what workers may allocate: the
// declared capacity less the parameters and optimizer state living there.
std::vector<MemoryRow> prepareMemory(const Config& config, Pipeline& pipe) {
  const auto& o = config.train.optimizer;
  const double factor = optimizerStateFactor(o.type, o.momentum);
  const std::vector<StageReport>& predicted = pipe.plan().stages;
  const int ranks = pipe.schedule().ranks;
  std::vector<MemoryRow> rows(ranks);
  const auto& boundaries = pipe.boundaries();
  for (int s = 0; s < pipe.schedule().stages(); ++s) {
    MemoryRow& row = rows[s % ranks];
    row.device = config.pipeline.devices[s % ranks].name;
    row.capacityBytes = config.pipeline.devices[s % ranks].memoryBytes;
    row.predictedBytes += predicted[s].memoryBytes;
    for (int l = boundaries[s]; l < boundaries[s + 1]; ++l) {
      for (const auto& p : pipe.layers()[l].module.ptr()->parameters()) {
        const auto bytes = static_cast<int64_t>(p.nbytes());
        row.parameterBytes += bytes;
        if (p.requires_grad()) row.gradientBytes += bytes;
      }
    }
  }
  for (int r = 0; r < ranks; ++r) {
    MemoryRow& row = rows[r];
    row.optimizerBytes = static_cast<int64_t>(factor * static_cast<double>(row.gradientBytes));
    if (row.capacityBytes > 0) {
      const int64_t fixed = row.parameterBytes + row.optimizerBytes;
      if (fixed >= row.capacityBytes) {
        throw ConfigError("pipeline.devices[" + std::to_string(r) + "].memory: " + row.device + " holds " +
                          formatBytes(fixed) + " of parameters and optimizer state, more than its capacity of " +
                          formatBytes(row.capacityBytes) + " (see `tpipe plan`)");
      }
      pipe.setMemoryCapacity(r, row.capacityBytes - fixed);
    }
  }
  pipe.resetPeakMemory();
  return rows;
}

std::vector<MemoryRow> finishMemory(const Pipeline& pipe, std::vector<MemoryRow> rows) {
  const auto measured = pipe.memory();
  for (size_t r = 0; r < rows.size() && r < measured.size(); ++r) {
    MemoryRow& row = rows[r];
    row.workerPeakBytes = measured[r].peakBytes;
    row.activationPeakBytes = std::max<int64_t>(0, row.workerPeakBytes - row.gradientBytes);
    row.measuredPeakBytes = row.parameterBytes + row.optimizerBytes + row.workerPeakBytes;
  }
  return rows;
}

void printMemory(std::ostream& log, const std::vector<MemoryRow>& rows) {
  log << "memory per device (measured peak = parameters + optimizer state + the worker's allocator peak)\n";
  char line[256];
  std::snprintf(line, sizeof line, "%-8s %11s %11s %11s %12s %12s %12s %7s %11s\n", "device", "params", "grads",
                "optimizer", "activations", "measured", "predicted", "error", "capacity");
  log << line;
  for (const auto& row : rows) {
    const double error = row.predictedBytes > 0
                             ? 100.0 * (static_cast<double>(row.predictedBytes) - row.measuredPeakBytes) /
                                   static_cast<double>(row.measuredPeakBytes)
                             : 0.0;
    std::snprintf(line, sizeof line, "%-8s %11s %11s %11s %12s %12s %12s %+6.1f%% %11s\n", row.device.c_str(),
                  formatBytes(row.parameterBytes).c_str(), formatBytes(row.gradientBytes).c_str(),
                  formatBytes(row.optimizerBytes).c_str(), formatBytes(row.activationPeakBytes).c_str(),
                  formatBytes(row.measuredPeakBytes).c_str(), formatBytes(row.predictedBytes).c_str(), error,
                  row.capacityBytes > 0 ? formatBytes(row.capacityBytes).c_str() : "-");
    log << line;
  }
}

void writeTraceOutputs(const Trace& trace, const TrainOptions& options, TrainSummary& summary,
                       std::ostream& log) {
  if (trace.steps.empty()) return;
  summary.bubble = bubbleReport(trace);
  printBubbleReport(log, summary.bubble);
  auto write = [](const std::string& path, const std::string& text) {
    if (path.empty()) return;
    writeAtomically(path, [&](const fs::path& temporary) {
      std::ofstream out(temporary);
      out << text;
      if (!out) throw std::runtime_error("cannot write " + path);
    });
  };
  write(options.tracePath, chromeTrace(trace).dump() + "\n");
  write(options.timelinePath, timelineSvg(trace));
  write(options.reportPath, bubbleReportToJson(summary.bubble).dump(1) + "\n");
  for (const auto* path : {&options.tracePath, &options.timelinePath, &options.reportPath}) {
    if (!path->empty()) log << "wrote " << *path << "\n";
  }
}

}  // namespace

TrainSummary train(const Config& config, const TrainOptions& givenOptions) {
  const std::shared_ptr<Communicator> communicator = joinWorld(config);
  Communicator* const world = communicator.get();
  TrainOptions options = givenOptions;
  std::ostringstream silent;
  if (world) {
    // Rank 0 speaks for the world; the bubble and memory reports are local
    // to one process and stay off.
    if (world->rank() != 0) {
      options.log = &silent;
      options.metricsPath.clear();
    }
    options.recordSteps = 0;
    options.memoryReport = false;
  }
  std::ostream& log = options.log ? *options.log : std::cout;
  const bool live = options.log == nullptr && ::isatty(STDOUT_FILENO);
  BuiltModel model = buildModel(config.model, config.train.seed);
  setBatchNormMicroBatches(model, config.pipeline.microBatches);
  const Dataset data = loadDataset(config, model);
  bool capped = false;
  for (const auto& device : config.pipeline.devices) capped = capped || device.memoryBytes > 0;
  const bool measureMemory = !world && (capped || options.memoryReport);
  const Plan plan = planFor(config, model, options, needsMeasuredCosts(config) || measureMemory, world);
  PipelineOptions pipeOptions = pipelineOptions(config, model, plan, communicator);
  pipeOptions.trackMemory = measureMemory;
  Pipeline pipe(model.layers, pipeOptions);
  std::vector<MemoryRow> memoryRows;
  if (measureMemory) memoryRows = prepareMemory(config, pipe);
  auto optimizer = makeOptimizer(config.train.optimizer, pipe.parameters());
  const LossFunction lossFn = makeLoss(config.train.loss);
  const bool classification = config.train.loss == "cross_entropy";
  BatchSource batches(data, config.train.batchSize, config.data.shuffle, config.train.seed);

  TrainSummary summary;
  if (!options.resumeDir.empty()) {
    summary.startStep = loadCheckpoint(options.resumeDir, pipe, *optimizer, world);
    if (summary.startStep > config.train.steps) {
      throw ConfigError("--resume: the checkpoint is at step " + std::to_string(summary.startStep) +
                        ", past train.steps = " + std::to_string(config.train.steps));
    }
  }
  std::ofstream metrics;
  if (!options.metricsPath.empty()) {
    metrics.open(options.metricsPath, summary.startStep > 0 ? std::ios::app : std::ios::trunc);
    if (!metrics) throw ConfigError("--metrics: cannot write " + options.metricsPath);
  }
  log << "model: " << model.layers.size() << " layers, " << model.parameterCount << " parameters; "
      << data.description << "\n";
  if (world) {
    log << "processes: " << world->worldSize() << " (" << world->replicas() << " replica(s) x "
        << world->pipelineRanks() << " pipeline ranks), rendezvous over c10d TCPStore + Gloo\n";
  }
  log << "pipeline: " << pipe.schedule().stages() << " stages on";
  for (const auto& device : pipe.stageDevices()) log << ' ' << device;
  log << ", boundaries";
  for (int b : pipe.boundaries()) log << ' ' << b;
  log << ", " << config.pipeline.microBatches << " micro-batches, " << config.pipeline.schedule << ", checkpoint "
      << config.pipeline.checkpoint << "\n";
  log << "plan: partition " << partitionMethodName(plan.partition) << ", costs from " << plan.costSource;
  if (plan.simulation.makespan > 0) log << ", predicted step " << std::fixed << std::setprecision(2)
                                        << plan.simulation.makespan << " ms" << std::defaultfloat;
  log << "\n";
  for (const auto& note : plan.notes) log << "plan: " << note << "\n";
  if (summary.startStep > 0) log << "resumed at step " << summary.startStep << "\n";

  const int64_t total = config.train.steps;
  const int64_t last = options.stopAfter > 0 ? std::min(total, options.stopAfter) : total;
  const int64_t logEvery = config.train.logEvery > 0 ? config.train.logEvery : std::max<int64_t>(1, total / 20);
  const int64_t evalChunk = std::max<int64_t>(config.train.batchSize, 256);
  const auto start = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  auto runEvaluation = [&](int64_t step) {
    const Evaluation e = evaluate(pipe, data, lossFn, classification, evalChunk, world);
    summary.evalLoss = e.loss;
    summary.evalAccuracy = e.accuracy;
    if (metrics.is_open()) {
      nlohmann::json record = {{"step", step}, {"eval_loss", e.loss}, {"elapsed_s", elapsed()}};
      if (classification) record["eval_accuracy"] = e.accuracy;
      metrics << record.dump() << '\n' << std::flush;
    }
    if (live) log << '\n';
    log << "eval at step " << step << ": loss " << std::fixed << std::setprecision(4) << e.loss;
    if (classification) log << ", accuracy " << e.accuracy;
    log << std::defaultfloat << "\n";
  };

  if (!options.saveDir.empty() && total == 0) saveCheckpoint(options.saveDir, 0, pipe, *optimizer, world);
  const int64_t recordFrom = std::max<int64_t>(summary.startStep, last - std::max(0, options.recordSteps));
  for (int64_t step = summary.startStep; step < last; ++step) {
    if (step == recordFrom && options.recordSteps > 0) pipe.setRecording(true);
    const double lr = learningRate(config.train, step);
    for (auto& group : optimizer->param_groups()) group.options().set_lr(lr);
    injectFault(world, step);
    auto [x, y] = batches.batch(step);
    if (world && world->replicas() > 1) {
      const int64_t share = config.train.batchSize / world->replicas();
      x = x.narrow(0, world->replica() * share, share);
      y = y.narrow(0, world->replica() * share, share);
    }
    optimizer->zero_grad();
    const double loss = pipe.trainStep(x, y, lossFn).item<double>();
    if (!std::isfinite(loss)) {
      throw std::runtime_error("the loss became " + std::to_string(loss) + " at step " + std::to_string(step + 1) +
                               " (lower train.optimizer.lr?)");
    }
    optimizer->step();
    summary.losses.push_back(loss);
    summary.finalLoss = loss;
    const int64_t done = step + 1;
    const double seconds = elapsed();
    const double rate = static_cast<double>((done - summary.startStep) * config.train.batchSize) / seconds;
    if (metrics.is_open()) {
      metrics << nlohmann::json{{"step", done}, {"loss", loss}, {"lr", lr},
                                {"elapsed_s", seconds}, {"samples_per_s", rate}}.dump()
              << '\n';
    }
    const double eta = static_cast<double>(total - done) * config.train.batchSize / std::max(rate, 1e-9);
    if (live) {
      log << "\rstep " << done << "/" << total << "  loss " << std::fixed << std::setprecision(4) << loss
          << "  " << std::setprecision(0) << rate << " samples/s  ETA " << duration(eta) << "   "
          << std::defaultfloat << std::flush;
    } else if (done % logEvery == 0 || done == total) {
      log << "step " << done << "/" << total << " loss " << std::fixed << std::setprecision(4) << loss << " "
          << std::setprecision(0) << rate << " samples/s ETA " << duration(eta) << std::defaultfloat << "\n";
    }
    if (options.evaluate && config.train.evalEvery > 0 && done % config.train.evalEvery == 0 && done != total) {
      runEvaluation(done);
    }
    if (!options.saveDir.empty() &&
        (done == last || (config.train.checkpointEvery > 0 && done % config.train.checkpointEvery == 0))) {
      saveCheckpoint(options.saveDir, done, pipe, *optimizer, world);
    }
  }
  if (live) log << '\n';
  summary.steps = last;
  summary.seconds = elapsed();
  summary.samplesPerSecond =
      static_cast<double>((last - summary.startStep) * config.train.batchSize) / std::max(summary.seconds, 1e-9);
  pipe.setRecording(false);
  writeTraceOutputs(pipe.trace(), options, summary, log);
  if (measureMemory) {
    summary.memory = finishMemory(pipe, memoryRows);
    printMemory(log, summary.memory);
  }
  if (!options.evaluate) return summary;
  runEvaluation(last);
  log << "done: " << last << " steps in " << std::fixed << std::setprecision(1) << summary.seconds << " s, "
      << std::setprecision(0) << summary.samplesPerSecond << " samples/s, final loss " << std::setprecision(4)
      << summary.finalLoss << ", eval loss " << summary.evalLoss;
  if (classification) log << ", eval accuracy " << summary.evalAccuracy;
  log << std::defaultfloat << "\n";
  return summary;
}

}  // namespace tpipe
