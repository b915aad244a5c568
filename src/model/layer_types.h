// The one table of layer types: for each, its config keys (kind and
// default), the shape rule, and the builder. Config validation
// (src/config/config.cpp) and the model builder (layers.cpp) both read it;
// a new layer type is one entry in layers.cpp.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tpipe {

// How a config value is checked.
enum class ParamKind {
  kPositive,
  kNonNegative,
  kSize2,
  kSize2NonNegative,
  kBool,
  kProbability,
  kPositiveNumber
};

struct ParamRule {
  const char* key;
  ParamKind kind;
  nlohmann::json fallback; // null: required (a pool's stride: the kernel size)
};

// What a builder gets: the checked parameters and the input shape of one
// sample; it fails through fail(), naming the layer.
struct LayerInput {
  const nlohmann::json& params;
  const std::vector<int64_t>& shape;
  bool integer;      // token ids (only an embedding takes them)
  std::string where; // "model.layers[4] (linear)"
  [[noreturn]] void fail(const std::string& what) const;
  void require(bool ok, const std::string& what) const;
};

// What a layer is, known from its parameters and input shape alone (no
// module built): the output shape, and the counts that size and time it
// where it cannot be measured (`tpipe tune --cluster`). Per sample; FLOPs
// count a multiply-add as two.
struct LayerFacts {
  std::vector<int64_t> output;
  int64_t parameters = 0;     // elements
  double forwardFlops = 0.0;  // the backward is about twice this
  double savedElements = 0.0; // kept by the forward for the backward
  // Elements the forward's memory-bound operations read and write beyond
  // the layer's input and output (norms, softmax, dropout, activations
  // inside a block); the backward moves about twice as many. The cluster
  // model's roofline adds their time to the matrix products'.
  double movedElements = 0.0;
  // Of the moved and saved elements, those of attention scores: an
  // attention that keeps its scores on chip (FlashAttention) neither writes
  // nor keeps them.
  double attentionMovedElements = 0.0;
  double attentionSavedElements = 0.0;
  // The skips alive after the layer (mergeSkipShapes): a stage ending here
  // sends them along with the output.
  double skipElements = 0.0;
};
using LayerFactsFn = LayerFacts (*)(const LayerInput& input);

struct BuiltLayer; // a module (layers.cpp)
using LayerBuildFn =
    BuiltLayer (*)(const LayerInput& input, const LayerFacts& facts);

struct LayerType {
  const char* name;
  std::vector<ParamRule> params;
  const char* shapeRule; // "[..., in] -> [..., out_features]"
  LayerFactsFn facts;    // checks the input shape, fails naming the layer
  LayerBuildFn build;
};

const std::vector<LayerType>& layerTypes();
const LayerType* findLayerType(const std::string& name);

struct LayerSpec;
struct ModelConfig;

// One layer's facts at an input shape, with the token-id checks; throws
// ConfigError naming the layer ("model.layers[4] (linear): ...").
LayerFacts layerFacts(
    const LayerSpec& spec,
    size_t index,
    const std::vector<int64_t>& shape,
    bool integer);
// The skips alive between two layers: per name, one sample's shape.
using SkipShapes = std::map<std::string, std::vector<int64_t>>;
// A layer's pops merged into its facts' output shape ("add": equal shapes;
// "concat": along the first per-sample dimension), then its stashes kept;
// throws ConfigError naming the layer.
void mergeSkipShapes(
    const LayerSpec& spec,
    size_t index,
    LayerFacts& facts,
    SkipShapes& live);
// Every layer's facts, in order: shape inference without building anything.
std::vector<LayerFacts> modelFacts(const ModelConfig& model);

// The facts functions of the table (layer_facts.cpp, no LibTorch).
namespace facts {
LayerFacts linear(const LayerInput& in);
LayerFacts conv2d(const LayerInput& in);
LayerFacts pool2d(const LayerInput& in);
LayerFacts flatten(const LayerInput& in);
LayerFacts elementwise(const LayerInput& in);
LayerFacts dropout(const LayerInput& in);
LayerFacts layernorm(const LayerInput& in);
LayerFacts positionEmbedding(const LayerInput& in);
LayerFacts batchnorm2d(const LayerInput& in);
LayerFacts embedding(const LayerInput& in);
LayerFacts transformerBlock(const LayerInput& in);
std::string shapeText(const std::vector<int64_t>& shape);
// A kSize2 parameter's two values (kernel, stride, padding).
std::vector<int64_t> sizePair(const nlohmann::json& value);
} // namespace facts

struct BuiltModel;
// model.torchscript's children as the layers, shapes from running a sample
// (torchscript.cpp); throws ConfigError naming the file or the layer.
BuiltModel buildScriptedModel(const ModelConfig& model);

} // namespace tpipe
