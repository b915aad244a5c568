// The tpipe command line.
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <algorithm>

#include <unistd.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <c10/util/Exception.h>

#include "cli/commands.h"
#include "json_input.h"
#include "tpipe/config.h"
#include "tpipe/curves.h"
#include "tpipe/distributed.h"
#include "tpipe/partition.h"
#include "tpipe/plan.h"
#include "tpipe/predict.h"
#include "tpipe/profile.h"
#include "tpipe/pipeline.h"
#include "tpipe/trainer.h"
#include "tpipe/planning.h"
#include "tpipe/tuning.h"
#include "train/checkpoint.h"
#include "train/files.h"
#include "tpipe/schedule.h"
#include "tpipe/tune.h"

namespace {

// `tpipe train` without a config trains this one
// (configs/fashion_mnist_cnn.json).
const char* const kDefaultConfig =
#include "default_config.inc"
    ;

nlohmann::json configJson(
    const std::string& path,
    const std::vector<std::string>& overrides) {
  if (!path.empty())
    return tpipe::readConfigJson(path, overrides);
  nlohmann::json json = nlohmann::json::parse(kDefaultConfig);
  for (const auto& assignment : overrides)
    tpipe::applyOverride(json, assignment);
  return json;
}

std::string shapeText(const std::vector<int64_t>& shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

// "pop block (add), stash down": what a layer takes back and keeps.
std::string skipText(const tpipe::LayerSpec& layer) {
  std::string text;
  auto names = [](const std::vector<std::string>& list) {
    std::string joined;
    for (const auto& name : list)
      joined += (joined.empty() ? "" : " ") + name;
    return joined;
  };
  if (!layer.pop.empty())
    text = "pop " + names(layer.pop) + " (" + layer.merge + ")";
  if (!layer.stash.empty())
    text +=
        (text.empty() ? "" : ", ") + std::string("stash ") + names(layer.stash);
  return text;
}

// The one feasibility verdict, as `plan` and `validate` print it.
void printInfeasible(const tpipe::Feasibility& verdict) {
  std::printf("INFEASIBLE: %s\n", verdict.problem.c_str());
  for (const auto& fix : verdict.fixes)
    std::printf("  would fit: %s\n", fix.c_str());
  if (verdict.fixes.empty()) {
    std::printf(
        "  no single change of schedule, checkpoint mode, partition, "
        "micro-batches or device count fits\n");
  }
}

// Every check short of training: config, shape inference, loss fit, data.
int validateConfig(
    const std::string& path,
    const std::vector<std::string>& overrides) {
  const tpipe::Config config = tpipe::parseConfig(configJson(path, overrides));
  const tpipe::BuiltModel model = tpipe::buildModel(config);
  tpipe::checkLossFits(config, model);
  std::printf(
      "%-6s %-18s %-18s %-11s %s\n",
      "layer",
      "type",
      "output",
      "parameters",
      "skips");
  std::printf(
      "%-6s %-18s %-18s\n", "input", "", shapeText(model.shapes[0]).c_str());
  const std::vector<int64_t> counts = tpipe::parameterCounts(model.layers);
  for (size_t i = 0; i < model.layers.size(); ++i) {
    std::printf(
        "%-6zu %-18s %-18s %-11lld %s\n",
        i,
        config.model.layers[i].type.c_str(),
        shapeText(model.shapes[i + 1]).c_str(),
        static_cast<long long>(counts[i]),
        skipText(config.model.layers[i]).c_str());
  }
  const tpipe::Dataset data = tpipe::loadDataset(config, model);
  std::printf("%s\n", data.description.c_str());
  tpipe::ScheduleSpec spec;
  spec.source = config.pipeline.schedule;
  spec.ranks = tpipe::pipelineRanks(config.pipeline);
  spec.microBatches = config.pipeline.microBatches;
  spec.virtualStages = config.pipeline.virtualStages;
  spec.checkpoint = config.pipeline.checkpoint;
  const tpipe::Schedule schedule = tpipe::makeSchedule(spec);
  // Memory from shapes alone: nothing of the model's activations is
  // allocated. pipeline.auto chooses its layout by tuning, so only its
  // devices' caps against the whole model are not judged here.
  if (!config.pipeline.autoTune) {
    const tpipe::Feasibility verdict =
        tpipe::configFeasibility(config, tpipe::shapeCosts(config, model));
    if (!verdict.fits) {
      printInfeasible(verdict);
      return 2;
    }
    int64_t largest = 0;
    for (const auto& stage : verdict.plan.stages)
      largest = std::max(largest, stage.memoryBytes);
    std::printf(
        "memory: largest stage %s predicted from shapes\n",
        tpipe::formatBytes(largest).c_str());
  }
  std::printf(
      "config OK: %lld parameters, %d stages, schedule %s valid\n",
      static_cast<long long>(model.parameterCount),
      schedule.stages(),
      schedule.name.c_str());
  return 0;
}

// A saved profile without a config: `stages` identical CPU devices.
tpipe::PlanRequest profileOnlyRequest(
    const std::string& profilePath,
    int stages) {
  if (stages < 1)
    throw tpipe::ConfigError(
        "--stages: required with --profile and no CONFIG (a positive integer)");
  const tpipe::Profile profile = tpipe::profileFromJson(
      tpipe::readJsonFile(profilePath, "--profile " + profilePath));
  tpipe::PlanRequest request;
  request.layers = profile.costsAt(profile.microBatchSize);
  request.costSource = profilePath;
  request.costNoise = profile.noise;
  for (int k = 0; k < stages; ++k)
    request.devices.push_back({"cpu:" + std::to_string(k)});
  request.stages = stages;
  request.partition = tpipe::PartitionMethod::kTime;
  return request;
}

// `plan` resolves exactly what `train` would run: the same request builder
// and resolver; with the same --profile file, the same plan.
int planCommand(
    const std::string& configPath,
    const std::vector<std::string>& overrides,
    const std::string& profilePath,
    int stages,
    bool json) {
  tpipe::PlanRequest request;
  if (configPath.empty()) {
    request = profileOnlyRequest(profilePath, stages);
  } else {
    tpipe::Config config =
        tpipe::parseConfig(configJson(configPath, overrides));
    if (config.pipeline.autoTune) {
      throw tpipe::ConfigError(
          "pipeline.auto: `tpipe train` chooses this config's plan by tuning; "
          "`tpipe tune CONFIG` shows the ranking and the choice");
    }
    if (stages > 0)
      config.pipeline.stages = stages;
    const tpipe::BuiltModel model = tpipe::buildModel(config);
    request = tpipe::planRequest(
        config, tpipe::trainingCosts(config, model, profilePath, true));
  }
  // The host's memory counts where one process would hold every stage.
  const tpipe::Feasibility verdict = tpipe::checkFeasibility(
      request, configPath.empty() ? 0 : tpipe::hostAvailableBytes());
  const bool resolved = !verdict.plan.boundaries.empty();
  if (json && resolved) {
    std::cout << tpipe::planToJson(verdict.plan).dump(1) << '\n';
    return verdict.fits ? 0 : 2;
  }
  if (resolved)
    tpipe::printPlan(std::cout, verdict.plan);
  if (!verdict.fits) {
    printInfeasible(verdict);
    return 2;
  }
  return 0;
}

int profileCommand(
    const std::string& configPath,
    const std::vector<std::string>& overrides,
    const std::string& outPath) {
  const tpipe::Config config =
      tpipe::parseConfig(configJson(configPath, overrides));
  const tpipe::BuiltModel model = tpipe::buildModel(config);
  const tpipe::Profile profile = tpipe::profileModel(config, model);
  std::printf(
      "%-24s %10s %10s %12s %12s %12s\n",
      "layer",
      "fwd ms",
      "bwd ms",
      "params",
      "output",
      "kept");
  for (const auto& layer : profile.layers) {
    std::printf(
        "%-24s %10.4f %10.4f %12s %12s %12s\n",
        layer.cost.name.substr(0, 24).c_str(),
        layer.cost.forwardMs,
        layer.cost.backwardMs,
        tpipe::formatBytes(layer.cost.paramBytes).c_str(),
        tpipe::formatBytes(layer.cost.activationBytes).c_str(),
        tpipe::formatBytes(layer.cost.stashBytes).c_str());
  }
  std::printf(
      "(medians over %d round(s) at %lld samples per micro-batch on %s; noise %.1f%%%s)\n",
      profile.rounds,
      static_cast<long long>(profile.microBatchSize),
      profile.device.c_str(),
      100.0 * profile.noise,
      profile.settled ? "" : ", still above the bound");
  // What `train` would run from these numbers (`plan --profile` shows it too).
  try {
    const tpipe::Plan plan = tpipe::resolvePlan(tpipe::planRequest(
        config, tpipe::costsFromProfile(config, profile, "this profile")));
    std::printf("\nthe plan from this profile:\n");
    tpipe::printPlan(std::cout, plan);
  } catch (const tpipe::PartitionError& error) {
    std::printf("\nno plan fits: %s\n", error.what());
  }
  if (!outPath.empty()) {
    std::ofstream out(outPath);
    out << tpipe::profileToJson(profile).dump(1) << '\n';
    if (!out)
      throw tpipe::ConfigError("--out: cannot write " + outPath);
    std::printf("wrote %s\n", outPath.c_str());
  }
  return 0;
}

// Per-stage costs from a recorded run's report (`tpipe train --report`,
// `tpipe profile --steps N --report`) or a file of the same shape.
std::vector<tpipe::StageCosts> readStageCosts(
    const std::string& path,
    int stages) {
  return tpipe::stageCostsFromJson(
      tpipe::readJsonFile(path, "--costs " + path), stages, "--costs " + path);
}

struct ScheduleRequest {
  tpipe::ScheduleSpec spec;
  std::string text = "gpipe"; // a schedule name, "auto", or a file
  std::string costsPath;
  // Micro-batches in flight per stage: one count for every stage, or one
  // per stage ("8,8,6,4"); empty: p.
  std::string memoryLimit;
};

std::vector<int> parseMemoryLimits(const std::string& text, int ranks) {
  std::vector<int> limits;
  size_t start = 0;
  while (!text.empty() && start <= text.size()) {
    const size_t comma = std::min(text.find(',', start), text.size());
    const std::string item = text.substr(start, comma - start);
    size_t used = 0;
    int value = 0;
    try {
      value = std::stoi(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used == 0 || used != item.size() || value < 1) {
      throw tpipe::ScheduleError(
          "--memory-limit: '" + item +
          "' is not a micro-batch count >= 1 (give N, or one per stage: "
          "N,N,...)");
    }
    limits.push_back(value);
    start = comma + 1;
  }
  if (limits.size() == 1)
    limits.assign(static_cast<size_t>(ranks), limits.front());
  if (!limits.empty() && static_cast<int>(limits.size()) != ranks) {
    throw tpipe::ScheduleError(
        "--memory-limit: " + std::to_string(limits.size()) + " limits for " +
        std::to_string(ranks) + " stages");
  }
  return limits;
}

int printSchedule(
    const ScheduleRequest& request,
    bool json,
    bool csv,
    bool csvComms) {
  tpipe::ScheduleSpec spec = request.spec;
  std::vector<tpipe::StageCosts> costs{tpipe::StageCosts{}};
  if (!request.costsPath.empty())
    costs = readStageCosts(request.costsPath, spec.ranks);
  tpipe::Schedule schedule;
  double searchMs = -1.0;
  if (request.text == "auto") {
    spec.source = tpipe::ScheduleKind::kAuto;
    spec.costs = costs;
    spec.inFlightLimits = parseMemoryLimits(request.memoryLimit, spec.ranks);
    const auto start = std::chrono::steady_clock::now();
    schedule = tpipe::makeSchedule(spec);
    searchMs = std::chrono::duration<double, std::milli>(
                   std::chrono::steady_clock::now() - start)
                   .count();
  } else {
    spec.source = request.text;
    if (spec.source.isBuiltIn() && tpipe::isVShaped(spec.source.kind()) &&
        spec.virtualStages == 1)
      spec.virtualStages = 2; // P ranks hold 2P stages in a V
    schedule = tpipe::makeSchedule(spec);
  }
  if (csv || csvComms) {
    std::cout
        << (csvComms ? tpipe::scheduleToCsvWithComms(schedule)
                     : tpipe::scheduleToCsv(schedule));
    return 0;
  }
  const tpipe::Simulation simulation = tpipe::simulate(schedule, costs);
  if (json) {
    nlohmann::json out = tpipe::scheduleToJson(schedule);
    out["simulation"] = tpipe::simulationToJson(schedule, simulation);
    std::cout << out.dump(1) << '\n';
    return 0;
  }
  tpipe::printInstructions(std::cout, schedule);
  if (request.costsPath.empty()) {
    std::cout
        << "\nunit costs: forward 1, backward 2 (input 1 + weight 1), recompute 1, transfer 0\n";
  } else {
    std::cout << "\ncosts (ms) from " << request.costsPath << "\n";
  }
  tpipe::printSimulation(std::cout, schedule, simulation);
  if (simulation.finished) {
    std::cout << "back-to-back steps without a barrier (post-validation): "
              << tpipe::steadyStepTime(schedule, costs) << " per step\n";
  }
  if (schedule.virtualStages == 1 && schedule.chains == 1) {
    std::cout << "span bubble floor " << std::fixed << std::setprecision(2)
              << 100.0 *
            tpipe::spanBubbleLowerBound(
                     schedule.ranks, schedule.microBatches, costs)
              << "% (no one-stage-per-rank split schedule does better at "
                 "these costs, whatever its memory)\n";
  }
  if (searchMs >= 0)
    std::cout << "auto search: " << searchMs << " ms\n";
  return 0;
}

// What a process that ends without its destructors must write first.
void flushOutput() {
  std::cout.flush();
  std::cerr.flush();
  std::fflush(nullptr);
}

// Translating errors to exit codes happens here and nowhere else: user
// errors exit 2, everything else 1. Exits at once rather than returning: a
// thread stuck on a peer that never answered must not hold the exit.
[[noreturn]] void exitWith(int code, const std::string& message) {
  if (!message.empty())
    std::cerr << "tpipe: error: " << message << std::endl;
  flushOutput();
  std::_Exit(code);
}

// A rank of `tpipe launch` is sent SIGTERM when another rank fails (and
// SIGINT or SIGTERM when the launcher is stopped). Outside the training
// loop, which stops after its step, that first signal must not end the rank
// at once: most often the rank is itself on its way out with its own
// account of the failure, and the default action cut that account off (the
// trainer had restored it). The rank ends 2 s later, on its own error if it
// gets there first; a second signal ends it at once.
constexpr unsigned kStopReportSeconds = 2;
volatile std::sig_atomic_t launcherStop = 0;

void onLauncherStop(int signal) {
  if (launcherStop != 0)
    ::_exit(128 + signal);
  launcherStop = signal;
  ::alarm(kStopReportSeconds);
}

void onStopReportTime(int) {
  ::_exit(128 + launcherStop);
}

void holdStopSignalsIfLaunched() {
  if (std::getenv("TPIPE_JOB_TOKEN") == nullptr)
    return;
  struct sigaction action {};
  action.sa_handler = onLauncherStop;
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  action.sa_handler = onStopReportTime;
  ::sigaction(SIGALRM, &action, nullptr);
}

// "[json.exception.type_error.302] type must be number" -> "type must be
// number".
std::string libraryText(const std::string& message) {
  const size_t close = message.find("] ");
  return message.rfind("[json.exception.", 0) == 0 && close != std::string::npos
      ? message.substr(close + 2)
      : message;
}

// Every subcommand's options, filled by CLI11.
struct Arguments {
  std::string configPath;
  std::vector<std::string> overrides;
  tpipe::TrainOptions train;
  tpipe::PredictOptions predict;
  std::string metricsIn, plotOut, plotTitle;
  int processes = 1;
  int maxRestarts = 0;
  int minProcesses = 0; // launch --min-nproc; 0: restarts keep --nproc
  std::string profilePath, profileOut;
  int planStages = 0, profileSteps = 0;
  bool json = false, csv = false, csvComms = false;
  ScheduleRequest schedule;
  std::string checkpoint = "except_last";
  tpipe::TuneOptions tune;
  std::string clusterPath, writePath;
};

CLI::App* addTrain(CLI::App& app, Arguments& a) {
  auto* train = app.add_subcommand(
      "train",
      "train from a JSON config (default: the built-in Fashion-MNIST CNN config)");
  train->add_option("config", a.configPath, "JSON config file")
      ->check(CLI::ExistingFile);
  train->add_option(
      "--set",
      a.overrides,
      "override a config value: key.path=value (repeatable)");
  train->add_option(
      "--metrics", a.train.metricsPath, "write JSON lines, one per step");
  train->add_option("--save", a.train.saveDir, "checkpoint directory");
  train->add_option(
      "--plot",
      a.train.plotPath,
      "draw the loss, eval and samples/s curves as SVG when the run ends");
  train->add_option(
      "--resume",
      a.train.resumeDir,
      "continue from this checkpoint directory; auto: from --save DIR's last "
      "checkpoint if it has one, else start fresh");
  train->add_flag(
      "--resume-changed",
      a.train.resumeChanged,
      "resume a checkpoint although the config changed (says what changed)");
  train->add_option(
      "--trace",
      a.train.tracePath,
      "write a Chrome trace (Perfetto) of the recorded steps");
  train->add_option(
      "--timeline",
      a.train.timelinePath,
      "draw the last recorded step as an SVG Gantt chart");
  train->add_option(
      "--report", a.train.reportPath, "write the bubble report as JSON");
  train->add_flag(
      "--memory-report",
      a.train.memoryReport,
      "measure memory per device next to the partitioner's prediction");
  train->add_option(
      "--record-steps",
      a.train.recordSteps,
      "how many final steps to record (default 5)");
  train
      ->add_option(
          "--profile",
          a.train.profilePath,
          "plan from this saved profile (tpipe profile --out) instead of measuring")
      ->check(CLI::ExistingFile);
  train->add_flag(
      "--overwrite",
      a.train.overwrite,
      "let --save replace a checkpoint already in the directory");
  train
      ->add_option(
          "--stop-after",
          a.train.stopAfter,
          "stop after this many steps (a preemption: the schedule still spans train.steps)")
      ->check(CLI::PositiveNumber);
  return train;
}

CLI::App* addLaunch(CLI::App& app, Arguments& a) {
  auto* launch = app.add_subcommand(
      "launch",
      "run `tpipe train` as N local processes (one pipeline rank each) over c10d");
  launch
      ->add_option(
          "--nproc",
          a.processes,
          "processes: pipeline ranks x data-parallel replicas")
      ->required()
      ->check(CLI::Range(1, 1024));
  launch
      ->add_option(
          "--max-restarts",
          a.maxRestarts,
          "when a rank fails, end the others and start the job again, up to "
          "this many times, resuming from the last checkpoint (needs --save)")
      ->check(CLI::Range(0, 1000));
  launch
      ->add_option(
          "--min-nproc",
          a.minProcesses,
          "with --max-restarts: restart without the failed rank while at "
          "least this many remain (the config needs pipeline.elastic)")
      ->check(CLI::Range(1, 1024));
  launch->prefix_command(); // CONFIG and the train options follow, passed on as
                            // they are
  launch->footer(
      "Everything after --nproc N is handed to `tpipe train` in every rank "
      "(it may start with the word train), or to `tpipe predict` when it "
      "starts with predict.");
  return launch;
}

CLI::App* addPredict(CLI::App& app, Arguments& a) {
  auto* predict = app.add_subcommand(
      "predict",
      "run a trained checkpoint on new inputs (pipelined, micro-batched)");
  predict->add_option("config", a.configPath, "JSON config file")
      ->required()
      ->check(CLI::ExistingFile);
  predict->add_option(
      "--set", a.overrides, "override a config value: key.path=value");
  predict
      ->add_option(
          "--resume",
          a.predict.resumeDir,
          "the checkpoint directory (train --save)")
      ->required();
  predict
      ->add_option(
          "--input",
          a.predict.inputPath,
          "torch.save(X) or torch.save({\"inputs\": X}) file")
      ->required();
  predict
      ->add_option(
          "--output", a.predict.outputPath, "outputs, as a torch.load file")
      ->required();
  return predict;
}

CLI::App* addPlot(CLI::App& app, Arguments& a) {
  auto* plot = app.add_subcommand(
      "plot", "draw a run's metrics (train --metrics) as SVG curves");
  plot->add_option("metrics", a.metricsIn, "JSON lines from train --metrics")
      ->required()
      ->check(CLI::ExistingFile);
  plot->add_option("--out", a.plotOut, "the SVG to write")->required();
  plot->add_option(
      "--title", a.plotTitle, "title (default: the metrics file's name)");
  return plot;
}

int plotCommand(const Arguments& a) {
  tpipe::checkOutputPath("--out", a.plotOut);
  tpipe::refuseOutputsOverInputs(
      {{"--out", a.plotOut}}, {{"the metrics file", a.metricsIn}});
  std::ifstream in(a.metricsIn);
  std::ostringstream lines;
  lines << in.rdbuf();
  if (!in)
    throw tpipe::ConfigError("cannot read the metrics file " + a.metricsIn);
  if (!tpipe::holdsMetricsRecords(lines.str()))
    throw tpipe::ConfigError(
        "the metrics file " + a.metricsIn +
        " holds no metrics records (JSON lines with a \"step\", as train "
        "--metrics writes)");
  const std::string title = a.plotTitle.empty()
      ? std::filesystem::path(a.metricsIn).filename().string()
      : a.plotTitle;
  tpipe::writeOutputFile(a.plotOut, tpipe::curvesSvg(lines.str(), title));
  std::cout << "wrote " << a.plotOut << "\n";
  return 0;
}

CLI::App* addValidate(CLI::App& app, Arguments& a) {
  auto* validate =
      app.add_subcommand("validate", "check a config without training");
  validate->add_option("config", a.configPath, "JSON config file")
      ->required()
      ->check(CLI::ExistingFile);
  validate->add_option(
      "--set", a.overrides, "override a config value: key.path=value");
  return validate;
}

CLI::App* addPlan(CLI::App& app, Arguments& a) {
  auto* plan = app.add_subcommand(
      "plan",
      "partition a config's model (or a saved profile) and predict the step");
  plan->add_option("config", a.configPath, "JSON config file")
      ->check(CLI::ExistingFile);
  plan->add_option(
      "--set", a.overrides, "override a config value: key.path=value");
  plan->add_option(
          "--profile",
          a.profilePath,
          "plan from a saved profile (with or without a CONFIG)")
      ->check(CLI::ExistingFile);
  plan->add_option(
          "--stages",
          a.planStages,
          "stage count (required with --profile and no CONFIG)")
      ->check(CLI::Range(1, 4096));
  plan->add_flag("--json", a.json, "print JSON");
  return plan;
}

CLI::App* addProfile(CLI::App& app, Arguments& a) {
  auto* profile =
      app.add_subcommand("profile", "measure each layer's time and memory");
  profile->add_option("config", a.configPath, "JSON config file")
      ->required()
      ->check(CLI::ExistingFile);
  profile->add_option(
      "--set", a.overrides, "override a config value: key.path=value");
  profile->add_option("--out", a.profileOut, "write the profile as JSON");
  profile->add_option(
      "--steps",
      a.profileSteps,
      "also run this many pipelined steps and report the bubble");
  profile->add_option(
      "--trace", a.train.tracePath, "with --steps: write a Chrome trace");
  profile->add_option(
      "--timeline",
      a.train.timelinePath,
      "with --steps: write an SVG timeline");
  profile->add_option(
      "--report",
      a.train.reportPath,
      "with --steps: write the bubble report as JSON");
  return profile;
}

CLI::App* addSchedule(CLI::App& app, Arguments& a) {
  auto* schedule = app.add_subcommand(
      "schedule",
      "print a schedule's instruction lists and simulated timeline");
  schedule
      ->add_option(
          "--stages", a.schedule.spec.ranks, "pipeline ranks (devices)")
      ->required()
      ->check(CLI::Range(1, 4096));
  schedule
      ->add_option(
          "--micro-batches", a.schedule.spec.microBatches, "micro-batches")
      ->required()
      ->check(CLI::Range(1, 65536));
  schedule->add_option(
      "--schedule",
      a.schedule.text,
      "gpipe | 1f1b | interleaved-1f1b | zb-h1 | zb-h2 | zb-v | zb-v-half | zb-v-min | dualpipev | dualpipe | auto | a file *.json or *.csv");
  schedule
      ->add_option(
          "--costs",
          a.schedule.costsPath,
          "per-stage costs: a report from `train --report` (\"stage_costs\")")
      ->check(CLI::ExistingFile);
  schedule->add_option(
      "--memory-limit",
      a.schedule.memoryLimit,
      "auto: micro-batches in flight per stage, N or one per stage "
      "N,N,... (default: stages, as zb-h1)");
  schedule
      ->add_option(
          "--weight-memory",
          a.schedule.spec.weightPassMemory,
          "auto: what a micro-batch keeps for its weight pass, as a fraction "
          "of what its forward stashed (the Zero Bubble paper's M_W / M_B; "
          "default 1: tpipe keeps the graph)")
      ->check(CLI::Range(0.0, 1.0));
  schedule
      ->add_option(
          "--virtual", a.schedule.spec.virtualStages, "stages per device")
      ->check(CLI::Range(1, 64));
  schedule->add_option(
      "--checkpoint", a.checkpoint, "always | except_last | never");
  schedule->add_flag("--json", a.json, "print JSON");
  schedule->add_flag(
      "--csv",
      a.csv,
      "print torch.distributed.pipelining's compute-only action CSV");
  schedule->add_flag(
      "--csv-comms",
      a.csvComms,
      "print the action CSV with its transfers (SEND_F, RECV_F, SEND_B, RECV_B)");
  return schedule;
}

CLI::App* addTune(CLI::App& app, Arguments& a) {
  auto* tune = app.add_subcommand(
      "tune",
      "choose stages, threads, micro-batches, schedule and checkpoint mode by a calibrated simulation");
  tune->add_option(
          "config",
          a.configPath,
          "JSON config file (default: the built-in one)")
      ->check(CLI::ExistingFile);
  tune->add_option(
      "--set", a.overrides, "override a config value: key.path=value");
  tune->add_option(
          "--top", a.tune.top, "candidates shown and measured (default 10)")
      ->check(CLI::Range(1, 1000));
  tune->add_flag(
      "--measure",
      a.tune.measure,
      "run the top candidates side by side; the fastest measured is chosen");
  tune->add_flag(
      "--quick",
      a.tune.quick,
      "calibrate as briefly as pipeline.auto does before training");
  tune->add_flag(
      "--json", a.json, "print the choice and every candidate as JSON");
  tune->add_option(
      "--write",
      a.writePath,
      "write the config with the chosen pipeline section");
  tune->add_option(
          "--cluster",
          a.clusterPath,
          "plan for a described cluster (docs/tune.md) from FLOPs, not measurement")
      ->check(CLI::ExistingFile);
  return tune;
}

int runTune(Arguments& a) {
  const nlohmann::json json = configJson(a.configPath, a.overrides);
  const tpipe::Config config = tpipe::parseConfig(json);
  if (!a.writePath.empty()) {
    // Checked before a tune of minutes. The config itself may be named: it
    // is read whole first, and replaced whole by the tuned one.
    tpipe::checkOutputPath("--write", a.writePath);
    std::vector<tpipe::RunInput> inputs = tpipe::inputsOf(config);
    inputs.push_back({"--cluster", a.clusterPath});
    tpipe::refuseOutputsOverInputs({{"--write", a.writePath}}, inputs);
  }
  a.tune.log = &std::cerr;
  tpipe::TuneOutcome outcome;
  if (a.clusterPath.empty()) {
    outcome = tpipe::tuneConfig(config, a.tune);
  } else {
    const nlohmann::json cluster =
        tpipe::readJsonFile(a.clusterPath, "--cluster " + a.clusterPath);
    outcome = tpipe::tuneForCluster(config, cluster, a.clusterPath);
  }
  const tpipe::TuneCandidate& choice =
      outcome.result.candidates[outcome.result.choice];
  if (!a.writePath.empty()) {
    if (choice.dataParallel > 1)
      throw tpipe::ConfigError(
          "--write: the choice runs " + std::to_string(choice.dataParallel) +
          " replicas; write it for a cluster run by hand");
    tpipe::writeOutputFile(
        a.writePath, tpipe::configWithPlan(json, choice).dump(2) + "\n");
  }
  if (a.json) {
    nlohmann::json out = tpipe::tuneResultToJson(outcome.result);
    out["calibration"] = outcome.calibration;
    std::cout << out.dump(1) << '\n';
    return 0;
  }
  for (const auto& line : outcome.calibration)
    std::cout << "calibration: " << line << "\n";
  std::cout << "costs: " << outcome.result.costSource << "; "
            << outcome.result.candidates.size() << " candidates ("
            << outcome.result.feasible() << " feasible) searched in "
            << static_cast<long long>(outcome.result.searchMs) << " ms\n";
  tpipe::printTuneTable(std::cout, outcome.result, a.tune.top);
  if (!a.writePath.empty())
    std::cout << "wrote " << a.writePath << "\n";
  return 0;
}

int runProfile(Arguments& a) {
  tpipe::refuseOutputsOverInputs(
      {{"--out", a.profileOut}}, {{"the config", a.configPath}});
  profileCommand(a.configPath, a.overrides, a.profileOut);
  if (a.profileSteps <= 0)
    return 0;
  tpipe::Config config =
      tpipe::parseConfig(configJson(a.configPath, a.overrides));
  config.train.steps = a.profileSteps + 2; // two warm-up steps
  config.train.evalEvery = 0;
  a.train.recordSteps = a.profileSteps;
  a.train.evaluate = false;
  a.train.configPath = a.configPath;
  std::cout << "\nrunning " << a.profileSteps
            << " recorded steps (after 2 warm-up steps)\n";
  tpipe::train(config, a.train);
  return 0;
}

// The subcommands that parsed, run; their errors become exit codes here.
// The value of `--flag VALUE` or `--flag=VALUE` among a command's words;
// empty when absent.
std::string flagValue(
    const std::vector<std::string>& words,
    const std::string& flag) {
  for (size_t i = 0; i < words.size(); ++i) {
    if (words[i] == flag && i + 1 < words.size())
      return words[i + 1];
    if (words[i].rfind(flag + "=", 0) == 0)
      return words[i].substr(flag.size() + 1);
  }
  return "";
}

// `tpipe launch --max-restarts K`: each failed attempt (not one the user
// stopped) is followed by a new one, which resumes from the --save
// directory's last checkpoint (--resume auto), until one succeeds or K
// restarts are spent. The new attempt has the same ranks, or with
// --min-nproc M one fewer while M remain: the failed rank's host or device
// is taken as gone, and the job re-plans for the ranks that are left.
int launchWithRestarts(
    int processes,
    int maxRestarts,
    int minProcesses,
    std::vector<std::string> arguments) {
  const bool predicting = arguments.front() == "predict";
  const std::string saveDir = flagValue(arguments, "--save");
  if (minProcesses > 0 && maxRestarts == 0) {
    throw tpipe::ConfigError(
        "launch: --min-nproc says how far restarts may shrink the job; give "
        "--max-restarts too");
  }
  if (minProcesses > processes) {
    throw tpipe::ConfigError(
        "launch: --min-nproc " + std::to_string(minProcesses) +
        " exceeds --nproc " + std::to_string(processes));
  }
  if (maxRestarts > 0) {
    if (predicting)
      throw tpipe::ConfigError(
          "launch: --max-restarts restarts training, not predict");
    if (saveDir.empty()) {
      throw tpipe::ConfigError(
          "launch: --max-restarts needs --save DIR, so that a restart resumes from "
          "the last checkpoint instead of starting over");
    }
    const std::string resume = flagValue(arguments, "--resume");
    if (!resume.empty() && resume != "auto") {
      throw tpipe::ConfigError(
          "launch: with --max-restarts, give --resume auto (or no --resume): a "
          "restart resumes from --save " +
          saveDir + ", not from " + resume);
    }
    if (resume.empty()) {
      arguments.push_back("--resume");
      arguments.push_back("auto");
    }
  }
  std::chrono::steady_clock::time_point since{};
  for (int restart = 0;; ++restart) {
    const tpipe::LaunchOutcome outcome = tpipe::launchAttempt(
        "/proc/self/exe", processes, arguments, since, tpipe::runCommandLine);
    if (outcome.status == 0 || outcome.stopped || maxRestarts == 0)
      return outcome.status;
    if (restart == maxRestarts) {
      std::cout << "launch: rank " << outcome.failedRank
                << " failed (exit status " << outcome.status
                << ") and no restarts are left (" << maxRestarts
                << " used); giving up" << std::endl;
      return outcome.status;
    }
    const std::optional<int64_t> step = tpipe::committedStep(saveDir);
    const bool shrink = minProcesses > 0 && processes - 1 >= minProcesses;
    if (shrink)
      --processes;
    // A rank that failed because a peer stopped answering names that peer:
    // the peer is the one to leave out.
    const int culprit =
        outcome.lostRank >= 0 ? outcome.lostRank : outcome.failedRank;
    std::cout << "launch: rank " << outcome.failedRank
              << " failed (exit status " << outcome.status << ")"
              << (culprit != outcome.failedRank
                      ? ", having lost rank " + std::to_string(culprit)
                      : std::string())
              << "; restart " << restart + 1 << " of " << maxRestarts << ": "
              << processes << " ranks"
              << (shrink ? " (without rank " + std::to_string(culprit) +
                          "'s place)"
                         : std::string())
              << ", "
              << (step ? "resuming from step " + std::to_string(*step) +
                          " in " + saveDir
                       : "no checkpoint yet, starting over")
              << std::endl;
    since = outcome.failedAt;
  }
}

struct Subcommands {
  CLI::App *train, *launch, *validate, *plan, *profile, *schedule, *tune,
      *predict, *plot;
};

int dispatch(const Subcommands& c, Arguments& a) {
  if (*c.train) {
    const tpipe::Config config =
        tpipe::parseConfig(configJson(a.configPath, a.overrides));
    if (a.train.runName.empty()) {
      a.train.runName = a.configPath.empty()
          ? std::string("the built-in Fashion-MNIST CNN")
          : std::filesystem::path(a.configPath).filename().string();
    }
    a.train.configPath = a.configPath;
    const tpipe::TrainSummary summary = tpipe::train(config, a.train);
    return summary.stopSignal ? 128 + summary.stopSignal : 0;
  }
  if (*c.launch) {
    const std::vector<std::string> arguments = c.launch->remaining();
    if (arguments.empty())
      throw tpipe::ConfigError("launch: give a CONFIG after --nproc N");
    return launchWithRestarts(
        a.processes, a.maxRestarts, a.minProcesses, arguments);
  }
  if (*c.plot)
    return plotCommand(a);
  if (*c.predict) {
    a.predict.configPath = a.configPath;
    tpipe::predict(
        tpipe::parseConfig(configJson(a.configPath, a.overrides)), a.predict);
    return 0;
  }
  if (*c.validate)
    return validateConfig(a.configPath, a.overrides);
  if (*c.plan) {
    if (a.configPath.empty() && a.profilePath.empty()) {
      throw tpipe::ConfigError("plan: give a CONFIG or --profile FILE");
    }
    return planCommand(
        a.configPath, a.overrides, a.profilePath, a.planStages, a.json);
  }
  if (*c.profile)
    return runProfile(a);
  if (*c.tune)
    return runTune(a);
  a.schedule.spec.checkpoint = tpipe::parseCheckpointMode(a.checkpoint);
  return printSchedule(a.schedule, a.json, a.csv, a.csvComms);
}

} // namespace

void tpipe::endProcess(int status) {
  flushOutput();
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  std::exit(status);
#else
  std::_Exit(status);
#endif
}

int tpipe::runCommandLine(int argc, char** argv) {
  CLI::App app{"tpipe: pipeline-parallel training on LibTorch"};
  app.require_subcommand(1);
  Arguments arguments;
  const Subcommands commands{
      addTrain(app, arguments),
      addLaunch(app, arguments),
      addValidate(app, arguments),
      addPlan(app, arguments),
      addProfile(app, arguments),
      addSchedule(app, arguments),
      addTune(app, arguments),
      addPredict(app, arguments),
      addPlot(app, arguments)};
  try {
    app.parse(argc, argv);
  } catch (const CLI::Success&) {
    std::cout << app.help(); // --help
    return 0;
  } catch (const CLI::ParseError& error) {
    // CLI11's own exit codes (105, 106, ...) are not tpipe's: a usage error
    // is a user error.
    std::cerr << app.help() << std::endl;
    exitWith(2, error.what());
  }
  holdStopSignalsIfLaunched();
  try {
    return dispatch(commands, arguments);
  } catch (const tpipe::UserError&
               error) { // configs, files, schedules, partitions, peers
    exitWith(2, error.what());
  } catch (const nlohmann::json::exception&
               error) { // a value of the wrong type in a user's file
    exitWith(2, "a JSON value of the wrong type: " + libraryText(error.what()));
  } catch (const c10::Error& error) {
    exitWith(1, error.what_without_backtrace());
  } catch (const std::exception& error) {
    exitWith(1, error.what());
  }
}
