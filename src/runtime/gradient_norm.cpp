// The global gradient norm after a step, over every stage (tied copies
// once, replicas once), and the clip that scales every gradient by one
// factor when it exceeds the limit.
#include <cmath>
#include <set>
#include <vector>

#include <ATen/ops/stack.h>

#include "runtime/pipeline_impl.h"

namespace tpipe {

double Pipeline::Impl::gradientSquares(int stage) const {
  std::vector<at::Tensor> norms;
  for (const auto& gradient : gradientsOf(stage)) {
    if (gradient.defined())
      norms.push_back(gradient.norm().to(at::kDouble));
  }
  return norms.empty() ? 0.0 : at::stack(norms).pow(2).sum().item<double>();
}

double Pipeline::Impl::stageSquares(int stage) const {
  double squares = gradientSquares(stage);
  for (const auto& group : ties) {
    const at::Tensor& gradient = group.tensors.front().grad();
    if (group.stages.front() == stage && gradient.defined()) {
      const double norm = gradient.norm().item<double>();
      squares += norm * norm;
    }
  }
  return squares;
}

Pipeline::GradientNorm Pipeline::clipGradNorm(double maxNorm) {
  TORCH_CHECK(
      impl_->posted.empty(), "clipGradNorm: steps are posted (finishStep)");
  const int stages = impl_->schedule.stages();
  std::vector<double> squares(stages, 0.0);
  for (const auto& stage : impl_->stages) {
    if (impl_->isLocalStage(stage.index))
      squares[stage.index] = impl_->stageSquares(stage.index);
  }
  if (auto* communicator = impl_->options.communicator.get()) {
    // Replicas hold the same (averaged) gradients: count one of them.
    squares = communicator->sum(squares);
    for (double& value : squares)
      value /= communicator->replicas();
  }
  GradientNorm result;
  double total = 0.0;
  for (int s = 0; s < stages; ++s) {
    if (!std::isfinite(squares[s]) && result.nonFiniteStage < 0)
      result.nonFiniteStage = s;
    total += squares[s];
  }
  result.norm = std::sqrt(total);
  if (result.nonFiniteStage >= 0 || maxNorm <= 0.0)
    return result;
  const double scale = maxNorm / (result.norm + 1e-6);
  if (scale >= 1.0)
    return result;
  // Every parameter a local layer uses (tied copies too), each tensor once.
  std::set<const c10::TensorImpl*> scaled;
  for (const auto& stage : impl_->stages) {
    if (!impl_->isLocalStage(stage.index))
      continue;
    for (const auto& layer : stage.layerParameters) {
      for (const auto& parameter : layer) {
        if (parameter.grad().defined() &&
            scaled.insert(parameter.unsafeGetTensorImpl()).second)
          parameter.mutable_grad().mul_(scale);
      }
    }
  }
  return result;
}

} // namespace tpipe
