// Layer list from a config: shape inference, the layer types, and the
// transformer block and deferred batch norm that LibTorch lacks.
#include <cmath>
#include <iomanip>
#include <sstream>

#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/pooling.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "host_memory.h"
#include "layers/parts.h"
#include "layers/random.h"
#include "model/layer_types.h"
#include "tpipe/model.h"
#include "tpipe/partition.h"

namespace tpipe {

struct BuiltLayer {
  torch::nn::AnyModule module;
};

namespace {

using Shape = std::vector<int64_t>;

// Dropout drawn from the running stage's own generator (stageDropout), so
// stages draw side by side; outside a pipeline, at::dropout's numbers.
class StageDropoutImpl : public torch::nn::Cloneable<StageDropoutImpl> {
 public:
  explicit StageDropoutImpl(double p) : p_(p) {}
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x) {
    return stageDropout(x, p_, is_training());
  }

 private:
  double p_;
};
TORCH_MODULE(StageDropout);

// Pre-LayerNorm GPT block: x + attn(ln1(x)), then x + mlp(ln2(x)), with a
// causal mask. Input and output [batch, time, dim]. Cloneable, so a
// bidirectional schedule (dualpipe) can copy it.
class TransformerBlockImpl : public torch::nn::Cloneable<TransformerBlockImpl> {
 public:
  TransformerBlockImpl(
      int64_t dim,
      int64_t heads,
      int64_t mlpRatio,
      double dropout)
      : dim_(dim), heads_(heads), mlpRatio_(mlpRatio), dropout_(dropout) {
    reset();
  }

  // Builds the parts (the constructor, and clone() before it copies the
  // values over).
  void reset() override {
    ln1 = register_module(
        "ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim_})));
    qkv = register_module("qkv", torch::nn::Linear(dim_, 3 * dim_));
    proj = register_module("proj", torch::nn::Linear(dim_, dim_));
    ln2 = register_module(
        "ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim_})));
    fc1 = register_module("fc1", torch::nn::Linear(dim_, mlpRatio_ * dim_));
    fc2 = register_module("fc2", torch::nn::Linear(mlpRatio_ * dim_, dim_));
    drop = register_module("drop", StageDropout(dropout_));
  }

  // Each part with parameters is reported (layers/parts.h): a split
  // backward's weight pass then needs none of the attention's graph.
  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t batch = x.size(0), time = x.size(1), dim = x.size(2);
    const int64_t headDim = dim / heads_;
    const torch::Tensor normed = reportPart(*ln1, x, ln1(x));
    auto parts = reportPart(*qkv, normed, qkv(normed))
                     .view({batch, time, 3, heads_, headDim})
                     .permute({2, 0, 3, 1, 4});
    torch::Tensor q = parts[0], k = parts[1], v = parts[2];
    torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) /
        std::sqrt(static_cast<double>(headDim));
    torch::Tensor future =
        torch::ones(
            {time, time},
            torch::TensorOptions().dtype(torch::kBool).device(x.device()))
            .triu(1);
    scores =
        scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    torch::Tensor attention = drop(torch::softmax(scores, -1));
    torch::Tensor mixed =
        torch::matmul(attention, v).transpose(1, 2).reshape({batch, time, dim});
    torch::Tensor h = x + drop(reportPart(*proj, mixed, proj(mixed)));
    const torch::Tensor normed2 = reportPart(*ln2, h, ln2(h));
    const torch::Tensor hidden =
        torch::nn::functional::gelu(reportPart(*fc1, normed2, fc1(normed2)));
    return h + drop(reportPart(*fc2, hidden, fc2(hidden)));
  }

 private:
  int64_t dim_, heads_, mlpRatio_;
  double dropout_;
  torch::nn::LayerNorm ln1{nullptr};
  torch::nn::Linear qkv{nullptr}, proj{nullptr};
  torch::nn::LayerNorm ln2{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  StageDropout drop{nullptr};
};
TORCH_MODULE(TransformerBlock);

// GPT-2's learned position embedding (wpe), added to the token embedding:
// one vector per position of the input's [..., seq, dim].
class PositionEmbeddingImpl
    : public torch::nn::Cloneable<PositionEmbeddingImpl> {
 public:
  PositionEmbeddingImpl(int64_t positions, int64_t dim)
      : positions_(positions), dim_(dim) {
    reset();
  }
  void reset() override {
    weight =
        register_parameter("weight", torch::randn({positions_, dim_}) * 0.02);
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return x + weight;
  }
  int64_t positions_, dim_;
  torch::Tensor weight;
};
TORCH_MODULE(PositionEmbedding);

// Normalizes each micro-batch with its own statistics (as any pipeline
// must), but accumulates sums over the micro-batches of a step and updates
// the running statistics once per batch, as the unpartitioned model would.
// A recomputed forward is not counted again.
class DeferredBatchNorm2dImpl : public torch::nn::Module {
 public:
  DeferredBatchNorm2dImpl(int64_t channels, double eps, double momentum)
      : eps_(eps), momentum_(momentum) {
    weight = register_parameter("weight", torch::ones({channels}));
    bias = register_parameter("bias", torch::zeros({channels}));
    running_mean = register_buffer("running_mean", torch::zeros({channels}));
    running_var = register_buffer("running_var", torch::ones({channels}));
    num_batches_tracked =
        register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
  }

