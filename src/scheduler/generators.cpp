// Schedule generators: each decides only the order of compute on every rank;
// `lower` adds the transfers and recomputation every generator needs alike.
#include <algorithm>
#include <deque>
#include <sstream>

#include "scheduler/compute_order.h"
#include "tpipe/schedule.h"

namespace tpipe {
namespace scheduling {

// Receives go right before the compute that needs them and sends right
// after the compute that produced them. A checkpointed micro-batch recomputes
// before it waits for its gradient, so the recompute overlaps that wait.
// The micro-batch that checkpoint mode except_last keeps whole: in a
// fill-drain order (every rank runs all its forwards before any backward)
// the one whose backward starts the drain, else the last (1F1B's last stage
// runs its backward right after its forward). Derived from the order, so a
// schedule read back from a CSV keeps the same one.
int keptMicroBatch(const ComputeOrder& order, int microBatches) {
  int firstBackward = -1;
  for (const auto& steps : order) {
    bool backwardSeen = false;
    for (const ComputeStep& step : steps) {
      if (step.pass == Pass::kForward && backwardSeen)
        return microBatches - 1;
      if (step.pass != Pass::kForward && !backwardSeen) {
        backwardSeen = true;
        if (firstBackward < 0)
          firstBackward = step.microBatch;
      }
    }
  }
  return firstBackward >= 0 ? firstBackward : microBatches - 1;
}

// The instruction of a backward step: whole, input pass or weight pass.
Instruction backwardInstruction(const ComputeStep& step) {
  switch (step.pass) {
    case Pass::kBackward:
      return Backward{step.stage, step.microBatch};
    case Pass::kBackwardInput:
      return BackwardInput{step.stage, step.microBatch};
    default:
      return BackwardWeight{step.stage, step.microBatch};
  }
}

Schedule lower(
    std::string name,
    int ranks,
    int virtualStages,
    int microBatches,
    CheckpointMode mode,
    const ComputeOrder& order) {
  const int kept = keptMicroBatch(order, microBatches);
  Schedule schedule;
  schedule.name = std::move(name);
  schedule.ranks = ranks;
  schedule.virtualStages = virtualStages;
  schedule.microBatches = microBatches;
  schedule.perRank.resize(ranks);
  const int last = ranks * virtualStages - 1;
  for (int rank = 0; rank < ranks; ++rank) {
    auto& list = schedule.perRank[rank];
    const auto& steps = order[rank];
    for (size_t k = 0; k < steps.size(); ++k) {
      const ComputeStep& step = steps[k];
      const int s = step.stage;
      const int mb = step.microBatch;
      const bool checkpointed = isCheckpointed(mode, mb, kept);
      if (step.overlapsNext) {
        // One overlapped step: both receives before it, both sends after.
        if (k + 1 >= steps.size() || steps[k + 1].pass != Pass::kBackward) {
          throw ScheduleError(
              "an overlapped forward must be followed by a whole backward");
        }
        const ComputeStep& back = steps[++k];
        if (s > 0)
          list.emplace_back(RecvActivation{s, mb});
        if (isCheckpointed(mode, back.microBatch, kept))
          list.emplace_back(Recompute{back.stage, back.microBatch});
        if (back.stage < last)
          list.emplace_back(RecvGrad{back.stage, back.microBatch});
        list.emplace_back(Forward{s, mb, checkpointed, true});
        list.emplace_back(Backward{back.stage, back.microBatch});
        if (s < last)
          list.emplace_back(SendActivation{s, mb});
        if (back.stage > 0)
          list.emplace_back(SendGrad{back.stage, back.microBatch});
        continue;
      }
      switch (step.pass) {
        case Pass::kForward:
          if (s > 0)
            list.emplace_back(RecvActivation{s, mb});
          list.emplace_back(Forward{s, mb, checkpointed});
          if (s < last)
            list.emplace_back(SendActivation{s, mb});
          break;
        case Pass::kBackward:
        case Pass::kBackwardInput:
          if (checkpointed)
            list.emplace_back(Recompute{s, mb});
          if (s < last)
            list.emplace_back(RecvGrad{s, mb});
          list.push_back(backwardInstruction(step));
          if (s > 0)
            list.emplace_back(SendGrad{s, mb});
          break;
        case Pass::kBackwardWeight:
          list.push_back(backwardInstruction(step));
          break;
      }
    }
  }
  return schedule;
}

} // namespace scheduling

namespace {

using scheduling::ComputeOrder;
using scheduling::ComputeStep;
using scheduling::lower;
using scheduling::Pass;

void requireCounts(int ranks, int microBatches, int virtualStages) {
  if (ranks < 1) {
    throw ScheduleError(
        "schedule: stages per virtual stage (ranks) must be "
        ">= 1, got " +
        std::to_string(ranks));
  }
  if (microBatches < 1) {
    throw ScheduleError(
        "schedule: micro-batches must be >= 1, got " +
        std::to_string(microBatches));
  }
  if (virtualStages < 1) {
    throw ScheduleError(
        "schedule: virtual stages must be >= 1, got " +
        std::to_string(virtualStages));
  }
}

// 1F1B's compute order for one rank: `warmup` forwards, then alternate one
// forward and one backward, then drain the remaining backwards.
std::vector<ComputeStep> oneFOneBOrder(
    int stage,
    int warmup,
    int microBatches,
    Pass backward) {
  std::vector<ComputeStep> steps;
  for (int mb = 0; mb < warmup; ++mb) {
    steps.push_back({Pass::kForward, stage, mb});
  }
  for (int k = 0; k < microBatches - warmup; ++k) {
    steps.push_back({Pass::kForward, stage, warmup + k});
    steps.push_back({backward, stage, k});
  }
  for (int mb = microBatches - warmup; mb < microBatches; ++mb) {
    steps.push_back({backward, stage, mb});
  }
  return steps;
}

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
      GreedyPolicy policy)
      : p_(ranks),
        stages_(static_cast<int>(placement.size())),
        m_(m),
        placement_(std::move(placement)),
        costs_(std::move(costs)),
        limit_(std::move(limit)),
        weightMemory_(weightMemory),
        policy_(policy),
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
    const double sent = backwardDone_[s + 1][b_[s]];
    return sent < 0 ? kNever : sent + cost(s + 1).transfer;
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
        firstBackward >= 0 && (!policy_.forwardFirst || firstForward < 0);
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
    if (policy_.backwardLookahead <= 0)
      return false;
    const double horizon =
        t + policy_.backwardLookahead * cost(forwardStage).forward;
    for (int s : stagesOf_[r]) {
      if (policy_.waitOnlyForStarvedUpstream &&
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
        gap + kEpsilon >= policy_.fillRatio * cost(s).backwardWeight;
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
  GreedyPolicy policy_;
  std::vector<double> free_;
  std::vector<int> f_, b_, w_; // next micro-batch of each pass, per stage
  std::vector<std::vector<double>> forwardDone_, backwardDone_;
  ComputeOrder order_;
  std::vector<std::vector<int>> stagesOf_; // per rank, ascending
  std::vector<double> held_;               // per rank, as counted for limit_
  std::vector<int> weightsLeft_;           // per rank
};

// One stage per rank: stage s on rank s.
std::vector<int> straightPlacement(int ranks) {
  std::vector<int> placement(ranks);
  for (int s = 0; s < ranks; ++s)
    placement[s] = s;
  return placement;
}

// 2p stages in a V: rank r holds stages r and 2p - 1 - r.
std::vector<int> vPlacement(int ranks) {
  std::vector<int> placement(2 * ranks);
  for (int s = 0; s < 2 * ranks; ++s)
    placement[s] = s < ranks ? s : 2 * ranks - 1 - s;
  return placement;
}

// How list schedules are compared: the step as the runtime runs it today
// (its makespan, a barrier between steps), then the Zero Bubble paper's
// span bubble, which back-to-back steps without a barrier would collect.
struct ScheduleScore {
  double makespan = 1e300;
  double spanBubble = 1.0;
  bool betterThan(const ScheduleScore& other) const {
    const double tolerance = 1e-9 * std::max(1.0, other.makespan);
    if (makespan < other.makespan - tolerance)
      return true;
    return makespan <= other.makespan + tolerance &&
        spanBubble < other.spanBubble - 1e-12;
  }
};

ScheduleScore scoreOf(
    const Schedule& schedule,
    const std::vector<StageCosts>& costs) {
  const Simulation simulation = simulate(schedule, costs);
  if (!simulation.finished)
    return {};
  return {simulation.makespan, simulation.spanBubble};
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
    double weightMemory = 1.0) {
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
  for (const GreedyPolicy& policy : policies) {
    {
      ComputeOrder order;
      try {
        order = GreedyZeroBubble(
                    ranks,
                    placement,
                    microBatches,
                    costs,
                    limit,
                    weightMemory,
                    policy)
                    .run();
      } catch (const ScheduleError&) {
        continue;
      }
      const ScheduleScore score =
          scoreOf(order, placement, microBatches, costs);
      if (score.betterThan(bestScore)) {
        best = std::move(order);
        bestScore = score;
      }
    }
  }
  if (best.empty())
    throw ScheduleError("zero-bubble scheduler: no rank can make progress");
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

CheckpointMode parseCheckpointMode(const std::string& name) {
  if (name == "always")
    return CheckpointMode::kAlways;
  if (name == "except_last")
    return CheckpointMode::kExceptLast;
  if (name == "never")
    return CheckpointMode::kNever;
  throw ScheduleError(
      "unknown checkpoint mode '" + name +
      "' (expected always, except_last or never)");
}

const char* checkpointModeName(CheckpointMode mode) {
  switch (mode) {
    case CheckpointMode::kAlways:
      return "always";
    case CheckpointMode::kExceptLast:
      return "except_last";
    case CheckpointMode::kNever:
      return "never";
  }
  return "?";
}

bool isCheckpointed(CheckpointMode mode, int microBatch, int keptMicroBatch) {
  switch (mode) {
    case CheckpointMode::kAlways:
      return true;
    case CheckpointMode::kExceptLast:
      return microBatch != keptMicroBatch;
    case CheckpointMode::kNever:
      return false;
  }
  return false;
}

const std::vector<std::string>& scheduleNames() {
  static const std::vector<std::string> names = {
      "gpipe",
      "1f1b",
      "interleaved-1f1b",
      "zb-h1",
      "zb-h2",
      "zb-v",
      "auto",
      "dualpipev"};
  return names;
}

// Fill-drain: all forwards, then all backwards in micro-batch order. The
// order of the backwards is the order in which each parameter's gradient
// sums its micro-batches' parts, and float addition is not associative:
// running them as every other schedule (and a sequential micro-batched
// loop) does keeps gpipe's gradients bit-identical to theirs. Reversed, the
// last rounding bits differed, and ill-conditioned models (batch norm over
// a few samples) amplified that into visibly different training.
Schedule gpipeSchedule(int ranks, int microBatches, CheckpointMode mode) {
  requireCounts(ranks, microBatches, 1);
  ComputeOrder order(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    for (int mb = 0; mb < microBatches; ++mb) {
      order[rank].push_back({Pass::kForward, rank, mb});
    }
    for (int mb = 0; mb < microBatches; ++mb) {
      order[rank].push_back({Pass::kBackward, rank, mb});
    }
  }
  return lower("gpipe", ranks, 1, microBatches, mode, order);
}

// PipeDream-flush: stage s runs p - s - 1 warm-up forwards, so at most p - s
// micro-batches are stashed at once.
Schedule oneFOneBSchedule(int ranks, int microBatches, CheckpointMode mode) {
  requireCounts(ranks, microBatches, 1);
  ComputeOrder order(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    const int warmup = std::min(ranks - rank - 1, microBatches);
    order[rank] = oneFOneBOrder(rank, warmup, microBatches, Pass::kBackward);
  }
  return lower("1f1b", ranks, 1, microBatches, mode, order);
}

// Megatron-LM's interleaved 1F1B: rank r holds model chunks (stages)
// r, r + p, ..., and walks them in groups of p micro-batches, so the
// pipeline fills v times faster. Needs m to be a multiple of p.
Schedule interleavedSchedule(
    int ranks,
    int microBatches,
    int virtualStages,
    CheckpointMode mode) {
  requireCounts(ranks, microBatches, virtualStages);
  if (virtualStages == 1) {
    Schedule schedule = oneFOneBSchedule(ranks, microBatches, mode);
    schedule.name = "interleaved-1f1b";
    return schedule;
  }
  if (microBatches % ranks != 0) {
    throw ScheduleError(
        "interleaved-1f1b needs micro-batches to be a multiple of the "
        "pipeline ranks: " +
        std::to_string(microBatches) + " % " + std::to_string(ranks) + " != 0");
  }
  const int total = microBatches * virtualStages;
  auto microBatchOfStep = [&](int k) {
    return (k / (ranks * virtualStages)) * ranks + k % ranks;
  };
  ComputeOrder order(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    auto forward = [&](int k) {
      const int chunk = (k / ranks) % virtualStages;
      return ComputeStep{
          Pass::kForward, chunk * ranks + rank, microBatchOfStep(k)};
    };
    auto backward = [&](int k) {
      const int chunk = virtualStages - 1 - (k / ranks) % virtualStages;
      return ComputeStep{
          Pass::kBackward, chunk * ranks + rank, microBatchOfStep(k)};
    };
    const int warmup = microBatches == ranks
        ? total
        : std::min(total, (ranks - rank - 1) * 2 + (virtualStages - 1) * ranks);
    auto& steps = order[rank];
    for (int k = 0; k < warmup; ++k)
      steps.push_back(forward(k));
    for (int k = 0; k < total - warmup; ++k) {
      steps.push_back(forward(warmup + k));
      steps.push_back(backward(k));
    }
    for (int k = total - warmup; k < total; ++k)
      steps.push_back(backward(k));
  }
  return lower(
      "interleaved-1f1b", ranks, virtualStages, microBatches, mode, order);
}

// Zero-bubble ZB-H1 (Qi et al. 2023): 1F1B with the backward split into B
// (input gradient, on the critical path) and W (weight gradient). Stage s
// holds back its first s W passes and runs them in the drain, where 1F1B
// idles; every stage then stashes at most p micro-batches, 1F1B's peak.
Schedule zeroBubbleH1Schedule(
    int ranks,
    int microBatches,
    CheckpointMode mode) {
  requireCounts(ranks, microBatches, 1);
  ComputeOrder order(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    const int warmup = std::min(ranks - rank - 1, microBatches);
    auto& steps = order[rank];
    int nextWeight = 0;
    int inputsDone = 0;
    for (const ComputeStep& step :
         oneFOneBOrder(rank, warmup, microBatches, Pass::kBackwardInput)) {
      steps.push_back(step);
      if (step.pass != Pass::kBackwardInput)
        continue;
      ++inputsDone;
      const bool steady = step.microBatch < microBatches - warmup;
      if (!steady || inputsDone > rank) {
        steps.push_back({Pass::kBackwardWeight, rank, nextWeight++});
      }
    }
    while (nextWeight < microBatches) {
      steps.push_back({Pass::kBackwardWeight, rank, nextWeight++});
    }
  }
  return lower("zb-h1", ranks, 1, microBatches, mode, order);
}

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
      ranks, placement, microBatches, costs, limit, weightPassMemory);
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

Schedule forwardOnlySchedule(
    int ranks,
    int virtualStages,
    int microBatches,
    const std::vector<int>& placement) {
  requireCounts(ranks, microBatches, virtualStages);
  Schedule placed;
  placed.ranks = ranks;
  placed.virtualStages = virtualStages;
  placed.placement = placement;
  ComputeOrder order(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    for (int stage : placed.stagesOfRank(rank)) {
      for (int mb = 0; mb < microBatches; ++mb) {
        order[rank].push_back({Pass::kForward, stage, mb});
      }
    }
  }
  Schedule schedule = lower(
      "forward-only",
      ranks,
      virtualStages,
      microBatches,
      CheckpointMode::kNever,
      order);
  schedule.training = false;
  schedule.placement = placement;
  return schedule;
}

Schedule zeroBubbleVSchedule(int ranks, int microBatches, CheckpointMode mode) {
  requireCounts(ranks, microBatches, 2);
  const std::vector<int> placement = vPlacement(ranks);
  // Each stage is half a 1F1B stage: 2p of them in flight on a rank hold
  // what 1F1B's first stage holds (p whole micro-batches).
  const std::vector<int> limit(ranks, 2 * ranks);
  const ComputeOrder order =
      bestGreedy(ranks, placement, microBatches, {StageCosts{}}, limit);
  Schedule schedule = lower("zb-v", ranks, 2, microBatches, mode, order);
  schedule.placement = placement;
  return schedule;
}

// DeepSeek's DualPipeV (as torch.distributed.pipelining's
// ScheduleDualPipeV builds it): rank r holds stage r (chunk 0, going down)
// and stage 2p - 1 - r (chunk 1, coming back). Each rank runs eight phases;
// I is an input pass whose weight pass waits in a queue for a W.
Schedule dualPipeVSchedule(int ranks, int microBatches, CheckpointMode mode) {
  requireCounts(ranks, microBatches, 2);
  const int p = ranks, m = microBatches;
  if (m < 2 * p) {
    throw ScheduleError(
        "schedule 'dualpipev' needs at least as many micro-batches as stages (" +
        std::to_string(2 * p) + " for " + std::to_string(p) + " ranks), got " +
        std::to_string(m));
  }
  ComputeOrder order(p);
  for (int r = 0; r < p; ++r) {
    auto& steps = order[r];
    const int down = r, up = 2 * p - 1 - r; // chunk 0 and chunk 1
    int next[2] = {0, 0}, nextBackward[2] = {0, 0};
    std::deque<std::pair<int, int>> weights; // (stage, micro-batch)
    auto stageOf = [&](int chunk) { return chunk == 0 ? down : up; };
    auto forward = [&](int chunk, bool overlapped = false) {
      steps.push_back(
          {Pass::kForward, stageOf(chunk), next[chunk]++, overlapped});
    };
    auto backward = [&](int chunk, bool split) {
      const int stage = stageOf(chunk), mb = nextBackward[chunk]++;
      steps.push_back(
          {split ? Pass::kBackwardInput : Pass::kBackward, stage, mb});
      if (split)
        weights.emplace_back(stage, mb);
    };
    auto weight = [&] {
      steps.push_back(
          {Pass::kBackwardWeight,
           weights.front().first,
           weights.front().second});
      weights.pop_front();
    };
    // Forward of `chunkF` overlapped with the whole backward of the other.
    auto pair = [&](int chunkF) {
      forward(chunkF, true);
      backward(1 - chunkF, false);
    };
    // 1: warm-up forwards of chunk 0.
    for (int i = 0; i < (p - r - 1) * 2; ++i)
      forward(0);
    // 2: forwards of both chunks.
    for (int i = 0; i < r + 1; ++i) {
      forward(0);
      forward(1);
    }
    // 3: chunk 1's split backward, its weight pass at once, a forward.
    for (int i = 0; i < p - r - 1; ++i) {
      backward(1, true);
      weight();
      forward(1);
    }
    // 4: the steady state, overlapped pairs (the last rank starts with a
    // forward and a backward apart).
    for (int i = 0; i < m - 2 * p + r + 1; ++i) {
      if (i == 0 && r == p - 1) {
        forward(0);
        backward(1, false);
      } else {
        pair(0);
      }
      pair(1);
    }
    // 5: chunk 1's backwards, each with a pair.
    for (int i = 0; i < p - r - 1; ++i) {
      backward(1, false);
      pair(1);
    }
    // 6: backwards of both chunks; from the middle on, split.
    bool split = false;
    for (int i = 0; i < r + 1; ++i) {
      if (i == (r + 1) / 2 && r % 2 == 1)
        split = true;
      backward(1, split);
      if (i == (r + 1) / 2 && r % 2 == 0)
        split = true;
      backward(0, split);
    }
    // 7: a queued weight pass, then chunk 0's split backward.
    for (int i = 0; i < p - r - 1; ++i) {
      weight();
      backward(0, true);
    }
    // 8: the remaining weight passes.
    while (!weights.empty())
      weight();
  }
  Schedule schedule = lower("dualpipev", p, 2, m, mode, order);
  schedule.placement = vPlacement(p);
  return schedule;
}

bool isVShaped(ScheduleKind kind) {
  return kind == ScheduleKind::kZeroBubbleV || kind == ScheduleKind::kDualPipeV;
}

const char* scheduleKindName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGpipe:
      return "gpipe";
    case ScheduleKind::kOneFOneB:
      return "1f1b";
    case ScheduleKind::kInterleaved:
      return "interleaved-1f1b";
    case ScheduleKind::kZeroBubbleH1:
      return "zb-h1";
    case ScheduleKind::kZeroBubbleH2:
      return "zb-h2";
    case ScheduleKind::kZeroBubbleV:
      return "zb-v";
    case ScheduleKind::kAuto:
      return "auto";
    case ScheduleKind::kDualPipeV:
      return "dualpipev";
  }
  return "?";
}

