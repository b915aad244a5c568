// Choosing a config's plan on this machine or for a described cluster:
// `tpipe tune` and "pipeline": {"auto": true}. The search itself is pure
// (tpipe/tune.h); this calibrates its cost model by running the config's
// job, and measures candidates where the prediction cannot decide.
#pragma once

#include <functional>
#include <iosfwd>
#include <stdexcept>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tpipe/config.h"
#include "tpipe/tune.h"

namespace tpipe {

struct TuneOptions {
  int top = 10;                // candidates shown (and measured, with measure)
  bool measure = false;        // run the top ones and rank them by measurement
  int measureSteps = 4;        // turns per candidate and round (after 2 steps)
  int measureRounds = 2;       // rounds over the candidates, in turn
  bool quick = false;          // fewer calibration rounds (for pipeline.auto)
  std::ostream* log = nullptr; // progress lines; null: none
  // Asked before each measurement; true ends the tune with TuneStopped. A
  // run stopped by SIGINT while pipeline.auto tunes ends within a step,
  // not after the tune's minute.
  std::function<bool()> stopRequested;
};

// The tune was stopped (TuneOptions::stopRequested) before it chose.
struct TuneStopped : std::runtime_error {
  TuneStopped() : std::runtime_error("the tune was stopped before it chose") {}
};

struct TuneOutcome {
  CostModel model;
  TuneRequest request; // what was searched (see candidatePlanRequest)
  TuneResult result;
  // The calibration, for the reader: fit residuals, runtime overheads.
  std::vector<std::string> calibration;
};

// Calibrates a cost model on this machine for the config's job (profiles
// every layer at the micro-batch sizes and thread counts the search needs,
// then times real steps, in turn, for the runtime's own costs and the
// noise) and searches. Where the prediction cannot decide (the plans
// predicted within 25% of the fastest, at most 4, the predicted choice, and
// the fastest predicted per device count within 2x) or with measure (the
// top candidates), they run in turn, built once, one untimed step and then
// 4 timed ones each per round over 15 rounds (measureRounds x measureSteps
// with measure; more beside a neighbour's bursts), and the fastest measured
// becomes the choice, or the simplest within the measurement's noise of it (at
// least 5%). The config's devices are the devices a plan may use; its pipeline
// settings are ignored.
TuneOutcome tuneConfig(const Config& config, const TuneOptions& options);

// Plans for a described cluster, nothing measured: per-layer FLOPs and
// bytes from shape inference, device peak FLOP/s and efficiency, links and
// memory from `cluster` (format in docs/tune.md). Throws ConfigError naming
// a bad key. `source` names the file for messages.
TuneOutcome tuneForCluster(
    const Config& config,
    const nlohmann::json& cluster,
    const std::string& source);

// tuneForCluster's cost model and request without the search (result left
// empty): to predict chosen plans with predictCandidate, as
// `benchmarks/run cluster` does for published runs.
TuneOutcome clusterCostModel(
    const Config& config,
    const nlohmann::json& cluster,
    const std::string& source);

// Runs each candidate (one process, threads) from the same initial weights:
// each built once and given 2 warm-up steps, then `rounds` rounds in which
// each takes a turn: one untimed step, then `steps` steps in a row, as
// training runs them, timed together. The lower quartile over the rounds of
// each one's ms per step (batch, forward, backward, optimizer): a busy
// neighbour only adds time, and the quartile is robust to bursts that hit
// one plan's turns more.
std::vector<double> measureCandidates(
    const Config& config,
    const std::vector<TuneCandidate>& candidates,
    int steps,
    int rounds,
    std::ostream* log = nullptr);

// A config file's JSON with its pipeline section set to run `candidate`
// (`tpipe tune --write`): the first `ranks` devices, partition "balance"
// with its boundaries, its schedule, micro-batches, checkpoint mode and
// threads; every other key as written. Training itself takes the
// candidate's plan (candidatePlanRequest), never a config rebuilt from it.
nlohmann::json configWithPlan(
    nlohmann::json config,
    const TuneCandidate& candidate);

} // namespace tpipe
