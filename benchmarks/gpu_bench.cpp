// GPU benchmark for the lent H200: a GPT-style transformer stack on cuda:0,
// unpartitioned LibTorch against tpipe pipelines whose ranks share the GPU
// on their own streams; fp32 and bf16. Prints a table; writes JSON to
// argv[1]. Skips (exit 0, saying so) without a GPU.
#include <chrono>
#include <cstdio>
#include <fstream>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "tpipe/trainer.h"

namespace {

using Clock = std::chrono::steady_clock;

constexpr int64_t kBatch = 16, kTime = 512, kDim = 1024, kHeads = 16,
                  kBlocks = 8, kVocab = 1024;

tpipe::BuiltModel transformer(torch::Dtype dtype) {
  nlohmann::json layers = nlohmann::json::array();
  for (int b = 0; b < kBlocks; ++b)
    layers.push_back({{"type", "transformer_block"}, {"heads", kHeads}});
  layers.push_back({{"type", "layernorm"}});
  layers.push_back({{"type", "linear"}, {"out_features", kVocab}});
  nlohmann::json config = {
      {"model", {{"input_shape", {kTime, kDim}}, {"layers", layers}}},
      {"data", {{"dataset", "synthetic"}}},
      {"pipeline", {{"devices", {"cuda:0"}}}},
      {"train", {{"batch_size", kBatch}}}};
  tpipe::BuiltModel built =
      tpipe::buildModel(tpipe::parseConfig(config).model, 0);
  for (auto& layer : built.layers)
    layer.module.ptr()->to(torch::Device("cuda:0"), dtype);
  return built;
}

double flopsPerStep() {
  const double tokens = static_cast<double>(kBatch) * kTime;
  const double perBlock =
      24.0 * kDim * kDim + 4.0 * kTime * kDim; // per token, forward
  const double forward = tokens * (kBlocks * perBlock + 2.0 * kDim * kVocab);
  return 3.0 * forward; // backward is about twice the forward
}

torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(
      out.reshape({-1, out.size(-1)}).to(torch::kFloat), y.reshape({-1}));
}

double timeSteps(const std::function<void()>& step, int warmup, int steps) {
  for (int s = 0; s < warmup; ++s)
    step();
  torch::cuda::synchronize();
  const auto start = Clock::now();
  for (int s = 0; s < steps; ++s)
    step();
  torch::cuda::synchronize();
  return std::chrono::duration<double, std::milli>(Clock::now() - start)
             .count() /
      steps;
}

} // namespace

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "gpu.json";
  if (!torch::cuda::is_available()) {
    std::printf("gpu_bench: no CUDA device; nothing measured\n");
    return 0;
  }
  nlohmann::json rows = nlohmann::json::array();
  std::printf(
      "GPT stack: %lld blocks, dim %lld, seq %lld, batch %lld; %.2f TFLOP per step\n",
      static_cast<long long>(kBlocks),
      static_cast<long long>(kDim),
      static_cast<long long>(kTime),
      static_cast<long long>(kBatch),
      flopsPerStep() / 1e12);
  std::printf(
      "%-6s %-22s %10s %10s %10s %10s %10s\n",
      "dtype",
      "run",
      "step ms",
      "TFLOP/s",
      "bubble",
      "theory",
      "simulated");
  for (auto dtype : {torch::kBFloat16, torch::kFloat}) {
    const char* dtypeName = dtype == torch::kBFloat16 ? "bf16" : "fp32";
    tpipe::BuiltModel model = transformer(dtype);
    const auto on = torch::TensorOptions().device(torch::Device("cuda:0"));
    const torch::Tensor x =
        torch::randn({kBatch, kTime, kDim}, on.dtype(dtype));
    const torch::Tensor y =
        torch::randint(0, kVocab, {kBatch, kTime}, on.dtype(torch::kLong));
    const double plain = timeSteps(
        [&] {
          torch::Tensor h = x;
          for (auto& layer : model.layers)
            h = layer.module.forward(h);
          loss(h, y).backward();
        },
        2,
        5);
    auto report = [&](const std::string& run,
                      double ms,
                      const tpipe::BubbleReport* bubble) {
      const double tflops = flopsPerStep() / (ms * 1e-3) / 1e12;
      std::printf(
          "%-6s %-22s %10.2f %10.1f %9.1f%% %9.1f%% %9.1f%%\n",
          dtypeName,
          run.c_str(),
          ms,
          tflops,
          bubble ? 100 * bubble->measuredBubble : 0.0,
          bubble ? 100 * bubble->theoreticalBubble : 0.0,
          bubble ? 100 * bubble->simulatedBubble : 0.0);
      nlohmann::json row = {
          {"dtype", dtypeName},
          {"run", run},
          {"step_ms", ms},
          {"tflops", tflops}};
      if (bubble) {
        row["measured_bubble"] = bubble->measuredBubble;
        row["theoretical_bubble"] = bubble->theoreticalBubble;
        row["simulated_bubble"] = bubble->simulatedBubble;
      }
      rows.push_back(row);
    };
    report("plain LibTorch", plain, nullptr);
    for (const auto& [ranks, schedule] :
         std::vector<std::pair<int, std::string>>{
             {1, "gpipe"},
             {4, "gpipe"},
             {4, "1f1b"},
             {4, "zb-h1"},
             {2, "dualpipev"}}) {
      tpipe::PipelineOptions options;
      options.devices = std::vector<std::string>(ranks, "cuda:0");
      options.microBatches = ranks == 1 ? 1 : 8;
      options.schedule = schedule;
      options.checkpoint = tpipe::CheckpointMode::kNever;
      tpipe::Pipeline pipe(model.layers, options);
      const double ms = timeSteps([&] { pipe.trainStep(x, y, loss); }, 2, 5);
      pipe.setRecording(
          true); // recording waits on each instruction: timed apart
      for (int s = 0; s < 2; ++s)
        pipe.trainStep(x, y, loss);
      const tpipe::BubbleReport bubble = tpipe::bubbleReport(pipe.trace());
      report(
          std::to_string(ranks) + " rank(s) " + schedule +
              " m=" + std::to_string(options.microBatches),
          ms,
          &bubble);
      // The overlapped pairs' forward and backward run on two streams:
      // how much of the shorter part hid under the other (0 to 1).
      double overlap = 0.0;
      for (const auto& costs : bubble.measuredCosts)
        overlap = std::max(overlap, costs.overlap);
      if (schedule == "dualpipev") {
        std::printf(
            "%-6s %-22s overlap of pairs %.2f\n", dtypeName, "", overlap);
        rows.back()["pair_overlap"] = overlap;
      }
      for (auto& p : pipe.parameters())
        p.mutable_grad() = torch::Tensor();
    }
  }
  std::ofstream(out)
      << nlohmann::json{{"rows", rows}, {"flops_per_step", flopsPerStep()}}
             .dump(1)
      << '\n';
  std::printf(
      "(ranks share the one GPU on separate streams: the bubble shows scheduling, not a speed-up)\n");
  std::printf("wrote %s\n", out.c_str());
  return 0;
}
