// Skip connections as names (torchgpipe's stash and pop), without LibTorch:
// which names are well formed, and which cross a cut between two layers.
// The JSON checks (config.cpp) and the pipeline (skips.cpp) both ask here.
#pragma once

#include <algorithm>
#include <cstddef>
#include <optional>
#include <string>
#include <vector>

namespace tpipe {

struct LayerSkips {
  std::vector<std::string> stash, pop;
  bool argument = false; // the popped tensor is the forward's 2nd argument
};

struct SkipProblem {
  size_t layer;     // the offending layer's index
  std::string what; // "'s1' is popped before any layer stashes it"
};

// Each name stashed once, popped once by a later layer, nothing left
// unpopped, and an argument merge pops exactly one name.
inline std::optional<SkipProblem> findSkipProblem(
    const std::vector<LayerSkips>& layers) {
  std::vector<std::string> live, ever;
  for (size_t l = 0; l < layers.size(); ++l) {
    const LayerSkips& layer = layers[l];
    if (layer.argument && layer.pop.size() != 1) {
      return SkipProblem{l, "an argument merge takes exactly one popped name"};
    }
    for (const auto& name : layer.pop) {
      auto found = std::find(live.begin(), live.end(), name);
      if (found == live.end()) {
        const bool popped =
            std::find(ever.begin(), ever.end(), name) != ever.end();
        return SkipProblem{
            l,
            "'" + name + "' is " +
                (popped ? "popped twice (each stash is popped once)"
                        : "popped before any layer stashes it")};
      }
      live.erase(found);
    }
    for (const auto& name : layer.stash) {
      if (name.empty())
        return SkipProblem{l, "a stash name is empty"};
      if (std::find(ever.begin(), ever.end(), name) != ever.end())
        return SkipProblem{l, "'" + name + "' is stashed twice"};
      live.push_back(name);
      ever.push_back(name);
    }
  }
  if (!live.empty()) {
    for (size_t l = layers.size(); l-- > 0;) {
      const auto& stash = layers[l].stash;
      if (std::find(stash.begin(), stash.end(), live.front()) != stash.end()) {
        return SkipProblem{
            l, "'" + live.front() + "' is stashed but no later layer pops it"};
      }
    }
  }
  return std::nullopt;
}

// The names stashed before layer `cut` and popped at or after it, in the
// order they were stashed: what travels with the activation into layer
// `cut` (a stage boundary when `cut` is a stage's first layer).
inline std::vector<std::string> skipsAcross(
    const std::vector<LayerSkips>& layers,
    size_t cut) {
  std::vector<std::string> live;
  for (size_t l = 0; l < cut && l < layers.size(); ++l) {
    for (const auto& name : layers[l].pop)
      live.erase(std::remove(live.begin(), live.end(), name), live.end());
    for (const auto& name : layers[l].stash)
      live.push_back(name);
  }
  return live;
}

} // namespace tpipe
