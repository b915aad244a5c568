// The one plan resolver (see tpipe/plan.h).
#include "tpipe/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <ostream>

#include <nlohmann/json.hpp>

namespace tpipe {
bool keepsUndoCopy(SpeculativeUpdates updates, int ranks) {
  return updates == SpeculativeUpdates::kEveryPlan ||
      (updates == SpeculativeUpdates::kSeveralRanks && ranks > 1);
}

namespace {

struct Candidate {
  std::string what; // "3 stages, time-optimal"
  bool simple = false;
  PartitionProblem problem;
  PartitionPlan partition;
  Schedule schedule;
  Simulation simulation;
  double stepMs = 0.0;
};

Schedule scheduleFor(
    const PlanRequest& request,
    int stages,
    std::vector<int> inFlightLimits = {}) {
  const int layers = static_cast<int>(request.layers.size());
  if (stages > layers) {
    throw PartitionError(
        "more stages (" + std::to_string(stages) + ") than layers (" +
        std::to_string(layers) + "): every stage needs at least one layer");
  }
  if (stages % request.virtualStages != 0) {
    throw PartitionError(
        "stages (" + std::to_string(stages) +
        ") must be a multiple of virtual stages (" +
        std::to_string(request.virtualStages) + ")");
  }
  const int ranks = stages / request.virtualStages;
  if (ranks > static_cast<int>(request.devices.size())) {
    throw PartitionError(
        std::to_string(stages) + " stages with " +
        std::to_string(request.virtualStages) +
        " virtual stage(s) per device need " + std::to_string(ranks) +
        " devices, got " + std::to_string(request.devices.size()));
  }
  ScheduleSpec spec;
  spec.source = request.schedule;
  spec.ranks = ranks;
  spec.microBatches = request.microBatches;
  spec.virtualStages = request.virtualStages;
  spec.checkpoint = request.checkpoint;
  if (!request.stageCosts.empty())
    spec.costs = request.stageCosts;
  spec.inFlightLimit = request.inFlightLimit;
  spec.inFlightLimits = std::move(inFlightLimits);
  return makeSchedule(spec);
}

PartitionProblem problemFor(
    const PlanRequest& request,
    const Schedule& schedule) {
  PartitionProblem problem;
  problem.layers = request.layers;
  // With virtual stages, stage k runs on rank k % ranks. A bidirectional
  // schedule partitions the model into one chain's stages; memoryModelOf
  // charges each the copies of the others.
  problem.stages = schedule.chainLength();
  for (int k = 0; k < problem.stages; ++k)
    problem.devices.push_back(request.devices[schedule.rankOfStage(k)]);
  problem.memory = memoryModelOf(
      schedule,
      request.optimizerFactor,
      request.inputBytes,
      request.directWeightGradients);
  problem.memory.keepsUndoCopy =
      keepsUndoCopy(request.speculativeUpdates, schedule.ranks);
  return problem;
}

Candidate evaluate(
    const PlanRequest& request,
    const Schedule& schedule,
    const PartitionPlan& partition,
    std::string what,
    bool simple) {
  Candidate candidate;
  candidate.what = std::move(what);
  candidate.simple = simple;
  candidate.problem = problemFor(request, schedule);
  candidate.partition = partition;
  candidate.schedule = schedule;
  candidate.simulation = simulate(
      schedule,
      !request.stageCosts.empty() ? request.stageCosts
                                  : stageCostsOf(
                                        request.layers,
                                        candidate.problem.devices,
                                        partition.boundaries,
                                        request.instructionMs,
                                        request.splitBackward));
  candidate.stepMs = candidate.simulation.makespan;
  return candidate;
}

bool fits(const PartitionPlan& plan) {
  for (const auto& stage : plan.stages) {
    if (stage.capacityBytes > 0 && stage.memoryBytes > stage.capacityBytes)
      return false;
  }
  return true;
}

std::vector<double> parameterWeights(const std::vector<LayerCost>& layers) {
  std::vector<double> weights;
  for (const auto& layer : layers)
    weights.push_back(static_cast<double>(layer.paramBytes));
  return weights;
}

// The boundaries of the methods that do not search.
std::vector<int> fixedBoundaries(const PlanRequest& request, int stages) {
  const int layers = static_cast<int>(request.layers.size());
  switch (request.partition) {
    case PartitionMethod::kBalance:
      return balanceBoundaries(request.balance, layers);
    case PartitionMethod::kParameters:
      return minMaxBoundaries(parameterWeights(request.layers), stages);
    case PartitionMethod::kUniform:
    case PartitionMethod::kTime:
      break;
  }
  return uniformBoundaries(layers, stages);
}

// For kTime: per stage count, the parameter-balanced split (when it fits)
// and the time-optimal one, in order from simple to elaborate.
std::vector<Candidate> timeCandidates(
    const PlanRequest& request,
    const std::vector<int>& counts) {
  std::vector<Candidate> candidates;
  std::string lastError;
  for (int stages : counts) {
    try {
      const Schedule schedule = scheduleFor(request, stages);
      const PartitionProblem problem = problemFor(request, schedule);
      const std::string prefix =
          std::to_string(stages) + (stages == 1 ? " stage" : " stages");
      const PartitionPlan balanced = evaluatePartition(
          problem, minMaxBoundaries(parameterWeights(request.layers), stages));
      if (fits(balanced))
        candidates.push_back(evaluate(
            request,
            schedule,
            balanced,
            prefix + ", parameter-balanced",
            true));
      candidates.push_back(evaluate(
          request,
          schedule,
          optimalPartition(problem),
          prefix + ", time-optimal",
          false));
    } catch (const UserError& error) {
      lastError = error.what();
    }
  }
  if (candidates.empty())
    throw PartitionError(lastError);
  return candidates;
}

std::string boundaryText(const std::vector<int>& boundaries) {
  std::string text;
  for (int b : boundaries)
    text += (text.empty() ? "" : " ") + std::to_string(b);
  return text;
}

std::string msText(double ms) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f ms", ms);
  return text;
}

// The simplest candidate within the noise of the fastest; notes name the
// others within noise.
size_t chooseWithinNoise(
    const PlanRequest& request,
    const std::vector<Candidate>& candidates,
    std::vector<std::string>& notes) {
  size_t fastest = 0;
  for (size_t i = 1; i < candidates.size(); ++i) {
    if (candidates[i].stepMs < candidates[fastest].stepMs)
      fastest = i;
  }
  const double bound =
      candidates[fastest].stepMs * (1.0 + request.costNoise) + 1e-12;
  size_t chosen = fastest;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (candidates[i].stepMs <= bound) {
      chosen = i;
      break;
    }
  }
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (i == chosen || candidates[i].stepMs > bound)
      continue;
    if (candidates[i].partition.boundaries ==
        candidates[chosen].partition.boundaries)
      continue;
    notes.push_back(
        "within noise: " + candidates[i].what + " (boundaries " +
        boundaryText(candidates[i].partition.boundaries) + ") predicts " +
        msText(candidates[i].stepMs) + " per step");
  }
  if (chosen != fastest &&
      candidates[fastest].partition.boundaries !=
          candidates[chosen].partition.boundaries) {
    char text[160];
    std::snprintf(
        text,
        sizeof text,
        "chose the simpler plan: the fastest is %.1f%% faster, within the %.1f%% noise",
        100.0 * (1.0 - candidates[fastest].stepMs / candidates[chosen].stepMs),
        100.0 * request.costNoise);
    notes.push_back(text);
  }
  return chosen;
}

