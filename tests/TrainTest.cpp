#include <gtest/gtest.h>

#include <sys/stat.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <torch/torch.h>

#include "data/tensor_files.h"
#include "model/layer_types.h"
#include "tpipe/trainer.h"

namespace tpipe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

Json smokeConfig() {
  return Json::parse(R"({
    "model": {"input_shape": [12], "layers": [
      {"type": "linear", "out_features": 16}, {"type": "tanh"},
      {"type": "dropout", "p": 0.2},
      {"type": "linear", "out_features": 16}, {"type": "gelu"},
      {"type": "linear", "out_features": 4}]},
    "data": {"dataset": "synthetic", "samples": 96},
    "pipeline": {"devices": ["cpu:0", "cpu:1", "cpu:2"], "micro_batches": 3, "schedule": "1f1b"},
    "train": {"batch_size": 24, "steps": 8, "loss": "cross_entropy", "seed": 3,
              "optimizer": {"type": "adam", "lr": 0.01, "warmup_steps": 2, "decay": "cosine"},
              "log_every": 100}
  })");
}

Config withOverrides(Json json, const std::vector<std::string>& overrides) {
  for (const auto& assignment : overrides)
    applyOverride(json, assignment);
  return parseConfig(json);
}

TrainSummary quietTrain(const Config& config, TrainOptions options = {}) {
  std::ostringstream sink;
  options.log = &sink;
  return train(config, options);
}

// The config's losses under gpipe, 1f1b and zb-h1, with and without
// rematerialization, equal `reference`'s step by step.
void expectEveryScheduleMatches(
    const Json& config,
    const TrainSummary& reference,
    double tolerance) {
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1"}) {
    for (const char* checkpoint : {"always", "never"}) {
      SCOPED_TRACE(std::string(schedule) + " " + checkpoint);
      const auto piped = quietTrain(withOverrides(
          config,
          {std::string("pipeline.schedule=") + schedule,
           std::string("pipeline.checkpoint=") + checkpoint}));
      ASSERT_EQ(piped.losses.size(), reference.losses.size());
      for (size_t i = 0; i < piped.losses.size(); ++i)
        EXPECT_NEAR(piped.losses[i], reference.losses[i], tolerance) << i;
    }
  }
}

fs::path scratch(const std::string& name) {
  const fs::path dir = fs::temp_directory_path() /
      ("tpipe-test-" + std::to_string(::getpid()) + "-" + name);
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

// Trains until `stopAfter` steps, saving into `dir`, then resumes from that
// checkpoint to the end (metrics, when named, appended across both); the
// resumed run's summary.
TrainSummary stopAndResume(
    const Json& json,
    const fs::path& dir,
    int stopAfter,
    const std::string& metricsPath = "") {
  TrainOptions save;
  save.saveDir = (dir / "ckpt").string();
  save.metricsPath = metricsPath;
  save.stopAfter = stopAfter;
  quietTrain(parseConfig(json), save);
  TrainOptions resume = save;
  resume.stopAfter = 0;
  resume.resumeDir = save.saveDir;
  return quietTrain(parseConfig(json), resume);
}

std::string shapeError(const Json& layers, const std::vector<int64_t>& input) {
  ModelConfig model;
  model.inputShape = input;
  Json config = smokeConfig();
  config["model"]["layers"] = layers;
  config["model"]["input_shape"] = input;
  config["pipeline"]["devices"] = Json::array({"cpu:0"});
  try {
    buildModel(parseConfig(config).model, 0);
  } catch (const ConfigError& error) {
    return error.what();
  }
  return "";
}

TEST(TrainTest, ShapeInferenceSizesEveryLayer) {
  Json json = smokeConfig();
  json["model"] = Json::parse(R"({"input_shape": [1, 28, 28], "layers": [
      {"type": "conv2d", "out_channels": 4, "kernel_size": 5, "stride": 2},
      {"type": "batchnorm2d"}, {"type": "relu"},
      {"type": "avgpool2d", "kernel_size": [2, 3]},
      {"type": "maxpool2d", "kernel_size": 2, "padding": 1},
      {"type": "flatten"}, {"type": "layernorm"}, {"type": "sigmoid"},
      {"type": "linear", "out_features": 4}]})");
  BuiltModel model = buildModel(parseConfig(json).model, 0);
  const std::vector<std::vector<int64_t>> expected = {
      {1, 28, 28},
      {4, 12, 12},
      {4, 12, 12},
      {4, 12, 12},
      {4, 6, 4},
      {4, 4, 3},
      {48},
      {48},
      {48},
      {4}};
  EXPECT_EQ(model.shapes, expected);
  // The inferred shapes are the real ones.
  torch::Tensor x = torch::randn({2, 1, 28, 28});
  for (size_t i = 0; i < model.layers.size(); ++i) {
    x = model.layers[i].module.forward(x);
    std::vector<int64_t> want{2};
    want.insert(want.end(), expected[i + 1].begin(), expected[i + 1].end());
    EXPECT_EQ(x.sizes().vec(), want) << "layer " << i;
  }
}

