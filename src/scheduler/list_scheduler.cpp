// The zero-bubble list scheduler: schedule `auto` (over measured stage
// costs and in-flight limits), and zb-h2 and zb-v, which it builds under
// unit costs. Each tries the Zero Bubble paper's heuristic variants and
// keeps the best simulated; `auto` then improves it locally.
#include <algorithm>
#include <array>
#include <deque>
#include <map>
#include <utility>

#include "scheduler/compute_order.h"
#include "tpipe/schedule.h"

namespace tpipe {
namespace {

using namespace scheduling; // the compute order, its lowering and checks

// How the list scheduler below breaks ties; autoSchedule tries several and
// keeps the best (the Zero Bubble paper's heuristic variants).
struct GreedyPolicy {
  // A free rank with nothing ready runs a pending weight pass only when
  // the wait for its next arrival is at least this fraction of the pass
  // (0: always; 1: only when the pass fits the gap, so it never delays the
  // arrival's work). A rank with no arrival ahead always runs it.
  double fillRatio = 0.0;
  // Prefer a ready forward to a ready input pass (1F1B's order) instead of
  // the reverse (which shortens the critical path through the Bs).
  bool forwardFirst = false;
  // A free rank does not start a forward when an input pass of its
  // becomes ready within this fraction of the forward: it waits for the
  // input pass instead, which is on the critical path (the paper's
  // "bubble allowed before a B").
  double backwardLookahead = 0.0;
  // Wait so only for an input pass whose gradient the rank upstream would
  // otherwise starve for: the upstream rank has no weight pass of its own
  // to run meanwhile. The first stage's input pass feeds no one, so it is
  // never waited for.
  bool waitOnlyForStarvedUpstream = false;
};

// The zero-bubble list scheduler (the Zero Bubble paper's automatic
// scheduler, simplified), with split backwards. Stage s runs on rank
// placement[s] (a rank may hold several stages, as in ZB-V). It replays time
// with the given per-stage costs; whenever a rank is free it runs, in this
// order of preference (the first two swap under policy.forwardFirst):
//   1. an input pass (B) whose gradient has arrived, the latest stage first:
//      it unblocks the stage before, so the bubble upstream shrinks;
//   2. a forward (F) whose activation has arrived, the latest stage first,
//      if the rank holds less than `limit[rank]` micro-batches of its
//      stages and the forward leaves one place for each later stage of the
//      rank still to forward (so a V's first stage cannot take the places
//      its second stage needs). A forwarded micro-batch counts 1 until its
//      weight pass; once its B is done, `weightMemory` (what the W still
//      needs, as a fraction of what the F stashed: the Zero Bubble paper's
//      M_W / M_B);
//   3. a weight pass (W) of a micro-batch whose B is done: W depends on no
//      other rank, so it fills what would be idle time (policy.fillRatio),
//      and it always runs when a forward has arrived but has no place (the
//      paper's "W to recycle memory");
// and otherwise waits for the next arrival. Remaining Ws drain at the end.
class GreedyZeroBubble {
 public:
  GreedyZeroBubble(
      int ranks,
      std::vector<int> placement,
      int m,
      std::vector<StageCosts> costs,
      std::vector<int> limit,
      double weightMemory,
      std::vector<GreedyPolicy> policy)
      : p_(ranks),
        stages_(static_cast<int>(placement.size())),
        m_(m),
        placement_(std::move(placement)),
        costs_(std::move(costs)),
        limit_(std::move(limit)),
        weightMemory_(weightMemory),
        policy_(std::move(policy)),
        free_(ranks, 0.0),
        f_(stages_, 0),
        b_(stages_, 0),
        w_(stages_, 0),
        forwardDone_(stages_, std::vector<double>(m, -1.0)),
        backwardDone_(stages_, std::vector<double>(m, -1.0)),
        order_(ranks),
        stagesOf_(ranks),
        held_(ranks, 0),
        weightsLeft_(ranks, 0) {
    for (int s = 0; s < stages_; ++s) {
      stagesOf_[placement_[s]].push_back(s);
      weightsLeft_[placement_[s]] += m;
    }
  }

