// The compute order each schedule generator decides (what runs on every
// rank, in order, without transfers), and its lowering into instruction
// lists. Private to src/scheduler/: the generators, the list scheduler and
// the CSV formats.
#pragma once

#include <string>
#include <vector>

#include "tpipe/schedule.h"

namespace tpipe {
namespace scheduling {

enum class Pass { kForward, kBackward, kBackwardInput, kBackwardWeight };

struct ComputeStep {
  Pass pass;
  int stage;
  int microBatch;
  // A forward overlapped with the next step, a whole backward.
  bool overlapsNext = false;
};

using ComputeOrder = std::vector<std::vector<ComputeStep>>; // per rank

// The micro-batch that checkpoint mode except_last keeps whole (see
// generators.cpp).
int keptMicroBatch(const ComputeOrder& order, int microBatches);

// The instruction of a backward step: whole, input pass or weight pass.
Instruction backwardInstruction(const ComputeStep& step);

// Adds to each rank's compute order the transfers and recomputation every
// generator needs alike.
Schedule lower(
    std::string name,
    int ranks,
    int virtualStages,
    int microBatches,
    CheckpointMode mode,
    const ComputeOrder& order,
    int chains = 1);

// Throws ScheduleError unless every count is at least 1.
void requireCounts(int ranks, int microBatches, int virtualStages);

// 2p stages in a V: rank r holds stages r and 2p - 1 - r (zb-v, dualpipev).
std::vector<int> vPlacement(int ranks);

} // namespace scheduling
} // namespace tpipe
