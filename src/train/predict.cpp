// `tpipe predict`: the training run's pipeline, forward only, over a
// checkpoint's weights.
#include <chrono>
#include <iostream>

#include <torch/csrc/jit/serialization/pickle.h>

#include "data/tensor_files.h"
#include "tpipe/predict.h"
#include "train/checkpoint.h"
#include "train/files.h"
#include "train/parts.h"

namespace tpipe {
namespace {

constexpr int64_t kChunksPerCall = 8;

// The tensor of a torch.save(X) file, or of the "inputs" key of a dict.
at::Tensor inputTensor(const std::string& path) {
  const c10::IValue value = readTorchSave("--input", path);
  if (value.isTensor())
    return value.toTensor();
  if (value.isGenericDict())
    return tensorOfDict(value.toGenericDict(), "inputs", "--input: " + path);
  throw ConfigError(
      "--input: " + path + " holds a " + value.tagKind() +
      "; expected a tensor, or a dict with a tensor under \"inputs\"");
}

// A NaN or an infinity in a sample's input gives that sample a prediction
// of NaN, and the others stand: said, not refused (training refuses such
// data, since one sample there reaches every weight).
void sayNonFinite(
    const at::Tensor& predictions,
    const at::Tensor& inputs,
    std::ostream& log) {
  const at::Tensor bad = predictions.reshape({predictions.size(0), -1})
                             .isfinite()
                             .logical_not()
                             .any(1);
  const int64_t count = bad.sum().item<int64_t>();
  if (count == 0)
    return;
  const int64_t first = bad.nonzero()[0][0].item<int64_t>();
  log << "predict: " << count << " of " << predictions.size(0)
      << " predictions hold NaN or an infinity, the first sample " << first;
  if (at::isFloatingType(inputs.scalar_type()) &&
      !inputs[first].isfinite().all().item<bool>())
    log << ", whose input does too";
  log << "\n";
}

} // namespace

PredictSummary predict(const Config& given, const PredictOptions& options) {
  const Config config = fittedToWorld(given);
  if (options.resumeDir.empty())
    throw ConfigError(
        "predict: --resume DIR (a checkpoint of `train --save DIR`) is required");
  if (options.inputPath.empty())
    throw ConfigError("predict: --input X.pt is required");
  if (options.outputPath.empty())
    throw ConfigError("predict: --output Y.pt is required");
  checkOutputPath("--output", options.outputPath);
  std::vector<RunInput> read = inputsOf(config);
  read.push_back({"the config", options.configPath});
  read.push_back({"--input", options.inputPath});
  read.push_back({"--resume", options.resumeDir, RunInput::Kind::kCheckpoint});
  refuseOutputsOverInputs({{"--output", options.outputPath}}, read);
  std::ostream& log = options.log ? *options.log : std::cout;
  const std::shared_ptr<Communicator> world = joinWorld(config);
  const BuiltModel model = buildModel(config);
  const at::Tensor inputs = modelInputs(
      inputTensor(options.inputPath), "--input: " + options.inputPath, model);
  // Training's micro-batch size, but up to 8 times as many micro-batches
  // per pipelined call: a forward-only call idles (p - 1) / (m + p - 1) of
  // its time filling and draining, so longer calls waste less.
  Config inference = config;
  const int64_t calls = std::max<int64_t>(
      1,
      std::min<int64_t>(
          kChunksPerCall, inputs.size(0) / config.train.batchSize));
  inference.train.batchSize *= calls;
  inference.pipeline.microBatches *= static_cast<int>(calls);
  const Plan plan =
      planTraining(
          inference, model, "", needsMeasuredCosts(inference), world.get())
          .plan;
  Pipeline pipe(model.layers, pipelineOptions(inference, model, plan, world));
  // The optimizer only receives the checkpoint's state: resume's checks
  // (checksums, layer names, layout) are the ones a prediction needs.
  auto optimizer = makeOptimizer(config.train.optimizer, pipe.parameters());
  const CheckpointIdentity identity{
      runFingerprint(config),
      config.train.optimizer.type,
      runDescription(config),
      /*acceptChanges=*/true};
  Resumed resumed;
  {
    DirectoryLock reading(
        options.resumeDir, DirectoryLock::Mode::kRead, "--resume");
    resumed = loadCheckpoint(
        options.resumeDir, pipe, *optimizer, identity, world.get());
  }
  for (const auto& layer : pipe.layers())
    layer.module.ptr()->train(false);
  const bool writer = !world || world->replica() == 0;
  if (!world || world->rank() == 0) {
    log << "predict: " << inputs.size(0) << " samples, the weights of step "
        << resumed.step << " from " << options.resumeDir << ", "
        << plan.schedule.stages() << " stage(s), "
        << inference.pipeline.microBatches << " micro-batches per chunk of "
        << inference.train.batchSize << "\n";
    if (!resumed.note.empty())
      log << "predict: " << resumed.note << "\n";
  }
  const int64_t n = inputs.size(0), chunk = inference.train.batchSize;
  std::vector<at::Tensor> outputs;
  const auto start = std::chrono::steady_clock::now();
  for (int64_t first = 0; first < n; first += chunk) {
    const at::Tensor out =
        pipe.forward(inputs.narrow(0, first, std::min(chunk, n - first)));
    if (out.defined() && writer)
      outputs.push_back(out.to(at::kCPU));
  }
  PredictSummary summary;
  summary.samples = n;
  summary.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  if (!outputs.empty()) {
    const at::Tensor all = at::cat(outputs);
    const std::vector<char> bytes = torch::jit::pickle_save(all);
    writeOutputFile(
        options.outputPath, std::string(bytes.begin(), bytes.end()));
    summary.wroteOutput = true;
    log << "predict: " << n << " samples in " << summary.seconds << " s, "
        << static_cast<int64_t>(n / std::max(summary.seconds, 1e-9))
        << " samples/s; wrote " << options.outputPath << " ("
        << shapeText(all.sizes()) << " " << c10::toString(all.scalar_type())
        << ")\n";
    sayNonFinite(all, inputs, log);
  }
  return summary;
}

} // namespace tpipe