void checkRequest(const PlanRequest& request) {
  if (request.layers.empty())
    throw PartitionError("the layer list is empty");
  if (request.devices.empty())
    throw PartitionError("no devices given");
  if (request.microBatches < 1) {
    throw PartitionError(
        "micro-batches must be >= 1, got " +
        std::to_string(request.microBatches));
  }
  if (request.virtualStages < 1) {
    throw PartitionError(
        "virtual stages must be >= 1, got " +
        std::to_string(request.virtualStages));
  }
  if (request.stages < 0)
    throw PartitionError(
        "stages must be >= 1, got " + std::to_string(request.stages));
  if (!(request.costNoise >= 0.0))
    throw PartitionError("cost noise must be >= 0");
  const bool balanced = request.partition == PartitionMethod::kBalance;
  if (balanced && request.balance.empty())
    throw PartitionError("partition 'balance' needs a balance list");
  if (!balanced && !request.balance.empty()) {
    throw PartitionError(
        "a balance is given with partition '" +
        std::string(partitionMethodName(request.partition)) +
        "': give one or the other (the balance implies partition 'balance')");
  }
  if (request.threadsPerDevice < 0)
    throw PartitionError(
        "threads per device must be >= 0, got " +
        std::to_string(request.threadsPerDevice));
  if (!request.stageCosts.empty() &&
      (!balanced || request.stageCosts.size() != request.balance.size())) {
    throw PartitionError(
        "per-stage costs (" + std::to_string(request.stageCosts.size()) +
        ") need partition 'balance' with one entry per stage");
  }
  if (balanced && request.stages > 0 &&
      request.stages != static_cast<int>(request.balance.size())) {
    throw PartitionError(
        "stages (" + std::to_string(request.stages) + ") and balance (" +
        std::to_string(request.balance.size()) + " entries) disagree");
  }
}

