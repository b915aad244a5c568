// The parts the training loop (trainer.cpp) is made of; private to src/train.
#pragma once

#include <cstdint>
#include <functional>
#include <iosfwd>
#include <memory>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <torch/optim/optimizer.h>

#include "tpipe/distributed.h"
#include "tpipe/trainer.h"
#include "tpipe/planning.h"
#include "tpipe/tuning.h"

namespace tpipe {

// ---- optimization.cpp: loss, optimizer, learning rate, batches ----------

LossFunction makeLoss(const std::string& name);
std::unique_ptr<torch::optim::Optimizer> makeOptimizer(
    const OptimizerConfig& optimizer,
    std::vector<torch::Tensor> parameters);
// LibTorch keys an optimizer's state by its parameter's TensorImpl: 1.x
// as the pointer's text, 2.x as the pointer itself.
template <typename StateMap>
typename StateMap::key_type stateKeyOf(const torch::Tensor& parameter) {
  using Key = typename StateMap::key_type;
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;
    text << parameter.unsafeGetTensorImpl();
    return text.str();
  } else {
    return parameter.unsafeGetTensorImpl();
  }
}

// One optimizer per pipeline rank (null where another process trains it),
// each over Pipeline::rankParameters, steps exactly what one optimizer over
// every parameter would. Their state moves into that one for a checkpoint
// (collect) and back after a resume or a re-plan (distribute); the two
// then share state tensors until the ranks' optimizers next step.
using RankOptimizers = std::vector<std::unique_ptr<torch::optim::Optimizer>>;
RankOptimizers makeRankOptimizers(
    const OptimizerConfig& optimizer,
    const Pipeline& pipe);
void collectOptimizerState(
    torch::optim::Optimizer& into,
    const RankOptimizers& from);
void distributeOptimizerState(
    torch::optim::Optimizer& from,
    RankOptimizers& into);
// A deep copy of the optimizer's state; calling the result puts it back
// (once). SGD, Adam and AdamW.
std::function<void()> snapshotOptimizerState(
    torch::optim::Optimizer& optimizer);
// Linear warm-up over warmupSteps, then constant or cosine decay to minLr
// at the final step. `step` counts from 0.
double learningRate(const TrainConfig& train, int64_t step);

// Batch k of the run: epoch k / batchesPerEpoch; with shuffle the epoch's
// order is a permutation drawn from (seed, epoch) alone, so any step's batch
// can be found again on resume.
class BatchSource {
 public:
  BatchSource(
      const Dataset& data,
      int64_t batchSize,
      bool shuffle,
      uint64_t seed);
  std::pair<torch::Tensor, torch::Tensor> batch(int64_t step);

 private:
  const Dataset& data_;
  int64_t batchSize_;
  bool shuffle_;
  uint64_t seed_;
  int64_t batchesPerEpoch_ = 1;
  int64_t epoch_ = -1;
  torch::Tensor order_;
};

// ---- planning.cpp: the world and the plan --------------------------------

// train.precision bf16: forwards run under autocast, whose backward stays
// autograd's (no weight gradient is added in place).
bool autocasts(const Config& config);

// Who may update before a posted step is decided (the memory model's undo
// copy): ranks whose steps overlap and check the gradients, every one
// across processes; in one process none of a model with tied weights.
SpeculativeUpdates speculativeUpdatesOf(const Config& config);

// pipeline.elastic across processes: the config with as many pipeline ranks
// as the world holds (WORLD_SIZE / data_parallel), on the first devices
// listed; a world below min_ranks, or larger than the devices or the model
// allow, is refused naming what would fit. Otherwise the config unchanged.
Config fittedToWorld(const Config& config);

// The communicator of a multi-process run (null for one process), after
// rendezvous has compared every rank's config.
std::shared_ptr<Communicator> joinWorld(const Config& config);

// Profiles the config's model on its first device's type with these
// options (sizes, threads, repeats); inputs drawn from the config's seed.
Profile profileModelWith(
    const Config& config,
    const BuiltModel& model,
    ProfileOptions options);

// A plan and the request it was resolved from: a re-plan (from measured
// stage times) keeps the request's devices, costs and options.
struct ResolvedPlan {
  PlanRequest request;
  Plan plan;
  // pipeline.auto: the tune's prediction of its choice (anchored to what it
  // measured), which the run reports instead of the plan's own simulation
  // over unanchored costs; negative: none.
  double tunedStepMs = -1.0;
};

// The plan this run trains with: costs measured (or read) once, on rank 0,
// and shared, so every process resolves the same plan.
ResolvedPlan planTraining(
    const Config& config,
    const BuiltModel& model,
    const std::string& profilePath,
    bool measure,
    Communicator* world);

// ---- trainer.cpp ----------------------------------------------------------

// What the pipeline of a run is made of: the config's devices, threads,
// seed, precision and transports, and the plan's stages and schedule.
PipelineOptions pipelineOptions(
    const Config& config,
    const BuiltModel& model,
    const Plan& plan,
    const std::shared_ptr<Communicator>& communicator);

// ---- reports.cpp: memory table, bubble report and trace files -----------

// Sized parts per device and the caps on what workers may allocate: the
// declared capacity less the parameters and optimizer state living there.
std::vector<MemoryRow> prepareMemory(const Config& config, Pipeline& pipe);
std::vector<MemoryRow> finishMemory(
    const Pipeline& pipe,
    std::vector<MemoryRow> rows);
// Across processes: this process's measured rows as text for rank 0
// (gatherText; empty outside the first replica), and rank 0's rows with
// every part's measurements put in.
std::string memoryForRoot(
    const std::vector<MemoryRow>& rows,
    const Communicator& world);
std::vector<MemoryRow> mergeMemory(
    std::vector<MemoryRow> rows,
    const std::vector<std::string>& parts);
void printMemory(std::ostream& log, const std::vector<MemoryRow>& rows);
void writeTraceOutputs(
    const Trace& trace,
    const TrainOptions& options,
    TrainSummary& summary,
    std::ostream& log);
std::string duration(double seconds);

// One process's recorded steps as text for rank 0 (gatherText), with the
// offset that puts its clock on rank 0's; empty when it is not in the
// first replica (one replica's ranks make the picture).
std::string traceForRoot(
    const Trace& trace,
    const Communicator& world,
    double offsetUs);
// The steps every part recorded, each event on rank 0's clock and relative
// to the step's earliest start: one trace of every rank.
Trace mergeTraces(const Trace& local, const std::vector<std::string>& parts);

} // namespace tpipe
