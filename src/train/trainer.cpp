// The training loop behind `tpipe train`: batches, optimizer and learning
// rate schedule, progress, metrics, evaluation and checkpoints.
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
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

Evaluation evaluate(Pipeline& pipe, const Dataset& data, const LossFunction& lossFn, bool classification,
                    int64_t chunk) {
  setTraining(pipe.layers(), false);
  Evaluation result;
  const int64_t n = data.evalInputs.size(0);
  double lossSum = 0.0, correct = 0.0, positions = 0.0;
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t size = std::min(chunk, n - start);
    const torch::Tensor x = data.evalInputs.narrow(0, start, size);
    const torch::Tensor y = data.evalTargets.narrow(0, start, size);
    const torch::Tensor out = pipe.forward(x).to(torch::kCPU);
    lossSum += lossFn(out, y).item<double>() * static_cast<double>(size);
    if (classification) {
      correct += out.argmax(-1).eq(y).sum().item<double>();
      positions += static_cast<double>(y.numel());
    }
  }
  setTraining(pipe.layers(), true);
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

// A checkpoint directory holds state-<step>/ (model.pt, optimizer.pt,
// generators.pt) and checkpoint.json naming the newest complete one; the
// rename of checkpoint.json is the commit point. DIR/model.pt is the newest
// weights too, for Python's torch.load.
void saveCheckpoint(const fs::path& dir, int64_t step, Pipeline& pipe, torch::optim::Optimizer& optimizer) {
  fs::create_directories(dir);
  const std::string name = "state-" + std::to_string(step);
  const fs::path staging = dir / (name + ".tmp");
  fs::remove_all(staging);
  fs::create_directories(staging);
  c10::Dict<std::string, torch::Tensor> weights;
  for (const auto& named : pipe.namedParameters()) {
    weights.insert(named.first, named.second.detach().to(torch::kCPU).contiguous());
  }
  for (const auto& layer : pipe.layers()) {
    for (const auto& buffer : layer.module.ptr()->named_buffers()) {
      weights.insert(layer.name + "." + buffer.key(), buffer.value().detach().to(torch::kCPU).contiguous());
    }
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
  writeAtomically(dir / "checkpoint.json", [&](const fs::path& temporary) {
    std::ofstream out(temporary);
    out << nlohmann::json{{"step", step}, {"state", name}}.dump() << '\n';
  });
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    if (file.rfind("state-", 0) == 0 && file != name) fs::remove_all(entry.path());
  }
}

int64_t loadCheckpoint(const fs::path& dir, Pipeline& pipe, torch::optim::Optimizer& optimizer) {
  const fs::path pointer = dir / "checkpoint.json";
  if (!fs::exists(pointer)) throw ConfigError("--resume: " + pointer.string() + " not found");
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(std::ifstream(pointer));
  } catch (const std::exception& error) {
    throw ConfigError("--resume: " + pointer.string() + " is not valid JSON");
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
  for (const auto& named : pipe.namedParameters()) restore(named.first, named.second);
  for (const auto& layer : pipe.layers()) {
    for (const auto& buffer : layer.module.ptr()->named_buffers()) restore(layer.name + "." + buffer.key(), buffer.value());
  }
  torch::load(optimizer, (state / "optimizer.pt").string());
  std::vector<torch::Tensor> generators;
  for (const auto& value : torch::pickle_load(readBytes(state / "generators.pt")).toTensorList()) {
    generators.push_back(value);
  }
  pipe.setGeneratorStates(generators);
  return step;
}

