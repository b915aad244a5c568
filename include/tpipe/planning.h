// From a config to a plan: the per-layer costs a plan is resolved over
// (a saved profile, measured now, or parameter bytes and shapes), the plan
// resolver's request for a config, and whether its plan fits. `tpipe
// train`, `plan`, `validate` and `profile` all ask these, so they agree.
#pragma once

#include <cstdint>
#include <string>

#include "tpipe/config.h"
#include "tpipe/model.h"
#include "tpipe/plan.h"
#include "tpipe/profile.h"

namespace tpipe {

// Profiles the config's model at its micro-batch size (batch / micro-batches)
// on the first pipeline device's type.
Profile profileModel(const Config& config, const BuiltModel& model);

// Per-layer costs for planning, and where they came from.
struct TrainingCosts {
  std::vector<LayerCost> layers;
  int64_t inputBytes = 0;
  double noise = 0.0;
  std::string source; // "parameter bytes", "measured now", "profile.json"
};

// Whether the config's plan needs measured times or bytes: partition `time`,
// or a device with a memory capacity.
bool needsMeasuredCosts(const Config& config);

// Costs for the config's plan: read from a saved profile (`tpipe profile
// --out`) when profilePath is given, measured now when `measure`, else
// parameter bytes alone. A profile of another model is a ConfigError.
TrainingCosts trainingCosts(
    const Config& config,
    const BuiltModel& model,
    const std::string& profilePath,
    bool measure);

// Bytes without running anything: parameters, and each layer's output and
// saved activations at the config's micro-batch size from shape inference
// (the layer facts; a TorchScript model's saved bytes are taken as its
// output's). No times.
TrainingCosts shapeCosts(const Config& config, const BuiltModel& model);

// Memory this process may still use on this host (MemAvailable); 0 when
// unknown.
int64_t hostAvailableBytes();

// checkFeasibility for a config over these costs, against its devices'
// caps and (in one process) the host's available memory; and the text a
// refusal prints: the problem, then the changes that would fit.
Feasibility configFeasibility(
    const Config& config,
    const TrainingCosts& costs,
    bool oneProcess = true);
std::string infeasibleText(const Feasibility& verdict);

// Costs from a profile, at the config's micro-batch size.
TrainingCosts costsFromProfile(
    const Config& config,
    const Profile& profile,
    const std::string& source);

// The plan resolver's request for a config: its devices (speed, memory),
// partition method, schedule, micro-batches, checkpoint mode and optimizer.
PlanRequest planRequest(const Config& config, const TrainingCosts& costs);

} // namespace tpipe