TEST(TrainTest, ShapeInferenceNamesTheFirstLayerThatDoesNotFit) {
  EXPECT_EQ(
      shapeError(
          Json::parse(R"([{"type": "linear", "out_features": 4},
                                      {"type": "conv2d", "out_channels": 2, "kernel_size": 3}])"),
          {12}),
      "model.layers[1] (conv2d): expects [channels, height, width] per sample, got [4]");
  EXPECT_EQ(
      shapeError(
          Json::parse(
              R"([{"type": "conv2d", "out_channels": 2, "kernel_size": 7}])"),
          {1, 5, 5}),
      "model.layers[0] (conv2d): kernel 7 does not fit an input of shape [1, 5, 5] with padding 0");
  EXPECT_EQ(
      shapeError(
          Json::parse(R"([{"type": "linear", "out_features": 6},
                                      {"type": "embedding", "num_embeddings": 9, "embedding_dim": 2}])"),
          {12}),
      "model.layers[1] (embedding): expects integer token ids, got a float input of shape [6]");
  EXPECT_EQ(
      shapeError(
          Json::parse(
              R"([{"type": "embedding", "num_embeddings": 9, "embedding_dim": 6},
                                      {"type": "transformer_block", "heads": 4}])"),
          {5}),
      "model.layers[1] (transformer_block): dim 6 is not divisible by heads 4");
}

// A model or a synthetic set past any host's memory (4 PB of parameters,
// 8 PB of samples) is refused with its figures before anything is
// allocated, not met by LibTorch's failed allocation.
TEST(TrainTest, AModelOrDataPastTheHostsMemoryIsRefusedWithItsSize) {
  auto refusal = [](const std::function<void()>& build) -> std::string {
    try {
      build();
    } catch (const ConfigError& error) {
      return error.what();
    } catch (const std::exception& error) {
      return std::string("not a ConfigError: ") + error.what();
    }
    return "";
  };
  Json huge = smokeConfig();
  huge["model"]["input_shape"] = {1000000};
  huge["model"]["layers"][0]["out_features"] = 1000000000;
  const std::string model =
      refusal([&] { buildModel(parseConfig(huge).model, 0); });
  EXPECT_NE(model.find(" billion parameters need "), std::string::npos)
      << model;
  EXPECT_NE(model.find("available"), std::string::npos) << model;

  Json wide = smokeConfig();
  wide["model"]["input_shape"] = {1000000};
  wide["model"]["layers"] = {{{"type", "linear"}, {"out_features", 2}}};
  wide["data"]["samples"] = 2000000000;
  wide["pipeline"] = {{"devices", {"cpu:0"}}};
  const Config config = parseConfig(wide);
  const std::string data =
      refusal([&] { loadDataset(config, buildModel(config.model, 0)); });
  EXPECT_NE(
      data.find("data.samples: 2400000000 synthetic samples"),
      std::string::npos)
      << data;
}

TEST(TrainTest, LossMustFitTheModelAndData) {
  Json json = smokeConfig();
  json["model"]["layers"].back()["out_features"] = 7;
  Config config = parseConfig(json);
  config.data.dataset = "fashion-mnist";
  config.model.inputShape = {12};
  try {
    checkLossFits(config, buildModel(config.model, 0));
    FAIL();
  } catch (const ConfigError& error) {
    EXPECT_NE(
        std::string(error.what()).find("fashion-mnist has 10 classes"),
        std::string::npos);
  }
}

TEST(TrainTest, FashionMnistReaderReadsTheRealFiles) {
  struct stat info {};
  if (::stat(
          (std::string(kFashionMnistPath) + "/t10k-labels-idx1-ubyte.gz")
              .c_str(),
          &info) != 0) {
    GTEST_SKIP() << "dataset-fashion-mnist is not installed";
  }
  Json json = smokeConfig();
  json["model"] = Json::parse(
      R"({"layers": [{"type": "flatten"}, {"type": "linear", "out_features": 10}]})");
  json["data"] = Json::parse(R"({"dataset": "fashion-mnist"})");
  json["pipeline"]["devices"] = Json::array({"cpu:0"});
  const Config config = parseConfig(json);
  const Dataset data = loadDataset(config, buildModel(config.model, 0));
  EXPECT_EQ(
      data.trainInputs.sizes().vec(), (std::vector<int64_t>{60000, 1, 28, 28}));
  EXPECT_EQ(
      data.evalInputs.sizes().vec(), (std::vector<int64_t>{10000, 1, 28, 28}));
  EXPECT_EQ(data.trainTargets.dtype(), torch::kLong);
  EXPECT_GE(data.trainInputs.min().item<float>(), 0.0f);
  EXPECT_LE(data.trainInputs.max().item<float>(), 1.0f);
  // The dataset's documented facts: 6,000 images per class, mean ~0.286.
  EXPECT_TRUE(torch::equal(
      data.trainTargets.bincount(), torch::full({10}, 6000, torch::kLong)));
  EXPECT_NEAR(data.trainInputs.mean().item<double>(), 0.2860, 1e-3);
  // First training label of the published file is 9 (ankle boot).
  EXPECT_EQ(data.trainTargets[0].item<int64_t>(), 9);

  // Each pixel byte b becomes b / 255 as torch divides (every byte occurs).
  EXPECT_TRUE(torch::equal(
      std::get<0>(at::_unique(data.evalInputs)),
      torch::arange(256, torch::kFloat).div_(255.0)));
  // Normalized by a lookup: the same values as the formula's ops.
  Json normalized = json;
  normalized["data"]["normalize"] = true;
  const Config normalizing = parseConfig(normalized);
  const Dataset centred =
      loadDataset(normalizing, buildModel(normalizing.model, 0));
  EXPECT_TRUE(
      torch::equal(centred.evalInputs, (data.evalInputs - 0.2860) / 0.3530));

  // A rank that feeds no stage's inputs holds a stand-in of their shape,
  // no memory, and the real labels.
  DataNeeds targetsOnly;
  targetsOnly.inputs = false;
  const Dataset last =
      loadDataset(config, buildModel(config.model, 0), targetsOnly);
  EXPECT_EQ(last.trainInputs.sizes(), data.trainInputs.sizes());
  EXPECT_EQ(last.evalInputs.sizes(), data.evalInputs.sizes());
  EXPECT_EQ(last.trainInputs.stride(0), 0);
  EXPECT_LE(last.trainInputs.storage().nbytes(), sizeof(float));
  EXPECT_TRUE(torch::equal(last.trainTargets, data.trainTargets));

  Json missing = json;
  missing["data"]["path"] = "/nonexistent/fashion";
  const Config bad = parseConfig(missing);
  try {
    loadDataset(bad, buildModel(bad.model, 0));
    FAIL();
  } catch (const ConfigError& error) {
    EXPECT_NE(
        std::string(error.what())
            .find("/nonexistent/fashion/train-images-idx3-ubyte.gz not found "
                  "(Debian's package dataset-fashion-mnist"),
        std::string::npos)
        << error.what();
  }
}

