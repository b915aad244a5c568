// Where a pipeline's stages and workers go, decided from the plan before
// anything is moved: a plain value that tests can build and print.
#pragma once

#include <string>
#include <vector>

#include "tpipe/plan.h"

namespace tpipe::runtime {

struct StagePlace {
  int rank = 0;
  std::string device;
  int firstLayer = 0;
  int endLayer = 0;  // exclusive
  bool local = true; // run by this process
};

struct RankPlace {
  std::string device;
  int threads = 1; // intra-op threads of its worker
  bool local = true;
  std::vector<int> stages; // increasing
};

struct Placement {
  std::vector<RankPlace> ranks;
  std::vector<StagePlace> stages;

  std::vector<int> localRanks() const;
  // One rank in this process: its work runs on the calling thread. Asked
  // every step, so it counts without building a list.
  bool runsOnCaller() const;
};

// Rank r of the plan's schedule on devices[r]. Each worker gets
// threadsAsked intra-op threads, or with 0 the cores shared fairly among
// the plan's ranks (at least 1). onlyRank >= 0: this process runs that rank
// alone (a multi-process run); -1: every rank.
Placement placeStages(
    const Plan& plan,
    const std::vector<std::string>& devices,
    int threadsAsked,
    int cores,
    int onlyRank = -1);

// One line per rank: "rank 0 cpu:0, 2 thread(s): stage 0 (layers 0-3), stage
// 3 (layers 9-11)", with ", another process" for ranks run elsewhere.
std::string describePlacement(const Placement& placement);

} // namespace tpipe::runtime
