// The plan resolver: the one place that decides how a run is laid out.
//
// resolvePlan turns (per-layer costs, devices, options) into a Plan: stage
// boundaries, the schedule, the checkpoint mode, and the predicted step and
// memory per stage. Pipeline, the trainer, `tpipe plan`, `tpipe profile` and
// the benchmarks all ask it; nobody else dispatches on the partition method.
// Pure: no LibTorch, no threads; the same request gives the same plan.
//
// Memory per stage comes from the schedule that will run: the resolver
// simulates it and hands the partitioner each stage's peak count of held
// micro-batches (so schedule files and new schedules are counted right).
//
// Choosing among near-equal plans: measured costs carry noise (costNoise, the
// relative spread the profiler saw). Candidates are ordered from simple to
// elaborate: fewer stages first, then the parameter-balanced partition before
// the time-optimal one. The simplest candidate whose predicted step is within
// the noise of the fastest wins, so small timing jitter does not move the
// plan; Plan::notes says which candidates were within noise.
//
//   tpipe::PlanRequest request;
//   request.layers = costs;                     // measured, or parameter bytes
//   request.devices = {{"cpu:0"}, {"cpu:1"}};
//   request.partition = tpipe::PartitionMethod::kTime;
//   request.microBatches = 8;
//   request.schedule = "1f1b";
//   tpipe::Plan plan = tpipe::resolvePlan(request);  // throws UserError
//   tpipe::printPlan(std::cout, plan);
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tpipe/costs.h"
#include "tpipe/partition.h"
#include "tpipe/schedule.h"

