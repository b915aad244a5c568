// Transparency on a GPU: stages on cuda:0 (several sharing the one GPU, each
// on its own streams), fp32 and bf16. Skipped, with the reason, without one.
#include <gtest/gtest.h>

#include <torch/torch.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "support/skip_net.h"
#include "tpipe/pipeline.h"

namespace tpipe {
namespace cuda_test {

#define REQUIRE_GPU()                                                   \
  if (!torch::cuda::is_available()) {                                   \
    GTEST_SKIP() << "no CUDA device (this LibTorch: "                   \
                 << (torch::cuda::device_count() ? "CUDA" : "CPU only") \
                 << ")";                                                \
  }

torch::nn::Sequential makeNet(torch::Dtype dtype, double dropout = 0.0) {
  torch::manual_seed(0);
  torch::nn::Sequential net(
      torch::nn::Linear(32, 64),
      torch::nn::GELU(),
      torch::nn::Dropout(dropout),
      torch::nn::Linear(64, 64),
      torch::nn::Tanh(),
      torch::nn::Linear(64, 48),
      torch::nn::ReLU(),
      torch::nn::Linear(48, 10));
  net->to(torch::Device("cuda:0"), dtype);
  return net;
}

torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out.to(torch::kFloat), y);
}

double relativeError(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kDouble) - b.to(torch::kDouble)).norm().item<double>() /
      std::max(b.to(torch::kDouble).norm().item<double>(), 1e-30);
}

// Returns how many overlapped forward-and-backward pairs the schedule has.
int expectTransparent(
    const std::vector<std::string>& devices,
    const std::string& schedule,
    CheckpointMode mode,
    torch::Dtype dtype,
    double tolerance) {
  SCOPED_TRACE(
      schedule + " on " + std::to_string(devices.size()) + " rank(s), " +
      checkpointModeName(mode));
  torch::nn::Sequential reference = makeNet(dtype);
  torch::nn::Sequential piped = makeNet(dtype);
  torch::manual_seed(1);
  const auto options = torch::TensorOptions().device(torch::Device("cuda:0"));
  torch::Tensor x = torch::randn({13, 32}, options.dtype(dtype));
  torch::Tensor y = torch::randint(0, 10, {13}, options.dtype(torch::kLong));
  PipelineOptions pipeOptions;
  pipeOptions.devices = devices;
  pipeOptions.microBatches = 4;
  pipeOptions.schedule = schedule;
  pipeOptions.checkpoint = mode;
  Pipeline pipe(layersOf(piped), pipeOptions);
  int pairs = 0;
  for (const auto& list : pipe.schedule().perRank) {
    for (const auto& instruction : list) {
      const auto* forward = std::get_if<Forward>(&instruction);
      pairs += forward && forward->overlapsBackward;
    }
  }
  torch::Tensor expected = loss(reference->forward(x), y);
  expected.backward();
  torch::Tensor got = pipe.trainStep(x, y, loss);
  torch::cuda::synchronize();
  EXPECT_LE(relativeError(got, expected.detach()), tolerance);
  auto want = reference->parameters();
  auto have = pipe.parameters();
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(have[i].is_cuda());
    if (!have[i].grad().defined()) {
      ADD_FAILURE() << "parameter " << i << " has no gradient";
      continue;
    }
    EXPECT_LE(relativeError(have[i].grad(), want[i].grad()), tolerance)
        << "parameter " << i;
  }
  return pairs;
}

TEST(CudaTest, TransparentOnOneGpuStage) {
  REQUIRE_GPU();
  expectTransparent(
      {"cuda:0"}, "gpipe", CheckpointMode::kExceptLast, torch::kFloat, 1e-5);
}

TEST(CudaTest, SeveralStagesShareTheGpuOnTheirOwnStreams) {
  REQUIRE_GPU();
  const std::vector<std::string> four(4, "cuda:0");
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1"}) {
    for (auto mode : {CheckpointMode::kNever, CheckpointMode::kAlways}) {
      expectTransparent(four, schedule, mode, torch::kFloat, 1e-5);
    }
  }
}

