#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <sys/un.h>
#include <unistd.h>

#include <torch/torch.h>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>
#include <nlohmann/json.hpp>

#include "runtime/network.h"
#include "runtime/placement.h"
#include "runtime/socket_channels.h"
#include "runtime/store.h"
#include "support/skip_net.h"
#include "tpipe/distributed.h"
#include "tpipe/config.h"
#include "tpipe/model.h"
#include "tpipe/pipeline.h"
#include "tpipe/torchscript.h"

namespace tpipe {
namespace {

torch::nn::Sequential makeNet(
    torch::Dtype dtype,
    uint64_t seed,
    double dropout = 0.0) {
  torch::manual_seed(seed);
  torch::nn::Sequential net(
      torch::nn::Linear(6, 12),
      torch::nn::Tanh(),
      torch::nn::Linear(12, 12),
      torch::nn::GELU(),
      torch::nn::Dropout(dropout),
      torch::nn::Linear(12, 10),
      torch::nn::Sigmoid(),
      torch::nn::Linear(10, 10),
      torch::nn::ReLU(),
      torch::nn::Linear(10, 3));
  net->to(dtype);
  return net;
}

torch::Tensor crossEntropy(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

double relativeError(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(b.norm().item<double>(), 1e-30);
  return (a - b).norm().item<double>() / scale;
}

std::vector<std::string> cpuDevices(int count) {
  std::vector<std::string> devices;
  for (int i = 0; i < count; ++i)
    devices.push_back("cpu:" + std::to_string(i));
  return devices;
}

struct Case {
  std::string schedule;
  int ranks;
  int virtualStages;
  int microBatches;
  CheckpointMode mode;
};

std::string describe(const Case& c, torch::Dtype dtype) {
  return c.schedule + " ranks=" + std::to_string(c.ranks) +
      " v=" + std::to_string(c.virtualStages) +
      " m=" + std::to_string(c.microBatches) + " " +
      checkpointModeName(c.mode) + (dtype == torch::kDouble ? " f64" : " f32");
}

// Loss and every gradient of a pipelined step equal the unpartitioned
// model's on the whole batch.
void expectTransparent(const Case& c, torch::Dtype dtype) {
  SCOPED_TRACE(describe(c, dtype));
  const double tolerance = dtype == torch::kDouble ? 1e-12 : 1e-5;
  torch::nn::Sequential reference = makeNet(dtype, 1);
  torch::nn::Sequential piped = makeNet(dtype, 1);
  torch::manual_seed(2);
  const int64_t batch = 13; // not divisible by 2, 4 or 7
  torch::Tensor x = torch::randn({batch, 6}, dtype);
  torch::Tensor y = torch::randint(0, 3, {batch}, torch::kLong);

  PipelineOptions options;
  options.devices = cpuDevices(c.ranks);
  options.virtualStages = c.virtualStages;
  options.microBatches = c.microBatches;
  options.schedule = c.schedule;
  options.checkpoint = c.mode;
  Pipeline pipe(layersOf(piped), options);
  ASSERT_EQ(pipe.schedule().stages(), c.ranks * c.virtualStages);

  torch::Tensor expected = crossEntropy(reference->forward(x), y);
  expected.backward();
  torch::Tensor loss = pipe.trainStep(x, y, crossEntropy);
  EXPECT_LE(relativeError(loss, expected.detach()), tolerance);

  auto want = reference->parameters();
  auto got = pipe.parameters();
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(got[i].grad().defined()) << "parameter " << i;
    EXPECT_LE(relativeError(got[i].grad(), want[i].grad()), tolerance)
        << "parameter " << i;
  }
}

std::vector<Case> transparencyCases() {
  std::vector<Case> cases;
  for (int ranks = 1; ranks <= 4; ++ranks) {
    for (int m : {1, 2, 4, 7}) {
      for (auto mode :
           {CheckpointMode::kAlways,
            CheckpointMode::kExceptLast,
            CheckpointMode::kNever}) {
        for (const char* schedule : {"gpipe", "1f1b", "zb-h1"}) {
          cases.push_back({schedule, ranks, 1, m, mode});
        }
        if (m % ranks == 0)
          cases.push_back({"interleaved-1f1b", ranks, 2, m, mode});
      }
    }
  }
  return cases;
}

TEST(PipelineTest, TransparentInDouble) {
  for (const Case& c : transparencyCases())
    expectTransparent(c, torch::kDouble);
}

TEST(PipelineTest, TransparentInFloat) {
  for (const Case& c : transparencyCases())
    expectTransparent(c, torch::kFloat);
}

// The schedules added since the transparency table was written, through the
// same check: ZB-H2 and ZB-V (two stages per rank in a V) over every stage
// count, micro-batch count and mode.
TEST(PipelineTest, ZeroBubbleH2AndVAreTransparent) {
  for (int ranks = 1; ranks <= 4; ++ranks) {
    for (int m : {1, 2, 4, 7}) {
      for (auto mode :
           {CheckpointMode::kAlways,
            CheckpointMode::kExceptLast,
            CheckpointMode::kNever}) {
        expectTransparent({"zb-h2", ranks, 1, m, mode}, torch::kDouble);
        expectTransparent({"zb-v", ranks, 2, m, mode}, torch::kDouble);
        expectTransparent({"zb-v-half", ranks, 2, m, mode}, torch::kDouble);
        expectTransparent({"zb-v-min", ranks, 2, m, mode}, torch::kDouble);
      }
    }
  }
}

// torch.distributed.pipelining's own schedule files (compute-only with an
// idle slot, lowered with its transfers, and DualPipeV with overlapped
// pairs) and tpipe's DualPipeV train exactly as one stage does.
TEST(PipelineTest, PyTorchsScheduleFilesAndDualPipeVAreTransparent) {
  const std::string dir =
      std::string(TPIPE_SOURCE_DIR) + "/../shared/conformance/pytorch/";
  for (auto mode :
       {CheckpointMode::kAlways,
        CheckpointMode::kExceptLast,
        CheckpointMode::kNever}) {
    if (std::filesystem::exists(dir)) {
      expectTransparent(
          {dir + "zb1p_2rank_2stagep_compute.csv", 2, 2, 8, mode},
          torch::kDouble);
      expectTransparent(
          {dir + "zb1p_2rank_2stagep_comms.csv", 2, 2, 8, mode},
          torch::kDouble);
      expectTransparent(
          {dir + "dualpipev_4rank_10mb.csv", 4, 2, 10, mode}, torch::kDouble);
    }
    for (int ranks = 1; ranks <= 4; ++ranks) {
      for (int m : {2 * ranks, 2 * ranks + 3})
        expectTransparent({"dualpipev", ranks, 2, m, mode}, torch::kDouble);
    }
  }
}

// DeepSeek's DualPipe: micro-batches enter from both ends, through two
// chains of stages, the second holding copies of the layers. The loss and
// the originals' gradients equal the unpartitioned model's; each copy's
// gradient equals its original's, so an optimizer over parameters() keeps
// them equal, and inference runs the first chain.
TEST(PipelineTest, DualPipeIsTransparent) {
  for (int ranks : {2, 4}) {
    for (int m : {2 * ranks, 2 * ranks + 2}) {
      for (auto mode :
           {CheckpointMode::kAlways,
            CheckpointMode::kExceptLast,
            CheckpointMode::kNever}) {
        SCOPED_TRACE(
            "ranks=" + std::to_string(ranks) + " m=" + std::to_string(m) + " " +
            checkpointModeName(mode));
        torch::nn::Sequential reference = makeNet(torch::kDouble, 1);
        torch::nn::Sequential piped = makeNet(torch::kDouble, 1);
        torch::manual_seed(2);
        const torch::Tensor x = torch::randn({13, 6}, torch::kDouble);
        const torch::Tensor y = torch::randint(0, 3, {13}, torch::kLong);
        PipelineOptions options;
        options.devices = cpuDevices(ranks);
        options.microBatches = m;
        options.schedule = "dualpipe";
        options.checkpoint = mode;
        Pipeline pipe(layersOf(piped), options);
        ASSERT_EQ(pipe.schedule().stages(), 2 * ranks);
        ASSERT_EQ(pipe.schedule().chains, 2);
        const torch::Tensor expected = crossEntropy(reference->forward(x), y);
        expected.backward();
        const torch::Tensor loss = pipe.trainStep(x, y, crossEntropy);
        EXPECT_LE(relativeError(loss, expected.detach()), 1e-12);
        const auto want = reference->parameters();
        const auto all = pipe.parameters();
        ASSERT_EQ(all.size(), 2 * want.size()); // the originals, the copies
        for (size_t i = 0; i < want.size(); ++i) {
          ASSERT_TRUE(all[i].grad().defined()) << "parameter " << i;
          EXPECT_LE(relativeError(all[i].grad(), want[i].grad()), 1e-12)
              << "parameter " << i;
          EXPECT_TRUE(torch::equal(all[i].grad(), all[want.size() + i].grad()))
              << "copy of parameter " << i;
        }
        torch::optim::Adam adam(all, 0.01);
        adam.step();
        for (size_t i = 0; i < want.size(); ++i)
          EXPECT_TRUE(torch::equal(all[i], all[want.size() + i]));
        reference->eval();
        piped->eval();
        EXPECT_LE(relativeError(pipe.forward(x), piped->forward(x)), 1e-14);
      }
    }
  }
  // Copies of running statistics would drift apart: refused, named.
  torch::nn::Sequential normed(
      torch::nn::Linear(6, 4),
      torch::nn::BatchNorm1d(4),
      torch::nn::Linear(4, 3));
  PipelineOptions options;
  options.devices = cpuDevices(2);
  options.microBatches = 4;
  options.schedule = "dualpipe";
  try {
    Pipeline pipe(layersOf(normed), options);
    ADD_FAILURE() << "built";
  } catch (const c10::Error& error) {
    EXPECT_NE(
        std::string(error.what()).find("layer '1' keeps running statistics"),
        std::string::npos)
        << error.what();
  }
}

namespace {

// A module that does not derive from torch::nn::Cloneable.
struct Uncopyable : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    return x;
  }
};

} // namespace

// What the tuner asks before it searches dualpipe: the first layer that
// stops a copy, named, and nothing drawn from the global generator.
TEST(PipelineTest, LayersThatCannotBeCopiedAreNamed) {
  torch::nn::Sequential plain(
      torch::nn::Linear(6, 4), torch::nn::ReLU(), torch::nn::Linear(4, 3));
  torch::manual_seed(7);
  EXPECT_EQ(whyLayersCannotBeCopied(layersOf(plain)), "");
  const torch::Tensor drawn = torch::rand({4});
  torch::manual_seed(7);
  EXPECT_TRUE(torch::equal(torch::rand({4}), drawn));

  LayerList layers = layersOf(plain);
  layers.push_back(
      {"odd", torch::nn::AnyModule(std::make_shared<Uncopyable>())});
  EXPECT_NE(
      whyLayersCannotBeCopied(layers).find("layer 'odd'"), std::string::npos);
  EXPECT_NE(
      whyLayersCannotBeCopied(layers).find("torch::nn::Cloneable"),
      std::string::npos);
  torch::nn::Sequential normed(
      torch::nn::Linear(6, 4), torch::nn::BatchNorm1d(4));
  EXPECT_NE(
      whyLayersCannotBeCopied(layersOf(normed))
          .find("layer '1' keeps running statistics ('running_mean')"),
      std::string::npos);
}

