#include "runtime/executor.h"

#include <algorithm>
#include <utility>

#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/ops/ones_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/variable.h>
#include <ATen/ops/convolution_backward.h>
#include <ATen/ops/native_layer_norm.h>
#include <ATen/ops/native_layer_norm_backward.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/version.h>

#include "layers/parts.h"
#include "layers/random.h"
#include "layers/skips.h"
#include "overloaded.h"

namespace tpipe {
namespace runtime {
namespace {

// Points this thread's part sink (layers/parts.h) at `parts` while a layer
// runs, and back at what it was.
class PartSinkScope {
 public:
  explicit PartSinkScope(std::vector<PartUse>* parts) : previous_(partSink()) {
    partSink() = parts;
  }
  ~PartSinkScope() {
    partSink() = previous_;
  }
  PartSinkScope(const PartSinkScope&) = delete;
  PartSinkScope& operator=(const PartSinkScope&) = delete;

 private:
  std::vector<PartUse>* previous_;
};

} // namespace

namespace {

thread_local bool recomputing = false;

// Tells the caching allocator that `stream` uses `tensor` (one on the
// stream's kind of device), so its memory is not handed out again before
// the stream is done with it.
void usedOnStream(const at::Tensor& tensor, c10::Stream stream) {
  if (tensor.defined() && tensor.device().type() == stream.device_type()) {
    c10::impl::VirtualGuardImpl(stream.device_type())
        .recordDataPtrOnStream(tensor.storage().data_ptr(), stream);
  }
}

class RecomputeScope {
 public:
  RecomputeScope() {
    recomputing = true;
  }
  ~RecomputeScope() {
    recomputing = false;
  }
  RecomputeScope(const RecomputeScope&) = delete;
  RecomputeScope& operator=(const RecomputeScope&) = delete;
};

// LibTorch's dropout draws from the device's one default generator. A
// stage with such a layer swaps its own state in while it runs, under this
// lock, so masks depend only on the stage's own stream and replay exactly.
// A stage whose layers draw only through stageDropout or stageGenerator()
// (layers/random.h) draws from its own generator instead, and takes no
// lock.
std::mutex& globalGeneratorMutex() {
  static std::mutex mutex;
  return mutex;
}

class StageGeneratorScope {
 public:
  // Draws from `state` while the stage runs (nothing when it draws
  // nothing or `active` is false).
  StageGeneratorScope(
      bool active,
      const StageRuntime& stage,
      const at::Tensor& state)
      : active_(active && stage.stochastic()) {
    if (!active_)
      return;
    if (stage.draws == StageRuntime::Draws::kDefaultGenerator) {
      lock_ = std::unique_lock<std::mutex>(globalGeneratorMutex());
      generator_ = at::globalContext().defaultGenerator(stage.device);
      std::lock_guard<std::mutex> guard(generator_.mutex());
      saved_ = generator_.get_state();
    } else {
      generator_ = *stage.generator;
    }
    {
      std::lock_guard<std::mutex> guard(generator_.mutex());
      generator_.set_state(state);
    }
    previous_ = std::exchange(stageGeneratorSlot(), generator_);
  }
  // The generator's state after the stage ran (the stage's next state).
  at::Tensor current() {
    std::lock_guard<std::mutex> guard(generator_.mutex());
    return generator_.get_state();
  }
  ~StageGeneratorScope() {
    if (!active_)
      return;
    stageGeneratorSlot() = std::move(previous_);
    if (saved_.defined()) {
      std::lock_guard<std::mutex> guard(generator_.mutex());
      generator_.set_state(saved_);
    }
  }
  StageGeneratorScope(const StageGeneratorScope&) = delete;
  StageGeneratorScope& operator=(const StageGeneratorScope&) = delete;

