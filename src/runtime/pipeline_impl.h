// Pipeline's private state, shared by its two files: pipeline.cpp builds
// it (plan, placement, workers) and pipeline_step.cpp drives steps on it.
#pragma once

#include <algorithm>
#include <atomic>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

#include "runtime/executor.h"
#include "runtime/memory.h"
#include "runtime/placement.h"
#include "runtime/ties.h"
#include "runtime/transport.h"
#include "runtime/worker.h"
#include "tpipe/pipeline.h"

namespace tpipe {
namespace runtime {
struct PostedStep; // overlapped_steps.cpp
} // namespace runtime

struct Pipeline::Impl {
  LayerList layers;
  // A bidirectional schedule's further chains run copies of the layers:
  // chainCopies[c - 1] for chain c (Schedule::chains), tied to the
  // originals (runtime/ties.h).
  std::vector<LayerList> chainCopies;
  const LayerList& layersOfStage(int stage) const {
    const int chain = stage / schedule.chainLength();
    return chain == 0 ? layers : chainCopies[chain - 1];
  }
  void copyLayersForChains();
  void followOriginalsMode();
  PipelineOptions options;
  std::vector<c10::Device> rankDevices;
  std::vector<int> boundaries;
  Schedule schedule;
  std::vector<runtime::StageRuntime> stages;
  c10::Device remoteDevice{c10::kCPU};  // see place()
  std::vector<runtime::TiedGroup> ties; // parameters used on several stages
  runtime::LocalTransport localTransport;
  std::unique_ptr<runtime::Transport> remoteTransport;
  runtime::Transport* transport = &localTransport;
  // Set when every transfer's shape is known ahead (across processes).
  c10::optional<at::ScalarType> transferDtype;
  runtime::Placement placement; // see resolve()
  std::vector<int> localRanks;  // the ranks this process runs

  // "stage 1 (cpu:1)", or "stage 1, 5 (cpu:1)" with virtual stages.
  std::string memoryLabel(int rank) const {
    std::string stageList;
    for (int s : schedule.stagesOfRank(rank)) {
      stageList += (stageList.empty() ? "" : ", ") + std::to_string(s);
    }
    return "stage " + stageList + " (" + options.devices[rank] + ")";
  }

  bool isLocalStage(int stage) const {
    return placement.stages[stage].local;
  }
  std::vector<std::unique_ptr<runtime::DeviceWorker>> workers;
  Trace trace;
  int steps = 0;
  // Per local rank (localRanks' order), when tracking memory.
  std::vector<int> memorySlots;

  // The slot charged for `rank`'s allocations; kUnattributed where memory
  // is not tracked or another process runs the rank.
  int memorySlotOf(int rank) const {
    const auto local = std::find(localRanks.begin(), localRanks.end(), rank);
    return memorySlots.empty() || local == localRanks.end()
        ? memory::kUnattributed
        : memorySlots[static_cast<size_t>(local - localRanks.begin())];
  }

  ~Impl() {
    workers.clear(); // join before the slots go back
    for (int slot : memorySlots)
      memory::releaseSlot(slot);
  }

  Plan plan;