TEST(PipelineTest, SeveralOptimizerStepsTrackSequentialTraining) {
  torch::nn::Sequential reference = makeNet(torch::kDouble, 3);
  torch::nn::Sequential piped = makeNet(torch::kDouble, 3);
  PipelineOptions options;
  options.devices = cpuDevices(3);
  options.microBatches = 4;
  options.schedule = "1f1b";
  Pipeline pipe(layersOf(piped), options);
  torch::optim::SGD refOpt(
      reference->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::optim::SGD pipeOpt(
      pipe.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  torch::manual_seed(4);
  for (int step = 0; step < 5; ++step) {
    torch::Tensor x = torch::randn({10, 6}, torch::kDouble);
    torch::Tensor y = torch::randint(0, 3, {10}, torch::kLong);
    refOpt.zero_grad();
    torch::Tensor expected = crossEntropy(reference->forward(x), y);
    expected.backward();
    refOpt.step();
    pipeOpt.zero_grad();
    torch::Tensor loss = pipe.trainStep(x, y, crossEntropy);
    pipeOpt.step();
    EXPECT_LE(relativeError(loss, expected.detach()), 1e-12) << "step " << step;
  }
  auto want = reference->parameters();
  auto got = pipe.parameters();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_LE(relativeError(got[i], want[i]), 1e-12) << "parameter " << i;
  }
}

// The gradients of one training step of `layers`: `devices` stages, seed
// 11, a batch of `samples` drawn after manual_seed(6).
struct OneStep {
  CheckpointMode mode = CheckpointMode::kNever;
  std::string schedule = "1f1b";
  int devices = 2, microBatches = 3, samples = 12;
  torch::Dtype dtype = torch::kFloat;
};

std::vector<torch::Tensor> gradientsOfOneStep(
    const LayerList& layers,
    const OneStep& step) {
  PipelineOptions options;
  options.devices = cpuDevices(step.devices);
  options.microBatches = step.microBatches;
  options.checkpoint = step.mode;
  options.schedule = step.schedule;
  options.seed = 11;
  Pipeline pipe(layers, options);
  torch::manual_seed(6);
  const torch::Tensor x = torch::randn({step.samples, 6}, step.dtype);
  const torch::Tensor y = torch::randint(0, 3, {step.samples}, torch::kLong);
  pipe.trainStep(x, y, crossEntropy);
  std::vector<torch::Tensor> grads;
  for (const auto& p : pipe.parameters())
    grads.push_back(p.grad().clone());
  return grads;
}

TEST(PipelineTest, DropoutMasksReplayUnderRecompute) {
  auto gradientsWith = [](CheckpointMode mode, const std::string& schedule) {
    torch::nn::Sequential net = makeNet(torch::kDouble, 5, /*dropout=*/0.5);
    return gradientsOfOneStep(
        layersOf(net), {mode, schedule, 3, 4, 12, torch::kDouble});
  };
  for (const char* schedule : {"gpipe", "1f1b"}) {
    auto kept = gradientsWith(CheckpointMode::kNever, schedule);
    auto remat = gradientsWith(CheckpointMode::kAlways, schedule);
    auto again = gradientsWith(CheckpointMode::kNever, schedule);
    for (size_t i = 0; i < kept.size(); ++i) {
      EXPECT_TRUE(torch::equal(kept[i], remat[i]))
          << schedule << " parameter " << i;
      EXPECT_TRUE(torch::equal(kept[i], again[i]))
          << schedule << " parameter " << i;
    }
  }
}

// The registry's dropout, built from a config (2 stages, two dropouts).
LayerList registryDropoutNet() {
  const Config config = parseConfig(nlohmann::json::parse(R"({
    "model": {"input_shape": [6], "layers": [
      {"type": "linear", "out_features": 16}, {"type": "dropout", "p": 0.5},
      {"type": "tanh"}, {"type": "linear", "out_features": 16},
      {"type": "dropout", "p": 0.3}, {"type": "linear", "out_features": 3}]},
    "data": {"dataset": "synthetic", "samples": 12},
    "pipeline": {"devices": ["cpu:0", "cpu:1"]},
    "train": {"batch_size": 12, "steps": 1, "loss": "cross_entropy"}})"));
  return buildModel(config.model, 4).layers;
}

// A user's own module drawing through tpipe's stage generator.
struct OwnDropoutImpl : torch::nn::Module {
  explicit OwnDropoutImpl(double p) : p(p) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return stageDropout(x, p, is_training());
  }
  double p;
};
TORCH_MODULE(OwnDropout);

// registryDropoutNet with its dropouts LibTorch's, or the user's own
// (OwnDropout), declared as given.
LayerList withDropoutsOf(const std::string& kind, Randomness declared) {
  LayerList layers = registryDropoutNet();
  const bool own = kind == "own";
  layers[1].module = own ? torch::nn::AnyModule(OwnDropout(0.5))
                         : torch::nn::AnyModule(torch::nn::Dropout(0.5));
  layers[4].module = own ? torch::nn::AnyModule(OwnDropout(0.3))
                         : torch::nn::AnyModule(torch::nn::Dropout(0.3));
  layers[1].randomness = layers[4].randomness = declared;
  return layers;
}

// The registry's dropout, LibTorch's Dropout as a layer of its own, and a
// module's own draws through stageDropout (declared kStageGenerator) draw
// from their stage's own generator, without the shared lock, exactly the
// numbers LibTorch's Dropout draws from the default generator with the
// stage's state swapped in under the lock (declared kDraws), and replay
// them under recompute.
TEST(PipelineTest, DropoutLayersDrawTheStagesStreamWithoutTheLock) {
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1"}) {
    const auto kept = gradientsOfOneStep(
        registryDropoutNet(), {CheckpointMode::kNever, schedule});
    for (CheckpointMode mode :
         {CheckpointMode::kNever, CheckpointMode::kAlways}) {
      SCOPED_TRACE(std::string(schedule) + " " + checkpointModeName(mode));
      const auto registry =
          gradientsOfOneStep(registryDropoutNet(), {mode, schedule});
      const auto libtorch = gradientsOfOneStep(
          withDropoutsOf("libtorch", Randomness::kAuto), {mode, schedule});
      const auto swapped = gradientsOfOneStep(
          withDropoutsOf("libtorch", Randomness::kDraws), {mode, schedule});
      const auto own = gradientsOfOneStep(
          withDropoutsOf("own", Randomness::kStageGenerator), {mode, schedule});
      ASSERT_EQ(registry.size(), kept.size());
      for (size_t i = 0; i < kept.size(); ++i) {
        EXPECT_TRUE(torch::equal(registry[i], kept[i])) << "parameter " << i;
        EXPECT_TRUE(torch::equal(libtorch[i], kept[i])) << "parameter " << i;
        EXPECT_TRUE(torch::equal(swapped[i], kept[i])) << "parameter " << i;
        EXPECT_TRUE(torch::equal(own[i], kept[i])) << "parameter " << i;
      }
    }
  }
}

// Holds its stage's forward until the other stage's forward has entered
// its own instance: on its `call`-th call (counting from 1), each instance
// arrives and waits for the other. Throws after 20 s instead of hanging.
struct RendezvousImpl : torch::nn::Module {
  struct Shared {
    std::mutex mutex;
    std::condition_variable arrived;
    int count = 0;
  };
  RendezvousImpl(std::shared_ptr<Shared> shared, int call)
      : shared(std::move(shared)), call(call) {}
  torch::Tensor forward(const torch::Tensor& x) {
    if (++calls != call)
      return x;
    std::unique_lock<std::mutex> lock(shared->mutex);
    ++shared->count;
    shared->arrived.notify_all();
    TORCH_CHECK(
        shared->arrived.wait_for(
            lock, std::chrono::seconds(20), [&] { return shared->count == 2; }),
        "the two stages' forwards never ran at the same time");
    return x;
  }
  std::shared_ptr<Shared> shared;
  int call, calls = 0;
};
TORCH_MODULE(Rendezvous);

// Two stages with dropout layers (the registry's, LibTorch's or the
// user's own through stageDropout) run forwards side by side: under GPipe,
// stage 0's second forward and stage 1's first meet.
TEST(PipelineTest, StagesWithDropoutLayersRunForwardsTogether) {
  for (const char* kind : {"registry", "libtorch", "own"}) {
    SCOPED_TRACE(kind);
    LayerList layers = std::string(kind) == "registry"
        ? registryDropoutNet()
        : withDropoutsOf(
              kind,
              std::string(kind) == "own" ? Randomness::kStageGenerator
                                         : Randomness::kAuto);
    auto shared = std::make_shared<RendezvousImpl::Shared>();
    NamedLayer first{"meet0", torch::nn::AnyModule(Rendezvous(shared, 2))};
    NamedLayer second{"meet1", torch::nn::AnyModule(Rendezvous(shared, 1))};
    first.randomness = second.randomness = Randomness::kNone;
    layers.insert(layers.begin() + 2, first); // stage 0: layers 0-2
    layers.push_back(second);
    PipelineOptions options;
    options.devices = cpuDevices(2);
    options.microBatches = 3;
    options.schedule = "gpipe";
    options.checkpoint = CheckpointMode::kNever;
    options.partition = PartitionMethod::kBalance;
    options.balance = {3, 5};
    Pipeline pipe(layers, options);
    const torch::Tensor x = torch::randn({12, 6});
    const torch::Tensor y = torch::randint(0, 3, {12}, torch::kLong);
    EXPECT_NO_THROW(pipe.trainStep(x, y, crossEntropy));
    EXPECT_EQ(shared->count, 2);
  }
}

// A user's own random layer, unknown to tpipe by name: x + noise.
struct NoiseImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    return x + 0.3 * torch::randn_like(x);
  }
};
TORCH_MODULE(Noise);

TEST(PipelineTest, AUserDefinedRandomLayerReplaysUnderRecompute) {
  auto gradientsWith = [](CheckpointMode mode, Randomness declared) {
    torch::manual_seed(5);
    torch::nn::Sequential net(
        torch::nn::Linear(6, 12),
        Noise(),
        torch::nn::Tanh(),
        torch::nn::Linear(12, 12),
        Noise(),
        torch::nn::Linear(12, 3));
    LayerList layers = layersOf(net);
    for (auto& layer : layers)
      layer.randomness = declared;
    return gradientsOfOneStep(layers, {mode, "gpipe", 2, 3, 9});
  };
  const auto kept = gradientsWith(CheckpointMode::kNever, Randomness::kAuto);
  const auto remat = gradientsWith(CheckpointMode::kAlways, Randomness::kAuto);
  for (size_t i = 0; i < kept.size(); ++i)
    EXPECT_TRUE(torch::equal(kept[i], remat[i])) << "parameter " << i;
  // Declared deterministic, the layer draws from the shared stream: the
  // recompute draws other numbers (what kAuto protects against).
  const auto declaredNone =
      gradientsWith(CheckpointMode::kAlways, Randomness::kNone);
  bool anyDiffers = false;
  for (size_t i = 0; i < kept.size(); ++i)
    anyDiffers = anyDiffers || !torch::equal(kept[i], declaredNone[i]);
  EXPECT_TRUE(anyDiffers);
}

