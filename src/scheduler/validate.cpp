// The one validator every schedule passes before it runs; its deadlock
// check is a unit-cost dry run of the simulator (simulate.cpp).
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
  if (schedule.hasPrevious(stage) &&
      (p.recvActivation < 0 || p.recvActivation > p.forward)) {
    fail(
        schedule, "missing receive of the activation before forward for " + at);
  }
  if (schedule.hasNext(stage) &&
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
  if (schedule.hasPrevious(stage)) {
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
    fail(
        schedule,
        (stage == 0
             ? std::string("stage 0")
             : "stage " + std::to_string(stage) + ", its chain's first,") +
            " has no previous stage to talk to (" + at + ")");
  }
  if (schedule.hasNext(stage)) {
    if (p.sendActivation < 0 || p.sendActivation < p.forward) {
      fail(schedule, "missing send of the activation after forward for " + at);
    }
    if (p.recvGrad < 0 || p.recvGrad > gradientPass) {
      fail(
          schedule,
          "missing receive of the gradient before backward for " + at);
    }
  } else if (p.sendActivation >= 0 || p.recvGrad >= 0) {
    fail(
        schedule,
        std::string(
            schedule.chains == 1 ? "the last stage"
                                 : "the last stage of a chain") +
            " has no next stage to talk to (" + at + ")");
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
    if (!schedule.hasNext(b))
      continue; // the boundary between two chains carries nothing
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
  // Equal chains, and micro-batches that split evenly over them: back-to-
  // back steps (steadyStepTime) number the next step's from m on.
  if (schedule.chains < 1 || stages % schedule.chains != 0 ||
      schedule.microBatches % schedule.chains != 0) {
    fail(
        schedule,
        "its " + std::to_string(stages) + " stages and " +
            std::to_string(schedule.microBatches) +
            " micro-batches cannot form " + std::to_string(schedule.chains) +
            " chains of equal length and share");
  }
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
      if (!schedule.runs(stage, mb)) {
        const int first = schedule.firstStageOf(mb);
        fail(
            schedule,
            "rank " + std::to_string(rank) + " runs " +
                shortLabel(instruction) + " of stage " + std::to_string(stage) +
                ", but micro-batch " + std::to_string(mb) + " runs chain " +
                std::to_string(schedule.chainOf(mb)) + " (stages " +
                std::to_string(first) + " to " +
                std::to_string(schedule.lastStageOf(mb)) + ")");
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
      if (schedule.runs(stage, mb))
        checkStageMicroBatch(schedule, positions[stage * m + mb], stage, mb);
    }
  }
  const Simulation dryRun = simulate(schedule, {StageCosts{}});
  if (!dryRun.finished)
    fail(schedule, "deadlock: " + dryRun.stuck);
}

} // namespace tpipe
