// What a training run reports: memory per device against the plan's
// prediction, the bubble report, and the trace and timeline files.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ostream>
#include <set>
#include <sstream>

#include "train/checkpoint.h"
#include "train/parts.h"

namespace tpipe {

std::string duration(double seconds) {
  std::ostringstream out;
  if (seconds >= 3600)
    out << static_cast<int>(seconds / 3600) << "h";
  if (seconds >= 60)
    out << static_cast<int>(std::fmod(seconds, 3600) / 60) << "m";
  out << static_cast<int>(std::fmod(seconds, 60)) << "s";
  return out.str();
}

std::vector<MemoryRow> prepareMemory(const Config& config, Pipeline& pipe) {
  const auto& o = config.train.optimizer;
  const double factor = optimizerStateFactor(o.type, o.momentum);
  const std::vector<StageReport>& predicted = pipe.plan().stages;
  const int ranks = pipe.schedule().ranks;
  std::vector<MemoryRow> rows(ranks);
  const auto& boundaries = pipe.boundaries();
  const Schedule& schedule = pipe.schedule();
  for (int s = 0; s < schedule.stages(); ++s) {
    const int rank = schedule.rankOfStage(s);
    MemoryRow& row = rows[rank];
    row.device = config.pipeline.devices[rank].name;
    row.capacityBytes = config.pipeline.devices[rank].memoryBytes;
    // A stage of the model predicts the memory of all its copies (chains).
    const int ms = schedule.modelStage(s);
    row.predictedBytes += predicted[ms].memoryBytes / schedule.chains;
    for (int l = boundaries[ms]; l < boundaries[ms + 1]; ++l) {
      for (const auto& p : pipe.layers()[l].module.ptr()->parameters()) {
        const auto bytes = static_cast<int64_t>(p.nbytes());
        row.parameterBytes += bytes;
        if (p.requires_grad())
          row.gradientBytes += bytes;
      }
    }
  }
  // Across processes this one caps only the devices it runs.
  std::set<std::string> local;
  for (const auto& device : pipe.memory())
    local.insert(device.device);
  for (int r = 0; r < ranks; ++r) {
    MemoryRow& row = rows[r];
    row.optimizerBytes =
        static_cast<int64_t>(factor * static_cast<double>(row.gradientBytes));
    if (row.capacityBytes > 0 && local.count(row.device)) {
      const int64_t fixed = row.parameterBytes + row.optimizerBytes;
      if (fixed >= row.capacityBytes) {
        throw ConfigError(
            "pipeline.devices[" + std::to_string(r) +
            "].memory: " + row.device + " holds " + formatBytes(fixed) +
            " of parameters and optimizer state, more than its capacity of " +
            formatBytes(row.capacityBytes) + " (see `tpipe plan`)");
      }
      pipe.setMemoryCapacity(r, row.capacityBytes - fixed);
    }
  }
  pipe.resetPeakMemory();
  return rows;
}

std::vector<MemoryRow> finishMemory(
    const Pipeline& pipe,
    std::vector<MemoryRow> rows) {
  for (const auto& measured : pipe.memory()) {
    auto at = std::find_if(rows.begin(), rows.end(), [&](const MemoryRow& row) {
      return row.device == measured.device;
    });
    if (at == rows.end())
      continue;
    MemoryRow& row = *at;
    row.measured = true;
    row.workerPeakBytes = measured.peakBytes;
    row.activationPeakBytes =
        std::max<int64_t>(0, row.workerPeakBytes - row.gradientBytes);
    row.measuredPeakBytes =
        row.parameterBytes + row.optimizerBytes + row.workerPeakBytes;
  }
  return rows;
}

std::string memoryForRoot(
    const std::vector<MemoryRow>& rows,
    const Communicator& world) {
  if (world.replica() != 0)
    return "";
  nlohmann::json measured = nlohmann::json::array();
  for (const auto& row : rows) {
    if (row.measured) {
      measured.push_back(
          {row.device,
           row.workerPeakBytes,
           row.activationPeakBytes,
           row.measuredPeakBytes});
    }
  }
  return measured.dump();
}

std::vector<MemoryRow> mergeMemory(
    std::vector<MemoryRow> rows,
    const std::vector<std::string>& parts) {
  for (const auto& part : parts) {
    if (part.empty())
      continue;
    for (const auto& entry : nlohmann::json::parse(part)) {
      for (auto& row : rows) {
        if (row.device != entry[0].get<std::string>())
          continue;
        row.measured = true;
        row.workerPeakBytes = entry[1].get<int64_t>();
        row.activationPeakBytes = entry[2].get<int64_t>();
        row.measuredPeakBytes = entry[3].get<int64_t>();
      }
    }
  }
  return rows;
}

void printMemory(std::ostream& log, const std::vector<MemoryRow>& rows) {
  log << "memory per device (measured peak = parameters + optimizer state + the worker's allocator peak)\n";
  char line[256];
  std::snprintf(
      line,
      sizeof line,
      "%-8s %11s %11s %11s %12s %12s %12s %7s %11s\n",
      "device",
      "params",
      "grads",
      "optimizer",
      "activations",
      "measured",
      "predicted",
      "error",
      "capacity");
  log << line;
  for (const auto& row : rows) {
    const double error = row.predictedBytes > 0 ? 100.0 *
            (static_cast<double>(row.predictedBytes) - row.measuredPeakBytes) /
            static_cast<double>(row.measuredPeakBytes)
                                                : 0.0;
    std::snprintf(
        line,
        sizeof line,
        "%-8s %11s %11s %11s %12s %12s %12s %+6.1f%% %11s\n",
        row.device.c_str(),
        formatBytes(row.parameterBytes).c_str(),
        formatBytes(row.gradientBytes).c_str(),
        formatBytes(row.optimizerBytes).c_str(),
        formatBytes(row.activationPeakBytes).c_str(),
        formatBytes(row.measuredPeakBytes).c_str(),
        formatBytes(row.predictedBytes).c_str(),
        error,
        row.capacityBytes > 0 ? formatBytes(row.capacityBytes).c_str() : "-");
    log << line;
  }
}

std::string traceForRoot(
    const Trace& trace,
    const Communicator& world,
    double offsetUs) {
  if (world.replica() != 0)
    return "";
  const int rank = world.stageRank();
  nlohmann::json steps = nlohmann::json::array();
  for (const auto& step : trace.steps) {
    nlohmann::json events = nlohmann::json::array();
    for (const auto& e : step.events) {
      if (e.rank == rank)
        events.push_back({e.index, e.startUs, e.endUs, e.bytes});
    }
    steps.push_back(
        {{"step", step.step},
         {"origin_us", step.originUs + offsetUs},
         {"wall_us", step.wallUs},
         {"events", events}});
  }
  const std::string device = rank < static_cast<int>(trace.devices.size())
      ? trace.devices[rank]
      : "rank " + std::to_string(rank);
  return nlohmann::json{{"rank", rank}, {"device", device}, {"steps", steps}}
      .dump();
}

namespace {

// One step of every part, on the earliest start's time base; false when a
// part lacks the step.
bool mergeStep(
    const std::vector<nlohmann::json>& parts,
    int step,
    StepTrace& out) {
  std::vector<const nlohmann::json*> found;
  double start = 1e300, end = -1e300;
  for (const auto& part : parts) {
    const nlohmann::json* mine = nullptr;
    for (const auto& s : part["steps"]) {
      if (s["step"].get<int>() == step)
        mine = &s;
    }
    if (!mine)
      return false;
    found.push_back(mine);
    const double origin = (*mine)["origin_us"].get<double>();
    start = std::min(start, origin);
    end = std::max(end, origin + (*mine)["wall_us"].get<double>());
  }
  out.step = step;
  out.originUs = start;
  out.wallUs = end - start;
  for (size_t p = 0; p < parts.size(); ++p) {
    const double shift = (*found[p])["origin_us"].get<double>() - start;
    for (const auto& e : (*found[p])["events"]) {
      out.events.push_back(
          {parts[p]["rank"].get<int>(),
           e[0].get<int>(),
           e[1].get<double>() + shift,
           e[2].get<double>() + shift,
           e[3].get<int64_t>()});
    }
  }
  return true;
}

} // namespace

Trace mergeTraces(const Trace& local, const std::vector<std::string>& texts) {
  Trace merged;
  merged.schedule = local.schedule;
  merged.perProcess = true;
  std::vector<nlohmann::json> parts;
  for (const auto& text : texts) {
    if (!text.empty())
      parts.push_back(nlohmann::json::parse(text));
  }
  merged.devices.assign(static_cast<size_t>(local.schedule.ranks), "");
  for (const auto& part : parts) {
    const int rank = part["rank"].get<int>();
    if (rank >= 0 && rank < local.schedule.ranks)
      merged.devices[rank] = "rank " + std::to_string(rank) + " " +
          part["device"].get<std::string>();
  }
  for (const auto& step : local.steps) {
    StepTrace out;
    if (mergeStep(parts, step.step, out))
      merged.steps.push_back(std::move(out));
  }
  return merged;
}

void writeTraceOutputs(
    const Trace& trace,
    const TrainOptions& options,
    TrainSummary& summary,
    std::ostream& log) {
  if (trace.steps.empty())
    return;
  summary.bubble = bubbleReport(trace);
  printBubbleReport(log, summary.bubble);
  auto write = [](const std::string& path, const std::string& text) {
    if (!path.empty())
      writeOutputFile(path, text);
  };
  write(options.tracePath, chromeTrace(trace).dump() + "\n");
  write(options.timelinePath, timelineSvg(trace));
  write(options.reportPath, bubbleReportToJson(summary.bubble).dump(1) + "\n");
  for (const auto* path :
       {&options.tracePath, &options.timelinePath, &options.reportPath}) {
    if (!path->empty())
      log << "wrote " << *path << "\n";
  }
}

} // namespace tpipe
