// Measuring per-layer costs for the plan resolver (tpipe/plan.h).
//
// profileLayers runs each layer forward and backward on sample micro-batches
// on the device it will run on: warm-up, then the median of several runs, at
// a few micro-batch sizes, with a least-squares fit of ln t against ln n (a
// quadratic: small micro-batches run matrix products less efficiently, so
// time is not linear in the size), so plans for other micro-batch counts
// need no new measurement. Memory comes from the
// device's own allocator statistics (the counting CPU allocator; CUDA's
// caching allocator in CUDA builds): bytes the forward leaves alive for the
// backward.
//
// Noise: measurement rounds repeat until the medians' relative uncertainty
// (Profile::noise, about two standard errors of the summed medians) is below
// ProfileOptions::noiseBound, or maxRounds pass (Profile::settled says
// which). The plan resolver treats plans closer than the noise as equal.
//
// The caller's modules are left exactly as found: device, parameter values,
// gradients (the .grad tensors themselves), buffers (batch norm statistics)
// and the process's default CPU generator.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include "tpipe/costs.h"
#include "tpipe/pipeline.h"

namespace tpipe {

// Least squares in log space (Eigen, column-pivoting QR).
SizeCurve fitSizeCurve(
    const std::vector<int64_t>& sizes,
    const std::vector<double>& times);

struct LayerProfile {
  LayerCost cost; // at the profile's micro-batch size
  SizeCurve forward, backward;
};

struct Profile {
  std::string device = "cpu";
  int64_t microBatchSize = 1;
  int64_t inputBytes = 0; // the model input per micro-batch
  std::vector<int64_t> fitSizes;
  std::vector<LayerProfile> layers;
  double noise = 0.0; // relative uncertainty of the summed medians
  int rounds = 1;
  bool settled = true; // noise reached ProfileOptions::noiseBound

  // Costs at another micro-batch size: times from the fits, bytes scaled.
  std::vector<LayerCost> costsAt(int64_t microBatchSize) const;
};

struct ProfileOptions {
  int64_t microBatchSize = 8;
  // The sizes the curves are fitted over; empty: half, one and two times
  // microBatchSize. microBatchSize itself is always measured.
  std::vector<int64_t> fitSizes;
  // Intra-op threads while measuring (restored after); 0: as the caller has.
  int threads = 0;
  int warmup = 2;
  int repeats = 5;
  std::string device = "cpu";
  int maxRounds = 4;
  double noiseBound = 0.03;
  // The least noise the resolver is told: run-to-run drift of a shared
  // machine that no repetition inside one call sees.
  double noiseFloor = 0.02;
  // Called before each layer is measured, if set. It may throw to end the
  // profile early (the tuner does on SIGINT or SIGTERM): the exception
  // leaves profileLayers once the layers and the thread count are as the
  // caller had them.
  std::function<void()> beforeEachLayer;
};

// `sample(n)` returns a model input batch of n samples.
Profile profileLayers(
    const LayerList& layers,
    const std::function<at::Tensor(int64_t)>& sample,
    const ProfileOptions& options);

nlohmann::json profileToJson(const Profile& profile);
Profile profileFromJson(const nlohmann::json& json); // throws ConfigError

} // namespace tpipe
