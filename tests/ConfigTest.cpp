#include <gtest/gtest.h>

#include "tpipe/config.h"

namespace tpipe {
namespace {

using Json = nlohmann::json;

Json baseConfig() {
  return Json::parse(R"({
    "model": {"input_shape": [1, 28, 28], "layers": [
      {"type": "conv2d", "out_channels": 32, "kernel_size": 3, "padding": 1}, {"type": "relu"},
      {"type": "maxpool2d", "kernel_size": 2}, {"type": "flatten"},
      {"type": "linear", "out_features": 10}]},
    "data": {"dataset": "fashion-mnist", "path": "/usr/share/datasets/fashion-mnist",
             "shuffle": true, "normalize": false},
    "pipeline": {"devices": ["cpu:0", "cpu:1"], "stages": 2, "micro_batches": 4,
                 "schedule": "gpipe", "checkpoint": "except_last"},
    "train": {"batch_size": 64, "steps": 100, "loss": "cross_entropy", "seed": 0,
              "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.0}, "eval_every": 0}
  })");
}

TEST(ConfigTest, TheIssueExampleParsesWithDefaults) {
  const Config config = parseConfig(baseConfig());
  EXPECT_EQ(config.model.layers.size(), 5u);
  EXPECT_EQ(config.model.layers[0].params["kernel_size"], Json::array({3, 3}));
  EXPECT_EQ(config.model.layers[0].params["stride"], Json::array({1, 1}));
  EXPECT_EQ(config.model.layers[2].params["stride"], Json::array({2, 2}));
  EXPECT_EQ(config.pipeline.devices[1].name, "cpu:1");
  EXPECT_EQ(config.pipeline.microBatches, 4);
  EXPECT_EQ(config.train.optimizer.type, "sgd");
  EXPECT_DOUBLE_EQ(config.train.optimizer.lr, 0.1);
}

TEST(ConfigTest, ShippedConfigsParse) {
  for (const char* name :
       {"fashion_mnist_cnn",
        "char_transformer",
        "mlp_synthetic",
        "beyond_one_device",
        "gpt_tied",
        "data_parallel_mlp",
        "torchscript_mlp",
        "skip_cnn",
        "zero_bubble_mlp",
        "auto_memory_mlp",
        "dualpipe_mlp"}) {
    const std::string path =
        std::string(TPIPE_SOURCE_DIR) + "/configs/" + name + ".json";
    SCOPED_TRACE(path);
    EXPECT_NO_THROW(loadConfig(path));
  }
}

struct BadCase {
  std::vector<std::string> overrides; // applied to the base config
  std::string expected;               // substring of the error
};

TEST(ConfigTest, EveryBadConfigNamesItsPath) {
  const std::vector<BadCase> cases = {
      {{"pipeline.micro_batches=-3"},
       "pipeline.micro_batches: expected a positive integer, got -3"},
      {{"pipeline.micro_batches=\"four\""},
       "pipeline.micro_batches: expected a positive integer, got \"four\""},
      {{"pipeline.mirco_batches=4"},
       "pipeline.mirco_batches: unknown key 'mirco_batches' (did you mean 'micro_batches'?)"},
      {{"trian={}"}, "trian: unknown key 'trian' (did you mean 'train'?)"},
      {{"pipeline.schedule=zigzag"},
       "pipeline.schedule: unknown value 'zigzag'; expected one of gpipe, 1f1b, interleaved-1f1b, zb-h1, zb-h2, zb-v, zb-v-half, zb-v-min, auto, dualpipev, dualpipe, a schedule file (*.json, *.csv)"},
      {{"pipeline.checkpoint=sometimes"},
       "pipeline.checkpoint: unknown value 'sometimes'"},
      {{"pipeline.devices=[]"}, "pipeline.devices: expected a non-empty list"},
      {{"pipeline.devices=[\"tpu:0\"]"},
       "pipeline.devices[0]: unknown device 'tpu:0'"},
      {{"pipeline.devices=[\"cpu:0\",\"cpu:0\"]"},
       "pipeline.devices[1]: device 'cpu:0' is listed twice"},
      {{"pipeline.devices.1={\"name\":\"cpu:1\",\"memory\":\"lots\"}"},
       "pipeline.devices[1].memory: expected a size such as \"512MiB\""},
      {{"pipeline.stages=9", "pipeline.devices=[\"cpu:0\"]"},
       "pipeline.stages: more stages (9) than layers (5)"},
      {{"pipeline.stages=3"},
       "pipeline.stages: 3 stages with 1 virtual stage(s) per device need 3 devices, got 2"},
      {{"pipeline.balance=[2,2]"},
       "pipeline.balance: sums to 4 layers, but the model has 5"},
      {{"pipeline.balance=[2,2,1]"},
       "pipeline.balance: has 3 entries for 2 stages"},
      {{"pipeline.balance=[2,0]"},
       "pipeline.balance[1]: expected a positive integer, got 0"},
      {{"pipeline.balance=[2,3]", "pipeline.partition=time"},
       "pipeline.balance: given together with partition 'time'"},
      {{"pipeline.partition=balance"},
       "pipeline.balance: missing (required by partition 'balance')"},
      {{"model.layers.0.type=conv3d"},
       "model.layers[0].type: unknown layer type 'conv3d' (did you mean 'conv2d'?)"},
      {{"model.layers.0.kernel_size=[3]"},
       "model.layers[0].kernel_size: expected a positive integer or a pair of them, got [3]"},
      {{"model.layers.0.out_chanels=3"},
       "model.layers[0].out_chanels: unknown key 'out_chanels' (did you mean 'out_channels'?)"},
      {{"model.layers.4={\"type\":\"linear\"}"},
       "model.layers[4].out_features: missing (required for linear)"},
      {{"model.layers.1={\"type\":\"dropout\",\"p\":1.5}"},
       "model.layers[1].p: expected a number in [0, 1), got 1.5"},
      {{"model.layers=[]"},
       "model.layers: expected a non-empty list of layers"},
      {{"model.input_shape=[1,32,32]"},
       "model.input_shape: fashion-mnist images are [1, 28, 28]"},
      {{"data.dataset=imagenet"}, "data.dataset: unknown value 'imagenet'"},
      {{"data.shuffle=1"}, "data.shuffle: expected true or false, got 1"},
      {{"train.batch_size=0"},
       "train.batch_size: expected a positive integer, got 0"},
      {{"train.batch_size=2"},
       "train.batch_size: batch size 2 per replica is smaller than pipeline.micro_batches (4)"},
      {{"pipeline.data_parallel=3"},
       "train.batch_size: batch size 64 does not split evenly over 3 data-parallel replicas"},
      {{"pipeline.timeout_s=0"},
       "pipeline.timeout_s: expected a number of seconds in [0.1, 86400], got 0"},
      {{"train.loss=hinge"},
       "train.loss: unknown value 'hinge'; expected one of cross_entropy, mse"},
      {{"train.optimizer.type=lamb"},
       "train.optimizer.type: unknown value 'lamb'"},
      {{"train.optimizer.lr=-1"},
       "train.optimizer.lr: expected a non-negative number, got -1"},
      {{"train.optimizer.momentum=2"},
       "train.optimizer.momentum: expected a number in [0, 1], got 2"},
      {{"train.optimizer.betas=[0.9]"},
       "train.optimizer.betas: unknown key 'betas'"},
      {{"train.optimizer.decay=linear"},
       "train.optimizer.decay: unknown value 'linear'; expected one of none, cosine"},
      {{"train.steps=1.5"},
       "train.steps: expected a non-negative integer, got 1.5"},
      {{"model.layers.1.pop=s"},
       "model.layers[1].pop: 's' is popped before any layer stashes it"},
      {{"model.layers.0.stash=s"},
       "model.layers[0].stash: 's' is stashed but no later layer pops it"},
      {{"model.layers.0.stash=s", "model.layers.1.stash=[\"t\",\"s\"]"},
       "model.layers[1].stash: 's' is stashed twice"},
      {{"model.layers.0.stash=s",
        "model.layers.1.pop=s",
        "model.layers.2.pop=s"},
       "model.layers[2].pop: 's' is popped twice"},
      {{"model.layers.1.merge=concat"},
       "model.layers[1].merge: needs a pop (the skip it merges)"},
      {{"model.layers.0.stash=s",
        "model.layers.1.pop=s",
        "model.layers.1.merge=mul"},
       "model.layers[1].merge: unknown value 'mul'; expected one of add, concat"},
      {{"model.layers.0.stash=5"},
       "model.layers[0].stash: expected a name or a list of names, got 5"},
      {{"model.layers.0.stash=[]"},
       "model.layers[0].stash: expected a name or a list of names, got []"},
  };
  for (const BadCase& c : cases) {
    Json json = baseConfig();
    for (const auto& assignment : c.overrides)
      applyOverride(json, assignment);
    try {
      parseConfig(json);
      ADD_FAILURE() << "no error for " << c.overrides[0];
    } catch (const ConfigError& error) {
      EXPECT_NE(std::string(error.what()).find(c.expected), std::string::npos)
          << "for " << c.overrides[0] << "\n  got: " << error.what()
          << "\n  want: " << c.expected;
    }
  }
}

TEST(ConfigTest, MissingSectionsAndDefaults) {
  Json json = baseConfig();
  json.erase("train");
  EXPECT_THROW(parseConfig(json), ConfigError);
  Json text = baseConfig();
  applyOverride(text, "data={\"dataset\":\"text\",\"seq_len\":16}");
  text["model"].erase("input_shape");
  text["model"]["layers"] = Json::parse(
      R"([{"type":"embedding","num_embeddings":256,"embedding_dim":8},
                                           {"type":"linear","out_features":256}])");
  const Config config = parseConfig(text);
  EXPECT_EQ(config.data.path, kDefaultTextPath);
  EXPECT_EQ(config.model.inputShape, (std::vector<int64_t>{16}));
}

TEST(ConfigTest, OverridesSetNestedValuesAndListElements) {
  Json json = baseConfig();
  applyOverride(json, "train.steps=20");
  applyOverride(json, "pipeline.devices.0=cpu:7");
  applyOverride(json, "pipeline.schedule=1f1b");
  applyOverride(json, "train.optimizer.warmup_steps=5");
  EXPECT_EQ(json["train"]["steps"], 20);
  EXPECT_EQ(json["pipeline"]["devices"][0], "cpu:7");
  EXPECT_EQ(json["pipeline"]["schedule"], "1f1b");
  EXPECT_EQ(json["train"]["optimizer"]["warmup_steps"], 5);
  EXPECT_THROW(applyOverride(json, "pipeline.devices.5=cpu:1"), ConfigError);
  EXPECT_THROW(applyOverride(json, "train.steps.x=1"), ConfigError);
  EXPECT_THROW(applyOverride(json, "novalue"), ConfigError);
  // The spelling errors use for list elements is taken back.
  applyOverride(json, "pipeline.devices[0]=cpu:3");
  EXPECT_EQ(json["pipeline"]["devices"][0], "cpu:3");
  EXPECT_THROW(applyOverride(json, "pipeline.devices[0=cpu:3"), ConfigError);
  // An index past any list is a ConfigError, not std::stoul's out_of_range.
  EXPECT_THROW(
      applyOverride(json, "pipeline.devices.99999999999999999999=cpu:1"),
      ConfigError);
}

TEST(ConfigTest, ByteSizes) {
  EXPECT_EQ(parseBytes("512MiB", "x"), 512LL << 20);
  EXPECT_EQ(parseBytes("1.5GiB", "x"), 3LL << 29);
  EXPECT_EQ(parseBytes("2 GB", "x"), 2000000000LL);
  EXPECT_EQ(parseBytes(4096, "x"), 4096);
  EXPECT_THROW(parseBytes("12 parsecs", "x"), ConfigError);
  EXPECT_THROW(parseBytes(-5, "x"), ConfigError);
}

} // namespace
} // namespace tpipe
