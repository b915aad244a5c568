// Layer list from a config: shape inference, the layer types, and the
// transformer block and deferred batch norm that LibTorch lacks.
#include <cmath>
#include <sstream>

#include <torch/nn/functional/activation.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>
#include <torch/nn/modules/pooling.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "tpipe/trainer.h"

namespace tpipe {
namespace {

using Shape = std::vector<int64_t>;

std::string shapeText(const Shape& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i) out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

// Pre-LayerNorm GPT block: x + attn(ln1(x)), then x + mlp(ln2(x)), with a
// causal mask. Input and output [batch, time, dim].
class TransformerBlockImpl : public torch::nn::Module {
 public:
  TransformerBlockImpl(int64_t dim, int64_t heads, int64_t mlpRatio, double dropout)
      : heads_(heads),
        ln1(register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        qkv(register_module("qkv", torch::nn::Linear(dim, 3 * dim))),
        proj(register_module("proj", torch::nn::Linear(dim, dim))),
        ln2(register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        fc1(register_module("fc1", torch::nn::Linear(dim, mlpRatio * dim))),
        fc2(register_module("fc2", torch::nn::Linear(mlpRatio * dim, dim))),
        drop(register_module("drop", torch::nn::Dropout(dropout))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    const int64_t batch = x.size(0), time = x.size(1), dim = x.size(2);
    const int64_t headDim = dim / heads_;
    auto parts = qkv(ln1(x)).view({batch, time, 3, heads_, headDim}).permute({2, 0, 3, 1, 4});
    torch::Tensor q = parts[0], k = parts[1], v = parts[2];
    torch::Tensor scores = torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(headDim));
    torch::Tensor future = torch::ones({time, time}, torch::TensorOptions().dtype(torch::kBool).device(x.device()))
                               .triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
    torch::Tensor attention = drop(torch::softmax(scores, -1));
    torch::Tensor mixed = torch::matmul(attention, v).transpose(1, 2).reshape({batch, time, dim});
    torch::Tensor h = x + drop(proj(mixed));
    return h + drop(fc2(torch::nn::functional::gelu(fc1(ln2(h)))));
  }

 private:
  int64_t heads_;
  torch::nn::LayerNorm ln1;
  torch::nn::Linear qkv, proj;
  torch::nn::LayerNorm ln2;
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
};
TORCH_MODULE(TransformerBlock);

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
    num_batches_tracked = register_buffer("num_batches_tracked", torch::zeros({}, torch::kLong));
  }

  void setMicroBatches(int microBatches) { microBatches_ = microBatches; }

