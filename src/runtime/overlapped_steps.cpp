// Steps without a barrier between them (the Zero Bubble paper's optimizer
// post-validation): each rank's worker runs its part of a posted step, then
// updates its own parameters, then starts its part of the next posted step,
// while later ranks still finish the first.
//
// Why the decisions are always in time: a rank ends its part of step k + 1
// only after every rank has begun step k + 1 (its backwards need the last
// stage's forwards, which need every earlier stage's), and each rank
// publishes its part of step k before it begins step k + 1. So a step's
// validation is known to every rank before that rank's part of the next
// step ends, which is where a wrong speculative update is settled.
//
// Across processes (one rank each) the parts are published as notes
// through the transport, not shared memory: at the end of its part each
// rank tells every other process whether it speculated, its stages'
// squared gradient norms and the values the caller wants agreed (the
// trainer's stop flags); each sums them in process order, so every rank
// decides alike. The loss lives on the last stage's rank of each replica,
// which tells it as soon as its last micro-batch's loss is computed:
// before its last gradient leaves, so every rank has it by the end of its
// part and knows, without waiting, whether the loss is finite. With
// replicas a rank first waits for its own stage's gradient average, the
// one wait data parallelism needs. A process runs its rank on the calling
// thread, so a posted step's part runs at once, there; the barrier it
// replaces was the step's end-of-step sum.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <limits>
#include <mutex>
#include <set>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/scalar_tensor.h>
#include <c10/util/Exception.h>
#include <torch/types.h>

#include "runtime/pipeline_impl.h"

namespace tpipe {
namespace runtime {

struct PostedStep {
  StepState state;
  at::Tensor input, target; // kept to run the step again
  LossFunction lossFn;
  Pipeline::Update update;
  std::shared_ptr<PostedStep> previous; // posted and unfinished before it
  std::unique_ptr<Latch> latch;         // the local ranks' parts
  // The trace's origin is when the first rank begins its part, not when
  // the step was posted behind another (a step posted ahead would show
  // the previous step's work as its idle start).
  std::once_flag started;
  std::vector<double> endedUs; // per rank, since state.start

  std::mutex mutex;
  std::condition_variable decided;
  // Tied copies: the local parts holding one that have ended; the last of
  // them sums the copies' gradients for all, before any counts or steps
  // them.
  int tiedPartsIn = 0;
  bool tiesSummed = false;
  std::condition_variable tiesReady;
  std::vector<double> squares; // per stage
  int partsIn = 0, parts = 0;
  bool failed = false; // a rank's part failed (state.error, or an earlier
                       // step's failure aborted it)
  bool lossFinite = true;
  bool known = false;
  bool anySpeculated = false;
  bool doomed = false; // ran on the parameters of a wrong speculation
  bool redone = false; // posted again after a doomed run
  // A step posted before it, still running, may speculate: this one may
  // then run on a wrong update and must be able to undo its forwards.
  bool mayBeDoomed = false;
  Pipeline::GradientNorm norm;
  bool updated = false;
  double scale = 1.0;

  // The same on every process: which post this is (notes' keys).
  int64_t sequence = 0;
  // Across processes: this replica's loss total (on its last stage's rank),
  // the mean over the replicas; Update::agree summed over the processes;
  // whether a thread of this process is receiving the other ranks' notes
  // (the others wait for it).
  double replicaLoss = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> replicaLosses; // several chains: per micro-batch
  double worldLoss = std::numeric_limits<double>::quiet_NaN();
  std::vector<double> agreed;
  bool collecting = false;
  int64_t lossNoteKey() const {
    return kNoteKeys * sequence;
  }
  int64_t partNoteKey() const {
    return kNoteKeys * sequence + 1;
  }
  int64_t tiesNoteKey(int slot) const {
    return kNoteKeys * sequence + 2 + slot;
  }
  static constexpr int64_t kNoteKeys = 2 + kTieDtypeSlots;

  // Per rank: what a speculative update changed, to undo it.
  struct Speculation {
    bool active = false;
    std::vector<at::Tensor> parameters, gradients;
    std::function<void()> restoreState;
  };
  std::vector<Speculation> speculations;
  // Per rank: its stages' buffers and generators as this step found them,
  // to undo a doomed step's forwards (batch norm's running statistics).
  struct Found {
    std::vector<at::Tensor> buffers, generators;
  };
  std::vector<Found> found;

