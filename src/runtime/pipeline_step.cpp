// Driving a step on a built pipeline: splitting the batch, running every
// local rank's instructions, the loss and the gradients' sums across
// processes. The gradient norm and clip after a step: gradient_norm.cpp.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>

#include <ATen/ops/cat.h>
#include <ATen/Parallel.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/types.h>

#include "runtime/pipeline_impl.h"

namespace tpipe {

std::vector<at::Tensor> Pipeline::Impl::split(
    const at::Tensor& tensor,
    int chunks,
    c10::Device device) const {
  std::vector<at::Tensor> parts;
  for (const auto& part : tensor.tensor_split(chunks, 0)) {
    parts.push_back(part.to(device));
  }
  return parts;
}

void Pipeline::Impl::splitBatch(
    runtime::StepState& state,
    const at::Tensor& input,
    const at::Tensor& target) const {
  const int m = schedule.microBatches;
  // Each micro-batch enters at its chain's first stage and ends at its last
  // (with one chain: stage 0 and the last).
  const auto inputs = input.tensor_split(m, 0);
  const auto targets = target.tensor_split(m, 0);
  for (int mb = 0; mb < m; ++mb) {
    const int first = schedule.firstStageOf(mb),
              last = schedule.lastStageOf(mb);
    state.inputs.push_back(inputs[mb].to(stages[first].device));
    state.targets.push_back(targets[mb].to(stages[last].device));
  }
  const int64_t batch = input.size(0);
  for (const auto& chunk : state.inputs) {
    state.weights.push_back(
        static_cast<double>(chunk.size(0)) / static_cast<double>(batch));
    state.microBatchSizes.push_back(chunk.size(0));
  }
}

// Across processes a failed step is explained by every rank: each posts its
// account and waits (up to the timeout) for the others'; ranks that never
// report are the lost ones, named in the error every live rank exits with.
std::string Pipeline::Impl::withAccounts(
    Communicator& world,
    const std::string& error) {
  const std::string mine =
      "rank " + std::to_string(world.rank()) + ": " + error;
  // The live ranks fail within moments of each other: a closed connection is
  // news at once, and a silent peer has already been waited out for the
  // timeout by whoever reports it. A few seconds collect every live
  // account; waiting the timeout again would only delay the exit (a stopped
  // rank used to hold the job for twice the timeout). A rank whose
  // connections closed is not waited for at all: a restart goes on at once.
  const auto grace = std::min(world.timeout(), std::chrono::milliseconds(3000));
  const Communicator::FailureAccounts accounts =
      world.reportFailure(mine, grace);
  std::string silent, ended, others;
  for (size_t r = 0; r < accounts.lines.size(); ++r) {
    const std::string& line = accounts.lines[r];
    std::string& list = accounts.closed[r] ? ended : silent;
    if (line.empty())
      list += (list.empty() ? "" : ", ") + std::to_string(r);
    else if (static_cast<int>(r) != world.rank())
      others += "\n  " + line.substr(0, line.find('\n'));
  }
  std::string text = mine;
  if (!ended.empty()) {
    text += "\nlost: rank(s) " + ended +
        " ended (their connections closed) without an account";
  }
  if (!silent.empty() && !accounts.storeLost.empty()) {
    text += "\nlost: rank(s) " + silent +
        ": no account could be read, the store stopped answering (" +
        accounts.storeLost + ")";
  } else if (!silent.empty()) {
    char seconds[32];
    std::snprintf(seconds, sizeof seconds, "%.1f", grace.count() / 1000.0);
    text += "\nlost: rank(s) " + silent + " sent no account within " + seconds +
        " s";
  }
  if (!others.empty())
    text += "\nthe other ranks:" + others;
  return text;
}

// With the transfers' shapes fixed (fixedTransferDtype), the process
// transport skips headers and posts its receives at the step's start.
void Pipeline::Impl::expectShapes(
    const runtime::StepState& state,
    const Schedule& plan) {
  if (!transferDtype)
    return;
  runtime::StepShapes shapes;
  shapes.dtype = *transferDtype;
  shapes.microBatchSizes = state.microBatchSizes;
  shapes.receivesAhead = options.receivesAhead;
  for (int b = 0; b + 1 < plan.stages(); ++b) {
    shapes.perSample.emplace_back();
    if (!plan.hasNext(b))
      continue; // between two chains: nothing crosses
    for (int layer : stages[b + 1].sourceLayers)
      shapes.perSample.back().push_back(options.layerOutputShapes[layer]);
  }
  for (int rank : localRanks) {
    for (const auto& instruction : plan.perRank[rank]) {
      if (const auto* r = std::get_if<RecvActivation>(&instruction)) {
        shapes.receives.push_back(
            {runtime::Direction::kActivation, r->stage - 1, r->microBatch});
      } else if (const auto* g = std::get_if<RecvGrad>(&instruction)) {
        shapes.receives.push_back(
            {runtime::Direction::kGradient, g->stage, g->microBatch});
      }
    }
  }
  // The posted receives' buffers are held from now on: charge them to the
  // device (one process runs one pipeline rank).
  c10::optional<memory::DeviceScope> charged;
  if (!memorySlots.empty())
    charged.emplace(memorySlots.front());
  transport->expect(shapes);
}

// One device in this process (one stage, or one rank of a multi-process
// run): its work runs on the calling thread, under the settings a worker
// has (intra-op threads, memory slot). On this machine a LibTorch loop on
// a process's first thread ran 6-10% faster than the same loop on a second
// thread (OpenMP's pool and malloc's arenas of later threads), and one
// stage must cost no more than a plain loop. With several devices each has
// its worker, and the caller waits.
void Pipeline::Impl::leaveCoresToWorkers() const {
  if (at::get_num_threads() != 1)
    at::set_num_threads(1);
}

void Pipeline::Impl::runOn(
    const std::vector<int>& ranks,
    const std::function<void(int)>& job) {
  if (runsOnCaller()) {
    // Set once and kept: changing the count back and forth would rebuild
    // LibTorch's thread pools every step.
    const int threads = placement.ranks[localRanks.front()].threads;
    if (at::get_num_threads() != threads)
      at::set_num_threads(threads);
    memory::DeviceScope charged(
        memorySlots.empty() ? memory::kUnattributed : memorySlots.front());
    job(localRanks.front());
    return;
  }
  leaveCoresToWorkers();
  runtime::Latch latch(static_cast<int>(ranks.size()));
  for (int rank : ranks) {
    workers[rank]->post([&job, &latch, rank] {
      job(rank);
      latch.countDown();
    });
  }
  latch.wait();
}

void Pipeline::Impl::prepare(runtime::StepState& state, const Schedule& plan) {
  state.schedule = &plan;
  state.stages = &stages;
  state.transport = transport;
  const int m = plan.microBatches;
  state.stash.assign(static_cast<size_t>(plan.stages()) * m, {});
  state.losses.assign(m, {});
  state.outputs.assign(m, {});
  state.record = options.record && plan.training;
  state.splitBackward = plan.splitsBackward();
  state.directBackward = options.directWeightGradients;
  state.autocast = options.autocast;
  state.copyOnReceive = !memorySlots.empty() && !remoteTransport;
  if (state.record)
    state.events.assign(plan.ranks, {});
  state.layerOutputShapes = &options.layerOutputShapes;
  followOriginalsMode();
}

// The user switches the originals between training and evaluation; the
// chains' copies follow (dropout, batch statistics).
void Pipeline::Impl::followOriginalsMode() {
  for (const auto& copy : chainCopies) {
    for (size_t l = 0; l < copy.size(); ++l) {
      const bool training = layers[l].module.ptr()->is_training();
      if (copy[l].module.ptr()->is_training() != training)
        copy[l].module.ptr()->train(training);
    }
  }
}

at::Tensor Pipeline::Impl::lossTotal(const runtime::StepState& state) {
  at::Tensor total;
  for (const auto& loss : state.losses) {
    if (loss.defined())
      total = total.defined() ? total + loss : loss;
  }
  return total;
}

void Pipeline::Impl::checkBatch(
    const at::Tensor& input,
    const at::Tensor& target,
    const LossFunction& lossFn,
    const char* what) const {
  TORCH_CHECK(
      input.defined() && input.dim() >= 1,
      what,
      ": input must have a batch dimension");
  TORCH_CHECK(
      target.defined() && target.dim() >= 1 && target.size(0) == input.size(0),
      what,
      ": target batch (",
      target.defined() && target.dim() ? target.size(0) : 0,
      ") differs from input batch (",
      input.size(0),
      ")");
  TORCH_CHECK(lossFn, what, ": no loss function given");
  const int m = schedule.microBatches;
  TORCH_CHECK(
      input.size(0) >= m,
      "more micro-batches (",
      m,
      ") than samples (",
      input.size(0),
      ") in the batch");
}

void Pipeline::Impl::run(runtime::StepState& state, const Schedule& plan) {
  TORCH_CHECK(
      posted.empty(),
      "a step runs while ",
      posted.size(),
      " posted step(s) are unfinished (finishStep first)");
  prepare(state, plan);
  transport->begin(plan.stages() - 1);
  if (remoteTransport)
    expectShapes(state, plan);
  state.start = std::chrono::steady_clock::now();
  const bool training = plan.training;
  runOn(localRanks, [&state, training](int rank) {
    at::AutoGradMode gradMode(training); // grad mode is per thread
    runtime::runRank(state, rank);
  });
  if (state.error.empty()) {
    try {
      transport->end();
    } catch (const c10::Error& error) {
      state.error = error.what_without_backtrace();
    }
  }
  const double wallUs = std::chrono::duration<double, std::micro>(
                            std::chrono::steady_clock::now() - state.start)
                            .count();
  state.stash.clear(); // frees activations of a failed step too
  if (!state.error.empty() && options.communicator)
    state.error = withAccounts(*options.communicator, state.error);
  TORCH_CHECK(state.error.empty(), state.error);
  if (plan.training)
    ++steps;
  if (state.record)
    keepTrace(state, wallUs);
}

// The step's events join the trace; the last keepSteps are kept.
void Pipeline::Impl::keepTrace(runtime::StepState& state, double wallUs) {
  StepTrace step;
  step.step = steps;
  step.wallUs = wallUs;
  step.originUs =
      std::chrono::duration<double, std::micro>(state.start.time_since_epoch())
          .count();
  for (auto& events : state.events)
    step.events.insert(step.events.end(), events.begin(), events.end());
  trace.steps.push_back(std::move(step));
  const size_t keep = static_cast<size_t>(std::max(1, options.keepSteps));
  if (trace.steps.size() > keep) {
    trace.steps.erase(
        trace.steps.begin(),
        trace.steps.end() - static_cast<std::ptrdiff_t>(keep));
  }
}

void Pipeline::Impl::armGradientAveraging(runtime::StepState& state) {
  Communicator* communicator = options.communicator.get();
  if (!communicator || communicator->replicas() == 1 ||
      !options.overlapGradientSync)
    return;
  state.gradientsFinal = [this, communicator](int stage) {
    communicator->startAveraging(gradientsOf(stage));
  };
}

void Pipeline::Impl::finishGradientAveraging(const runtime::StepState& state) {
  Communicator& communicator = *options.communicator;
  if (!state.gradientsFinal) {
    for (const auto& stage : stages) {
      if (isLocalStage(stage.index))
        communicator.startAveraging(gradientsOf(stage.index));
    }
  }
  communicator.finishAveraging();
}

at::Tensor Pipeline::Impl::worldLossTensor(
    double value,
    const runtime::StepState& state) const {
  // In the dtype of the losses computed here, if any.
  at::ScalarType dtype = torch::kFloat;
  for (const auto& loss : state.losses) {
    if (loss.defined()) {
      dtype = loss.scalar_type();
      break;
    }
  }
  return torch::tensor(value, torch::TensorOptions().dtype(dtype));
}

torch::Tensor Pipeline::trainStep(
    const torch::Tensor& input,
    const torch::Tensor& target,
    const LossFunction& lossFn) {
  impl_->checkBatch(input, target, lossFn, "trainStep");
  runtime::StepState state;
  impl_->splitBatch(state, input, target);
  state.lossFn = &lossFn;
  impl_->armGradientAveraging(state);
  impl_->run(state, impl_->schedule);
  const bool lastIsLocal = impl_->endsMicroBatches();
  const at::Tensor total = lastIsLocal ? Impl::lossTotal(state) : at::Tensor();
  auto isLocal = [this](int stage) { return impl_->isLocalStage(stage); };
  Communicator* communicator = impl_->options.communicator.get();
  if (!communicator) {
    runtime::sumTiedGradients(impl_->ties, isLocal, nullptr);
    return total;
  }
  // Every process returns the mean over replicas; gradients likewise, their
  // reductions started as each stage's backward ended, or now.
  double mean = 0.0;
  if (impl_->schedule.chains == 1) {
    const double local = lastIsLocal ? total.item<double>() : 0.0;
    mean = communicator->sum({local})[0] / communicator->replicas();
  } else {
    // Micro-batches end on several processes: each one's loss is gathered
    // and they are added in micro-batch order, in the loss's own precision,
    // as one process adds them.
    std::vector<double> each(state.losses.size(), 0.0);
    for (size_t mb = 0; mb < each.size(); ++mb) {
      if (state.losses[mb].defined())
        each[mb] = state.losses[mb].item<double>();
    }
    each = communicator->sum(each);
    at::Tensor sum;
    for (double loss : each) {
      const at::Tensor value = torch::tensor(
          loss / communicator->replicas(),
          torch::TensorOptions().dtype(
              total.defined() ? total.scalar_type() : torch::kFloat));
      sum = sum.defined() ? sum + value : value;
    }
    mean = sum.item<double>();
  }
  impl_->finishGradientAveraging(state);
  runtime::sumTiedGradients(impl_->ties, isLocal, communicator);
  return impl_->worldLossTensor(mean, state);
}

void Pipeline::runOnWorker(const std::function<void()>& task) {
  std::exception_ptr failure;
  impl_->runOn({impl_->localRanks.front()}, [&](int) {
    try {
      memory::DeviceScope unattributed(memory::kUnattributed);
      task();
    } catch (...) {
      failure = std::current_exception();
    }
  });
  if (failure)
    std::rethrow_exception(failure);
}

torch::Tensor Pipeline::forward(const torch::Tensor& input) {
  TORCH_CHECK(
      input.defined() && input.dim() >= 1 && input.size(0) >= 1,
      "forward: input must have a non-empty batch dimension");
  const int m = static_cast<int>(
      std::min<int64_t>(impl_->schedule.microBatches, input.size(0)));
  // Inference needs one chain: a bidirectional schedule's first (stage s on
  // rank s) forwards every micro-batch, ending where other schedules end.
  const Schedule& trained = impl_->schedule;
  const Schedule inference = trained.chains > 1
      ? forwardOnlySchedule(trained.ranks, 1, m)
      : forwardOnlySchedule(
            trained.ranks, trained.virtualStages, m, trained.placement);
  runtime::StepState state;
  state.inputs = impl_->split(input, m, impl_->stages.front().device);
  for (const auto& chunk : state.inputs)
    state.microBatchSizes.push_back(chunk.size(0));
  impl_->run(state, inference);
  if (!impl_->isLocalStage(inference.stages() - 1))
    return torch::Tensor();
  return at::cat(state.outputs, 0);
}

} // namespace tpipe