  torch::Tensor forward(const torch::Tensor& x) {
    if (!is_training()) {
      return torch::batch_norm(x, weight, bias, running_mean, running_var, false, 0.0, eps_, true);
    }
    if (!isRecomputing()) accumulate(x);
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
    if (++seen_ < microBatches_) return;
    const torch::Tensor mean = sum_ / count_;
    const torch::Tensor variance = (squares_ / count_ - mean * mean) * (count_ / std::max<double>(count_ - 1, 1));
    running_mean.mul_(1 - momentum_).add_(mean.to(running_mean.dtype()) * momentum_);
    running_var.mul_(1 - momentum_).add_(variance.to(running_var.dtype()) * momentum_);
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

struct Built {
  torch::nn::AnyModule module;
  Shape output;
};

std::vector<int64_t> pair(const nlohmann::json& value) {
  return {value[0].get<int64_t>(), value[1].get<int64_t>()};
}

class LayerBuilder {
 public:
  LayerBuilder(const LayerSpec& spec, size_t index, const Shape& input, bool integer)
      : spec_(spec), input_(input), integer_(integer),
        where_("model.layers[" + std::to_string(index) + "] (" + spec.type + ")") {}

  Built build() {
    const auto& p = spec_.params;
    const std::string& type = spec_.type;
    if (type == "embedding") {
      require(integer_, "expects integer token ids, got a float input of shape " + shapeText(input_));
      Shape out = input_;
      out.push_back(p["embedding_dim"].get<int64_t>());
      return {torch::nn::AnyModule(torch::nn::Embedding(p["num_embeddings"].get<int64_t>(),
                                                        p["embedding_dim"].get<int64_t>())),
              out};
    }
    require(!integer_, "expects a float input, got integer token ids of shape " + shapeText(input_) +
                           " (put an embedding first)");
    if (type == "linear") {
      const int64_t in = input_.back();
      Shape out = input_;
      out.back() = p["out_features"].get<int64_t>();
      return {torch::nn::AnyModule(torch::nn::Linear(
                  torch::nn::LinearOptions(in, out.back()).bias(p["bias"].get<bool>()))),
              out};
    }
    if (type == "conv2d") {
      requireImage();
      const auto kernel = pair(p["kernel_size"]), stride = pair(p["stride"]), padding = pair(p["padding"]);
      const int64_t channels = p["out_channels"].get<int64_t>();
      Shape out = {channels, window(input_[1], kernel[0], stride[0], padding[0]),
                   window(input_[2], kernel[1], stride[1], padding[1])};
      return {torch::nn::AnyModule(torch::nn::Conv2d(
                  torch::nn::Conv2dOptions(input_[0], channels, {kernel[0], kernel[1]})
                      .stride({stride[0], stride[1]})
                      .padding({padding[0], padding[1]})
                      .bias(p["bias"].get<bool>()))),
              out};
    }
    if (type == "maxpool2d" || type == "avgpool2d") {
      requireImage();
      const auto kernel = pair(p["kernel_size"]), stride = pair(p["stride"]), padding = pair(p["padding"]);
      require(padding[0] * 2 <= kernel[0] && padding[1] * 2 <= kernel[1],
              "padding must be at most half the kernel size");
      Shape out = {input_[0], window(input_[1], kernel[0], stride[0], padding[0]),
                   window(input_[2], kernel[1], stride[1], padding[1])};
      if (type == "maxpool2d") {
        return {torch::nn::AnyModule(torch::nn::MaxPool2d(
                    torch::nn::MaxPool2dOptions({kernel[0], kernel[1]})
                        .stride({stride[0], stride[1]})
                        .padding({padding[0], padding[1]}))),
                out};
      }
      return {torch::nn::AnyModule(torch::nn::AvgPool2d(
                  torch::nn::AvgPool2dOptions({kernel[0], kernel[1]})
                      .stride({stride[0], stride[1]})
                      .padding({padding[0], padding[1]}))),
              out};
    }
    if (type == "flatten") {
      int64_t size = 1;
      for (int64_t d : input_) size *= d;
      return {torch::nn::AnyModule(torch::nn::Flatten()), {size}};
    }
    if (type == "relu") return {torch::nn::AnyModule(torch::nn::ReLU()), input_};
    if (type == "gelu") return {torch::nn::AnyModule(torch::nn::GELU()), input_};
    if (type == "tanh") return {torch::nn::AnyModule(torch::nn::Tanh()), input_};
    if (type == "sigmoid") return {torch::nn::AnyModule(torch::nn::Sigmoid()), input_};
    if (type == "dropout") {
      return {torch::nn::AnyModule(torch::nn::Dropout(p["p"].get<double>())), input_};
    }
    if (type == "layernorm") {
      return {torch::nn::AnyModule(torch::nn::LayerNorm(
                  torch::nn::LayerNormOptions({input_.back()}).eps(p["eps"].get<double>()))),
              input_};
    }
    if (type == "batchnorm2d") {
      requireImage();
      return {torch::nn::AnyModule(DeferredBatchNorm2d(input_[0], p["eps"].get<double>(),
                                                       p["momentum"].get<double>())),
              input_};
    }
    if (type == "transformer_block") {
      require(input_.size() == 2, "expects [seq_len, dim] per sample, got " + shapeText(input_));
      const int64_t heads = p["heads"].get<int64_t>();
      require(input_[1] % heads == 0, "dim " + std::to_string(input_[1]) +
                                          " is not divisible by heads " + std::to_string(heads));
      return {torch::nn::AnyModule(TransformerBlock(input_[1], heads, p["mlp_ratio"].get<int64_t>(),
                                                    p["dropout"].get<double>())),
              input_};
    }
    fail("unknown layer type");
  }

 private:
  [[noreturn]] void fail(const std::string& what) const { throw ConfigError(where_ + ": " + what); }
  void require(bool ok, const std::string& what) const {
    if (!ok) fail(what);
  }
  void requireImage() const {
    require(input_.size() == 3, "expects [channels, height, width] per sample, got " + shapeText(input_));
  }
  int64_t window(int64_t size, int64_t kernel, int64_t stride, int64_t padding) const {
    const int64_t out = (size + 2 * padding - kernel) / stride + 1;
    require(size + 2 * padding >= kernel && out >= 1,
            "kernel " + std::to_string(kernel) + " does not fit an input of shape " + shapeText(input_) +
                " with padding " + std::to_string(padding));
    return out;
  }

  const LayerSpec& spec_;
  const Shape& input_;
  bool integer_;
  std::string where_;
};

}  // namespace

BuiltModel buildModel(const ModelConfig& model, uint64_t seed) {
  torch::manual_seed(seed);
  BuiltModel built;
  built.shapes.push_back(model.inputShape);
  built.integerInput = !model.layers.empty() && model.layers.front().type == "embedding";
  bool integer = built.integerInput;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    Built layer = LayerBuilder(model.layers[i], i, built.shapes.back(), integer).build();
    integer = false;
    for (const auto& parameter : layer.module.ptr()->parameters()) {
      built.parameterCount += parameter.numel();
    }
    built.layers.push_back({std::to_string(i), std::move(layer.module)});
    built.shapes.push_back(std::move(layer.output));
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

}  // namespace tpipe