 private:
  bool active_;
  std::unique_lock<std::mutex> lock_;
  at::Generator generator_;
  at::Tensor saved_;
  c10::optional<at::Generator> previous_;
};

// Autocast for one stage's forward, on the worker's thread (autocast is
// per thread). The cast cache is cleared when the outermost scope ends: a
// cached low-precision copy of a weight must not outlive the optimizer step
// that changes the weight.
class AutocastScope {
 public:
  AutocastScope(c10::DeviceType type, c10::optional<at::ScalarType> dtype)
      : type_(type), on_(dtype.has_value()) {
    if (!on_)
      return;
#if TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    wasEnabled_ = at::autocast::is_autocast_enabled(type);
    previousDtype_ = at::autocast::get_autocast_dtype(type);
#else
    const bool cpu = type == c10::kCPU;
    wasEnabled_ =
        cpu ? at::autocast::is_cpu_enabled() : at::autocast::is_enabled();
    previousDtype_ = cpu ? at::autocast::get_autocast_cpu_dtype()
                         : at::autocast::get_autocast_gpu_dtype();
#endif
    set(true, *dtype);
    at::autocast::increment_nesting();
  }
  ~AutocastScope() {
    if (!on_)
      return;
    if (at::autocast::decrement_nesting() == 0)
      at::autocast::clear_cache();
    set(wasEnabled_, previousDtype_);
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  void set(bool enabled, at::ScalarType dtype) const {
#if TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
    at::autocast::set_autocast_dtype(type_, dtype);
    at::autocast::set_autocast_enabled(type_, enabled);
#else
    if (type_ == c10::kCPU) {
      at::autocast::set_autocast_cpu_dtype(dtype);
      at::autocast::set_cpu_enabled(enabled);
    } else {
      at::autocast::set_autocast_gpu_dtype(dtype);
      at::autocast::set_enabled(enabled);
    }
#endif
  }

  c10::DeviceType type_;
  bool on_;
  bool wasEnabled_ = false;
  at::ScalarType previousDtype_ = at::kFloat;
};

// Under autocast a stage's output may be bf16; losses and returned outputs
// are computed and kept in float.
at::Tensor fullPrecision(const at::Tensor& tensor) {
  return tensor.is_floating_point() && tensor.scalar_type() != at::kFloat &&
          tensor.scalar_type() != at::kDouble
      ? tensor.to(at::kFloat)
      : tensor;
}

// A recompute runs the stage's forward a second time, and modules that
// update buffers in their forward (batch norm's running statistics and
// num_batches_tracked) would count the micro-batch twice. The buffers are
// copied before and written back after, so the recompute leaves them as
// the first forward did, for any module, without knowing its kind.
class BufferRestoreScope {
 public:
  explicit BufferRestoreScope(const std::vector<at::Tensor>& buffers)
      : buffers_(buffers) {
    at::NoGradGuard noGrad;
    saved_.reserve(buffers_.size());
    for (const auto& buffer : buffers_)
      saved_.push_back(buffer.clone());
  }
  // Below autograd's in-place bookkeeping: the recompute's graph saved the
  // running statistics, and a version bump would fail its backward, which
  // in training mode does not read them.
  ~BufferRestoreScope() {
    at::NoGradGuard noGrad;
    at::AutoDispatchBelowADInplaceOrView belowAutograd;
    for (size_t i = 0; i < buffers_.size(); ++i)
      buffers_[i].copy_(saved_[i]);
  }
  BufferRestoreScope(const BufferRestoreScope&) = delete;
  BufferRestoreScope& operator=(const BufferRestoreScope&) = delete;

 private:
  const std::vector<at::Tensor>& buffers_;
  std::vector<at::Tensor> saved_;
};

class RankExecutor {
 public:
  explicit RankExecutor(StepState& state) : state_(state) {}

  void operator()(const Forward& op) {
    StageRuntime& stage = stageAt(op.stage);
    Stash& stash = state_.at(op.stage, op.microBatch);
    if (!state_.schedule->hasPrevious(op.stage))
      stash.inputs = {state_.inputs[op.microBatch]};
    TORCH_CHECK(
        !stash.inputs.empty() && stash.inputs.front().defined(),
        "no input received");
    stash.checkpointed = op.checkpointed;
    const bool training = state_.schedule->training;
    if (training && stage.stochastic())
      stash.rngState = stage.rngState;
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode gradMode(training && !op.checkpointed);
      StageGeneratorScope generator(training, stage, stage.rngState);
      const bool record = training && !op.checkpointed && recordsParts(stage);
      outputs = runLayers(stage, stash.inputs, record ? &stash : nullptr);
      if (record)
        keepPartsForBackward(stage, stash);
      if (training && stage.stochastic())
        stage.rngState = generator.current();
      if (isLast(op.stage) && training)
        outputs.front() = weightedLoss(outputs.front(), op);
    }
    if (isLast(op.stage)) {
      if (training) {
        state_.losses[op.microBatch] = outputs.front().detach();
        const int expected = state_.lossesHere > 0
            ? state_.lossesHere
            : state_.schedule->microBatches;
        if (++state_.lossesIn == expected && state_.lossesKnown)
          state_.lossesKnown();
      } else {
        state_.outputs[op.microBatch] =
            state_.autocast ? fullPrecision(outputs.front()) : outputs.front();
      }
    }
    stash.outputs = std::move(outputs);
    if (!training)
      stash.inputs.clear();
  }

  void operator()(const Recompute& op) {
    StageRuntime& stage = stageAt(op.stage);
    Stash& stash = state_.at(op.stage, op.microBatch);
    at::AutoGradMode gradMode(true);
    RecomputeScope recomputeScope;
    BufferRestoreScope buffers(stage.buffers);
    StageGeneratorScope generator(true, stage, stash.rngState);
    const bool record = recordsParts(stage);
    std::vector<at::Tensor> outputs =
        runLayers(stage, stash.inputs, record ? &stash : nullptr);
    if (record)
      keepPartsForBackward(stage, stash);
    if (isLast(op.stage)) {
      outputs.front() =
          weightedLoss(outputs.front(), Forward{op.stage, op.microBatch, true});
    }
    stash.outputs = std::move(outputs);
  }

  void operator()(const Backward& op) {
    const StageRuntime& stage = stageAt(op.stage);
    Stash& stash = state_.at(op.stage, op.microBatch);
    if (state_.directBackward && fusesDirectly(stash) && !stage.pairStream) {
      // Every weight gradient here is a Linear's, computed directly: the
      // input pass, whose walk computes none, then the weight pass at once.
      // On a stack of Linear 1024 at 32 rows that is 0.84-0.90x of
      // autograd's fused walk (pipeline_bench zero-bubble: "1f1b-autograd").
      inputPass(op.stage, stash, /*keepGraph=*/false);
      weightPass(stash);
      release(stash);
      return;
    }
    at::AutoGradMode gradMode(true);
    std::vector<at::Tensor> roots, grads;
    differentiable(stage, stash, roots, grads);
    if (!roots.empty())
      torch::autograd::backward(roots, grads);
    if (state_.schedule->hasPrevious(op.stage))
      stash.inputGrads = inputGradients(stage, stash);
    if (stage.pairStream) {
      // A forward run on the pair stream has its backward kernels there
      // too (autograd runs each on its forward's stream).
      for (const auto& grad : grads)
        usedOnStream(grad, *stage.pairStream);
    }
    release(stash);
  }