std::vector<Candidate> candidatesFor(const PlanRequest& request) {
  const int layers = static_cast<int>(request.layers.size());
  const int devices = static_cast<int>(request.devices.size());
  if (request.partition == PartitionMethod::kTime) {
    std::vector<int> counts;
    if (request.stages == 0 && request.virtualStages == 1) {
      for (int count = 1; count <= std::min(layers, devices); ++count)
        counts.push_back(count);
    } else {
      counts.push_back(
          request.stages > 0 ? request.stages
                             : devices * request.virtualStages);
    }
    return timeCandidates(request, counts);
  }
  int stages =
      request.stages > 0 ? request.stages : devices * request.virtualStages;
  if (request.partition == PartitionMethod::kBalance)
    stages = static_cast<int>(request.balance.size());
  const Schedule schedule = scheduleFor(request, stages);
  const PartitionPlan partition = evaluatePartition(
      problemFor(request, schedule), fixedBoundaries(request, stages));
  return {evaluate(
      request,
      schedule,
      partition,
      partitionMethodName(request.partition),
      true)};
}

// `auto` holds 1F1B's p micro-batches per rank unless told otherwise. When
// every device declares its memory, each rank may hold what its device has
// room for instead: the most micro-batches whose activations fit beside its
// parameters, gradients and optimizer state, by the partition's own memory
// model. The schedule built so replaces the chosen one when its plan fits
// and runs faster, or when the chosen one does not fit at all.
void fitAutoToMemory(
    const PlanRequest& request,
    Candidate& chosen,
    std::vector<std::string>& notes) {
  const Schedule& schedule = chosen.schedule;
  if (!request.schedule.isBuiltIn() ||
      request.schedule.kind() != ScheduleKind::kAuto ||
      schedule.virtualStages != 1 || schedule.ranks < 2 ||
      request.inFlightLimit > 0) // a limit asked for wins over the memory's
    return;
  for (const StageReport& stage : chosen.partition.stages) {
    if (stage.capacityBytes <= 0)
      return;
  }
  const int stages = schedule.stages();
  std::vector<int> limits(stages, 0);
  for (int held = 1; held <= schedule.microBatches; ++held) {
    PartitionProblem problem = chosen.problem;
    problem.memory.stashed.assign(stages, held);
    problem.memory.live.resize(stages);
    for (int s = 0; s < stages; ++s)
      problem.memory.live[s] = std::min(held, chosen.problem.memory.liveAt(s));
    const PartitionPlan at =
        evaluatePartition(problem, chosen.partition.boundaries);
    bool anyFits = false;
    for (int s = 0; s < stages; ++s) {
      if (at.stages[s].memoryBytes <= at.stages[s].capacityBytes) {
        limits[s] = held;
        anyFits = true;
      }
    }
    if (!anyFits)
      break; // memory only grows with what is held
  }
  if (std::find(limits.begin(), limits.end(), 0) != limits.end())
    return; // a device without room for one micro-batch: nothing helps
  if (limits == std::vector<int>(schedule.ranks, schedule.ranks))
    return;
  Candidate fitted;
  try {
    const Schedule rebuilt = scheduleFor(request, schedule.stages(), limits);
    fitted = evaluate(
        request,
        rebuilt,
        evaluatePartition(
            problemFor(request, rebuilt), chosen.partition.boundaries),
        chosen.what,
        chosen.simple);
  } catch (const UserError&) {
    return;
  }
  if (!fits(fitted.partition) ||
      (fits(chosen.partition) && fitted.stepMs >= chosen.stepMs - 1e-12))
    return;
  std::string text;
  for (int limit : limits)
    text += (text.empty() ? "" : ", ") + std::to_string(limit);
  notes.push_back(
      "auto: micro-batches in flight per device from its memory: " + text +
      " (1F1B holds " + std::to_string(schedule.ranks) + "); predicts " +
      msText(fitted.stepMs) + " per step against " + msText(chosen.stepMs));
  chosen = std::move(fitted);
}

} // namespace