// DualPipeV's and DualPipe's overlapped pairs: the forward runs on a stream
// of its own beside the backward on the compute stream, and every result
// still equals the sequential model's.
TEST(CudaTest, OverlappedPairsOnTwoStreamsAreTransparent) {
  REQUIRE_GPU();
  const std::vector<std::string> two(2, "cuda:0");
  for (const char* schedule : {"dualpipev", "dualpipe"}) {
    for (auto mode : {CheckpointMode::kNever, CheckpointMode::kExceptLast}) {
      EXPECT_GT(expectTransparent(two, schedule, mode, torch::kFloat, 1e-5), 0)
          << schedule << " has no overlapped pair to check";
    }
  }
}

TEST(CudaTest, TransparentInBfloat16) {
  REQUIRE_GPU();
  expectTransparent(
      std::vector<std::string>(3, "cuda:0"),
      "1f1b",
      CheckpointMode::kExceptLast,
      torch::kBFloat16,
      3e-2);
}

// Skips of every kind (support/skip_net.h) crossing stages that share the
// GPU, one passing a whole stage by: loss and gradients equal the
// sequential model's (tpipe::runSequential) on the GPU.
TEST(CudaTest, SkipConnectionsAcrossStagesAreTransparent) {
  REQUIRE_GPU();
  const torch::Device gpu("cuda:0");
  const auto on = torch::TensorOptions().device(gpu);
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({13, 6}, on);
  const torch::Tensor y = torch::randint(0, 3, {13}, on.dtype(torch::kLong));
  const LayerList reference = testing::skipNet(5, torch::kFloat, gpu);
  const torch::Tensor expected = loss(runSequential(reference, x), y);
  expected.backward();
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1"}) {
    for (auto mode : {CheckpointMode::kNever, CheckpointMode::kAlways}) {
      SCOPED_TRACE(std::string(schedule) + " " + checkpointModeName(mode));
      const LayerList layers = testing::skipNet(5, torch::kFloat, gpu);
      PipelineOptions options;
      options.devices = std::vector<std::string>(3, "cuda:0");
      options.microBatches = 4;
      options.schedule = schedule;
      options.checkpoint = mode;
      Pipeline pipe(layers, options);
      const torch::Tensor got = pipe.trainStep(x, y, loss);
      torch::cuda::synchronize();
      EXPECT_LE(relativeError(got, expected.detach()), 1e-5);
      const auto want = testing::parametersOf(reference);
      const auto have = testing::parametersOf(layers);
      ASSERT_EQ(want.size(), have.size());
      for (size_t i = 0; i < want.size(); ++i) {
        ASSERT_TRUE(have[i].grad().defined()) << "parameter " << i;
        EXPECT_LE(relativeError(have[i].grad(), want[i].grad()), 1e-5)
            << "parameter " << i;
      }
    }
  }
}

// A head that uses another module's weight (the token embedding's).
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

torch::nn::Sequential tiedTrunk() {
  torch::manual_seed(7);
  torch::nn::Sequential trunk(
      torch::nn::Embedding(64, 32),
      torch::nn::Linear(32, 32),
      torch::nn::Tanh(),
      torch::nn::Linear(32, 32));
  trunk->to(torch::Device("cuda:0"));
  return trunk;
}

torch::Tensor tokenLoss(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(
      out.reshape({-1, 64}), y.reshape({-1}));
}