  void setMicroBatches(int microBatches) {
    microBatches_ = microBatches;
  }

  torch::Tensor forward(const torch::Tensor& x) {
    if (!is_training()) {
      return torch::batch_norm(
          x, weight, bias, running_mean, running_var, false, 0.0, eps_, true);
    }
    if (!isRecomputing())
      accumulate(x);
    return torch::batch_norm(x, weight, bias, {}, {}, true, 0.0, eps_, true);
  }

  torch::Tensor weight, bias, running_mean, running_var, num_batches_tracked;

 private:
  void accumulate(const torch::Tensor& x) {
    torch::NoGradGuard noGrad;
    const auto xd = x.detach().to(torch::kDouble);
    torch::Tensor sum = xd.sum({0, 2, 3});
    torch::Tensor squares = (xd * xd).sum({0, 2, 3});
    sum_ = sum_.defined() ? sum_ + sum : sum;
    squares_ = squares_.defined() ? squares_ + squares : squares;
    count_ += x.numel() / x.size(1);
    if (++seen_ < microBatches_)
      return;
    const torch::Tensor mean = sum_ / count_;
    const torch::Tensor variance = (squares_ / count_ - mean * mean) *
        (count_ / std::max<double>(count_ - 1, 1));
    running_mean.mul_(1 - momentum_)
        .add_(mean.to(running_mean.dtype()) * momentum_);
    running_var.mul_(1 - momentum_)
        .add_(variance.to(running_var.dtype()) * momentum_);
    num_batches_tracked.add_(1);
    sum_ = squares_ = torch::Tensor();
    count_ = 0;
    seen_ = 0;
  }

