// What pipelining costs when there is nothing to pipeline: tpipe's trainer
// with one stage, one micro-batch and every core, beside a plain LibTorch
// loop with the same model (built by tpipe from the same config, so the
// same layers and initial weights), threads, optimizer and data (shuffled
// each epoch where the config says so, as tpipe's trainer does), and the
// same loop in PyTorch when /usr/bin/python3 has torch. Rounds alternate
// the contenders; each time is the median over rounds of per-step
// medians, each "vs loop" the median over rounds of that round's ratio
// (with their range). The step is split into forward and backward, the update
// (optimizer step and zeroing; tpipe adds its gradient-norm check there),
// and the rest. Prints a table; writes JSON to argv[1].
#include <ATen/Parallel.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "tpipe/config.h"
#include "tpipe/pipeline.h"
#include "tpipe/trainer.h"

namespace {

using Clock = std::chrono::steady_clock;
using Json = nlohmann::json;

const int kCores =
    static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));

// Set before any contender runs, so that each runs with the memory policy
// tpipe's pipeline sets (the Python loop through glibc's environment).
const bool kKeptFreedMemory = tpipe::keepFreedHostMemory();

double median(std::vector<double> values) {
  if (values.empty())
    return 0.0;
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

double ms(Clock::duration d) {
  return std::chrono::duration<double, std::milli>(d).count();
}

struct Split {
  double stepMs = 0.0, computeMs = 0.0, updateMs = 0.0;
};

struct Job {
  std::string name;
  Json config; // one stage, one micro-batch, every core
  int steps = 0;
  std::string python; // the model as PyTorch builds it
};

Json oneStage(const std::string& path, int steps) {
  std::ifstream file(path);
  Json config = Json::parse(file);
  config["pipeline"] = {
      {"devices", {"cpu:0"}},
      {"micro_batches", 1},
      {"threads_per_device", kCores}};
  config["train"]["steps"] = steps;
  config["train"]["eval_every"] = 0;
  return config;
}

Split timeTpipe(const Job& job) {
  std::ostringstream sink;
  tpipe::TrainOptions options;
  options.log = &sink;
  options.evaluate = false;
  options.recordSteps = 0;
  const tpipe::TrainSummary summary =
      tpipe::train(tpipe::parseConfig(job.config), options);
  const auto& s = summary.split;
  return {s.stepMs, s.pipelineMs, s.updateMs};
}

std::unique_ptr<torch::optim::Optimizer> optimizerFor(
    const Json& config,
    const std::vector<torch::Tensor>& parameters) {
  const Json& o = config["train"]["optimizer"];
  const double lr = o.value("lr", 0.01);
  if (o.value("type", "sgd") == "adam")
    return std::make_unique<torch::optim::Adam>(
        parameters, torch::optim::AdamOptions(lr));
  return std::make_unique<torch::optim::SGD>(
      parameters,
      torch::optim::SGDOptions(lr).momentum(o.value("momentum", 0.0)));
}

// The loop a LibTorch user writes: forward, loss, backward, step, zero.
Split timeLoopHere(const Job& job) {
  const tpipe::Config config = tpipe::parseConfig(job.config);
  tpipe::BuiltModel model = tpipe::buildModel(config);
  const tpipe::Dataset data = tpipe::loadDataset(config, model);
  std::vector<torch::Tensor> parameters;
  for (const auto& layer : model.layers) {
    for (const auto& p : layer.module.ptr()->parameters())
      parameters.push_back(p);
  }
  auto optimizer = optimizerFor(job.config, parameters);
  const bool mse = config.train.loss == "mse";
  const int64_t batch = config.train.batchSize;
  const int64_t samples = data.trainInputs.size(0);
  const int64_t batchesPerEpoch = samples / batch;
  torch::Tensor order; // this epoch's sample order, when the config shuffles
  const int previous = at::get_num_threads();
  at::set_num_threads(kCores);
  std::vector<double> steps, compute, update;
  Clock::time_point last;
  for (int step = 0; step < job.steps; ++step) {
    const auto begin = Clock::now();
    if (step > 0)
      steps.push_back(ms(begin - last));
    last = begin;
    // The batches tpipe's trainer draws: in order, or gathered in a new
    // order each epoch.
    const int64_t from = (step % batchesPerEpoch) * batch;
    torch::Tensor x = data.trainInputs.narrow(0, from, batch);
    torch::Tensor y = data.trainTargets.narrow(0, from, batch);
    if (config.data.shuffle) {
      if (from == 0)
        order = torch::randperm(samples, torch::kLong);
      const torch::Tensor index = order.narrow(0, from, batch);
      x = data.trainInputs.index_select(0, index);
      y = data.trainTargets.index_select(0, index);
    }
    const auto fetched = Clock::now();
    torch::Tensor out = x;
    for (auto& layer : model.layers)
      out = layer.module.forward(out);
    torch::Tensor loss = mse
        ? torch::nn::functional::mse_loss(out, y)
        : torch::nn::functional::cross_entropy(
              out.reshape({-1, out.size(-1)}), y.reshape({-1}));
    loss.backward();
    const double value = loss.item<double>();
    const auto computed = Clock::now();
    optimizer->step();
    optimizer->zero_grad();
    compute.push_back(ms(computed - fetched));
    update.push_back(ms(Clock::now() - computed));
    if (!std::isfinite(value))
      std::fprintf(stderr, "the loop's loss is not finite\n");
  }
  at::set_num_threads(previous);
  return {median(steps), median(compute), median(update)};
}

// TPIPE_LOOP_ON_THREAD=1 runs the loop on a second thread instead of the
// process's first: on this machine that alone costs it 6-10%, which is why
// tpipe runs a process's only device on the calling thread.
Split timeLoop(const Job& job) {
  if (!std::getenv("TPIPE_LOOP_ON_THREAD"))
    return timeLoopHere(job);
  Split result;
  std::thread([&] { result = timeLoopHere(job); }).join();
  return result;
}

// The same loop in PyTorch, on random data of the job's shapes.
bool pythonHasTorch() {
  return std::system("/usr/bin/python3 -c 'import torch' >/dev/null 2>&1") == 0;
}

Split timePython(const Job& job, const std::string& scratch) {
  const tpipe::Config config = tpipe::parseConfig(job.config);
  std::ofstream(scratch + "/loop.py")
      << "import json, sys, time, torch, torch.nn as nn, torch.nn.functional as F\n"
      << "torch.set_num_threads(" << kCores << ")\n"
      << "torch.manual_seed(0)\n"
      << "m = " << job.python << "\n"
      << "shape = " << Json(config.model.inputShape).dump() << "\n"
      << "batch = " << config.train.batchSize << "\n"
      << "mse = " << (config.train.loss == "mse" ? "True" : "False") << "\n"
      << "x = torch.randn([batch] + shape)\n"
      << "y = torch.randn(m(x[:1]).shape[1:]).expand(batch, -1).contiguous() if mse else torch.randint(0, 10, (batch,))\n"
      << "o = json.loads(sys.argv[1])\n"
      << "opt = torch.optim.Adam(m.parameters(), lr=o['lr']) if o['type'] == 'adam' else torch.optim.SGD(m.parameters(), lr=o['lr'], momentum=o.get('momentum', 0.0))\n"
      << "steps, compute, update, last = [], [], [], None\n"
      << "for step in range(" << job.steps << "):\n"
      << "    begin = time.perf_counter()\n"
      << "    if last is not None: steps.append(begin - last)\n"
      << "    last = begin\n"
      << "    loss = F.mse_loss(m(x), y) if mse else F.cross_entropy(m(x), y)\n"
      << "    loss.backward(); loss.item()\n"
      << "    computed = time.perf_counter()\n"
      << "    opt.step(); opt.zero_grad()\n"
      << "    compute.append(computed - begin); update.append(time.perf_counter() - computed)\n"
      << "med = lambda v: sorted(v)[len(v) // 2] * 1000\n"
      << "print(json.dumps([med(steps), med(compute), med(update)]))\n";
  const std::string out = scratch + "/loop.json";
  // glibc's own settings for what keepFreedHostMemory sets in this process.
  const std::string keep = kKeptFreedMemory
      ? "MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=" +
          std::to_string(std::numeric_limits<int64_t>::max()) + " "
      : "";
  const std::string command = keep + "/usr/bin/python3 " + scratch +
      "/loop.py '" + job.config["train"]["optimizer"].dump() + "' > " + out;
  if (std::system(command.c_str()) != 0)
    return {};
  std::ifstream file(out);
  const Json result = Json::parse(file);
  return {result[0], result[1], result[2]};
}

std::vector<Job> jobs(const std::string& root) {
  std::string reference = "nn.Sequential(";
  for (int i = 0; i < 8; ++i)
    reference += "nn.Linear(1024, 1024), nn.ReLU(), ";
  reference += ")";
  return {
      {"reference mlp",
       oneStage(root + "/configs/reference_mlp.json", 40),
       40,
       reference},
      {"fashion-mnist cnn",
       oneStage(root + "/configs/fashion_mnist_cnn.json", 200),
       200,
       "nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), "
       "nn.MaxPool2d(2), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), "
       "nn.MaxPool2d(2), nn.Flatten(), nn.Linear(1568, 128), nn.ReLU(), "
       "nn.Linear(128, 10))"}};
}

} // namespace

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "overhead.json";
  const std::string root = argc > 2 ? argv[2] : TPIPE_SOURCE_DIR;
  const int rounds = 7;
  const bool python = pythonHasTorch();
  const std::string scratch =
      "/tmp/tpipe-overhead-" + std::to_string(::getpid());
  std::system(("mkdir -p " + scratch).c_str());
  std::printf(
      "one stage, one micro-batch, %d intra-op threads for every contender; "
      "%d rounds, contenders alternating; freed host memory kept for every "
      "contender: %s\n",
      kCores,
      rounds,
      kKeptFreedMemory ? "yes" : "no (not glibc, or MALLOC_* set)");
  std::printf(
      "%-18s %-14s %9s %12s %10s %9s %9s  %s\n",
      "job",
      "contender",
      "step ms",
      "fwd+bwd ms",
      "update ms",
      "rest ms",
      "vs loop",
      "per round");
  Json results = Json::array();
  for (const Job& job : jobs(root)) {
    std::map<std::string, std::vector<Split>> runs;
    for (int round = 0; round < rounds; ++round) {
      // Rotate who goes first, so warm caches and turbo favour no one.
      std::vector<std::string> order{"libtorch loop", "tpipe", "pytorch"};
      std::rotate(order.begin(), order.begin() + round % 3, order.end());
      for (const auto& who : order) {
        if (who == "tpipe")
          runs[who].push_back(timeTpipe(job));
        else if (who == "libtorch loop")
          runs[who].push_back(timeLoop(job));
        else if (python)
          runs[who].push_back(timePython(job, scratch));
      }
    }
    auto summarize = [&](const std::string& who) {
      std::vector<double> step, compute, update;
      for (const auto& s : runs[who]) {
        step.push_back(s.stepMs);
        compute.push_back(s.computeMs);
        update.push_back(s.updateMs);
      }
      return Split{median(step), median(compute), median(update)};
    };
    // Each round's ratio pairs runs seconds apart, so the machine's drift
    // over the rounds cancels out of it; the figure is their median.
    auto pairedRatios = [&](const std::string& who) {
      std::vector<double> ratios;
      for (size_t r = 0; r < runs[who].size(); ++r)
        ratios.push_back(runs[who][r].stepMs / runs["libtorch loop"][r].stepMs);
      return ratios;
    };
    for (const std::string who : {"libtorch loop", "tpipe", "pytorch"}) {
      if (runs[who].empty())
        continue;
      const Split s = summarize(who);
      const std::vector<double> ratios = pairedRatios(who);
      const double ratio = median(ratios);
      const double rest = s.stepMs - s.computeMs - s.updateMs;
      std::printf(
          "%-18s %-14s %9.2f %12.2f %10.2f %9.2f %9.3f  %.3f-%.3f\n",
          job.name.c_str(),
          who.c_str(),
          s.stepMs,
          s.computeMs,
          s.updateMs,
          rest,
          ratio,
          *std::min_element(ratios.begin(), ratios.end()),
          *std::max_element(ratios.begin(), ratios.end()));
      results.push_back(
          {{"job", job.name},
           {"contender", who},
           {"step_ms", s.stepMs},
           {"forward_backward_ms", s.computeMs},
           {"update_ms", s.updateMs},
           {"rest_ms", rest},
           {"vs_loop", ratio},
           {"vs_loop_each_round", ratios}});
    }
  }
  std::printf(
      "goal: tpipe <= 1.03 x the libtorch loop on both jobs (tpipe's "
      "fwd+bwd is its pipeline: the forwards and backwards with their "
      "dispatch)\n");
  std::system(("rm -rf " + scratch).c_str());
  Json summary{{"rounds", rounds}, {"threads", kCores}};
  summary["freed_memory_kept"] = kKeptFreedMemory;
  summary["results"] = results;
  std::ofstream(out) << summary.dump(1) << '\n';
  return 0;
}