  // The input pass: the gradient of the stage inputs (for the previous
  // stage) and of each parameter-owning layer's output (for the weight
  // pass), in one walk that computes no weight gradient. The graph is kept
  // only for a weight pass that walks a part: one that computes every
  // part's gradients from the kept inputs lets it go now, not one or more
  // instructions later.
  void operator()(const BackwardInput& op) {
    Stash& stash = state_.at(op.stage, op.microBatch);
    inputPass(op.stage, stash, !computesWeightsDirectly(stash));
  }

  // The weight pass: each part's parameter gradients from the gradient at
  // its output. A plain Linear's are two products of the kept input and
  // that gradient, computed here as Megatron's delayed weight-gradient pass
  // does; any other part's walk only that part's own graph.
  void operator()(const BackwardWeight& op) {
    Stash& stash = state_.at(op.stage, op.microBatch);
    weightPass(stash);
    release(stash);
  }

  void operator()(const SendActivation& op) {
    Stash& stash = state_.at(op.stage, op.microBatch);
    std::vector<at::Tensor> detached;
    for (const auto& output : stash.outputs)
      detached.push_back(output.detach());
    // Built in a statement of its own: every temporary sharing the tensors
    // dies before another thread can own them.
    Payload sent = ship(detached, stageAt(op.stage), stageAt(op.stage + 1));
    detached.clear();
    transferred = bytesOf(sent.tensors);
    state_.transport->send(
        Direction::kActivation, op.stage, op.microBatch, std::move(sent));
    if (stash.checkpointed || !state_.schedule->training) {
      stash.outputs.clear(); // recompute rebuilds them
    }
  }

  void operator()(const RecvActivation& op) {
    const StageRuntime& stage = stageAt(op.stage);
    std::vector<at::Tensor> inputs = land(
        state_.transport->receive(
            Direction::kActivation, op.stage - 1, op.microBatch),
        stage);
    checkActivation(inputs, stage, op);
    transferred = bytesOf(inputs);
    for (auto& input : inputs) {
      if (state_.copyOnReceive)
        input = input.clone();
      if (state_.schedule->training && input.is_floating_point())
        input.requires_grad_(true);
    }
    state_.at(op.stage, op.microBatch).inputs = std::move(inputs);
  }

  void operator()(const SendGrad& op) {
    Stash& stash = state_.at(op.stage, op.microBatch);
    Payload sent =
        ship(stash.inputGrads, stageAt(op.stage), stageAt(op.stage - 1));
    stash.inputGrads.clear();
    stash.inputs.clear(); // their .grad() may be `sent`: drop them first
    transferred = bytesOf(sent.tensors);
    state_.transport->send(
        Direction::kGradient, op.stage - 1, op.microBatch, std::move(sent));
  }

  void operator()(const RecvGrad& op) {
    Stash& stash = state_.at(op.stage, op.microBatch);
    stash.gradOutputs = land(
        state_.transport->receive(
            Direction::kGradient, op.stage, op.microBatch),
        stageAt(op.stage));
    if (state_.copyOnReceive) {
      for (auto& grad : stash.gradOutputs)
        grad = grad.clone();
    }
    checkGradients(stash, stageAt(op.stage), op);
    transferred = bytesOf(stash.gradOutputs);
  }

  int64_t transferred = 0; // bytes moved by the last transfer instruction

  // Tells the caching allocator that `stream` uses what the forward `op`
  // kept (it ran on another stream), so no buffer of it is handed out
  // again before `stream` is done with it.
  void keepForStream(const Forward& op, c10::Stream stream) const {
    const Stash& stash = state_.at(op.stage, op.microBatch);
    for (const auto& tensor : stash.inputs)
      usedOnStream(tensor, stream);
    for (const auto& tensor : stash.outputs)
      usedOnStream(tensor, stream);
    for (const auto& part : stash.weightParts) {
      usedOnStream(part.input, stream);
      usedOnStream(part.output, stream);
    }
    if (isLast(op.stage) && state_.schedule->training)
      usedOnStream(state_.losses[op.microBatch], stream);
  }

 private:
  StageRuntime& stageAt(int stage) {
    return (*state_.stages)[stage];
  }
  // Where the micro-batches of the stage's chain end (compute the loss).
  bool isLast(int stage) const {
    return !state_.schedule->hasNext(stage);
  }
  static bool passesThrough(const StageRuntime& stage, size_t inputSlot) {
    return std::find(
               stage.passedFrom.begin(),
               stage.passedFrom.end(),
               static_cast<int>(inputSlot)) != stage.passedFrom.end();
  }

