#include "tpipe/torchscript.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/module.h>
#include <torch/types.h>
#include <torch/utils.h>

#include "model/layer_types.h"
#include "tpipe/errors.h"
#include "tpipe/model.h"

namespace tpipe {
namespace {

// Registers a scripted module's own tensors on `holder` under their names,
// and its children as holders of theirs: named_parameters() then names
// every tensor as PyTorch does, and they are the scripted module's tensors.
void mirrorTensors(torch::nn::Module& holder, const torch::jit::Module& from);

class ScriptedTensorsImpl : public torch::nn::Module {
 public:
  explicit ScriptedTensorsImpl(const torch::jit::Module& from) {
    mirrorTensors(*this, from);
  }
};
TORCH_MODULE(ScriptedTensors);

void mirrorTensors(torch::nn::Module& holder, const torch::jit::Module& from) {
  for (const auto& parameter : from.named_parameters(/*recurse=*/false)) {
    holder.register_parameter(
        parameter.name, parameter.value, parameter.value.requires_grad());
  }
  for (const auto& buffer : from.named_buffers(/*recurse=*/false))
    holder.register_buffer(buffer.name, buffer.value);
  for (const auto& child : from.named_children())
    holder.register_module(child.name, ScriptedTensors(child.value));
}

// One top-level child of a scripted model as a layer.
class ScriptedLayerImpl : public torch::nn::Module {
 public:
  explicit ScriptedLayerImpl(torch::jit::Module module)
      : module_(std::move(module)) {
    mirrorTensors(*this, module_);
  }
  torch::Tensor forward(const torch::Tensor& input) {
    return module_.forward({input}).toTensor();
  }
  void train(bool on = true) override {
    torch::nn::Module::train(on);
    module_.train(on);
  }
  // A copy with tensors of its own (dualpipe's second chain): the scripted
  // module deep-copied, its tensors mirrored anew.
  std::shared_ptr<torch::nn::Module> clone(
      const c10::optional<torch::Device>& device =
          c10::nullopt) const override {
    torch::jit::Module copied;
    {
      // Copied as leaves, then marked trainable as the originals are.
      torch::NoGradGuard noGrad;
      copied = module_.deepcopy();
    }
    std::vector<at::Tensor> originals;
    for (const auto& parameter : module_.named_parameters())
      originals.push_back(parameter.value);
    size_t i = 0;
    for (const auto& parameter : copied.named_parameters())
      parameter.value.requires_grad_(originals.at(i++).requires_grad());
    auto copy = std::make_shared<ScriptedLayerImpl>(std::move(copied));
    copy->train(is_training());
    if (device)
      copy->to(*device);
    return copy;
  }

 private:
  torch::jit::Module module_;
};
TORCH_MODULE(ScriptedLayer);

} // namespace

LayerList layersOf(const torch::jit::Module& module) {
  LayerList layers;
  for (const auto& child : module.named_children()) {
    layers.push_back(
        {child.name, torch::nn::AnyModule(ScriptedLayer(child.value))});
  }
  if (layers.empty()) {
    throw UserError(
        "the scripted model has no children to pipeline (script an "
        "nn.Sequential, or a module whose children run in order)");
  }
  return layers;
}

namespace {

torch::jit::Module loadScriptedModule(const std::string& path) {
  torch::jit::Module module;
  try {
    module = torch::jit::load(path);
  } catch (const c10::Error& error) {
    std::string reason = error.what_without_backtrace();
    reason = reason.substr(0, reason.find('\n'));
    throw UserError(
        path + ": not a TorchScript model torch::jit::load can read (" +
        reason + ")");
  }
  return module;
}

} // namespace

LayerList loadTorchScript(const std::string& path) {
  return layersOf(loadScriptedModule(path));
}

namespace {

// TorchScript's errors end with the Python-style line that says what
// went wrong, after the interpreter's traceback.
std::string lastLine(std::string text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' '))
    text.pop_back();
  const auto newline = text.rfind('\n');
  return newline == std::string::npos ? text : text.substr(newline + 1);
}

