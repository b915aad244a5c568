// Building a Pipeline: checking layers and devices, resolving (or taking)
// the plan, placing stages on devices and starting their workers; and the
// accessors. Steps are driven in pipeline_step.cpp.
#include "tpipe/pipeline.h"

#include <algorithm>
#include <set>
#include <thread>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/nn/modules/dropout.h>
#include <torch/types.h>

#include "layers/random.h"
#include "layers/skips.h"
#include "runtime/c10d_transport.h"
#include "runtime/pipeline_impl.h"
#include "tpipe/partition.h"

namespace tpipe {

namespace {

c10::Device parseDevice(const std::string& name) {
  const auto colon = name.find(':');
  const std::string type = name.substr(0, colon);
  int index = 0;
  if (colon != std::string::npos) {
    const std::string digits = name.substr(colon + 1);
    TORCH_CHECK(
        !digits.empty() && digits.size() < 6 &&
            std::all_of(
                digits.begin(),
                digits.end(),
                [](char c) { return c >= '0' && c <= '9'; }),
        "unknown device '",
        name,
        "' (expected cpu:N for a virtual CPU device or cuda:N)");
    index = std::stoi(digits);
  }
  if (type == "cpu")
    return c10::Device(c10::kCPU);
  if (type == "cuda") {
    TORCH_CHECK(
        torch::cuda::is_available(),
        "device '",
        name,
        "': this LibTorch has no usable CUDA device");
    TORCH_CHECK(
        index < static_cast<int>(torch::cuda::device_count()),
        "device '",
        name,
        "': only ",
        torch::cuda::device_count(),
        " CUDA device(s) present");
    return c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  TORCH_CHECK(
      false,
      "unknown device '",
      name,
      "' (expected cpu:N for a virtual CPU device or cuda:N)");
}

// "torch::nn::LinearImpl" -> "Linear"; "(anonymous namespace)::NoiseImpl" ->
// "Noise".
std::string moduleKind(const std::string& name) {
  std::string kind = name.substr(
      name.rfind(':') == std::string::npos ? 0 : name.rfind(':') + 1);
  if (kind.size() > 4 && kind.compare(kind.size() - 4, 4, "Impl") == 0)
    kind.resize(kind.size() - 4);
  return kind;
}

// LibTorch's and tpipe's modules known to draw no random numbers.
bool knownDeterministic(const std::string& kind) {
  static const std::set<std::string> kinds = {
      "Linear",
      "Bilinear",
      "Conv1d",
      "Conv2d",
      "Conv3d",
      "ConvTranspose1d",
      "ConvTranspose2d",
      "ConvTranspose3d",
      "ReLU",
      "ReLU6",
      "LeakyReLU",
      "PReLU",
      "ELU",
      "SELU",
      "CELU",
      "GELU",
      "SiLU",
      "Mish",
      "Tanh",
      "Sigmoid",
      "Softplus",
      "Softmax",
      "LogSoftmax",
      "Hardtanh",
      "Identity",
      "LayerNorm",
      "GroupNorm",
      "BatchNorm1d",
      "BatchNorm2d",
      "BatchNorm3d",
      "InstanceNorm1d",
      "InstanceNorm2d",
      "Embedding",
      "Flatten",
      "Unflatten",
      "MaxPool1d",
      "MaxPool2d",
      "MaxPool3d",
      "AvgPool1d",
      "AvgPool2d",
      "AvgPool3d",
      "AdaptiveAvgPool1d",
      "AdaptiveAvgPool2d",
      "AdaptiveMaxPool2d",
      "Sequential",
      "ModuleList",
      "ModuleDict",
      "TransformerBlock",
      "DeferredBatchNorm2d",
      "PositionEmbedding"};
  return kinds.count(kind) > 0;
}

// LibTorch's dropouts that drop nothing draw nothing: at::dropout and its
// kin return their input when p = 0.
bool dropsNothing(const torch::nn::Module& module) {
  if (const auto* d = module.as<torch::nn::DropoutImpl>())
    return d->options.p() == 0;
  if (const auto* d = module.as<torch::nn::Dropout2dImpl>())
    return d->options.p() == 0;
  if (const auto* d = module.as<torch::nn::Dropout3dImpl>())
    return d->options.p() == 0;
  if (const auto* d = module.as<torch::nn::AlphaDropoutImpl>())
    return d->options.p() == 0;
  if (const auto* d = module.as<torch::nn::FeatureAlphaDropoutImpl>())
    return d->options.p() == 0;
  return false;
}

using Draws = runtime::StageRuntime::Draws;

Draws drawsOf(const NamedLayer& layer) {
  switch (layer.randomness) {
    case Randomness::kNone:
      return Draws::kNothing;
    case Randomness::kDraws:
      return Draws::kDefaultGenerator;
    case Randomness::kStageGenerator:
      return Draws::kOwnGenerator;
    case Randomness::kAuto:
      break;
  }
  if (runsAsStageDropout(*layer.module.ptr()))
    return Draws::kOwnGenerator;
  Draws draws = Draws::kNothing;
  for (const auto& module : layer.module.ptr()->modules()) {
    const std::string kind = moduleKind(module->name());
    if (kind == "StageDropout") // the registry's (layers/random.h)
      draws = Draws::kOwnGenerator;
    else if (!knownDeterministic(kind) && !dropsNothing(*module))
      return Draws::kDefaultGenerator; // dropout, or unknown
  }
  return draws;
}

template <class Body>
auto checked(Body body) -> decltype(body()) {
  try {
    return body();
  } catch (const std::invalid_argument& error) {
    TORCH_CHECK(false, error.what());
  }
}

} // namespace

// Layer names unique, modules present, devices known and distinct.
std::vector<c10::Device> Pipeline::Impl::checkLayersAndDevices() const {
  TORCH_CHECK(!layers.empty(), "the layer list is empty");
  std::set<std::string> names;
  for (size_t i = 0; i < layers.size(); ++i) {
    TORCH_CHECK(
        !layers[i].module.is_empty(),
        "layer ",
        i,
        " ('",
        layers[i].name,
        "') holds no module");
    TORCH_CHECK(
        names.insert(layers[i].name).second,
        "two layers are named '",
        layers[i].name,
        "'");
  }
  checkSkips(layers);
  TORCH_CHECK(
      options.threadsPerDevice >= 0,
      "threads per device must be >= 0, got ",
      options.threadsPerDevice);
  TORCH_CHECK(!options.devices.empty(), "no devices given");
  std::set<std::string> seen;
  std::vector<c10::Device> devices;
  for (const auto& name : options.devices) {
    devices.push_back(parseDevice(name));
    // Virtual CPU devices are distinct by name; one GPU may host several
    // ranks, each with its own worker and streams.
    TORCH_CHECK(
        seen.insert(name).second || !devices.back().is_cpu(),
        "device '",
        name,
        "' is listed twice; each virtual CPU device runs one worker");
  }
  return devices;
}

void Pipeline::Impl::resolve() {
  const std::vector<c10::Device> devices = checkLayersAndDevices();
  const std::shared_ptr<const Plan> given = options.plan;
  plan = given
      ? *given
      : checked([&] { return resolvePlan(planRequest(devices.size())); });
  TORCH_CHECK(
      plan.boundaries.size() >= 2 && plan.boundaries.front() == 0 &&
          plan.boundaries.back() == static_cast<int>(layers.size()),
      "the plan's boundaries do not cover the ",
      layers.size(),
      " layers");
  const int ranks = plan.schedule.ranks;
  TORCH_CHECK(
      plan.schedule.chainLength() == plan.stageCount(),
      "the plan's schedule has ",
      plan.schedule.chainLength(),
      " stages, its boundaries ",
      plan.stageCount());
  TORCH_CHECK(
      ranks <= static_cast<int>(devices.size()),
      "the plan needs ",
      ranks,
      " devices, got ",
      devices.size());
  if (given)
    checkAgreesWithPlan();
  rankDevices.assign(devices.begin(), devices.begin() + ranks);
  if (options.communicator) {
    TORCH_CHECK(
        options.communicator->pipelineRanks() == ranks,
        "the communicator spans ",
        options.communicator->pipelineRanks(),
        " pipeline ranks but the pipeline has ",
        ranks);
  }
  boundaries = plan.boundaries;
  schedule = plan.schedule;
  const int cores =
      static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  placement = runtime::placeStages(
      plan,
      options.devices,
      options.threadsPerDevice > 0 ? options.threadsPerDevice
                                   : plan.threadsPerDevice,
      cores,
      options.communicator ? options.communicator->stageRank() : -1);
  localRanks = placement.localRanks();
}

PlanRequest Pipeline::Impl::planRequest(size_t deviceCount) const {
  TORCH_CHECK(
      options.partition != PartitionMethod::kTime,
      "partition kTime needs measured costs: pass PipelineOptions::plan from resolvePlan over "
      "profileLayers' costs (as the trainer does)");
  PlanRequest request;
  request.layers = parameterCosts(layers);
  if (options.autocast) { // keeps autograd's backward
    for (auto& layer : request.layers)
      layer.weightGradientInPlace = false;
  }
  request.directWeightGradients = options.directWeightGradients;
  for (size_t d = 0; d < deviceCount; ++d)
    request.devices.push_back({options.devices[d]});
  request.stages = options.stages;
  // A balance alone implies kBalance; with another method it is an error.
  request.partition =
      !options.balance.empty() && options.partition == PartitionMethod::kUniform
      ? PartitionMethod::kBalance
      : options.partition;
  request.balance = options.balance;
  request.schedule = options.schedule;
  request.microBatches = options.microBatches;
  request.virtualStages = options.virtualStages;
  request.checkpoint = options.checkpoint;
  request.threadsPerDevice = options.threadsPerDevice;
  return request;
}

// Options that contradict a given plan are errors, not silently ignored.
void Pipeline::Impl::checkAgreesWithPlan() const {
  const PipelineOptions defaults;
  auto agrees = [&](bool same, bool isDefault, const char* what) {
    TORCH_CHECK(
        same || isDefault,
        "PipelineOptions::",
        what,
        " disagrees with PipelineOptions::plan");
  };
  agrees(options.stages == plan.stageCount(), options.stages == 0, "stages");
  agrees(
      options.balance == balanceOf(plan.boundaries),
      options.balance.empty(),
      "balance");
  agrees(
      options.microBatches == plan.schedule.microBatches,
      options.microBatches == defaults.microBatches,
      "microBatches");
  agrees(
      options.virtualStages == plan.schedule.virtualStages,
      options.virtualStages == 1,
      "virtualStages");
  agrees(
      options.checkpoint == plan.checkpoint,
      options.checkpoint == defaults.checkpoint,
      "checkpoint");
  agrees(
      options.threadsPerDevice == plan.threadsPerDevice,
      options.threadsPerDevice == 0 || plan.threadsPerDevice == 0,
      "threadsPerDevice");
}

// NCCL pairs a boundary's sends with its receives by order alone.
void Pipeline::Impl::checkTransfersInOrder(const Schedule& plan) const {
  const std::string mismatch = transferOrderMismatch(plan);
  TORCH_CHECK(
      mismatch.empty(),
      "the NCCL transport cannot run this schedule: ",
      mismatch);
}

// Which skips a stage takes and hands on, and the layers that made them.
void Pipeline::Impl::routeSkips(runtime::StageRuntime& stage) const {
  const std::vector<LayerSkips> skips = skipsOf(layers);
  const int modelStage = schedule.modelStage(stage.index);
  const int first = boundaries[modelStage];
  stage.skipsIn = skipsAcross(skips, static_cast<size_t>(first));
  stage.skipsOut =
      skipsAcross(skips, static_cast<size_t>(boundaries[modelStage + 1]));
  stage.sourceLayers = {first - 1};
  for (const auto& name : stage.skipsIn) {
    for (size_t l = 0; l < skips.size(); ++l) {
      const auto& stash = skips[l].stash;
      if (std::find(stash.begin(), stash.end(), name) != stash.end())
        stage.sourceLayers.push_back(static_cast<int>(l));
    }
  }
  stage.passedFrom = {-1};
  for (const auto& name : stage.skipsOut) {
    auto in = std::find(stage.skipsIn.begin(), stage.skipsIn.end(), name);
    stage.passedFrom.push_back(
        in == stage.skipsIn.end()
            ? -1
            : static_cast<int>(in - stage.skipsIn.begin()) + 1);
  }
}

// Stage s: its device, layers (moved there when local), parameters, streams
// and its own random generator.
void Pipeline::Impl::placeStage(int s) {
  runtime::StageRuntime& stage = stages[s];
  stage.index = s;
  stage.deviceName = placement.stages[s].device;
  const bool local = isLocalStage(s);
  // A stage in another process is sent tensors on remoteDevice (place()).
  stage.device = local ? rankDevices[schedule.rankOfStage(s)] : remoteDevice;
  const LayerList& source = layersOfStage(s);
  const int modelStage = schedule.modelStage(s);
  for (int l = boundaries[modelStage]; l < boundaries[modelStage + 1]; ++l) {
    const torch::nn::AnyModule& layer = source[l].module;
    if (local)
      layer.ptr()->to(stage.device);
    stage.layers.push_back(source[l]);
    stage.draws = std::max(stage.draws, drawsOf(source[l]));
    for (const auto& buffer : layer.ptr()->buffers())
      stage.buffers.push_back(buffer);
    stage.layerParameters.emplace_back();
    for (const auto& parameter : layer.ptr()->parameters()) {
      if (!parameter.requires_grad())
        continue;
      // Tied copies are summed (and averaged over replicas) as a group.
      if (!runtime::isTied(ties, parameter))
        stage.parameters.push_back(parameter);
      stage.layerParameters.back().push_back(parameter);
    }
  }
  routeSkips(stage);
  if (local && !stage.device.is_cpu()) {
    // One set of streams per rank: its virtual stages share them.
    const int first = schedule.stagesOfRank(schedule.rankOfStage(s)).front();
    if (first == s) {
      c10::impl::VirtualGuardImpl impl(stage.device.type());
      stage.computeStream = impl.getStreamFromGlobalPool(stage.device);
      stage.copyStream = impl.getStreamFromGlobalPool(stage.device);
      stage.pairStream = impl.getStreamFromGlobalPool(stage.device);
    } else {
      stage.computeStream = stages[first].computeStream;
      stage.copyStream = stages[first].copyStream;
      stage.pairStream = stages[first].pairStream;
    }
  }
  // The stage's own stream of random numbers, in its device's format.
  at::Generator generator = local
      ? at::globalContext().defaultGenerator(stage.device).clone()
      : at::make_generator<at::CPUGeneratorImpl>();
  generator.set_current_seed(
      options.seed * 1000003ULL + static_cast<uint64_t>(s));
  stage.rngState = generator.get_state();
  if (local)
    stage.generator = generator;
}

// One worker per local rank, with its intra-op threads and memory slot.
void Pipeline::Impl::startWorkers() {
  const int ranks = schedule.ranks;
  const bool tracking = options.trackMemory || !options.deviceMemory.empty();
  TORCH_CHECK(
      options.deviceMemory.empty() ||
          options.deviceMemory.size() >= static_cast<size_t>(ranks),
      "deviceMemory has ",
      options.deviceMemory.size(),
      " entries for ",
      ranks,
      " devices");
  if (tracking)
    memory::install();
  workers.resize(ranks);
  for (int rank : localRanks) {
    const int slot = tracking ? memory::acquireSlot() : memory::kUnattributed;
    if (tracking) {
      memorySlots.push_back(slot);
      const int64_t capacity =
          options.deviceMemory.empty() ? 0 : options.deviceMemory[rank];
      TORCH_CHECK(capacity >= 0, "deviceMemory[", rank, "] is negative");
      memory::setCapacity(slot, capacity, memoryLabel(rank));
    }
    if (runsOnCaller())
      continue; // its work runs on the calling thread: runOn
    // OpenMP's thread count is per thread, and a new thread inherits the
    // last value set anywhere: set it once in each worker. Allocations on
    // the worker are charged to its device's slot.
    const int threads = placement.ranks[rank].threads;
    workers[rank] = std::make_unique<runtime::DeviceWorker>([threads, slot] {
      at::set_num_threads(threads);
      memory::setThreadDevice(slot);
    });
  }
}

// Each further chain of a bidirectional schedule gets its own copy of
// every layer, equal to the original. Running statistics would drift apart
// between the copies (each sees half the micro-batches), so layers that
// keep them are refused.
void Pipeline::Impl::copyLayersForChains() {
  chainCopies.clear();
  if (schedule.chains == 1)
    return;
  // A copy is built anew (its reset() draws initial values) before the
  // original's values are copied in: the global generator is left as it
  // was, so what the caller draws later does not depend on the schedule.
  at::Generator global = at::globalContext().defaultGenerator(at::kCPU);
  const at::Tensor drawnSoFar = global.get_state();
  const std::string why = whyLayersCannotBeCopied(layers);
  TORCH_CHECK(
      why.empty(),
      "schedule '",
      schedule.name,
      "' runs a copy of every layer, and ",
      why,
      "; use a schedule with one chain (dualpipev lays the same V without "
      "copies)");
  for (int chain = 1; chain < schedule.chains; ++chain) {
    LayerList copy;
    for (const auto& layer : layers) {
      NamedLayer copied = layer;
      copied.module = layer.module.clone();
      copy.push_back(std::move(copied));
    }
    chainCopies.push_back(std::move(copy));
  }
  global.set_state(drawnSoFar);
}

void Pipeline::Impl::place() {
  copyLayersForChains();
  ties = runtime::findTiedGroups(layers, boundaries, options.tiedParameters);
  if (!chainCopies.empty()) {
    ties = runtime::withChainCopies(
        std::move(ties), layers, chainCopies, boundaries);
  }
  checkSharedTensorsStayOnOneDevice();
  // What a stage in another process is sent: a CPU tensor the transport
  // moves, or one on this process's GPU that NCCL sends as it is.
  remoteDevice = c10::Device(c10::kCPU);
  if (options.communicator) {
    remoteDevice = runtime::transferDevice(
        rankDevices, options.communicator->stageRank(), options.nccl);
    if (!remoteDevice.is_cpu())
      checkTransfersInOrder(schedule);
  }
  stages.resize(schedule.stages());
  for (int s = 0; s < schedule.stages(); ++s)
    placeStage(s);
  if (options.communicator) {
    remoteTransport = runtime::makeProcessGroupTransport(
        schedule.placement,
        *options.communicator,
        schedule.stages(),
        schedule.microBatches,
        mostSlots(),
        remoteDevice);
    transport = remoteTransport.get();
    transferDtype = fixedTransferDtype();
  }
  startWorkers();
}

// One tensor used on stages of two accelerators cannot live on both: such
// a tie needs a copy per stage, which only a declared tie gives.
void Pipeline::Impl::checkSharedTensorsStayOnOneDevice() const {
  for (const auto& group : ties) {
    for (size_t i = 1; i < group.tensors.size(); ++i) {
      const c10::Device a = rankDevices[schedule.rankOfStage(group.stages[0])];
      const c10::Device b = rankDevices[schedule.rankOfStage(group.stages[i])];
      TORCH_CHECK(
          group.tensors[i].unsafeGetTensorImpl() !=
                  group.tensors[0].unsafeGetTensorImpl() ||
              a == b || (a.is_cpu() && b.is_cpu()) ||
              !isLocalStage(group.stages[0]) || !isLocalStage(group.stages[i]),
          "'",
          group.names[0],
          "' and '",
          group.names[i],
          "' are one tensor on stages ",
          group.stages[0],
          " (",
          a,
          ") and ",
          group.stages[i],
          " (",
          b,
          "); give each its own tensor and tie them with "
          "PipelineOptions::tiedParameters");
    }
  }
}

// What crosses every boundary, when it is fixed: each layer's output shape
// known (shape inference) and one floating dtype throughout. Parameters
// keep their dtype, so this is decided once.
c10::optional<at::ScalarType> Pipeline::Impl::fixedTransferDtype() const {
  // Under autocast a boundary's dtype is the last op's (float or bf16).
  if (options.layerOutputShapes.size() != layers.size() || options.autocast)
    return c10::nullopt;
  c10::optional<at::ScalarType> dtype;
  for (const auto& layer : layers) {
    for (const auto& parameter : layer.module.ptr()->parameters()) {
      if (!parameter.is_floating_point() ||
          (dtype && *dtype != parameter.scalar_type()))
        return c10::nullopt;
      dtype = parameter.scalar_type();
    }
  }
  return dtype.value_or(at::kFloat);
}

bool keepFreedHostMemory() {
  memory::installHostCache();
  return memory::keepHeapMemory();
}

Pipeline::Pipeline(LayerList layers, PipelineOptions options)
    : impl_(std::make_unique<Impl>()) {
  keepFreedHostMemory();
  impl_->layers = std::move(layers);
  impl_->options = std::move(options);
  impl_->resolve();
  impl_->place();
  impl_->trace.schedule = impl_->schedule;
  impl_->trace.devices.assign(
      impl_->options.devices.begin(),
      impl_->options.devices.begin() + impl_->schedule.ranks);
}

Pipeline::~Pipeline() = default;

std::vector<torch::Tensor> Pipeline::parameters() const {
  // A tensor two layers share is stepped once.
  std::vector<torch::Tensor> all;
  std::set<const c10::TensorImpl*> seen;
  for (const auto& named : namedParameters()) {
    if (seen.insert(named.second.unsafeGetTensorImpl()).second)
      all.push_back(named.second);
  }
  for (const auto& copy : impl_->chainCopies) {
    for (const auto& layer : copy) {
      for (const auto& parameter : layer.module.ptr()->parameters()) {
        if (seen.insert(parameter.unsafeGetTensorImpl()).second)
          all.push_back(parameter);
      }
    }
  }
  return all;
}

void Pipeline::refreshChainCopies() {
  TORCH_CHECK(
      impl_->chainCopies.empty() || !impl_->options.communicator,
      "refreshChainCopies: the copies of a bidirectional schedule live on "
      "other processes than their originals");
  // Parameters through their ties; buffers, which no tie holds, directly.
  runtime::makeCopiesEqual(impl_->ties);
  torch::NoGradGuard noGrad;
  for (const auto& copy : impl_->chainCopies) {
    for (size_t l = 0; l < copy.size(); ++l) {
      const auto buffers = impl_->layers[l].module.ptr()->buffers();
      const auto copied = copy[l].module.ptr()->buffers();
      for (size_t i = 0; i < buffers.size(); ++i)
        copied[i].copy_(buffers[i]);
    }
  }
}

std::vector<std::pair<std::string, torch::Tensor>> Pipeline::namedParameters()
    const {
  std::vector<std::pair<std::string, torch::Tensor>> all;
  for (const auto& layer : impl_->layers) {
    for (const auto& item : layer.module.ptr()->named_parameters()) {
      all.emplace_back(layer.name + "." + item.key(), item.value());
    }
  }
  return all;
}

const LayerList& Pipeline::layers() const {
  return impl_->layers;
}
const std::vector<NamedLayer>& Pipeline::stageLayers(int stage) const {
  TORCH_CHECK(
      stage >= 0 && stage < impl_->schedule.stages(),
      "stageLayers: no stage ",
      stage,
      " in ",
      impl_->schedule.stages());
  return impl_->stages[stage].layers;
}

const Plan& Pipeline::plan() const {
  return impl_->plan;
}

const std::vector<int>& Pipeline::boundaries() const {
  return impl_->boundaries;
}
const Schedule& Pipeline::schedule() const {
  return impl_->schedule;
}
const PipelineOptions& Pipeline::options() const {
  return impl_->options;
}

const Trace& Pipeline::trace() const {
  return impl_->trace;
}

std::vector<DeviceMemory> Pipeline::memory() const {
  std::vector<DeviceMemory> all;
  for (size_t i = 0; i < impl_->memorySlots.size(); ++i) {
    const int rank = impl_->localRanks[i];
    const int slot = impl_->memorySlots[i];
    DeviceMemory m;
    m.device = impl_->options.devices[rank];
    if (!memory::acceleratorStats(
            impl_->rankDevices[rank], &m.liveBytes, &m.peakBytes)) {
      m.liveBytes = memory::liveBytes(slot);
      m.peakBytes = memory::peakBytes(slot);
    }
    m.capacityBytes = impl_->options.deviceMemory.empty()
        ? 0
        : impl_->options.deviceMemory[rank];
    all.push_back(m);
  }
  return all;
}

void Pipeline::setMemoryCapacity(int rank, int64_t bytes) {
  TORCH_CHECK(
      !impl_->memorySlots.empty(),
      "setMemoryCapacity: memory tracking is off (PipelineOptions::trackMemory)");
  const int slot = impl_->memorySlotOf(rank);
  TORCH_CHECK(
      slot != memory::kUnattributed,
      "setMemoryCapacity: device ",
      rank,
      " is not run by this process");
  TORCH_CHECK(bytes >= 0, "setMemoryCapacity: negative capacity");
  if (impl_->options.deviceMemory.empty())
    impl_->options.deviceMemory.assign(impl_->schedule.ranks, 0);
  impl_->options.deviceMemory[rank] = bytes;
  memory::setCapacity(slot, bytes, impl_->memoryLabel(rank));
}

void Pipeline::resetPeakMemory() {
  for (int slot : impl_->memorySlots)
    memory::resetPeak(slot);
  for (int rank : impl_->localRanks)
    memory::resetAcceleratorPeak(impl_->rankDevices[rank]);
}
void Pipeline::setRecording(bool on) {
  impl_->options.record = on;
}
void Pipeline::clearTrace() {
  impl_->trace.steps.clear();
}

std::vector<torch::Tensor> Pipeline::generatorStates() const {
  std::vector<torch::Tensor> states;
  for (const auto& stage : impl_->stages)
    states.push_back(stage.rngState.clone());
  return states;
}

void Pipeline::setGeneratorStates(const std::vector<torch::Tensor>& states) {
  TORCH_CHECK(
      states.size() == impl_->stages.size(),
      "expected ",
      impl_->stages.size(),
      " stage generator states, got ",
      states.size());
  for (size_t s = 0; s < states.size(); ++s) {
    at::Generator probe = impl_->isLocalStage(static_cast<int>(s))
        ? at::globalContext().defaultGenerator(impl_->stages[s].device).clone()
        : at::make_generator<at::CPUGeneratorImpl>();
    probe.set_state(states[s]); // rejects a malformed state
    impl_->stages[s].rngState = states[s].clone();
  }
}

std::vector<std::string> Pipeline::stageDevices() const {
  std::vector<std::string> names;
  for (const auto& stage : impl_->stages)
    names.push_back(stage.deviceName);
  return names;
}

std::string Pipeline::crossProcessTransfers(int stageRank) const {
  const Schedule& schedule = impl_->schedule;
  std::vector<c10::Device> ranks(schedule.ranks, c10::kCPU);
  for (int s = 0; s < schedule.stages(); ++s) {
    const std::string& name = impl_->stages[s].deviceName;
    if (name.rfind("cuda", 0) == 0)
      ranks[schedule.rankOfStage(s)] = c10::Device(name);
  }
  if (impl_->remoteTransport)
    return impl_->remoteTransport->describe();
  const c10::Device device =
      runtime::transferDevice(ranks, stageRank, impl_->options.nccl);
  return device.is_cpu() ? std::string("over Gloo through host memory")
                         : "over NCCL from " + device.str();
}

} // namespace tpipe
