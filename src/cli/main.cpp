// The tpipe command line.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "tpipe/pipeline.h"
#include "tpipe/schedule.h"

namespace {

// The built-in example: a 6-layer MLP learning a synthetic 4-class problem,
// pipelined over two virtual CPU devices, checked against the
// unpartitioned model's loss at the first step.
int trainBuiltInExample(int steps) {
  torch::manual_seed(0);
  const int64_t samples = 2048, features = 16, classes = 4;
  torch::Tensor x = torch::randn({samples, features});
  torch::Tensor projection = torch::randn({features, classes});
  torch::Tensor y = x.matmul(projection).argmax(1);

  torch::nn::Sequential net(
      torch::nn::Linear(features, 64), torch::nn::ReLU(),
      torch::nn::Linear(64, 64), torch::nn::ReLU(),
      torch::nn::Linear(64, classes), torch::nn::Identity());
  tpipe::PipelineOptions options;
  options.devices = {"cpu:0", "cpu:1"};
  options.microBatches = 4;
  tpipe::Pipeline pipe(tpipe::layersOf(net), options);
  torch::optim::SGD sgd(pipe.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  auto loss = [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(out, target);
  };
  std::cout << "tpipe built-in example: 6-layer MLP, 2 stages on cpu:0, cpu:1, "
               "4 micro-batches, gpipe, checkpoint except_last\n";
  const int64_t batch = 128;
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    const int64_t offset = (step * batch) % samples;
    torch::Tensor xb = x.narrow(0, offset, batch);
    torch::Tensor yb = y.narrow(0, offset, batch);
    sgd.zero_grad();
    const double value = pipe.trainStep(xb, yb, loss).item<double>();
    if (step == 0) {
      torch::NoGradGuard noGrad;
      const double reference = loss(net->forward(xb), yb).item<double>();
      std::printf("step 1: pipelined loss %.6f, unpartitioned loss %.6f\n",
                  value, reference);
    }
    sgd.step();
    if ((step + 1) % 50 == 0) std::printf("step %d: loss %.4f\n", step + 1, value);
  }
  const double seconds = std::chrono::duration<double>(
                             std::chrono::steady_clock::now() - start).count();
  torch::Tensor predictions = pipe.forward(x).argmax(1);
  const double accuracy = predictions.eq(y).to(torch::kDouble).mean().item<double>();
  std::printf("trained %d steps in %.2f s; training accuracy %.3f\n", steps,
              seconds, accuracy);
  return 0;
}

int printSchedule(const tpipe::ScheduleSpec& spec, bool json) {
  const tpipe::Schedule schedule = tpipe::makeSchedule(spec);
  const tpipe::Simulation simulation = tpipe::simulate(schedule, {tpipe::StageCosts{}});
  if (json) {
    nlohmann::json out = tpipe::scheduleToJson(schedule);
    out["simulation"] = tpipe::simulationToJson(schedule, simulation);
    std::cout << out.dump(1) << '\n';
    return 0;
  }
  tpipe::printInstructions(std::cout, schedule);
  std::cout << "\nunit costs: forward 1, backward 2 (input 1 + weight 1), "
               "recompute 1, transfer 0\n";
  tpipe::printSimulation(std::cout, schedule, simulation);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tpipe: pipeline-parallel training on LibTorch"};
  app.require_subcommand(1);

  auto* train = app.add_subcommand("train", "train (now: the built-in example)");
  int steps = 300;
  train->add_option("--steps", steps, "optimizer steps")->check(CLI::PositiveNumber);

  auto* schedule = app.add_subcommand(
      "schedule", "print a schedule's instruction lists and simulated timeline");
  tpipe::ScheduleSpec spec;
  std::string checkpoint = "except_last";
  bool json = false;
  schedule->add_option("--stages", spec.ranks, "pipeline ranks (devices)")->required();
  schedule->add_option("--micro-batches", spec.microBatches, "micro-batches")->required();
  schedule->add_option("--schedule", spec.name,
                       "gpipe | 1f1b | interleaved-1f1b | zb-h1");
  schedule->add_option("--virtual", spec.virtualStages, "stages per device");
  schedule->add_option("--checkpoint", checkpoint, "always | except_last | never");
  schedule->add_flag("--json", json, "print JSON");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*train) return trainBuiltInExample(steps);
    if (*schedule) {
      spec.checkpoint = tpipe::parseCheckpointMode(checkpoint);
      return printSchedule(spec, json);
    }
  } catch (const c10::Error& error) {
    std::cerr << "tpipe: error: " << error.what_without_backtrace() << '\n';
    return 2;
  } catch (const std::exception& error) {
    std::cerr << "tpipe: error: " << error.what() << '\n';
    return 2;
  }
  return 0;
}