TEST(TrainTest, TextDatasetPredictsTheNextByte) {
  const fs::path dir = scratch("text");
  {
    std::ofstream out(dir / "tiny.txt");
    for (int i = 0; i < 50; ++i)
      out << "abcdefghij";
  }
  Json json = smokeConfig();
  json["model"] = Json::parse(
      R"({"layers": [{"type": "embedding", "num_embeddings": 256, "embedding_dim": 8},
                                             {"type": "linear", "out_features": 256}]})");
  json["data"] = {
      {"dataset", "text"},
      {"path", (dir / "tiny.txt").string()},
      {"seq_len", 9}};
  json["pipeline"]["devices"] = Json::array({"cpu:0"});
  const Config config = parseConfig(json);
  const Dataset data = loadDataset(config, buildModel(config.model, 0));
  EXPECT_EQ(data.trainInputs.size(1), 9);
  EXPECT_EQ(data.trainInputs[0][0].item<int64_t>(), 'a');
  EXPECT_EQ(data.trainTargets[0][0].item<int64_t>(), 'b');
  // 500 bytes: the last 50 held out as 5 windows of 10; training windows
  // every 2 bytes (9 / 4) of the first 450.
  EXPECT_EQ(data.evalInputs.size(0), 5);
  EXPECT_EQ(data.trainInputs.size(0), (450 - 10) / 2 + 1);
  EXPECT_EQ(data.trainInputs[1][0].item<int64_t>(), 'c');
  EXPECT_EQ(data.evalInputs[0][0].item<int64_t>(), 'a'); // byte 450
  fs::remove_all(dir);
}

TEST(TrainTest, APipelinedRunEqualsTheSameRunOnOneStage) {
  const auto piped = quietTrain(withOverrides(smokeConfig(), {}));
  const auto single = quietTrain(
      withOverrides(smokeConfig(), {"pipeline.devices=[\"cpu:0\"]"}));
  ASSERT_EQ(piped.losses.size(), 8u);
  ASSERT_EQ(single.losses.size(), 8u);
  // Dropout masks come from each stage's own generator, so compare without it.
  const auto a =
      quietTrain(withOverrides(smokeConfig(), {"model.layers.2.p=0.0"}));
  const auto b = quietTrain(withOverrides(
      smokeConfig(), {"model.layers.2.p=0.0", "pipeline.devices=[\"cpu:0\"]"}));
  for (size_t i = 0; i < a.losses.size(); ++i)
    EXPECT_NEAR(a.losses[i], b.losses[i], 1e-5) << "step " << i;
  EXPECT_LT(a.losses.back(), a.losses.front());
}

TEST(TrainTest, AConvolutionalPipelineEqualsOneStage) {
  Json json = smokeConfig();
  json["model"] = Json::parse(R"({"input_shape": [1, 12, 12], "layers": [
      {"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1}, {"type": "relu"},
      {"type": "maxpool2d", "kernel_size": 2}, {"type": "conv2d", "out_channels": 6, "kernel_size": 3},
      {"type": "batchnorm2d"}, {"type": "flatten"}, {"type": "linear", "out_features": 4}]})");
  json["pipeline"]["devices"] =
      Json::array({"cpu:0", "cpu:1", "cpu:2", "cpu:3"});
  json["pipeline"]["micro_batches"] =
      1; // batch norm normalizes per micro-batch
  const auto piped = quietTrain(parseConfig(json));
  json["pipeline"]["devices"] = Json::array({"cpu:0"});
  const auto single = quietTrain(parseConfig(json));
  ASSERT_EQ(piped.losses.size(), single.losses.size());
  for (size_t i = 0; i < piped.losses.size(); ++i)
    EXPECT_NEAR(piped.losses[i], single.losses[i], 1e-5);
}