ScheduleSource::ScheduleSource(const std::string& text) {
  for (auto kind :
       {ScheduleKind::kGpipe,
        ScheduleKind::kOneFOneB,
        ScheduleKind::kInterleaved,
        ScheduleKind::kZeroBubbleH1,
        ScheduleKind::kZeroBubbleH2,
        ScheduleKind::kZeroBubbleV,
        ScheduleKind::kAuto,
        ScheduleKind::kDualPipeV}) {
    if (text == scheduleKindName(kind)) {
      kind_ = kind;
      known_ = true;
      return;
    }
  }
  auto endsWith = [&](const char* suffix) {
    const size_t n = std::char_traits<char>::length(suffix);
    return text.size() > n && text.compare(text.size() - n, n, suffix) == 0;
  };
  if (endsWith(".json") || endsWith(".csv")) {
    path_ = text;
    return;
  }
  unknown_ = text;
}

ScheduleSource ScheduleSource::file(const std::string& path) {
  ScheduleSource source;
  source.known_ = false;
  source.path_ = path;
  return source;
}

std::string ScheduleSource::text() const {
  if (isFile())
    return path_;
  return known_ ? scheduleKindName(kind_) : unknown_;
}

namespace {

Schedule loadMatching(const ScheduleSpec& spec) {
  const std::string& file = spec.source.path();
  Schedule loaded =
      file.size() > 4 && file.compare(file.size() - 4, 4, ".csv") == 0
      ? loadScheduleCsv(file, spec.checkpoint)
      : loadScheduleFile(file);
  if (loaded.ranks != spec.ranks ||
      loaded.virtualStages != spec.virtualStages) {
    throw ScheduleError(
        "schedule " + file + " is for " + std::to_string(loaded.ranks) +
        " rank(s) x " + std::to_string(loaded.virtualStages) +
        " virtual stage(s); the pipeline has " + std::to_string(spec.ranks) +
        " x " + std::to_string(spec.virtualStages));
  }
  if (loaded.microBatches != spec.microBatches) {
    throw ScheduleError(
        "schedule " + file + " has " + std::to_string(loaded.microBatches) +
        " micro-batches; the pipeline has " +
        std::to_string(spec.microBatches));
  }
  if (!loaded.training)
    throw ScheduleError("schedule " + file + " is an inference schedule");
  return loaded;
}

// Every rank lists every micro-batch of each of its stages: bounded so a
// typo cannot ask for gigabytes of instructions.
void checkSize(const ScheduleSpec& spec) {
  const int64_t size =
      int64_t{spec.ranks} * spec.virtualStages * spec.microBatches;
  if (spec.ranks < 1 || spec.microBatches < 1 || spec.virtualStages < 1 ||
      size > (int64_t{1} << 22)) {
    throw ScheduleError(
        "a schedule of " + std::to_string(spec.ranks) + " rank(s) x " +
        std::to_string(spec.virtualStages) + " virtual stage(s) x " +
        std::to_string(spec.microBatches) +
        " micro-batches is out of range (each at least 1, "
        "their product at most 4194304)");
  }
}

} // namespace