TEST(PipelineTest, AScheduleFromAFileRunsTransparently) {
  const std::string path = ::testing::TempDir() + "/tpipe-custom-schedule.json";
  {
    // zb-h1 written out, then edited by hand: rank 2 runs its W passes last.
    nlohmann::json json =
        scheduleToJson(zeroBubbleH1Schedule(3, 4, CheckpointMode::kNever));
    auto& list = json["stages"][2];
    nlohmann::json weights = nlohmann::json::array(),
                   rest = nlohmann::json::array();
    for (const auto& item : list)
      (item["op"] == "backward_weight" ? weights : rest).push_back(item);
    for (const auto& item : weights)
      rest.push_back(item);
    list = rest;
    std::ofstream(path) << json.dump();
  }
  torch::nn::Sequential reference = makeNet(torch::kDouble, 21);
  torch::nn::Sequential piped = makeNet(torch::kDouble, 21);
  PipelineOptions options;
  options.devices = cpuDevices(3);
  options.microBatches = 4;
  options.schedule = path;
  Pipeline pipe(layersOf(piped), options);
  EXPECT_EQ(pipe.schedule().name, "zb-h1");
  torch::Tensor x = torch::randn({9, 6}, torch::kDouble);
  torch::Tensor y = torch::randint(0, 3, {9}, torch::kLong);
  crossEntropy(reference->forward(x), y).backward();
  pipe.trainStep(x, y, crossEntropy);
  auto want = reference->parameters();
  auto got = pipe.parameters();
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_LE(relativeError(got[i].grad(), want[i].grad()), 1e-12);
  // The file must fit the pipeline.
  options.microBatches = 2;
  try {
    Pipeline wrong(layersOf(makeNet(torch::kDouble, 21)), options);
    FAIL();
  } catch (const c10::Error& error) {
    EXPECT_NE(
        std::string(error.what_without_backtrace())
            .find("has 4 micro-batches; the pipeline has 2"),
        std::string::npos);
  }
  options.schedule = ::testing::TempDir() + "/no-such-schedule.json";
  EXPECT_THROW(
      Pipeline(layersOf(makeNet(torch::kDouble, 21)), options), c10::Error);
}

TEST(PipelineTest, ForwardMatchesTheModelInEvalMode) {
  torch::nn::Sequential net = makeNet(torch::kDouble, 7, 0.3);
  PipelineOptions options;
  options.devices = cpuDevices(4);
  options.microBatches = 3;
  Pipeline pipe(layersOf(net), options);
  net->eval();
  torch::Tensor x = torch::randn({11, 6}, torch::kDouble);
  torch::Tensor out = pipe.forward(x);
  EXPECT_FALSE(out.requires_grad());
  EXPECT_LE(relativeError(out, net->forward(x).detach()), 1e-14);
  // Fewer samples than micro-batches is fine for inference.
  EXPECT_EQ(pipe.forward(x.narrow(0, 0, 2)).size(0), 2);
}

TEST(PipelineTest, PartitionMethodsAndNames) {
  torch::nn::Sequential net = makeNet(torch::kFloat, 8);
  PipelineOptions options;
  options.devices = cpuDevices(3);
  options.balance = {2, 5, 3};
  Pipeline pipe(layersOf(net), options);
  EXPECT_EQ(pipe.boundaries(), (std::vector<int>{0, 2, 7, 10}));
  EXPECT_EQ(
      pipe.stageDevices(),
      (std::vector<std::string>{"cpu:0", "cpu:1", "cpu:2"}));
  EXPECT_EQ(pipe.namedParameters().front().first, "0.weight");
  EXPECT_EQ(pipe.namedParameters().back().first, "9.bias");

  PipelineOptions byParameters;
  byParameters.devices = cpuDevices(2);
  byParameters.partition = PartitionMethod::kParameters;
  Pipeline balanced(layersOf(makeNet(torch::kFloat, 8)), byParameters);
  // Parameters per layer: 84, 0, 156, 0, 0, 130, 0, 110, 0, 33.
  EXPECT_EQ(balanced.boundaries(), (std::vector<int>{0, 3, 10}));
}

std::string constructionError(
    const PipelineOptions& options,
    const LayerList& layers = layersOf(makeNet(torch::kFloat, 9))) {
  try {
    Pipeline pipe(layers, options);
  } catch (const c10::Error& error) {
    return error.what_without_backtrace();
  }
  return "";
}

TEST(PipelineTest, BadOptionsAreClearErrors) {
  PipelineOptions options;
  options.devices = cpuDevices(12);
  options.stages = 11;
  EXPECT_NE(
      constructionError(options).find("more stages (11) than layers (10)"),
      std::string::npos)
      << constructionError(options);

  options = {};
  options.devices = {"cpu:0", "gpu:1"};
  EXPECT_NE(
      constructionError(options).find("unknown device 'gpu:1'"),
      std::string::npos)
      << constructionError(options);

  options = {};
  options.devices = cpuDevices(2);
  options.balance = {4, 4};
  EXPECT_NE(
      constructionError(options).find(
          "balance sums to 8 layers, but the model has 10"),
      std::string::npos)
      << constructionError(options);

  options = {};
  options.devices = cpuDevices(2);
  options.stages = 3;
  EXPECT_NE(
      constructionError(options).find("need 3 devices, got 2"),
      std::string::npos)
      << constructionError(options);

  options = {};
  options.devices = {"cpu:0", "cpu:0"};
  EXPECT_NE(constructionError(options).find("listed twice"), std::string::npos);

  options = {};
  options.schedule = "zigzag";
  EXPECT_NE(
      constructionError(options).find("unknown schedule 'zigzag'"),
      std::string::npos);

  options = {};
  options.devices = {"cuda:0"};
  if (!torch::cuda::is_available()) {
    EXPECT_NE(
        constructionError(options).find("no usable CUDA device"),
        std::string::npos)
        << constructionError(options);
  }
}

TEST(PipelineTest, MoreMicroBatchesThanSamples) {
  PipelineOptions options;
  options.devices = cpuDevices(2);
  options.microBatches = 8;
  Pipeline pipe(layersOf(makeNet(torch::kFloat, 10)), options);
  try {
    pipe.trainStep(
        torch::randn({5, 6}), torch::zeros({5}, torch::kLong), crossEntropy);
    FAIL() << "expected an error";
  } catch (const c10::Error& error) {
    EXPECT_NE(
        std::string(error.what_without_backtrace())
            .find("more micro-batches (8) than samples (5)"),
        std::string::npos);
  }
  EXPECT_THROW(
      pipe.trainStep(
          torch::randn({9, 6}), torch::zeros({8}, torch::kLong), crossEntropy),
      c10::Error);
}

struct ThrowingImpl : torch::nn::Module {
  bool armed = false;
  torch::Tensor forward(torch::Tensor x) {
    if (armed)
      throw std::runtime_error("boom");
    return x;
  }
};
TORCH_MODULE(Throwing);

TEST(PipelineTest, AThrowingLayerEndsTheStepAndThePipelineRecovers) {
  torch::manual_seed(12);
  Throwing thrower;
  torch::nn::Sequential net(
      torch::nn::Linear(6, 8),
      torch::nn::ReLU(),
      torch::nn::Linear(8, 8),
      thrower,
      torch::nn::Linear(8, 3),
      torch::nn::Identity());
  torch::manual_seed(12);
  torch::nn::Sequential reference(
      torch::nn::Linear(6, 8),
      torch::nn::ReLU(),
      torch::nn::Linear(8, 8),
      torch::nn::Identity(),
      torch::nn::Linear(8, 3),
      torch::nn::Identity());
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1"}) {
    PipelineOptions options;
    options.devices = cpuDevices(3);
    options.microBatches = 4;
    options.schedule = schedule;
    Pipeline pipe(layersOf(net), options);
    torch::Tensor x = torch::randn({8, 6});
    torch::Tensor y = torch::randint(0, 3, {8}, torch::kLong);
    thrower->armed = true;
    try {
      pipe.trainStep(x, y, crossEntropy);
      FAIL() << "expected the step to fail";
    } catch (const c10::Error& error) {
      // Where it failed, where it was in its list, what it last finished.
      const std::string what = error.what_without_backtrace();
      EXPECT_NE(
          what.find("stage 1 on cpu:1, micro-batch 0, forward (instruction 2 "
                    "of "),
          std::string::npos)
          << what;
      EXPECT_NE(
          what.find("; last completed: recv act 0 <- stage 0): boom"),
          std::string::npos)
          << what;
    }
    thrower->armed = false;
    for (auto& p : pipe.parameters())
      p.mutable_grad() = torch::Tensor();
    for (auto& p : reference->parameters())
      p.mutable_grad() = torch::Tensor();
    torch::Tensor loss = pipe.trainStep(x, y, crossEntropy);
    torch::Tensor expected = crossEntropy(reference->forward(x), y);
    expected.backward();
    EXPECT_LE(relativeError(loss, expected.detach()), 1e-5);
    auto got = pipe.parameters();
    auto want = reference->parameters();
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_LE(relativeError(got[i].grad(), want[i].grad()), 1e-5);
    }
  }
}

TEST(PipelineTest, ABadLossIsReportedWithItsStage) {
  PipelineOptions options;
  options.devices = cpuDevices(2);
  options.microBatches = 2;
  Pipeline pipe(layersOf(makeNet(torch::kFloat, 13)), options);
  auto perSample = [](const torch::Tensor& out, const torch::Tensor& y) {
    return torch::nn::functional::cross_entropy(
        out,
        y,
        torch::nn::functional::CrossEntropyFuncOptions().reduction(
            torch::kNone));
  };
  try {
    pipe.trainStep(
        torch::randn({4, 6}), torch::zeros({4}, torch::kLong), perSample);
    FAIL();
  } catch (const c10::Error& error) {
    EXPECT_NE(
        std::string(error.what_without_backtrace())
            .find("stage 1 on cpu:1, micro-batch 0, forward (instruction 2 "),
        std::string::npos)
        << error.what_without_backtrace();
    EXPECT_NE(
        std::string(error.what_without_backtrace())
            .find("): the loss function must return a scalar"),
        std::string::npos)
        << error.what_without_backtrace();
  }
}

// One global norm over every stage, clipped as clip_grad_norm_ clips the
// sequential model, for several stage counts and schedules.
TEST(PipelineTest, ClipGradNormEqualsTheSequentialModels) {
  for (int ranks : {1, 2, 3}) {
    for (const char* schedule : {"1f1b", "zb-h1"}) {
      for (double maxNorm : {0.05, 1e6}) {
        SCOPED_TRACE(
            std::string(schedule) + " ranks=" + std::to_string(ranks) +
            " max=" + std::to_string(maxNorm));
        torch::nn::Sequential reference = makeNet(torch::kFloat, 5);
        torch::nn::Sequential piped = makeNet(torch::kFloat, 5);
        torch::manual_seed(6);
        torch::Tensor x = torch::randn({12, 6});
        torch::Tensor y = torch::randint(0, 3, {12}, torch::kLong);
        crossEntropy(reference->forward(x), y).backward();
        const double want =
            torch::nn::utils::clip_grad_norm_(reference->parameters(), maxNorm);
        PipelineOptions options;
        options.devices = cpuDevices(ranks);
        options.microBatches = 4;
        options.schedule = schedule;
        Pipeline pipe(layersOf(piped), options);
        pipe.trainStep(x, y, crossEntropy);
        const Pipeline::GradientNorm got = pipe.clipGradNorm(maxNorm);
        EXPECT_EQ(got.nonFiniteStage, -1);
        EXPECT_NEAR(got.norm, want, 1e-5 * want);
        const auto expected = reference->parameters();
        const auto clipped = pipe.parameters();
        ASSERT_EQ(expected.size(), clipped.size());
        for (size_t i = 0; i < expected.size(); ++i) {
          EXPECT_LE(relativeError(clipped[i].grad(), expected[i].grad()), 1e-5)
              << "parameter " << i;
        }
      }
    }
  }
}

