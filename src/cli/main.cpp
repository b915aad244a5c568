// The tpipe command line.
#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <c10/util/Exception.h>

#include "tpipe/config.h"
#include "tpipe/pipeline.h"
#include "tpipe/trainer.h"
#include "tpipe/schedule.h"

namespace {

// `tpipe train` without a config trains this one (configs/fashion_mnist_cnn.json).
const char* const kDefaultConfig =
#include "default_config.inc"
    ;

nlohmann::json configJson(const std::string& path, const std::vector<std::string>& overrides) {
  if (!path.empty()) return tpipe::readConfigJson(path, overrides);
  nlohmann::json json = nlohmann::json::parse(kDefaultConfig);
  for (const auto& assignment : overrides) tpipe::applyOverride(json, assignment);
  return json;
}

std::string shapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// Every check short of training: config, shape inference, loss fit, data.
int validateConfig(const std::string& path, const std::vector<std::string>& overrides) {
  const tpipe::Config config = tpipe::parseConfig(configJson(path, overrides));
  const tpipe::BuiltModel model = tpipe::buildModel(config.model, config.train.seed);
  tpipe::checkLossFits(config, model);
  std::printf("%-6s %-18s %-18s %s\n", "layer", "type", "output", "parameters");
  std::printf("%-6s %-18s %-18s\n", "input", "", shapeText(model.shapes[0]).c_str());
  for (size_t i = 0; i < model.layers.size(); ++i) {
    int64_t count = 0;
    for (const auto& p : model.layers[i].module.ptr()->parameters()) count += p.numel();
    std::printf("%-6zu %-18s %-18s %lld\n", i, config.model.layers[i].type.c_str(),
                shapeText(model.shapes[i + 1]).c_str(), static_cast<long long>(count));
  }
  const tpipe::Dataset data = tpipe::loadDataset(config, model);
  std::printf("%s\n", data.description.c_str());
  tpipe::ScheduleSpec spec;
  spec.name = config.pipeline.schedule;
  spec.ranks = (config.pipeline.stages > 0 ? config.pipeline.stages
                : !config.pipeline.balance.empty() ? static_cast<int>(config.pipeline.balance.size())
                : static_cast<int>(config.pipeline.devices.size()) * config.pipeline.virtualStages) /
               config.pipeline.virtualStages;
  spec.microBatches = config.pipeline.microBatches;
  spec.virtualStages = config.pipeline.virtualStages;
  spec.checkpoint = tpipe::parseCheckpointMode(config.pipeline.checkpoint);
  const tpipe::Schedule schedule = tpipe::makeSchedule(spec);
  std::printf("config OK: %lld parameters, %d stages, schedule %s valid\n",
              static_cast<long long>(model.parameterCount), schedule.stages(), schedule.name.c_str());
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

  std::string configPath;
  std::vector<std::string> overrides;
  auto* train = app.add_subcommand(
      "train", "train from a JSON config (default: the built-in Fashion-MNIST CNN config)");
  tpipe::TrainOptions trainOptions;
  train->add_option("config", configPath, "JSON config file")->check(CLI::ExistingFile);
  train->add_option("--set", overrides, "override a config value: key.path=value (repeatable)");
  train->add_option("--metrics", trainOptions.metricsPath, "write JSON lines, one per step");
  train->add_option("--save", trainOptions.saveDir, "checkpoint directory");
  train->add_option("--resume", trainOptions.resumeDir, "continue from this checkpoint directory");
  train->add_option("--stop-after", trainOptions.stopAfter,
                    "stop after this many steps (a preemption: the schedule still spans train.steps)");

  auto* validate = app.add_subcommand("validate", "check a config without training");
  validate->add_option("config", configPath, "JSON config file")->required()->check(CLI::ExistingFile);
  validate->add_option("--set", overrides, "override a config value: key.path=value");

  auto* schedule = app.add_subcommand(
      "schedule", "print a schedule's instruction lists and simulated timeline");
  tpipe::ScheduleSpec spec;
  std::string checkpoint = "except_last";
  bool json = false;
  schedule->add_option("--stages", spec.ranks, "pipeline ranks (devices)")->required();
  schedule->add_option("--micro-batches", spec.microBatches, "micro-batches")->required();
  schedule->add_option("--schedule", spec.name, "gpipe | 1f1b | interleaved-1f1b | zb-h1");
  schedule->add_option("--virtual", spec.virtualStages, "stages per device");
  schedule->add_option("--checkpoint", checkpoint, "always | except_last | never");
  schedule->add_flag("--json", json, "print JSON");

  CLI11_PARSE(app, argc, argv);
  try {
    if (*train) {
      const tpipe::Config config = tpipe::parseConfig(configJson(configPath, overrides));
      tpipe::train(config, trainOptions);
      return 0;
    }
    if (*validate) return validateConfig(configPath, overrides);
    if (*schedule) {
      spec.checkpoint = tpipe::parseCheckpointMode(checkpoint);
      return printSchedule(spec, json);
    }
  } catch (const tpipe::ConfigError& error) {
    std::cerr << "tpipe: error: " << error.what() << '\n';
    return 2;
  } catch (const std::invalid_argument& error) {  // schedule and partition errors
    std::cerr << "tpipe: error: " << error.what() << '\n';
    return 2;
  } catch (const c10::Error& error) {
    std::cerr << "tpipe: error: " << error.what_without_backtrace() << '\n';
    return 1;
  } catch (const std::exception& error) {
    std::cerr << "tpipe: error: " << error.what() << '\n';
    return 1;
  }
  return 0;
}