  // Moves tensors toward another stage's device. From an accelerator the
  // copies run on the sender's copy stream after the kernels that produced
  // them, and the caching allocator learns that stream uses them.
  static Payload ship(
      const std::vector<at::Tensor>& tensors,
      const StageRuntime& from,
      const StageRuntime& to) {
    Payload payload;
    if (!from.computeStream || tensors.front().device().is_cpu()) {
      for (const auto& tensor : tensors)
        payload.tensors.push_back(tensor.to(to.device));
      return payload;
    }
    const c10::DeviceType type = from.device.type();
    c10::Event produced(type);
    produced.record(*from.computeStream);
    produced.block(*from.copyStream);
    {
      c10::StreamGuard onCopy(*from.copyStream);
      for (const auto& tensor : tensors) {
        payload.tensors.push_back(
            tensor.to(to.device, /*non_blocking=*/!to.device.is_cpu()));
      }
    }
    for (const auto& tensor : tensors)
      usedOnStream(tensor, *from.copyStream);
    payload.ready = std::make_shared<c10::Event>(type);
    payload.ready->record(*from.copyStream);
    return payload;
  }

  // Makes arrived tensors safe to use on this stage's stream: it waits for
  // the sender's copies, and the caching allocator learns that it uses them
  // (a buffer received across processes was made on another stream). What
  // Gloo brought to host memory moves to the device here.
  static std::vector<at::Tensor> land(
      Payload payload,
      const StageRuntime& here) {
    if (!here.computeStream)
      return std::move(payload.tensors);
    if (payload.ready)
      payload.ready->block(*here.computeStream);
    for (auto& tensor : payload.tensors) {
      if (tensor.device() != here.device)
        tensor = tensor.to(here.device);
      usedOnStream(tensor, *here.computeStream);
    }
    return std::move(payload.tensors);
  }

  // As many tensors as the stage takes and, when the pipeline was given
  // shape inference, each of the shape of the layer that made it (the
  // batch dimension: the micro-batch's size).
  void checkActivation(
      const std::vector<at::Tensor>& inputs,
      const StageRuntime& stage,
      const RecvActivation& op) const {
    TORCH_CHECK(
        inputs.size() == stage.sourceLayers.size(),
        "received ",
        inputs.size(),
        " tensors from stage ",
        op.stage - 1,
        ", expected ",
        stage.sourceLayers.size(),
        " (the activation and ",
        stage.skipsIn.size(),
        " skips)");
    const auto* shapes = state_.layerOutputShapes;
    if (shapes == nullptr || shapes->empty())
      return;
    for (size_t i = 0; i < inputs.size(); ++i) {
      const int layer = stage.sourceLayers[i];
      if (layer < 0 || layer >= static_cast<int>(shapes->size()))
        continue;
      std::vector<int64_t> expected{
          state_.microBatchSizes.empty()
              ? inputs[i].size(0)
              : state_.microBatchSizes[op.microBatch]};
      const auto& sample = (*shapes)[layer];
      expected.insert(expected.end(), sample.begin(), sample.end());
      TORCH_CHECK(
          inputs[i].sizes().vec() == expected,
          "received ",
          i == 0 ? std::string("an activation")
                 : "the skip '" + stage.skipsIn[i - 1] + "'",
          " of shape ",
          inputs[i].sizes(),
          " from stage ",
          op.stage - 1,
          ", expected ",
          c10::IntArrayRef(expected));
    }
  }

  // The gradients must match the outputs this stage sent.
  static void checkGradients(
      const Stash& stash,
      const StageRuntime& stage,
      const RecvGrad& op) {
    TORCH_CHECK(
        stash.gradOutputs.size() == 1 + stage.skipsOut.size(),
        "received ",
        stash.gradOutputs.size(),
        " gradients from stage ",
        op.stage + 1,
        " for ",
        1 + stage.skipsOut.size(),
        " outputs");
    for (size_t o = 0; o < stash.outputs.size(); ++o) {
      const at::Tensor& output = stash.outputs[o];
      const at::Tensor& grad = stash.gradOutputs[o];
      TORCH_CHECK(
          (grad.sizes() == output.sizes() &&
           grad.scalar_type() == output.scalar_type()),
          "received a gradient of shape ",
          grad.sizes(),
          " (",
          grad.scalar_type(),
          ") from stage ",
          op.stage + 1,
          " for an output of shape ",
          output.sizes(),
          " (",
          output.scalar_type(),
          ")");
    }
  }

  // With `record`, keeps the output of every layer that owns parameters,
  // for a split backward's weight pass.
  std::vector<at::Tensor> runLayers(
      StageRuntime& stage,
      const std::vector<at::Tensor>& inputs,
      Stash* record = nullptr) {
    AutocastScope autocast(stage.device.type(), state_.autocast);
    if (record)
      record->weightParts.clear();
    SkipStore live;
    for (size_t k = 0; k < stage.skipsIn.size(); ++k)
      live.put(stage.skipsIn[k], inputs.at(k + 1));
    at::Tensor x = inputs.front();
    for (size_t l = 0; l < stage.layers.size(); ++l) {
      const at::Tensor input = record ? x : at::Tensor();
      std::vector<PartUse> parts;
      {
        c10::optional<PartSinkScope> sink;
        if (record)
          sink.emplace(&parts);
        x = runLayer(stage.layers[l], x, live);
      }
      if (record && !stage.layerParameters[l].empty() && x.requires_grad())
        recordWeightParts(stage, l, input, x, parts, *record);
    }
    std::vector<at::Tensor> outputs{x};
    for (const auto& name : stage.skipsOut)
      outputs.push_back(live.at(name));
    return outputs;
  }