  double eps_, momentum_;
  int microBatches_ = 1;
  torch::Tensor sum_, squares_;
  double count_ = 0;
  int seen_ = 0;
};
TORCH_MODULE(DeferredBatchNorm2d);

// Builders: the shape checks and the output shape are the facts' (see
// layer_facts.cpp); these make the module.

template <class Module>
BuiltLayer elementwise(const LayerInput&, const LayerFacts&) {
  return {torch::nn::AnyModule(Module())};
}

BuiltLayer embedding(const LayerInput& in, const LayerFacts&) {
  const auto& p = in.params;
  return {torch::nn::AnyModule(torch::nn::Embedding(
      p["num_embeddings"].get<int64_t>(), p["embedding_dim"].get<int64_t>()))};
}

BuiltLayer positionEmbedding(const LayerInput& in, const LayerFacts&) {
  return {torch::nn::AnyModule(
      PositionEmbedding(in.shape[in.shape.size() - 2], in.shape.back()))};
}

BuiltLayer linear(const LayerInput& in, const LayerFacts& facts) {
  return {torch::nn::AnyModule(torch::nn::Linear(
      torch::nn::LinearOptions(in.shape.back(), facts.output.back())
          .bias(in.params["bias"].get<bool>())))};
}

BuiltLayer conv2d(const LayerInput& in, const LayerFacts& facts) {
  const auto& p = in.params;
  const auto kernel = facts::sizePair(p["kernel_size"]),
             stride = facts::sizePair(p["stride"]),
             padding = facts::sizePair(p["padding"]);
  return {torch::nn::AnyModule(torch::nn::Conv2d(
      torch::nn::Conv2dOptions(
          in.shape[0], facts.output[0], {kernel[0], kernel[1]})
          .stride({stride[0], stride[1]})
          .padding({padding[0], padding[1]})
          .bias(p["bias"].get<bool>())))};
}

template <class Pool, class Options>
BuiltLayer pool2d(const LayerInput& in, const LayerFacts&) {
  const auto& p = in.params;
  const auto kernel = facts::sizePair(p["kernel_size"]),
             stride = facts::sizePair(p["stride"]),
             padding = facts::sizePair(p["padding"]);
  return {torch::nn::AnyModule(Pool(Options({kernel[0], kernel[1]})
                                        .stride({stride[0], stride[1]})
                                        .padding({padding[0], padding[1]})))};
}

BuiltLayer flatten(const LayerInput&, const LayerFacts&) {
  return {torch::nn::AnyModule(torch::nn::Flatten())};
}

BuiltLayer dropout(const LayerInput& in, const LayerFacts&) {
  return {torch::nn::AnyModule(StageDropout(in.params["p"].get<double>()))};
}

BuiltLayer layernorm(const LayerInput& in, const LayerFacts&) {
  return {torch::nn::AnyModule(
      torch::nn::LayerNorm(torch::nn::LayerNormOptions({in.shape.back()})
                               .eps(in.params["eps"].get<double>())))};
}

BuiltLayer batchnorm2d(const LayerInput& in, const LayerFacts&) {
  return {torch::nn::AnyModule(DeferredBatchNorm2d(
      in.shape[0],
      in.params["eps"].get<double>(),
      in.params["momentum"].get<double>()))};
}

BuiltLayer transformerBlock(const LayerInput& in, const LayerFacts&) {
  return {torch::nn::AnyModule(TransformerBlock(
      in.shape[1],
      in.params["heads"].get<int64_t>(),
      in.params["mlp_ratio"].get<int64_t>(),
      in.params["dropout"].get<double>()))};
}

} // namespace

const std::vector<LayerType>& layerTypes() {
  using K = ParamKind;
  static const std::vector<LayerType> types = {
      {"linear",
       {{"out_features", K::kPositive, nullptr}, {"bias", K::kBool, true}},
       "[..., in] -> [..., out_features]",
       facts::linear,
       linear},
      {"conv2d",
       {{"out_channels", K::kPositive, nullptr},
        {"kernel_size", K::kSize2, nullptr},
        {"stride", K::kSize2, 1},
        {"padding", K::kSize2NonNegative, 0},
        {"bias", K::kBool, true}},
       "[c, h, w] -> [out_channels, h', w']",
       facts::conv2d,
       conv2d},
      {"maxpool2d",
       {{"kernel_size", K::kSize2, nullptr},
        {"stride", K::kSize2, nullptr},
        {"padding", K::kSize2NonNegative, 0}},
       "[c, h, w] -> [c, h', w']",
       facts::pool2d,
       pool2d<torch::nn::MaxPool2d, torch::nn::MaxPool2dOptions>},
      {"avgpool2d",
       {{"kernel_size", K::kSize2, nullptr},
        {"stride", K::kSize2, nullptr},
        {"padding", K::kSize2NonNegative, 0}},
       "[c, h, w] -> [c, h', w']",
       facts::pool2d,
       pool2d<torch::nn::AvgPool2d, torch::nn::AvgPool2dOptions>},
      {"flatten", {}, "[...] -> [product]", facts::flatten, flatten},
      {"identity",
       {},
       "same",
       facts::elementwise,
       elementwise<torch::nn::Identity>},
      {"relu", {}, "same", facts::elementwise, elementwise<torch::nn::ReLU>},
      {"gelu", {}, "same", facts::elementwise, elementwise<torch::nn::GELU>},
      {"tanh", {}, "same", facts::elementwise, elementwise<torch::nn::Tanh>},
      {"sigmoid",
       {},
       "same",
       facts::elementwise,
       elementwise<torch::nn::Sigmoid>},
      {"dropout",
       {{"p", K::kProbability, 0.5}},
       "same",
       facts::dropout,
       dropout},
      {"layernorm",
       {{"eps", K::kPositiveNumber, 1e-5}},
       "same (over the last dim)",
       facts::layernorm,
       layernorm},
      {"position_embedding",
       {},
       "[..., seq, dim] -> same, plus a learned vector per position",
       facts::positionEmbedding,
       positionEmbedding},
      {"batchnorm2d",
       {{"eps", K::kPositiveNumber, 1e-5}, {"momentum", K::kProbability, 0.1}},
       "[c, h, w] -> same",
       facts::batchnorm2d,
       batchnorm2d},
      {"embedding",
       {{"num_embeddings", K::kPositive, nullptr},
        {"embedding_dim", K::kPositive, nullptr}},
       "token ids [...] -> [..., embedding_dim]",
       facts::embedding,
       embedding},
      {"transformer_block",
       {{"heads", K::kPositive, nullptr},
        {"mlp_ratio", K::kPositive, 4},
        {"dropout", K::kProbability, 0.0}},
       "[seq_len, dim] -> same",
       facts::transformerBlock,
       transformerBlock},
  };
  return types;
}

const LayerType* findLayerType(const std::string& name) {
  for (const auto& type : layerTypes()) {
    if (name == type.name)
      return &type;
  }
  return nullptr;
}

namespace {

// Layer `layer`'s weight takes layer `to`'s values and is declared tied to
// it: the model is the tied one, and the pipeline keeps the copies equal.
void tie(BuiltModel& built, int to, size_t layer) {
  const std::string where =
      "model.layers[" + std::to_string(layer) + "].tied_to";
  auto weightOf = [&](size_t index) {
    auto* weight =
        built.layers[index].module.ptr()->named_parameters().find("weight");
    if (weight == nullptr) {
      throw ConfigError(
          where + ": layer " + std::to_string(index) + " has no weight");
    }
    return *weight;
  };
  const at::Tensor source = weightOf(static_cast<size_t>(to));
  at::Tensor target = weightOf(layer);
  if (source.sizes() != target.sizes()) {
    throw ConfigError(
        where + ": its weight " +
        c10::str(target.sizes(), " and layer ", to, "'s ", source.sizes()) +
        " differ in shape (a linear head tied to an embedding of V x D "
        "has out_features V and input D, bias false)");
  }
  torch::NoGradGuard noGrad;
  target.copy_(source);
  built.parameterCount -= target.numel();
  built.tiedParameters.push_back(
      {std::to_string(to) + ".weight", std::to_string(layer) + ".weight"});
}

// Every process builds the whole model before a plan splits it, so its
// parameters must fit in this host's available memory: a config written for
// a cluster (configs/gpt3_175b.json, 175 billion parameters) had filled the
// memory for minutes. Tied layers are left out: a lower bound, never a
// refusal of a model that would fit.
void checkParametersFitHost(const ModelConfig& model) {
  const int64_t available = availableMemoryBytes();
  if (available <= 0)
    return;
  const std::vector<LayerFacts> facts = modelFacts(model);
  double parameters = 0;
  for (size_t l = 0; l < facts.size(); ++l) {
    if (model.layers[l].tiedTo < 0)
      parameters += static_cast<double>(facts[l].parameters);
  }
  const double bytes = parameters * sizeof(float);
  if (bytes <= static_cast<double>(available))
    return;
  std::ostringstream count;
  count << std::fixed << std::setprecision(1);
  if (parameters >= 1e9)
    count << parameters / 1e9 << " billion";
  else
    count << parameters / 1e6 << " million";
  throw ConfigError(
      "model: its " + count.str() + " parameters need " +
      formatBytes(static_cast<int64_t>(std::min(bytes, 9e18))) +
      " as float32, and this host has " + formatBytes(available) +
      " available; every process builds the whole model before a plan "
      "splits it (`tpipe tune --cluster` plans a model for a cluster "
      "without building it)");
}

} // namespace

BuiltModel buildModel(const Config& config) {
  BuiltModel built = buildModel(config.model, config.train.seed);
  checkPipelineFitsLayers(config.pipeline, built.layers.size());
  return built;
}

BuiltModel buildModel(const ModelConfig& model, uint64_t seed) {
  if (!model.torchscript.empty())
    return buildScriptedModel(model);
  checkParametersFitHost(model);
  torch::manual_seed(seed);
  BuiltModel built;
  built.shapes.push_back(model.inputShape);
  built.integerInput =
      !model.layers.empty() && model.layers.front().type == "embedding";
  bool integer = built.integerInput;
  if (integer) {
    built.inputVocabulary =
        model.layers.front().params["num_embeddings"].get<int64_t>();
  }
  SkipShapes skips;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    const LayerSpec& spec = model.layers[i];
    LayerFacts facts = layerFacts(spec, i, built.shapes.back(), integer);
    const LayerInput input{spec.params, built.shapes.back(), integer, ""};
    BuiltLayer layer = findLayerType(spec.type)->build(input, facts);
    mergeSkipShapes(spec, i, facts, skips);
    integer = false;
    for (const auto& parameter : layer.module.ptr()->parameters()) {
      built.parameterCount += parameter.numel();
    }
    built.layers.push_back({std::to_string(i), std::move(layer.module)});
    built.layers.back().stash = spec.stash;
    built.layers.back().pop = spec.pop;
    built.layers.back().merge =
        spec.merge == "concat" ? SkipMerge::kConcat : SkipMerge::kAdd;
    if (spec.tiedTo >= 0)
      tie(built, spec.tiedTo, i);
    built.shapes.push_back(std::move(facts.output));
  }
  return built;
}

void setBatchNormMicroBatches(const BuiltModel& model, int microBatches) {
  for (const auto& layer : model.layers) {
    if (auto* norm = layer.module.ptr()->as<DeferredBatchNorm2dImpl>()) {
      norm->setMicroBatches(microBatches);
    }
  }
}

} // namespace tpipe