PartitionMethod parsePartitionMethod(const std::string& name) {
  for (auto method :
       {PartitionMethod::kUniform,
        PartitionMethod::kParameters,
        PartitionMethod::kTime,
        PartitionMethod::kBalance}) {
    if (name == partitionMethodName(method))
      return method;
  }
  throw UserError(
      "unknown partition method '" + name +
      "' (uniform, parameters, time or balance)");
}

const char* partitionMethodName(PartitionMethod method) {
  switch (method) {
    case PartitionMethod::kUniform:
      return "uniform";
    case PartitionMethod::kParameters:
      return "parameters";
    case PartitionMethod::kTime:
      return "time";
    case PartitionMethod::kBalance:
      return "balance";
  }
  return "?";
}

double optimizerStateFactor(const std::string& optimizer, double momentum) {
  if (optimizer == "sgd")
    return momentum > 0 ? 1.0 : 0.0;
  return 2.0; // adam, adamw: first and second moments
}

bool Plan::overCapacity() const {
  return !fits(PartitionPlan{boundaries, bottleneckMs, stages});
}

std::vector<StageCosts> stageCostsOf(
    const std::vector<LayerCost>& layers,
    const std::vector<DeviceSpec>& devices,
    const std::vector<int>& boundaries,
    double instructionMs,
    double splitBackward) {
  std::vector<StageCosts> costs;
  for (size_t k = 0; k + 1 < boundaries.size(); ++k) {
    double forward = 0.0, backward = 0.0;
    for (int l = boundaries[k]; l < boundaries[k + 1]; ++l) {
      forward += layers[l].forwardMs;
      backward += layers[l].backwardMs;
    }
    const DeviceSpec& device = devices[k];
    StageCosts c;
    c.forward = forward / device.speed;
    c.backward = backward / device.speed;
    c.backwardInput = c.backward / 2 * splitBackward + instructionMs;
    c.backwardWeight = c.backward / 2 * splitBackward + instructionMs;
    c.recompute = c.forward + instructionMs;
    c.forward += instructionMs;
    c.backward += instructionMs;
    const bool last = k + 2 == boundaries.size();
    const double bytes =
        static_cast<double>(layers[boundaries[k + 1] - 1].activationBytes);
    c.transfer = last ? 0.0
                      : device.linkLatencyMs +
            (device.linkBytesPerMs > 0.0 ? bytes / device.linkBytesPerMs : 0.0);
    costs.push_back(c);
  }
  return costs;
}

MemoryModel memoryModelOf(
    const Schedule& schedule,
    double optimizerFactor,
    int64_t inputBytes,
    bool directWeightGradients) {
  const Simulation unit = simulate(schedule, {StageCosts{}});
  MemoryModel memory;
  memory.stashed = unit.peakStashed;
  memory.live = unit.peakLive;
  if (schedule.chains > 1) {
    // Per stage of the model: what its copies on every chain hold.
    const int length = schedule.chainLength();
    memory.stashed.assign(length, 0);
    memory.live.assign(length, 0);
    for (int s = 0; s < schedule.stages(); ++s) {
      memory.stashed[schedule.modelStage(s)] += unit.peakStashed[s];
      memory.live[schedule.modelStage(s)] += unit.peakLive[s];
    }
    memory.parameterCopies = schedule.chains;
  }
  memory.optimizerFactor = optimizerFactor;
  memory.inputBytes = inputBytes;
  memory.weightGradientsInPlace =
      directWeightGradients || schedule.splitsBackward();
  return memory;
}

