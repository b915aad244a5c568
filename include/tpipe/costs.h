// Cost types shared by the pure parts: the partitioner (per-layer costs,
// devices) and the scheduler's simulator (per-stage costs). Plain values.
#pragma once

#include <cstdint>
#include <string>

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

// Time against micro-batch size n: ln ms = c0 + c1 ln n + c2 (ln n)^2 over
// the measured sizes [lo, hi]; past them it goes on along the end's slope
// (held between 0 and 1.2, so a few points cannot extrapolate wildly). One
// measured size gives time proportional to n; two, a power law.
struct SizeCurve {
  double c0 = 0.0, c1 = 1.0, c2 = 0.0;
  double lo = 1.0, hi = 1.0;
  double worstResidual = 0.0; // max |fit / measured - 1| at measured sizes
  double at(double samples) const;
};

struct DeviceSpec {
  std::string name;
  double speed = 1.0;          // relative: a stage's time is divided by it
  int64_t memoryBytes = 0;     // capacity; 0: unlimited
  double linkBytesPerMs = 0.0; // to the next device; 0: transfers are free
  double linkLatencyMs = 0.0;  // per transfer to the next device
};

// What one stage's instructions cost, for the simulator.
struct StageCosts {
  double forward = 1.0;
  double backward = 2.0;       // a whole Backward
  double backwardInput = 1.0;  // zero-bubble B
  double backwardWeight = 1.0; // zero-bubble W
  double recompute = 1.0;
  double transfer = 0.0;
};

} // namespace tpipe
