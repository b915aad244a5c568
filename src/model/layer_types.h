// The one table of layer types: for each, its config keys (kind and
// default), the shape rule, and the builder. Config validation
// (src/config/config.cpp) and the model builder (layers.cpp) both read it;
// a new layer type is one entry in layers.cpp.
#pragma once

#include <cstdint>
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

struct BuiltLayer; // a module and its output shape (layers.cpp)
using LayerBuildFn = BuiltLayer (*)(const LayerInput& input);

struct LayerType {
  const char* name;
  std::vector<ParamRule> params;
  const char* shapeRule; // "[..., in] -> [..., out_features]"
  LayerBuildFn build;
};

const std::vector<LayerType>& layerTypes();
const LayerType* findLayerType(const std::string& name);

} // namespace tpipe