Plan resolvePlan(const PlanRequest& request) {
  checkRequest(request);
  Plan plan;
  const std::vector<Candidate> candidates = candidatesFor(request);
  Candidate chosen =
      candidates[chooseWithinNoise(request, candidates, plan.notes)];
  fitAutoToMemory(request, chosen, plan.notes);
  plan.partition = request.partition;
  plan.boundaries = chosen.partition.boundaries;
  plan.schedule = chosen.schedule;
  plan.checkpoint = request.checkpoint;
  plan.stages = chosen.partition.stages;
  plan.bottleneckMs = chosen.partition.bottleneckMs;
  plan.simulation = chosen.simulation;
  plan.costSource = request.costSource;
  plan.costNoise = request.costNoise;
  plan.threadsPerDevice = request.threadsPerDevice;
  if (request.partition == PartitionMethod::kTime)
    plan.notes.insert(plan.notes.begin(), "chosen: " + chosen.what);
  if (keepsUndoCopy(request.speculativeUpdates, plan.schedule.ranks)) {
    plan.notes.push_back(
        "memory counts each stage's parameters, gradients and optimizer "
        "state twice: posted steps that check the gradients keep them to "
        "undo an update made before the step is decided "
        "(pipeline.overlap_steps=false does without)");
  }
  return plan;
}

PlanRequest pinnedRequest(
    PlanRequest request,
    const Plan& plan,
    std::vector<StageCosts> stageCosts) {
  request.partition = PartitionMethod::kBalance;
  request.balance = balanceOf(plan.boundaries);
  request.stages = plan.stageCount();
  // A pass a recorded run never ran has no time of its own: `auto` would
  // take it as free.
  const double split = request.splitBackward > 0 ? request.splitBackward : 1.0;
  for (StageCosts& c : stageCosts) {
    const double halves = c.backwardInput + c.backwardWeight;
    if (halves <= 0.0 && c.backward > 0.0)
      c.backwardInput = c.backwardWeight = c.backward * split / 2.0;
    else if (c.backward <= 0.0 && halves > 0.0)
      c.backward = halves / split;
    if (c.recompute <= 0.0)
      c.recompute = c.forward;
  }
  request.stageCosts = std::move(stageCosts);
  return request;
}

nlohmann::json planToJson(const Plan& plan) {
  nlohmann::json stages = nlohmann::json::array();
  for (const auto& stage : plan.stages) {
    stages.push_back(
        {{"device", stage.device},
         {"first_layer", stage.firstLayer},
         {"end_layer", stage.endLayer},
         {"compute_ms", stage.computeMs},
         {"transfer_ms", stage.transferMs},
         {"time_ms", stage.timeMs},
         {"param_bytes", stage.paramBytes},
         {"memory_bytes", stage.memoryBytes},
         {"activation_bytes", stage.activationBytes},
         {"capacity_bytes", stage.capacityBytes},
         {"in_flight_micro_batches", stage.inFlight}});
  }
  return {
      {"partition", partitionMethodName(plan.partition)},
      {"stage_count", plan.stageCount()},
      {"boundaries", plan.boundaries},
      {"schedule", plan.schedule.name},
      {"micro_batches", plan.schedule.microBatches},
      {"virtual_stages", plan.schedule.virtualStages},
      {"checkpoint", checkpointModeName(plan.checkpoint)},
      {"threads_per_device", plan.threadsPerDevice},
      {"bottleneck_ms", plan.bottleneckMs},
      {"predicted_step_ms", plan.simulation.makespan},
      {"cost_source", plan.costSource},
      {"cost_noise", plan.costNoise},
      {"notes", plan.notes},
      {"stages", stages},
      {"simulation", simulationToJson(plan.schedule, plan.simulation)}};
}