// Skips from JSON: a residual ("res") inside a stage or across one, a
// channel concat ("wide") across stages.
Json skipCnnConfig() {
  Json json = smokeConfig();
  json["model"] = Json::parse(R"({"input_shape": [1, 12, 12], "layers": [
      {"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1},
      {"type": "relu"},
      {"type": "maxpool2d", "kernel_size": 2, "stash": "wide"},
      {"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1, "stash": "res"},
      {"type": "tanh"},
      {"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1, "pop": "res"},
      {"type": "identity", "pop": "wide", "merge": "concat"},
      {"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1},
      {"type": "flatten"},
      {"type": "linear", "out_features": 4}]})");
  json["pipeline"]["devices"] =
      Json::array({"cpu:0", "cpu:1", "cpu:2", "cpu:3"});
  return json;
}

// Inferred shapes include the merges, and the pipelined run's losses equal
// one stage's, for several schedules and checkpoint modes.
TEST(TrainTest, ASkipConnectedCnnFromJsonEqualsOneStage) {
  const BuiltModel model = buildModel(parseConfig(skipCnnConfig()).model, 0);
  EXPECT_EQ(model.shapes[7], (std::vector<int64_t>{8, 6, 6}));
  // What else crosses a cut after layers 2 and 3: "wide", then "res" too.
  const auto facts = modelFacts(parseConfig(skipCnnConfig()).model);
  EXPECT_EQ(facts[2].skipElements, 4 * 6 * 6);
  EXPECT_EQ(facts[3].skipElements, 2 * 4 * 6 * 6);
  EXPECT_EQ(
      runSequential(model.layers, torch::randn({2, 1, 12, 12})).sizes().vec(),
      (std::vector<int64_t>{2, 4}));
  const auto single = quietTrain(
      withOverrides(skipCnnConfig(), {"pipeline.devices=[\"cpu:0\"]"}));
  expectEveryScheduleMatches(skipCnnConfig(), single, 1e-5);
}

TEST(TrainTest, ASkipThatCannotMergeIsNamedWithItsShapes) {
  Json json = skipCnnConfig();
  json["model"]["layers"][2].erase("stash");
  json["model"]["layers"][1]["stash"] = "wide"; // [4, 12, 12]
  try {
    buildModel(parseConfig(json).model, 0);
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& error) {
    EXPECT_EQ(
        std::string(error.what()),
        "model.layers[6] (identity): cannot concatenate the skip 'wide' of "
        "shape [4, 12, 12] to its output of shape [4, 6, 6] (all sizes but "
        "the first, the channels, must agree)");
  }
}

TEST(TrainTest, ResumeReproducesTheUninterruptedLosses) {
  for (const char* optimizer : {"adam", "sgd"}) {
    SCOPED_TRACE(optimizer);
    const fs::path dir = scratch(std::string("resume-") + optimizer);
    Json json = smokeConfig();
    json["train"]["optimizer"] = {
        {"type", optimizer}, {"lr", 0.05}, {"decay", "cosine"}};
    if (std::string(optimizer) == "sgd")
      json["train"]["optimizer"]["momentum"] = 0.9;
    json["train"]["steps"] = 10;
    const TrainSummary whole = quietTrain(parseConfig(json));
    const std::string metricsPath = (dir / "metrics.jsonl").string();
    const TrainSummary rest = stopAndResume(json, dir, 4, metricsPath);
    EXPECT_EQ(rest.startStep, 4);
    ASSERT_EQ(rest.losses.size(), 6u);
    for (size_t i = 0; i < rest.losses.size(); ++i) {
      EXPECT_EQ(rest.losses[i], whole.losses[i + 4])
          << "step " << i + 5; // bit-exact
    }
    // The metrics file continues: steps 1..10, 1-based, then the eval record.
    std::ifstream metrics(metricsPath);
    std::string line;
    int64_t expectedStep = 1;
    while (std::getline(metrics, line)) {
      const Json record = Json::parse(line);
      if (record.contains("loss")) {
        EXPECT_EQ(record["step"], expectedStep++);
      }
      EXPECT_TRUE(record.contains("elapsed_s"));
    }
    EXPECT_EQ(expectedStep, 11);
    fs::remove_all(dir);
  }
}

// Steps without a barrier (pipeline.overlap_steps, one optimizer per rank)
// train as steps with one: the same losses bit for bit, under a clip, with
// non-finite steps skipped, evaluations between steps and Adam's state.
TEST(TrainTest, OverlappingStepsTrainAsStepsWithABarrier) {
  for (const char* schedule : {"zb-h2", "1f1b"}) {
    for (const char* clip : {"0", "0.5"}) {
      SCOPED_TRACE(std::string(schedule) + ", clip " + clip);
      const std::vector<std::string> overrides{
          std::string("pipeline.schedule=") + schedule,
          std::string("train.clip_grad_norm=") + clip,
          "train.on_nonfinite=skip",
          "train.eval_every=3"};
      TrainOptions evaluate;
      evaluate.evaluate = true;
      const TrainSummary overlapped =
          quietTrain(withOverrides(smokeConfig(), overrides), evaluate);
      auto withBarrier = overrides;
      withBarrier.push_back("pipeline.overlap_steps=false");
      const TrainSummary barrier =
          quietTrain(withOverrides(smokeConfig(), withBarrier), evaluate);
      ASSERT_EQ(overlapped.losses.size(), 8u);
      EXPECT_EQ(overlapped.losses, barrier.losses);
      EXPECT_EQ(overlapped.evalLoss, barrier.evalLoss);
      EXPECT_EQ(barrier.rerunSteps, 0);
    }
  }
}

TEST(TrainTest, CheckpointHoldsSequentialNamesAndSurvivesAFailedSave) {
  const fs::path dir = scratch("ckpt");
  Json json = smokeConfig();
  json["train"]["steps"] = 0;
  TrainOptions options;
  options.saveDir = (dir / "ckpt").string();
  quietTrain(parseConfig(json), options);
  std::ifstream file(dir / "ckpt" / "model.pt", std::ios::binary);
  std::vector<char> bytes(
      (std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  const auto weights = torch::pickle_load(bytes).toGenericDict();
  std::vector<std::string> names;
  for (const auto& item : weights)
    names.push_back(item.key().toStringRef());
  std::sort(names.begin(), names.end());
  EXPECT_EQ(
      names,
      (std::vector<std::string>{
          "0.bias", "0.weight", "3.bias", "3.weight", "5.bias", "5.weight"}));
  // Initial weights, as the same seed builds them.
  const BuiltModel model =
      buildModel(parseConfig(json).model, parseConfig(json).train.seed);
  EXPECT_TRUE(torch::equal(
      weights.at("3.weight").toTensor(),
      model.layers[3].module.ptr()->named_parameters()["weight"]));
  // A crash mid-save leaves a staging directory behind; checkpoint.json still
  // names the complete state, and resuming works.
  fs::create_directories(dir / "ckpt" / "state-9.tmp");
  std::ofstream(dir / "ckpt" / "state-9.tmp" / "model.pt") << "partial";
  json["train"]["steps"] = 2;
  TrainOptions resume;
  resume.resumeDir = options.saveDir;
  EXPECT_EQ(quietTrain(parseConfig(json), resume).losses.size(), 2u);

  // Debian's python3-torch (scripts/setup installs it): the check runs or
  // fails, never skips.
  const std::string command =
      "/usr/bin/python3 -c \"import torch; d = torch.load('" +
      (dir / "ckpt" / "model.pt").string() +
      "'); assert sorted(d) == ['0.bias', '0.weight', '3.bias', '3.weight', "
      "'5.bias', '5.weight'], d.keys(); assert d['3.weight'].shape == (16, 16)\"";
  EXPECT_EQ(std::system(command.c_str()), 0)
      << "Python's torch.load failed on model.pt (is python3-torch installed? scripts/setup installs it)";
  fs::remove_all(dir);
}

TEST(TrainTest, DeferredBatchNormTracksTheWholeBatch) {
  Json json = smokeConfig();
  json["model"] = Json::parse(R"({"input_shape": [3, 4, 4], "layers": [
      {"type": "batchnorm2d", "momentum": 0.5}, {"type": "flatten"}, {"type": "linear", "out_features": 4}]})");
  const Config config = parseConfig(json);
  BuiltModel model = buildModel(config.model, 0);
  const int m = 4;
  setBatchNormMicroBatches(model, m);
  PipelineOptions options;
  options.devices = {"cpu:0", "cpu:1"};
  options.microBatches = m;
  options.checkpoint =
      CheckpointMode::kAlways; // recompute must not count twice
  Pipeline pipe(model.layers, options);
  torch::Tensor x = torch::randn({10, 3, 4, 4}) * 2 + 1;
  torch::Tensor y = torch::randint(0, 4, {10}, torch::kLong);
  pipe.trainStep(x, y, [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(out, t);
  });
  torch::nn::BatchNorm2d reference(
      torch::nn::BatchNorm2dOptions(3).momentum(0.5));
  reference->forward(x);
  const auto buffers = model.layers[0].module.ptr()->named_buffers();
  EXPECT_TRUE(torch::allclose(
      buffers["running_mean"], reference->running_mean, 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(
      buffers["running_var"], reference->running_var, 1e-5, 1e-6));
  EXPECT_EQ(buffers["num_batches_tracked"].item<int64_t>(), 1);
}

// The registry's transformer block reports its parts (norms and products)
// to a split backward: the weight pass computes their gradients from their
// kept inputs, walking none of the block's graph again. Its gradients equal
// autograd's fused backward's for every parameter, with activations kept or
// recomputed, under ZB-H1 and ZB-V, and so do tpipe's own fused backward's.
TEST(TrainTest, TransformerBlocksSplitTheirBackwardByParts) {
  Json json = smokeConfig();
  json["model"] = Json::parse(R"({"input_shape": [8, 16], "layers": [
      {"type": "transformer_block", "heads": 2}, {"type": "transformer_block", "heads": 2},
      {"type": "transformer_block", "heads": 2}, {"type": "transformer_block", "heads": 2},
      {"type": "flatten"}, {"type": "linear", "out_features": 4}]})");
  const Config config = parseConfig(json);
  torch::manual_seed(4);
  const torch::Tensor x = torch::randn({8, 8, 16});
  const torch::Tensor y = torch::randint(0, 4, {8}, torch::kLong);
  auto loss = [](const torch::Tensor& out, const torch::Tensor& t) {
    return torch::nn::functional::cross_entropy(out, t);
  };
  auto gradientsUnder =
      [&](const char* schedule, CheckpointMode mode, bool direct = true) {
        BuiltModel model = buildModel(config.model, 7);
        PipelineOptions options;
        options.directWeightGradients = direct;
        options.devices = {"cpu:0", "cpu:1"};
        options.microBatches = 4;
        options.schedule = schedule;
        options.virtualStages = std::string(schedule) == "zb-v" ? 2 : 1;
        options.checkpoint = mode;
        Pipeline pipe(model.layers, options);
        pipe.trainStep(x, y, loss);
        std::vector<torch::Tensor> grads;
        for (const auto& parameter : pipe.parameters()) {
          EXPECT_TRUE(parameter.grad().defined()) << schedule;
          grads.push_back(parameter.grad().clone());
        }
        return grads;
      };
  const auto fused =
      gradientsUnder("1f1b", CheckpointMode::kNever, /*direct=*/false);
  for (const char* schedule : {"1f1b", "zb-h1", "zb-v"}) {
    for (auto mode : {CheckpointMode::kNever, CheckpointMode::kAlways}) {
      SCOPED_TRACE(std::string(schedule) + " " + checkpointModeName(mode));
      const auto split = gradientsUnder(schedule, mode);
      ASSERT_EQ(split.size(), fused.size());
      for (size_t i = 0; i < fused.size(); ++i) {
        EXPECT_TRUE(torch::allclose(split[i], fused[i], 1e-4, 1e-6))
            << "parameter " << i << " differs by "
            << (split[i] - fused[i]).abs().max().item<float>();
      }
    }
  }
}

TEST(TrainTest, CharTransformerLearnsOnTinyText) {
  const fs::path dir = scratch("char");
  {
    std::ofstream out(dir / "text.txt");
    for (int i = 0; i < 80; ++i)
      out << "the quick brown fox jumps over the lazy dog. ";
  }
  Json json = Json::parse(R"({
    "model": {"layers": [
      {"type": "embedding", "num_embeddings": 256, "embedding_dim": 16},
      {"type": "transformer_block", "heads": 2}, {"type": "transformer_block", "heads": 2},
      {"type": "layernorm"}, {"type": "linear", "out_features": 256}]},
    "data": {"dataset": "text", "seq_len": 16},
    "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 2, "schedule": "zb-h1", "checkpoint": "always"},
    "train": {"batch_size": 16, "steps": 60, "seed": 1, "optimizer": {"type": "adamw", "lr": 0.01}}
  })");
  json["data"]["path"] = (dir / "text.txt").string();
  const TrainSummary summary = quietTrain(parseConfig(json));
  // A repeated sentence is nearly deterministic after a few characters.
  EXPECT_LT(summary.evalLoss, 1.0);
  EXPECT_GT(summary.evalAccuracy, 0.6);
  fs::remove_all(dir);
}

