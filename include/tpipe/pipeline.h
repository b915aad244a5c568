// tpipe: GPipe-style pipeline-parallel training of a LibTorch layer stack.
//
// A Pipeline splits an ordered list of layers into contiguous stages, places
// the stages on devices (one worker thread per device), and runs a schedule
// of forward, backward, recompute and transfer instructions over
// micro-batches. The contract: a pipelined step computes the same loss and
// the same parameter gradients as the unpartitioned model on the whole batch,
// for every stage count, micro-batch count, schedule and checkpoint mode.
//
//   torch::nn::Sequential net(torch::nn::Linear(32, 64), torch::nn::ReLU(),
//                             torch::nn::Linear(64, 10));
//   tpipe::PipelineOptions options;
//   options.devices = {"cpu:0", "cpu:1"};
//   options.microBatches = 4;
//   tpipe::Pipeline pipe(tpipe::layersOf(net), options);
//   torch::optim::SGD sgd(pipe.parameters(), 0.1);
//   sgd.zero_grad();
//   torch::Tensor loss = pipe.trainStep(x, y, [](auto& out, auto& target) {
//     return torch::nn::functional::cross_entropy(out, target);
//   });
//   sgd.step();
//
// Threads: trainStep and forward block the calling thread until every worker
// has finished its instruction list; call them from one thread at a time.
// With one device in the process, the calling thread does that device's
// work itself (no worker), with the device's intra-op threads, which it
// keeps afterwards (at::set_num_threads on the caller).
// Ownership: the pipeline shares the modules with the caller (the same
// parameter tensors), so any LibTorch optimizer over parameters() works.
//
// Rematerialization (checkpoint modes): a checkpointed micro-batch runs its
// stage forward under no-grad and keeps only the stage input; right before
// its backward the stage runs the forward again with grad, which costs one
// more forward per stage but frees every intermediate activation between the
// two. So that random layers (dropout) draw the same numbers twice, each
// stage owns its random generator: its state is saved at the forward and
// replayed at the recompute. The config registry's dropout (the "dropout"
// layer and the transformer block's) and a layer that is LibTorch's plain
// torch::nn::Dropout (not in place) draw from the running stage's own
// generator, so stages draw side by side, and so does a module of yours
// that draws through tpipe::stageDropout or tpipe::stageGenerator()
// (tpipe/layers.h) and is declared Randomness::kStageGenerator. A dropout
// inside a module of yours draws from LibTorch's process-wide generator, so
// its stage (as any stage with a module that may draw) swaps its own state
// into it under one lock while it runs: such forwards are serialized
// against each other. Either way masks differ from the unpartitioned
// model's (it draws from one stream).
//
// Which stages may draw does not depend on layer names: NamedLayer::randomness
// says it, and kAuto (the default) treats every module that is not one of
// LibTorch's or tpipe's known deterministic layers (or a LibTorch dropout
// with p = 0) as drawing; a user's own module is therefore replayed exactly
// unless declared kNone. The cost is a generator-state copy per forward and
// recompute, and the lock, which serializes the forwards of stages that
// draw: on this project's 2-core machine (benchmarks/run pipeline,
// "randomness" table), 2 stages of 4 x (Linear 512 + Tanh), batch 256,
// 8 micro-batches, every layer declared kDraws against kNone: +3.6% per step
// with checkpoint never, +12% with checkpoint always.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tpipe/distributed.h"
#include "tpipe/layers.h"
#include "tpipe/plan.h"
#include "tpipe/schedule.h"
#include "tpipe/trace.h"

