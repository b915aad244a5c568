// The simulator: a schedule's instruction lists replayed in time under
// per-stage costs, for the validator's deadlock check, the bubble reports,
// the partitioner's and the tuner's predictions.
#include <algorithm>
#include <sstream>
#include <utility>

#include "overloaded.h"
#include "tpipe/schedule.h"

namespace tpipe {
namespace {

// Replays a schedule's instruction lists in time: each rank runs its list in
// order, a receive waits for its send, compute takes its stage's cost.
class Simulator {
 public:
  Simulator(const Schedule& schedule, const std::vector<StageCosts>& costs)
      : schedule_(schedule),
        costs_(costs),
        stages_(schedule.stages()),
        m_(schedule.microBatches),
        activationReady_(static_cast<size_t>(stages_) * m_, -1.0),
        gradReady_(static_cast<size_t>(stages_) * m_, -1.0),
        stashed_(stages_, 0),
        live_(stages_, 0),
        next_(schedule.ranks, 0),
        clock_(schedule.ranks, 0.0),
        firstStart_(schedule.ranks, -1.0),
        lastEnd_(schedule.ranks, 0.0),
        pairedForward_(schedule.ranks, -1.0) {
    const int size = static_cast<int>(costs.size());
    if (size != 1 && size != stages_ && size != schedule.chainLength()) {
      throw ScheduleError(
          "simulate: expected 1 or " + std::to_string(stages_) +
          (schedule.chains > 1 ? " (or one chain's " +
                   std::to_string(schedule.chainLength()) + ")"
                               : std::string()) +
          " stage costs, got " + std::to_string(costs.size()));
    }
    size_t instructions = 0;
    for (const auto& list : schedule.perRank)
      instructions += list.size();
    result_.timeline.reserve(instructions);
    result_.busy.assign(schedule.ranks, 0.0);
    result_.idle.assign(schedule.ranks, 0.0);
    result_.peakStashed.assign(stages_, 0);
    result_.peakLive.assign(stages_, 0);
  }

  Simulation run() {
    for (bool progress = true; progress;) {
      progress = false;
      for (int rank = 0; rank < schedule_.ranks; ++rank) {
        while (next_[rank] < schedule_.perRank[rank].size() && step(rank))
          progress = true;
      }
    }
    finish();
    return std::move(result_); // run once: the timeline is not copied
  }

 private:
  const StageCosts& cost(int stage) const {
    // Per stage of a chain: a copy costs what its original does.
    if (costs_.size() == 1)
      return costs_[0];
    return static_cast<int>(costs_.size()) == stages_
        ? costs_[stage]
        : costs_[schedule_.modelStage(stage)];
  }
  size_t index(int stage, int mb) const {
    return static_cast<size_t>(stage) * m_ + mb;
  }

  void bump(int stage, int stashDelta, int liveDelta) {
    stashed_[stage] += stashDelta;
    live_[stage] += liveDelta;
    result_.peakStashed[stage] =
        std::max(result_.peakStashed[stage], stashed_[stage]);
    result_.peakLive[stage] = std::max(result_.peakLive[stage], live_[stage]);
  }

