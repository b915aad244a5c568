#include "runtime/placement.h"

#include <algorithm>

namespace tpipe::runtime {

std::vector<int> Placement::localRanks() const {
  std::vector<int> local;
  for (size_t r = 0; r < ranks.size(); ++r) {
    if (ranks[r].local)
      local.push_back(static_cast<int>(r));
  }
  return local;
}

bool Placement::runsOnCaller() const {
  return std::count_if(ranks.begin(), ranks.end(), [](const RankPlace& rank) {
           return rank.local;
         }) == 1;
}

Placement placeStages(
    const Plan& plan,
    const std::vector<std::string>& devices,
    int threadsAsked,
    int cores,
    int onlyRank) {
  const Schedule& schedule = plan.schedule;
  const int ranks = schedule.ranks;
  const int threads =
      threadsAsked > 0 ? threadsAsked : std::max(1, cores / std::max(1, ranks));
  Placement placement;
  for (int r = 0; r < ranks; ++r) {
    RankPlace rank;
    rank.device = devices.at(static_cast<size_t>(r));
    rank.threads = threads;
    rank.local = onlyRank < 0 || onlyRank == r;
    rank.stages = schedule.stagesOfRank(r);
    placement.ranks.push_back(rank);
  }
  for (int s = 0; s < schedule.stages(); ++s) {
    StagePlace stage;
    stage.rank = schedule.rankOfStage(s);
    stage.device = placement.ranks[stage.rank].device;
    const auto model = static_cast<size_t>(schedule.modelStage(s));
    stage.firstLayer = plan.boundaries.at(model); // a copy's, on chain > 0
    stage.endLayer = plan.boundaries.at(model + 1);
    stage.local = placement.ranks[stage.rank].local;
    placement.stages.push_back(stage);
  }
  return placement;
}

std::string describePlacement(const Placement& placement) {
  std::string text;
  for (size_t r = 0; r < placement.ranks.size(); ++r) {
    const RankPlace& rank = placement.ranks[r];
    text += "rank " + std::to_string(r) + " " + rank.device + ", " +
        std::to_string(rank.threads) + " thread(s):";
    for (size_t k = 0; k < rank.stages.size(); ++k) {
      const StagePlace& stage = placement.stages[rank.stages[k]];
      text += std::string(k ? "," : "") + " stage " +
          std::to_string(rank.stages[k]) + " (layers " +
          std::to_string(stage.firstLayer) + "-" +
          std::to_string(stage.endLayer - 1) + ")";
    }
    if (!rank.local)
      text += ", another process";
    text += "\n";
  }
  return text;
}

} // namespace tpipe::runtime
