// torch.distributed.pipelining's action CSV, both forms: compute only, and
// lowered with its transfers; written from and read into schedules.
#include <cctype>
#include <cstring>
#include <sstream>

#include "scheduler/compute_order.h"
#include "tpipe/schedule.h"

namespace tpipe {
namespace {

using scheduling::backwardInstruction;
using scheduling::ComputeOrder;
using scheduling::ComputeStep;
using scheduling::keptMicroBatch;
using scheduling::lower;
using scheduling::Pass;

} // namespace

namespace {

// One cell of torch.distributed.pipelining's action CSV: "0F1" (stage 0,
// forward, micro-batch 1), with I, W and B for the backward passes;
// "(0F7;7B3)OVERLAP_F_B" for an overlapped pair; and in the lowered form
// "0SEND_F1", "2RECV_F1", "2SEND_B1", "0RECV_B1" for the transfers.
struct Action {
  enum Kind { kCompute, kSendF, kRecvF, kSendB, kRecvB } kind = kCompute;
  ComputeStep step{Pass::kForward, 0, 0};
};

Action parseAction(const std::string& text, int rank) {
  auto bad = [&](const std::string& why) {
    return ScheduleError(
        "CSV row " + std::to_string(rank) + ": cannot read action '" + text +
        "'" + why);
  };
  size_t at = 0;
  auto number = [&] {
    const size_t start = at;
    while (at < text.size() &&
           std::isdigit(static_cast<unsigned char>(text[at])))
      ++at;
    if (at == start || at - start > 6)
      throw bad("");
    return std::stoi(text.substr(start, at - start));
  };
  Action action;
  action.step.stage = number();
  if (at >= text.size())
    throw bad(": it has no type");
  static const std::pair<const char*, Action::Kind> kTransfers[] = {
      {"SEND_F", Action::kSendF},
      {"RECV_F", Action::kRecvF},
      {"SEND_B", Action::kSendB},
      {"RECV_B", Action::kRecvB}};
  for (const auto& [name, kind] : kTransfers) {
    if (text.compare(at, std::strlen(name), name) == 0) {
      at += std::strlen(name);
      action.kind = kind;
      action.step.microBatch = number();
      if (at != text.size())
        throw bad("");
      return action;
    }
  }
  const char type = text[at++];
  action.step.microBatch = number();
  if (at != text.size())
    throw bad("");
  switch (type) {
    case 'F':
      action.step.pass = Pass::kForward;
      break;
    case 'B':
      action.step.pass = Pass::kBackward;
      break;
    case 'I':
      action.step.pass = Pass::kBackwardInput;
      break;
    case 'W':
      action.step.pass = Pass::kBackwardWeight;
      break;
    default:
      throw bad(
          ": not F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B or "
          "(F;B)OVERLAP_F_B");
  }
  return action;
}

// A cell's actions: one, or the two of an overlapped pair.
std::vector<Action> parseCell(const std::string& text, int rank) {
  const std::string suffix = ")OVERLAP_F_B";
  if (text.front() != '(')
    return {parseAction(text, rank)};
  const size_t semicolon = text.find(';');
  if (text.size() <= suffix.size() ||
      text.compare(text.size() - suffix.size(), suffix.size(), suffix) != 0 ||
      semicolon == std::string::npos) {
    throw ScheduleError(
        "CSV row " + std::to_string(rank) + ": cannot read action '" + text +
        "' (an overlapped pair is written (0F1;3B0)OVERLAP_F_B)");
  }
  Action forward = parseAction(text.substr(1, semicolon - 1), rank);
  const Action backward = parseAction(
      text.substr(semicolon + 1, text.size() - suffix.size() - semicolon - 1),
      rank);
  if (forward.kind != Action::kCompute || forward.step.pass != Pass::kForward ||
      backward.kind != Action::kCompute ||
      backward.step.pass != Pass::kBackward) {
    throw ScheduleError(
        "CSV row " + std::to_string(rank) + ": '" + text +
        "' must pair a forward with a whole backward (F;B)");
  }
  forward.step.overlapsNext = true;
  return {forward, backward};
}

std::vector<std::string> splitCells(const std::string& line) {
  std::vector<std::string> cells;
  std::string cell;
  for (char c : line + ",") {
    if (c == ',') {
      const size_t first = cell.find_first_not_of(" \t\r");
      const size_t last = cell.find_last_not_of(" \t\r");
      cells.push_back(
          first == std::string::npos ? ""
                                     : cell.substr(first, last - first + 1));
      cell.clear();
    } else {
      cell += c;
    }
  }
  return cells;
}

} // namespace

namespace {

// A schedule as action cells, one row per rank; with `comms`, the
// transfers too.
std::string csvOf(const Schedule& schedule, bool comms) {
  if (schedule.chains != 1) {
    throw ScheduleError(
        "schedule '" + schedule.name +
        "' runs two chains of stages (micro-batches enter from both ends); "
        "torch.distributed.pipelining's CSV has no such schedules: write "
        "it with --json");
  }
  std::ostringstream csv;
  for (const auto& list : schedule.perRank) {
    std::vector<std::string> cells;
    bool pairOpen = false;
    for (const Instruction& instruction : list) {
      const std::string at = std::to_string(stageOf(instruction));
      const std::string mb = std::to_string(microBatchOf(instruction));
      std::string cell;
      if (const auto* f = std::get_if<Forward>(&instruction)) {
        cell = at + "F" + mb;
        if (f->overlapsBackward) {
          cells.push_back("(" + cell);
          pairOpen = true;
          continue;
        }
      } else if (std::holds_alternative<Backward>(instruction)) {
        cell = at + "B" + mb;
        if (pairOpen) {
          cells.back() += ";" + cell + ")OVERLAP_F_B";
          pairOpen = false;
          continue;
        }
      } else if (std::holds_alternative<BackwardInput>(instruction)) {
        cell = at + "I" + mb;
      } else if (std::holds_alternative<BackwardWeight>(instruction)) {
        cell = at + "W" + mb;
      } else if (comms && std::holds_alternative<SendActivation>(instruction)) {
        cell = at + "SEND_F" + mb;
      } else if (comms && std::holds_alternative<RecvActivation>(instruction)) {
        cell = at + "RECV_F" + mb;
      } else if (comms && std::holds_alternative<SendGrad>(instruction)) {
        cell = at + "SEND_B" + mb;
      } else if (comms && std::holds_alternative<RecvGrad>(instruction)) {
        cell = at + "RECV_B" + mb;
      } else {
        continue; // recomputes are derived; transfers too without comms
      }
      cells.push_back(cell);
    }
    for (size_t i = 0; i < cells.size(); ++i)
      csv << (i ? "," : "") << cells[i];
    csv << '\n';
  }
  return csv.str();
}

} // namespace

std::string scheduleToCsv(const Schedule& schedule) {
  return csvOf(schedule, false);
}

std::string scheduleToCsvWithComms(const Schedule& schedule) {
  return csvOf(schedule, true);
}

namespace {

// A lowered CSV's own instruction lists: its transfers in its order, a
// recompute before each checkpointed micro-batch's backward (before the
// pair, for an overlapped one).
std::vector<std::vector<Instruction>> loweredAsWritten(
    const std::vector<std::vector<Action>>& rows,
    int lastStage,
    CheckpointMode mode,
    int kept) {
  std::vector<std::vector<Instruction>> perRank;
  for (const auto& row : rows) {
    auto& list = perRank.emplace_back();
    for (size_t k = 0; k < row.size(); ++k) {
      const ComputeStep& step = row[k].step;
      const int s = step.stage, mb = step.microBatch;
      const bool checkpointed = isCheckpointed(mode, mb, kept);
      switch (row[k].kind) {
        case Action::kSendF:
          list.emplace_back(SendActivation{s, mb});
          continue;
        case Action::kRecvF:
          list.emplace_back(RecvActivation{s, mb});
          continue;
        case Action::kSendB:
          list.emplace_back(SendGrad{s, mb});
          continue;
        case Action::kRecvB:
          // As lowering does: a checkpointed micro-batch recomputes before
          // it waits for its gradient.
          if (isCheckpointed(mode, mb, kept))
            list.emplace_back(Recompute{s, mb});
          list.emplace_back(RecvGrad{s, mb});
          continue;
        case Action::kCompute:
          break;
      }
      switch (step.pass) {
        case Pass::kForward:
          if (step.overlapsNext && k + 1 < row.size()) {
            const ComputeStep& back = row[k + 1].step;
            if (back.stage == lastStage &&
                isCheckpointed(mode, back.microBatch, kept))
              list.emplace_back(Recompute{back.stage, back.microBatch});
          }
          list.emplace_back(Forward{s, mb, checkpointed, step.overlapsNext});
          break;
        case Pass::kBackward:
        case Pass::kBackwardInput:
          if (checkpointed && s == lastStage &&
              !(k > 0 && row[k - 1].step.overlapsNext &&
                row[k - 1].kind == Action::kCompute)) {
            list.emplace_back(Recompute{s, mb}); // no gradient to wait for
          }
          list.push_back(backwardInstruction(step));
          break;
        case Pass::kBackwardWeight:
          list.push_back(backwardInstruction(step));
          break;
      }
    }
  }
  return perRank;
}

} // namespace

Schedule scheduleFromCsv(const std::string& text, CheckpointMode mode) {
  std::istringstream lines(text);
  std::string line;
  std::vector<std::vector<Action>> rows;
  ComputeOrder order;
  bool comms = false;
  int stages = 0, microBatches = 0;
  while (std::getline(lines, line)) {
    if (line.find_first_not_of(" \t\r") == std::string::npos && rows.empty())
      continue;
    rows.emplace_back();
    order.emplace_back();
    const int rank = static_cast<int>(rows.size()) - 1;
    for (const std::string& cell : splitCells(line)) {
      if (cell.empty())
        continue; // an idle slot
      for (const Action& action : parseCell(cell, rank)) {
        rows.back().push_back(action);
        comms = comms || action.kind != Action::kCompute;
        if (action.kind == Action::kCompute)
          order.back().push_back(action.step);
        stages = std::max(stages, action.step.stage + 1);
        microBatches = std::max(microBatches, action.step.microBatch + 1);
      }
    }
  }
  while (!rows.empty() && rows.back().empty()) {
    rows.pop_back();
    order.pop_back();
  }
  const int ranks = static_cast<int>(order.size());
  if (ranks == 0 || stages == 0)
    throw ScheduleError("CSV schedule: no actions");
  // Each stage's rank is the row its compute appears on; the default
  // (s % ranks) is kept implicit.
  std::vector<int> placement(stages, -1);
  for (int rank = 0; rank < ranks; ++rank) {
    for (const ComputeStep& step : order[rank]) {
      if (placement[step.stage] >= 0 && placement[step.stage] != rank) {
        throw ScheduleError(
            "CSV schedule: stage " + std::to_string(step.stage) +
            " appears on rows " + std::to_string(placement[step.stage]) +
            " and " + std::to_string(rank));
      }
      placement[step.stage] = rank;
    }
  }
  bool interleaved = true;
  for (int s = 0; s < stages; ++s)
    interleaved = interleaved && placement[s] == s % ranks;
  if (stages % ranks != 0) {
    throw ScheduleError(
        "CSV schedule: " + std::to_string(stages) + " stages on " +
        std::to_string(ranks) + " ranks; each rank must hold as many stages");
  }
  for (int s = 0; s < stages; ++s) {
    if (placement[s] < 0)
      throw ScheduleError(
          "CSV schedule: stage " + std::to_string(s) + " never runs");
  }
  const int virtualStages = stages / ranks;
  Schedule schedule =
      lower("custom", ranks, virtualStages, microBatches, mode, order);
  if (comms) {
    schedule.perRank = loweredAsWritten(
        rows, stages - 1, mode, keptMicroBatch(order, microBatches));
  }
  if (!interleaved)
    schedule.placement = placement;
  validate(schedule);
  return schedule;
}

} // namespace tpipe