// Forward 0, backward inf x 0 = NaN: finite loss, non-finite gradients
// upstream of it.
struct NaNGradientImpl : torch::nn::Module {
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::sqrt(x * 0.0) + x;
  }
};
TORCH_MODULE(NaNGradient);

TEST(PipelineTest, NonFiniteGradientsNameTheirStageAndAreNotScaled) {
  torch::manual_seed(7);
  torch::nn::Sequential net(
      torch::nn::Linear(6, 8),
      torch::nn::Tanh(),
      NaNGradient(),
      torch::nn::Linear(8, 3));
  PipelineOptions options;
  options.devices = cpuDevices(2);
  options.balance = {2, 2}; // the NaN layer opens stage 1
  options.microBatches = 2;
  Pipeline pipe(layersOf(net), options);
  const torch::Tensor loss = pipe.trainStep(
      torch::randn({4, 6}),
      torch::randint(0, 3, {4}, torch::kLong),
      crossEntropy);
  EXPECT_TRUE(std::isfinite(loss.item<double>()));
  const Pipeline::GradientNorm norm = pipe.clipGradNorm(1.0);
  EXPECT_EQ(norm.nonFiniteStage, 0);
  EXPECT_FALSE(std::isfinite(norm.norm));
  // Stage 1's own gradients are finite and were left as they were.
  const auto last = pipe.parameters().back().grad();
  EXPECT_TRUE(torch::isfinite(last).all().item<bool>());
}

// The reference's LM head: a linear map with the embedding's own tensor.
struct TiedHeadImpl : torch::nn::Module {
  explicit TiedHeadImpl(const torch::Tensor& shared) {
    weight = register_parameter("weight", shared);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return torch::nn::functional::linear(x, weight);
  }
  torch::Tensor weight;
};
TORCH_MODULE(TiedHead);

constexpr int64_t kVocab = 11, kDim = 8;

// LibTorch's Module::parameters() lists a shared tensor once per use;
// PyTorch's, and what an optimizer must step, once.
std::vector<torch::Tensor> distinct(const std::vector<torch::Tensor>& all) {
  std::vector<torch::Tensor> once;
  for (const auto& t : all) {
    if (std::none_of(once.begin(), once.end(), [&](const torch::Tensor& o) {
          return o.is_same(t);
        }))
      once.push_back(t);
  }
  return once;
}

torch::nn::Sequential tiedTrunk(uint64_t seed) {
  torch::manual_seed(seed);
  return torch::nn::Sequential(
      torch::nn::Embedding(kVocab, kDim),
      torch::nn::Linear(kDim, kDim),
      torch::nn::Tanh(),
      torch::nn::Linear(kDim, kDim),
      torch::nn::GELU());
}

torch::Tensor tokenLoss(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(
      out.reshape({-1, kVocab}), y.reshape({-1}));
}

// A GPT's embedding and head tied across stages: each stage keeps a copy,
// and both copies' gradients equal the one shared tensor's gradient in the
// sequential tied model, for every schedule and checkpoint mode; after an
// optimizer step the copies are equal bit for bit.
TEST(PipelineTest, TiedWeightsAcrossStagesAreTransparent) {
  torch::manual_seed(9);
  const torch::Tensor x = torch::randint(0, kVocab, {6, 3});
  const torch::Tensor y = torch::randint(0, kVocab, {6, 3});
  struct TiedCase {
    const char* schedule;
    int ranks, virtualStages;
  };
  for (const TiedCase& c :
       {TiedCase{"gpipe", 3, 1},
        TiedCase{"1f1b", 2, 1},
        TiedCase{"zb-h1", 3, 1},
        TiedCase{"interleaved-1f1b", 2, 2},
        TiedCase{"zb-v", 2, 2},
        TiedCase{"dualpipe", 2, 1},
        TiedCase{"1f1b", 1, 1}}) {
    for (auto mode : {CheckpointMode::kAlways, CheckpointMode::kNever}) {
      SCOPED_TRACE(
          std::string(c.schedule) + " ranks=" + std::to_string(c.ranks) + " " +
          checkpointModeName(mode));
      torch::nn::Sequential reference = tiedTrunk(3);
      reference->push_back(
          TiedHead(reference[0]->as<torch::nn::Embedding>()->weight));
      tokenLoss(reference->forward(x), y).backward();
      const torch::Tensor shared =
          reference[0]->as<torch::nn::Embedding>()->weight;

      torch::nn::Sequential piped = tiedTrunk(3);
      piped->push_back(torch::nn::Linear(
          torch::nn::LinearOptions(kDim, kVocab).bias(false)));
      PipelineOptions options;
      options.devices = cpuDevices(c.ranks);
      options.virtualStages = c.virtualStages;
      const bool dualPipe = std::string(c.schedule) == "dualpipe";
      options.microBatches = dualPipe ? 4 : 2;
      options.schedule = c.schedule;
      options.checkpoint = mode;
      options.tiedParameters = {{"0.weight", "5.weight"}};
      Pipeline pipe(layersOf(piped), options);
      const torch::Tensor embedding =
          piped[0]->as<torch::nn::Embedding>()->weight;
      const torch::Tensor head = piped[5]->as<torch::nn::Linear>()->weight;
      EXPECT_TRUE(torch::equal(head, shared)); // the copy took its values
      const torch::Tensor loss = pipe.trainStep(x, y, tokenLoss);
      EXPECT_LE(relativeError(loss, tokenLoss(reference->forward(x), y)), 1e-5);
      EXPECT_LE(relativeError(embedding.grad(), shared.grad()), 1e-5);
      EXPECT_TRUE(torch::equal(embedding.grad(), head.grad()));
      // Each tensor once: the two copies, not the shared one twice (and
      // under dualpipe, each again in the second chain).
      EXPECT_EQ(
          pipe.parameters().size(),
          (distinct(reference->parameters()).size() + 1) * (dualPipe ? 2 : 1));
      torch::optim::Adam adam(pipe.parameters(), 0.01);
      adam.step();
      EXPECT_TRUE(torch::equal(embedding, head));
      EXPECT_FALSE(torch::equal(embedding, shared));
    }
  }
}

// The reference model itself (one tensor in layers 0 and 5) pipelined on
// CPU devices: the tie is found, stepped once, and the gradient is right.
TEST(PipelineTest, OneTensorOnTwoStagesIsFoundTied) {
  torch::manual_seed(10);
  const torch::Tensor x = torch::randint(0, kVocab, {4, 3});
  const torch::Tensor y = torch::randint(0, kVocab, {4, 3});
  torch::nn::Sequential reference = tiedTrunk(4);
  reference->push_back(
      TiedHead(reference[0]->as<torch::nn::Embedding>()->weight));
  tokenLoss(reference->forward(x), y).backward();
  torch::nn::Sequential piped = tiedTrunk(4);
  piped->push_back(TiedHead(piped[0]->as<torch::nn::Embedding>()->weight));
  PipelineOptions options;
  options.devices = cpuDevices(3);
  options.microBatches = 2;
  options.schedule = "1f1b";
  Pipeline pipe(layersOf(piped), options);
  pipe.trainStep(x, y, tokenLoss);
  EXPECT_EQ(pipe.parameters().size(), distinct(reference->parameters()).size());
  EXPECT_LE(
      relativeError(
          piped[0]->as<torch::nn::Embedding>()->weight.grad(),
          reference[0]->as<torch::nn::Embedding>()->weight.grad()),
      1e-5);
  const Pipeline::GradientNorm norm = pipe.clipGradNorm(0.0);
  EXPECT_NEAR(
      norm.norm,
      torch::nn::utils::clip_grad_norm_(distinct(reference->parameters()), 1e9),
      1e-5);
}

TEST(PipelineTest, BadTiesAreClearErrors) {
  torch::nn::Sequential net = tiedTrunk(5);
  net->push_back(torch::nn::Linear(kDim, kVocab));
  PipelineOptions options;
  options.devices = cpuDevices(2);
  options.tiedParameters = {{"0.weight", "9.weight"}};
  EXPECT_NE(
      constructionError(options, layersOf(net))
          .find("tied parameter '9.weight' is not a trainable parameter"),
      std::string::npos)
      << constructionError(options, layersOf(net));
  options.tiedParameters = {{"0.weight", "1.weight"}};
  EXPECT_NE(
      constructionError(options, layersOf(net))
          .find("differ in shape or dtype"),
      std::string::npos)
      << constructionError(options, layersOf(net));
}

// Reads a file torch.save wrote (a dict of tensors).
c10::Dict<c10::IValue, c10::IValue> loadTorchSave(const std::string& path) {
  std::ifstream file(path, std::ios::binary);
  std::vector<char> bytes(
      (std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  return torch::pickle_load(bytes).toGenericDict();
}

// A fresh scratch directory for one test, named for it and this process.
std::filesystem::path scratchDirectory(const std::string& name) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
      ("tpipe-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir;
}

// Writes `script` to DIR/make.py and runs it with Debian's Python (the one
// with torch): its exit status.
int runPython(const std::filesystem::path& dir, const std::string& script) {
  std::ofstream(dir / "make.py") << script;
  return std::system(
      ("/usr/bin/python3 " + (dir / "make.py").string()).c_str());
}

// A model scripted in Python is the layer list: tpipe's first-step loss and
// gradients equal PyTorch's on the same batch, parameters keep PyTorch's
// names, and training updates the loaded module's own tensors.
TEST(PipelineTest, AModelScriptedInPythonMatchesPyTorch) {
  namespace fs = std::filesystem;
  const fs::path dir = scratchDirectory("script");
  const std::string script =
      "import torch, torch.nn as nn\n"
      "torch.manual_seed(0)\n"
      "class Block(nn.Module):\n"
      "    def __init__(self):\n"
      "        super().__init__()\n"
      "        self.fc = nn.Linear(12, 12)\n"
      "        self.norm = nn.LayerNorm(12)\n"
      "    def forward(self, x):\n"
      "        return x + torch.tanh(self.fc(self.norm(x)))\n"
      "m = nn.Sequential(nn.Linear(6, 12), nn.GELU(), Block(), Block(), nn.Linear(12, 3))\n"
      "x = torch.randn(10, 6); y = torch.randint(0, 3, (10,))\n"
      "loss = nn.functional.cross_entropy(m(x), y)\n"
      "loss.backward()\n"
      "torch.jit.script(m).save('" +
      (dir / "m.pt").string() +
      "')\n"
      "ref = {'x': x, 'y': y, 'loss': loss.detach()}\n"
      "for name, p in m.named_parameters(): ref['grad.' + name] = p.grad\n"
      "torch.save(ref, '" +
      (dir / "ref.pt").string() + "')\n";
  ASSERT_EQ(runPython(dir, script), 0)
      << "python3-torch is needed (scripts/setup installs it)";
  const auto ref = loadTorchSave((dir / "ref.pt").string());
  const torch::Tensor x = ref.at("x").toTensor();
  const torch::Tensor y = ref.at("y").toTensor();

  for (int microBatches : {1, 3}) {
    SCOPED_TRACE("micro-batches " + std::to_string(microBatches));
    PipelineOptions options;
    options.devices = cpuDevices(3);
    options.microBatches = microBatches;
    options.schedule = "1f1b";
    options.checkpoint = CheckpointMode::kAlways;
    Pipeline pipe(loadTorchScript((dir / "m.pt").string()), options);
    const torch::Tensor loss = pipe.trainStep(x, y, crossEntropy);
    EXPECT_LE(relativeError(loss, ref.at("loss").toTensor()), 1e-6);
    size_t compared = 0;
    for (const auto& [name, parameter] : pipe.namedParameters()) {
      ASSERT_TRUE(ref.contains("grad." + name))
          << name << " is not PyTorch's name";
      EXPECT_LE(
          relativeError(parameter.grad(), ref.at("grad." + name).toTensor()),
          1e-5)
          << name;
      ++compared;
    }
    EXPECT_EQ(compared, 12u); // 2 + 2 x (2 + 2) + 2
  }
  EXPECT_THROW(loadTorchScript((dir / "make.py").string()), UserError);
  fs::remove_all(dir);
}

} // namespace
} // namespace tpipe