namespace tpipe {

enum class PartitionMethod {
  kUniform,    // layers per stage as even as possible
  kParameters, // balance parameter bytes (optimal min-max)
  kTime,       // the fastest plan by measured costs, within memory
  kBalance,    // an explicit balance (layers per stage)
};

PartitionMethod parsePartitionMethod(const std::string& name); // UserError
const char* partitionMethodName(PartitionMethod method);

// The optimizer's state per parameter byte: sgd 0, sgd with momentum 1,
// adam and adamw 2.
double optimizerStateFactor(const std::string& optimizer, double momentum);

// Which plans' ranks may apply their update before the step is decided:
// steps posted without a barrier (pipeline.overlap_steps) that check the
// gradients (a clip, or skipped non-finite steps). Such a rank keeps its
// parameters, gradients and optimizer state as they were, to undo the
// update, through the next step: the memory model charges that copy.
enum class SpeculativeUpdates {
  kNone,
  kSeveralRanks, // one process: a lone rank runs on the caller, posting none
  kEveryPlan,    // across processes, where every rank posts
};

// Whether a plan of `ranks` ranks keeps the undo copy.
bool keepsUndoCopy(SpeculativeUpdates updates, int ranks);

struct PlanRequest {
  std::vector<LayerCost> layers;
  // Where the costs came from, for the reader ("parameter bytes", "measured
  // now", "profile.json"); and their relative noise (0: exact).
  std::string costSource = "parameter bytes";
  double costNoise = 0.0;
  // The devices available, one per pipeline rank.
  std::vector<DeviceSpec> devices;
  // Total stages; 0: one per device times virtualStages, or (kTime with one
  // virtual stage) the count from 1 to the devices that predicts fastest.
  int stages = 0;
  PartitionMethod partition = PartitionMethod::kUniform;
  std::vector<int> balance; // layers per stage, with kBalance
  ScheduleSource schedule = ScheduleKind::kGpipe;
  int microBatches = 1;
  int virtualStages = 1;
  CheckpointMode checkpoint = CheckpointMode::kExceptLast;
  // For `auto`: the micro-batches in flight each rank may hold; 0: the
  // ranks (1F1B's memory), or as many as fit where every device declares
  // its memory.
  int inFlightLimit = 0;
  double optimizerFactor = 0.0;
  // PipelineOptions::directWeightGradients, for the memory model.
  bool directWeightGradients = true;
  SpeculativeUpdates speculativeUpdates = SpeculativeUpdates::kNone;
  // The runtime's own costs, where calibrated (tpipe/tune.h): per compute
  // instruction, and the split backward's (input + weight) over the fused.
  double instructionMs = 0.0;
  double splitBackward = 1.0;
  int64_t inputBytes = 0; // the model input per micro-batch
  // Intra-op threads of each device's worker, as the costs were measured
  // at; 0: the runtime shares the cores fairly. Carried into the Plan.
  int threadsPerDevice = 0;
  // Per-stage costs known as such (a recorded run's, or the tuner's for a
  // fixed partition): the schedule `auto` is built from them and the
  // simulation uses them, instead of sums of the layers. Needs partition
  // kBalance, one entry per stage.
  std::vector<StageCosts> stageCosts;
};

struct Plan {
  PartitionMethod partition = PartitionMethod::kUniform;
  std::vector<int> boundaries; // stages + 1 layer indices
  Schedule schedule;
  CheckpointMode checkpoint = CheckpointMode::kExceptLast;
  std::vector<StageReport> stages; // predicted time and memory per stage
  double bottleneckMs = 0.0;
  Simulation simulation; // the predicted step under the plan's costs
  std::string costSource;
  double costNoise = 0.0;
  std::vector<std::string> notes; // near-equal alternatives, choices made
  int threadsPerDevice = 0;       // the request's (0: shared fairly)
  // A stage exceeds its device's capacity (only for methods that do not
  // search: uniform, parameters, balance; kTime throws instead).
  bool overCapacity() const;
  int stageCount() const {
    return static_cast<int>(boundaries.size()) - 1;
  }
};

// Throws UserError (PartitionError, ScheduleError) naming what is wrong.
Plan resolvePlan(const PlanRequest& request);

// The request for `plan`'s own partition (an explicit balance) under these
// per-stage costs: resolving it keeps the layout and rebuilds a schedule
// `auto` for them. The trainer's re-plan from measured stage times and the
// tuner's `auto` candidates both ask this. Passes the costs do not time (a
// recorded run of fused backwards times no input or weight pass) are
// derived from those they do, with the request's splitBackward.
PlanRequest pinnedRequest(
    PlanRequest request,
    const Plan& plan,
    std::vector<StageCosts> stageCosts);

// Per-stage costs for the simulator: forward and backward sums scaled by the
// device speed, B and W as halves of the backward (times splitBackward),
// recompute as one more forward, instructionMs on every compute
// instruction, transfer from the link.
std::vector<StageCosts> stageCostsOf(
    const std::vector<LayerCost>& layers,
    const std::vector<DeviceSpec>& devices,
    const std::vector<int>& boundaries,
    double instructionMs = 0.0,
    double splitBackward = 1.0);

// The partitioner's memory model for a schedule: each stage's peak held and
// live micro-batches from its unit-cost simulation. Weight gradients are
// added in place under directWeightGradients or a split backward (whose
// weight pass computes them directly).
MemoryModel memoryModelOf(
    const Schedule& schedule,
    double optimizerFactor,
    int64_t inputBytes,
    bool directWeightGradients = false);

// Whether a request's plan fits: every stage within its device's memory
// and, when hostBytes > 0, all stages together within what this host has
// available (one process holds every stage). `tpipe plan`, `tpipe
// validate` and `tpipe train` all ask this one function, so they agree.
struct Feasibility {
  bool fits = true;
  Plan plan;           // resolved, when the resolver found one
  std::string problem; // what does not fit, naming need and capacity
  // Changes that fit when applied as written: each is the full set of
  // config keys it changes from this request ("pipeline.checkpoint=always,
  // pipeline.partition=time"), checked by resolving the changed request.
  std::vector<std::string> fixes;
};
Feasibility checkFeasibility(const PlanRequest& request, int64_t hostBytes = 0);

nlohmann::json planToJson(const Plan& plan);
// The per-stage table, the simulated timeline, the cost source and notes.
void printPlan(std::ostream& out, const Plan& plan);

} // namespace tpipe