void printPlan(std::ostream& out, const Plan& plan) {
  char line[256];
  std::snprintf(
      line,
      sizeof line,
      "%-5s %-8s %-14s %10s %10s %24s\n",
      "stage",
      "device",
      "layers",
      "time ms",
      "params",
      "memory / capacity");
  out << line;
  for (size_t k = 0; k < plan.stages.size(); ++k) {
    const auto& s = plan.stages[k];
    const std::string layers = std::to_string(s.firstLayer) + "-" +
        std::to_string(s.endLayer - 1) + " (" +
        std::to_string(s.endLayer - s.firstLayer) + ")";
    const std::string memory = formatBytes(s.memoryBytes) + " / " +
        (s.capacityBytes > 0 ? formatBytes(s.capacityBytes) : std::string("-"));
    const bool over = s.capacityBytes > 0 && s.memoryBytes > s.capacityBytes;
    std::snprintf(
        line,
        sizeof line,
        "%-5zu %-8s %-14s %10.3f %10s %24s%s\n",
        k,
        s.device.c_str(),
        layers.c_str(),
        s.timeMs,
        formatBytes(s.paramBytes).c_str(),
        memory.c_str(),
        over ? "  OVER CAPACITY" : "");
    out << line;
  }
  out << "boundaries " << boundaryText(plan.boundaries)
      << "; costs: " << plan.costSource;
  if (plan.costNoise > 0) {
    std::snprintf(line, sizeof line, " (noise %.1f%%)", 100.0 * plan.costNoise);
    out << line;
  }
  out << "\n";
  for (const auto& note : plan.notes)
    out << note << "\n";
  std::snprintf(
      line,
      sizeof line,
      "bottleneck %.3f ms per micro-batch; %s with %d micro-batches, checkpoint %s:\n",
      plan.bottleneckMs,
      plan.schedule.name.c_str(),
      plan.schedule.microBatches,
      checkpointModeName(plan.checkpoint));
  out << line;
  printSimulation(out, plan.schedule, plan.simulation);
}