  // Runs the rank's next instruction; false when it waits for a transfer.
  bool step(int rank) {
    const Instruction& instruction = schedule_.perRank[rank][next_[rank]];
    const int s = stageOf(instruction);
    const int mb = microBatchOf(instruction);
    const StageCosts& c = cost(s);
    double start = clock_[rank];
    double duration = 0.0;
    bool blocked = false;
    auto await = [&](double ready) {
      blocked = ready < 0;
      start = std::max(start, ready);
    };
    std::visit(
        Overloaded{
            [&](const Forward& f) {
              duration = c.forward, bump(s, 1, f.checkpointed ? 0 : 1);
              pairedForward_[rank] = f.overlapsBackward ? c.forward : -1.0;
            },
            [&](const Recompute&) { duration = c.recompute, bump(s, 0, 1); },
            [&](const Backward&) {
              duration = c.backward, bump(s, -1, -1);
              // The second half of an overlapped pair: the part hidden
              // under the forward just run is not spent again.
              if (pairedForward_[rank] >= 0) {
                duration -=
                    c.overlap * std::min(pairedForward_[rank], c.backward);
                pairedForward_[rank] = -1.0;
              }
            },
            [&](const BackwardInput&) { duration = c.backwardInput; },
            [&](const BackwardWeight&) {
              duration = c.backwardWeight, bump(s, -1, -1);
            },
            [&](const SendActivation&) {
              activationReady_[index(s, mb)] = start + c.transfer;
            },
            [&](const SendGrad&) {
              gradReady_[index(s, mb)] = start + cost(s - 1).transfer;
            },
            [&](const RecvActivation&) {
              await(
                  schedule_.hasPrevious(s) ? activationReady_[index(s - 1, mb)]
                                           : -1);
            },
            [&](const RecvGrad&) {
              await(schedule_.hasNext(s) ? gradReady_[index(s + 1, mb)] : -1);
            }},
        instruction);
    if (blocked)
      return false;
    const double end = start + duration;
    if (isCompute(instruction)) {
      result_.busy[rank] += duration;
      if (firstStart_[rank] < 0)
        firstStart_[rank] = start;
      lastEnd_[rank] = end;
    }
    result_.timeline.push_back(
        {rank, static_cast<int>(next_[rank]), start, end});
    clock_[rank] = end;
    ++next_[rank];
    return true;
  }

  void finish() {
    std::ostringstream stuck;
    for (int rank = 0; rank < schedule_.ranks; ++rank) {
      const auto& list = schedule_.perRank[rank];
      if (next_[rank] < list.size()) {
        result_.finished = false;
        stuck << "rank " << rank << " waits at instruction " << next_[rank]
              << " (" << shortLabel(list[next_[rank]]) << "); ";
      }
    }
    result_.stuck = stuck.str();
    if (!result_.stuck.empty())
      result_.stuck.resize(result_.stuck.size() - 2);
    result_.makespan = *std::max_element(clock_.begin(), clock_.end());
    double idle = 0.0;
    for (int rank = 0; rank < schedule_.ranks; ++rank) {
      result_.idle[rank] = result_.makespan - result_.busy[rank];
      idle += result_.idle[rank];
    }
    result_.bubbleFraction = result_.makespan > 0
        ? idle / (schedule_.ranks * result_.makespan)
        : 0.0;
    double worstIdle = 0.0, mostWork = 0.0;
    result_.span.assign(schedule_.ranks, 0.0);
    for (int rank = 0; rank < schedule_.ranks; ++rank) {
      if (firstStart_[rank] >= 0)
        result_.span[rank] = lastEnd_[rank] - firstStart_[rank];
      worstIdle = std::max(worstIdle, result_.span[rank] - result_.busy[rank]);
      mostWork = std::max(mostWork, result_.busy[rank]);
    }
    result_.spanBubble =
        worstIdle > 0 ? worstIdle / (mostWork + worstIdle) : 0.0;
  }

