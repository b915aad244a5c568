#include <gtest/gtest.h>

#include <algorithm>
#include <random>

#include "tpipe/partition.h"

namespace tpipe {
namespace {

TEST(PartitionTest, UniformPutsTheRemainderFirst) {
  EXPECT_EQ(uniformBoundaries(10, 4), (std::vector<int>{0, 3, 6, 8, 10}));
  EXPECT_EQ(uniformBoundaries(3, 3), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(balanceOf({0, 3, 6, 8, 10}), (std::vector<int>{3, 3, 2, 2}));
}

TEST(PartitionTest, MoreStagesThanLayersIsAClearError) {
  try {
    uniformBoundaries(3, 4);
    FAIL();
  } catch (const PartitionError& error) {
    EXPECT_STREQ(error.what(),
                 "cannot split 3 layers into 4 stages: every stage needs at "
                 "least one layer");
  }
  EXPECT_THROW(uniformBoundaries(3, 0), PartitionError);
}

TEST(PartitionTest, BalanceIsChecked) {
  EXPECT_EQ(balanceBoundaries({2, 1, 3}, 6), (std::vector<int>{0, 2, 3, 6}));
  try {
    balanceBoundaries({2, 2}, 5);
    FAIL();
  } catch (const PartitionError& error) {
    EXPECT_STREQ(error.what(), "balance sums to 4 layers, but the model has 5");
  }
  EXPECT_THROW(balanceBoundaries({3, 0, 2}, 5), PartitionError);
  EXPECT_THROW(balanceBoundaries({}, 5), PartitionError);
}

double bottleneck(const std::vector<double>& w, const std::vector<int>& b) {
  double worst = 0;
  for (size_t k = 0; k + 1 < b.size(); ++k) {
    double sum = 0;
    for (int i = b[k]; i < b[k + 1]; ++i) sum += w[i];
    worst = std::max(worst, sum);
  }
  return worst;
}

// Every contiguous split of n layers into k non-empty stages: each choice
// of k - 1 cut positions among the n - 1 gaps.
std::vector<std::vector<int>> allSplits(int n, int k) {
  std::vector<std::vector<int>> splits;
  for (unsigned mask = 0; mask < (1u << (n - 1)); ++mask) {
    if (__builtin_popcount(mask) != k - 1) continue;
    std::vector<int> boundaries{0};
    for (int gap = 1; gap < n; ++gap) {
      if (mask & (1u << (gap - 1))) boundaries.push_back(gap);
    }
    boundaries.push_back(n);
    splits.push_back(boundaries);
  }
  return splits;
}

TEST(PartitionTest, MinMaxIsOptimalAgainstBruteForce) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> weight(0.1, 10.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 9);
    const int k = 1 + static_cast<int>(rng() % n);
    std::vector<double> w(n);
    for (auto& x : w) x = weight(rng);
    const auto found = minMaxBoundaries(w, k);
    ASSERT_EQ(found.size(), static_cast<size_t>(k + 1));
    double best = 1e300;
    for (const auto& split : allSplits(n, k)) {
      best = std::min(best, bottleneck(w, split));
    }
    EXPECT_NEAR(bottleneck(w, found), best, 1e-9) << "trial " << trial;
  }
}

}  // namespace
}  // namespace tpipe
