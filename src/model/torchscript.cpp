#include "tpipe/torchscript.h"

#include <torch/csrc/jit/serialization/import.h>
#include <torch/nn/module.h>

#include "tpipe/errors.h"

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

LayerList loadTorchScript(const std::string& path) {
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
  return layersOf(module);
}

} // namespace tpipe