  bool recordsParts(const StageRuntime& stage) const {
    return state_.splitBackward ||
        (state_.directBackward && stage.backwardFusesDirectly.value_or(true));
  }

  // Under a fused backward the parts are kept only where it runs as an
  // input pass and a direct weight pass; elsewhere autograd's walk does it
  // all, and the inputs and outputs the parts keep would only be held longer.
  void keepPartsForBackward(StageRuntime& stage, Stash& stash) const {
    if (state_.splitBackward)
      return;
    stage.backwardFusesDirectly = fusesDirectly(stash);
    if (!*stage.backwardFusesDirectly)
      stash.weightParts.clear();
  }

  // Whether the weight pass computes every recorded part's gradients
  // itself (a schedule that splits some backwards records every part).
  static bool computesWeightsDirectly(const Stash& stash) {
    return !stash.weightParts.empty() &&
        std::all_of(
            stash.weightParts.begin(),
            stash.weightParts.end(),
            [](const Stash::WeightPart& part) {
              return part.computedDirectly();
            });
  }

  // Whether a fused backward is faster as an input pass and a direct weight
  // pass: where every part is a Linear, whose weight gradient the GEMM adds
  // in place (Linear 1024 stacks: 0.85-0.95x autograd's fused walk). A
  // convolution's or a LayerNorm's gradients come out of one kernel call in
  // autograd's walk, for the input and the weights together; computed
  // apart they took 1.02-1.07x (four Conv2d 32->32 on 16 x 16, six runs)
  // and 1.01-1.03x (two transformer blocks), pipeline_bench zero-bubble's
  // "fused backward per micro-batch".
  static bool fusesDirectly(const Stash& stash) {
    return !stash.weightParts.empty() &&
        std::all_of(
            stash.weightParts.begin(),
            stash.weightParts.end(),
            [](const Stash::WeightPart& part) { return part.linear; });
  }

  // The gradients arriving at `targets` from `roots` (seeded with `grads`,
  // or ones for the loss), accumulated nowhere: what torch::autograd::grad
  // computes, given edges instead of tensors, so that a part's output need
  // not be kept for the gradient at it to be found.
  static std::vector<at::Tensor> gradientsAt(
      const std::vector<at::Tensor>& roots,
      std::vector<at::Tensor> grads,
      const torch::autograd::edge_list& targets,
      bool keepGraph) {
    torch::autograd::edge_list rootEdges;
    for (const auto& root : roots)
      rootEdges.push_back(torch::autograd::impl::gradient_edge(root));
    if (grads.empty()) {
      for (const auto& root : roots)
        grads.push_back(at::ones_like(root));
    }
    return torch::autograd::Engine::get_default_engine().execute(
        rootEdges,
        grads,
        keepGraph,
        /*create_graph=*/false,
        /*accumulate_grad=*/false,
        targets);
  }

  // The gradient of the stage inputs (for the previous stage) and at each
  // part's output (for the weight pass), in one walk that computes no
  // weight gradient; `keepGraph` for a weight pass that walks a part.
  void inputPass(int stageIndex, Stash& stash, bool keepGraph) {
    const StageRuntime& stage = stageAt(stageIndex);
    at::AutoGradMode gradMode(true);
    std::vector<at::Tensor> roots, grads;
    differentiable(stage, stash, roots, grads);
    torch::autograd::edge_list targets;
    std::vector<size_t> wantedSlots;
    const bool hasPrevious = state_.schedule->hasPrevious(stageIndex);
    for (size_t i = 0; hasPrevious && i < stash.inputs.size(); ++i) {
      if (stash.inputs[i].requires_grad() && !passesThrough(stage, i)) {
        targets.push_back(
            torch::autograd::impl::gradient_edge(stash.inputs[i]));
        wantedSlots.push_back(i);
      }
    }
    for (const auto& part : stash.weightParts)
      targets.push_back(part.outputEdge);
    std::vector<at::Tensor> found(targets.size());
    if (!roots.empty() && !targets.empty())
      found = gradientsAt(roots, grads, targets, keepGraph);
    stash.inputGrads.assign(stash.inputs.size(), at::Tensor());
    for (size_t k = 0; k < wantedSlots.size(); ++k)
      stash.inputGrads[wantedSlots[k]] = found[k];
    for (size_t k = 0; k < stash.weightParts.size(); ++k)
      stash.weightParts[k].outputGrad = found[wantedSlots.size() + k];
    if (hasPrevious)
      stash.inputGrads = inputGradients(stage, stash);
  }

  void weightPass(Stash& stash) {
    at::AutoGradMode gradMode(true);
    for (const auto& part : stash.weightParts) {
      if (!part.outputGrad.defined())
        continue; // the loss does not depend on this part
      if (part.linear) {
        linearWeightGradients(*part.linear, part.input, part.outputGrad);
        continue;
      }
      if (part.conv) {
        convWeightGradients(*part.conv, part.input, part.outputGrad);
        continue;
      }
      if (part.layerNorm) {
        layerNormWeightGradients(*part.layerNorm, part.input, part.outputGrad);
        continue;
      }
      // One walk per part: given the parameters of several, a walk would
      // reach the earlier ones through the whole graph between them.
      torch::autograd::backward(
          {part.output},
          {part.outputGrad},
          /*retain_graph=*/false,
          /*create_graph=*/false,
          part.parameters);
    }
  }

