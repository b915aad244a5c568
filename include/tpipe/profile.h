// Measuring per-layer costs for the partitioner, and planning from them.
//
// profileLayers runs each layer forward and backward on sample micro-batches
// on the device it will run on: warm-up, then the median of several runs, at
// a few micro-batch sizes, with a least-squares fit t = a + b * n so plans
// for other micro-batch counts need no new measurement. Memory comes from
// LibTorch's allocator (bytes the forward leaves alive for the backward).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <nlohmann/json_fwd.hpp>

#include "tpipe/config.h"
#include "tpipe/partition.h"
#include "tpipe/pipeline.h"

namespace tpipe {

struct LinearFit {
  double intercept = 0.0;  // ms
  double slope = 0.0;      // ms per sample
  double at(double samples) const { return intercept + slope * samples; }
};

// Least-squares line through (size, time) points (Eigen, column-pivoting QR).
LinearFit fitLine(const std::vector<int64_t>& sizes, const std::vector<double>& times);

struct LayerProfile {
  LayerCost cost;  // at the profile's micro-batch size
  LinearFit forward, backward;
};

struct Profile {
  std::string device = "cpu";
  int64_t microBatchSize = 1;
  int64_t inputBytes = 0;  // the model input per micro-batch
  std::vector<int64_t> fitSizes;
  std::vector<LayerProfile> layers;

  // Costs at another micro-batch size: times from the fits, bytes scaled.
  std::vector<LayerCost> costsAt(int64_t microBatchSize) const;
};

struct ProfileOptions {
  int64_t microBatchSize = 8;
  int warmup = 2;
  int repeats = 5;
  std::string device = "cpu";
};

// `sample(n)` returns a model input batch of n samples.
Profile profileLayers(const LayerList& layers, const std::function<at::Tensor(int64_t)>& sample,
                      const ProfileOptions& options);

nlohmann::json profileToJson(const Profile& profile);
Profile profileFromJson(const nlohmann::json& json);  // throws ConfigError

// The partition problem a config poses: its devices (speed, memory), memory
// model (schedule, checkpoint, micro-batches, optimizer) and stage count.
PartitionProblem partitionProblem(const Config& config, const std::vector<LayerCost>& costs,
                                  int64_t inputBytes);

// Boundaries for the config's partition method: `time` is the optimal plan,
// the others are evaluated as configured.
PartitionPlan planFor(const Config& config, const PartitionProblem& problem,
                      const std::vector<int64_t>& parameterCounts);

}  // namespace tpipe