  ComputeOrder run() {
    while (!allDone()) {
      double t = kNever;
      for (int r = 0; r < p_; ++r) {
        if (!rankDone(r))
          t = std::min(t, free_[r]);
      }
      bool progressed = false;
      for (int r = 0; r < p_; ++r) {
        if (!rankDone(r) && free_[r] <= t + kEpsilon)
          progressed = step(r, t) || progressed;
      }
      if (!progressed)
        advance(t);
    }
    return order_;
  }

 private:
  static constexpr double kNever = 1e300;
  static constexpr double kEpsilon = 1e-12;

  const StageCosts& cost(int s) const {
    return costs_.size() == 1 ? costs_[0] : costs_[s];
  }
  bool rankDone(int r) const {
    return weightsLeft_[r] == 0;
  }
  bool allDone() const {
    for (int r = 0; r < p_; ++r) {
      if (weightsLeft_[r] > 0)
        return false;
    }
    return true;
  }
  // Places rank r must keep for its stages after s still to forward.
  int reserved(int s) const {
    int places = 0;
    for (int later : stagesOf_[placement_[s]]) {
      if (later > s && f_[later] < m_ && f_[later] - w_[later] == 0)
        ++places;
    }
    return places;
  }
  // When stage s could start its next B / F; kNever while unknown.
  double backwardReady(int s) const {
    if (b_[s] >= f_[s])
      return kNever;
    if (s == stages_ - 1)
      return forwardDone_[s][b_[s]];
    // The gradient crosses the same boundary as stage s's output, at its
    // cost (as the simulator charges it).
    const double sent = backwardDone_[s + 1][b_[s]];
    return sent < 0 ? kNever : sent + cost(s).transfer;
  }
  // When stage s's next forward has its input, place or not.
  double forwardArrival(int s) const {
    if (f_[s] >= m_)
      return kNever;
    if (s == 0)
      return 0.0;
    const double sent = forwardDone_[s - 1][f_[s]];
    return sent < 0 ? kNever : sent + cost(s - 1).transfer;
  }
  double forwardReady(int s) const {
    const int r = placement_[s];
    if (held_[r] + 1 + reserved(s) > limit_[r] + kEpsilon)
      return kNever;
    return forwardArrival(s);
  }
  // The latest stage of rank r whose next pass is ready by t, or -1.
  int latestReady(int r, double t, bool backward) const {
    for (auto it = stagesOf_[r].rbegin(); it != stagesOf_[r].rend(); ++it) {
      const int s = *it;
      const double ready = backward ? backwardReady(s) : forwardReady(s);
      if (ready <= t + kEpsilon)
        return s;
    }
    return -1;
  }
  // The stage of rank r with the oldest pending weight pass, or -1.
  int pendingWeight(int r) const {
    for (int s : stagesOf_[r]) {
      if (w_[s] < b_[s])
        return s;
    }
    return -1;
  }
  // The next time anything of rank r becomes ready after t (kNever when
  // nothing is known to come).
  double nextArrival(int r, double t) const {
    double next = kNever;
    for (int s : stagesOf_[r]) {
      for (double ready : {backwardReady(s), forwardReady(s)}) {
        if (ready > t + kEpsilon)
          next = std::min(next, ready);
      }
    }
    return next;
  }

  bool step(int r, double t) {
    Pass pass;
    int s = -1, mb;
    double duration;
    const int firstBackward = latestReady(r, t, true);
    const int firstForward = latestReady(r, t, false);
    const bool backward =
        firstBackward >= 0 && (!policy_[r].forwardFirst || firstForward < 0);
    if (!backward && firstForward >= 0 && backwardSoon(r, firstForward, t))
      return false;
    if (backward) {
      s = firstBackward;
      pass = Pass::kBackwardInput, mb = b_[s]++,
      duration = cost(s).backwardInput;
      backwardDone_[s][mb] = t + duration;
      held_[r] -= 1 - weightMemory_;
    } else if (firstForward >= 0) {
      s = firstForward;
      pass = Pass::kForward, mb = f_[s]++, duration = cost(s).forward;
      forwardDone_[s][mb] = t + duration;
      ++held_[r];
    } else if (
        (s = pendingWeight(r)) >= 0 &&
        (fillsGap(r, s, t) || forwardWithoutPlace(r, t))) {
      pass = Pass::kBackwardWeight, mb = w_[s]++,
      duration = cost(s).backwardWeight;
      held_[r] -= weightMemory_, --weightsLeft_[r];
    } else {
      return false;
    }
    order_[r].push_back({pass, s, mb});
    free_[r] = t + duration;
    return true;
  }
  bool backwardSoon(int r, int forwardStage, double t) const {
    const GreedyPolicy& policy = policy_[r];
    if (policy.backwardLookahead <= 0)
      return false;
    const double horizon =
        t + policy.backwardLookahead * cost(forwardStage).forward;
    for (int s : stagesOf_[r]) {
      if (policy.waitOnlyForStarvedUpstream &&
          (s == 0 || pendingWeight(placement_[s - 1]) >= 0))
        continue;
      if (backwardReady(s) <= horizon)
        return true;
    }
    return false;
  }
  // A forward of rank r has its input by t but no place to go.
  bool forwardWithoutPlace(int r, double t) const {
    for (int s : stagesOf_[r]) {
      if (forwardArrival(s) <= t + kEpsilon)
        return true;
    }
    return false;
  }
  bool fillsGap(int r, int s, double t) const {
    const double gap = nextArrival(r, t) - t;
    return gap >= kNever / 2 ||
        gap + kEpsilon >= policy_[r].fillRatio * cost(s).backwardWeight;
  }