  at::Tensor weightedLoss(const at::Tensor& output, const Forward& op) {
    at::Tensor loss = (*state_.lossFn)(
        state_.autocast ? fullPrecision(output) : output,
        state_.targets[op.microBatch]);
    TORCH_CHECK(
        loss.defined() && loss.numel() == 1,
        "the loss function must return a scalar, got shape ",
        loss.sizes());
    return loss.reshape({}) * state_.weights[op.microBatch];
  }

  // The outputs a backward starts from, with their gradients: those the
  // stage computed (a skip passing through is handed back as it came). The
  // last stage's output is the loss itself: its gradient is implicit.
  static void differentiable(
      const StageRuntime& stage,
      const Stash& stash,
      std::vector<at::Tensor>& roots,
      std::vector<at::Tensor>& grads) {
    for (size_t o = 0; o < stash.outputs.size(); ++o) {
      const bool passed =
          o < stage.passedFrom.size() && stage.passedFrom[o] >= 0;
      if (passed || !stash.outputs[o].requires_grad())
        continue;
      roots.push_back(stash.outputs[o]);
      if (!stash.gradOutputs.empty())
        grads.push_back(stash.gradOutputs.at(o));
    }
  }

  // Per input slot, the gradient the previous stage awaits: a passed-through
  // skip's as received; an input no gradient reached (an integer tensor, or
  // one the stage ignored) gets zeros.
  static std::vector<at::Tensor> inputGradients(
      const StageRuntime& stage,
      const Stash& stash) {
    std::vector<at::Tensor> grads(stash.inputs.size());
    for (size_t i = 0; i < grads.size(); ++i) {
      if (i < stash.inputGrads.size() && stash.inputGrads[i].defined())
        grads[i] = stash.inputGrads[i];
      else if (stash.inputs[i].grad().defined())
        grads[i] = stash.inputs[i].grad();
      else
        grads[i] = at::zeros_like(stash.inputs[i]);
    }
    for (size_t o = 0; o < stage.passedFrom.size(); ++o) {
      if (stage.passedFrom[o] >= 0)
        grads.at(stage.passedFrom[o]) = stash.gradOutputs.at(o);
    }
    return grads;
  }

  // The layer's reported parts where they hold every one of its
  // parameters, else the layer as one part. The weight pass computes a
  // LibTorch Linear's, Conv2d's or LayerNorm's gradients itself, where the
  // part's output is its own alone (a layer merging no skip into it) and in
  // full precision (under autocast autograd's pass keeps autocast's dtypes).
  void recordWeightParts(
      const StageRuntime& stage,
      size_t l,
      const at::Tensor& input,
      const at::Tensor& output,
      const std::vector<PartUse>& parts,
      Stash& stash) const {
    const bool direct = !state_.autocast;
    std::vector<Stash::WeightPart> reported;
    std::vector<const c10::TensorImpl*> covered;
    for (const PartUse& use : parts) {
      Stash::WeightPart part;
      for (const auto& parameter : use.part->parameters()) {
        if (!parameter.requires_grad())
          continue;
        part.parameters.push_back(parameter);
        covered.push_back(parameter.unsafeGetTensorImpl());
      }
      if (!use.output.requires_grad())
        continue;
      keepEnds(part, direct ? use.part : nullptr, use.input, use.output);
      reported.push_back(std::move(part));
    }
    const auto& own = stage.layerParameters[l];
    const bool coversLayer = !parts.empty() &&
        std::all_of(own.begin(), own.end(), [&](const at::Tensor& p) {
          return std::find(
                     covered.begin(), covered.end(), p.unsafeGetTensorImpl()) !=
              covered.end();
        });
    if (coversLayer) {
      for (auto& part : reported)
        stash.weightParts.push_back(std::move(part));
      return;
    }
    const NamedLayer& layer = stage.layers[l];
    Stash::WeightPart part;
    part.parameters = own;
    keepEnds(
        part,
        direct && layer.pop.empty() ? layer.module.ptr().get() : nullptr,
        input,
        output);
    stash.weightParts.push_back(std::move(part));
  }

  // What the weight pass needs of a part: the kind whose gradients it
  // computes itself, where `module` may be computed directly (null: no
  // kind is); the edge where its output's gradient arrives; then its input
  // (computed directly) or its output (walked). The edge is taken now: a layer
  // after it that changes the output in place moves the tensor's own edge past
  // its change.
  static void keepEnds(
      Stash::WeightPart& part,
      torch::nn::Module* module,
      const at::Tensor& input,
      const at::Tensor& output) {
    if (module) {
      part.linear = module->as<torch::nn::LinearImpl>();
      part.conv = directConv(*module);
      part.layerNorm = module->as<torch::nn::LayerNormImpl>();
    }
    part.outputEdge = torch::autograd::impl::gradient_edge(output);
    if (part.computedDirectly())
      part.input = input;
    else
      part.output = output;
  }

  // Added to the parameter's gradient as autograd's accumulation adds (the
  // first gradient is taken as it is).
  static void accumulateGradient(at::Tensor& parameter, at::Tensor update) {
    if (!parameter.defined() || !parameter.requires_grad())
      return;
    at::Tensor& current = parameter.mutable_grad();
    if (current.defined())
      current.add_(update);
    else
      current = std::move(update);
  }

