// Names, labels, printing and JSON for schedules and simulations.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <iomanip>
#include <ostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "overloaded.h"
#include "json_input.h"
#include "tpipe/schedule.h"

namespace tpipe {

const char* opName(const Instruction& instruction) {
  return std::visit(
      Overloaded{
          [](const Forward&) { return "forward"; },
          [](const Recompute&) { return "recompute"; },
          [](const Backward&) { return "backward"; },
          [](const BackwardInput&) { return "backward_input"; },
          [](const BackwardWeight&) { return "backward_weight"; },
          [](const SendActivation&) { return "send_activation"; },
          [](const RecvActivation&) { return "recv_activation"; },
          [](const SendGrad&) { return "send_grad"; },
          [](const RecvGrad&) { return "recv_grad"; }},
      instruction);
}

int stageOf(const Instruction& instruction) {
  return std::visit([](const auto& op) { return op.stage; }, instruction);
}

int microBatchOf(const Instruction& instruction) {
  return std::visit([](const auto& op) { return op.microBatch; }, instruction);
}

bool isCompute(const Instruction& instruction) {
  return std::holds_alternative<Forward>(instruction) ||
      std::holds_alternative<Recompute>(instruction) ||
      std::holds_alternative<Backward>(instruction) ||
      std::holds_alternative<BackwardInput>(instruction) ||
      std::holds_alternative<BackwardWeight>(instruction);
}

std::string shortLabel(const Instruction& instruction) {
  const std::string mb = std::to_string(microBatchOf(instruction));
  const int stage = stageOf(instruction);
  return std::visit(
      Overloaded{
          [&](const Forward&) { return "F" + mb; },
          [&](const Recompute&) { return "R" + mb; },
          [&](const Backward&) { return "B" + mb; },
          [&](const BackwardInput&) { return "b" + mb; },
          [&](const BackwardWeight&) { return "w" + mb; },
          [&](const SendActivation&) {
            return "send act " + mb + " -> stage " + std::to_string(stage + 1);
          },
          [&](const RecvActivation&) {
            return "recv act " + mb + " <- stage " + std::to_string(stage - 1);
          },
          [&](const SendGrad&) {
            return "send grad " + mb + " -> stage " + std::to_string(stage - 1);
          },
          [&](const RecvGrad&) {
            return "recv grad " + mb + " <- stage " + std::to_string(stage + 1);
          }},
      instruction);
}

void printInstructions(std::ostream& out, const Schedule& schedule) {
  out << "schedule " << schedule.name << ": " << schedule.ranks << " ranks, "
      << schedule.virtualStages << " virtual stage(s) per rank, "
      << schedule.microBatches << " micro-batches";
  if (schedule.chains > 1) {
    out << ", " << schedule.chains << " chains of " << schedule.chainLength()
        << " stages (micro-batch k runs chain k % " << schedule.chains
        << "; stage s of chain c is stage c x " << schedule.chainLength()
        << " + s, a copy of stage s)";
  }
  out << '\n';
  for (int rank = 0; rank < schedule.ranks; ++rank) {
    out << "rank " << rank << ":";
    for (const Instruction& instruction : schedule.perRank[rank]) {
      if (!isCompute(instruction))
        continue;
      out << ' ' << shortLabel(instruction);
      if (schedule.virtualStages > 1)
        out << '@' << stageOf(instruction);
    }
    out << '\n';
  }
  out << "(F forward, B backward, R recompute, b backward-input, "
         "w backward-weight; transfers omitted, see --json)\n";
}

void printSimulation(
    std::ostream& out,
    const Schedule& schedule,
    const Simulation& simulation,
    int width) {
  if (!simulation.finished) {
    out << "simulation stalled: " << simulation.stuck << '\n';
    return;
  }
  const double span = std::max(simulation.makespan, 1e-12);
  const auto flags = out.flags();
  out << std::fixed << std::setprecision(3);
  out << "simulated step " << simulation.makespan << ", bubble "
      << std::setprecision(1) << 100.0 * simulation.bubbleFraction
      << "% (idle / (ranks x step)); theory "
      << 100.0 * theoreticalBubble(schedule) << "% ("
      << theoreticalBubbleFormula(schedule) << ")\n";
  out << "span bubble " << std::setprecision(2) << 100.0 * simulation.spanBubble
      << "% (the Zero Bubble paper's: idle between a rank's first and last "
         "compute)\n";
  out << std::setprecision(3);
  out << "rank   busy     idle   stages: peak stashed / live micro-batches\n";
  for (int rank = 0; rank < schedule.ranks; ++rank) {
    out << std::setw(4) << rank << ' ' << std::setw(7) << simulation.busy[rank]
        << ' ' << std::setw(8) << simulation.idle[rank] << "  ";
    for (int stage : schedule.stagesOfRank(rank)) {
      out << " s" << stage << ": " << simulation.peakStashed[stage] << " / "
          << simulation.peakLive[stage];
    }
    out << '\n';
  }
  // One character per time slot; '.' is idle.
  std::vector<std::string> rows(schedule.ranks, std::string(width, '.'));
  for (const TimedInstruction& timed : simulation.timeline) {
    const Instruction& instruction = schedule.perRank[timed.rank][timed.index];
    if (!isCompute(instruction) || timed.end <= timed.start)
      continue;
    const int from = static_cast<int>(std::floor(timed.start / span * width));
    const int to = std::max(
        from + 1, static_cast<int>(std::floor(timed.end / span * width)));
    const std::string label = shortLabel(instruction);
    for (int x = from; x < std::min(to, width); ++x) {
      const size_t k = static_cast<size_t>(x - from);
      rows[timed.rank][x] = k < label.size() ? label[k] : '=';
    }
  }
  out << "timeline (" << width << " columns = " << simulation.makespan
      << "):\n";
  for (int rank = 0; rank < schedule.ranks; ++rank) {
    out << "  " << std::setw(3) << rank << " |" << rows[rank] << "|\n";
  }
  out.flags(flags);
}

nlohmann::json scheduleToJson(const Schedule& schedule) {
  nlohmann::json lists = nlohmann::json::array();
  for (const auto& list : schedule.perRank) {
    nlohmann::json items = nlohmann::json::array();
    for (const Instruction& instruction : list) {
      nlohmann::json item = {
          {"op", opName(instruction)},
          {"stage", stageOf(instruction)},
          {"micro_batch", microBatchOf(instruction)}};
      if (const auto* forward = std::get_if<Forward>(&instruction)) {
        item["checkpointed"] = forward->checkpointed;
        if (forward->overlapsBackward)
          item["overlaps_backward"] = true;
      }
      items.push_back(std::move(item));
    }
    lists.push_back(std::move(items));
  }
  nlohmann::json json = {
      {"schedule", schedule.name},
      {"training", schedule.training},
      {"ranks", schedule.ranks},
      {"virtual_stages", schedule.virtualStages},
      {"placement", schedule.placement},
      {"micro_batches", schedule.microBatches},
      {"stages", std::move(lists)}};
  if (schedule.chains != 1)
    json["chains"] = schedule.chains;
  return json;
}

namespace {

int requireInt(
    const nlohmann::json& object,
    const char* key,
    const std::string& path,
    int fallback,
    bool required) {
  if (!object.contains(key)) {
    if (required) {
      throw ScheduleError(path + "." + key + ": missing");
    }
    return fallback;
  }
  const auto& value = object.at(key);
  if (!value.is_number_integer()) {
    throw ScheduleError(
        path + "." + key + ": expected an integer, got " + value.dump());
  }
  return value.get<int>();
}

Instruction instructionFromJson(
    const nlohmann::json& item,
    const std::string& path) {
  if (!item.is_object() || !item.contains("op") || !item["op"].is_string()) {
    throw ScheduleError(
        path +
        ": expected {\"op\": ..., \"stage\": ..., "
        "\"micro_batch\": ...}, got " +
        item.dump());
  }
  const std::string op = item["op"];
  const int stage = requireInt(item, "stage", path, 0, true);
  const int mb = requireInt(item, "micro_batch", path, 0, true);
  if (op == "forward") {
    const bool checkpointed = item.value("checkpointed", false);
    return Forward{
        stage, mb, checkpointed, item.value("overlaps_backward", false)};
  }
  if (op == "recompute")
    return Recompute{stage, mb};
  if (op == "backward")
    return Backward{stage, mb};
  if (op == "backward_input")
    return BackwardInput{stage, mb};
  if (op == "backward_weight")
    return BackwardWeight{stage, mb};
  if (op == "send_activation")
    return SendActivation{stage, mb};
  if (op == "recv_activation")
    return RecvActivation{stage, mb};
  if (op == "send_grad")
    return SendGrad{stage, mb};
  if (op == "recv_grad")
    return RecvGrad{stage, mb};
  throw ScheduleError(path + ".op: unknown instruction '" + op + "'");
}

} // namespace

Schedule scheduleFromJson(const nlohmann::json& json) {
  if (!json.is_object() || !json.contains("stages") ||
      !json["stages"].is_array()) {
    throw ScheduleError(
        "schedule JSON: expected an object with a \"stages\" "
        "array of instruction lists");
  }
  Schedule schedule;
  schedule.name = json.value("schedule", std::string("custom"));
  schedule.training = json.value("training", true);
  const auto& lists = json["stages"];
  schedule.ranks = requireInt(
      json, "ranks", "schedule", static_cast<int>(lists.size()), false);
  schedule.virtualStages =
      requireInt(json, "virtual_stages", "schedule", 1, false);
  schedule.chains = requireInt(json, "chains", "schedule", 1, false);
  if (json.contains("placement")) {
    const auto& placement = json["placement"];
    if (!placement.is_array())
      throw ScheduleError("placement: expected a list of ranks, one per stage");
    for (const auto& rank : placement) {
      if (!rank.is_number_integer() || rank.get<int64_t>() < 0 ||
          rank.get<int64_t>() >= schedule.ranks) {
        throw ScheduleError(
            "placement: expected ranks in [0, " +
            std::to_string(schedule.ranks) + "), got " + rank.dump());
      }
      schedule.placement.push_back(rank.get<int>());
    }
  }
  int maxMicroBatch = -1;
  for (size_t rank = 0; rank < lists.size(); ++rank) {
    const std::string path = "stages[" + std::to_string(rank) + "]";
    if (!lists[rank].is_array()) {
      throw ScheduleError(path + ": expected an array of instructions");
    }
    std::vector<Instruction> list;
    for (size_t i = 0; i < lists[rank].size(); ++i) {
      list.push_back(instructionFromJson(
          lists[rank][i], path + "[" + std::to_string(i) + "]"));
      maxMicroBatch = std::max(maxMicroBatch, microBatchOf(list.back()));
    }
    schedule.perRank.push_back(std::move(list));
  }
  schedule.microBatches =
      requireInt(json, "micro_batches", "schedule", maxMicroBatch + 1, false);
  return schedule;
}

Schedule loadScheduleFile(const std::string& path) {
  nlohmann::json json;
  try {
    json = readJsonFile(path, "schedule file " + path);
  } catch (const ConfigError& error) {
    throw ScheduleError(error.what());
  }
  try {
    Schedule schedule = scheduleFromJson(json);
    validate(schedule);
    return schedule;
  } catch (const ScheduleError& error) {
    throw ScheduleError("schedule file " + path + ": " + error.what());
  }
}

Schedule loadScheduleCsv(const std::string& path, CheckpointMode mode) {
  std::ifstream file(path, std::ios::binary);
  if (!file)
    throw ScheduleError("schedule file " + path + ": cannot open");
  std::ostringstream text;
  text << file.rdbuf();
  try {
    return scheduleFromCsv(text.str(), mode);
  } catch (const ScheduleError& error) {
    throw ScheduleError("schedule file " + path + ": " + error.what());
  }
}

nlohmann::json simulationToJson(
    const Schedule& schedule,
    const Simulation& simulation) {
  nlohmann::json ranks = nlohmann::json::array();
  for (int rank = 0; rank < schedule.ranks; ++rank) {
    ranks.push_back(
        {{"rank", rank},
         {"busy", simulation.busy[rank]},
         {"idle", simulation.idle[rank]}});
  }
  return {
      {"finished", simulation.finished},
      {"makespan", simulation.makespan},
      {"bubble_fraction", simulation.bubbleFraction},
      {"span_bubble", simulation.spanBubble},
      {"span", simulation.span},
      {"theoretical_bubble", theoreticalBubble(schedule)},
      {"ranks", ranks},
      {"peak_stashed_micro_batches", simulation.peakStashed},
      {"peak_live_micro_batches", simulation.peakLive}};
}

} // namespace tpipe