// A small GPT with its head tied to the token embedding (as gpt_tied.json),
// no dropout so partitions draw nothing.
Json tiedGptConfig() {
  return Json::parse(R"({
    "model": {"input_shape": [16], "layers": [
      {"type": "embedding", "num_embeddings": 256, "embedding_dim": 32},
      {"type": "position_embedding"},
      {"type": "transformer_block", "heads": 2, "dropout": 0.0},
      {"type": "transformer_block", "heads": 2, "dropout": 0.0},
      {"type": "layernorm"},
      {"type": "linear", "out_features": 256, "bias": false, "tied_to": 0}]},
    "data": {"dataset": "text", "path": "/usr/share/common-licenses/GPL-3", "seq_len": 16},
    "pipeline": {"devices": ["cpu:0", "cpu:1", "cpu:2"], "micro_batches": 3, "schedule": "1f1b"},
    "train": {"batch_size": 12, "steps": 6, "seed": 2, "log_every": 100,
              "optimizer": {"type": "adamw", "lr": 0.01}}
  })");
}

// The tied GPT's losses equal the one-stage (sequential) model's, step after
// step, for several schedules and checkpoint modes.
TEST(TrainTest, TiedGptMatchesTheSequentialModel) {
  const auto sequential = quietTrain(withOverrides(
      tiedGptConfig(),
      {"pipeline.devices=[\"cpu:0\"]", "pipeline.micro_batches=3"}));
  expectEveryScheduleMatches(tiedGptConfig(), sequential, 1e-4);
}

