// A training run described in one JSON file: model, data, pipeline, train.
//
// parseConfig checks every key and value and throws ConfigError naming the
// JSON path ("pipeline.micro_batches: expected a positive integer, got -3");
// unknown keys get a did-you-mean hint. Defaults are filled in, so a parsed
// Config is complete. Plain C++: no tensors here.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tpipe/errors.h"
#include "tpipe/plan.h"
#include "tpipe/schedule.h"

namespace tpipe {

struct LayerSpec {
  std::string type;      // "linear", "conv2d", ..., "transformer_block"
  nlohmann::json params; // checked against the type's keys, defaults filled
  // "tied_to": an earlier layer whose weight this layer's weight is (same
  // shape): a GPT's LM head tied to its token embedding. -1: none.
  int tiedTo = -1;
  // Skip connections (tpipe/pipeline.h, NamedLayer): "stash": "s1" keeps
  // this layer's output as s1; "pop": "s1" merges s1 into this layer's
  // output by "merge": "add" (the default) or "concat" (along dim 1 of the
  // batch, the channels or features). Names are stashed and popped once.
  std::vector<std::string> stash{}, pop{};
  std::string merge = "add";
};

struct ModelConfig {
  std::vector<int64_t> inputShape; // per sample, without the batch dim
  std::vector<LayerSpec> layers;   // empty with `torchscript`
  // A model scripted in Python (tpipe/torchscript.h): its children are the
  // layers, counted only when it is loaded (checkPipelineFitsLayers).
  std::string torchscript;
  bool tokenInput = false; // token ids in (text and token data)
};

struct DataConfig {
  std::string dataset;  // fashion-mnist | text | tokens | tensors | synthetic
  std::string path;     // directory (fashion-mnist) or file (text, tokens,
                        // tensors: a torch.save({"inputs", "targets"}) file)
  std::string evalPath; // tensors: the evaluation file; empty: hold out a
                        // tenth of path's samples
  bool shuffle = true;
  bool normalize = false; // fashion-mnist: standardize with mean/std
  int64_t seqLen = 64;    // text: characters per sample
  int64_t stride =
      0; // text: training windows start every stride bytes (0: seq_len / 4)
  int64_t samples = 1024;  // synthetic: training samples
  int64_t evalSamples = 0; // 0: the dataset's own test split / default
};

struct DeviceConfig {
  std::string name;        // "cpu:0", "cuda:1"
  int64_t memoryBytes = 0; // declared capacity; 0: unlimited
  double speed = 1.0;      // relative speed for the partitioner
};

struct PipelineConfig {
  std::vector<DeviceConfig> devices;
  int stages = 0; // 0: one per device
  int microBatches = 1;
  ScheduleSource schedule = ScheduleKind::kGpipe;
  int virtualStages = 1;
  CheckpointMode checkpoint = CheckpointMode::kExceptLast;
  PartitionMethod partition = PartitionMethod::kUniform;
  std::vector<int> balance;
  int threadsPerDevice = 0;
  int dataParallel = 1;   // replicas of the pipeline, one process per rank
  double timeoutS = 60.0; // across processes: give up on a silent peer
  // With data_parallel > 1: reduce each stage's gradients as soon as its
  // backward ends (PipelineOptions::overlapGradientSync).
  bool overlapGradSync = true;
  // In one process with a worker per device: each device updates its own
  // parameters as soon as its part of a step ends, and starts the next
  // step's work behind it (optimizer post-validation,
  // Pipeline::postStep); results equal synchronous steps bit for bit.
  bool overlapSteps = true;
  // PipelineOptions::directWeightGradients: the weight gradients of Linear
  // and Conv2d layers computed directly in every backward.
  bool directWeightGradients = true;
  // Across processes: GPU tensors go over NCCL where it can pair the two
  // GPUs; false stages them through host memory over Gloo.
  bool nccl = true;
  // "auto": `tpipe train` tunes first (tpipe/tune.h) and trains with the
  // choice; the devices are what it may use.
  bool autoTune = false;
  // pipeline.elastic.min_ranks: across processes the pipeline has as many
  // ranks as the world holds (WORLD_SIZE / data_parallel), on the first
  // devices listed, and refuses fewer than this; 0: the devices fix it.
  int elasticMinRanks = 0;
};

struct OptimizerConfig {
  std::string type = "sgd"; // sgd | adam | adamw
  double lr = 0.1;
  double momentum = 0.0;
  double weightDecay = 0.0;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  int64_t warmupSteps = 0;    // linear warm-up from 0 to lr
  std::string decay = "none"; // none | cosine (to minLr at the last step)
  double minLr = 0.0;
};

struct TrainConfig {
  int64_t batchSize = 64;
  int64_t steps = 100;
  std::string loss = "cross_entropy"; // cross_entropy | mse
  uint64_t seed = 0;
  OptimizerConfig optimizer;
  int64_t evalEvery = 0;       // 0: evaluate at the end only
  int64_t checkpointEvery = 0; // 0: save at the end only (with --save)
  int64_t logEvery = 0;        // 0: about 20 progress lines per run
  // One global gradient norm over every stage and rank, clipped to this
  // (Pipeline::clipGradNorm); 0: measured, not clipped.
  double clipGradNorm = 0.0;
  // A non-finite loss or gradient: "stop" ends the run naming the step and
  // stage; "skip" skips that step's update on every stage and rank.
  std::string onNonFinite = "stop";
  // "fp32", or "bf16": forwards under bf16 autocast (PipelineOptions).
  std::string precision = "fp32";

