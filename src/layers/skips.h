// Running layers with their skip connections (tpipe/layers.h,
// NamedLayer::stash and pop): the executor, the profiler and the
// sequential reference all run a layer through runLayer.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "layers/skip_rules.h"
#include "tpipe/layers.h"

namespace tpipe {

// The stashed tensors alive between two layers, by name, in stash order.
class SkipStore {
 public:
  void put(const std::string& name, at::Tensor tensor);
  // Removes and returns it; throws naming the layer that asked.
  at::Tensor take(const std::string& name, const std::string& layer);
  const at::Tensor& at(const std::string& name) const;
  std::vector<std::pair<std::string, at::Tensor>>& items() {
    return items_;
  }

 private:
  std::vector<std::pair<std::string, at::Tensor>> items_;
};

// The layer's module on x, its pops merged into the output, then the
// output stashed under its names.
at::Tensor runLayer(
    const NamedLayer& layer,
    const at::Tensor& x,
    SkipStore& live);

std::vector<LayerSkips> skipsOf(const LayerList& layers);
// Throws c10::Error naming the layer when findSkipProblem finds one.
void checkSkips(const LayerList& layers);
bool hasSkips(const LayerList& layers);

} // namespace tpipe
