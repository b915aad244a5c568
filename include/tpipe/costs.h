// Cost types shared by the pure parts: the partitioner (per-layer costs,
// devices) and the scheduler's simulator (per-stage costs). Plain values.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

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
  // Its backward adds the weight gradient into the parameter's gradient in
  // place (direct weight gradients of a LibTorch Linear), allocating no
  // weight-sized gradient first. It holds only where the stage's every
  // parameter-owning layer is such a layer: else autograd walks the stage.
  bool weightGradientInPlace = false;
};

// Time against micro-batch size n, through measured (size, ms) points:
// straight in log-log space between neighbouring sizes (a power law per
// interval, so time need not be linear in the size: small matrix products
// are inefficient), and past the ends along the end interval's slope (held
// in [0, 1.2], so a few points cannot extrapolate wildly). One point: time
// proportional to n.
struct SizeCurve {
  std::vector<double> sizes; // ascending, distinct
  std::vector<double> ms;
  // How far each inner point lies from the power law through its two
  // neighbours (max relative): the curve's roughness, noise included.
  double worstResidual = 0.0;
  double at(double samples) const;
  static SizeCurve proportional(double size, double ms);
};

// `cost` at micro-batch size n: its times from the curves (never negative),
// its activation and stash bytes from their bytes per sample. The one rule
// by which the tuner's cost model and the profiler's profile scale a layer.
LayerCost layerCostAt(
    LayerCost cost,
    const SizeCurve& forward,
    const SizeCurve& backward,
    double activationBytesPerSample,
    double stashBytesPerSample,
    double n);

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
  // An overlapped forward-and-backward pair takes F + B - overlap x min(F,
  // B): 0 runs the two one after the other (CPU), 1 hides the shorter part
  // under the longer entirely.
  double overlap = 0.0;
};

} // namespace tpipe
