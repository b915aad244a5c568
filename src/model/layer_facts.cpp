// What each layer type is from its parameters and input shape alone: output
// shape (with the shape checks), parameters, FLOPs and saved activations.
// Shape inference for building and the analytic costs of `tpipe tune
// --cluster` both come from here, so a model too large to build can still
// be planned.
#include <sstream>

#include "model/layer_types.h"
#include "tpipe/config.h"
#include "tpipe/errors.h"

namespace tpipe {
namespace {

using Shape = std::vector<int64_t>;

double elements(const Shape& shape) {
  double count = 1.0;
  for (int64_t d : shape)
    count *= static_cast<double>(d);
  return count;
}

void requireImage(const LayerInput& in) {
  in.require(
      in.shape.size() == 3,
      "expects [channels, height, width] per sample, got " +
          facts::shapeText(in.shape));
}

int64_t window(
    const LayerInput& in,
    int64_t size,
    int64_t kernel,
    int64_t stride,
    int64_t padding) {
  const int64_t out = (size + 2 * padding - kernel) / stride + 1;
  in.require(
      size + 2 * padding >= kernel && out >= 1,
      "kernel " + std::to_string(kernel) + " does not fit an input of shape " +
          facts::shapeText(in.shape) + " with padding " +
          std::to_string(padding));
  return out;
}

// Output [c, h', w'] of a sliding window with the layer's kernel, stride
// and padding.
Shape windowed(const LayerInput& in, int64_t channels) {
  const auto& p = in.params;
  const auto kernel = facts::sizePair(p["kernel_size"]),
             stride = facts::sizePair(p["stride"]),
             padding = facts::sizePair(p["padding"]);
  return {
      channels,
      window(in, in.shape[1], kernel[0], stride[0], padding[0]),
      window(in, in.shape[2], kernel[1], stride[1], padding[1])};
}

double kernelArea(const LayerInput& in) {
  const auto kernel = facts::sizePair(in.params["kernel_size"]);
  return static_cast<double>(kernel[0] * kernel[1]);
}

} // namespace

namespace facts {

std::vector<int64_t> sizePair(const nlohmann::json& value) {
  return {value[0].get<int64_t>(), value[1].get<int64_t>()};
}

std::string shapeText(const std::vector<int64_t>& shape) {
  std::ostringstream out;
  out << '[';
  for (size_t i = 0; i < shape.size(); ++i)
    out << (i ? ", " : "") << shape[i];
  out << ']';
  return out.str();
}

LayerFacts linear(const LayerInput& in) {
  in.require(!in.shape.empty(), "expects an input of rank >= 1");
  LayerFacts f;
  f.output = in.shape;
  const int64_t inFeatures = in.shape.back();
  const int64_t out = in.params["out_features"].get<int64_t>();
  f.output.back() = out;
  const bool bias = in.params["bias"].get<bool>();
  f.parameters = inFeatures * out + (bias ? out : 0);
  const double rows = elements(in.shape) / static_cast<double>(inFeatures);
  f.forwardFlops = 2.0 * rows * static_cast<double>(inFeatures * out);
  f.savedElements = elements(in.shape);
  return f;
}

LayerFacts conv2d(const LayerInput& in) {
  requireImage(in);
  LayerFacts f;
  f.output = windowed(in, in.params["out_channels"].get<int64_t>());
  const double perOutput = static_cast<double>(in.shape[0]) * kernelArea(in);
  f.parameters = static_cast<int64_t>(perOutput) * f.output[0] +
      (in.params["bias"].get<bool>() ? f.output[0] : 0);
  f.forwardFlops = 2.0 * perOutput * elements(f.output);
  f.savedElements = elements(in.shape);
  return f;
}

LayerFacts pool2d(const LayerInput& in) {
  requireImage(in);
  const auto kernel = facts::sizePair(in.params["kernel_size"]);
  const auto padding = facts::sizePair(in.params["padding"]);
  in.require(
      padding[0] * 2 <= kernel[0] && padding[1] * 2 <= kernel[1],
      "padding must be at most half the kernel size");
  LayerFacts f;
  f.output = windowed(in, in.shape[0]);
  f.forwardFlops = kernelArea(in) * elements(f.output);
  f.savedElements = elements(in.shape) + elements(f.output);
  return f;
}

LayerFacts flatten(const LayerInput& in) {
  LayerFacts f;
  f.output = {static_cast<int64_t>(elements(in.shape))};
  return f;
}

LayerFacts elementwise(const LayerInput& in) {
  LayerFacts f;
  f.output = in.shape;
  f.forwardFlops = elements(in.shape);
  f.savedElements = elements(in.shape);
  return f;
}

LayerFacts dropout(const LayerInput& in) {
  LayerFacts f = elementwise(in);
  f.savedElements = elements(in.shape) / 4; // a byte mask per element
  return f;
}

LayerFacts layernorm(const LayerInput& in) {
  in.require(!in.shape.empty(), "expects an input of rank >= 1");
  LayerFacts f;
  f.output = in.shape;
  f.parameters = 2 * in.shape.back();
  f.forwardFlops = 5.0 * elements(in.shape);
  f.savedElements = elements(in.shape);
  return f;
}

// A learned vector per position of [..., seq, dim], added to it.
LayerFacts positionEmbedding(const LayerInput& in) {
  in.require(
      in.shape.size() >= 2, "expects [..., seq, dim] (after an embedding)");
  LayerFacts f;
  f.output = in.shape;
  f.parameters = in.shape[in.shape.size() - 2] * in.shape.back();
  f.forwardFlops = elements(in.shape);
  return f;
}

LayerFacts batchnorm2d(const LayerInput& in) {
  requireImage(in);
  LayerFacts f = layernorm(in);
  f.parameters = 2 * in.shape[0];
  return f;
}

LayerFacts embedding(const LayerInput& in) {
  const int64_t dim = in.params["embedding_dim"].get<int64_t>();
  LayerFacts f;
  f.output = in.shape;
  f.output.push_back(dim);
  f.parameters = in.params["num_embeddings"].get<int64_t>() * dim;
  f.forwardFlops = elements(f.output);
  f.savedElements = elements(in.shape);
  return f;
}

// Pre-LN GPT block over [s, h] with a heads and MLP ratio r: QKV, scores,
// mix, projection and the MLP are 2 s h^2 (4 + 2r) + 4 s^2 h FLOPs; the
// saved activations follow Korthikanti et al. (2022): about (9 + 2r) s h
// inputs of the matrix products and norms, and the softmax output plus its
// dropout mask, 1.25 a s^2. What runs bound by memory, per token: two norms
// (2h each in and out), the activation over the r h hidden (2 r h), two
// dropout-and-residual adds (3.5h each); and on the a s scores per token:
// written by one product and read by the other (2), softmax in and out (2),
// dropout in, out and its byte mask (2.5).
LayerFacts transformerBlock(const LayerInput& in) {
  in.require(
      in.shape.size() == 2,
      "expects [seq_len, dim] per sample, got " + shapeText(in.shape));
  const int64_t heads = in.params["heads"].get<int64_t>();
  in.require(
      in.shape[1] % heads == 0,
      "dim " + std::to_string(in.shape[1]) + " is not divisible by heads " +
          std::to_string(heads));
  const double s = static_cast<double>(in.shape[0]);
  const double h = static_cast<double>(in.shape[1]);
  const double r = static_cast<double>(in.params["mlp_ratio"].get<int64_t>());
  const int64_t dim = in.shape[1];
  const int64_t ratio = in.params["mlp_ratio"].get<int64_t>();
  LayerFacts f;
  f.output = in.shape;
  f.parameters = (4 + 2 * ratio) * dim * dim + (9 + ratio) * dim;
  f.forwardFlops = 2.0 * s * h * h * (4.0 + 2.0 * r) + 4.0 * s * s * h;
  const double scores = static_cast<double>(heads) * s * s;
  f.attentionSavedElements = 1.25 * scores;
  f.attentionMovedElements = 6.5 * scores;
  f.savedElements = (9.0 + 2.0 * r) * s * h + f.attentionSavedElements;
  f.movedElements = (11.0 + 2.0 * r) * s * h + f.attentionMovedElements;
  return f;
}

} // namespace facts

LayerFacts layerFacts(
    const LayerSpec& spec,
    size_t index,
    const std::vector<int64_t>& shape,
    bool integer) {
  const LayerInput input{
      spec.params,
      shape,
      integer,
      "model.layers[" + std::to_string(index) + "] (" + spec.type + ")"};
  const LayerType* type = findLayerType(spec.type);
  if (type == nullptr)
    input.fail("unknown layer type");
  const bool takesTokens = spec.type == "embedding";
  if (takesTokens) {
    input.require(
        integer,
        "expects integer token ids, got a float input of shape " +
            facts::shapeText(shape));
  } else {
    input.require(
        !integer,
        "expects a float input, got integer token ids of shape " +
            facts::shapeText(shape) + " (put an embedding first)");
  }
  return type->facts(input);
}

void mergeSkipShapes(
    const LayerSpec& spec,
    size_t index,
    LayerFacts& facts,
    SkipShapes& live) {
  const std::string where =
      "model.layers[" + std::to_string(index) + "] (" + spec.type + ")";
  for (const auto& name : spec.pop) {
    auto found = live.find(name);
    if (found == live.end())
      throw ConfigError(where + ": pops '" + name + "', which is not stashed");
    const std::vector<int64_t>& skip = found->second;
    std::vector<int64_t>& out = facts.output;
    const bool concat = spec.merge == "concat";
    const bool fits = concat ? !out.empty() && skip.size() == out.size() &&
            std::equal(out.begin() + 1, out.end(), skip.begin() + 1)
                             : skip == out;
    if (!fits) {
      throw ConfigError(
          where + ": cannot " + (concat ? "concatenate" : "add") +
          " the skip '" + name + "' of shape " + facts::shapeText(skip) +
          " to its output of shape " + facts::shapeText(out) +
          (concat ? " (all sizes but the first, the channels, must agree)"
                  : " (shapes must agree)"));
    }
    if (concat)
      out.front() += skip.front();
    live.erase(found);
  }
  for (const auto& name : spec.stash)
    live[name] = facts.output;
  for (const auto& [name, shape] : live)
    facts.skipElements += elements(shape);
}

std::vector<LayerFacts> modelFacts(const ModelConfig& model) {
  std::vector<LayerFacts> all;
  std::vector<int64_t> shape = model.inputShape;
  bool integer =
      !model.layers.empty() && model.layers.front().type == "embedding";
  SkipShapes skips;
  for (size_t i = 0; i < model.layers.size(); ++i) {
    all.push_back(layerFacts(model.layers[i], i, shape, integer));
    mergeSkipShapes(model.layers[i], i, all.back(), skips);
    shape = all.back().output;
    integer = false;
  }
  return all;
}

void LayerInput::fail(const std::string& what) const {
  throw ConfigError(where + ": " + what);
}

void LayerInput::require(bool ok, const std::string& what) const {
  if (!ok)
    fail(what);
}

} // namespace tpipe
