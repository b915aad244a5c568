// A layer list with skips of every kind across stages, shared by the CPU
// and GPU transparency tests.
#pragma once

#include <string>
#include <vector>

#include <torch/torch.h>

#include "tpipe/pipeline.h"

namespace tpipe {
namespace testing {

// A layer whose forward takes the popped skip as its second argument: an
// activation gated by an earlier one (the shape of "hidden state plus
// mask"). Cloneable, so dualpipe can copy it.
struct GateImpl : torch::nn::Cloneable<GateImpl> {
  void reset() override {}
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& gate) {
    return x * torch::sigmoid(gate);
  }
};
TORCH_MODULE(Gate);

// 6 features in, 3 classes out. "a" jumps from the first layer to the last
// (passing through every stage between), "b" is a short residual, "c" an
// argument, "d" is stashed by the layer that pops "b".
inline LayerList skipNet(
    uint64_t seed,
    torch::Dtype dtype,
    torch::Device device = torch::kCPU) {
  torch::manual_seed(seed);
  LayerList layers;
  auto add = [&](torch::nn::AnyModule module,
                 std::vector<std::string> stash,
                 std::vector<std::string> pop,
                 SkipMerge merge = SkipMerge::kAdd) {
    module.ptr()->to(device, dtype);
    layers.push_back(
        {std::to_string(layers.size()),
         std::move(module),
         Randomness::kNone,
         std::move(stash),
         std::move(pop),
         merge});
  };
  add(torch::nn::AnyModule(torch::nn::Linear(6, 8)), {"a"}, {});
  add(torch::nn::AnyModule(torch::nn::Tanh()), {"c"}, {});
  add(torch::nn::AnyModule(torch::nn::Linear(8, 8)), {"b"}, {});
  add(torch::nn::AnyModule(torch::nn::GELU()), {}, {});
  add(torch::nn::AnyModule(torch::nn::Linear(8, 8)), {"d"}, {"b"});
  add(torch::nn::AnyModule(Gate()), {}, {"c"}, SkipMerge::kArgument);
  add(torch::nn::AnyModule(torch::nn::Linear(8, 8)), {}, {"d"});
  add(torch::nn::AnyModule(torch::nn::Sigmoid()),
      {},
      {"a"},
      SkipMerge::kConcat);
  add(torch::nn::AnyModule(torch::nn::Linear(16, 3)), {}, {});
  return layers;
}

inline std::vector<torch::Tensor> parametersOf(const LayerList& layers) {
  std::vector<torch::Tensor> parameters;
  for (const auto& layer : layers) {
    for (const auto& parameter : layer.module.ptr()->parameters())
      parameters.push_back(parameter);
  }
  return parameters;
}

} // namespace testing
} // namespace tpipe