// An embedding on stage 0 tied to the head on the last stage, as a declared
// tie (each stage its own copy, as GPUs need): the copies' gradients equal
// the shared tensor's in the sequential tied model, and stay equal after an
// optimizer step.
TEST(CudaTest, TiedWeightsAcrossStagesAreTransparent) {
  REQUIRE_GPU();
  const auto on = torch::TensorOptions().device(torch::Device("cuda:0"));
  torch::manual_seed(9);
  const torch::Tensor x = torch::randint(0, 64, {6, 5}, on.dtype(torch::kLong));
  const torch::Tensor y = torch::randint(0, 64, {6, 5}, on.dtype(torch::kLong));
  torch::nn::Sequential reference = tiedTrunk();
  const torch::Tensor shared = reference[0]->as<torch::nn::Embedding>()->weight;
  reference->push_back(TiedHead(shared));
  tokenLoss(reference->forward(x), y).backward();
  for (auto mode : {CheckpointMode::kNever, CheckpointMode::kAlways}) {
    SCOPED_TRACE(checkpointModeName(mode));
    torch::nn::Sequential piped = tiedTrunk();
    torch::nn::Linear head(torch::nn::LinearOptions(32, 64).bias(false));
    head->to(torch::Device("cuda:0"));
    piped->push_back(head);
    PipelineOptions options;
    options.devices = std::vector<std::string>(2, "cuda:0");
    options.microBatches = 2;
    options.schedule = "1f1b";
    options.checkpoint = mode;
    options.tiedParameters = {{"0.weight", "4.weight"}};
    Pipeline pipe(layersOf(piped), options);
    const torch::Tensor embedding =
        piped[0]->as<torch::nn::Embedding>()->weight;
    EXPECT_TRUE(torch::equal(head->weight, shared));
    const torch::Tensor got = pipe.trainStep(x, y, tokenLoss);
    torch::cuda::synchronize();
    EXPECT_LE(
        relativeError(got, tokenLoss(reference->forward(x), y).detach()), 1e-5);
    EXPECT_LE(relativeError(embedding.grad(), shared.grad()), 1e-5);
    EXPECT_TRUE(torch::equal(embedding.grad(), head->weight.grad()));
    torch::optim::Adam adam(pipe.parameters(), 0.01);
    adam.step();
    EXPECT_TRUE(torch::equal(embedding, head->weight));
  }
}

TEST(CudaTest, DropoutMasksReplayOnTheGpu) {
  REQUIRE_GPU();
  auto grads = [](CheckpointMode mode) {
    torch::nn::Sequential net = makeNet(torch::kFloat, 0.5);
    PipelineOptions options;
    options.devices = std::vector<std::string>(2, "cuda:0");
    options.microBatches = 4;
    options.checkpoint = mode;
    Pipeline pipe(layersOf(net), options);
    torch::manual_seed(3);
    const auto on = torch::TensorOptions().device(torch::Device("cuda:0"));
    pipe.trainStep(
        torch::randn({16, 32}, on),
        torch::randint(0, 10, {16}, on.dtype(torch::kLong)),
        loss);
    std::vector<torch::Tensor> out;
    for (const auto& p : pipe.parameters())
      out.push_back(p.grad().cpu());
    return out;
  };
  const auto kept = grads(CheckpointMode::kNever);
  const auto remat = grads(CheckpointMode::kAlways);
  for (size_t i = 0; i < kept.size(); ++i)
    EXPECT_TRUE(torch::equal(kept[i], remat[i])) << "parameter " << i;
}

TEST(CudaTest, MemoryComesFromTheCachingAllocator) {
  REQUIRE_GPU();
  torch::nn::Sequential net = makeNet(torch::kFloat);
  PipelineOptions options;
  options.devices = {"cuda:0"};
  options.trackMemory = true;
  Pipeline pipe(layersOf(net), options);
  pipe.resetPeakMemory();
  const auto on = torch::TensorOptions().device(torch::Device("cuda:0"));
  pipe.trainStep(
      torch::randn({64, 32}, on),
      torch::randint(0, 10, {64}, on.dtype(torch::kLong)),
      loss);
  const auto memory = pipe.memory();
  ASSERT_EQ(memory.size(), 1u);
#ifdef TPIPE_USE_CUDA
  EXPECT_GT(memory[0].peakBytes, 64 * 64 * 4);
#endif
}