// The tied GPT overlaps its steps too (in one process the copies' gradients
// are summed where the parts holding them end): its losses equal those of
// steps with a barrier, bit for bit, with AdamW, a clip that binds on some
// steps (so speculations run again) and skipping non-finite steps.
// The clip is chosen so that a speculation is wrong whatever order the
// ranks end in: at step 0 the stages' own norms are about 1.8, 7.5 and 5.5
// (9.5 in all), so the clip binds while two ranks sit below it, and at most
// one of them is the last to end (the one that decides and never
// speculates). A clip of 3.0 left only rank 0 below it: whether a step ran
// again depended on rank 0 not ending last, and in 4-7 of 30 runs it did.
TEST(TrainTest, TiedGptOverlapsItsStepsAsStepsWithABarrier) {
  for (const char* schedule : {"zb-h2", "1f1b"}) {
    SCOPED_TRACE(schedule);
    const std::vector<std::string> overrides{
        std::string("pipeline.schedule=") + schedule,
        "train.clip_grad_norm=6.0",
        "train.on_nonfinite=skip",
        "train.steps=8"};
    const TrainSummary overlapped =
        quietTrain(withOverrides(tiedGptConfig(), overrides));
    auto withBarrier = overrides;
    withBarrier.push_back("pipeline.overlap_steps=false");
    const TrainSummary barrier =
        quietTrain(withOverrides(tiedGptConfig(), withBarrier));
    ASSERT_EQ(overlapped.losses.size(), 8u);
    EXPECT_EQ(overlapped.losses, barrier.losses);
    EXPECT_GT(overlapped.rerunSteps, 0) << "the steps did not overlap";
    EXPECT_EQ(barrier.rerunSteps, 0);
  }
}