PipelineOptions pipelineOptions(const Config& config, const BuiltModel& model) {
  const auto& p = config.pipeline;
  PipelineOptions options;
  options.devices.clear();
  for (const auto& device : p.devices) options.devices.push_back(device.name);
  options.stages = p.stages;
  options.balance = p.balance;
  options.partition = p.partition == "parameters" ? PartitionMethod::kParameters : PartitionMethod::kUniform;
  options.microBatches = p.microBatches;
  options.schedule = p.schedule;
  options.virtualStages = p.virtualStages;
  options.checkpoint = parseCheckpointMode(p.checkpoint);
  options.threadsPerDevice = p.threadsPerDevice;
  options.seed = config.train.seed;
  if (p.partition == "time") {
    const PartitionPlan plan = planModel(config, model, profileModel(config, model));
    options.balance = balanceOf(plan.boundaries);
    options.stages = static_cast<int>(options.balance.size());
  }
  return options;
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
std::vector<MemoryRow> prepareMemory(const Config& config, const BuiltModel& model, Pipeline& pipe) {
  const auto& o = config.train.optimizer;
  const double factor = o.type == "sgd" ? (o.momentum > 0 ? 1.0 : 0.0) : 2.0;
  const Profile profile = profileModel(config, model, 1);
  const PartitionProblem problem = partitionProblem(config, profile.costsAt(profile.microBatchSize),
                                                    profile.inputBytes);
  const PartitionPlan predicted = evaluatePartition(problem, pipe.boundaries());
  const int ranks = pipe.schedule().ranks;
  std::vector<MemoryRow> rows(ranks);
  const auto& boundaries = pipe.boundaries();
  for (int s = 0; s < pipe.schedule().stages(); ++s) {
    MemoryRow& row = rows[s % ranks];
    row.device = config.pipeline.devices[s % ranks].name;
    row.capacityBytes = config.pipeline.devices[s % ranks].memoryBytes;
    row.predictedBytes += predicted.stages[s].memoryBytes;
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

Profile profileModel(const Config& config, const BuiltModel& model, int repeats) {
  ProfileOptions options;
  const int64_t m = config.pipeline.microBatches;
  options.microBatchSize = (config.train.batchSize + m - 1) / m;
  options.repeats = repeats;
  const std::string& first = config.pipeline.devices.front().name;
  options.device = first.rfind("cuda", 0) == 0 ? first : "cpu";
  torch::manual_seed(config.train.seed);
  const std::vector<int64_t>& shape = model.shapes.front();
  auto sample = [&](int64_t n) {
    std::vector<int64_t> sizes{n};
    sizes.insert(sizes.end(), shape.begin(), shape.end());
    if (!model.integerInput) return torch::randn(sizes);
    const int64_t vocab = config.model.layers.front().params["num_embeddings"].get<int64_t>();
    return torch::randint(vocab, sizes, torch::kLong);
  };
  return profileLayers(model.layers, sample, options);
}

PartitionPlan planModel(const Config& config, const BuiltModel& model, const Profile& profile) {
  std::vector<int64_t> parameters;
  for (const auto& layer : model.layers) {
    int64_t count = 0;
    for (const auto& p : layer.module.ptr()->parameters()) count += p.numel();
    parameters.push_back(count);
  }
  const PartitionProblem problem = partitionProblem(config, profile.costsAt(profile.microBatchSize),
                                                    profile.inputBytes);
  try {
    return planFor(config, problem, parameters);
  } catch (const PartitionError& error) {
    throw ConfigError(std::string("pipeline: ") + error.what());
  }
}

TrainSummary train(const Config& config, const TrainOptions& options) {
  std::ostream& log = options.log ? *options.log : std::cout;
  const bool live = options.log == nullptr && ::isatty(STDOUT_FILENO);
  BuiltModel model = buildModel(config.model, config.train.seed);
  setBatchNormMicroBatches(model, config.pipeline.microBatches);
  const Dataset data = loadDataset(config, model);
  PipelineOptions pipeOptions = pipelineOptions(config, model);
  bool capped = false;
  for (const auto& device : config.pipeline.devices) capped = capped || device.memoryBytes > 0;
  const bool measureMemory = capped || options.memoryReport;
  pipeOptions.trackMemory = measureMemory;
  Pipeline pipe(model.layers, pipeOptions);
  std::vector<MemoryRow> memoryRows;
  if (measureMemory) memoryRows = prepareMemory(config, model, pipe);
  auto optimizer = makeOptimizer(config.train.optimizer, pipe.parameters());
  const LossFunction lossFn = makeLoss(config.train.loss);
  const bool classification = config.train.loss == "cross_entropy";
  BatchSource batches(data, config.train.batchSize, config.data.shuffle, config.train.seed);

  TrainSummary summary;
  if (!options.resumeDir.empty()) {
    summary.startStep = loadCheckpoint(options.resumeDir, pipe, *optimizer);
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
  log << "pipeline: " << pipe.schedule().stages() << " stages on";
  for (const auto& device : pipe.stageDevices()) log << ' ' << device;
  log << ", boundaries";
  for (int b : pipe.boundaries()) log << ' ' << b;
  log << ", " << config.pipeline.microBatches << " micro-batches, " << config.pipeline.schedule << ", checkpoint "
      << config.pipeline.checkpoint << "\n";
  if (summary.startStep > 0) log << "resumed at step " << summary.startStep << "\n";

  const int64_t total = config.train.steps;
  const int64_t last = options.stopAfter > 0 ? std::min(total, options.stopAfter) : total;
  const int64_t logEvery = config.train.logEvery > 0 ? config.train.logEvery : std::max<int64_t>(1, total / 20);
  const int64_t evalChunk = std::max<int64_t>(config.train.batchSize, 256);
  const auto start = Clock::now();
  auto elapsed = [&] { return std::chrono::duration<double>(Clock::now() - start).count(); };
  auto runEvaluation = [&](int64_t step) {
    const Evaluation e = evaluate(pipe, data, lossFn, classification, evalChunk);
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

  if (!options.saveDir.empty() && total == 0) saveCheckpoint(options.saveDir, 0, pipe, *optimizer);
  const int64_t recordFrom = std::max<int64_t>(summary.startStep, last - std::max(0, options.recordSteps));
  for (int64_t step = summary.startStep; step < last; ++step) {
    if (step == recordFrom && options.recordSteps > 0) pipe.setRecording(true);
    const double lr = learningRate(config.train, step);
    for (auto& group : optimizer->param_groups()) group.options().set_lr(lr);
    auto [x, y] = batches.batch(step);
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
      saveCheckpoint(options.saveDir, done, pipe, *optimizer);
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