namespace {

int64_t largestStage(const Plan& plan) {
  int64_t largest = 0;
  for (const auto& stage : plan.stages)
    largest = std::max(largest, stage.memoryBytes);
  return largest;
}

int64_t totalMemory(const Plan& plan) {
  int64_t total = 0;
  for (const auto& stage : plan.stages)
    total += stage.memoryBytes;
  return total;
}

// Empty when the plan fits; otherwise the first stage over its device's
// capacity, or the whole plan over the host's available memory.
std::string memoryProblem(
    const Plan& plan,
    int64_t hostBytes,
    bool keepsUndoCopy) {
  for (size_t k = 0; k < plan.stages.size(); ++k) {
    const StageReport& stage = plan.stages[k];
    if (stage.capacityBytes > 0 && stage.memoryBytes > stage.capacityBytes) {
      return "stage " + std::to_string(k) + " (layers " +
          std::to_string(stage.firstLayer) + "-" +
          std::to_string(stage.endLayer - 1) + ") needs " +
          formatBytes(stage.memoryBytes) + " on " + stage.device + " (" +
          formatBytes(stage.memoryBytes - stage.activationBytes) +
          " of it parameters, gradients and optimizer state" +
          (keepsUndoCopy ? ", half of that kept to undo posted steps' updates"
                         : "") +
          "), whose capacity is " + formatBytes(stage.capacityBytes);
    }
  }
  const int64_t total = totalMemory(plan);
  if (hostBytes > 0 && total > hostBytes) {
    return "the plan needs " + formatBytes(total) +
        " in all, and this host has " + formatBytes(hostBytes) + " available";
  }
  return "";
}

struct Attempt {
  bool resolved = false;
  Plan plan;
  std::string problem;
};

Attempt attempt(const PlanRequest& request, int64_t hostBytes) {
  Attempt result;
  try {
    result.plan = resolvePlan(request);
    result.resolved = true;
    result.problem = memoryProblem(
        result.plan,
        hostBytes,
        keepsUndoCopy(request.speculativeUpdates, result.plan.schedule.ranks));
  } catch (const PartitionError& error) {
    result.problem = error.what();
  }
  return result;
}

struct Variant {
  std::string keys;
  PlanRequest request;
};

// Single changes a user can make in the config, and their pairs with
// rematerialization: each names every key it sets, and none repeats what
// the request already has.
std::vector<Variant> variantsOf(const PlanRequest& request) {
  std::vector<Variant> variants;
  const bool always = request.checkpoint == CheckpointMode::kAlways;
  const bool oneFOneB = request.schedule.isBuiltIn() &&
      request.schedule.kind() == ScheduleKind::kOneFOneB;
  const bool byTime = request.partition == PartitionMethod::kTime;
  auto add = [&](std::string keys, auto change) {
    PlanRequest copy = request;
    change(copy);
    variants.push_back({std::move(keys), std::move(copy)});
  };
  auto remat = [](PlanRequest& r) { r.checkpoint = CheckpointMode::kAlways; };
  auto oneF = [](PlanRequest& r) { r.schedule = ScheduleKind::kOneFOneB; };
  auto time = [](PlanRequest& r) {
    r.partition = PartitionMethod::kTime;
    r.balance.clear();
  };
  if (request.speculativeUpdates != SpeculativeUpdates::kNone) {
    add("pipeline.overlap_steps=false",
        [](auto& r) { r.speculativeUpdates = SpeculativeUpdates::kNone; });
  }
  if (!always)
    add("pipeline.checkpoint=always", remat);
  if (!oneFOneB)
    add("pipeline.schedule=1f1b", oneF);
  if (!always && !oneFOneB) {
    add("pipeline.schedule=1f1b, pipeline.checkpoint=always", [&](auto& r) {
      oneF(r);
      remat(r);
    });
  }
  if (!byTime) {
    add("pipeline.partition=time", time);
    if (!always) {
      add("pipeline.partition=time, pipeline.checkpoint=always", [&](auto& r) {
        time(r);
        remat(r);
      });
    }
  }
  add("pipeline.micro_batches=" + std::to_string(request.microBatches * 2) +
          " (half their size)",
      [](auto& r) {
        r.microBatches *= 2;
        r.inputBytes /= 2;
        for (auto& layer : r.layers) {
          layer.activationBytes /= 2;
          layer.stashBytes /= 2;
        }
      });
  return variants;
}

// The fewest devices like the first (up to 8 times as many, one layer
// each at most) that fit, with the request's other settings.
std::string moreDevices(const PlanRequest& request, int64_t hostBytes) {
  const int devices = static_cast<int>(request.devices.size());
  const int layers = static_cast<int>(request.layers.size());
  if (devices == 0 || request.devices.front().memoryBytes <= 0)
    return "";
  for (int more = devices + 1; more <= std::min(layers, devices * 8); ++more) {
    PlanRequest copy = request;
    copy.devices.assign(more, request.devices.front());
    copy.stages = 0;
    copy.balance.clear();
    if (copy.partition == PartitionMethod::kBalance)
      copy.partition = PartitionMethod::kParameters;
    const Attempt tried = attempt(copy, hostBytes);
    if (tried.resolved && tried.problem.empty()) {
      return "pipeline.devices: " + std::to_string(more) + " devices like " +
          request.devices.front().name + " (largest stage " +
          formatBytes(largestStage(tried.plan)) + ")";
    }
  }
  return "";
}

} // namespace

Feasibility checkFeasibility(const PlanRequest& request, int64_t hostBytes) {
  Feasibility verdict;
  const Attempt first = attempt(request, hostBytes);
  if (first.resolved)
    verdict.plan = first.plan;
  verdict.problem = first.problem;
  verdict.fits = first.resolved && first.problem.empty();
  if (verdict.fits)
    return verdict;
  for (const Variant& variant : variantsOf(request)) {
    const Attempt tried = attempt(variant.request, hostBytes);
    if (!tried.resolved || !tried.problem.empty())
      continue;
    verdict.fixes.push_back(
        variant.keys + " (largest stage " +
        formatBytes(largestStage(tried.plan)) + ")");
  }
  const std::string devices = moreDevices(request, hostBytes);
  if (!devices.empty())
    verdict.fixes.push_back(devices);
  return verdict;
}

} // namespace tpipe