// A batch of two seeded random samples (token ids below the vocabulary):
// distinct values, so a forward that is not the chain of children shows.
torch::Tensor sampleInput(const BuiltModel& built) {
  std::vector<int64_t> sizes{2};
  sizes.insert(sizes.end(), built.shapes[0].begin(), built.shapes[0].end());
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(20241);
  if (built.integerInput) {
    return at::randint(
        std::max<int64_t>(1, built.inputVocabulary),
        sizes,
        generator,
        at::kLong);
  }
  return at::randn(sizes, generator, at::kFloat);
}

// Each layer's per-sample output shape, from the sample through the layers
// in eval mode (no dropout drawn, no statistics updated); returns the last
// layer's output.
torch::Tensor inferShapes(BuiltModel& built, const torch::Tensor& sample) {
  torch::Tensor x = sample;
  torch::NoGradGuard noGrad;
  for (size_t l = 0; l < built.layers.size(); ++l) {
    auto& module = *built.layers[l].module.ptr();
    module.eval();
    try {
      x = built.layers[l].module.forward(x);
    } catch (const std::exception& error) {
      throw ConfigError(
          "model.torchscript: layer " + built.layers[l].name +
          " fails on an input of " + c10::str(x.sizes()) +
          " (check model.input_shape): " + lastLine(error.what()));
    }
    module.train();
    built.shapes.emplace_back(x.sizes().begin() + 1, x.sizes().end());
  }
  return x;
}

// tpipe pipelines the chain of children; a module whose own forward does
// something else (a child used twice, a residual outside the children)
// would silently train another model. Both run on the sample in eval mode.
void checkForwardIsChain(
    torch::jit::Module& module,
    const torch::Tensor& sample,
    const torch::Tensor& chain) {
  torch::NoGradGuard noGrad;
  module.eval();
  torch::Tensor whole;
  std::string failure;
  try {
    whole = module.forward({sample}).toTensor();
  } catch (const std::exception& error) {
    failure = lastLine(error.what());
  }
  module.train();
  if (!failure.empty()) {
    throw ConfigError(
        "model.torchscript: the model's own forward fails on the sample "
        "its children accept (" +
        failure + ")");
  }
  if (whole.sizes() != chain.sizes()) {
    throw ConfigError(
        "model.torchscript: the model's forward is not its children in "
        "order: forward returns shape " +
        c10::str(whole.sizes()) + ", the chain of children " +
        c10::str(chain.sizes()) +
        " (tpipe pipelines the children in order: script an nn.Sequential)");
  }
  const double gap = (whole.to(at::kDouble) - chain.to(at::kDouble))
                         .abs()
                         .max()
                         .item<double>();
  const double scale =
      std::max(1.0, whole.to(at::kDouble).abs().max().item<double>());
  if (!(gap <= 1e-4 * scale)) {
    throw ConfigError(
        "model.torchscript: the model's forward is not its children in "
        "order: on a sample input its output differs from the chain of "
        "children by up to " +
        std::to_string(gap) +
        " (tpipe pipelines the children in order: script an nn.Sequential, "
        "or a module whose forward calls its children one after another)");
  }
}

} // namespace

BuiltModel buildScriptedModel(const ModelConfig& model) {
  BuiltModel built;
  torch::jit::Module module;
  try {
    module = loadScriptedModule(model.torchscript);
    built.layers = layersOf(module);
  } catch (const UserError& error) {
    throw ConfigError(std::string("model.torchscript: ") + error.what());
  }
  if (model.inputShape.empty())
    throw ConfigError("model.input_shape: missing (required with torchscript)");
  built.shapes.push_back(model.inputShape);
  built.integerInput = model.tokenInput;
  for (const auto& layer : built.layers) {
    for (const auto& parameter : layer.module.ptr()->parameters())
      built.parameterCount += parameter.numel();
  }
  if (built.integerInput) {
    auto* weight =
        built.layers.front().module.ptr()->named_parameters().find("weight");
    if (weight == nullptr) {
      throw ConfigError(
          "model.torchscript: token ids need an embedding first; layer " +
          built.layers.front().name + " has no weight");
    }
    built.inputVocabulary = weight->size(0);
  }
  const torch::Tensor sample = sampleInput(built);
  checkForwardIsChain(module, sample, inferShapes(built, sample));
  return built;
}

} // namespace tpipe