namespace tpipe {
namespace {

using testing::parametersOf;

LayerList skipNet(uint64_t seed) {
  return testing::skipNet(seed, torch::kDouble);
}

TEST(PipelineTest, SkipConnectionsAcrossStagesAreTransparent) {
  torch::manual_seed(12);
  const torch::Tensor x = torch::randn({7, 6}, torch::kDouble);
  const torch::Tensor y = torch::randint(0, 3, {7});
  const LayerList reference = skipNet(5);
  const torch::Tensor expected = crossEntropy(runSequential(reference, x), y);
  expected.backward();
  struct SkipCase {
    const char* schedule;
    int ranks, virtualStages;
  };
  std::vector<SkipCase> cases;
  for (int ranks = 1; ranks <= 4; ++ranks) {
    for (const char* schedule : {"gpipe", "1f1b", "zb-h1"})
      cases.push_back({schedule, ranks, 1});
    if (ranks <= 4)
      cases.push_back({"zb-v", ranks, 2});
    if (ranks == 2)
      cases.push_back({"interleaved-1f1b", ranks, 2});
    if (ranks == 2) // m >= 2p micro-batches of 7 samples
      cases.push_back({"dualpipe", ranks, 1});
  }
  for (const SkipCase& c : cases) {
    const bool dualPipe = std::string(c.schedule) == "dualpipe";
    for (int m : dualPipe ? std::vector<int>{2 * c.ranks, 2 * c.ranks + 2}
                          : std::vector<int>{1, 2, 4}) {
      for (auto mode :
           {CheckpointMode::kAlways,
            CheckpointMode::kExceptLast,
            CheckpointMode::kNever}) {
        SCOPED_TRACE(
            std::string(c.schedule) + " ranks=" + std::to_string(c.ranks) +
            " m=" + std::to_string(m) + " " + checkpointModeName(mode));
        const LayerList layers = skipNet(5);
        PipelineOptions options;
        options.devices = cpuDevices(c.ranks);
        options.virtualStages = c.virtualStages;
        options.microBatches = m;
        options.schedule = c.schedule;
        options.checkpoint = mode;
        if (std::string(c.schedule) == "interleaved-1f1b" && m % c.ranks)
          continue;
        Pipeline pipe(layers, options);
        const torch::Tensor loss = pipe.trainStep(x, y, crossEntropy);
        EXPECT_LE(relativeError(loss, expected.detach()), 1e-12);
        const auto want = parametersOf(reference);
        const auto got = parametersOf(layers);
        ASSERT_EQ(want.size(), got.size());
        for (size_t i = 0; i < want.size(); ++i) {
          ASSERT_TRUE(got[i].grad().defined()) << "parameter " << i;
          EXPECT_LE(relativeError(got[i].grad(), want[i].grad()), 1e-12)
              << "parameter " << i;
        }
        EXPECT_TRUE(
            torch::allclose(pipe.forward(x), runSequential(reference, x)));
      }
    }
  }
}

TEST(PipelineTest, BadSkipsAreClearErrors) {
  auto errorOf = [](LayerList layers) {
    PipelineOptions options;
    options.devices = cpuDevices(2);
    return constructionError(options, std::move(layers));
  };
  LayerList popFirst = skipNet(1);
  popFirst[0].pop = {"z"};
  EXPECT_NE(
      errorOf(popFirst).find(
          "layer '0': 'z' is popped before any layer stashes it"),
      std::string::npos)
      << errorOf(popFirst);
  LayerList twice = skipNet(1);
  twice[3].stash = {"a"};
  EXPECT_NE(
      errorOf(twice).find("layer '3': 'a' is stashed twice"), std::string::npos)
      << errorOf(twice);
  LayerList never = skipNet(1);
  never[8].stash = {"e"};
  EXPECT_NE(
      errorOf(never).find("'e' is stashed but no later layer pops it"),
      std::string::npos)
      << errorOf(never);
  // A shape that cannot merge is named, with the layer, at the step.
  LayerList wrongShape = skipNet(1);
  torch::nn::Linear narrow(8, 5);
  narrow->to(torch::kDouble);
  wrongShape[4].module = torch::nn::AnyModule(narrow);
  PipelineOptions options;
  options.devices = cpuDevices(2);
  Pipeline pipe(wrongShape, options);
  try {
    pipe.trainStep(
        torch::randn({2, 6}, torch::kDouble),
        torch::randint(0, 3, {2}),
        crossEntropy);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& error) {
    EXPECT_NE(
        std::string(error.what())
            .find(
                "layer '4' cannot add the skip 'b' of shape [2, 8] to its output "
                "of shape [2, 5]"),
        std::string::npos)
        << error.what();
  }
}

} // namespace
} // namespace tpipe

namespace tpipe {
namespace {

// Batch norm keeps buffers (running statistics, a batch counter) that its
// forward updates: a pipelined step must leave them as a sequential run
// over the same micro-batches does, whatever the schedule and checkpoint
// mode (a recompute must not count a micro-batch twice).
torch::nn::Sequential batchNormNet(torch::Dtype dtype, uint64_t seed) {
  torch::manual_seed(seed);
  torch::nn::Sequential net(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)),
      torch::nn::BatchNorm2d(4),
      torch::nn::ReLU(),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 4, 3).padding(1)),
      torch::nn::BatchNorm2d(4),
      torch::nn::Tanh(),
      torch::nn::Flatten(),
      torch::nn::Linear(4 * 5 * 5, 3));
  net->to(dtype);
  return net;
}

// The plain model over the batch's micro-batches in order, each forward in
// training mode and each loss weighted by its share, as the pipeline
// splits them (tensor_split).
torch::Tensor microBatchedStep(
    torch::nn::Sequential& net,
    const torch::Tensor& x,
    const torch::Tensor& y,
    int microBatches) {
  torch::Tensor total = torch::zeros({}, x.options());
  const auto xs = x.tensor_split(microBatches);
  const auto ys = y.tensor_split(microBatches);
  for (size_t k = 0; k < xs.size(); ++k) {
    torch::Tensor loss = crossEntropy(net->forward(xs[k]), ys[k]) *
        (static_cast<double>(xs[k].size(0)) / x.size(0));
    loss.backward();
    total = total + loss.detach();
  }
  return total;
}

TEST(PipelineTest, BatchNormBuffersMatchAMicroBatchedRunUnderEverySchedule) {
  torch::manual_seed(8);
  const torch::Tensor x = torch::randn({12, 1, 5, 5}, torch::kDouble);
  const torch::Tensor y = torch::randint(0, 3, {12}, torch::kLong);
  std::vector<Case> cases;
  for (int ranks = 1; ranks <= 3; ++ranks) {
    for (int m : {1, 2, 4}) {
      for (auto mode :
           {CheckpointMode::kAlways,
            CheckpointMode::kExceptLast,
            CheckpointMode::kNever}) {
        for (const char* schedule : {"gpipe", "1f1b", "zb-h1", "zb-h2"})
          cases.push_back({schedule, ranks, 1, m, mode});
        cases.push_back({"zb-v", ranks, 2, m, mode});
        if (m % ranks == 0)
          cases.push_back({"interleaved-1f1b", ranks, 2, m, mode});
      }
    }
  }
  for (const Case& c : cases) {
    SCOPED_TRACE(describe(c, torch::kDouble));
    torch::nn::Sequential reference = batchNormNet(torch::kDouble, 6);
    torch::nn::Sequential piped = batchNormNet(torch::kDouble, 6);
    const torch::Tensor expected =
        microBatchedStep(reference, x, y, c.microBatches);
    PipelineOptions options;
    options.devices = cpuDevices(c.ranks);
    options.virtualStages = c.virtualStages;
    options.microBatches = c.microBatches;
    options.schedule = c.schedule;
    options.checkpoint = c.mode;
    Pipeline pipe(layersOf(piped), options);
    const torch::Tensor loss = pipe.trainStep(x, y, crossEntropy);
    EXPECT_LE(relativeError(loss, expected), 1e-12);
    const auto want = reference->parameters();
    const auto got = piped->parameters();
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_LE(relativeError(got[i].grad(), want[i].grad()), 1e-12)
          << "parameter " << i;
    }
    const auto wantBuffers = reference->named_buffers();
    const auto gotBuffers = piped->named_buffers();
    ASSERT_EQ(wantBuffers.size(), 6u); // 2 x (mean, var, count)
    for (size_t i = 0; i < wantBuffers.size(); ++i) {
      const std::string& name = wantBuffers[i].key();
      if (name.find("num_batches_tracked") != std::string::npos) {
        EXPECT_TRUE(torch::equal(gotBuffers[i].value(), wantBuffers[i].value()))
            << name << ": " << gotBuffers[i].value().item<int64_t>() << " vs "
            << wantBuffers[i].value().item<int64_t>();
      } else {
        EXPECT_LE(
            relativeError(gotBuffers[i].value(), wantBuffers[i].value()), 1e-12)
            << name;
      }
    }
  }
}

// Float addition is not associative, so each stage must add its
// micro-batches' gradients in one order for every schedule; batch norm over
// two samples amplifies the last bit into visibly different training. gpipe
// and 1F1B train bit-identically over several SGD steps.
TEST(PipelineTest, GpipeTrainsBitIdenticallyToOneFOneB) {
  for (int ranks : {1, 2}) {
    for (auto mode : {CheckpointMode::kNever, CheckpointMode::kExceptLast}) {
      SCOPED_TRACE(
          std::to_string(ranks) + " rank(s), " + checkpointModeName(mode));
      std::vector<torch::nn::Sequential> nets;
      std::vector<std::unique_ptr<Pipeline>> pipes;
      std::vector<std::unique_ptr<torch::optim::SGD>> optimizers;
      for (const char* schedule : {"gpipe", "1f1b"}) {
        nets.push_back(batchNormNet(torch::kFloat, 9));
        PipelineOptions options;
        options.devices = cpuDevices(ranks);
        options.microBatches = 4;
        options.schedule = schedule;
        options.checkpoint = mode;
        pipes.push_back(
            std::make_unique<Pipeline>(layersOf(nets.back()), options));
        optimizers.push_back(std::make_unique<torch::optim::SGD>(
            pipes.back()->parameters(), torch::optim::SGDOptions(0.5)));
      }
      torch::manual_seed(10);
      for (int step = 0; step < 4; ++step) {
        const torch::Tensor x = torch::randn({8, 1, 5, 5});
        const torch::Tensor y = torch::randint(0, 3, {8}, torch::kLong);
        for (size_t k = 0; k < pipes.size(); ++k) {
          optimizers[k]->zero_grad();
          pipes[k]->trainStep(x, y, crossEntropy);
          optimizers[k]->step();
        }
      }
      const auto gpipe = nets[0]->named_parameters();
      const auto oneFOneB = nets[1]->named_parameters();
      for (size_t i = 0; i < gpipe.size(); ++i) {
        EXPECT_TRUE(torch::equal(gpipe[i].value(), oneFOneB[i].value()))
            << gpipe[i].key() << " differs by "
            << (gpipe[i].value() - oneFOneB[i].value())
                   .abs()
                   .max()
                   .item<float>();
      }
      const auto gpipeBuffers = nets[0]->named_buffers();
      const auto oneFOneBBuffers = nets[1]->named_buffers();
      for (size_t i = 0; i < gpipeBuffers.size(); ++i) {
        EXPECT_TRUE(
            torch::equal(gpipeBuffers[i].value(), oneFOneBBuffers[i].value()))
            << gpipeBuffers[i].key();
      }
    }
  }
}