// Runs a command through the shell; its output and exit status.
std::pair<std::string, int> shell(const std::string& command) {
  std::string output;
  FILE* pipe = ::popen((command + " 2>&1").c_str(), "r");
  char buffer[4096];
  while (pipe && std::fgets(buffer, sizeof buffer, pipe))
    output += buffer;
  const int status = pipe ? ::pclose(pipe) : -1;
  return {output, WIFEXITED(status) ? WEXITSTATUS(status) : -1};
}

std::vector<double> lossesIn(const std::string& file) {
  std::vector<double> losses;
  std::ifstream in(file);
  std::string line;
  while (std::getline(in, line)) {
    const auto at = line.find("\"loss\":");
    if (at != std::string::npos)
      losses.push_back(std::stod(line.substr(at + 7)));
  }
  return losses;
}

// `tpipe launch --nproc 2` on `devices` against `tpipe train` (one process)
// on the same devices: equal losses, and the start line naming how
// transfers go (`transfers`). The model has a skip across the boundary.
void expectProcessesMatchOneProcess(
    const std::string& devices,
    const std::string& transfers) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::temp_directory_path() / ("tpipe-cuda-" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string binary =
      (fs::read_symlink("/proc/self/exe").parent_path() / "tpipe").string();
  const std::string config = (dir / "config.json").string();
  std::ofstream(config) << R"({
    "model": {"input_shape": [24], "layers": [
      {"type": "linear", "out_features": 32, "stash": "s"}, {"type": "tanh"},
      {"type": "linear", "out_features": 32}, {"type": "relu", "pop": "s"},
      {"type": "linear", "out_features": 5}]},
    "data": {"dataset": "synthetic", "samples": 512},
    "pipeline": {"devices": )"
                        << devices << R"(, "micro_batches": 4,
                 "schedule": "1f1b", "balance": [2, 3]},
    "train": {"batch_size": 32, "steps": 8, "seed": 4,
              "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9}}
  })";
  const std::string threaded = (dir / "threaded.jsonl").string();
  const std::string two = (dir / "two.jsonl").string();
  const auto one =
      shell(binary + " train " + config + " --metrics " + threaded);
  ASSERT_EQ(one.second, 0) << one.first;
  const auto launched =
      shell(binary + " launch --nproc 2 " + config + " --metrics " + two);
  ASSERT_EQ(launched.second, 0) << launched.first;
  EXPECT_NE(launched.first.find(transfers), std::string::npos)
      << launched.first;
  const auto a = lossesIn(threaded), b = lossesIn(two);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_FALSE(a.empty());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_NEAR(a[i], b[i], 1e-5) << "step " << i + 1;
  fs::remove_all(dir);
}

// Two processes sharing the one GPU: NCCL cannot pair a GPU with itself,
// so activations and gradients are staged through host memory over Gloo.
TEST(CudaTest, TwoProcessesOnOneGpuStageThroughHostMemory) {
  REQUIRE_GPU();
  expectProcessesMatchOneProcess(
      R"(["cuda:0", "cuda:0"])", "transfers over Gloo through host memory");
}

// Two processes, one GPU each, joined by NCCL: activations, gradients and
// the skip never leave the GPUs. Needs two GPUs.
TEST(CudaTest, TwoProcessesOverNcclMatchOneProcess) {
  REQUIRE_GPU();
  if (torch::cuda::device_count() < 2)
    GTEST_SKIP() << "needs two GPUs (NCCL refuses two ranks on one GPU)";
#ifndef TPIPE_USE_NCCL_TEST
  GTEST_SKIP() << "this tpipe was built without NCCL (TPIPE_USE_NCCL=OFF)";
#endif
  expectProcessesMatchOneProcess(
      R"(["cuda:0", "cuda:1"])", "transfers over NCCL from cuda:");
}

} // namespace cuda_test
} // namespace tpipe