  const Schedule& schedule_;
  const std::vector<StageCosts>& costs_;
  int stages_, m_;
  // Time at which a sent tensor is available to its receiver; < 0: not sent.
  std::vector<double> activationReady_, gradReady_;
  std::vector<int> stashed_, live_;
  std::vector<size_t> next_;
  std::vector<double> clock_, firstStart_, lastEnd_;
  // Per rank: the duration of an overlapped forward whose backward is next;
  // < 0: none.
  std::vector<double> pairedForward_;
  Simulation result_;
};

} // namespace

Simulation simulate(
    const Schedule& schedule,
    const std::vector<StageCosts>& costs) {
  return Simulator(schedule, costs).run();
}

double sharedCoresMakespan(
    const Schedule& schedule,
    const Simulation& simulation,
    const CoreSharing& sharing) {
  if (sharing.cores <= 0.0)
    return simulation.makespan;
  // +1 where a compute starts, -1 where one ends; the ends first at a tie.
  std::vector<std::pair<double, int>> edges;
  for (const TimedInstruction& t : simulation.timeline) {
    if (t.end > t.start &&
        isCompute(schedule.perRank[t.rank][static_cast<size_t>(t.index)])) {
      edges.emplace_back(t.start, 1);
      edges.emplace_back(t.end, -1);
    }
  }
  std::sort(edges.begin(), edges.end());
  double stretched = 0.0, last = 0.0;
  int computing = 0;
  for (const auto& [time, change] : edges) {
    const double demand = computing * sharing.coresPerRank / sharing.cores;
    stretched += (time - last) * std::max(1.0, demand);
    last = time;
    computing += change;
  }
  return stretched + (simulation.makespan - last);
}

double steadyStepTime(
    const Schedule& schedule,
    const std::vector<StageCosts>& costs,
    const CoreSharing& sharing) {
  // Step k's micro-batches are numbered k m .. k m + m - 1, so transfers of
  // different steps never meet; each rank's lists simply follow each other.
  constexpr int kSteps = 3;
  const int m = schedule.microBatches;
  auto repeated = [&](int steps) {
    Schedule run = schedule;
    run.microBatches = m * steps;
    for (int rank = 0; rank < schedule.ranks; ++rank) {
      auto& list = run.perRank[rank];
      list.clear();
      for (int step = 0; step < steps; ++step) {
        for (Instruction instruction : schedule.perRank[rank]) {
          std::visit([&](auto& op) { op.microBatch += step * m; }, instruction);
          list.push_back(instruction);
        }
      }
    }
    const Simulation simulation = simulate(run, costs);
    if (!simulation.finished)
      throw ScheduleError("steady step: stalls: " + simulation.stuck);
    return sharedCoresMakespan(run, simulation, sharing);
  };
  return (repeated(kSteps) - repeated(1)) / (kSteps - 1);
}

double theoreticalBubble(int stages, int microBatches) {
  return static_cast<double>(stages - 1) / (microBatches + stages - 1);
}

namespace {

// DeepSeek's arm: the ranks a micro-batch crosses one way (-1: not theirs).
int dualPipeArm(const Schedule& schedule) {
  if (schedule.name == "dualpipe")
    return schedule.ranks / 2;
  if (schedule.name == "dualpipev")
    return schedule.ranks;
  return -1;
}

} // namespace

double theoreticalBubble(const Schedule& schedule) {
  const int arm = dualPipeArm(schedule);
  if (arm > 0 && schedule.ranks > 0) {
    const double idle = 2.0 * (arm - 1);
    const double work =
        3.0 * schedule.microBatches * schedule.chainLength() / schedule.ranks;
    return idle / (work + idle);
  }
  return theoreticalBubble(
      schedule.ranks, schedule.microBatches * schedule.virtualStages);
}

double spanBubbleLowerBound(
    int ranks,
    int microBatches,
    const std::vector<StageCosts>& costs) {
  if (ranks < 1 || microBatches < 1 ||
      (costs.size() != 1 && static_cast<int>(costs.size()) != ranks)) {
    throw ScheduleError(
        "span bubble bound: expected 1 or " + std::to_string(ranks) +
        " stage costs and at least one micro-batch");
  }
  auto cost = [&](int s) -> const StageCosts& {
    return costs.size() == 1 ? costs[0] : costs[s];
  };
  const int last = ranks - 1;
  const double lastStage =
      microBatches * (cost(last).forward + cost(last).backwardInput);
  double mostWork = 0.0, worstIdle = 0.0;
  // Walks up from the last stage: `way` is the time down from stage r to
  // the last stage and back up, transfers included.
  double way = 0.0;
  for (int r = last; r >= 0; --r) {
    const StageCosts& c = cost(r);
    if (r < last)
      way += c.forward + c.backwardInput + 2 * c.transfer;
    const double work =
        microBatches * (c.forward + c.backwardInput + c.backwardWeight);
    const double span = way + lastStage + c.backwardWeight;
    mostWork = std::max(mostWork, work);
    worstIdle = std::max(worstIdle, span - work);
  }
  return worstIdle > 0 ? worstIdle / (mostWork + worstIdle) : 0.0;
}

std::string theoreticalBubbleFormula(const Schedule& schedule) {
  if (dualPipeArm(schedule) > 0) {
    return std::string("DeepSeek's (") +
        (schedule.name == "dualpipe" ? "PP/2" : "PP") +
        " - 1)(F&B + B - 3W) over the step: equal stages, F = I = W";
  }
  return "(p - 1) / (v m + p - 1): fill-drain, 1F1B and interleaved with "
         "equal stages";
}

} // namespace tpipe