// A model no one here wrote: torchvision's ResNet-18, scripted in Python
// (children in an nn.Sequential, a 1-channel stem), on 4 stages with
// rematerialization. Its batch-norm buffers, loss and gradients equal
// PyTorch's sequential run over the same micro-batches.
TEST(PipelineTest, AScriptedTorchvisionResNetKeepsPyTorchsBuffersUnderRemat) {
  namespace fs = std::filesystem;
  const fs::path dir = scratchDirectory("resnet");
  const std::string script =
      "import torch, torch.nn as nn\n"
      "try:\n"
      "    import torchvision\n"
      "except ImportError:\n"
      "    raise SystemExit(3)\n"
      "torch.manual_seed(0)\n"
      "r = torchvision.models.resnet18(num_classes=10)\n"
      "r.conv1 = nn.Conv2d(1, 64, 7, 2, 3, bias=False)\n"
      "m = nn.Sequential(r.conv1, r.bn1, r.relu, r.maxpool, r.layer1, "
      "r.layer2, r.layer3, r.layer4, r.avgpool, nn.Flatten(), r.fc)\n"
      "torch.jit.script(m).save('" +
      (dir / "m.pt").string() +
      "')\n"
      "x = torch.randn(8, 1, 28, 28); y = torch.randint(0, 10, (8,))\n"
      "total = 0.0\n"
      "for xs, ys in zip(x.tensor_split(4), y.tensor_split(4)):\n"
      "    loss = nn.functional.cross_entropy(m(xs), ys) * (xs.shape[0] / 8)\n"
      "    loss.backward(); total += loss.item()\n"
      "ref = {'x': x, 'y': y, 'loss': torch.tensor(total)}\n"
      "for name, p in m.named_parameters(): ref['grad.' + name] = p.grad\n"
      "for name, b in m.named_buffers(): ref['buffer.' + name] = b\n"
      "torch.save(ref, '" +
      (dir / "ref.pt").string() + "')\n";
  ASSERT_EQ(runPython(dir, script), 0)
      << "python3-torchvision is needed (scripts/setup installs it)";
  const auto ref = loadTorchSave((dir / "ref.pt").string());
  PipelineOptions options;
  options.devices = cpuDevices(4);
  options.microBatches = 4;
  options.schedule = "1f1b";
  options.checkpoint = CheckpointMode::kAlways;
  Pipeline pipe(loadTorchScript((dir / "m.pt").string()), options);
  const torch::Tensor loss = pipe.trainStep(
      ref.at("x").toTensor(), ref.at("y").toTensor(), crossEntropy);
  EXPECT_LE(relativeError(loss, ref.at("loss").toTensor()), 1e-5);
  size_t buffers = 0;
  for (const auto& layer : pipe.layers()) {
    for (const auto& item : layer.module.ptr()->named_buffers()) {
      const std::string name = layer.name + "." + item.key();
      ASSERT_TRUE(ref.contains("buffer." + name)) << name;
      const torch::Tensor want = ref.at("buffer." + name).toTensor();
      if (name.find("num_batches_tracked") != std::string::npos) {
        EXPECT_EQ(item.value().item<int64_t>(), want.item<int64_t>()) << name;
      } else {
        EXPECT_LE(relativeError(item.value(), want), 1e-4) << name;
      }
      ++buffers;
    }
  }
  EXPECT_EQ(buffers, 60u); // 20 batch norms x (mean, var, count)
  for (const auto& [name, parameter] : pipe.namedParameters()) {
    EXPECT_LE(
        relativeError(parameter.grad(), ref.at("grad." + name).toTensor()),
        1e-3)
        << name;
  }
  fs::remove_all(dir);
}

// Trains a copy of `reference` (whose gradients `expected` already put in
// place) one step under `options`: the same loss and gradients.
void expectSameGradientsAsSequential(
    const torch::nn::Sequential& reference,
    PipelineOptions options,
    const torch::Tensor& x,
    const torch::Tensor& y,
    const torch::Tensor& expected) {
  torch::nn::Sequential piped =
      std::dynamic_pointer_cast<torch::nn::SequentialImpl>(reference->clone());
  for (auto& p : piped->parameters())
    p.mutable_grad() = torch::Tensor();
  Pipeline pipe(layersOf(piped), std::move(options));
  const torch::Tensor loss = pipe.trainStep(x, y, crossEntropy);
  EXPECT_LE(relativeError(loss, expected.detach()), 1e-12);
  const auto want = reference->parameters();
  const auto got = pipe.parameters();
  ASSERT_EQ(want.size(), got.size());
  for (size_t i = 0; i < want.size(); ++i) {
    ASSERT_TRUE(got[i].grad().defined()) << "parameter " << i;
    EXPECT_LE(relativeError(got[i].grad(), want[i].grad()), 1e-12)
        << "parameter " << i;
  }
}

// The split backward on convolutions (the input pass, then the weight pass:
// convolution_backward called directly for numeric zero padding, autograd's
// walk of the layer's graph for "same"): under zb-h1, zb-h2 and zb-v the
// gradients equal the sequential model's for strided, dilated, grouped,
// bias-free and "same"-padded convolutions.
TEST(PipelineTest, ConvolutionWeightPassesEqualAutogradsUnderSplitBackward) {
  torch::manual_seed(12);
  torch::nn::Sequential reference(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 6, 3).padding(1)),
      torch::nn::Tanh(),
      torch::nn::Conv2d(
          torch::nn::Conv2dOptions(6, 6, 3).stride(2).padding(2).dilation(2)),
      torch::nn::ReLU(),
      torch::nn::Conv2d(
          torch::nn::Conv2dOptions(6, 6, 3).groups(3).bias(false).padding(
              torch::kSame)),
      torch::nn::GELU(),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 4, 2)), // "valid"
      torch::nn::Flatten(),
      torch::nn::Linear(4 * 3 * 3, 3));
  reference->to(torch::kDouble);
  const torch::Tensor x = torch::randn({10, 2, 8, 8}, torch::kDouble);
  const torch::Tensor y = torch::randint(0, 3, {10}, torch::kLong);
  const torch::Tensor expected = crossEntropy(reference->forward(x), y);
  expected.backward();
  for (const auto& [schedule, ranks, v] :
       std::vector<std::tuple<std::string, int, int>>{
           {"zb-h1", 3, 1}, {"zb-h2", 2, 1}, {"zb-v", 2, 2}}) {
    SCOPED_TRACE(schedule);
    PipelineOptions options;
    options.devices = cpuDevices(ranks);
    options.virtualStages = v;
    options.microBatches = 4;
    options.schedule = schedule;
    options.checkpoint = CheckpointMode::kNever;
    expectSameGradientsAsSequential(reference, options, x, y, expected);
  }
}

// The weight gradients tpipe computes itself (fused backwards of stages of
// Linear, Conv2d and LayerNorm alone, and every weight pass) equal
// autograd's, with an in-place activation after each product: the gradient
// at a product's output is taken where it arrives at the product's node, not
// at the tensor the activation then changed. With directWeightGradients
// off, autograd computes every fused backward, to the same gradients.
TEST(PipelineTest, DirectWeightGradientsEqualAutogradsAfterInPlaceActivations) {
  torch::manual_seed(21);
  torch::nn::Sequential reference(
      torch::nn::Linear(6, 8),
      torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
      torch::nn::Linear(8, 8),
      torch::nn::LeakyReLU(torch::nn::LeakyReLUOptions().inplace(true)),
      torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})),
      torch::nn::ReLU(torch::nn::ReLUOptions().inplace(true)),
      torch::nn::Linear(8, 8),
      torch::nn::Linear(8, 3));
  reference->to(torch::kDouble);
  // Not its initial ones and zeros: a wrong weight or bias gradient shows.
  for (auto& parameter : reference[4]->parameters())
    parameter.data().uniform_(0.5, 1.5);
  const torch::Tensor x = torch::randn({12, 6}, torch::kDouble);
  const torch::Tensor y = torch::randint(0, 3, {12}, torch::kLong);
  const torch::Tensor expected = crossEntropy(reference->forward(x), y);
  expected.backward();
  for (const auto& [schedule, ranks, v] :
       std::vector<std::tuple<std::string, int, int>>{
           {"gpipe", 1, 1},
           {"1f1b", 2, 1},
           {"interleaved-1f1b", 2, 2},
           {"zb-h1", 2, 1},
           {"zb-v", 2, 2},
           {"dualpipev", 2, 2}}) {
    for (const bool direct : {true, false}) {
      for (const auto mode :
           {CheckpointMode::kNever, CheckpointMode::kAlways}) {
        SCOPED_TRACE(
            schedule + (direct ? " direct " : " autograd ") +
            checkpointModeName(mode));
        PipelineOptions options;
        options.devices = cpuDevices(ranks);
        options.virtualStages = v;
        options.microBatches = 4;
        options.schedule = schedule;
        options.checkpoint = mode;
        options.directWeightGradients = direct;
        expectSameGradientsAsSequential(reference, options, x, y, expected);
      }
    }
  }
}

} // namespace
} // namespace tpipe

// Ranks of one host meet over abstract Unix sockets, whose names any local
// process can find: a connection that cannot present the secret the
// listener published in the rendezvous store is closed, and the ranks'
// own channel carries their tensors.
TEST(PipelineTest, SocketChannelsShutOutAnyoneWithoutTheSecret) {
  using tpipe::runtime::SocketChannels;
  SocketChannels low(0, std::chrono::seconds(10));
  SocketChannels high(1, std::chrono::seconds(10));
  if (high.ticket().empty())
    GTEST_SKIP() << "no abstract Unix sockets here (or TPIPE_P2P=gloo)";
  std::istringstream fields(high.ticket());
  std::string identity, name;
  fields >> identity >> name;
  const int intruder = ::socket(AF_UNIX, SOCK_STREAM, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path + 1, name.data(), name.size());
  const auto length =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  ASSERT_EQ(
      ::connect(intruder, reinterpret_cast<sockaddr*>(&address), length), 0);
  struct {
    int64_t magic, rank;
    char secret[32];
  } hello{0x7470697065736f63, 0, {}}; // claims to be rank 0
  std::memset(hello.secret, 'a', sizeof hello.secret);
  ASSERT_EQ(::send(intruder, &hello, sizeof hello, 0), ssize_t{sizeof hello});
  const std::vector<std::string> tickets{low.ticket(), high.ticket()};
  std::thread lowSide([&] { low.connect(tickets); });
  high.connect(tickets);
  lowSide.join();
  EXPECT_TRUE(high.reaches(0));
  EXPECT_TRUE(low.reaches(1));
  timeval wait{5, 0};
  ::setsockopt(intruder, SOL_SOCKET, SO_RCVTIMEO, &wait, sizeof wait);
  char byte = 0;
  EXPECT_EQ(::recv(intruder, &byte, 1, 0), 0) << "the intruder was not closed";
  ::close(intruder);
  const torch::Tensor sent = torch::arange(6.0).reshape({2, 3});
  low.send(1, 7, {sent});
  const std::vector<torch::Tensor> got = high.receive(0, 7);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_TRUE(got[0].equal(sent));
}

