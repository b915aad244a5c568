// The tuner checked by measurement: for each example config and the
// reference job, tune predicts every candidate, then a grid of them (the
// top predicted, a spread over the rest of the ranking, the choice) runs
// side by side, in alternating rounds, on the same run. Reports how far the
// choice's measured step is from the best measured, and the prediction
// error over the grid; `cluster` times the GPT-3 plan on 1024 devices.
//
//   tune_bench OUT.json [CONFIG ...]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>

#include <nlohmann/json.hpp>

#include "json_input.h"
#include "tpipe/trainer.h"

using namespace tpipe;

namespace {

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// The top 5 predicted, then every few places down the ranking: 10 plans.
std::vector<size_t> gridOf(const TuneResult& result) {
  const size_t feasible = static_cast<size_t>(result.feasible());
  std::vector<size_t> grid;
  for (size_t i = 0; i < std::min<size_t>(5, feasible); ++i)
    grid.push_back(i);
  const size_t rest = feasible > 5 ? feasible - 5 : 0;
  for (size_t k = 1; k <= 5 && rest > 0; ++k) {
    const size_t i = 5 + (rest - 1) * k / 5;
    if (std::find(grid.begin(), grid.end(), i) == grid.end())
      grid.push_back(i);
  }
  if (std::find(grid.begin(), grid.end(), result.choice) == grid.end())
    grid.push_back(result.choice);
  return grid;
}

nlohmann::json benchConfig(const std::string& path) {
  const Config config = loadConfig(path);
  std::cout << "== " << path << std::endl;
  const TuneOutcome outcome = tuneConfig(config, TuneOptions{});
  for (const auto& line : outcome.calibration)
    std::cout << "calibration: " << line << "\n";
  const std::vector<size_t> grid = gridOf(outcome.result);
  std::vector<TuneCandidate> plans;
  for (size_t i : grid)
    plans.push_back(outcome.result.candidates[i]);
  const std::vector<double> measured = measureCandidates(config, plans, 4, 3);
  double best = measured[0], choiceMs = 0.0;
  std::vector<double> errors;
  nlohmann::json rows = nlohmann::json::array();
  std::printf("%-56s %10s %10s %8s\n", "plan", "pred ms", "meas ms", "error");
  for (size_t g = 0; g < grid.size(); ++g) {
    const TuneCandidate& c = plans[g];
    best = std::min(best, measured[g]);
    if (grid[g] == outcome.result.choice)
      choiceMs = measured[g];
    const double error = (c.predictedStepMs - measured[g]) / measured[g];
    errors.push_back(std::abs(error));
    std::printf(
        "%-56s %10.2f %10.2f %+7.1f%%%s\n",
        c.label().c_str(),
        c.predictedStepMs,
        measured[g],
        100.0 * error,
        grid[g] == outcome.result.choice ? "  <- choice" : "");
    nlohmann::json row = tuneCandidateToJson(c);
    row["measured_step_ms"] = measured[g];
    rows.push_back(row);
  }
  const double worst = *std::max_element(errors.begin(), errors.end());
  std::printf(
      "choice / best measured %.3f; |error| median %.1f%%, worst %.1f%%\n\n",
      choiceMs / best,
      100.0 * median(errors),
      100.0 * worst);
  return {
      {"config", path},
      {"calibration", outcome.calibration},
      {"choice_over_best", choiceMs / best},
      {"median_abs_error", median(errors)},
      {"worst_abs_error", worst},
      {"abs_errors", errors},
      {"grid", rows}};
}

nlohmann::json benchCluster() {
  const std::string dir = std::string(TPIPE_SOURCE_DIR) + "/configs/";
  const Config config = loadConfig(dir + "gpt3_175b.json");
  const nlohmann::json cluster =
      readJsonFile(dir + "cluster_1024.json", "cluster_1024.json");
  const auto start = std::chrono::steady_clock::now();
  const TuneOutcome outcome =
      tuneForCluster(config, cluster, "cluster_1024.json");
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - start)
                        .count();
  const TuneCandidate& choice =
      outcome.result.candidates[outcome.result.choice];
  std::printf(
      "== cluster: GPT-3 175B on 1024 devices planned in %.0f ms (%zu "
      "candidates): %s, %.0f ms per step, bubble %.1f%%\n",
      ms,
      outcome.result.candidates.size(),
      choice.label().c_str(),
      choice.predictedStepMs,
      100.0 * choice.bubble);
  return {
      {"plan_ms", ms},
      {"candidates", outcome.result.candidates.size()},
      {"choice", tuneCandidateToJson(choice)}};
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: tune_bench OUT.json [CONFIG ...]\n";
    return 2;
  }
  std::vector<std::string> configs(argv + 2, argv + argc);
  if (configs.empty()) {
    const std::string dir = std::string(TPIPE_SOURCE_DIR) + "/configs/";
    for (const char* name :
         {"reference_mlp.json",
          "mlp_synthetic.json",
          "char_transformer.json",
          "fashion_mnist_cnn.json",
          "beyond_one_device.json"})
      configs.push_back(dir + name);
  }
  nlohmann::json out = {{"configs", nlohmann::json::array()}};
  out["cluster"] = benchCluster();
  std::cout << std::endl;
  std::vector<double> ratios, medians, worsts, all;
  for (const auto& path : configs) {
    const nlohmann::json row = benchConfig(path);
    ratios.push_back(row["choice_over_best"]);
    medians.push_back(row["median_abs_error"]);
    worsts.push_back(row["worst_abs_error"]);
    for (double e : row["abs_errors"])
      all.push_back(e);
    out["configs"].push_back(row);
  }
  std::printf(
      "%-40s %14s %14s %14s\n",
      "config",
      "choice/best",
      "median |err|",
      "worst |err|");
  for (size_t i = 0; i < configs.size(); ++i) {
    const std::string name = configs[i].substr(configs[i].rfind('/') + 1);
    std::printf(
        "%-40s %14.3f %13.1f%% %13.1f%%\n",
        name.c_str(),
        ratios[i],
        100.0 * medians[i],
        100.0 * worsts[i]);
  }
  std::printf(
      "over all %zu measured plans: median |error| %.1f%%, worst %.1f%%\n",
      all.size(),
      100.0 * median(all),
      100.0 * *std::max_element(all.begin(), all.end()));
  out["median_abs_error"] = median(all);
  out["worst_abs_error"] = *std::max_element(all.begin(), all.end());
  std::ofstream(argv[1]) << out.dump(1) << "\n";
  return 0;
}
