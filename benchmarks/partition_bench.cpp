// Partitioner benchmark: time to partition 10,000 layers into 64 stages, and
// the bottleneck of each partition method on the example configs' profiles.
// Prints a table; writes JSON to argv[1] (default partition.json).
#include <chrono>
#include <cstdio>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "tpipe/profile.h"
#include "tpipe/planning.h"
#include "tpipe/trainer.h"

namespace {

double medianMs(const std::function<void()>& body, int runs) {
  std::vector<double> times;
  for (int r = 0; r < runs; ++r) {
    const auto start = std::chrono::steady_clock::now();
    body();
    times.push_back(std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - start)
                        .count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

tpipe::PartitionProblem bigProblem(bool capped) {
  std::mt19937 rng(1);
  std::uniform_real_distribution<double> time(0.1, 3.0);
  tpipe::PartitionProblem problem;
  int64_t total = 0;
  for (int i = 0; i < 10000; ++i) {
    tpipe::LayerCost layer{
        "l" + std::to_string(i),
        time(rng),
        2 * time(rng),
        static_cast<int64_t>(rng() % 100000),
        static_cast<int64_t>(rng() % 10000),
        static_cast<int64_t>(rng() % 20000)};
    total += layer.paramBytes;
    problem.layers.push_back(layer);
  }
  for (int k = 0; k < 64; ++k) {
    problem.devices.push_back(
        {"cpu:" + std::to_string(k), 1.0, capped ? total * 6 / 64 : 0, 0.0});
  }
  problem.stages = 64;
  problem.memory = tpipe::memoryModelOf(
      tpipe::oneFOneBSchedule(64, 128, tpipe::CheckpointMode::kAlways), 2.0, 0);
  return problem;
}

} // namespace

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "partition.json";
  const std::string root = TPIPE_SOURCE_DIR;
  nlohmann::json json;
  std::printf(
      "%-44s %12s\n", "partition 10,000 layers into 64 stages", "median ms");
  for (bool capped : {false, true}) {
    const tpipe::PartitionProblem problem = bigProblem(capped);
    tpipe::PartitionPlan plan;
    const double ms =
        medianMs([&] { plan = tpipe::optimalPartition(problem); }, 5);
    const std::string name = capped ? "time-optimal, memory caps + remat + 1F1B"
                                    : "time-optimal, no memory caps";
    std::printf("%-44s %12.1f\n", name.c_str(), ms);
    json["large"].push_back(
        {{"case", name},
         {"median_ms", ms},
         {"bottleneck_ms", plan.bottleneckMs}});
  }
  std::printf(
      "\n%-22s %-11s %14s %14s %14s %10s\n",
      "config",
      "stages",
      "uniform ms",
      "parameters ms",
      "time ms",
      "gain");
  for (const char* name :
       {"fashion_mnist_cnn", "char_transformer", "mlp_synthetic"}) {
    tpipe::Config config =
        tpipe::loadConfig(root + "/configs/" + name + ".json");
    config.pipeline.balance.clear();
    config.pipeline.stages = static_cast<int>(config.pipeline.devices.size());
    const tpipe::BuiltModel model = tpipe::buildModel(config.model, 0);
    const tpipe::TrainingCosts costs =
        tpipe::trainingCosts(config, model, "", true);
    nlohmann::json row = {{"config", name}, {"stages", config.pipeline.stages}};
    double bottleneck[3];
    const char* methods[] = {"uniform", "parameters", "time"};
    for (int i = 0; i < 3; ++i) {
      config.pipeline.partition = tpipe::parsePartitionMethod(methods[i]);
      tpipe::PlanRequest request = tpipe::planRequest(config, costs);
      request.costNoise =
          0.0; // the strictly fastest, not the simplest within noise
      const tpipe::Plan plan = tpipe::resolvePlan(request);
      bottleneck[i] = plan.bottleneckMs;
      row[methods[i]] = {
          {"bottleneck_ms", plan.bottleneckMs},
          {"boundaries", plan.boundaries}};
    }
    const double gain = std::min(bottleneck[0], bottleneck[1]) / bottleneck[2];
    std::printf(
        "%-22s %-11d %14.3f %14.3f %14.3f %9.2fx\n",
        name,
        config.pipeline.stages,
        bottleneck[0],
        bottleneck[1],
        bottleneck[2],
        gain);
    row["gain_over_best_heuristic"] = gain;
    json["configs"].push_back(row);
  }
  std::ofstream(out) << json.dump(1) << '\n';
  std::printf(
      "\nwrote %s (gain: best of uniform/parameters bottleneck over time-optimal)\n",
      out.c_str());
  return 0;
}