// Where stages and workers go is a value decided from the plan: ZB-V lays
// rank r's two stages in a V, threads follow the plan (or share the cores),
// and in a multi-process run only this process's rank is local.
TEST(PipelineTest, PlacementIsAPlainValueFromThePlan) {
  tpipe::PlanRequest request;
  for (int l = 0; l < 8; ++l)
    request.layers.push_back({"l" + std::to_string(l), 1.0, 2.0, 100});
  request.devices = {{"cpu:0"}, {"cpu:1"}};
  request.schedule = tpipe::ScheduleKind::kZeroBubbleV;
  request.virtualStages = 2;
  request.microBatches = 4;
  const tpipe::Plan plan = tpipe::resolvePlan(request);
  const auto shared =
      tpipe::runtime::placeStages(plan, {"cpu:0", "cpu:1"}, 0, 6);
  EXPECT_EQ(
      tpipe::runtime::describePlacement(shared),
      "rank 0 cpu:0, 3 thread(s): stage 0 (layers 0-1), stage 3 (layers 6-7)\n"
      "rank 1 cpu:1, 3 thread(s): stage 1 (layers 2-3), stage 2 (layers 4-5)\n");
  EXPECT_FALSE(shared.runsOnCaller());
  const auto second =
      tpipe::runtime::placeStages(plan, {"cpu:0", "cpu:1"}, 1, 6, 1);
  EXPECT_EQ(second.localRanks(), std::vector<int>{1});
  EXPECT_TRUE(second.runsOnCaller());
  EXPECT_FALSE(second.stages[0].local);
  EXPECT_TRUE(second.stages[2].local);
  EXPECT_NE(
      tpipe::runtime::describePlacement(second).find(
          "rank 0 cpu:0, 1 thread(s): stage 0 (layers 0-1), stage 3 (layers "
          "6-7), another process"),
      std::string::npos);
}

// A plan's threads reach the workers without being repeated in the
// options; options that contradict them are refused.
TEST(PipelineTest, ThePlansThreadsRunTheStages) {
  int seen = 0;
  auto probe = [&seen](const torch::Tensor& x) {
    seen = at::get_num_threads();
    return x;
  };
  tpipe::LayerList layers;
  layers.push_back({"fc", torch::nn::AnyModule(torch::nn::Linear(4, 4))});
  layers.push_back(
      {"probe", torch::nn::AnyModule(torch::nn::Functional(probe))});
  tpipe::PlanRequest request;
  request.layers = tpipe::parameterCosts(layers);
  request.devices = {{"cpu:0"}};
  request.threadsPerDevice = 1;
  auto plan = std::make_shared<const tpipe::Plan>(tpipe::resolvePlan(request));
  tpipe::PipelineOptions options;
  options.plan = plan;
  {
    tpipe::Pipeline pipe(layers, options);
    pipe.forward(torch::ones({2, 4}));
    EXPECT_EQ(seen, 1);
  }
  options.threadsPerDevice = 2;
  EXPECT_THROW(tpipe::Pipeline(layers, options), c10::Error);
}

// The calling thread of stages on workers only splits batches and waits:
// it is left with one intra-op thread, so that no OpenMP team of its own
// spins on the stages' cores, whatever it ran before. A stage run on the
// caller keeps its plan's threads.
TEST(PipelineTest, ACallerOfStageWorkersKeepsNoThreadTeam) {
  const int before = at::get_num_threads();
  tpipe::LayerList layers;
  for (int i = 0; i < 2; ++i)
    layers.push_back(
        {"fc" + std::to_string(i),
         torch::nn::AnyModule(torch::nn::Linear(4, 4))});
  const torch::Tensor x = torch::randn({8, 4}), y = torch::randn({8, 4});
  auto loss = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::mse_loss(out, target);
  };
  tpipe::PipelineOptions options;
  options.devices = tpipe::cpuDevices(2);
  options.microBatches = 2;
  options.partition = tpipe::PartitionMethod::kBalance;
  options.balance = {1, 1};
  {
    tpipe::Pipeline pipe(layers, options);
    at::set_num_threads(2);
    pipe.trainStep(x, y, loss);
    EXPECT_EQ(at::get_num_threads(), 1) << "trainStep";
    at::set_num_threads(2);
    tpipe::Pipeline::Update update;
    update.apply = [](int) {};
    pipe.postStep(x, y, loss, update);
    pipe.finishStep();
    EXPECT_EQ(at::get_num_threads(), 1) << "postStep";
  }
  options.devices = tpipe::cpuDevices(1);
  options.balance = {2};
  options.threadsPerDevice = 2;
  {
    tpipe::Pipeline pipe(layers, options);
    at::set_num_threads(1);
    pipe.trainStep(x, y, loss);
    EXPECT_EQ(at::get_num_threads(), 2) << "one stage, on the caller";
  }
  at::set_num_threads(before);
}

namespace tpipe {
namespace {

// Each rank's SGD (momentum) over its own parameters, and a deep copy of its
// state for a speculative update.
struct RankOptimizers {
  std::vector<std::unique_ptr<torch::optim::SGD>> perRank;
  RankOptimizers(Pipeline& pipe, double lr) : perRank(pipe.schedule().ranks) {
    for (int rank : pipe.localRanks()) {
      perRank[rank] = std::make_unique<torch::optim::SGD>(
          pipe.rankParameters(rank),
          torch::optim::SGDOptions(lr).momentum(0.9));
    }
  }
  Pipeline::Update update(bool checkGradients, double clip) {
    Pipeline::Update u;
    u.apply = [this](int rank) { perRank[rank]->step(); };
    u.saveState = [this](int rank) -> std::function<void()> {
      auto& state = perRank[rank]->state();
      auto saved = std::make_shared<std::map<std::string, torch::Tensor>>();
      for (auto& entry : state) {
        auto& sgd = static_cast<torch::optim::SGDParamState&>(*entry.second);
        (*saved)[entry.first] = sgd.momentum_buffer().clone();
      }
      return [&state, saved] {
        for (auto it = state.begin(); it != state.end();) {
          auto found = saved->find(it->first);
          if (found == saved->end()) {
            it = state.erase(it);
            continue;
          }
          static_cast<torch::optim::SGDParamState&>(*it->second)
              .momentum_buffer(found->second);
          ++it;
        }
      };
    };
    u.checkGradients = checkGradients;
    u.clipGradNorm = clip;
    return u;
  }
};

// One model trained with a barrier (trainStep, one SGD) beside its twin
// trained by posted steps (one SGD per rank), from the same options.
struct PostedBesideSynchronous {
  Pipeline sync, posted;
  torch::optim::SGD syncOptimizer;
  RankOptimizers rankOptimizers;
  PostedBesideSynchronous(
      torch::nn::Sequential& syncNet,
      torch::nn::Sequential& postedNet,
      const PipelineOptions& options)
      : sync(layersOf(syncNet), options),
        posted(layersOf(postedNet), options),
        syncOptimizer(
            sync.parameters(),
            torch::optim::SGDOptions(0.3).momentum(0.9)),
        rankOptimizers(posted, 0.3) {}
};

// Steps posted back to back, each rank updating as soon as its part ends
// (optimizer post-validation), train bit for bit as synchronous steps with
// one optimizer do: the losses, the skipped non-finite step, a clip that
// binds on the whole model only (each rank speculates wrongly, and the next
// step runs again), one that binds on a rank's own part (it waits), and
// dropout and batch-norm state through the runs done again.
TEST(PipelineTest, PostedStepsTrainAsSynchronousSteps) {
  struct Mode {
    const char* name;
    bool checks;
    double clipFactor; // of the first step's norm; 0: no clip
    bool expectRedo;
    bool everyOtherStep = false; // checks on even steps only
  };
  const Mode modes[] = {
      {"loss check only", false, 0.0, false},
      {"skip non-finite", true, 0.0, false},
      {"clip binding on the whole model", true, 0.9, true},
      {"clip binding on every rank", true, 0.05, false},
      // A step without checks behind one that speculated wrongly runs
      // again too, and so does the one behind it.
      {"clip on every other step", true, 0.9, true, true},
  };
  struct Layout {
    const char* schedule;
    int ranks, virtualStages;
    bool batchNorm;
  };
  const Layout layouts[] = {
      {"zb-h2", 3, 1, false},
      {"1f1b", 2, 1, true},
      {"zb-v", 2, 2, false},
  };
  const int steps = 6;
  for (const auto& layout : layouts) {
    for (const auto& mode : modes) {
      SCOPED_TRACE(std::string(layout.schedule) + ", " + mode.name);
      auto checksAt = [&](int k) {
        return mode.checks && (!mode.everyOtherStep || k % 2 == 0);
      };
      // Batch norm keeps a poisoned batch's statistics for good: its runs
      // compare the statistics instead.
      const int poisoned = layout.batchNorm ? -1 : 3;
      auto makeModel = [&] {
        return layout.batchNorm ? batchNormNet(torch::kFloat, 21)
                                : makeNet(torch::kFloat, 21, 0.2);
      };
      torch::nn::Sequential syncNet = makeModel(), postedNet = makeModel();
      PipelineOptions options;
      options.devices = cpuDevices(layout.ranks);
      options.virtualStages = layout.virtualStages;
      options.microBatches = 4;
      options.schedule = layout.schedule;
      options.checkpoint = CheckpointMode::kExceptLast;
      options.seed = 5;
      PostedBesideSynchronous pair(syncNet, postedNet, options);
      ASSERT_TRUE(pair.posted.canOverlapSteps());

      torch::manual_seed(22);
      std::vector<torch::Tensor> xs, ys;
      for (int k = 0; k < steps; ++k) {
        xs.push_back(
            layout.batchNorm ? torch::randn({8, 1, 5, 5})
                             : torch::randn({8, 6}));
        // Without checks only a non-finite loss skips (NaN reaches it);
        // with them, an infinite input makes the first stage's gradients
        // non-finite under a finite loss (the MLP's tanh), which ranks
        // that end earlier cannot know.
        if (k == poisoned) {
          xs.back().view(-1)[3] = checksAt(k)
              ? std::numeric_limits<float>::infinity()
              : std::numeric_limits<float>::quiet_NaN();
        }
        ys.push_back(torch::randint(0, 3, {8}, torch::kLong));
      }
      double clip = 0.0;
      if (mode.clipFactor > 0.0) {
        torch::nn::Sequential probeNet = makeModel();
        Pipeline probe(layersOf(probeNet), options);
        probe.trainStep(xs[0], ys[0], crossEntropy);
        clip = mode.clipFactor * probe.clipGradNorm().norm;
      }

      auto updateAt = [&](int k) {
        return pair.rankOptimizers.update(
            checksAt(k), checksAt(k) ? clip : 0.0);
      };
      pair.posted.postStep(xs[0], ys[0], crossEntropy, updateAt(0));
      int redone = 0;
      for (int k = 0; k < steps; ++k) {
        if (k + 1 < steps)
          pair.posted.postStep(
              xs[k + 1], ys[k + 1], crossEntropy, updateAt(k + 1));
        const Pipeline::StepOutcome outcome = pair.posted.finishStep();
        redone += outcome.redone ? 1 : 0;

        pair.syncOptimizer.zero_grad();
        const torch::Tensor loss =
            pair.sync.trainStep(xs[k], ys[k], crossEntropy);
        Pipeline::GradientNorm norm;
        if (checksAt(k))
          norm = pair.sync.clipGradNorm(clip);
        const bool finite =
            std::isfinite(loss.item<double>()) && norm.nonFiniteStage < 0;
        if (finite)
          pair.syncOptimizer.step();

        EXPECT_EQ(outcome.updated, finite) << "step " << k;
        EXPECT_EQ(outcome.updated, k != poisoned) << "step " << k;
        if (finite) {
          EXPECT_TRUE(torch::equal(outcome.loss, loss)) << "step " << k;
        }
        if (checksAt(k) && finite) {
          EXPECT_EQ(outcome.norm.norm, norm.norm) << "step " << k;
        }
      }
      EXPECT_EQ(pair.posted.stepsInFlight(), 0);
      if (mode.expectRedo) {
        EXPECT_GT(redone, 0)
            << "no speculation was wrong: the clip never bound";
      }
      if (!mode.checks) {
        EXPECT_EQ(redone, 0) << "nothing speculates without checks";
      }
      auto same = [](const torch::Tensor& a, const torch::Tensor& b) {
        return torch::allclose(a, b, 0.0, 0.0, /*equal_nan=*/true);
      };
      const auto want = syncNet->named_parameters();
      const auto got = postedNet->named_parameters();
      for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_TRUE(same(got[i].value(), want[i].value()))
            << want[i].key() << " differs by "
            << (got[i].value() - want[i].value()).abs().max().item<float>();
      }
      const auto wantBuffers = syncNet->named_buffers();
      const auto gotBuffers = postedNet->named_buffers();
      for (size_t i = 0; i < wantBuffers.size(); ++i) {
        EXPECT_TRUE(same(gotBuffers[i].value(), wantBuffers[i].value()))
            << wantBuffers[i].key();
      }
    }
  }
}

// Tied copies on different ranks: where the parts holding them end, the
// last sums their gradients for all, each rank steps its own copy, and the
// steps train bit for bit as synchronous ones, clip and reruns included,
// with the copies equal. One tensor on two ranks keeps the barrier: both
// ranks' updates would step it.
TEST(PipelineTest, PostedStepsWithTiedCopiesTrainAsSynchronousSteps) {
  struct Case {
    const char* schedule;
    int ranks, virtualStages;
    double clipFactor; // of the first step's norm; 0: no clip
  };
  for (const Case& c :
       {Case{"zb-h2", 3, 1, 0.0},
        Case{"zb-h2", 3, 1, 0.9},
        Case{"1f1b", 2, 1, 0.9},
        Case{"zb-v", 2, 2, 0.9},
        Case{"dualpipe", 2, 1, 0.9}}) {
    SCOPED_TRACE(
        std::string(c.schedule) + " clip x" + std::to_string(c.clipFactor));
    auto makeModel = [] {
      torch::nn::Sequential net = tiedTrunk(6);
      net->push_back(torch::nn::Linear(
          torch::nn::LinearOptions(kDim, kVocab).bias(false)));
      return net;
    };
    torch::nn::Sequential syncNet = makeModel(), postedNet = makeModel();
    PipelineOptions options;
    options.devices = cpuDevices(c.ranks);
    options.virtualStages = c.virtualStages;
    options.microBatches = 4;
    options.schedule = c.schedule;
    options.checkpoint = CheckpointMode::kNever;
    options.tiedParameters = {{"0.weight", "5.weight"}};
    PostedBesideSynchronous pair(syncNet, postedNet, options);
    ASSERT_TRUE(pair.posted.canOverlapSteps());

    torch::manual_seed(23);
    const int steps = 6;
    std::vector<torch::Tensor> xs, ys;
    for (int k = 0; k < steps; ++k) {
      xs.push_back(torch::randint(0, kVocab, {8, 3}));
      ys.push_back(torch::randint(0, kVocab, {8, 3}));
    }
    const bool checks = c.clipFactor > 0.0;
    double clip = 0.0;
    if (checks) {
      torch::nn::Sequential probeNet = makeModel();
      Pipeline probe(layersOf(probeNet), options);
      probe.trainStep(xs[0], ys[0], tokenLoss);
      clip = c.clipFactor * probe.clipGradNorm().norm;
    }
    pair.posted.postStep(
        xs[0], ys[0], tokenLoss, pair.rankOptimizers.update(checks, clip));
    int redone = 0;
    for (int k = 0; k < steps; ++k) {
      if (k + 1 < steps) {
        pair.posted.postStep(
            xs[k + 1],
            ys[k + 1],
            tokenLoss,
            pair.rankOptimizers.update(checks, clip));
      }
      const Pipeline::StepOutcome outcome = pair.posted.finishStep();
      redone += outcome.redone ? 1 : 0;
      pair.syncOptimizer.zero_grad();
      const torch::Tensor loss = pair.sync.trainStep(xs[k], ys[k], tokenLoss);
      Pipeline::GradientNorm norm;
      if (checks)
        norm = pair.sync.clipGradNorm(clip);
      pair.syncOptimizer.step();
      EXPECT_TRUE(outcome.updated) << "step " << k;
      EXPECT_TRUE(torch::equal(outcome.loss, loss)) << "step " << k;
      if (checks) {
        EXPECT_EQ(outcome.norm.norm, norm.norm) << "step " << k;
      }
    }
    if (checks) {
      EXPECT_GT(redone, 0) << "no speculation was wrong: the clip never bound";
    }
    const auto want = syncNet->named_parameters();
    const auto got = postedNet->named_parameters();
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_TRUE(torch::equal(got[i].value(), want[i].value()))
          << want[i].key();
    }
    EXPECT_TRUE(torch::equal(
        postedNet[0]->as<torch::nn::Embedding>()->weight,
        postedNet[5]->as<torch::nn::Linear>()->weight));
  }
  torch::nn::Sequential shared = tiedTrunk(7);
  shared->push_back(TiedHead(shared[0]->as<torch::nn::Embedding>()->weight));
  PipelineOptions options;
  options.devices = cpuDevices(2);
  options.microBatches = 2;
  options.schedule = "1f1b";
  Pipeline oneTensor(layersOf(shared), options);
  EXPECT_FALSE(oneTensor.canOverlapSteps());
}

