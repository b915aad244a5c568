// The loss, the optimizer, the learning-rate schedule and the batches of a
// training run.
#include <ATen/CPUGeneratorImpl.h>
#include <cmath>
#include <torch/nn/functional/loss.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include "train/parts.h"

namespace tpipe {

LossFunction makeLoss(const std::string& name) {
  if (name == "mse") {
    return [](const torch::Tensor& out, const torch::Tensor& target) {
      return torch::nn::functional::mse_loss(out, target);
    };
  }
  // Sequences ([batch, time, classes]) are flattened to one prediction per
  // position; the mean over positions and samples is the per-token loss.
  return [](const torch::Tensor& out, const torch::Tensor& target) {
    return torch::nn::functional::cross_entropy(
        out.reshape({-1, out.size(-1)}), target.reshape({-1}));
  };
}

std::unique_ptr<torch::optim::Optimizer> makeOptimizer(
    const OptimizerConfig& o,
    std::vector<torch::Tensor> parameters) {
  if (o.type == "adam") {
    return std::make_unique<torch::optim::Adam>(
        parameters,
        torch::optim::AdamOptions(o.lr)
            .betas({o.beta1, o.beta2})
            .eps(o.eps)
            .weight_decay(o.weightDecay));
  }
  if (o.type == "adamw") {
    return std::make_unique<torch::optim::AdamW>(
        parameters,
        torch::optim::AdamWOptions(o.lr)
            .betas({o.beta1, o.beta2})
            .eps(o.eps)
            .weight_decay(o.weightDecay));
  }
  return std::make_unique<torch::optim::SGD>(
      parameters,
      torch::optim::SGDOptions(o.lr)
          .momentum(o.momentum)
          .weight_decay(o.weightDecay));
}

namespace {

// Replaces a cloned state's tensors (shared with the original) by copies.
void deepen(torch::optim::OptimizerParamState& state) {
  auto copy = [](const torch::Tensor& t) {
    return t.defined() ? t.clone() : t;
  };
  if (auto* sgd = dynamic_cast<torch::optim::SGDParamState*>(&state)) {
    sgd->momentum_buffer(copy(sgd->momentum_buffer()));
  } else if (auto* adam = dynamic_cast<torch::optim::AdamParamState*>(&state)) {
    adam->exp_avg(copy(adam->exp_avg()));
    adam->exp_avg_sq(copy(adam->exp_avg_sq()));
    adam->max_exp_avg_sq(copy(adam->max_exp_avg_sq()));
  } else if (
      auto* adamw = dynamic_cast<torch::optim::AdamWParamState*>(&state)) {
    adamw->exp_avg(copy(adamw->exp_avg()));
    adamw->exp_avg_sq(copy(adamw->exp_avg_sq()));
    adamw->max_exp_avg_sq(copy(adamw->max_exp_avg_sq()));
  } else {
    TORCH_CHECK(false, "no deep copy for this optimizer's state");
  }
}

} // namespace

RankOptimizers makeRankOptimizers(
    const OptimizerConfig& optimizer,
    const Pipeline& pipe) {
  RankOptimizers perRank(pipe.schedule().ranks);
  for (int rank : pipe.localRanks())
    perRank[rank] = makeOptimizer(optimizer, pipe.rankParameters(rank));
  return perRank;
}

void collectOptimizerState(
    torch::optim::Optimizer& into,
    const RankOptimizers& from) {
  for (const auto& rank : from) {
    if (!rank)
      continue;
    for (const auto& entry : rank->state())
      into.state()[entry.first] = entry.second->clone();
  }
}

void distributeOptimizerState(
    torch::optim::Optimizer& from,
    RankOptimizers& into) {
  auto& all = from.state();
  using StateMap = std::decay_t<decltype(all)>;
  for (auto& rank : into) {
    if (!rank)
      continue;
    for (auto& group : rank->param_groups()) {
      for (const auto& parameter : group.params()) {
        const auto key = stateKeyOf<StateMap>(parameter);
        const auto found = all.find(key);
        if (found != all.end())
          rank->state()[key] = found->second->clone();
      }
    }
  }
}

std::function<void()> snapshotOptimizerState(
    torch::optim::Optimizer& optimizer) {
  auto& state = optimizer.state();
  using StateMap = std::decay_t<decltype(state)>;
  auto saved = std::make_shared<StateMap>();
  for (const auto& entry : state) {
    auto copy = entry.second->clone();
    deepen(*copy);
    (*saved)[entry.first] = std::move(copy);
  }
  return [&state, saved] { state = std::move(*saved); };
}

double learningRate(const TrainConfig& t, int64_t step) {
  const auto& o = t.optimizer;
  if (step < o.warmupSteps)
    return o.lr * static_cast<double>(step + 1) /
        static_cast<double>(o.warmupSteps);
  if (o.decay != "cosine")
    return o.lr;
  const double span = std::max<int64_t>(1, t.steps - o.warmupSteps);
  const double progress =
      std::min(1.0, static_cast<double>(step - o.warmupSteps) / span);
  return o.minLr + 0.5 * (o.lr - o.minLr) * (1.0 + std::cos(M_PI * progress));
}

BatchSource::BatchSource(
    const Dataset& data,
    int64_t batchSize,
    bool shuffle,
    uint64_t seed)
    : data_(data), batchSize_(batchSize), shuffle_(shuffle), seed_(seed) {
  const int64_t n = data.trainInputs.size(0);
  if (n < batchSize) {
    throw ConfigError(
        "train.batch_size: " + std::to_string(batchSize) + " exceeds the " +
        std::to_string(n) + " training samples");
  }
  batchesPerEpoch_ = n / batchSize;
}

std::pair<torch::Tensor, torch::Tensor> BatchSource::batch(int64_t step) {
  const int64_t epoch = step / batchesPerEpoch_;
  const int64_t offset = (step % batchesPerEpoch_) * batchSize_;
  if (!shuffle_) {
    return {
        data_.trainInputs.narrow(0, offset, batchSize_),
        data_.trainTargets.narrow(0, offset, batchSize_)};
  }
  if (epoch != epoch_) {
    at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(
        seed_ * 1000003ULL + 7919ULL * (epoch + 1));
    order_ =
        torch::randperm(data_.trainInputs.size(0), generator, torch::kLong);
    epoch_ = epoch;
  }
  const torch::Tensor index = order_.narrow(0, offset, batchSize_);
  return {
      data_.trainInputs.index_select(0, index),
      data_.trainTargets.index_select(0, index)};
}

} // namespace tpipe