  bool speculationWrong() const {
    return anySpeculated && !(updated && scale == 1.0);
  }
  void waitDecided() {
    std::unique_lock<std::mutex> lock(mutex);
    decided.wait(lock, [&] { return known; });
  }
  bool hasError() {
    std::lock_guard<std::mutex> lock(state.errorMutex);
    return !state.error.empty();
  }
  // An earlier step's failure aborts the transport under this one too,
  // whose parts then end without an error of their own. The step before
  // marked `failed` on this rank's worker before this part began.
  bool erroredOrAborted() {
    if (hasError())
      return true;
    if (!previous)
      return false;
    if (previous->hasError())
      return true;
    std::lock_guard<std::mutex> lock(previous->mutex);
    return previous->failed;
  }
};

} // namespace runtime

namespace {

void dropGradients(const std::vector<at::Tensor>& parameters) {
  for (const auto& parameter : parameters)
    parameter.mutable_grad() = at::Tensor();
}

} // namespace

bool Pipeline::canOverlapSteps() const {
  // Tied copies sum their gradients where the parts holding them end: in
  // one process between the workers, across processes between the holders
  // (exchangeTiedGradients). One tensor on two ranks of one process would
  // take both workers' gradients at once.
  if (!impl_->options.communicator && impl_->tiedTensorOnTwoRanks())
    return false;
  if (impl_->options.communicator)
    return impl_->transport->carriesNotes();
  return !impl_->runsOnCaller();
}

int Pipeline::stepsInFlight() const {
  return static_cast<int>(impl_->posted.size());
}

const std::vector<int>& Pipeline::localRanks() const {
  return impl_->localRanks;
}

std::vector<torch::Tensor> Pipeline::rankParameters(int rank) const {
  return impl_->rankParameters(rank);
}

std::vector<at::Tensor> Pipeline::Impl::rankParameters(int rank) const {
  std::vector<at::Tensor> all;
  std::set<const c10::TensorImpl*> seen;
  for (int s : schedule.stagesOfRank(rank)) {
    for (const auto& parameter : stages[s].parameters) {
      if (seen.insert(parameter.unsafeGetTensorImpl()).second)
        all.push_back(parameter);
    }
  }
  // The rank's tied copies: each rank steps its own, with the summed
  // gradient, so the copies stay equal.
  for (const auto& group : ties) {
    for (size_t i = 0; i < group.tensors.size(); ++i) {
      if (schedule.rankOfStage(group.stages[i]) == rank &&
          seen.insert(group.tensors[i].unsafeGetTensorImpl()).second)
        all.push_back(group.tensors[i]);
    }
  }
  return all;
}

bool Pipeline::Impl::holdsTiedCopy(int rank) const {
  for (const auto& group : ties) {
    for (int stage : group.stages) {
      if (schedule.rankOfStage(stage) == rank)
        return true;
    }
  }
  return false;
}

bool Pipeline::Impl::tiedTensorOnTwoRanks() const {
  for (const auto& group : ties) {
    for (size_t i = 0; i < group.tensors.size(); ++i) {
      for (size_t j = i + 1; j < group.tensors.size(); ++j) {
        if (group.tensors[i].unsafeGetTensorImpl() ==
                group.tensors[j].unsafeGetTensorImpl() &&
            schedule.rankOfStage(group.stages[i]) !=
                schedule.rankOfStage(group.stages[j]))
          return true;
      }
    }
  }
  return false;
}

void Pipeline::postStep(
    const torch::Tensor& input,
    const torch::Tensor& target,
    const LossFunction& lossFn,
    Update update) {
  TORCH_CHECK(
      canOverlapSteps(),
      "postStep: steps overlap in one process with a worker per device, "
      "or across processes with transfers through host "
      "memory; never with one tied tensor on two ranks of one process "
      "(use trainStep)");
  TORCH_CHECK(update.apply, "postStep: no update given");
  TORCH_CHECK(
      !update.checkGradients || update.saveState,
      "postStep: checkGradients needs saveState");
  impl_->checkBatch(input, target, lossFn, "postStep");
  auto step = std::make_shared<runtime::PostedStep>();
  step->input = input;
  step->target = target;
  step->lossFn = lossFn;
  step->update = std::move(update);
  impl_->post(std::move(step));
}

void Pipeline::Impl::post(std::shared_ptr<runtime::PostedStep> step) {
  runtime::StepState& state = step->state;
  splitBatch(state, step->input, step->target);
  state.lossFn = &step->lossFn;
  prepare(state, schedule);
  step->squares.assign(schedule.stages(), 0.0);
  step->parts = static_cast<int>(localRanks.size());
  step->speculations.resize(schedule.ranks);
  step->found.resize(schedule.ranks);
  step->endedUs.assign(schedule.ranks, 0.0);
  step->latch = std::make_unique<runtime::Latch>(step->parts);
  step->sequence = postedCount++;
  // A step posted again after a wrong speculation finds the transport
  // still carrying the others' notes: it begins only after an end.
  if (!transportOpen) {
    transport->begin(schedule.stages() - 1);
    transportOpen = true;
  }
  if (!posted.empty())
    step->previous = posted.back();
  for (const auto& earlier : posted)
    step->mayBeDoomed = step->mayBeDoomed || earlier->update.checkGradients;
  if (acrossProcesses()) {
    state.lossesHere = lossesEndingHere();
    runtime::PostedStep* raw = step.get();
    if (state.lossesHere > 0)
      state.lossesKnown = [this, raw] { tellLoss(*raw); };
  }
  armGradientAveraging(state);
  state.start = std::chrono::steady_clock::now(); // until a rank begins
  posted.push_back(step);
  auto part = [this, step](int rank) {
    runPostedPart(*step, rank);
    step->endedUs[rank] =
        std::chrono::duration<double, std::micro>(
            std::chrono::steady_clock::now() - step->state.start)
            .count();
    step->latch->countDown();
  };
  if (runsOnCaller()) {
    // A process's one rank: its part runs now, so the part before it has
    // received everything, and this step's receives may be posted ahead
    // (known shapes: no headers).
    if (remoteTransport)
      expectShapes(state, schedule);
    runOn(localRanks, part);
    return;
  }
  leaveCoresToWorkers();
  for (int rank : localRanks)
    workers[rank]->post([part, rank] { part(rank); });
}

// The micro-batches whose loss this process computes: their forwards on
// the stages where a chain ends.
int Pipeline::Impl::lossesEndingHere() const {
  int count = 0;
  for (int stage = 0; stage < schedule.stages(); ++stage) {
    if (schedule.hasNext(stage) || !isLocalStage(stage))
      continue;
    for (const auto& instruction :
         schedule.perRank[schedule.rankOfStage(stage)]) {
      const auto* forward = std::get_if<Forward>(&instruction);
      count += forward && forward->stage == stage;
    }
  }
  return count;
}

bool Pipeline::Impl::endsChainOnRank(int rank) const {
  for (int stage : schedule.stagesOfRank(rank)) {
    if (!schedule.hasNext(stage))
      return true;
  }
  return false;
}

// One chain: the replica's loss total. Several (dualpipe): each micro-batch's
// loss, 0 where it ends elsewhere, as a step with a barrier gathers them.
void Pipeline::Impl::tellLoss(runtime::PostedStep& step) {
  std::vector<double> note;
  if (schedule.chains == 1) {
    step.replicaLoss = lossTotal(step.state).item<double>();
    note = {step.replicaLoss};
  } else {
    for (const auto& loss : step.state.losses)
      note.push_back(loss.defined() ? loss.item<double>() : 0.0);
    step.replicaLosses = note;
  }
  const Communicator& world = *options.communicator;
  for (int process = 0; process < world.worldSize(); ++process) {
    if (process != world.rank())
      transport->sendNote(process, step.lossNoteKey(), note);
  }
}

// Every replica's loss, summed in process order and averaged, as the sum
// of a step with a barrier adds them. The processes where chains end told
// them before their last gradients left, and this process's gradient
// average waited for its peers of every replica: here by now.
double Pipeline::Impl::worldLoss(runtime::PostedStep& step) {
  const Communicator& world = *options.communicator;
  const int chains = schedule.chains;
  const int m = schedule.microBatches;
  std::vector<double> each(chains == 1 ? 1 : m, 0.0);
  for (int process = 0; process < world.worldSize(); ++process) {
    if (!endsChainOnRank(process % world.pipelineRanks()))
      continue;
    const std::vector<double> told = process != world.rank()
        ? transport->receiveNote(
              process, step.lossNoteKey(), static_cast<int>(each.size()))
        : chains == 1 ? std::vector<double>{step.replicaLoss}
                      : step.replicaLosses;
    for (size_t i = 0; i < each.size(); ++i)
      each[i] += told[i];
  }
  if (chains == 1)
    return each[0] / world.replicas();
  // In micro-batch order, in the losses' own dtype, as trainStep adds them.
  at::Tensor sum;
  const at::ScalarType dtype = worldLossTensor(0.0, step.state).scalar_type();
  for (double loss : each) {
    const at::Tensor value = at::scalar_tensor(
        loss / world.replicas(), at::TensorOptions().dtype(dtype));
    sum = sum.defined() ? sum + value : value;
  }
  return sum.item<double>();
}

void Pipeline::Impl::tellPart(
    runtime::PostedStep& step,
    int rank,
    bool speculated,
    const std::vector<double>& squares) {
  std::vector<double> note{speculated ? 1.0 : 0.0};
  note.insert(note.end(), step.update.agree.begin(), step.update.agree.end());
  note.insert(note.end(), squares.begin(), squares.end());
  note.resize(
      1 + step.update.agree.size() + schedule.stagesOfRank(rank).size());
  const Communicator& world = *options.communicator;
  for (int process = 0; process < world.worldSize(); ++process) {
    if (process != world.rank())
      transport->sendNote(process, step.partNoteKey(), note);
  }
}

// Under step.mutex, with every part in: the step's validation.
void Pipeline::Impl::decide(runtime::PostedStep& step) {
  double total = 0.0;
  for (size_t s = 0; s < step.squares.size(); ++s) {
    if (!std::isfinite(step.squares[s]) && step.norm.nonFiniteStage < 0)
      step.norm.nonFiniteStage = static_cast<int>(s);
    total += step.squares[s];
  }
  step.norm.norm = std::sqrt(total);
  step.updated =
      !step.failed && step.lossFinite && step.norm.nonFiniteStage < 0;
  const double clip = step.update.clipGradNorm;
  if (step.updated && clip > 0.0) {
    const double scale = clip / (step.norm.norm + 1e-6);
    if (scale < 1.0)
      step.scale = scale;
  }
  step.known = true;
  step.decided.notify_all();
  lastStepBound = !step.updated || step.scale < 1.0;
}

void Pipeline::Impl::awaitDecision(runtime::PostedStep& step) {
  if (!acrossProcesses())
    return step.waitDecided();
  {
    std::unique_lock<std::mutex> lock(step.mutex);
    if (step.known)
      return;
    if (step.collecting)
      return step.decided.wait(lock, [&] { return step.known; });
    step.collecting = true;
  }
  // Every rank told its part before it began the next step: the notes are
  // here, or on their way, by the time this rank's part of it ends.
  const Communicator& world = *options.communicator;
  const int me = world.rank(), ranks = world.pipelineRanks();
  const size_t agree = step.update.agree.size();
  std::vector<std::vector<double>> notes(world.worldSize());
  std::string failure;
  bool aborted = false;
  try {
    for (int process = 0; process < world.worldSize(); ++process) {
      if (process == me)
        continue;
      const int count = static_cast<int>(
          1 + agree + schedule.stagesOfRank(process % ranks).size());
      notes[process] =
          transport->receiveNote(process, step.partNoteKey(), count);
    }
  } catch (const runtime::StepAborted&) {
    aborted = true; // by a failure the step that met it names
  } catch (const c10::Error& error) {
    failure = error.what_without_backtrace();
  } catch (const std::exception& error) {
    failure = error.what();
  }
  std::lock_guard<std::mutex> lock(step.mutex);
  // Summed in process order, then over the replicas (which hold the same
  // averaged gradients), as the norm of a step with a barrier is.
  std::vector<double> squares(step.squares.size(), 0.0);
  step.agreed.assign(agree, 0.0);
  for (int process = 0;
       process < world.worldSize() && failure.empty() && !aborted;
       ++process) {
    const std::vector<int> stages = schedule.stagesOfRank(process % ranks);
    if (process == me) {
      for (size_t i = 0; i < agree; ++i)
        step.agreed[i] += step.update.agree[i];
      for (int s : stages)
        squares[s] += step.squares[s];
      continue;
    }
    const std::vector<double>& note = notes[process];
    step.anySpeculated = step.anySpeculated || note[0] != 0.0;
    for (size_t i = 0; i < agree; ++i)
      step.agreed[i] += note[1 + i];
    size_t i = 1 + agree;
    for (int s : stages)
      squares[s] += note[i++];
  }
  for (size_t s = 0; s < squares.size(); ++s)
    step.squares[s] = squares[s] / world.replicas();
  if (!failure.empty() || aborted) {
    step.failed = true;
    std::lock_guard<std::mutex> errorLock(step.state.errorMutex);
    if (step.state.error.empty())
      step.state.error = failure;
  }
  decide(step);
}

void Pipeline::Impl::runPostedPart(runtime::PostedStep& step, int rank) {
  const std::vector<int> rankStages = schedule.stagesOfRank(rank);
  if (step.mayBeDoomed) {
    auto& found = step.found[rank];
    for (int s : rankStages) {
      for (const auto& buffer : stages[s].buffers)
        found.buffers.push_back(buffer.clone());
      found.generators.push_back(
          stages[s].rngState.defined() ? stages[s].rngState.clone()
                                       : at::Tensor());
    }
  }
  std::call_once(step.started, [&] {
    step.state.start = std::chrono::steady_clock::now();
  });
  {
    at::AutoGradMode gradMode(true);
    runtime::runRank(step.state, rank);
  }
  // The update is charged to no device, as between synchronous steps (the
  // memory report counts optimizer state apart), and must not throw out of
  // the worker: a failure fails the step, and wakes whoever waits on it.
  try {
    memory::DeviceScope unattributed(memory::kUnattributed);
    if (holdsTiedCopy(rank)) {
      if (acrossProcesses())
        exchangeTies(step);
      else
        sumTiesOnceAllIn(step);
    }
    updateAfterPart(step, rank);
  } catch (const std::exception& error) {
    {
      std::lock_guard<std::mutex> lock(step.state.errorMutex);
      if (step.state.error.empty()) {
        step.state.error =
            "the update of " + memoryLabel(rank) + " failed: " + error.what();
      }
    }
    std::lock_guard<std::mutex> lock(step.mutex);
    step.failed = true;
    step.updated = false;
    step.known = true;
    step.decided.notify_all();
  }
}

// Every local part holding a tied copy has ended its backward: the last of
// them sums the groups' gradients into every copy (as trainStep does after
// its flush), and the others wait for it. A failure to sum still wakes them.
void Pipeline::Impl::sumTiesOnceAllIn(runtime::PostedStep& step) {
  int holders = 0;
  for (int r : localRanks)
    holders += holdsTiedCopy(r) ? 1 : 0;
  std::unique_lock<std::mutex> lock(step.mutex);
  if (++step.tiedPartsIn < holders) {
    step.tiesReady.wait(lock, [&] { return step.tiesSummed; });
    return;
  }
  struct Wake {
    runtime::PostedStep& step;
    ~Wake() {
      step.tiesSummed = true;
      step.tiesReady.notify_all();
    }
  } wake{step};
  runtime::sumTiedGradients(
      ties, [this](int stage) { return isLocalStage(stage); }, nullptr);
}

// Across processes: this process's copies' sums go to the other holders,
// and theirs come back, with the step's keys.
void Pipeline::Impl::exchangeTies(runtime::PostedStep& step) {
  const Communicator& world = *options.communicator;
  runtime::TieMessages messages;
  messages.send = [&](int process, int slot, const at::Tensor& flat) {
    transport->sendNoteTensor(process, step.tiesNoteKey(slot), flat);
  };
  messages.receive = [&](int process, int slot, const at::Tensor& like) {
    return transport->receiveNoteTensor(process, step.tiesNoteKey(slot), like);
  };
  auto processesOf = [&](int stage) {
    std::vector<int> processes;
    for (int replica = 0; replica < world.replicas(); ++replica) {
      processes.push_back(
          replica * world.pipelineRanks() + schedule.rankOfStage(stage));
    }
    return processes;
  };
  runtime::exchangeTiedGradients(
      ties, processesOf, world.rank(), world.replicas(), messages);
}

void Pipeline::Impl::updateAfterPart(runtime::PostedStep& step, int rank) {
  const std::vector<int> rankStages = schedule.stagesOfRank(rank);
  runtime::PostedStep* previous = step.previous.get();
  const std::vector<at::Tensor> parameters = rankParameters(rank);
  bool errored = step.erroredOrAborted();
  const bool world = acrossProcesses();
  // The replicas' gradient average, which every replica runs alike
  // (a step about to be dropped too).
  if (world && !errored)
    finishGradientAveraging(step.state);
  // The last stage's ranks told the loss before their last gradients left:
  // here by now, even in a step about to be dropped (nothing is left
  // unreceived).
  if (world && !errored)
    step.worldLoss = worldLoss(step);

  // The step before: right, or settled here and this step runs again.
  if (previous && !errored) {
    awaitDecision(*previous);
    bool doomed;
    {
      std::lock_guard<std::mutex> lock(previous->mutex);
      errored = previous->failed;
      doomed = previous->doomed || previous->speculationWrong();
    }
    if (!errored && doomed) {
      settle(*previous, rank);
      dropGradients(parameters);
      auto& found = step.found[rank];
      size_t b = 0, g = 0;
      for (int s : rankStages) {
        for (auto& buffer : stages[s].buffers)
          buffer.copy_(found.buffers[b++]);
        stages[s].rngState = found.generators[g++];
      }
      std::lock_guard<std::mutex> lock(step.mutex);
      step.doomed = true;
      step.known = true;
      step.decided.notify_all();
      return;
    }
    if (!errored)
      previous->speculations[rank] = {};
  }

  const Update& update = step.update;
  const bool checks = update.checkGradients;
  bool lossFinite = true;
  std::vector<double> mine;
  double mineSquares = 0.0;
  bool mineFinite = true;
  if (!errored) {
    lossFinite = std::isfinite(
        world ? step.worldLoss : Impl::lossTotal(step.state).item<double>());
    if (checks) {
      for (int s : rankStages) {
        mine.push_back(stageSquares(s));
        mineSquares += mine.back();
        mineFinite = mineFinite && std::isfinite(mine.back());
      }
    }
  }
  const double clip = update.clipGradNorm;
  // Whether this part alone settles the step: a non-finite loss or
  // gradient skips it; a norm already past the clip will be clipped.
  const bool skipsForSure = !lossFinite || !mineFinite;
  const bool clipsForSure = clip > 0.0 && std::sqrt(mineSquares) + 1e-6 > clip;
  bool speculate = false;
  {
    std::lock_guard<std::mutex> lock(step.mutex);
    size_t i = 0;
    for (int s : rankStages) {
      if (i < mine.size())
        step.squares[s] = mine[i++];
    }
    step.failed = step.failed || errored;
    step.lossFinite = step.lossFinite && lossFinite;
    // In one process the last part in decides; across processes the
    // other ranks' notes are needed too.
    if (++step.partsIn == step.parts && !step.known && !world) {
      decide(step);
    } else if (
        checks && !errored && !skipsForSure && !clipsForSure &&
        !lastStepBound) {
      speculate = true;
      step.anySpeculated = true;
    }
  }
  if (errored)
    return;
  if (world)
    tellPart(step, rank, speculate, mine);
  if (!checks) {
    if (lossFinite)
      update.apply(rank);
    dropGradients(parameters);
    return;
  }
  if (speculate) {
    // What it keeps to undo the update stays through the next step: charged
    // to the rank's device, as the plan's memory model charges it
    // (MemoryModel::keepsUndoCopy), not to the update's unattributed scope.
    auto& speculation = step.speculations[rank];
    speculation.active = true;
    {
      memory::DeviceScope charged(memorySlotOf(rank));
      for (const auto& parameter : parameters)
        speculation.parameters.push_back(parameter.detach().clone());
      speculation.restoreState = update.saveState(rank);
    }
    update.apply(rank);
    for (const auto& parameter : parameters)
      speculation.gradients.push_back(parameter.grad());
    dropGradients(parameters);
    return;
  }
  if (skipsForSure) {
    dropGradients(parameters);
    return;
  }
  awaitDecision(step);
  if (step.updated) {
    if (step.scale < 1.0) {
      for (const auto& parameter : parameters) {
        if (parameter.grad().defined())
          parameter.mutable_grad().mul_(step.scale);
      }
    }
    update.apply(rank);
  }
  dropGradients(parameters);
}

// Undoes rank's wrong speculative update of `step` and makes the one
// decided, from the gradients it kept.
void Pipeline::Impl::settle(runtime::PostedStep& step, int rank) {
  auto& speculation = step.speculations[rank];
  if (!speculation.active)
    return;
  const std::vector<at::Tensor> parameters = rankParameters(rank);
  {
    at::NoGradGuard noGrad;
    for (size_t i = 0; i < parameters.size(); ++i)
      parameters[i].copy_(speculation.parameters[i]);
  }
  if (speculation.restoreState)
    speculation.restoreState();
  if (step.updated) {
    for (size_t i = 0; i < parameters.size(); ++i) {
      at::Tensor gradient = speculation.gradients[i];
      if (gradient.defined() && step.scale < 1.0)
        gradient.mul_(step.scale);
      parameters[i].mutable_grad() = gradient;
    }
    step.update.apply(rank);
    dropGradients(parameters);
  }
  speculation = {};
}

void Pipeline::Impl::waitForPosted() {
  for (const auto& step : posted)
    step->latch->wait();
  posted.clear();
}

Pipeline::StepOutcome Pipeline::finishStep() {
  auto& posted = impl_->posted;
  TORCH_CHECK(!posted.empty(), "finishStep: no step is posted");
  std::shared_ptr<runtime::PostedStep> step = posted.front();
  step->latch->wait();
  if (!step->erroredOrAborted())
    impl_->awaitDecision(*step);
  bool failed;
  {
    std::lock_guard<std::mutex> lock(step->mutex);
    failed = step->failed;
  }
  if (failed || step->erroredOrAborted())
    impl_->failPosted(*step);
  posted.pop_front();
  step->previous.reset();
  ++impl_->steps;
  if (step->state.record) {
    double wallUs = 0.0;
    for (double us : step->endedUs)
      wallUs = std::max(wallUs, us);
    impl_->keepTrace(step->state, wallUs);
  }
  // The step after reads only this one's decision: its inputs and stash
  // go now, not when that step ends.
  step->state.stash.clear();
  step->state.inputs.clear();
  step->state.targets.clear();
  StepOutcome outcome;
  if (impl_->acrossProcesses()) {
    // As trainStep returns it on every process.
    outcome.loss = impl_->worldLossTensor(step->worldLoss, step->state);
    outcome.agreed = step->agreed;
  } else {
    outcome.loss = Impl::lossTotal(step->state);
    outcome.agreed = step->update.agree;
  }
  outcome.norm = step->norm;
  outcome.updated = step->updated;
  if (step->speculationWrong()) {
    // Every later posted step ran on the wrong parameters: the first of
    // them settled this step on each rank; run them again, in order.
    std::vector<std::shared_ptr<runtime::PostedStep>> later(
        posted.begin(), posted.end());
    if (later.empty()) {
      impl_->runOn(
          impl_->localRanks, [&](int rank) { impl_->settle(*step, rank); });
    }
    impl_->waitForPosted();
    for (const auto& again : later) {
      auto fresh = std::make_shared<runtime::PostedStep>();
      fresh->input = again->input;
      fresh->target = again->target;
      fresh->lossFn = again->lossFn;
      fresh->update = again->update;
      fresh->redone = true;
      impl_->post(std::move(fresh));
    }
  }
  outcome.redone = step->redone;
  if (posted.empty())
    impl_->transportOpen = false;
  if (posted.empty() && impl_->remoteTransport) {
    try {
      impl_->transport->end(); // every send of the posted steps has left
    } catch (const c10::Error& error) {
      TORCH_CHECK(
          false,
          impl_->options.communicator
              ? Impl::withAccounts(
                    *impl_->options.communicator,
                    error.what_without_backtrace())
              : std::string(error.what_without_backtrace()));
    }
  }
  return outcome;
}

// Ends every posted step and throws what the first failure was, with
// every process's account of it across processes; the next step begins the
// transport again.
void Pipeline::Impl::failPosted(runtime::PostedStep& step) {
  // The failure may have met a later step first (a part runs ahead),
  // aborting this one's wait.
  std::vector<std::shared_ptr<runtime::PostedStep>> all(
      posted.begin(), posted.end());
  waitForPosted();
  std::string error;
  for (runtime::PostedStep* candidate = &step; error.empty();) {
    {
      std::lock_guard<std::mutex> lock(candidate->state.errorMutex);
      error = candidate->state.error;
    }
    auto next = std::find_if(all.begin(), all.end(), [&](const auto& later) {
      return later->previous.get() == candidate;
    });
    if (next == all.end())
      break;
    candidate = next->get();
  }
  if (error.empty())
    error = "a posted step was aborted";
  if (options.communicator)
    error = withAccounts(*options.communicator, error);
  transportOpen = false; // the next step begins it again
  TORCH_CHECK(false, error);
}

} // namespace tpipe
