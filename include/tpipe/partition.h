// Partitioning a layer list into contiguous stages.
//
// A partition is `stages + 1` boundaries: stage k runs layers
// [boundaries[k], boundaries[k + 1]). Every function here is pure: costs in,
// boundaries out. Measuring the costs (running layers) lives elsewhere.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "tpipe/costs.h"
#include "tpipe/errors.h"

namespace tpipe {

class PartitionError : public UserError {
 public:
  using UserError::UserError;
};

// Layers per stage as evenly as possible; earlier stages take the remainder.
std::vector<int> uniformBoundaries(int layers, int stages);

// An explicit balance (layers per stage), checked: each >= 1, sum == layers.
std::vector<int> balanceBoundaries(const std::vector<int>& balance, int layers);

// The contiguous split into `stages` parts minimizing the largest part's
// summed weight (exact; ties go to the split whose boundaries come first).
std::vector<int> minMaxBoundaries(
    const std::vector<double>& weights,
    int stages);

// Layers per stage from boundaries: {0, 2, 5} -> {2, 3}.
std::vector<int> balanceOf(const std::vector<int>& boundaries);

} // namespace tpipe

namespace tpipe {

// What a stage holds per micro-batch in flight, and the optimizer's state
// per parameter byte. The counts come from the schedule's own simulation
// (the plan resolver asks the simulator), so the partitioner knows nothing
// of schedules: for stage k, stashed[k] micro-batches keep their stage input
// and live[k] of them keep their whole activation graph (the rest are
// rematerialized before their backward). Empty vectors mean one of each.
struct MemoryModel {
  std::vector<int> stashed;
  std::vector<int> live;
  double optimizerFactor = 0.0; // sgd 0, sgd+momentum 1, adam 2
  int64_t inputBytes = 0;       // the model input per micro-batch
  // How many copies of each stage's parameters (with their gradients and
  // optimizer state) the devices hold: 2 under a bidirectional schedule
  // (dualpipe), charged to the stage.
  int parameterCopies = 1;
  // Each rank may keep its parameters, gradients and optimizer state a
  // second time: posted steps that check the gradients update before the
  // step is decided and hold what they replaced, to undo it, through the
  // next step (PlanRequest::speculativeUpdates).
  bool keepsUndoCopy = false;
  // Backwards add the weight gradients of layers marked
  // LayerCost::weightGradientInPlace in place (direct weight gradients, or
  // a schedule's weight pass): a stage of such layers alone allocates no
  // weight-sized gradient.
  bool weightGradientsInPlace = false;

  int stashedAt(int stage) const;
  int liveAt(int stage) const;
  // No stage rematerializes: it keeps the whole graph of everything it holds.
  bool keepsEverything() const;
};

struct PartitionProblem {
  std::vector<LayerCost> layers;
  std::vector<DeviceSpec> devices;
  // Stage k runs on devices[k]. Choosing the stage count is the plan
  // resolver's job (it simulates each candidate's schedule).
  int stages = 1;
  MemoryModel memory;
};

struct StageReport {
  int firstLayer = 0;
  int endLayer = 0; // exclusive
  std::string device;
  double computeMs = 0.0;  // (forward + backward) / device speed
  double transferMs = 0.0; // output activation over the link
  double timeMs = 0.0;     // computeMs + transferMs
  int64_t paramBytes = 0;
  int64_t memoryBytes = 0;     // parameters, gradients, optimizer, activations
  int64_t activationBytes = 0; // the activation share of memoryBytes
  int64_t capacityBytes = 0;   // 0: unlimited
  int inFlight = 0;            // micro-batches whose activations it keeps
};

struct PartitionPlan {
  std::vector<int> boundaries; // stages + 1 layer indices
  double bottleneckMs = 0.0;
  std::vector<StageReport> stages;
};

// "1.50 GiB", "512.00 MiB", "12 B".
std::string formatBytes(int64_t bytes);

// Evaluates one given partition (no search): times and memory per stage.
PartitionPlan evaluatePartition(
    const PartitionProblem& problem,
    const std::vector<int>& boundaries);

// The partition minimizing the bottleneck stage time within every device's
// memory: exact (bisection on the bottleneck with an interval-reachability
// feasibility check), ties broken toward the earliest boundaries. Throws
// PartitionError explaining infeasibility: a layer too large for every
// device, or the number of devices of this size that would fit.
PartitionPlan optimalPartition(const PartitionProblem& problem);

} // namespace tpipe