  // Nobody could run at t: idle ranks wait for the next finish or arrival.
  void advance(double t) {
    double next = kNever;
    for (int r = 0; r < p_; ++r) {
      if (!rankDone(r) && free_[r] > t + kEpsilon)
        next = std::min(next, free_[r]);
    }
    for (int s = 0; s < stages_; ++s) {
      for (double ready : {backwardReady(s), forwardReady(s)}) {
        if (ready > t + kEpsilon)
          next = std::min(next, ready);
      }
    }
    if (next >= kNever)
      throw ScheduleError("zero-bubble scheduler: no rank can make progress");
    for (int r = 0; r < p_; ++r) {
      if (!rankDone(r) && free_[r] <= t + kEpsilon)
        free_[r] = next;
    }
  }

  int p_, stages_, m_;
  std::vector<int> placement_;
  std::vector<StageCosts> costs_;
  std::vector<int> limit_; // per rank
  double weightMemory_;
  std::vector<GreedyPolicy> policy_; // per rank
  std::vector<double> free_;
  std::vector<int> f_, b_, w_; // next micro-batch of each pass, per stage
  std::vector<std::vector<double>> forwardDone_, backwardDone_;
  ComputeOrder order_;
  std::vector<std::vector<int>> stagesOf_; // per rank, ascending
  std::vector<double> held_;               // per rank, as counted for limit_
  std::vector<int> weightsLeft_;           // per rank
};

// What `auto` spends on per-rank policies, in scheduled passes (about 5e5:
// every greedy run schedules 3 p m of them); fixed, so the result does not
// depend on the machine's speed.
constexpr long kPerRankPolicySteps = 500000;

// One stage per rank: stage s on rank s.
std::vector<int> straightPlacement(int ranks) {
  std::vector<int> placement(ranks);
  for (int s = 0; s < ranks; ++s)
    placement[s] = s;
  return placement;
}

// How list schedules are compared: the step as the runtime runs it today
// (its makespan, a barrier between steps), then the Zero Bubble paper's
// span bubble, which back-to-back steps without a barrier would collect.
struct ScheduleScore {
  double makespan = 1e300;
  double spanBubble = 1.0;
  double spanIdle = 1e300; // every rank's idle within its span, summed
  bool betterThan(const ScheduleScore& other) const {
    const double tolerance = 1e-9 * std::max(1.0, other.makespan);
    if (makespan < other.makespan - tolerance)
      return true;
    if (makespan > other.makespan + tolerance)
      return false;
    if (spanBubble < other.spanBubble - 1e-12)
      return true;
    return spanBubble <= other.spanBubble + 1e-12 &&
        spanIdle < other.spanIdle - tolerance;
  }
};

ScheduleScore scoreOf(
    const Schedule& schedule,
    const std::vector<StageCosts>& costs) {
  const Simulation simulation = simulate(schedule, costs);
  if (!simulation.finished)
    return {};
  double spanIdle = 0.0;
  for (size_t rank = 0; rank < simulation.span.size(); ++rank)
    spanIdle += simulation.span[rank] - simulation.busy[rank];
  return {simulation.makespan, simulation.spanBubble, spanIdle};
}

ScheduleScore scoreOf(
    const ComputeOrder& order,
    const std::vector<int>& placement,
    int microBatches,
    const std::vector<StageCosts>& costs) {
  const int ranks = static_cast<int>(order.size());
  Schedule lowered = lower(
      "",
      ranks,
      static_cast<int>(placement.size()) / ranks,
      microBatches,
      CheckpointMode::kNever,
      order);
  lowered.placement = placement;
  return scoreOf(lowered, costs);
}

// The greedy list scheduler under each of its policies, best simulated
// makespan first (ties: the first policy). Policies that stall are skipped.
ComputeOrder bestGreedy(
    int ranks,
    const std::vector<int>& placement,
    int microBatches,
    const std::vector<StageCosts>& costs,
    const std::vector<int>& limit,
    double weightMemory = 1.0,
    long perRankSteps = 0) {
  ComputeOrder best;
  ScheduleScore bestScore;
  constexpr double kOnlyWhenNeeded = 1e200; // a W waits for the tail or
                                            // for memory
  std::vector<GreedyPolicy> policies;
  for (double lookahead : {0.0, 0.5, 1.0}) {
    for (bool forwardFirst : {false, true}) {
      for (double fillRatio : {0.0, 0.5, 1.0, kOnlyWhenNeeded}) {
        policies.push_back({fillRatio, forwardFirst, lookahead, false});
        if (lookahead > 0)
          policies.push_back({fillRatio, forwardFirst, lookahead, true});
      }
    }
  }
  // Tries one policy per rank; keeps the order when it scores better.
  auto attempt = [&](const std::vector<GreedyPolicy>& perRank) {
    ComputeOrder order;
    try {
      order = GreedyZeroBubble(
                  ranks,
                  placement,
                  microBatches,
                  costs,
                  limit,
                  weightMemory,
                  perRank)
                  .run();
    } catch (const ScheduleError&) {
      return false;
    }
    const ScheduleScore score = scoreOf(order, placement, microBatches, costs);
    if (!score.betterThan(bestScore))
      return false;
    best = std::move(order);
    bestScore = score;
    return true;
  };
  std::vector<GreedyPolicy> chosen;
  for (const GreedyPolicy& policy : policies) {
    std::vector<GreedyPolicy> uniform(ranks, policy);
    if (attempt(uniform))
      chosen = uniform;
  }
  if (best.empty())
    throw ScheduleError("zero-bubble scheduler: no rank can make progress");
  // Then each rank's own policy, one rank at a time, while that improves:
  // the first stage's input passes feed no one, the last stage's forwards
  // wait for no one, and the best tie-break differs along the pipeline.
  long budget = perRankSteps / std::max<long>(1, 3L * ranks * microBatches);
  for (bool improved = true; improved && budget > 0;) {
    improved = false;
    for (int rank = 0; rank < ranks && budget > 0; ++rank) {
      for (const GreedyPolicy& policy : policies) {
        if (budget-- <= 0)
          break;
        std::vector<GreedyPolicy> trial = chosen;
        trial[rank] = policy;
        if (attempt(trial)) {
          chosen = std::move(trial);
          improved = true;
        }
      }
    }
  }
  return best;
}

// Peak micro-batches each rank holds, as GreedyZeroBubble counts them: a
// forwarded one 1, one whose input pass is done `weightMemory`.
std::vector<double> peakHeld(const ComputeOrder& order, double weightMemory) {
  std::vector<double> peaks;
  for (const auto& steps : order) {
    double held = 0, peak = 0;
    for (const ComputeStep& step : steps) {
      if (step.pass == Pass::kForward)
        peak = std::max(peak, ++held);
      else if (step.pass == Pass::kBackwardInput)
        held -= 1 - weightMemory;
      else if (step.pass == Pass::kBackwardWeight)
        held -= weightMemory;
      else
        held -= 1;
    }
    peaks.push_back(peak);
  }
  return peaks;
}

// A local improvement pass over a list schedule: move single weight passes
// one place earlier or later on their rank, keeping each move the
// simulator scores faster and the in-flight limits allow, until a pass
// finds nothing or the budget of evaluations (fixed, so the result does not
// depend on the machine's speed) is spent.
void improveWeightPlacement(
    ComputeOrder& order,
    const std::vector<int>& placement,
    int microBatches,
    const std::vector<StageCosts>& costs,
    const std::vector<int>& limit,
    double weightMemory) {
  const int ranks = static_cast<int>(order.size());
  size_t steps = 0;
  for (const auto& list : order)
    steps += list.size();
  // About 3e6 simulated steps in all: bounded time at p = 32, m = 256.
  long budget = std::max<long>(8, static_cast<long>(3e6 / (steps + 1)));
  ScheduleScore best = scoreOf(order, placement, microBatches, costs);
  for (bool improved = true; improved && budget > 0;) {
    improved = false;
    for (int r = 0; r < ranks && budget > 0; ++r) {
      auto& list = order[r];
      for (size_t i = 0; i < list.size() && budget > 0; ++i) {
        if (list[i].pass != Pass::kBackwardWeight)
          continue;
        for (int direction : {-1, 1}) {
          const size_t j = i + direction;
          if (j >= list.size() || budget <= 0)
            continue;
          const ComputeStep& other = list[j];
          if (direction < 0 && other.pass == Pass::kBackwardInput &&
              other.stage == list[i].stage &&
              other.microBatch == list[i].microBatch)
            continue; // a W stays after its own B
          std::swap(list[i], list[j]);
          --budget;
          const std::vector<double> held = peakHeld({list}, weightMemory);
          const ScheduleScore score = held[0] <= limit[r] + 1e-9
              ? scoreOf(order, placement, microBatches, costs)
              : ScheduleScore{};
          if (score.betterThan(best)) {
            best = score;
            improved = true;
            break;
          }
          std::swap(list[i], list[j]);
        }
      }
    }
  }
}

} // namespace

Schedule zeroBubbleH2Schedule(
    int ranks,
    int microBatches,
    CheckpointMode mode) {
  requireCounts(ranks, microBatches, 1);
  // Up to 2p - 1 micro-batches in flight: enough warm-up forwards to cover
  // the wait for the first gradient, so unit-cost stages never idle.
  const std::vector<int> limit(ranks, 2 * ranks - 1);
  const ComputeOrder order = bestGreedy(
      ranks, straightPlacement(ranks), microBatches, {StageCosts{}}, limit);
  return lower("zb-h2", ranks, 1, microBatches, mode, order);
}

Schedule autoSchedule(
    int ranks,
    int microBatches,
    CheckpointMode mode,
    const std::vector<StageCosts>& costs,
    const std::vector<int>& limit,
    double weightPassMemory) {
  requireCounts(ranks, microBatches, 1);
  if (costs.size() != 1 && static_cast<int>(costs.size()) != ranks) {
    throw ScheduleError(
        "auto schedule: expected 1 or " + std::to_string(ranks) +
        " stage costs, got " + std::to_string(costs.size()));
  }
  if (static_cast<int>(limit.size()) != ranks) {
    throw ScheduleError(
        "auto schedule: expected " + std::to_string(ranks) +
        " in-flight limits, got " + std::to_string(limit.size()));
  }
  for (int cap : limit) {
    if (cap < 1)
      throw ScheduleError("auto schedule: an in-flight limit must be >= 1");
  }
  if (!(weightPassMemory >= 0.0 && weightPassMemory <= 1.0)) {
    throw ScheduleError(
        "auto schedule: the weight pass's memory must be a fraction of a "
        "micro-batch's, from 0 to 1, got " +
        std::to_string(weightPassMemory));
  }
  const std::vector<int> placement = straightPlacement(ranks);
  ComputeOrder order = bestGreedy(
      ranks,
      placement,
      microBatches,
      costs,
      limit,
      weightPassMemory,
      kPerRankPolicySteps);
  improveWeightPlacement(
      order, placement, microBatches, costs, limit, weightPassMemory);
  Schedule best = lower("auto", ranks, 1, microBatches, mode, order);
  ScheduleScore bestScore = scoreOf(best, costs);
  // Never worse than a built-in schedule that fits the same limit.
  auto fits = [&](int held) {
    for (int cap : limit) {
      if (cap < std::min(held, microBatches))
        return false;
    }
    return true;
  };
  std::vector<Schedule> builtIns;
  if (fits(ranks)) {
    builtIns.push_back(oneFOneBSchedule(ranks, microBatches, mode));
    builtIns.push_back(zeroBubbleH1Schedule(ranks, microBatches, mode));
  }
  if (fits(2 * ranks - 1))
    builtIns.push_back(zeroBubbleH2Schedule(ranks, microBatches, mode));
  for (Schedule& candidate : builtIns) {
    const ScheduleScore score = scoreOf(candidate, costs);
    if (score.betterThan(bestScore)) {
      best = std::move(candidate);
      best.name = "auto";
      bestScore = score;
    }
  }
  validate(best);
  return best;
}

namespace {

// ZB-V as the Zero Bubble paper lays it out (m >= 2p): rank r holds stage
// r (chunk 0, going down) and stage 2p - 1 - r (chunk 1, coming back).
// Its warm-up forwards chunk 0 until the V's turn reaches it, then pairs
// each chunk-1 forward with that micro-batch's input and weight passes;
// the steady state repeats F, B, W on chunk 0 then chunk 1; the cool-down
// runs the remaining input passes, then the weight passes they left. Under
// T_F = T_B = T_W every rank is busy from its first operation to its last.
ComputeOrder zeroBubbleVOrder(int p, int m) {
  ComputeOrder order(p);
  for (int r = 0; r < p; ++r) {
    auto& steps = order[r];
    const int stageOf[2] = {r, 2 * p - 1 - r};
    int forwards[2] = {0, 0}, inputs[2] = {0, 0}, weights[2] = {0, 0};
    auto forward = [&](int chunk) {
      steps.push_back({Pass::kForward, stageOf[chunk], forwards[chunk]++});
    };
    auto input = [&](int chunk) {
      steps.push_back({Pass::kBackwardInput, stageOf[chunk], inputs[chunk]++});
    };
    auto weight = [&](int chunk) {
      steps.push_back(
          {Pass::kBackwardWeight, stageOf[chunk], weights[chunk]++});
    };
    for (int i = 0; i < 2 * (p - r) - 1; ++i)
      forward(0);
    for (int i = 0; i < r; ++i) {
      forward(1);
      forward(0);
    }
    for (int i = 0; i < p - r; ++i) {
      forward(1);
      input(1);
      weight(1);
    }
    while (forwards[1] < forwards[0] || forwards[0] < m) {
      if (forwards[0] < m)
        forward(0);
      input(0);
      weight(0);
      forward(1);
      input(1);
      weight(1);
    }
    for (int i = 0; i < r; ++i) {
      input(0);
      input(1);
    }
    for (int i = 0; i < p - r; ++i) {
      input(0);
      weight(0);
    }
    while (weights[1] < inputs[1])
      weight(1);
    while (weights[0] < inputs[0])
      weight(0);
  }
  return order;
}

} // namespace

Schedule zeroBubbleVSchedule(int ranks, int microBatches, CheckpointMode mode) {
  requireCounts(ranks, microBatches, 2);
  const std::vector<int> placement = vPlacement(ranks);
  // Each stage is half a 1F1B stage: 2p of them in flight on a rank hold
  // what 1F1B's first stage holds (p whole micro-batches). Fewer
  // micro-batches than stages leave the paper's layout no steady state:
  // the list scheduler lays those under the same limit.
  const ComputeOrder order = microBatches >= 2 * ranks
      ? zeroBubbleVOrder(ranks, microBatches)
      : bestGreedy(
            ranks,
            placement,
            microBatches,
            {StageCosts{}},
            std::vector<int>(ranks, 2 * ranks));
  Schedule schedule = lower("zb-v", ranks, 2, microBatches, mode, order);
  schedule.placement = placement;
  validate(schedule);
  return schedule;
}

namespace {

// The V laid from a building block (Qi et al., "Pipeline Parallelism with
// Controllable Memory", 2024): rank r's four passes of micro-batch 0 take
// the slots `first(p, r)` gives (the forward of stage r, of stage 2p - 1 - r,
// then the input passes of 2p - 1 - r and of r), and micro-batch k takes
// them 6 k slots later, six passes per period with the two weight passes.
// The block fixes how long each activation lives, so the peak memory, where
// a list scheduler under a limit leaves idle that grows with p. Weight
// passes fill the free slots in order, the later stage's first (its input
// pass came first); the rest drain at the end. Empty when two passes of a
// rank fall on one slot.
ComputeOrder vBlockOrder(
    int p,
    int m,
    std::array<int, 4> (*first)(int p, int rank)) {
  ComputeOrder order(p);
  for (int r = 0; r < p; ++r) {
    const int stageOf[4] = {r, 2 * p - 1 - r, 2 * p - 1 - r, r};
    const Pass passOf[4] = {
        Pass::kForward,
        Pass::kForward,
        Pass::kBackwardInput,
        Pass::kBackwardInput};
    const std::array<int, 4> offsets = first(p, r);
    std::map<int, ComputeStep> slots;
    for (int k = 0; k < m; ++k) {
      for (int kind = 0; kind < 4; ++kind) {
        const ComputeStep step{passOf[kind], stageOf[kind], k};
        if (!slots.emplace(offsets[kind] + 6 * k, step).second)
          return {};
      }
    }
    std::deque<ComputeStep> weights[2]; // the later stage's, the earlier's
    int next = 0;
    for (const auto& [slot, step] : slots) {
      for (; next < slot; ++next) {
        for (auto& pending : weights) {
          if (!pending.empty()) {
            order[r].push_back(pending.front());
            pending.pop_front();
            break;
          }
        }
      }
      order[r].push_back(step);
      next = slot + 1;
      if (step.pass == Pass::kBackwardInput) {
        weights[step.stage == r ? 1 : 0].push_back(
            {Pass::kBackwardWeight, step.stage, step.microBatch});
      }
    }
    for (auto& pending : weights) {
      for (const ComputeStep& weight : pending)
        order[r].push_back(weight);
    }
  }
  return order;
}

// The building blocks' first slots: V-Min's lifespans hold a third of
// 1F1B's activations, V-Half's half (with a gap of 2 or 3 slots where p
// divides by 3, or is even, so no two passes meet).
std::array<int, 4> vMinBlock(int p, int r) {
  const int gap = p % 3 == 0 ? 2 : 0;
  return {r, 2 * p - 1 - r, 2 * p + gap + r, 4 * p + gap - 1 - r};
}
std::array<int, 4> vHalfBlock(int p, int r) {
  const int gap = p % 2 == 0 ? 3 : 0;
  return {2 * r, 3 * p - r - 2, 3 * p + gap + 2 * r - 1, 6 * p + gap - r - 2};
}

// The V of zb-v with at most `limit` half-stage micro-batches stashed on
// each rank: from the paper's building block where that fits the limit and
// runs faster under unit costs, else laid by the list scheduler.
Schedule boundedV(
    const char* name,
    int ranks,
    int microBatches,
    CheckpointMode mode,
    int limit,
    std::array<int, 4> (*block)(int p, int r)) {
  requireCounts(ranks, microBatches, 2);
  const std::vector<int> placement = vPlacement(ranks);
  ComputeOrder order = bestGreedy(
      ranks,
      placement,
      microBatches,
      {StageCosts{}},
      std::vector<int>(ranks, limit));
  const ComputeOrder built = vBlockOrder(ranks, microBatches, block);
  if (!built.empty()) {
    const std::vector<double> held = peakHeld(built, 1.0);
    const bool fits = std::all_of(
        held.begin(), held.end(), [&](double h) { return h <= limit + 1e-9; });
    ScheduleScore score;
    try {
      score = scoreOf(built, placement, microBatches, {StageCosts{}});
    } catch (const ScheduleError&) {
      score = {}; // a block that does not fit this p and m
    }
    if (fits &&
        score.betterThan(
            scoreOf(order, placement, microBatches, {StageCosts{}})))
      order = built;
  }
  Schedule schedule = lower(name, ranks, 2, microBatches, mode, order);
  schedule.placement = placement;
  validate(schedule);
  return schedule;
}

} // namespace

Schedule zeroBubbleVHalfSchedule(
    int ranks,
    int microBatches,
    CheckpointMode mode) {
  // P / 2 + 1 whole micro-batches: p + 2 half-stage ones.
  return boundedV(
      "zb-v-half", ranks, microBatches, mode, ranks + 2, vHalfBlock);
}

int zeroBubbleVMinLimit(int ranks) {
  return (2 * ranks + 2) / 3 + 2;
}

Schedule zeroBubbleVMinSchedule(
    int ranks,
    int microBatches,
    CheckpointMode mode) {
  return boundedV(
      "zb-v-min",
      ranks,
      microBatches,
      mode,
      zeroBubbleVMinLimit(ranks),
      vMinBlock);
}

} // namespace tpipe
