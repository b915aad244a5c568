// Executes one rank's instruction list for one step. Knows nothing about
// which generator produced the schedule: it dispatches each instruction to
// its handler with std::visit.
#pragma once

#include <atomic>
#include <chrono>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/Stream.h>
#include <c10/util/Optional.h>
#include <torch/csrc/autograd/edge.h>
#include <torch/nn/modules/container/any.h>

#include "runtime/transport.h"
#include "tpipe/pipeline.h"
#include "tpipe/schedule.h"

namespace torch {
namespace nn {
class LinearImpl;
class Conv2dImpl;
class LayerNormImpl;
} // namespace nn
} // namespace torch

namespace tpipe {
namespace runtime {

struct StageRuntime {
  int index = 0;
  std::string deviceName; // as in the options, e.g. "cpu:1"
  c10::Device device{c10::kCPU};
  std::vector<NamedLayer> layers; // modules with their skips
  // Slot 0 of a stage's input and output is the activation; then come the
  // skips that arrive with the input (skipsIn) and leave with the output
  // (skipsOut), by name in stash order. A skip in both passes through the
  // stage untouched: passedFrom[o] is the input slot output slot o is, or
  // -1. sourceLayers[i]: the layer whose output input slot i is (shape
  // checks).
  std::vector<std::string> skipsIn, skipsOut;
  std::vector<int> passedFrom, sourceLayers;
  std::vector<at::Tensor> parameters; // those requiring grad
  // Per layer, its parameters requiring grad (the weight pass's targets).
  std::vector<std::vector<at::Tensor>> layerParameters;
  // Every buffer of the stage's layers (batch norm's running statistics, a
  // scripted module's counters): a recompute must leave them as the first
  // forward left them, whatever module keeps them.
  std::vector<at::Tensor> buffers;
  // How the stage's layers draw random numbers: not at all; only through
  // stageDropout or stageGenerator() (layers/random.h), from the stage's own
  // `generator`; or (also) from the device's default generator, whose state
  // the stage swaps in under one process-wide lock while it runs.
  enum class Draws { kNothing, kOwnGenerator, kDefaultGenerator };
  Draws draws = Draws::kNothing;
  bool stochastic() const {
    return draws != Draws::kNothing;
  }
  c10::optional<at::Generator> generator; // a local stage's own
  at::Tensor rngState; // the stage's stream: its state before the next draw
  // With direct weight gradients and fused backwards: whether the stage's
  // backward runs as an input pass and a direct weight pass (every part a
  // Linear; StepState::directBackward), as the stage's first recorded
  // forward found. Once false its forwards record nothing more. Unset
  // before that forward.
  c10::optional<bool> backwardFusesDirectly;
  // On an accelerator: the stage computes on its own stream and ships its
  // outputs on a second one, so transfers overlap compute; the forward of
  // an overlapped pair runs on a third, beside the pair's backward on the
  // compute stream. Unset on CPU.
  c10::optional<c10::Stream> computeStream, copyStream, pairStream;
};

// What one (stage, micro-batch) keeps between its instructions, per slot
// (StageRuntime: the activation, then the skips).
struct Stash {
  std::vector<at::Tensor> inputs;      // grad-requiring leaves where float
  std::vector<at::Tensor> outputs;     // or the weighted loss on the last stage
  std::vector<at::Tensor> gradOutputs; // received for `outputs`
  std::vector<at::Tensor> inputGrads;  // to send to the previous stage
  at::Tensor rngState; // generator state at the forward, for recompute
  bool checkpointed = false;
  // Split backward: per part that owns parameters (a layer, or a part a
  // layer reported: layers/parts.h), where its output's gradient arrives
  // (the edge into its autograd node) as recorded at the forward or
  // recompute, and the gradient the input pass found there, where the
  // weight pass starts. A plain Linear or Conv2d keeps its input too (which
  // its node keeps anyway): the weight pass computes its gradients itself,
  // without autograd's engine. Any other part keeps its output, and its
  // pass walks its own graph from there to its parameters.
  struct WeightPart {
    torch::autograd::Edge outputEdge;
    at::Tensor output; // walked by autograd
    at::Tensor outputGrad;
    at::Tensor input; // computed directly, from one of these:
    torch::nn::LinearImpl* linear = nullptr;
    torch::nn::Conv2dImpl* conv = nullptr;
    torch::nn::LayerNormImpl* layerNorm = nullptr;
    std::vector<at::Tensor> parameters;

    bool computedDirectly() const {
      return linear || conv || layerNorm;
    }
  };
  std::vector<WeightPart> weightParts;
};

// The state of one step, shared by all ranks' workers.
struct StepState {
  const Schedule* schedule = nullptr;
  std::vector<StageRuntime>* stages = nullptr;
  Transport* transport = nullptr;
  std::vector<at::Tensor> inputs;  // per micro-batch, on stage 0's device
  std::vector<at::Tensor> targets; // per micro-batch, on the last device
  std::vector<double> weights;     // micro-batch size / batch size
  std::vector<int64_t> microBatchSizes;
  const LossFunction* lossFn = nullptr;
  // Forwards and recomputes run under autocast to this dtype (bf16); the
  // loss and inference outputs come back in float. Unset: full precision.
  c10::optional<at::ScalarType> autocast;
  // The schedule splits backwards into input and weight passes: forwards
  // record what the weight pass needs.
  bool splitBackward = false;
  // A fused backward of a stage whose every weight gradient the weight pass
  // computes directly (Linear, Conv2d) runs as the input pass then the
  // weight pass: forwards record for it too.
  bool directBackward = false;
  std::vector<Stash> stash;        // [stage * m + micro-batch]
  std::vector<at::Tensor> losses;  // weighted, detached, per micro-batch
  std::vector<at::Tensor> outputs; // inference outputs per micro-batch

  // Called on the rank's worker right after a stage's last instruction
  // that adds to its parameter gradients (backward or weight pass), so they
  // can be reduced while the rest of the step runs. May be empty.
  std::function<void(int stage)> gradientsFinal;
  // Called on a worker of a stage where a chain ends once `lossesHere`
  // losses are in (every micro-batch ending in this process), before the
  // last gradient leaves: a step posted across processes tells the other
  // ranks the losses then. May be empty.
  std::function<void()> lossesKnown;
  int lossesHere = 0;           // 0: every micro-batch's
  std::atomic<int> lossesIn{0}; // by the workers of the stages where chains end

  bool record = false;
  // Copy received tensors, so each virtual CPU device holds (and is charged
  // for) its own copy as separate devices would; on when tracking memory.
  bool copyOnReceive = false;
  const std::vector<std::vector<int64_t>>* layerOutputShapes = nullptr;
  std::chrono::steady_clock::time_point start;
  std::vector<std::vector<TraceEvent>> events; // per rank, when recording

  std::mutex errorMutex;
  std::string error; // first failure, with its context; empty when none

  Stash& at(int stage, int microBatch) {
    return stash
        [static_cast<size_t>(stage) * schedule->microBatches + microBatch];
  }
};

// Runs schedule.perRank[rank]. Never throws: a failure is recorded in
// state.error with stage, device, micro-batch and instruction, and aborts
// the transport so every other rank stops too.
void runRank(StepState& state, int rank);

} // namespace runtime
} // namespace tpipe