  // dW += g^T x and db += sum(g) over every leading dimension. After the
  // first micro-batch the product is added by the GEMM itself (beta = 1):
  // autograd's pass writes it to a new tensor and adds that, two more
  // trips through a weight-sized buffer (a fifth of the weight pass of a
  // Linear 1024 at 32 rows).
  static void linearWeightGradients(
      torch::nn::LinearImpl& linear,
      const at::Tensor& input,
      const at::Tensor& grad) {
    at::NoGradGuard noGrad;
    const at::Tensor g = grad.reshape({-1, grad.size(-1)});
    const at::Tensor x = input.reshape({-1, input.size(-1)}).detach();
    if (linear.weight.requires_grad()) {
      at::Tensor& current = linear.weight.mutable_grad();
      if (current.defined())
        current.addmm_(g.t(), x);
      else
        current = g.t().mm(x);
    }
    accumulateGradient(linear.bias, g.sum(0));
  }

  // A Conv2d whose output is the convolution of its input alone: zero
  // padding given as numbers ("same" may pad the input first, and other
  // padding modes do).
  static torch::nn::Conv2dImpl* directConv(torch::nn::Module& module) {
    auto* conv = module.as<torch::nn::Conv2dImpl>();
    if (conv == nullptr)
      return nullptr;
    // Alternative 0 of each: numbers, and zeros (c10::variant in LibTorch
    // 1.x, std::variant in 2.x: index() is what both have).
    const auto& o = conv->options;
    return o.padding().index() == 0 && o.padding_mode().index() == 0 ? conv
                                                                     : nullptr;
  }

  // The kernel autograd's ConvolutionBackward calls, asked for the weight
  // and bias alone: the same gradients, without a walk of the engine.
  static void convWeightGradients(
      torch::nn::Conv2dImpl& conv,
      const at::Tensor& input,
      const at::Tensor& grad) {
    at::NoGradGuard noGrad;
    const auto& o = conv.options;
    using std::get; // with ADL, c10::get for LibTorch 1.x's c10::variant
    const auto& padding = get<0>(o.padding());
    const bool weight = conv.weight.requires_grad();
    const bool bias = conv.bias.defined() && conv.bias.requires_grad();
    const std::vector<int64_t> biasSizes{conv.weight.size(0)};
    auto grads = at::convolution_backward(
        grad,
        input.detach(),
        conv.weight.detach(),
        bias ? at::OptionalIntArrayRef(biasSizes) : c10::nullopt,
        *o.stride(),
        *padding,
        *o.dilation(),
        /*transposed=*/false,
        /*output_padding=*/{0, 0},
        o.groups(),
        {false, weight, bias});
    if (weight)
      accumulateGradient(conv.weight, std::move(std::get<1>(grads)));
    if (bias)
      accumulateGradient(conv.bias, std::move(std::get<2>(grads)));
  }

  // LayerNorm's weight and bias from the kernel autograd's node calls, its
  // statistics computed again from the kept input (a pass over the input,
  // against keeping the whole graph alive for the weight pass): the same
  // gradients, bit for bit (checked against Python's torch 1.13 on
  // 256 x 64 x 256).
  static void layerNormWeightGradients(
      torch::nn::LayerNormImpl& norm,
      const at::Tensor& input,
      const at::Tensor& grad) {
    at::NoGradGuard noGrad;
    const bool weight = norm.weight.defined() && norm.weight.requires_grad();
    const bool bias = norm.bias.defined() && norm.bias.requires_grad();
    const at::Tensor x = input.detach();
    const std::vector<int64_t>& shape = norm.options.normalized_shape();
    const c10::optional<at::Tensor> gamma = norm.weight.defined()
        ? c10::optional<at::Tensor>(norm.weight.detach())
        : c10::nullopt;
    const c10::optional<at::Tensor> beta = norm.bias.defined()
        ? c10::optional<at::Tensor>(norm.bias.detach())
        : c10::nullopt;
    // The statistics alone: no weight or bias to apply to an output unused.
    const auto statistics = at::native_layer_norm(
        x, shape, c10::nullopt, c10::nullopt, norm.options.eps());
    auto grads = at::native_layer_norm_backward(
        grad,
        x,
        shape,
        std::get<1>(statistics),
        std::get<2>(statistics),
        gamma,
        beta,
        {false, weight, bias});
    if (weight)
      accumulateGradient(norm.weight, std::move(std::get<1>(grads)));
    if (bias)
      accumulateGradient(norm.bias, std::move(std::get<2>(grads)));
  }

  static void release(Stash& stash) {
    stash.outputs.clear();
    stash.gradOutputs.clear();
    stash.rngState = at::Tensor();
    stash.weightParts.clear();
  }

