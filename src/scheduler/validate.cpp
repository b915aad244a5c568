// The one validator every schedule passes before it runs, and the simulator
// whose unit-cost dry run is the validator's deadlock check.
#include <algorithm>
#include <sstream>

#include "overloaded.h"
#include "tpipe/schedule.h"

namespace tpipe {
namespace {

// Position of each instruction kind for one (stage, micro-batch) in its
// rank's list; -1 when absent.
struct Positions {
  int forward = -1;
  int recompute = -1;
  int backward = -1;
  int backwardInput = -1;
  int backwardWeight = -1;
  int sendActivation = -1;
  int recvActivation = -1;
  int sendGrad = -1;
  int recvGrad = -1;
  bool checkpointed = false;
};

std::string where(int stage, int microBatch) {
  return "stage " + std::to_string(stage) + ", micro-batch " +
      std::to_string(microBatch);
}

[[noreturn]] void fail(const Schedule& schedule, const std::string& what) {
  throw ScheduleError("invalid schedule '" + schedule.name + "': " + what);
}

void record(
    const Schedule& schedule,
    int& slot,
    int position,
    const Instruction& instruction) {
  if (slot >= 0) {
    fail(
        schedule,
        std::string(opName(instruction)) + " appears twice for " +
            where(stageOf(instruction), microBatchOf(instruction)));
  }
  slot = position;
}

int* slotFor(Positions& p, const Instruction& instruction) {
  return std::visit(
      Overloaded{
          [&](const Forward&) { return &p.forward; },
          [&](const Recompute&) { return &p.recompute; },
          [&](const Backward&) { return &p.backward; },
          [&](const BackwardInput&) { return &p.backwardInput; },
          [&](const BackwardWeight&) { return &p.backwardWeight; },
          [&](const SendActivation&) { return &p.sendActivation; },
          [&](const RecvActivation&) { return &p.recvActivation; },
          [&](const SendGrad&) { return &p.sendGrad; },
          [&](const RecvGrad&) { return &p.recvGrad; }},
      instruction);
}

void checkInference(
    const Schedule& schedule,
    const Positions& p,
    int stage,
    const std::string& at) {
  if (p.backward >= 0 || p.backwardInput >= 0 || p.backwardWeight >= 0 ||
      p.recompute >= 0 || p.sendGrad >= 0 || p.recvGrad >= 0 ||
      p.checkpointed) {
    fail(schedule, "an inference schedule only forwards; see " + at);
  }
  if (stage > 0 && (p.recvActivation < 0 || p.recvActivation > p.forward)) {
    fail(
        schedule, "missing receive of the activation before forward for " + at);
  }
  if (stage < schedule.stages() - 1 &&
      (p.sendActivation < 0 || p.sendActivation < p.forward)) {
    fail(schedule, "missing send of the activation after forward for " + at);
  }
}

// The backward (whole or split), and recompute between forward and it.
// Returns the position of the pass that produces the input gradient.
int checkBackward(
    const Schedule& schedule,
    const Positions& p,
    const std::string& at) {
  const bool split = p.backwardInput >= 0 || p.backwardWeight >= 0;
  if (split && p.backward >= 0)
    fail(schedule, "both backward and backward_input/weight for " + at);
  if (split && (p.backwardInput < 0 || p.backwardWeight < 0)) {
    fail(
        schedule,
        "backward_input and backward_weight must both appear for " + at);
  }
  if (!split && p.backward < 0)
    fail(schedule, "no backward for " + at);
  const int gradientPass = split ? p.backwardInput : p.backward;
  if (gradientPass < p.forward)
    fail(schedule, "backward before forward for " + at);
  if (split && p.backwardWeight < p.backwardInput) {
    fail(schedule, "backward_weight before backward_input for " + at);
  }
  if (p.checkpointed) {
    if (p.recompute < 0)
      fail(schedule, "checkpointed forward without recompute for " + at);
    if (p.recompute < p.forward || p.recompute > gradientPass) {
      fail(
          schedule,
          "recompute must come between forward and backward for " + at);
    }
  } else if (p.recompute >= 0) {
    fail(
        schedule, "recompute of a forward that kept its activations for " + at);
  }
  return gradientPass;
}

// Each transfer with the neighbouring stages, in the right order.
void checkTransfers(
    const Schedule& schedule,
    const Positions& p,
    int stage,
    int gradientPass,
    const std::string& at) {
  if (stage > 0) {
    if (p.recvActivation < 0 || p.recvActivation > p.forward) {
      fail(
          schedule,
          "missing receive of the activation before forward for " + at);
    }
    if (p.sendGrad < 0 || p.sendGrad < gradientPass) {
      fail(
          schedule,
          "missing send of the input gradient after backward for " + at);
    }
  } else if (p.recvActivation >= 0 || p.sendGrad >= 0) {
    fail(schedule, "stage 0 has no previous stage to talk to (" + at + ")");
  }
  if (stage < schedule.stages() - 1) {
    if (p.sendActivation < 0 || p.sendActivation < p.forward) {
      fail(schedule, "missing send of the activation after forward for " + at);
    }
    if (p.recvGrad < 0 || p.recvGrad > gradientPass) {
      fail(
          schedule,
          "missing receive of the gradient before backward for " + at);
    }
  } else if (p.sendActivation >= 0 || p.recvGrad >= 0) {
    fail(schedule, "the last stage has no next stage to talk to (" + at + ")");
  }
}

void checkStageMicroBatch(
    const Schedule& schedule,
    const Positions& p,
    int stage,
    int mb) {
  const std::string at = where(stage, mb);
  if (p.forward < 0)
    fail(schedule, "no forward for " + at);
  if (!schedule.training)
    return checkInference(schedule, p, stage, at);
  checkTransfers(schedule, p, stage, checkBackward(schedule, p, at), at);
}

} // namespace

namespace {

// The micro-batches of one boundary's transfers in one direction, in the
// order the sending (or receiving) stage's rank lists them.
std::vector<int> transferOrder(
    const Schedule& schedule,
    int boundary,
    bool activations,
    bool sending) {
  const int stage = activations == sending ? boundary : boundary + 1;
  std::vector<int> order;
  for (const auto& instruction :
       schedule.perRank[schedule.rankOfStage(stage)]) {
    const bool match = std::visit(
        [&](const auto& op) {
          using Op = std::decay_t<decltype(op)>;
          if (op.stage != stage)
            return false;
          if (activations)
            return sending ? std::is_same_v<Op, SendActivation>
                           : std::is_same_v<Op, RecvActivation>;
          return sending ? std::is_same_v<Op, SendGrad>
                         : std::is_same_v<Op, RecvGrad>;
        },
        instruction);
    if (match)
      order.push_back(microBatchOf(instruction));
  }
  return order;
}

std::string orderText(const std::vector<int>& order) {
  std::string text;
  for (int microBatch : order)
    text += (text.empty() ? "" : " ") + std::to_string(microBatch);
  return "[" + text + "]";
}

} // namespace

std::string transferOrderMismatch(const Schedule& schedule) {
  for (int b = 0; b + 1 < schedule.stages(); ++b) {
    for (bool activations : {true, false}) {
      const auto sent = transferOrder(schedule, b, activations, true);
      const auto received = transferOrder(schedule, b, activations, false);
      if (sent != received) {
        return "boundary " + std::to_string(b) + "'s " +
            (activations ? "activations" : "gradients") +
            " are sent in micro-batch order " + orderText(sent) +
            " and received in " + orderText(received);
      }
    }
  }
  return "";
}

namespace {

// An overlapped forward pairs with the rank's next compute instruction,
// which must be a whole backward (PyTorch's OVERLAP_F_B).
void checkOverlappedPair(
    const Schedule& schedule,
    const std::vector<Instruction>& list,
    int forwardIndex) {
  for (size_t next = forwardIndex + 1; next < list.size(); ++next) {
    if (!isCompute(list[next]))
      continue;
    if (std::holds_alternative<Backward>(list[next]))
      return;
    break;
  }
  fail(
      schedule,
      shortLabel(list[forwardIndex]) + " of stage " +
          std::to_string(stageOf(list[forwardIndex])) +
          " overlaps a backward, but the next compute instruction of its rank "
          "is not a whole backward");
}

} // namespace

void validate(const Schedule& schedule) {
  if (schedule.ranks < 1 || schedule.virtualStages < 1 ||
      schedule.microBatches < 1) {
    fail(schedule, "ranks, virtual stages and micro-batches must be >= 1");
  }
  if (static_cast<int>(schedule.perRank.size()) != schedule.ranks) {
    fail(
        schedule,
        "has " + std::to_string(schedule.perRank.size()) +
            " instruction lists for " + std::to_string(schedule.ranks) +
            " ranks");
  }
  const int stages = schedule.stages();
  if (!schedule.placement.empty()) {
    if (static_cast<int>(schedule.placement.size()) != stages)
      fail(
          schedule,
          "places " + std::to_string(schedule.placement.size()) +
              " stages, but it has " + std::to_string(stages));
    for (int rank = 0; rank < schedule.ranks; ++rank) {
      if (static_cast<int>(schedule.stagesOfRank(rank).size()) !=
          schedule.virtualStages)
        fail(
            schedule,
            "rank " + std::to_string(rank) + " is placed " +
                std::to_string(schedule.stagesOfRank(rank).size()) +
                " stages, not " + std::to_string(schedule.virtualStages));
    }
  }
  const int m = schedule.microBatches;
  std::vector<Positions> positions(static_cast<size_t>(stages) * m);
  for (int rank = 0; rank < schedule.ranks; ++rank) {
    const auto& list = schedule.perRank[rank];
    for (int i = 0; i < static_cast<int>(list.size()); ++i) {
      const Instruction& instruction = list[i];
      const int stage = stageOf(instruction);
      const int mb = microBatchOf(instruction);
      if (stage < 0 || stage >= stages) {
        fail(
            schedule,
            "rank " + std::to_string(rank) + " instruction " +
                std::to_string(i) + " names stage " + std::to_string(stage) +
                " of " + std::to_string(stages));
      }
      if (mb < 0 || mb >= m) {
        fail(
            schedule,
            "rank " + std::to_string(rank) + " instruction " +
                std::to_string(i) + " names micro-batch " + std::to_string(mb) +
                " of " + std::to_string(m));
      }
      if (schedule.rankOfStage(stage) != rank) {
        fail(
            schedule,
            "rank " + std::to_string(rank) + " runs " +
                shortLabel(instruction) + " of stage " + std::to_string(stage) +
                ", which lives on rank " +
                std::to_string(schedule.rankOfStage(stage)));
      }
      Positions& p = positions[static_cast<size_t>(stage) * m + mb];
      record(schedule, *slotFor(p, instruction), i, instruction);
      if (const auto* forward = std::get_if<Forward>(&instruction)) {
        p.checkpointed = forward->checkpointed;
        if (forward->overlapsBackward)
          checkOverlappedPair(schedule, list, i);
      }
    }
  }
  for (int stage = 0; stage < stages; ++stage) {
    for (int mb = 0; mb < m; ++mb) {
      checkStageMicroBatch(schedule, positions[stage * m + mb], stage, mb);
    }
  }
  const Simulation dryRun = simulate(schedule, {StageCosts{}});
  if (!dryRun.finished)
    fail(schedule, "deadlock: " + dryRun.stuck);
}

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
    if (costs.size() != 1 && static_cast<int>(costs.size()) != stages_) {
      throw ScheduleError(
          "simulate: expected 1 or " + std::to_string(stages_) +
          " stage costs, got " + std::to_string(costs.size()));
    }
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
    return result_;
  }

 private:
  const StageCosts& cost(int stage) const {
    return costs_.size() == 1 ? costs_[0] : costs_[stage];
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
              await(s > 0 ? activationReady_[index(s - 1, mb)] : -1);
            },
            [&](const RecvGrad&) {
              await(s + 1 < stages_ ? gradReady_[index(s + 1, mb)] : -1);
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

double steadyStepTime(
    const Schedule& schedule,
    const std::vector<StageCosts>& costs) {
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
    return simulation.makespan;
  };
  return (repeated(kSteps) - repeated(1)) / (kSteps - 1);
}

double theoreticalBubble(int stages, int microBatches) {
  return static_cast<double>(stages - 1) / (microBatches + stages - 1);
}

double theoreticalBubble(const Schedule& schedule) {
  return theoreticalBubble(
      schedule.ranks, schedule.microBatches * schedule.virtualStages);
}

} // namespace tpipe
