// One pipeline rank per process. Start it as torchrun would, once per rank:
//   MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=0 ./multiprocess
//   & MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 WORLD_SIZE=2 RANK=1
//   ./multiprocess
// (on several hosts, also set the same TPIPE_JOB_TOKEN on each).
#include <chrono>
#include <cstdio>

#include <torch/torch.h>
#include <tpipe/distributed.h>
#include <tpipe/pipeline.h>

int main() {
  const tpipe::WorldInfo world = tpipe::worldFromEnvironment();
  if (world.worldSize != 2) {
    std::fprintf(
        stderr, "set WORLD_SIZE=2 and RANK=0|1 (see the comment at the top)\n");
    return 2;
  }
  auto communicator = std::make_shared<tpipe::Communicator>(
      world,
      /*pipelineRanks=*/2,
      std::chrono::seconds(30),
      R"({"example": "multiprocess"})");
  torch::manual_seed(0); // every rank builds the same weights
  torch::nn::Sequential net(
      torch::nn::Linear(8, 32),
      torch::nn::Tanh(),
      torch::nn::Linear(32, 32),
      torch::nn::Tanh(),
      torch::nn::Linear(32, 2));
  tpipe::PipelineOptions options;
  options.devices = {"cpu:0", "cpu:1"};
  options.microBatches = 4;
  options.schedule = "1f1b";
  options.communicator = communicator;
  tpipe::Pipeline pipe(
      tpipe::layersOf(net), options); // this process runs its own rank only

  const torch::Tensor x = torch::randn({32, 8});
  const torch::Tensor y = (x.sum(1) > 0).to(torch::kLong);
  torch::optim::SGD sgd(pipe.parameters(), 0.1);
  auto loss = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(out, target);
  };
  double first = 0, last = 0;
  for (int step = 0; step < 20; ++step) {
    sgd.zero_grad();
    last = pipe.trainStep(x, y, loss).item<double>();
    sgd.step();
    if (step == 0)
      first = last;
  }
  std::printf(
      "rank %d: loss %.4f -> %.4f\n", communicator->rank(), first, last);
  return last < first ? 0 : 1;
}
