// The layer list run plainly (runLayer, runSequential, the skips
// checked) and described without running (names, parameter counts, costs).
#include "layers/skips.h"
#include "layers/parts.h"
#include "layers/random.h"

#include <algorithm>

#include <ATen/Context.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/dropout.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/Exception.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>

namespace tpipe {

void SkipStore::put(const std::string& name, at::Tensor tensor) {
  items_.emplace_back(name, std::move(tensor));
}

at::Tensor SkipStore::take(const std::string& name, const std::string& layer) {
  auto found =
      std::find_if(items_.begin(), items_.end(), [&](const auto& item) {
        return item.first == name;
      });
  TORCH_CHECK(
      found != items_.end(),
      "layer '",
      layer,
      "' pops '",
      name,
      "', which no earlier layer stashed");
  at::Tensor tensor = std::move(found->second);
  items_.erase(found);
  return tensor;
}

const at::Tensor& SkipStore::at(const std::string& name) const {
  auto found =
      std::find_if(items_.begin(), items_.end(), [&](const auto& item) {
        return item.first == name;
      });
  TORCH_INTERNAL_ASSERT(found != items_.end(), "no skip named ", name);
  return found->second;
}

namespace {

at::Tensor merged(
    const NamedLayer& layer,
    const at::Tensor& output,
    const at::Tensor& skip,
    const std::string& name) {
  const bool concat = layer.merge == SkipMerge::kConcat;
  const bool fits = concat ? output.dim() >= 2 && output.dim() == skip.dim() &&
          output.sizes().slice(2) == skip.sizes().slice(2) &&
          output.size(0) == skip.size(0)
                           : output.sizes() == skip.sizes();
  TORCH_CHECK(
      fits,
      "layer '",
      layer.name,
      "' cannot ",
      concat ? "concatenate" : "add",
      " the skip '",
      name,
      "' of shape ",
      skip.sizes(),
      " to its output of shape ",
      output.sizes(),
      concat ? " (all sizes but dim 1 must agree)" : " (shapes must agree)");
  return concat ? at::cat({output, skip}, 1) : output + skip;
}

// The layer's module as LibTorch's plain Dropout, not in place; null for
// any other module (runsAsStageDropout).
const torch::nn::DropoutImpl* plainDropout(const torch::nn::Module& module) {
  const auto* dropout = module.as<torch::nn::DropoutImpl>();
  return dropout && !dropout->options.inplace() ? dropout : nullptr;
}

} // namespace

at::Tensor runLayer(
    const NamedLayer& layer,
    const at::Tensor& x,
    SkipStore& live) {
  // AnyModule::forward is not const, though it changes only the module.
  auto& module = const_cast<torch::nn::AnyModule&>(layer.module);
  at::Tensor y;
  if (layer.merge == SkipMerge::kArgument && !layer.pop.empty()) {
    y = module.forward(x, live.take(layer.pop.front(), layer.name));
  } else {
    const torch::nn::DropoutImpl* dropout = plainDropout(*module.ptr());
    y = dropout ? stageDropout(x, dropout->options.p(), dropout->is_training())
                : module.forward(x);
    for (const auto& name : layer.pop)
      y = merged(layer, y, live.take(name, layer.name), name);
  }
  for (const auto& name : layer.stash)
    live.put(name, y);
  return y;
}

std::vector<LayerSkips> skipsOf(const LayerList& layers) {
  std::vector<LayerSkips> skips;
  for (const auto& layer : layers) {
    skips.push_back(
        {layer.stash, layer.pop, layer.merge == SkipMerge::kArgument});
  }
  return skips;
}

bool hasSkips(const LayerList& layers) {
  return std::any_of(layers.begin(), layers.end(), [](const auto& layer) {
    return !layer.stash.empty() || !layer.pop.empty();
  });
}

void checkSkips(const LayerList& layers) {
  if (const auto problem = findSkipProblem(skipsOf(layers))) {
    TORCH_CHECK(
        false, "layer '", layers[problem->layer].name, "': ", problem->what);
  }
}

torch::Tensor runSequential(const LayerList& layers, const torch::Tensor& x) {
  checkSkips(layers);
  SkipStore live;
  at::Tensor y = x;
  for (const auto& layer : layers)
    y = runLayer(layer, y, live);
  return y;
}

std::string whyLayersCannotBeCopied(const LayerList& layers) {
  // A copy is built anew, and its reset() draws initial values: the global
  // generator is put back, so what is drawn later does not depend on this.
  at::Generator global = at::globalContext().defaultGenerator(at::kCPU);
  const at::Tensor drawnSoFar = global.get_state();
  struct Restore {
    at::Generator& generator;
    const at::Tensor& state;
    ~Restore() {
      generator.set_state(state);
    }
  } restore{global, drawnSoFar};
  for (const auto& layer : layers) {
    for (const auto& buffer : layer.module.ptr()->named_buffers()) {
      if (buffer.key().find("running_") != std::string::npos ||
          buffer.key().find("num_batches_tracked") != std::string::npos) {
        return "layer '" + layer.name + "' keeps running statistics ('" +
            buffer.key() + "') that the copies would update apart";
      }
    }
    try {
      layer.module.clone();
    } catch (const c10::Error&) {
      return "layer '" + layer.name + "' (" + layer.module.ptr()->name() +
          ") cannot be copied: its module does not implement clone() (derive "
          "it from torch::nn::Cloneable)";
    }
  }
  return "";
}

LayerList layersOf(const torch::nn::Sequential& sequential) {
  LayerList layers;
  size_t index = 0;
  for (const auto& module : *sequential) {
    layers.push_back({std::to_string(index++), module});
  }
  return layers;
}

std::vector<LayerCost> parameterCosts(const LayerList& layers) {
  std::vector<LayerCost> costs;
  for (const auto& layer : layers) {
    LayerCost cost;
    cost.name = layer.name;
    for (const auto& parameter : layer.module.ptr()->parameters()) {
      cost.paramBytes += static_cast<int64_t>(parameter.nbytes());
    }
    cost.weightGradientInPlace = addsWeightGradientInPlace(layer);
    costs.push_back(cost);
  }
  return costs;
}

bool addsWeightGradientInPlace(const NamedLayer& layer) {
  return layer.pop.empty() &&
      layer.module.ptr()->as<torch::nn::LinearImpl>() != nullptr;
}

std::vector<int64_t> parameterCounts(const LayerList& layers) {
  std::vector<int64_t> counts;
  for (const auto& layer : layers) {
    int64_t count = 0;
    for (const auto& parameter : layer.module.ptr()->parameters())
      count += parameter.numel();
    counts.push_back(count);
  }
  return counts;
}

std::vector<PartUse>*& partSink() {
  thread_local std::vector<PartUse>* sink = nullptr;
  return sink;
}

c10::optional<at::Generator>& stageGeneratorSlot() {
  thread_local c10::optional<at::Generator> generator;
  return generator;
}

c10::optional<at::Generator> stageGenerator() {
  return stageGeneratorSlot();
}

bool runsAsStageDropout(const torch::nn::Module& layerModule) {
  return plainDropout(layerModule) != nullptr;
}

at::Tensor stageDropout(const at::Tensor& x, double p, bool training) {
  TORCH_CHECK(
      p >= 0 && p <= 1, "dropout probability must be in [0, 1], got ", p);
  const c10::optional<at::Generator>& generator = stageGeneratorSlot();
  if (!training || p == 0 || x.numel() == 0 || !generator)
    return at::dropout(x, p, training);
  at::Tensor keep = at::empty_like(x).bernoulli_(1 - p, *generator);
  return p == 1 ? x * keep : x * keep.div_(1 - p);
}

} // namespace tpipe
