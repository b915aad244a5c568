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

#include "tpipe/schedule.h"

namespace tpipe {

class PartitionError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Layers per stage as evenly as possible; earlier stages take the remainder.
std::vector<int> uniformBoundaries(int layers, int stages);

// An explicit balance (layers per stage), checked: each >= 1, sum == layers.
std::vector<int> balanceBoundaries(const std::vector<int>& balance, int layers);

// The contiguous split into `stages` parts minimizing the largest part's
// summed weight (exact; ties go to the split whose boundaries come first).
std::vector<int> minMaxBoundaries(const std::vector<double>& weights,
                                  int stages);

// Layers per stage from boundaries: {0, 2, 5} -> {2, 3}.
std::vector<int> balanceOf(const std::vector<int>& boundaries);

}  // namespace tpipe

namespace tpipe {

// What one layer costs, per micro-batch of the profiled size.
struct LayerCost {
  std::string name;
  double forwardMs = 0.0;
  double backwardMs = 0.0;
  int64_t paramBytes = 0;
  // The layer's output per micro-batch: what crosses a link when a stage
  // ends here, and the stage input the next stage keeps under remat.
  int64_t activationBytes = 0;
  // Bytes the layer keeps alive for its backward when not rematerialized.
  int64_t stashBytes = 0;
};

struct DeviceSpec {
  std::string name;
  double speed = 1.0;          // relative: a stage's time is divided by it
  int64_t memoryBytes = 0;     // capacity; 0: unlimited
  double linkBytesPerMs = 0.0; // to the next device; 0: transfers are free
};

// How many micro-batches of activations a stage keeps, from the schedule
// and checkpoint mode; and the optimizer's state per parameter byte.
struct MemoryModel {
  std::string schedule = "gpipe";  // gpipe | 1f1b | interleaved-1f1b | zb-h1
  std::string checkpoint = "never";  // always | except_last | never
  int microBatches = 1;
  double optimizerFactor = 0.0;  // sgd 0, sgd+momentum 1, adam 2
  int64_t inputBytes = 0;        // the model input per micro-batch
};

struct PartitionProblem {
  std::vector<LayerCost> layers;
  std::vector<DeviceSpec> devices;
  // Stage k runs on devices[k]. 0: choose the stage count (1 to the device
  // count) that minimizes the predicted fill-drain step time.
  int stages = 0;
  MemoryModel memory;
};

struct StageReport {
  int firstLayer = 0;
  int endLayer = 0;  // exclusive
  std::string device;
  double computeMs = 0.0;   // (forward + backward) / device speed
  double transferMs = 0.0;  // output activation over the link
  double timeMs = 0.0;      // computeMs + transferMs
  int64_t paramBytes = 0;
  int64_t memoryBytes = 0;  // parameters, gradients, optimizer, activations
  int64_t activationBytes = 0;  // the activation share of memoryBytes
  int64_t capacityBytes = 0;    // 0: unlimited
  int inFlight = 0;             // micro-batches whose activations it keeps
};

struct PartitionPlan {
  std::vector<int> boundaries;  // stages + 1 layer indices
  double bottleneckMs = 0.0;
  std::vector<StageReport> stages;
};

// "1.50 GiB", "512.00 MiB", "12 B".
std::string formatBytes(int64_t bytes);

// Micro-batches stage k of p keeps in flight under the memory model.
int inFlightMicroBatches(const MemoryModel& memory, int stage, int stages);

// Evaluates one given partition (no search): times and memory per stage.
PartitionPlan evaluatePartition(const PartitionProblem& problem,
                                const std::vector<int>& boundaries);

// The partition minimizing the bottleneck stage time within every device's
// memory: exact (bisection on the bottleneck with an interval-reachability
// feasibility check), ties broken toward the earliest boundaries. Throws
// PartitionError explaining infeasibility: a layer too large for every
// device, or the number of devices of this size that would fit.
PartitionPlan optimalPartition(const PartitionProblem& problem);

// Per-stage costs for the schedule simulator: forward and backward sums
// scaled by the device speed, B and W as halves of the backward, recompute
// as one more forward, transfer from the link.
std::vector<StageCosts> stageCostsOf(const PartitionProblem& problem, const PartitionPlan& plan);

}  // namespace tpipe