TEST(PipelineTest, PostedStepsRefuseWhatTheyCannotRun) {
  torch::nn::Sequential net = makeNet(torch::kFloat, 1);
  PipelineOptions options;
  options.devices = cpuDevices(1);
  Pipeline one(layersOf(net), options);
  EXPECT_FALSE(one.canOverlapSteps()); // one device runs on the caller
  options.devices = cpuDevices(2);
  options.microBatches = 2;
  torch::nn::Sequential net2 = makeNet(torch::kFloat, 1);
  Pipeline two(layersOf(net2), options);
  EXPECT_THROW(two.finishStep(), c10::Error);
  RankOptimizers optimizers(two, 0.1);
  const torch::Tensor x = torch::randn({4, 6});
  const torch::Tensor y = torch::randint(0, 3, {4}, torch::kLong);
  two.postStep(x, y, crossEntropy, optimizers.update(false, 0.0));
  EXPECT_EQ(two.stepsInFlight(), 1);
  try {
    two.trainStep(x, y, crossEntropy);
    ADD_FAILURE() << "a synchronous step ran beside a posted one";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find("posted"), std::string::npos);
  }
  two.finishStep();
  // A failing step names its stage, and the pipeline recovers.
  const torch::Tensor bad = torch::randn({4, 7});
  two.postStep(bad, y, crossEntropy, optimizers.update(false, 0.0));
  two.postStep(x, y, crossEntropy, optimizers.update(false, 0.0));
  try {
    two.finishStep();
    ADD_FAILURE() << "a step with the wrong input width finished";
  } catch (const c10::Error& error) {
    EXPECT_NE(std::string(error.what()).find("stage 0"), std::string::npos)
        << error.what();
  }
  EXPECT_EQ(two.stepsInFlight(), 0);
  two.postStep(x, y, crossEntropy, optimizers.update(false, 0.0));
  EXPECT_TRUE(two.finishStep().updated);
}

// `tpipe launch` runs each rank in a fork of the launcher, where LibTorch is
// loaded already, while the launcher runs one thread; beside other threads
// a fork could inherit a lock one of them held, so the executable is run
// anew. Each launch runs in a forked child of this test: a process of one
// thread, whatever threads earlier tests left behind.
TEST(LaunchTest, RanksRunInTheLaunchersForkOnlyWhileItRunsOneThread) {
  const std::filesystem::path dir =
      std::filesystem::path(::testing::TempDir()) / "tpipe-launch-fork";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto launch = [&](bool besideAThread) {
    const pid_t child = ::fork();
    if (child == 0) {
      std::atomic<bool> done{false};
      std::thread other;
      if (besideAThread) {
        other = std::thread([&] {
          while (!done)
            ::usleep(1000);
        });
      }
      // /bin/true stands for the executable: it ignores the words and
      // succeeds, and it leaves no mark.
      const LaunchOutcome outcome = launchAttempt(
          "/bin/true", 2, {"--word"}, {}, [&](int argc, char** argv) {
            const std::string rank = std::getenv("RANK");
            std::ofstream mark(dir / ("rank-" + rank));
            mark << argc;
            for (int k = 1; k < argc; ++k)
              mark << " " << argv[k];
            return rank == "1" ? 3 : 0;
          });
      done = true;
      if (other.joinable())
        other.join();
      ::_exit(outcome.status * 10 + outcome.failedRank + 1);
    }
    int status = 0;
    ::waitpid(child, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  auto marks = [&] {
    std::vector<std::string> found;
    for (const char* rank : {"rank-0", "rank-1"}) {
      std::ifstream in(dir / rank);
      std::string text;
      std::getline(in, text);
      found.push_back(text);
    }
    return found;
  };
  // Forked: each rank runs the given code with its words, and rank 1's
  // status is the launch's, rank 1 the failed one.
  EXPECT_EQ(launch(false), 3 * 10 + 1 + 1);
  EXPECT_EQ(
      marks(), (std::vector<std::string>{"3 train --word", "3 train --word"}));
  std::filesystem::remove(dir / "rank-0");
  std::filesystem::remove(dir / "rank-1");
  // Beside a thread: /bin/true runs, no rank code, and all succeed.
  EXPECT_EQ(launch(true), 0);
  EXPECT_EQ(marks(), (std::vector<std::string>{"", ""}));
  std::filesystem::remove_all(dir);
}

// A signal that lands while a store call waits for its answer does not end
// the call: a launched rank is sent SIGTERM when another rank fails, at the
// moment it posts its account of the failure in the store.
TEST(StoreTest, ACallGoesOnThroughASignal) {
  struct sigaction ignore {
  }, previous{};
  ignore.sa_handler = [](int) {}; // no SA_RESTART: poll returns EINTR
  ASSERT_EQ(::sigaction(SIGUSR1, &ignore, &previous), 0);
  const int port = runtime::freeLoopbackPort();
  const auto timeout = std::chrono::seconds(20);
  const auto server =
      runtime::startStoreServer("127.0.0.1", port, "secret", timeout);
  runtime::RendezvousStore waiter("127.0.0.1", port, 0, "secret", timeout);
  runtime::RendezvousStore setter("127.0.0.1", port, 1, "secret", timeout);
  std::atomic<bool> waiting{false};
  const pthread_t main = ::pthread_self();
  std::thread other([&] {
    while (!waiting)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    for (int k = 0; k < 20; ++k) {
      ::pthread_kill(main, SIGUSR1);
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    setter.set("key", {7});
  });
  waiting = true;
  EXPECT_NO_THROW(waiter.wait({"key"}));
  other.join();
  EXPECT_EQ(waiter.get("key"), std::vector<uint8_t>{7});
  ::sigaction(SIGUSR1, &previous, nullptr);
}

} // namespace
} // namespace tpipe