// DeepSeek's DualPipe through the trainer: its losses follow one stage's
// (without dropout: each chain's stages draw their own masks), the tied
// GPT's too (its blocks copied), and a run stopped and resumed from its
// checkpoint repeats the uninterrupted losses bit for bit, dropout on (the
// copies refreshed from the checkpoint, their optimizer state and
// generators restored).
TEST(TrainTest, DualPipeTrainsAsOneStageAndResumesExactly) {
  Json json = smokeConfig();
  json["model"]["layers"][2]["p"] = 0.0;
  json["pipeline"]["devices"] = {"cpu:0", "cpu:1"};
  json["pipeline"]["micro_batches"] = 4;
  const TrainSummary one =
      quietTrain(withOverrides(json, {"pipeline.devices=[\"cpu:0\"]"}));
  json["pipeline"]["schedule"] = "dualpipe";
  const TrainSummary dual = quietTrain(parseConfig(json));
  ASSERT_EQ(dual.losses.size(), one.losses.size());
  for (size_t i = 0; i < dual.losses.size(); ++i)
    EXPECT_NEAR(dual.losses[i], one.losses[i], 1e-5) << "step " << i + 1;

  const TrainSummary sequential = quietTrain(withOverrides(
      tiedGptConfig(),
      {"pipeline.devices=[\"cpu:0\"]", "pipeline.micro_batches=4"}));
  const TrainSummary tied = quietTrain(withOverrides(
      tiedGptConfig(),
      {"pipeline.devices=[\"cpu:0\", \"cpu:1\"]",
       "pipeline.micro_batches=4",
       "pipeline.schedule=dualpipe"}));
  ASSERT_EQ(tied.losses.size(), sequential.losses.size());
  for (size_t i = 0; i < tied.losses.size(); ++i)
    EXPECT_NEAR(tied.losses[i], sequential.losses[i], 1e-4) << "step " << i;

  json["model"]["layers"][2]["p"] = 0.2;
  json["train"]["steps"] = 10;
  const TrainSummary whole = quietTrain(parseConfig(json));
  const fs::path dir = scratch("dualpipe-resume");
  const TrainSummary rest = stopAndResume(json, dir, 4);
  ASSERT_EQ(rest.losses.size(), 6u);
  for (size_t i = 0; i < rest.losses.size(); ++i)
    EXPECT_EQ(rest.losses[i], whole.losses[i + 4]) << "step " << i + 5;
  fs::remove_all(dir);
}

// The checkpoint holds the tied weight once, under both names, and PyTorch
// loads it into the equivalent tied nn.Module.
TEST(TrainTest, TiedCheckpointLoadsIntoATiedTorchModule) {
  const fs::path dir = scratch("tied");
  Json json = Json::parse(R"({
    "model": {"input_shape": [8], "layers": [
      {"type": "embedding", "num_embeddings": 256, "embedding_dim": 16},
      {"type": "layernorm"},
      {"type": "linear", "out_features": 256, "bias": false, "tied_to": 0}]},
    "data": {"dataset": "text", "path": "/usr/share/common-licenses/GPL-3", "seq_len": 8},
    "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 2, "balance": [2, 1]},
    "train": {"batch_size": 8, "steps": 4, "seed": 1, "log_every": 100,
              "optimizer": {"type": "adam", "lr": 0.01}}
  })");
  TrainOptions options;
  options.saveDir = (dir / "ckpt").string();
  quietTrain(parseConfig(json), options);
  const std::string script =
      "import torch, torch.nn as nn\n"
      "d = torch.load('" +
      (dir / "ckpt" / "model.pt").string() +
      "')\n"
      "assert sorted(d) == ['0.weight', '1.bias', '1.weight', '2.weight'], list(d)\n"
      "assert d['0.weight'].data_ptr() == d['2.weight'].data_ptr(), 'stored twice'\n"
      "m = nn.Sequential(nn.Embedding(256, 16), nn.LayerNorm(16), nn.Linear(16, 256, bias=False))\n"
      "m[2].weight = m[0].weight\n"
      "m.load_state_dict(d)\n"
      "assert m[2].weight is m[0].weight and torch.equal(m[0].weight, d['0.weight'])\n"
      "assert not torch.equal(d['0.weight'], nn.Embedding(256, 16).weight)\n";
  std::ofstream(dir / "check.py") << script;
  EXPECT_EQ(
      std::system(("/usr/bin/python3 " + (dir / "check.py").string()).c_str()),
      0)
      << script;
  fs::remove_all(dir);
}