  void resolve();
  std::vector<c10::Device> checkLayersAndDevices() const;
  PlanRequest planRequest(size_t deviceCount) const;
  void checkAgreesWithPlan() const;
  void place();
  void checkSharedTensorsStayOnOneDevice() const;
  void placeStage(int s);
  void startWorkers();
  // A step's state for `plan`, before its transport begins.
  void prepare(runtime::StepState& state, const Schedule& plan);
  void run(runtime::StepState& state, const Schedule& plan);
  // What trainStep and postStep refuse, named after `what`.
  void checkBatch(
      const at::Tensor& input,
      const at::Tensor& target,
      const LossFunction& lossFn,
      const char* what) const;
  // The batch's loss: the weighted micro-batch losses summed in order (the
  // ones this process computed, when they end on several ranks).
  static at::Tensor lossTotal(const runtime::StepState& state);
  // Whether this process runs a stage where micro-batches end (computes
  // losses or outputs).
  bool endsMicroBatches() const {
    for (int s = 0; s < schedule.stages(); ++s) {
      if (!schedule.hasNext(s) && isLocalStage(s))
        return true;
    }
    return false;
  }
  bool runsOnCaller() const {
    return placement.runsOnCaller();
  }
  // Before work is handed to stage workers: the calling thread only takes
  // batches, splits them and waits, so it runs no OpenMP team of its own.
  // A team it leaves behind spins on a core the stages need: two one-thread
  // stages stepped 1.3-1.5x slower from a thread that had run a two-thread
  // stage (the tuner's). A fresh process got one thread there only by
  // chance (LibTorch sets a thread's count at its first parallel op, from
  // the last count set anywhere: the workers' one).
  void leaveCoresToWorkers() const;
  // Runs job(rank) where each of `ranks` (local ones) works, and waits.
  void runOn(
      const std::vector<int>& ranks,
      const std::function<void(int)>& job);
  std::vector<at::Tensor> gradientsOf(int stage) const {
    std::vector<at::Tensor> gradients;
    for (const auto& parameter : stages[stage].parameters)
      gradients.push_back(parameter.grad());
    return gradients;
  }
  void expectShapes(const runtime::StepState& state, const Schedule& plan);
  void routeSkips(runtime::StageRuntime& stage) const;
  void checkTransfersInOrder(const Schedule& plan) const;
  // The most tensors one transfer carries (the activation and its skips).
  int mostSlots() const {
    size_t most = 1;
    for (const auto& stage : stages)
      most = std::max(most, stage.sourceLayers.size());
    return static_cast<int>(most);
  }
  void keepTrace(runtime::StepState& state, double wallUs);
  // Replicas average each stage's gradients: armed, as its last backward
  // ends (options.overlapGradientSync); finished after the part, starting
  // those not armed. A no-op with one replica.
  void armGradientAveraging(runtime::StepState& state);
  void finishGradientAveraging(const runtime::StepState& state);
  // The step's loss as every process returns it: the mean over the
  // replicas, in the last stage's dtype where it runs here.
  at::Tensor worldLossTensor(double value, const runtime::StepState& state)
      const;
  // The squared L2 norm of a stage's gradients, in double, one device
  // sync: what clipGradNorm and a posted step's validation add up.
  double gradientSquares(int stage) const;
  // gradientSquares plus each tied group whose first use is on the stage:
  // the copies hold one summed gradient, counted once. Per stage, what
  // clipGradNorm adds and a posted step's validation adds alike.
  double stageSquares(int stage) const;
  // Whether rank `rank` holds a copy of a tied parameter.
  bool holdsTiedCopy(int rank) const;
  // One tensor of a tied group used on two ranks: both ranks' updates would
  // step it, so such a pipeline keeps the barrier between steps.
  bool tiedTensorOnTwoRanks() const;

  // Steps posted without a barrier (overlapped_steps.cpp), oldest first.
  std::deque<std::shared_ptr<runtime::PostedStep>> posted;
  // Whether the last decided step was clipped or skipped: the next ones
  // likely are too, and waiting for their decision beats running a step
  // twice (a clip that binds every step would otherwise rerun each one).
  std::atomic<bool> lastStepBound{false};
  int64_t postedCount = 0;    // the same on every process: notes' keys
  bool transportOpen = false; // begun for posted steps, not yet ended
  bool acrossProcesses() const {
    return options.communicator != nullptr;
  }
  void post(std::shared_ptr<runtime::PostedStep> step);
  void runPostedPart(runtime::PostedStep& step, int rank);
  void updateAfterPart(runtime::PostedStep& step, int rank);
  void sumTiesOnceAllIn(runtime::PostedStep& step);
  void exchangeTies(runtime::PostedStep& step);
  int lossesEndingHere() const;
  bool endsChainOnRank(int rank) const;
  void decide(runtime::PostedStep& step);
  // Waits for the step's validation; across processes, receives the other
  // ranks' notes first unless another thread of this process does.
  void awaitDecision(runtime::PostedStep& step);
  // Across processes: the last stage's rank tells the others the loss;
  // every rank tells the others its part of the step.
  void tellLoss(runtime::PostedStep& step);
  double worldLoss(runtime::PostedStep& step);
  void tellPart(
      runtime::PostedStep& step,
      int rank,
      bool speculated,
      const std::vector<double>& squares);
  void settle(runtime::PostedStep& step, int rank);
  [[noreturn]] void failPosted(runtime::PostedStep& step);
  static std::string withAccounts(
      Communicator& world,
      const std::string& error);
  void waitForPosted();
  c10::optional<at::ScalarType> fixedTransferDtype() const;
  std::vector<at::Tensor> split(
      const at::Tensor& tensor,
      int chunks,
      c10::Device device) const;
  // The batch into micro-batches, each with its share of the batch.
  void splitBatch(
      runtime::StepState& state,
      const at::Tensor& input,
      const at::Tensor& target) const;
  // The parameters whose gradients `rank` computes, each tensor once.
  std::vector<at::Tensor> rankParameters(int rank) const;
};

} // namespace tpipe
