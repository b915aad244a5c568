// A layer's parameter-owning parts, reported as they run, for a split
// backward. While the executor records a forward (a sink is set on this
// thread), a layer that knows its parts (the registry's transformer block)
// reports each part it applies, with the part's input and output. The
// weight pass then computes a Linear, Conv2d or LayerNorm part's gradients
// from those two tensors (a Linear's in two products, as Megatron's delayed
// weight-gradient pass does) and walks only another part's own node,
// instead of the layer's whole graph a second time.
#pragma once

#include <vector>

#include <ATen/core/Tensor.h>

namespace torch {
namespace nn {
class Module;
} // namespace nn
} // namespace torch

namespace tpipe {

struct PartUse {
  torch::nn::Module* part = nullptr;
  at::Tensor input, output;
};

// This thread's sink; null while nothing records.
std::vector<PartUse>*& partSink();

// Reports `part` applied to `input`, giving `output`; returns `output`.
inline at::Tensor reportPart(
    torch::nn::Module& part,
    const at::Tensor& input,
    at::Tensor output) {
  if (std::vector<PartUse>* sink = partSink())
    sink->push_back({&part, input, output});
  return output;
}

} // namespace tpipe