Schedule makeSchedule(const ScheduleSpec& spec) {
  if (spec.source.isFile())
    return loadMatching(spec);
  if (!spec.source.isBuiltIn()) {
    std::ostringstream message;
    message << "unknown schedule '" << spec.source.text()
            << "' (expected one of:";
    for (const auto& name : scheduleNames())
      message << ' ' << name;
    message << ", or a schedule file *.json)";
    throw ScheduleError(message.str());
  }
  checkSize(spec);
  const ScheduleKind kind = spec.source.kind();
  if (isVShaped(kind) && spec.virtualStages != 2) {
    throw ScheduleError(
        "schedule '" + spec.source.text() +
        "' lays two stages on each rank: it needs 2 virtual "
        "stages, got " +
        std::to_string(spec.virtualStages));
  }
  if (kind != ScheduleKind::kInterleaved && !isVShaped(kind) &&
      spec.virtualStages != 1) {
    throw ScheduleError(
        "schedule '" + spec.source.text() +
        "' has one stage per rank; virtual stages (" +
        std::to_string(spec.virtualStages) +
        ") need 'interleaved-1f1b', 'zb-v' or 'dualpipev'");
  }
  Schedule schedule;
  switch (kind) {
    case ScheduleKind::kGpipe:
      schedule = gpipeSchedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kOneFOneB:
      schedule =
          oneFOneBSchedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kInterleaved:
      schedule = interleavedSchedule(
          spec.ranks, spec.microBatches, spec.virtualStages, spec.checkpoint);
      break;
    case ScheduleKind::kZeroBubbleH1:
      schedule =
          zeroBubbleH1Schedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kZeroBubbleH2:
      schedule =
          zeroBubbleH2Schedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kZeroBubbleV:
      schedule =
          zeroBubbleVSchedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kDualPipeV:
      schedule =
          dualPipeVSchedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kAuto:
      schedule = autoSchedule(
          spec.ranks,
          spec.microBatches,
          spec.checkpoint,
          spec.costs,
          std::vector<int>(
              spec.ranks,
              spec.inFlightLimit > 0 ? spec.inFlightLimit : spec.ranks),
          spec.weightPassMemory);
      break;
  }
  validate(schedule);
  return schedule;
}

} // namespace tpipe
