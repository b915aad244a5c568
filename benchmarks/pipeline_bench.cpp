// Pipeline benchmark: stages x micro-batches x schedules x checkpoint modes
// on a balanced stack, against the 1-stage pipeline (same threads per stage)
// and plain LibTorch training with every core, all in one run; plus the
// per-instruction dispatch overhead, the recompute overhead, the example
// configs, and peak memory per stage by schedule against theory.
// Prints tables; writes JSON to argv[1] (default pipeline.json).
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <thread>

#include <nlohmann/json.hpp>

#include "tpipe/config.h"
#include "tpipe/model.h"
#include "tpipe/pipeline.h"
#include "tpipe/planning.h"
#include "tpipe/trainer.h"

namespace {

using Clock = std::chrono::steady_clock;
using tpipe::CheckpointMode;

const int kCores =
    static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

torch::Tensor crossEntropy(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

torch::nn::Sequential balancedStack(int blocks, int width) {
  torch::manual_seed(0);
  torch::nn::Sequential net;
  for (int b = 0; b < blocks; ++b) {
    net->push_back(torch::nn::Linear(width, width));
    net->push_back(torch::nn::Tanh());
  }
  return net;
}

struct Measured {
  double stepMs = 0.0;
  tpipe::BubbleReport bubble;
  int64_t peakBytes = 0; // largest device's worker peak
  std::vector<int64_t> peaks;
};

Measured timePipeline(
    const tpipe::LayerList& layers,
    tpipe::PipelineOptions options,
    const torch::Tensor& x,
    const torch::Tensor& y,
    int warmup,
    int steps,
    bool memory = true) {
  options.record = false;
  options.trackMemory = memory;
  options.keepSteps = steps;
  tpipe::Pipeline pipe(layers, options);
  for (int s = 0; s < warmup; ++s)
    pipe.trainStep(x, y, crossEntropy);
  pipe.resetPeakMemory();
  std::vector<double> times;
  for (int s = 0; s < steps; ++s) {
    const auto start = Clock::now();
    pipe.trainStep(x, y, crossEntropy);
    times.push_back(
        std::chrono::duration<double, std::milli>(Clock::now() - start)
            .count());
  }
  Measured m;
  m.stepMs = median(times);
  for (const auto& device : pipe.memory()) {
    m.peaks.push_back(device.peakBytes);
    m.peakBytes = std::max(m.peakBytes, device.peakBytes);
  }
  // The bubble from separately recorded steps, so timing above is clean.
  pipe.setRecording(true);
  for (int s = 0; s < 3; ++s)
    pipe.trainStep(x, y, crossEntropy);
  m.bubble = tpipe::bubbleReport(pipe.trace());
  for (auto& p : pipe.parameters())
    p.mutable_grad() = torch::Tensor();
  return m;
}

double timePlain(
    torch::nn::Sequential& net,
    const torch::Tensor& x,
    const torch::Tensor& y,
    int warmup,
    int steps) {
  at::set_num_threads(kCores);
  std::vector<double> times;
  for (int s = 0; s < warmup + steps; ++s) {
    const auto start = Clock::now();
    crossEntropy(net->forward(x), y).backward();
    if (s >= warmup)
      times.push_back(
          std::chrono::duration<double, std::milli>(Clock::now() - start)
              .count());
  }
  for (auto& p : net->parameters())
    p.mutable_grad() = torch::Tensor();
  return median(times);
}

std::vector<std::string> cpus(int n) {
  std::vector<std::string> devices;
  for (int i = 0; i < n; ++i)
    devices.push_back("cpu:" + std::to_string(i));
  return devices;
}

// p CPU devices, m micro-batches, one intra-op thread per stage.
tpipe::PipelineOptions benchOptions(
    int p,
    int m,
    const char* schedule,
    CheckpointMode mode) {
  tpipe::PipelineOptions options;
  options.devices = cpus(p);
  options.microBatches = m;
  options.schedule = schedule;
  options.checkpoint = mode;
  options.threadsPerDevice = 1;
  return options;
}

nlohmann::json sweep() {
  const int blocks = 8, width = 384, batch = 256;
  torch::nn::Sequential net = balancedStack(blocks, width);
  const tpipe::LayerList layers = tpipe::layersOf(net);
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({batch, width});
  const torch::Tensor y = torch::randint(0, width, {batch}, torch::kLong);
  const double plainMs = timePlain(net, x, y, 2, 7);
  std::printf(
      "balanced stack: %d x (linear %d + tanh), batch %d, 1 intra-op thread per stage; plain LibTorch "
      "(%d threads): %.2f ms/step = %.0f samples/s\n",
      blocks,
      width,
      batch,
      kCores,
      plainMs,
      batch * 1000.0 / plainMs);
  std::printf(
      "%-3s %-3s %-17s %-12s %9s %8s %8s %7s %6s %8s %8s %8s %9s %10s\n",
      "p",
      "m",
      "schedule",
      "checkpoint",
      "step ms",
      "samp/s",
      "vs 1stg",
      "ideal",
      "eff",
      "vs plain",
      "bubble",
      "theory",
      "simulated",
      "overhead");
  nlohmann::json rows = nlohmann::json::array();
  std::map<std::pair<int, int>, double> oneStage; // (m, checkpoint) -> step ms
  for (int p : {1, 2, 4}) {
    for (int m : {2, 8, 16}) {
      for (const char* schedule :
           {"gpipe", "1f1b", "zb-h1", "interleaved-1f1b"}) {
        const bool interleaved = std::string(schedule) == "interleaved-1f1b";
        if (p == 1 && std::string(schedule) != "gpipe")
          continue;
        if (interleaved && m % p != 0)
          continue;
        for (auto mode : {CheckpointMode::kNever, CheckpointMode::kAlways}) {
          tpipe::PipelineOptions options;
          options.devices = cpus(p);
          options.microBatches = m;
          options.schedule = schedule;
          options.virtualStages = interleaved ? 2 : 1;
          options.checkpoint = mode;
          options.threadsPerDevice = 1;
          const Measured r = timePipeline(layers, options, x, y, 2, 7);
          if (p == 1)
            oneStage[{m, static_cast<int>(mode)}] = r.stepMs;
          const double base = oneStage[{m, static_cast<int>(mode)}];
          const double speedup = base / r.stepMs;
          const double ideal = static_cast<double>(m) * p / (m + p - 1);
          const double overhead =
              r.stepMs / std::max(r.bubble.simulatedStepMs, 1e-9);
          std::printf(
              "%-3d %-3d %-17s %-12s %9.2f %8.0f %7.2fx %6.2fx %5.0f%% %7.2fx %7.1f%% %7.1f%% %8.1f%% %9.3f\n",
              p,
              m,
              schedule,
              tpipe::checkpointModeName(mode),
              r.stepMs,
              batch * 1000.0 / r.stepMs,
              speedup,
              ideal,
              100 * speedup / ideal,
              plainMs / r.stepMs,
              100 * r.bubble.measuredBubble,
              100 * r.bubble.theoreticalBubble,
              100 * r.bubble.simulatedBubble,
              overhead);
          rows.push_back(
              {{"stages", p},
               {"micro_batches", m},
               {"schedule", schedule},
               {"checkpoint", tpipe::checkpointModeName(mode)},
               {"step_ms", r.stepMs},
               {"samples_per_s", batch * 1000.0 / r.stepMs},
               {"speedup_vs_1_stage", speedup},
               {"ideal_speedup", ideal},
               {"speedup_vs_plain_libtorch", plainMs / r.stepMs},
               {"measured_bubble", r.bubble.measuredBubble},
               {"theoretical_bubble", r.bubble.theoreticalBubble},
               {"simulated_bubble", r.bubble.simulatedBubble},
               {"overhead_measured_over_simulated", overhead},
               {"peak_worker_bytes", r.peaks}});
        }
      }
    }
  }
  return {
      {"plain_libtorch_ms", plainMs},
      {"threads_plain", kCores},
      {"rows", rows}};
}

// Identity layers: a step is nothing but dispatch, transfers and bookkeeping.
// Per instruction: the step's time outside compute instructions (from a
// recorded trace) over the rank's instruction count; on 1 stage that is the
// executor's own cost, on 2 it also holds the waits of the pipeline fill.
nlohmann::json dispatchOverhead() {
  torch::nn::Sequential net;
  for (int i = 0; i < 4; ++i)
    net->push_back(torch::nn::Identity());
  net->push_back(torch::nn::Linear(4, 2)); // something for the loss to reach
  const tpipe::LayerList layers = tpipe::layersOf(net);
  const int m = 64;
  const torch::Tensor x = torch::randn({m, 4});
  const torch::Tensor y = torch::randint(0, 2, {m}, torch::kLong);
  nlohmann::json rows = nlohmann::json::array();
  std::printf(
      "\ndispatch overhead (identity layers, %d micro-batches of 1 sample)\n",
      m);
  std::printf(
      "%-3s %-8s %10s %12s %18s %18s\n",
      "p",
      "schedule",
      "step ms",
      "instr/rank",
      "step us/instr",
      "non-compute us/instr");
  for (int p : {1, 2}) {
    for (const char* schedule : {"gpipe", "1f1b"}) {
      tpipe::PipelineOptions options =
          benchOptions(p, m, schedule, CheckpointMode::kNever);
      const Measured r = timePipeline(layers, options, x, y, 3, 15, false);
      tpipe::Pipeline probe(layers, options);
      size_t instructions = 0;
      for (const auto& list : probe.schedule().perRank)
        instructions = std::max(instructions, list.size());
      double nonCompute = 0.0;
      for (const auto& rank : r.bubble.ranks) {
        nonCompute = std::max(
            nonCompute,
            1000.0 * (rank.wallMs - rank.computeMs) /
                static_cast<double>(instructions));
      }
      const double perInstruction =
          1000.0 * r.stepMs / static_cast<double>(instructions);
      std::printf(
          "%-3d %-8s %10.3f %12zu %18.2f %18.2f\n",
          p,
          schedule,
          r.stepMs,
          instructions,
          perInstruction,
          nonCompute);
      rows.push_back(
          {{"stages", p},
           {"schedule", schedule},
           {"step_ms", r.stepMs},
           {"instructions_per_rank", instructions},
           {"step_us_per_instruction", perInstruction},
           {"non_compute_us_per_instruction", nonCompute}});
    }
  }
  return rows;
}

nlohmann::json exampleConfigs() {
  std::printf(
      "\nexample configs (synthetic inputs of each config's shape; steps timed without data loading)\n");
  std::printf(
      "%-20s %-9s %10s %10s %10s %9s %9s %9s %10s %10s\n",
      "config",
      "stages",
      "pipe ms",
      "1-stage ms",
      "plain ms",
      "vs 1stg",
      "vs plain",
      "bubble",
      "simulated",
      "recording");
  nlohmann::json rows = nlohmann::json::array();
  for (const char* name :
       {"fashion_mnist_cnn", "char_transformer", "mlp_synthetic"}) {
    tpipe::Config config = tpipe::loadConfig(
        std::string(TPIPE_SOURCE_DIR) + "/configs/" + name + ".json");
    tpipe::BuiltModel model = tpipe::buildModel(config.model, 0);
    const auto& shape = model.shapes.front();
    std::vector<int64_t> sizes{config.train.batchSize};
    sizes.insert(sizes.end(), shape.begin(), shape.end());
    torch::manual_seed(2);
    const torch::Tensor x = model.integerInput
        ? torch::randint(256, sizes, torch::kLong)
        : torch::randn(sizes);
    const auto& out = model.shapes.back();
    std::vector<int64_t> targetSizes{config.train.batchSize};
    if (out.size() == 2)
      targetSizes.push_back(out[0]);
    const torch::Tensor y =
        torch::randint(out.back(), targetSizes, torch::kLong);
    auto lossFn = [](const torch::Tensor& o, const torch::Tensor& t) {
      return torch::nn::functional::cross_entropy(
          o.reshape({-1, o.size(-1)}), t.reshape({-1}));
    };
    // Steps alternate recording off and on, so the recording overhead is
    // measured side by side; the step time is the unrecorded median.
    struct Timed {
      double ms, recordedMs;
      tpipe::BubbleReport bubble;
    };
    auto timeOf = [&](tpipe::PipelineOptions options) {
      tpipe::Pipeline pipe(model.layers, options);
      std::vector<double> plainTimes, recordedTimes;
      for (int s = 0; s < 16; ++s) {
        pipe.setRecording(s % 2 == 1);
        const auto start = Clock::now();
        pipe.trainStep(x, y, lossFn);
        const double ms =
            std::chrono::duration<double, std::milli>(Clock::now() - start)
                .count();
        if (s >= 2)
          (s % 2 ? recordedTimes : plainTimes).push_back(ms);
      }
      return Timed{
          median(plainTimes),
          median(recordedTimes),
          tpipe::bubbleReport(pipe.trace())};
    };
    tpipe::PipelineOptions options;
    options.devices.clear();
    for (const auto& d : config.pipeline.devices)
      options.devices.push_back(d.name);
    options.microBatches = config.pipeline.microBatches;
    options.schedule = config.pipeline.schedule;
    options.checkpoint = config.pipeline.checkpoint;
    options.balance = config.pipeline.balance;
    if (config.pipeline.partition == tpipe::PartitionMethod::kTime) {
      const tpipe::TrainingCosts costs =
          tpipe::trainingCosts(config, model, "", true);
      options.balance = tpipe::balanceOf(
          tpipe::resolvePlan(tpipe::planRequest(config, costs)).boundaries);
    }
    const auto piped = timeOf(options);
    tpipe::PipelineOptions single = options;
    single.devices = {"cpu:0"};
    single.balance.clear();
    single.stages = 1;
    single.threadsPerDevice = 1;
    const auto one = timeOf(single);
    at::set_num_threads(kCores);
    std::vector<double> plain;
    for (int s = 0; s < 8; ++s) {
      const auto start = Clock::now();
      torch::Tensor h = x;
      for (auto& layer : model.layers)
        h = layer.module.forward(h);
      lossFn(h, y).backward();
      if (s >= 2)
        plain.push_back(
            std::chrono::duration<double, std::milli>(Clock::now() - start)
                .count());
    }
    const double plainMs = median(plain);
    const double recording = 100.0 * (piped.recordedMs / piped.ms - 1.0);
    std::printf(
        "%-20s %-9zu %10.2f %10.2f %10.2f %8.2fx %8.2fx %8.1f%% %9.1f%% %+9.1f%%\n",
        name,
        options.devices.size(),
        piped.ms,
        one.ms,
        plainMs,
        one.ms / piped.ms,
        plainMs / piped.ms,
        100 * piped.bubble.measuredBubble,
        100 * piped.bubble.simulatedBubble,
        recording);
    rows.push_back(
        {{"config", name},
         {"pipeline_ms", piped.ms},
         {"one_stage_ms", one.ms},
         {"plain_libtorch_ms", plainMs},
         {"measured_bubble", piped.bubble.measuredBubble},
         {"simulated_bubble", piped.bubble.simulatedBubble},
         {"theoretical_bubble", piped.bubble.theoreticalBubble},
         {"recorded_step_ms", piped.recordedMs},
         {"recording_overhead_percent", recording}});
  }
  return rows;
}

// Peak activation memory per stage by schedule and checkpoint mode, in
// units of one micro-batch of a stage's stashed activations, against theory.
nlohmann::json memoryBySchedule() {
  const int p = 4, m = 8, width = 256, batch = 2048;
  torch::nn::Sequential net = balancedStack(4, width);
  const tpipe::LayerList layers = tpipe::layersOf(net);
  const torch::Tensor x = torch::randn({batch, width});
  const torch::Tensor y = torch::randint(0, width, {batch}, torch::kLong);
  // A stage is (linear, tanh): per micro-batch it keeps the linear's output
  // and the tanh's output, [batch / m, width] floats each.
  const double unit = 2.0 * (batch / m) * width * 4;
  const double gradients =
      (width * width + width) * 4.0; // one linear per stage
  std::printf(
      "\npeak activations per stage (p=%d, m=%d), in units of one micro-batch of a stage's stashed "
      "activations (%.0f KiB): (worker peak - weight gradients) / unit\n",
      p,
      m,
      unit / 1024);
  std::printf(
      "%-8s %-12s %-30s %-30s\n",
      "schedule",
      "checkpoint",
      "measured units (device 0..)",
      "schedule's prediction");
  nlohmann::json rows = nlohmann::json::array();
  for (const char* schedule :
       {"gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v", "auto"}) {
    for (auto mode :
         {CheckpointMode::kNever,
          CheckpointMode::kExceptLast,
          CheckpointMode::kAlways}) {
      // zb-v: the same 4 stages, two per device on 2 devices.
      const bool v = std::string(schedule) == "zb-v";
      const int ranks = v ? p / 2 : p;
      tpipe::PipelineOptions options = benchOptions(ranks, m, schedule, mode);
      options.virtualStages = v ? 2 : 1;
      const Measured r = timePipeline(layers, options, x, y, 1, 2);
      tpipe::ScheduleSpec spec;
      spec.source = schedule;
      spec.ranks = ranks;
      spec.microBatches = m;
      spec.virtualStages = v ? 2 : 1;
      spec.checkpoint = mode;
      const tpipe::Schedule plan = tpipe::makeSchedule(spec);
      const tpipe::MemoryModel model = tpipe::memoryModelOf(plan, 0, 0);
      std::string measured, theory;
      std::vector<double> units;
      for (int d = 0; d < ranks; ++d) {
        const std::vector<int> stages = plan.stagesOfRank(d);
        char cell[32];
        const double u = (static_cast<double>(r.peaks[d]) -
                          gradients * static_cast<double>(stages.size())) /
            unit;
        std::snprintf(cell, sizeof cell, "%6.2f ", u);
        measured += cell;
        units.push_back(u);
        // The schedule's own prediction: a unit is a stage input plus the
        // tanh output; stage 0's input is the caller's batch, not the
        // worker's. Held micro-batches keep their input; live ones (not
        // rematerialized, or recomputed and awaiting their passes) also the
        // tanh output.
        double expected = 0.0;
        for (int s : stages) {
          const double input = s == 0 ? 0.0 : 0.5;
          expected += model.stashedAt(s) * input + model.liveAt(s) * 0.5;
        }
        std::snprintf(cell, sizeof cell, "%6.2f ", expected);
        theory += cell;
      }
      std::printf(
          "%-8s %-12s %-30s %-30s\n",
          schedule,
          tpipe::checkpointModeName(mode),
          measured.c_str(),
          theory.c_str());
      rows.push_back(
          {{"schedule", schedule},
           {"checkpoint", tpipe::checkpointModeName(mode)},
           {"measured_units_per_stage", units},
           {"theory", theory},
           {"unit_bytes", unit}});
    }
  }
  std::printf(
      "(prediction: from the schedule's simulation, per stage held micro-batches x stage input + live ones x "
      "stashed output; the backward's workspace comes on top)\n");
  return rows;
}

} // namespace

// Dropout from the stage's own generator (LibTorch's Dropout as a layer of
// its own, which the runtime runs so) against the same layers declared
// kDraws, whose stage swaps its state into the process-wide generator under
// one lock for the whole forward (what any dropout inside a module of the
// user's gets): the same weights and masks, side by side, alternating.
// Under GPipe the two stages' forwards overlap, which the lock serializes.
nlohmann::json dropoutGenerators() {
  const int p = 2, m = 8;
  nlohmann::json layers = nlohmann::json::array();
  for (int block = 0; block < 4; ++block) {
    layers.push_back({{"type", "linear"}, {"out_features", 512}});
    layers.push_back({{"type", "tanh"}});
    layers.push_back({{"type", "dropout"}, {"p", 0.1}});
  }
  layers.push_back({{"type", "linear"}, {"out_features", 512}});
  const tpipe::ModelConfig model =
      tpipe::parseConfig(
          {{"model", {{"input_shape", {512}}, {"layers", layers}}},
           {"data", {{"dataset", "synthetic"}, {"samples", 256}}},
           {"pipeline", {{"devices", {"cpu:0"}}}},
           {"train",
            {{"batch_size", 256}, {"steps", 1}, {"loss", "cross_entropy"}}}})
          .model;
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({256, 512});
  const torch::Tensor y = torch::randint(0, 512, {256}, torch::kLong);
  std::printf(
      "\ndropout 0.1, %d stages x 2 x (Linear 512 + Tanh + Dropout), batch 256, "
      "%d micro-batches, gpipe\n",
      p,
      m);
  std::printf(
      "%-12s %14s %14s %8s\n",
      "checkpoint",
      "own gen. ms",
      "locked ms",
      "ratio");
  nlohmann::json rows = nlohmann::json::array();
  for (auto mode : {CheckpointMode::kNever, CheckpointMode::kAlways}) {
    std::vector<double> own, shared, ratios;
    for (int round = 0; round < 5; ++round) {
      for (bool locked : {round % 2 == 1, round % 2 == 0}) {
        tpipe::LayerList net = tpipe::buildModel(model, 3).layers;
        for (auto& layer : net) {
          if (layer.module.ptr()->name().find("Dropout") != std::string::npos) {
            layer.module = torch::nn::AnyModule(torch::nn::Dropout(0.1));
            if (locked)
              layer.randomness = tpipe::Randomness::kDraws;
          }
        }
        tpipe::PipelineOptions options = benchOptions(p, m, "gpipe", mode);
        const double ms = timePipeline(net, options, x, y, 1, 3, false).stepMs;
        (locked ? shared : own).push_back(ms);
      }
      ratios.push_back(own.back() / shared.back());
    }
    std::printf(
        "%-12s %14.2f %14.2f %8.3f\n",
        tpipe::checkpointModeName(mode),
        median(own),
        median(shared),
        median(ratios));
    rows.push_back(
        {{"checkpoint", tpipe::checkpointModeName(mode)},
         {"own_generator_ms", median(own)},
         {"locked_ms", median(shared)},
         {"own_over_locked", median(ratios)}});
  }
  return rows;
}

// The cost of replaying random numbers: every layer declared as drawing
// (each forward swaps the stage's generator in under the shared lock) against
// declared deterministic, side by side, alternating.
nlohmann::json randomnessCost() {
  const int p = 2, m = 8;
  torch::nn::Sequential net = balancedStack(8, 512);
  torch::manual_seed(1);
  const torch::Tensor x = torch::randn({256, 512});
  const torch::Tensor y = torch::randint(0, 512, {256}, torch::kLong);
  std::printf(
      "\nrandomness replay, %d stages x 4 x (Linear 512 + Tanh), batch 256, %d micro-batches\n",
      p,
      m);
  std::printf(
      "%-12s %12s %12s %8s\n", "checkpoint", "none ms", "draws ms", "cost");
  nlohmann::json rows = nlohmann::json::array();
  for (auto mode : {CheckpointMode::kNever, CheckpointMode::kAlways}) {
    std::vector<double> none, draws;
    for (int round = 0; round < 5; ++round) {
      for (auto declared :
           {tpipe::Randomness::kNone, tpipe::Randomness::kDraws}) {
        tpipe::LayerList layers = tpipe::layersOf(net);
        for (auto& layer : layers)
          layer.randomness = declared;
        tpipe::PipelineOptions options = benchOptions(p, m, "1f1b", mode);
        const double ms =
            timePipeline(layers, options, x, y, 1, 3, false).stepMs;
        (declared == tpipe::Randomness::kNone ? none : draws).push_back(ms);
      }
    }
    const double cost = median(draws) / median(none) - 1.0;
    std::printf(
        "%-12s %12.2f %12.2f %+7.1f%%\n",
        tpipe::checkpointModeName(mode),
        median(none),
        median(draws),
        100.0 * cost);
    rows.push_back(
        {{"checkpoint", tpipe::checkpointModeName(mode)},
         {"none_ms", median(none)},
         {"draws_ms", median(draws)},
         {"relative_cost", cost}});
  }
  return {{"declared", rows}, {"dropout", dropoutGenerators()}};
}

// Steps back to back, with a barrier (trainStep, then one optimizer step)
// and without (postStep: each rank steps its own optimizer when its part
// ends, and starts the next step behind it). Staggered schedules (ZB-H2,
// ZB-V) end their ranks at different times, which only the second collects.
double msPerStep(
    const tpipe::LayerList& layers,
    const tpipe::PipelineOptions& options,
    const torch::Tensor& x,
    const torch::Tensor& y,
    bool overlap,
    int steps) {
  tpipe::Pipeline pipe(layers, options);
  const auto sgd = torch::optim::SGDOptions(0.001).momentum(0.9);
  std::vector<std::unique_ptr<torch::optim::SGD>> perRank(
      pipe.schedule().ranks);
  for (int rank : pipe.localRanks())
    perRank[rank] =
        std::make_unique<torch::optim::SGD>(pipe.rankParameters(rank), sgd);
  torch::optim::SGD all(pipe.parameters(), sgd);
  tpipe::Pipeline::Update update;
  update.apply = [&](int rank) { perRank[rank]->step(); };
  auto run = [&](int count) {
    if (!overlap) {
      for (int s = 0; s < count; ++s) {
        pipe.trainStep(x, y, crossEntropy);
        pipe.runOnWorker([&] {
          all.step();
          all.zero_grad();
        });
      }
      return;
    }
    pipe.postStep(x, y, crossEntropy, update);
    for (int s = 0; s < count; ++s) {
      if (s + 1 < count)
        pipe.postStep(x, y, crossEntropy, update);
      pipe.finishStep();
    }
  };
  run(2); // warm-up
  const auto start = Clock::now();
  run(steps);
  return std::chrono::duration<double, std::milli>(Clock::now() - start)
             .count() /
      steps;
}

// Mean duration (ms) of each op kind over the recorded steps.
std::map<std::string, double> meanOpMs(const tpipe::Trace& trace) {
  std::map<std::string, double> sum;
  std::map<std::string, int> count;
  for (const auto& step : trace.steps) {
    for (const auto& event : step.events) {
      const auto& instruction = trace.schedule.perRank[event.rank][event.index];
      const std::string op = tpipe::opName(instruction);
      sum[op] += (event.endUs - event.startUs) / 1000.0;
      ++count[op];
    }
  }
  for (auto& [op, total] : sum)
    total /= count[op];
  return sum;
}

// zb-h1 against 1F1B on one stack, alternating: the step, and the split
// backward (input + weight pass) against the fused one per micro-batch,
// both in the pipeline and with the whole stack on one worker. In the
// pipeline a schedule with less bubble runs more of its passes while the
// other worker computes too, sharing the caches and memory bandwidth, so
// there the ratio also prices that concurrency; alone it is the split's
// own cost.
// `balance`: layers per stage, so that both stages hold equal blocks (a
// uniform split by layer count would give one stage the head's layers and
// an unequal share of blocks, and a bubble no schedule can fill);
// `halfBalance`: the same for zb-v's four half-size stages.
// zb-h2 and zb-v run in the same rounds, against zb-h1, and 1F1B with
// autograd computing its fused backward (PipelineOptions::
// directWeightGradients off), against 1F1B as tpipe runs it.
nlohmann::json zeroBubbleOn(
    const std::string& what,
    const tpipe::LayerList& layers,
    const std::vector<int>& balance,
    const std::vector<int>& halfBalance,
    const torch::Tensor& x,
    const torch::Tensor& y) {
  const int p = 2, m = 8;
  std::printf(
      "\nzero bubble, %d stages x %s, batch %lld, %d micro-batches, checkpoint never,"
      " 1 thread per stage\n",
      p,
      what.c_str(),
      static_cast<long long>(x.size(0)),
      m);
  std::map<std::string, std::vector<double>> steps, simulated;
  std::map<std::string, std::map<std::string, double>> ops, alone;
  std::vector<double> ratios;             // zb-h1 over 1f1b, per round
  std::vector<double> directOverAutograd; // 1f1b's, per round
  std::map<std::string, std::vector<double>> overH1; // per round
  // Back to back (postStep), where ZB-H2's and ZB-V's staggered ends are
  // collected: per round against zb-h1's, and the simulation's steady step.
  std::map<std::string, std::vector<double>> backToBack, steady;
  std::map<std::string, std::vector<double>> backToBackOverH1;
  const int rounds = 7;
  auto recordOps = [&](tpipe::PipelineOptions options,
                       std::map<std::string, double>& into) {
    options.record = true;
    tpipe::Pipeline recorded(layers, options);
    for (int s = 0; s < 3; ++s)
      recorded.trainStep(x, y, crossEntropy);
    for (const auto& [op, ms] : meanOpMs(recorded.trace()))
      into[op] += ms / rounds;
    for (auto& q : recorded.parameters())
      q.mutable_grad() = torch::Tensor();
  };
  for (int round = 0; round < rounds; ++round) {
    // Who goes first alternates, and each round's ratio pairs two
    // measurements taken seconds apart, so the machine's drift over the
    // rounds cancels out of it.
    std::vector<std::string> order{
        "1f1b", "1f1b-autograd", "zb-h1", "zb-h2", "zb-v"};
    if (round % 2)
      std::reverse(order.begin(), order.end());
    for (const std::string& schedule : order) {
      const bool autogradFused = schedule == "1f1b-autograd";
      const std::string kind = autogradFused ? "1f1b" : schedule;
      tpipe::PipelineOptions options =
          benchOptions(p, m, kind.c_str(), CheckpointMode::kNever);
      options.directWeightGradients = !autogradFused;
      options.partition = tpipe::PartitionMethod::kBalance;
      options.balance = schedule == "zb-v" ? halfBalance : balance;
      if (schedule == "zb-v")
        options.virtualStages = 2;
      const Measured r = timePipeline(layers, options, x, y, 2, 5, false);
      steps[schedule].push_back(r.stepMs);
      simulated[schedule].push_back(r.bubble.simulatedStepMs);
      if (kind != "1f1b") {
        backToBack[schedule].push_back(
            msPerStep(layers, options, x, y, /*overlap=*/true, 5));
        steady[schedule].push_back(r.bubble.simulatedSteadyStepMs);
      }
      if (kind != "1f1b" && schedule != "zb-h1")
        continue; // the split's parts: those suffice
      recordOps(options, ops[schedule]);
      tpipe::PipelineOptions oneWorker =
          benchOptions(1, m, kind.c_str(), CheckpointMode::kNever);
      oneWorker.directWeightGradients = !autogradFused;
      recordOps(oneWorker, alone[schedule]);
    }
    ratios.push_back(steps["zb-h1"].back() / steps["1f1b"].back());
    directOverAutograd.push_back(
        steps["1f1b"].back() / steps["1f1b-autograd"].back());
    for (const char* schedule : {"zb-h2", "zb-v"}) {
      overH1[schedule].push_back(
          steps[schedule].back() / steps["zb-h1"].back());
      backToBackOverH1[schedule].push_back(
          backToBack[schedule].back() / backToBack["zb-h1"].back());
    }
  }
  std::printf(
      "%-13s %12s %14s %14s\n",
      "schedule",
      "step ms",
      "simulated ms",
      "meas./sim.");
  for (const char* schedule :
       {"1f1b", "1f1b-autograd", "zb-h1", "zb-h2", "zb-v"}) {
    std::printf(
        "%-13s %12.2f %14.2f %14.3f\n",
        schedule,
        median(steps[schedule]),
        median(simulated[schedule]),
        median(steps[schedule]) / median(simulated[schedule]));
  }
  const double ratio = median(ratios);
  const double simulatedRatio =
      median(simulated["zb-h1"]) / median(simulated["1f1b"]);
  std::printf(
      "zb-h1 / 1f1b step: %.3f, median of %d paired rounds (%.3f-%.3f); "
      "simulated on the measured instruction times %.3f (goal <= 0.97)\n",
      ratio,
      rounds,
      *std::min_element(ratios.begin(), ratios.end()),
      *std::max_element(ratios.begin(), ratios.end()),
      simulatedRatio);
  for (const char* schedule : {"zb-h2", "zb-v"}) {
    const auto& each = overH1[schedule];
    std::printf(
        "%s / zb-h1 step: %.3f, median of %d paired rounds (%.3f-%.3f); "
        "simulated %.3f (goal <= 1)\n",
        schedule,
        median(each),
        rounds,
        *std::min_element(each.begin(), each.end()),
        *std::max_element(each.begin(), each.end()),
        median(simulated[schedule]) / median(simulated["zb-h1"]));
    const auto& posted = backToBackOverH1[schedule];
    std::printf(
        "  back to back (postStep, SGD): %.2f against zb-h1's %.2f ms: "
        "%.3f (%.3f-%.3f); simulated %.3f\n",
        median(backToBack[schedule]),
        median(backToBack["zb-h1"]),
        median(posted),
        *std::min_element(posted.begin(), posted.end()),
        *std::max_element(posted.begin(), posted.end()),
        median(steady[schedule]) / median(steady["zb-h1"]));
  }
  std::printf(
      "1f1b / 1f1b-autograd step: %.3f, median of %d paired rounds "
      "(%.3f-%.3f): the direct weight gradients in a fused backward\n",
      median(directOverAutograd),
      rounds,
      *std::min_element(directOverAutograd.begin(), directOverAutograd.end()),
      *std::max_element(directOverAutograd.begin(), directOverAutograd.end()));
  for (auto* by : {&ops, &alone}) {
    const double direct = (*by)["1f1b"]["backward"];
    const double autograd = (*by)["1f1b-autograd"]["backward"];
    std::printf(
        "  fused backward per micro-batch, %s: %.3f ms direct, %.3f ms "
        "autograd: %.3fx\n",
        by == &ops ? "in the pipeline" : "the whole stack on one worker",
        direct,
        autograd,
        direct / autograd);
  }
  // The split backward against the fused one, per micro-batch, as `by`
  // recorded them.
  auto splitAgainstFused =
      [](const char* where,
         std::map<std::string, std::map<std::string, double>>& by) {
        const double fused = by["1f1b"]["backward"];
        const double input = by["zb-h1"]["backward_input"];
        const double weight = by["zb-h1"]["backward_weight"];
        std::printf(
            "%s: fused %.3f ms; input %.3f + weight %.3f = %.3f ms: %.3fx "
            "(goal <= 1.05)\n",
            where,
            fused,
            input,
            weight,
            input + weight,
            (input + weight) / fused);
        return nlohmann::json{
            {"fused_backward_ms", fused},
            {"input_pass_ms", input},
            {"weight_pass_ms", weight},
            {"split_over_fused", (input + weight) / fused}};
      };
  nlohmann::json row =
      splitAgainstFused("backward per micro-batch and stage", ops);
  row["one_worker"] = splitAgainstFused("the whole stack on one worker", alone);
  row["stack"] = what;
  row["one_f_one_b_direct_over_autograd"] = median(directOverAutograd);
  row["fused_backward_direct_over_autograd_one_worker"] =
      alone["1f1b"]["backward"] / alone["1f1b-autograd"]["backward"];
  for (const char* schedule :
       {"1f1b", "1f1b-autograd", "zb-h1", "zb-h2", "zb-v"}) {
    row["step_ms"][schedule] = median(steps[schedule]);
    row["simulated_step_ms"][schedule] = median(simulated[schedule]);
  }
  for (const char* schedule : {"zb-h2", "zb-v"}) {
    const std::string name(schedule);
    row[name + "_over_zb_h1"] = median(overH1[schedule]);
    row[name + "_over_zb_h1_each_round"] = overH1[schedule];
    row[name + "_over_zb_h1_back_to_back"] = median(backToBackOverH1[schedule]);
    row[name + "_over_zb_h1_back_to_back_simulated"] =
        median(steady[schedule]) / median(steady["zb-h1"]);
  }
  row["zb_h1_over_1f1b"] = ratio;
  row["zb_h1_over_1f1b_each_round"] = ratios;
  row["simulated_zb_h1_over_1f1b"] = simulatedRatio;
  return row;
}

nlohmann::json zeroBubble() {
  nlohmann::json rows = nlohmann::json::array();
  torch::manual_seed(2);
  torch::nn::Sequential linear;
  for (int b = 0; b < 8; ++b) {
    linear->push_back(torch::nn::Linear(1024, 1024));
    linear->push_back(torch::nn::ReLU());
  }
  rows.push_back(zeroBubbleOn(
      "4 x (Linear 1024 + ReLU)",
      tpipe::layersOf(linear),
      {8, 8},
      {4, 4, 4, 4},
      torch::randn({256, 1024}),
      torch::randint(0, 1024, {256}, torch::kLong)));
  torch::nn::Sequential conv;
  for (int b = 0; b < 8; ++b) {
    conv->push_back(
        torch::nn::Conv2d(torch::nn::Conv2dOptions(32, 32, 3).padding(1)));
    conv->push_back(torch::nn::ReLU());
  }
  conv->push_back(torch::nn::Flatten());
  conv->push_back(torch::nn::Linear(32 * 16 * 16, 10));
  rows.push_back(zeroBubbleOn(
      "4 x (Conv2d 32->32 3x3 + ReLU) on 16 x 16",
      tpipe::layersOf(conv),
      {8, 10},
      {4, 4, 4, 6},
      torch::randn({64, 32, 16, 16}),
      torch::randint(0, 10, {64}, torch::kLong)));
  // The registry's pre-LN GPT block: it reports its four Linear products as
  // parts, whose weight pass is direct, as are its layer norms'.
  const tpipe::ModelConfig blocks =
      tpipe::parseConfig(nlohmann::json::parse(R"({
    "model": {"input_shape": [64, 256], "layers": [
      {"type": "transformer_block", "heads": 4}, {"type": "transformer_block", "heads": 4},
      {"type": "transformer_block", "heads": 4}, {"type": "transformer_block", "heads": 4},
      {"type": "flatten"}, {"type": "linear", "out_features": 10}]},
    "data": {"dataset": "synthetic", "samples": 32},
    "pipeline": {"devices": ["cpu:0"]},
    "train": {"batch_size": 32, "steps": 1, "loss": "cross_entropy"}})"))
          .model;
  torch::manual_seed(3);
  rows.push_back(zeroBubbleOn(
      "2 x transformer_block (64 x 256, 4 heads)",
      tpipe::buildModel(blocks, 3).layers,
      {2, 4},
      {1, 1, 1, 3},
      torch::randn({32, 64, 256}),
      torch::randint(0, 10, {32}, torch::kLong)));
  return rows;
}

// Every zero-bubble schedule against 1F1B, side by side (alternating), on a
// balanced stack: step time, and the measured against the simulated step
// (the schedule replayed with the measured mean instruction times).
nlohmann::json scheduleTableFor(int p) {
  torch::manual_seed(3);
  torch::nn::Sequential net = balancedStack(8, 512);
  const torch::Tensor x = torch::randn({256, 512});
  const torch::Tensor y = torch::randint(0, 512, {256}, torch::kLong);
  std::printf(
      "\nschedules, %d devices over %d cores%s, 8 x (Linear 512 + Tanh), batch 256, checkpoint never, 1 thread "
      "per device\n",
      p,
      kCores,
      p > kCores ? " (oversubscribed)" : "");
  std::printf(
      "%-4s %-9s %10s %12s %14s %14s\n",
      "m",
      "sched",
      "step ms",
      "vs 1f1b",
      "bubble meas.",
      "meas./sim.");
  nlohmann::json rows = nlohmann::json::array();
  for (int m : {4, 8, 16}) {
    std::map<std::string, std::vector<double>> steps, ratio, bubble;
    // Every built-in but fill-drain and interleaved (a table against 1F1B,
    // one stage per device or a V).
    std::vector<std::string> schedules;
    for (const std::string& name : tpipe::scheduleNames()) {
      if (name != "gpipe" && name != "interleaved-1f1b")
        schedules.push_back(name);
    }
    for (int round = 0; round < 3; ++round) {
      for (const std::string& schedule : schedules) {
        if (schedule == "dualpipev" && m < 2 * p)
          continue; // it needs as many micro-batches as stages
        if (schedule == "dualpipe" && (m < 2 * p || p % 2))
          continue; // two mirrored halves of the ranks, two chains
        tpipe::PipelineOptions options =
            benchOptions(p, m, schedule.c_str(), CheckpointMode::kNever);
        if (tpipe::isVShaped(tpipe::ScheduleSource(schedule).kind()))
          options.virtualStages = 2; // 2p half-size stages in a V
        const Measured r =
            timePipeline(tpipe::layersOf(net), options, x, y, 1, 3, false);
        steps[schedule].push_back(r.stepMs);
        ratio[schedule].push_back(
            r.bubble.stepMs / std::max(r.bubble.simulatedStepMs, 1e-9));
        bubble[schedule].push_back(r.bubble.measuredBubble);
      }
    }
    for (const std::string& schedule : schedules) {
      if (steps[schedule].empty())
        continue;
      const double step = median(steps[schedule]);
      std::printf(
          "%-4d %-9s %10.2f %12.3f %13.1f%% %14.3f\n",
          m,
          schedule.c_str(),
          step,
          step / median(steps["1f1b"]),
          100 * median(bubble[schedule]),
          median(ratio[schedule]));
      rows.push_back(
          {{"devices", p},
           {"micro_batches", m},
           {"schedule", schedule},
           {"step_ms", step},
           {"over_1f1b", step / median(steps["1f1b"])},
           {"measured_bubble", median(bubble[schedule])},
           {"measured_over_simulated", median(ratio[schedule])}});
    }
  }
  return rows;
}

nlohmann::json scheduleTable() {
  nlohmann::json rows = scheduleTableFor(2);
  for (auto& row : scheduleTableFor(4))
    rows.push_back(row);
  return rows;
}

nlohmann::json overlappedSteps() {
  torch::manual_seed(3);
  torch::nn::Sequential net = balancedStack(8, 512);
  const torch::Tensor x = torch::randn({256, 512});
  const torch::Tensor y = torch::randint(0, 512, {256}, torch::kLong);
  const int steps = 20, m = 8;
  nlohmann::json rows = nlohmann::json::array();
  for (int p : {2, 4}) {
    std::printf(
        "\nsteps back to back, %d devices over %d cores%s, m = %d, 8 x (Linear 512 + Tanh), batch 256, SGD; "
        "ms per step over %d steps, medians of 3 alternating rounds\n",
        p,
        kCores,
        p > kCores ? " (oversubscribed)" : "",
        m,
        steps);
    std::printf(
        "%-7s %12s %12s %10s %12s %12s %12s\n",
        "sched",
        "barrier ms",
        "overlap ms",
        "gain",
        "vs zb-h1",
        "sim. barrier",
        "sim. overlap");
    const char* schedules[] = {"1f1b", "zb-h1", "zb-h2", "zb-v"};
    std::map<std::string, std::vector<double>> barrier, overlapped;
    for (int round = 0; round < 3; ++round) {
      for (const char* schedule : schedules) {
        tpipe::PipelineOptions options =
            benchOptions(p, m, schedule, CheckpointMode::kNever);
        if (std::string(schedule) == "zb-v")
          options.virtualStages = 2;
        barrier[schedule].push_back(
            msPerStep(tpipe::layersOf(net), options, x, y, false, steps));
        overlapped[schedule].push_back(
            msPerStep(tpipe::layersOf(net), options, x, y, true, steps));
      }
    }
    for (auto& parameter : net->parameters())
      parameter.mutable_grad() = torch::Tensor();
    const double h1 = median(overlapped["zb-h1"]);
    for (const char* schedule : schedules) {
      tpipe::PipelineOptions options =
          benchOptions(p, m, schedule, CheckpointMode::kNever);
      if (std::string(schedule) == "zb-v")
        options.virtualStages = 2;
      tpipe::Pipeline pipe(tpipe::layersOf(net), options);
      // Unit costs per rank (F = I = W = 1; a V's half-stages half each):
      // what the simulator predicts with and without the barrier.
      const tpipe::Schedule& plan = pipe.schedule();
      const double share = 1.0 / plan.virtualStages;
      tpipe::StageCosts unit;
      unit.forward = unit.backwardInput = unit.backwardWeight = unit.recompute =
          share;
      unit.backward = 2.0 * share;
      const double simBarrier = tpipe::simulate(plan, {unit}).makespan;
      const double simOverlap = tpipe::steadyStepTime(plan, {unit});
      const double b = median(barrier[schedule]);
      const double o = median(overlapped[schedule]);
      std::printf(
          "%-7s %12.2f %12.2f %9.1f%% %12.3f %12.1f %12.1f\n",
          schedule,
          b,
          o,
          100.0 * (1.0 - o / b),
          o / h1,
          simBarrier,
          simOverlap);
      rows.push_back(
          {{"devices", p},
           {"micro_batches", m},
           {"schedule", schedule},
           {"barrier_ms", b},
           {"overlap_ms", o},
           {"overlap_over_zb_h1", o / h1},
           {"simulated_barrier", simBarrier},
           {"simulated_overlap", simOverlap}});
    }
  }
  return rows;
}

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "pipeline.json";
  const std::string only = argc > 2 ? argv[2] : "all";
  nlohmann::json json;
  json["cores"] = kCores;
  // Before any contender runs: the plain loops get the memory policy that
  // the first Pipeline built would set for everything after it.
  json["freed_memory_kept"] = tpipe::keepFreedHostMemory();
  if (only == "all" || only == "sweep")
    json["sweep"] = sweep();
  if (only == "all" || only == "dispatch")
    json["dispatch"] = dispatchOverhead();
  if (only == "all" || only == "configs")
    json["configs"] = exampleConfigs();
  if (only == "all" || only == "memory")
    json["memory"] = memoryBySchedule();
  if (only == "all" || only == "randomness")
    json["randomness"] = randomnessCost();
  if (only == "all" || only == "zero-bubble")
    json["zero_bubble"] = zeroBubble();
  if (only == "all" || only == "schedules")
    json["schedules"] = scheduleTable();
  if (only == "all" || only == "schedules" || only == "overlap")
    json["overlapped_steps"] = overlappedSteps();
  std::ofstream(out) << json.dump(1) << '\n';
  std::printf("\nwrote %s\n", out.c_str());
  return 0;
}
