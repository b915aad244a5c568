#include <algorithm>
#include <limits>
#include <numeric>

#include "tpipe/partition.h"

namespace tpipe {
namespace {

void requireSplittable(int layers, int stages) {
  if (stages < 1) {
    throw PartitionError("stages must be >= 1, got " + std::to_string(stages));
  }
  if (layers < stages) {
    throw PartitionError("cannot split " + std::to_string(layers) +
                         " layers into " + std::to_string(stages) +
                         " stages: every stage needs at least one layer");
  }
}

}  // namespace

std::vector<int> uniformBoundaries(int layers, int stages) {
  requireSplittable(layers, stages);
  std::vector<int> boundaries{0};
  for (int k = 0; k < stages; ++k) {
    const int size = layers / stages + (k < layers % stages ? 1 : 0);
    boundaries.push_back(boundaries.back() + size);
  }
  return boundaries;
}

std::vector<int> balanceBoundaries(const std::vector<int>& balance,
                                   int layers) {
  if (balance.empty()) throw PartitionError("balance is empty");
  std::vector<int> boundaries{0};
  for (size_t k = 0; k < balance.size(); ++k) {
    if (balance[k] < 1) {
      throw PartitionError("balance[" + std::to_string(k) +
                           "]: every stage needs at least one layer, got " +
                           std::to_string(balance[k]));
    }
    boundaries.push_back(boundaries.back() + balance[k]);
  }
  if (boundaries.back() != layers) {
    throw PartitionError("balance sums to " + std::to_string(boundaries.back()) +
                         " layers, but the model has " +
                         std::to_string(layers));
  }
  return boundaries;
}

// Dynamic programming over (stages used, layers covered); O(stages x
// layers^2), ample for the layer counts of a model handed over by hand.
std::vector<int> minMaxBoundaries(const std::vector<double>& weights,
                                  int stages) {
  const int layers = static_cast<int>(weights.size());
  requireSplittable(layers, stages);
  std::vector<double> prefix(layers + 1, 0.0);
  for (int i = 0; i < layers; ++i) prefix[i + 1] = prefix[i] + weights[i];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][j]: smallest bottleneck covering layers [0, j) with k stages.
  std::vector<std::vector<double>> best(stages + 1,
                                        std::vector<double>(layers + 1, inf));
  std::vector<std::vector<int>> cut(stages + 1, std::vector<int>(layers + 1, -1));
  best[0][0] = 0.0;
  for (int k = 1; k <= stages; ++k) {
    for (int j = k; j <= layers - (stages - k); ++j) {
      for (int i = k - 1; i < j; ++i) {
        const double candidate = std::max(best[k - 1][i], prefix[j] - prefix[i]);
        if (candidate < best[k][j]) {
          best[k][j] = candidate;
          cut[k][j] = i;
        }
      }
    }
  }
  std::vector<int> boundaries(stages + 1);
  boundaries[stages] = layers;
  for (int k = stages; k > 0; --k) boundaries[k - 1] = cut[k][boundaries[k]];
  return boundaries;
}

std::vector<int> balanceOf(const std::vector<int>& boundaries) {
  std::vector<int> balance;
  for (size_t k = 1; k < boundaries.size(); ++k) {
    balance.push_back(boundaries[k] - boundaries[k - 1]);
  }
  return balance;
}

}  // namespace tpipe
