// Partitioning a layer list into contiguous stages.
//
// A partition is `stages + 1` boundaries: stage k runs layers
// [boundaries[k], boundaries[k + 1]). Every function here is pure: costs in,
// boundaries out. Measuring the costs (running layers) lives elsewhere.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace tpipe {

class PartitionError : public std::invalid_argument {
 public:
  using std::invalid_argument::invalid_argument;
};

// Layers per stage as evenly as possible; earlier stages take the remainder.
std::vector<int> uniformBoundaries(int layers, int stages);

// An explicit balance (layers per stage), checked: each >= 1, sum == layers.
std::vector<int> balanceBoundaries(const std::vector<int>& balance, int layers);

// The contiguous split into `stages` parts minimizing the largest part's
// summed weight (exact; ties go to the split whose boundaries come first).
std::vector<int> minMaxBoundaries(const std::vector<double>& weights,
                                  int stages);

// Layers per stage from boundaries: {0, 2, 5} -> {2, 3}.
std::vector<int> balanceOf(const std::vector<int>& boundaries);

}  // namespace tpipe