// A flat uint16 token file (as nanoGPT's prepare.py writes train.bin) feeds
// the tied GPT; bad files are clear errors.
TEST(TrainTest, ATokenFileTrainsTheTiedGpt) {
  const fs::path dir = scratch("tokens");
  fs::create_directories(dir);
  std::vector<uint16_t> ids;
  for (int i = 0; i < 6000; ++i)
    ids.push_back(
        static_cast<uint16_t>((i * 7 + i / 13) % 200)); // a learnable pattern
  auto write = [&](const fs::path& path, size_t bytes) {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(ids.data()), bytes);
  };
  write(dir / "train.bin", ids.size() * 2);
  Json json = tiedGptConfig();
  json["data"] = {
      {"dataset", "tokens"},
      {"path", (dir / "train.bin").string()},
      {"seq_len", 16}};
  json["train"]["steps"] = 30;
  const auto summary = quietTrain(parseConfig(json));
  EXPECT_LT(summary.losses.back(), summary.losses.front() - 1.0);

  auto trainingError = [&](const fs::path& file) -> std::string {
    json["data"]["path"] = file.string();
    try {
      quietTrain(parseConfig(json));
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "no error";
  };
  write(dir / "odd.bin", 2 * 100 + 1);
  const std::string odd = trainingError(dir / "odd.bin");
  EXPECT_NE(odd.find("not a whole number of uint16 tokens"), std::string::npos)
      << odd;
  ids.assign(4000, 300); // beyond 256 embedding rows
  write(dir / "big.bin", ids.size() * 2);
  const std::string big = trainingError(dir / "big.bin");
  EXPECT_NE(
      big.find("holds token id 300, but the model has 256 embedding rows"),
      std::string::npos)
      << big;
  fs::remove_all(dir);
}

// "model": {"torchscript": ...}: a model scripted in Python at test time
// trains from JSON, saves under the Python module's names (load_state_dict
// takes them back, strict), and resumes.
TEST(TrainTest, ATorchScriptModelTrainsFromJsonAndRoundTrips) {
  const fs::path dir = scratch("torchscript");
  fs::create_directories(dir);
  const std::string model = (dir / "m.pt").string();
  const std::string python =
      "import torch, torch.nn as nn\n"
      "def net():\n"
      "    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.LayerNorm(16), nn.Linear(16, 4))\n"
      "import sys\n"
      "if sys.argv[1] == 'make':\n"
      "    torch.manual_seed(5); torch.jit.script(net()).save('" +
      model +
      "')\n"
      "else:\n"
      "    m = net(); first = torch.jit.load('" +
      model +
      "')\n"
      "    m.load_state_dict(torch.load('" +
      (dir / "ckpt" / "model.pt").string() +
      "'))\n"
      "    assert not torch.equal(m[0].weight, first.state_dict()['0.weight']), 'not trained'\n";
  std::ofstream(dir / "m.py") << python;
  auto run = [&](const char* what) {
    return std::system(
        ("/usr/bin/python3 " + (dir / "m.py").string() + " " + what).c_str());
  };
  ASSERT_EQ(run("make"), 0)
      << "python3-torch is needed (scripts/setup installs it)";
  Json json = smokeConfig();
  json["model"] = {{"input_shape", {12}}, {"torchscript", model}};
  TrainOptions options;
  options.saveDir = (dir / "ckpt").string();
  options.stopAfter = 4;
  const auto first = quietTrain(parseConfig(json), options);
  EXPECT_EQ(first.losses.size(), 4u);
  EXPECT_EQ(run("check"), 0) << python;
  TrainOptions resume;
  resume.resumeDir = options.saveDir;
  const auto rest = quietTrain(parseConfig(json), resume);
  EXPECT_EQ(rest.losses.size(), 4u); // steps 5 to 8
  // dualpipe copies the scripted layers for its second chain.
  const std::vector<std::string> twoDevices{
      "pipeline.devices=[\"cpu:0\", \"cpu:1\"]", "pipeline.micro_batches=4"};
  auto dualPipe = twoDevices;
  dualPipe.push_back("pipeline.schedule=dualpipe");
  const auto oneChain = quietTrain(withOverrides(json, twoDevices));
  const auto twoChains = quietTrain(withOverrides(json, dualPipe));
  ASSERT_EQ(twoChains.losses.size(), oneChain.losses.size());
  for (size_t i = 0; i < oneChain.losses.size(); ++i)
    EXPECT_NEAR(twoChains.losses[i], oneChain.losses[i], 1e-5) << "step " << i;
  // Bad input: a balance for another layer count, a file that is no model.
  json["pipeline"]["balance"] = {1, 1, 1};
  EXPECT_THROW(quietTrain(parseConfig(json)), ConfigError);
  json["pipeline"].erase("balance");
  json["model"]["torchscript"] = (dir / "m.py").string();
  EXPECT_THROW(quietTrain(parseConfig(json)), ConfigError);
  fs::remove_all(dir);
}

// train.precision "bf16": every stage's forward runs under bf16 autocast
// (the matmuls round to bf16), and the loss after 40 steps stays within the
// documented 5% of the fp32 run's; across processes too.
TEST(TrainTest, Bf16AutocastStaysNearFp32) {
  Json json = smokeConfig();
  json["model"]["layers"][2] = {{"type", "relu"}}; // no dropout draws
  json["train"]["steps"] = 40;
  const auto full = quietTrain(parseConfig(json));
  json["train"]["precision"] = "bf16";
  const auto half = quietTrain(parseConfig(json));
  ASSERT_EQ(full.losses.size(), half.losses.size());
  EXPECT_NE(full.losses[0], half.losses[0]) << "bf16 changed nothing";
  EXPECT_NEAR(
      half.losses.back(), full.losses.back(), 0.05 * full.losses.back());
  EXPECT_LT(half.losses.back(), half.losses.front());
}

} // namespace
} // namespace tpipe