  // A clip or skipped non-finite steps: every step's gradients are checked
  // (their norm over every stage and rank) before any update. That norm is
  // one more pass over every gradient, which a plain loop does not make, so
  // it runs only when asked for. With on_nonfinite "stop" alone the loss is
  // checked every step, and a gradient that turns non-finite while the loss
  // stays finite stops the run at the next step's loss.
  bool checksGradients() const {
    return clipGradNorm > 0 || onNonFinite == "skip";
  }
};

struct Config {
  ModelConfig model;
  DataConfig data;
  PipelineConfig pipeline;
  TrainConfig train;
};

// Total stages: `stages`, else the balance's length, else one per device
// times the virtual stages. Pipeline ranks are that over virtual stages.
int configuredStages(const PipelineConfig& pipeline);
inline int pipelineRanks(const PipelineConfig& pipeline) {
  return configuredStages(pipeline) / pipeline.virtualStages;
}

// Parses and checks a config; throws ConfigError.
Config parseConfig(const nlohmann::json& json);

// The stage count and balance against the model's layer count (parseConfig
// checks a layer list; a TorchScript model's count is known once loaded).
void checkPipelineFitsLayers(const PipelineConfig& pipeline, size_t layers);

// Every resolved value, defaults filled, keyed as in the JSON file: what
// the ranks of one job compare before they train together.
nlohmann::json describeConfig(const Config& config);

// Reads a JSON file, applies "key.path=value" overrides (value parsed as
// JSON when it is valid JSON, as a string otherwise), and parses it.
nlohmann::json readConfigJson(
    const std::string& path,
    const std::vector<std::string>& overrides = {});
Config loadConfig(
    const std::string& path,
    const std::vector<std::string>& overrides = {});

// Applies one "a.b.0.c=value" override in place; throws ConfigError.
void applyOverride(nlohmann::json& json, const std::string& assignment);

// "512MiB", "2GB", "1024" -> bytes; throws ConfigError naming `path`.
int64_t parseBytes(const nlohmann::json& value, const std::string& path);

// Built-in default paths and facts used by the checks.
extern const char* const kFashionMnistPath;
extern const char* const kDefaultTextPath;

} // namespace tpipe