  StepState& state_;
};

} // namespace

namespace {

// Where a rank failed: stage, device, micro-batch, the instruction and its
// place in the list, and the last one it completed.
std::string failureText(
    const StepState& state,
    const std::vector<Instruction>& list,
    size_t i,
    const std::exception& error) {
  const Instruction& instruction = list[i];
  const int stage = stageOf(instruction);
  const c10::Error* torchError = dynamic_cast<const c10::Error*>(&error);
  return "stage " + std::to_string(stage) + " on " +
      (*state.stages)[stage].deviceName + ", micro-batch " +
      std::to_string(microBatchOf(instruction)) + ", " + opName(instruction) +
      " (instruction " + std::to_string(i + 1) + " of " +
      std::to_string(list.size()) + "; last completed: " +
      (i > 0 ? shortLabel(list[i - 1]) : std::string("none this step")) +
      "): " +
      (torchError ? torchError->what_without_backtrace() : error.what());
}

} // namespace

namespace {

// Per instruction of `list`, the stage whose parameter gradients are final
// once it has run, or -1.
std::vector<int> gradientsFinalAfter(const std::vector<Instruction>& list) {
  std::vector<int> finalAfter(list.size(), -1);
  std::vector<int> seen;
  for (size_t i = list.size(); i-- > 0;) {
    const Instruction& instruction = list[i];
    if (!std::holds_alternative<Backward>(instruction) &&
        !std::holds_alternative<BackwardWeight>(instruction))
      continue;
    const int stage = stageOf(instruction);
    if (std::find(seen.begin(), seen.end(), stage) != seen.end())
      continue;
    seen.push_back(stage);
    finalAfter[i] = stage;
  }
  return finalAfter;
}

} // namespace

void runRank(StepState& state, int rank) {
  const auto& list = state.schedule->perRank[rank];
  RankExecutor executor(state);
  const StageRuntime& home = (*state.stages)[rank]; // stage `rank` lives here
  c10::optional<c10::StreamGuard> onCompute;
  if (home.computeStream)
    onCompute.emplace(*home.computeStream);
  const c10::impl::VirtualGuardImpl device(home.device.type());
  auto settle = [&](const c10::optional<c10::Stream>& stream) {
    if (stream)
      device.synchronizeStream(*stream);
  };
  auto since = [&](std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double, std::micro>(t - state.start).count();
  };
  auto recordEvent = [&](size_t i,
                         std::chrono::steady_clock::time_point begin,
                         std::chrono::steady_clock::time_point end) {
    state.events[rank].push_back(
        {rank,
         static_cast<int>(i),
         since(begin),
         since(end),
         executor.transferred});
  };
  const std::vector<int> finalAfter = state.gradientsFinal
      ? gradientsFinalAfter(list)
      : std::vector<int>(list.size(), -1);
  auto ran = [&](size_t i) {
    if (finalAfter[i] >= 0)
      state.gradientsFinal(finalAfter[i]);
  };
  // An overlapped pair on an accelerator: the forward's kernels go to the
  // pair stream, the backward's to the compute stream, so the device runs
  // them side by side (on CPU they run one after the other). The backward
  // must follow at once: anything between would expect the forward done.
  auto pairedOnTwoStreams = [&](size_t i) {
    const auto* forward = std::get_if<Forward>(&list[i]);
    return home.pairStream && forward && forward->overlapsBackward &&
        i + 1 < list.size() && std::holds_alternative<Backward>(list[i + 1]);
  };
  size_t i = 0;
  try {
    for (; i < list.size(); ++i) {
      executor.transferred = 0;
      const auto begin = state.record ? std::chrono::steady_clock::now()
                                      : std::chrono::steady_clock::time_point();
      if (pairedOnTwoStreams(i)) {
        c10::Event computed(home.device.type());
        computed.record(*home.computeStream);
        computed.block(*home.pairStream);
        {
          c10::StreamGuard onPair(*home.pairStream);
          std::visit(executor, list[i]);
        }
        const size_t forward = i++;
        const auto backwardBegin = state.record
            ? std::chrono::steady_clock::now()
            : std::chrono::steady_clock::time_point();
        std::visit(executor, list[i]);
        c10::Event paired(home.device.type());
        paired.record(*home.pairStream);
        paired.block(*home.computeStream);
        executor.keepForStream(
            std::get<Forward>(list[forward]), *home.computeStream);
        if (state.record) {
          // The forward's end is known only once the backward is queued
          // too: the pair's overlap (meanCosts) is then a lower bound.
          settle(home.pairStream);
          const auto forwardEnd = std::chrono::steady_clock::now();
          settle(home.computeStream);
          recordEvent(forward, begin, forwardEnd);
          recordEvent(i, backwardBegin, std::chrono::steady_clock::now());
        }
        ran(forward);
        ran(i);
        continue;
      }
      std::visit(executor, list[i]);
      if (state.record) {
        // Kernels run asynchronously: wait for each instruction so its end
        // time is real (recording costs overlap on accelerators).
        settle(home.computeStream);
        recordEvent(i, begin, std::chrono::steady_clock::now());
      }
      ran(i);
    }
    // What the rank leaves (losses, gradients, received tensors) is read
    // after the step by threads on other streams.
    settle(home.pairStream);
    settle(home.computeStream);
    settle(home.copyStream);
  } catch (const StepAborted&) {
    // Another rank failed first and has recorded why.
  } catch (const std::exception& error) {
    std::string message = failureText(state, list, i, error);
    {
      std::lock_guard<std::mutex> lock(state.errorMutex);
      if (state.error.empty())
        state.error = std::move(message);
    }
    state.transport->abort();
  }
}

} // namespace runtime

bool isRecomputing() {
  return runtime::recomputing;
}

} // namespace tpipe
