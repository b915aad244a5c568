// A user-defined residual block with dropout, pipelined over 2 virtual CPU
// devices with 1F1B and rematerialization, trained for a few steps.
#include <cstdio>

#include <torch/torch.h>
#include <tpipe/pipeline.h>

// Your own module: tpipe knows nothing of it. Its dropout draws from the
// running stage's own generator (tpipe::stageDropout), and its layer says
// so (Randomness::kStageGenerator, below): recompute replays its masks
// exactly, and the two stages run their forwards side by side. (With a
// torch::nn::Dropout inside, tpipe would treat the block as drawing from
// LibTorch's process-wide generator, replay it as exactly, and let one
// such stage run a forward at a time.)
struct ResidualBlockImpl : torch::nn::Module {
  explicit ResidualBlockImpl(int64_t width)
      : fc(register_module("fc", torch::nn::Linear(width, width))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    return x + tpipe::stageDropout(torch::relu(fc(x)), 0.1, is_training());
  }
  torch::nn::Linear fc;
};
TORCH_MODULE(ResidualBlock);

int main() {
  torch::manual_seed(0);
  torch::nn::Sequential net(
      torch::nn::Linear(16, 64),
      ResidualBlock(64),
      ResidualBlock(64),
      ResidualBlock(64),
      torch::nn::Linear(64, 4));
  tpipe::PipelineOptions options;
  options.devices = {"cpu:0", "cpu:1"};
  options.microBatches = 4;
  options.schedule = "1f1b";
  options.checkpoint = tpipe::CheckpointMode::kAlways;
  tpipe::LayerList layers = tpipe::layersOf(net);
  for (auto& layer : layers) {
    if (layer.module.ptr()->as<ResidualBlockImpl>())
      layer.randomness = tpipe::Randomness::kStageGenerator;
  }
  tpipe::Pipeline pipe(layers, options);

  const torch::Tensor x = torch::randn({64, 16});
  const torch::Tensor y = x.narrow(1, 0, 4).argmax(1); // a learnable target
  torch::optim::SGD sgd(
      pipe.parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto loss = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(out, target);
  };
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    sgd.zero_grad();
    last = pipe.trainStep(x, y, loss).item<double>();
    sgd.step();
    if (step == 0)
      first = last;
    if (step % 10 == 0 || step == 29)
      std::printf("step %d loss %.4f\n", step + 1, last);
  }
  std::printf("stages %d, boundaries", pipe.plan().stageCount());
  for (int b : pipe.boundaries())
    std::printf(" %d", b);
  std::printf("; loss %.4f -> %.4f\n", first, last);
  return last < first ? 0 : 1; // the loss must fall
}