namespace tpipe {

struct PipelineOptions {
  // "cpu:K" is a virtual CPU device (its own worker); "cuda:K" a GPU.
  std::vector<std::string> devices{"cpu:0"};
  // A resolved plan (resolvePlan over measured costs, as the trainer
  // makes): its boundaries and schedule are run as they are, and stages,
  // partition, balance, microBatches, schedule, virtualStages, checkpoint
  // and threadsPerDevice below must agree with it or stay at their defaults.
  // Without one, the pipeline asks resolvePlan itself with
  // parameterCosts(layers); kTime then needs a plan, since only measured costs
  // can choose by time. That plan knows no optimizer and no posted steps:
  // its predicted memory counts no optimizer state and no undo copy. For a
  // prediction that does, pass a plan resolved with
  // PlanRequest::optimizerFactor and, for postStep with
  // Update::checkGradients, speculativeUpdates (as the trainer does).
  std::shared_ptr<const Plan> plan;
  // Total stages; 0 means one per device (times virtualStages).
  int stages = 0;
  PartitionMethod partition = PartitionMethod::kUniform;
  std::vector<int> balance; // layers per stage; implies kBalance
  int microBatches = 1;
  // A built-in schedule or a schedule file (as `tpipe schedule --json`
  // writes it), validated before use: `schedule = "1f1b"` or "mine.json".
  ScheduleSource schedule = ScheduleKind::kGpipe;
  int virtualStages = 1; // stages per device (interleaved-1f1b)
  CheckpointMode checkpoint = CheckpointMode::kExceptLast;
  // Intra-op threads of each device's worker; 0 takes the plan's
  // (Plan::threadsPerDevice), and where that is 0 too shares the cores
  // fairly. Where the stages run on workers, trainStep, postStep and
  // forward leave the calling thread one intra-op thread
  // (at::set_num_threads(1)): it only splits batches and waits, and an
  // OpenMP team it had run before spun on the stages' cores (two one-thread
  // stages stepped 1.3-1.5x slower). Set your own count again if that
  // thread computes between steps. A process whose one stage runs on the
  // calling thread gives it the stage's count.
  int threadsPerDevice = 0;
  uint64_t seed = 0; // seeds each stage's random generator
  // Record every executed instruction's start and end (see trace()); off,
  // it costs one branch per instruction. The last `keepSteps` are kept.
  bool record = false;
  int keepSteps = 8;
  // Per-device memory accounting (CPU: a counting allocator charges each
  // allocation to the worker's device). deviceMemory caps, per device, what
  // its worker may hold from allocations made during steps (activations,
  // gradients, workspace); exceeding it fails the step with an out-of-memory
  // error naming stage and device. Non-empty deviceMemory implies tracking.
  bool trackMemory = false;
  std::vector<int64_t> deviceMemory;
  // Across processes: this process runs only pipeline rank
  // communicator->stageRank() of replica communicator->replica(); the others
  // are reached over c10d. trainStep then returns the mean loss over all
  // replicas, with gradients averaged across replicas before it returns;
  // forward returns the output on the last stage's process only.
  std::shared_ptr<Communicator> communicator;
  // With replicas: each stage's gradients start their all-reduce as soon as
  // its last backward (or weight pass) ends, while other stages on the rank
  // and the rest of the step go on; false reduces them all after the step.
  bool overlapGradientSync = true;
  // Across processes, with this process's stage on a GPU: tensors go to
  // other processes over NCCL, never through host memory (in builds with
  // TPIPE_USE_NCCL, and when no two pipeline ranks name the same GPU, which
  // NCCL cannot pair). False, or otherwise: staged through host memory over
  // Gloo. runtime::transferDevice decides.
  bool nccl = true;
  // Across processes, with fixed transfer shapes: how many receives each
  // process keeps posted ahead of its worker, each holding its buffer. 0
  // posts all of a step's at its start: fastest (data lands during compute;
  // +8-10% samples/s against 4 on the Fashion-MNIST CNN, 4 ranks, 8
  // micro-batches), but a stage then holds a buffer for every micro-batch
  // it receives, which undoes 1F1B's bound on held activations. The
  // trainer keeps 2 x ranks posted when a device declares its memory.
  int receivesAhead = 0;
  // Mixed precision: forwards and recomputes of every stage run under
  // autocast to this dtype (at::kBFloat16), parameters and gradients stay
  // in their own dtype, and the loss is computed in float. Unset: off.
  c10::optional<at::ScalarType> autocast;
  // The weight gradients of LibTorch's Linear and Conv2d (numeric zero
  // padding), computed by tpipe from each layer's input and the gradient at
  // its output, as the zero-bubble schedules' weight pass does: a stage
  // whose every parameter is theirs runs a fused backward as the walk to
  // the inputs and those outputs, then those products (0.84-0.90x of
  // autograd's walk on a stack of Linear 1024 at 32 rows). A Linear's is
  // added into its gradient in place, so such a stage allocates no
  // weight-sized gradient (the memory model knows: LayerCost::
  // weightGradientInPlace). Gradient hooks on those parameters are not
  // called; false keeps autograd's walk for fused backwards.
  bool directWeightGradients = true;
  // Tied parameters, as groups of names ("0.weight", "9.weight"): one weight
  // the model uses in several layers, e.g. a GPT's token embedding and LM
  // head. Each layer keeps its own tensor (the pipeline copies the first's
  // values into the others); their gradients are summed before trainStep
  // returns, across processes too, so the copies stay equal bit for bit
  // under any element-wise optimizer. One tensor shared by layers on
  // different stages is a tie found without declaring it (on one host's
  // CPU; accelerators need a copy per stage, so declare those).
  // parameters() lists each tensor once.
  std::vector<std::vector<std::string>> tiedParameters;
  // Per-sample output shape of every layer (from shape inference): each
  // received activation is checked against its sending stage's last layer.
  std::vector<std::vector<int64_t>> layerOutputShapes;
};

struct DeviceMemory {
  std::string device;
  int64_t liveBytes = 0; // allocated by its worker and still alive
  int64_t peakBytes = 0; // since the last resetPeakMemory()
  int64_t capacityBytes = 0;
};

// Must return the mean loss over the micro-batch (a scalar); the pipeline
// weights each micro-batch by its share of the batch.
using LossFunction = std::function<
    torch::Tensor(const torch::Tensor& output, const torch::Tensor& target)>;

// True on a worker thread while it re-runs a checkpointed forward. Layers
// that keep running statistics (batch norm) skip their update then, so a
// recomputed micro-batch is not counted twice.
bool isRecomputing();

// Keeps the host memory a step frees for the next step, instead of glibc
// handing it back to the system and faulting it in again (a page fault per
// 4 KiB of every activation and workspace, every step):
// - blocks up to 32 MiB come from the heap, which is never trimmed;
// - freed blocks of 1 MiB and more are kept by LibTorch's CPU allocator
//   (a cache beneath tpipe's memory accounting) for the next allocation of
//   their size: glibc maps blocks above 32 MiB whatever its settings, and
//   worker threads' arenas give back their emptied heaps. The cache holds
//   at most twice the most such memory ever live at once, and gives it all
//   back when the system refuses a block. TPIPE_HOST_CACHE=0 turns it off.
// On this project's 2-core machine a Fashion-MNIST CNN step ran 11.7 ms
// median without the heap settings and 10.8 with them; two stages of
// convolutions with 51 MiB activations stepped 12x faster with the cache
// than with the heap settings alone (`benchmarks/run host-memory`). The
// process keeps its peak. A Pipeline calls it when it is built; call it
// yourself to give a loop of your own the same. Returns whether it took
// effect: false off glibc, and when MALLOC_MMAP_THRESHOLD_,
// MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ or a glibc.malloc tunable in
// GLIBC_TUNABLES is set (yours are kept, and the cache is off; set one to
// opt out).
bool keepFreedHostMemory();

class Pipeline {
 public:
  // Throws c10::Error naming the offending option: unknown device, more
  // stages than layers or devices, a balance not summing to the layer count,
  // an invalid schedule.
  Pipeline(LayerList layers, PipelineOptions options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  // One pipelined forward and backward over the batch, split along dim 0
  // into microBatches chunks (sizes differ by at most one). Gradients are
  // accumulated into every parameter's .grad() exactly as
  // lossFn(model(input), target).backward() would; returns the batch's mean
  // loss (detached). On an error in any stage the step ends on every worker,
  // the error names stage, device, micro-batch and instruction, and the
  // pipeline is ready for the next step (gradients of the failed step are
  // partial: zero them).
  torch::Tensor trainStep(
      const torch::Tensor& input,
      const torch::Tensor& target,
      const LossFunction& lossFn);

  // Micro-batched inference under no-grad; outputs concatenated in order.
  torch::Tensor forward(const torch::Tensor& input);

  // After trainStep: the L2 norm of every parameter's gradient over every
  // stage (and, across processes, every pipeline rank), as
  // torch::nn::utils::clip_grad_norm_ computes it on the sequential model;
  // when maxNorm > 0 and the norm exceeds it, every gradient is scaled by
  // maxNorm / (norm + 1e-6), as that function does. A non-finite norm scales
  // nothing: nonFiniteStage names the first stage whose gradients are not
  // finite, the same on every process. Across processes every process must
  // call it after each step (one collective).
  struct GradientNorm {
    double norm = 0.0;
    int nonFiniteStage = -1; // -1: all finite
  };
  GradientNorm clipGradNorm(double maxNorm = 0.0);

  // Runs `task` where this process's first device works (its worker, or
  // the calling thread when it is the only device), waits, and rethrows
  // what it threw. Work between steps (the optimizer update) belongs there:
  // elsewhere it starts a second intra-op (OpenMP) pool, and on few cores
  // two pools spinning in turn slow each other's kernels. Its allocations
  // are charged to no device.
  void runOnWorker(const std::function<void()>& task);

  // Steps without a barrier between them: the Zero Bubble paper's
  // optimizer post-validation. Each rank updates its own parameters on its
  // worker as soon as its part of a step is done, and its part of the next
  // posted step follows at once, while later ranks still finish this one.
  // The results equal trainStep + clipGradNorm + a skipped or applied
  // update of one optimizer, bit for bit: README, "Steps without a barrier".
  //
  // The global decisions (a non-finite loss or gradient skips the update;
  // the clip factor of the global norm) need every rank's part. With
  // checkGradients, a rank whose own part cannot decide updates
  // speculatively (unclipped), keeping a copy of what it changed; when all
  // parts are in and the step should have been clipped or skipped, each
  // such rank restores its copy and redoes the update as decided, and the
  // step posted after it, computed on the wrong parameters, is run again.
  // A rank whose own gradients already exceed the clip waits for the
  // decision instead.
  //
  // Across processes (transfers through host memory) each
  // process runs its rank's part on the calling thread when the step is
  // posted, and the ranks agree through small notes instead of a
  // collective; a rank other than the last learns the loss from the last
  // stage's rank, which tells it before its last gradient leaves.
  struct Update {
    // Steps rank `rank`'s optimizer over rankParameters(rank), whose
    // gradients are final (and clipped). Runs on the rank's worker.
    std::function<void(int rank)> apply;
    // Copies rank `rank`'s optimizer state deeply and returns what puts
    // the copy back (the pipeline copies the parameters itself); needed
    // with checkGradients.
    std::function<std::function<void()>(int rank)> saveState;
    // Compute the global gradient norm and finiteness (for a clip, or for
    // skipping non-finite updates); without it only the loss is checked.
    bool checkGradients = false;
    double clipGradNorm = 0.0; // > 0: scale as clipGradNorm(maxNorm)
    // Values summed over every process with the step's decision (as
    // Communicator::rideNextSum's with trainStep): the same count on every
    // process. StepOutcome::agreed gets the sums.
    std::vector<double> agree;
  };
  struct StepOutcome {
    torch::Tensor loss;  // the batch's mean loss, as trainStep returns
    GradientNorm norm;   // zero without checkGradients
    bool updated = true; // false: skipped (a non-finite loss or gradient)
    bool redone = false; // ran again after a wrong speculative update
    std::vector<double> agreed; // Update::agree summed over the processes
  };
  // In one process with a worker per device, or across processes with
  // transfers through host memory (data-parallel replicas average each
  // stage's gradients before its update). Tied copies only in one process:
  // the last part holding one sums their gradients for all, and each rank
  // steps its own copy (rankParameters lists it); across processes that
  // sum is a collective, and one tensor on two ranks would be stepped by
  // both. False otherwise (then use trainStep).
  bool canOverlapSteps() const;
  // Queues a step behind those posted before; returns at once.
  void postStep(
      const torch::Tensor& input,
      const torch::Tensor& target,
      const LossFunction& lossFn,
      Update update);
  // Waits for the oldest posted step and its update. Throws what the step
  // failed with, after every posted step has ended (those after it are
  // dropped, unapplied or not: a failed step leaves the parameters to be
  // restored from a checkpoint).
  StepOutcome finishStep();
  int stepsInFlight() const;
  // The parameters whose gradients rank `rank` computes, its tied copies
  // included (each tensor once).
  std::vector<torch::Tensor> rankParameters(int rank) const;
  // The pipeline ranks this process runs.
  const std::vector<int>& localRanks() const;

  // Every tensor an optimizer steps. Under a bidirectional schedule
  // (dualpipe) the second chain's copies of the layers follow the
  // originals: their gradients are summed with the originals' after each
  // step, so an optimizer over them keeps them equal, bit for bit.
  std::vector<torch::Tensor> parameters() const;
  // Named as nn.Sequential.state_dict() names them: "1.weight". The
  // originals only.
  std::vector<std::pair<std::string, torch::Tensor>> namedParameters() const;
  // After the originals' parameters or buffers were written outside a step
  // (a checkpoint loaded into layers()), makes the second chain's copies
  // equal to them again. A no-op with one chain. In one process only.
  void refreshChainCopies();

  const LayerList& layers() const;
  // The layers stage `stage` runs: layers() of its range on the first
  // chain, their copies on a bidirectional schedule's second.
  const std::vector<NamedLayer>& stageLayers(int stage) const;
  const std::vector<int>& boundaries() const; // stages + 1 layer indices
  const Plan& plan() const; // what runs: boundaries, schedule, predictions
  const Schedule& schedule() const;
  const PipelineOptions& options() const;
  // The device each stage runs on, as named in the options.
  std::vector<std::string> stageDevices() const;
  // How pipeline rank `stageRank`'s stages reach other processes: "over
  // Unix sockets to rank(s) 1 (this host)", "over Gloo through host
  // memory to rank(s) 2" (another host), or "over NCCL from cuda:K".
  std::string crossProcessTransfers(int stageRank) const;

  // The recorded training steps (PipelineOptions::record); inference steps
  // are not recorded. setRecording switches recording for later steps.
  const Trace& trace() const;
  // Per device, when PipelineOptions::trackMemory.
  std::vector<DeviceMemory> memory() const;
  void resetPeakMemory();
  // Changes device `rank`'s cap on step allocations (0: none); needs
  // tracking on.
  void setMemoryCapacity(int rank, int64_t bytes);
  void setRecording(bool on);
  void clearTrace();

  // Each stage's random generator state (dropout), for checkpoints: restoring
  // them makes a resumed run draw the same masks as an uninterrupted one.
  std::vector<torch::Tensor> generatorStates() const;
  void setGeneratorStates(const std::vector<torch::Tensor>& states);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

} // namespace tpipe
