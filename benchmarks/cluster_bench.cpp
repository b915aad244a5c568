// `tpipe tune --cluster` held against published pipeline-parallel runs. For
// each table in a published file (benchmarks/published/zero_bubble.json:
// the Zero Bubble paper's GPT runs on A100s), every job is rebuilt as a
// user would describe it to tpipe: the model's layer list, the devices and
// links, the micro-batch size and count, the schedule and the paper's
// layout. The device efficiency (the cluster file's one free number) is
// fitted on one cell per table, chosen by a fixed rule: the first model's
// 1F1B at its most micro-batches (the plainest schedule, the least bubble).
// Every other cell is then predicted and compared. Nothing is built or run.
//
//   cluster_bench OUT.json [PUBLISHED.json]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "json_input.h"
#include "tpipe/config.h"
#include "tpipe/errors.h"
#include "tpipe/tuning.h"

namespace {

using Json = nlohmann::json;
using tpipe::ScheduleKind;
using tpipe::TuneCandidate;

struct Cell {
  std::string table, model, schedule;
  int gpus = 1, microBatchSize = 1, microBatches = 1;
  double published = 0.0;   // samples per GPU per second
  double publishedGb = 0.0; // peak memory, as published
  // Filled in:
  double predicted = 0.0, predictedGb = 0.0, bubble = 0.0;
  std::string infeasible;
  double error() const {
    return (predicted - published) / published;
  }
};

// How a published schedule name runs in tpipe.
struct ScheduleShape {
  ScheduleKind kind = ScheduleKind::kOneFOneB;
  bool oneLayerChunks = false; // interleaved with the most chunks
  int inFlightTimesRanks = 0;  // auto's limit in units of p
  int microBatchDivisor = 1;   // ZB-2p*: half the size, twice the count
};

ScheduleShape shapeOf(const std::string& name) {
  ScheduleShape s;
  if (name == "1F1B")
    return s;
  if (name == "1F1B-I") {
    s.kind = ScheduleKind::kInterleaved;
    s.oneLayerChunks = true;
    return s;
  }
  if (name == "ZB-V") {
    s.kind = ScheduleKind::kZeroBubbleV;
    return s;
  }
  s.kind = ScheduleKind::kAuto;
  if (name == "ZB-1p") {
    s.inFlightTimesRanks = 1;
    return s;
  }
  if (name == "ZB-2p" || name == "ZB-2p*") {
    s.inFlightTimesRanks = 2;
    s.microBatchDivisor = name == "ZB-2p*" ? 2 : 1;
    return s;
  }
  throw tpipe::UserError("published schedule '" + name + "' has no tpipe form");
}

// The GPT model as a tpipe layer list: embedding, blocks, final norm and the
// logits (Megatron's loss runs on the last stage with them).
Json gptConfig(const Json& root, const Json& model, int64_t batch) {
  const int64_t hidden = model.at("hidden");
  const int64_t vocabulary = root.at("vocabulary");
  Json layers = Json::array();
  layers.push_back(
      {{"type", "embedding"},
       {"num_embeddings", vocabulary},
       {"embedding_dim", hidden}});
  for (int l = 0; l < model.at("layers").get<int>(); ++l)
    layers.push_back(
        {{"type", "transformer_block"}, {"heads", model.at("heads")}});
  layers.push_back({{"type", "layernorm"}});
  layers.push_back(
      {{"type", "linear"}, {"out_features", vocabulary}, {"bias", false}});
  return {
      {"model", {{"input_shape", {root.at("sequence")}}, {"layers", layers}}},
      {"data", {{"dataset", "synthetic"}, {"samples", batch}}},
      // Megatron runs one iteration after the other: the published step
      // is the makespan, not tpipe's back-to-back step.
      {"pipeline", {{"devices", {"cpu:0"}}, {"overlap_steps", false}}},
      {"train",
       {{"batch_size", batch},
        {"steps", 1},
        {"loss", "cross_entropy"},
        {"optimizer", {{"type", "adam"}, {"lr", 1e-4}}}}}};
}

Json clusterFor(const Json& root, int gpus, double efficiency) {
  const int perNode = root.at("devices_per_node");
  Json device = root.at("device");
  device["efficiency"] = efficiency;
  return {
      {"nodes", (gpus + perNode - 1) / perNode},
      {"devices_per_node", std::min(gpus, perNode)},
      {"device", device},
      {"intra_node", root.at("intra_node")},
      {"inter_node", root.at("inter_node")},
      {"bytes_per_value", 2},
      {"optimizer_bytes_per_parameter", 12},
      {"instruction_us", 20},
      {"flash_attention", root.at("flash_attention")}};
}

// The paper's layout over `stages` stages: blocks split evenly, the first
// and last stage one block fewer (they hold the embedding, and the norm
// and logits). Boundaries over the layer list [embedding, blocks, norm,
// logits].
std::vector<int> paperBoundaries(int blocks, int stages) {
  if ((blocks + 2) % stages != 0) {
    throw tpipe::UserError(
        std::to_string(blocks) + " blocks do not lay out evenly on " +
        std::to_string(stages) + " stages with one fewer at each end");
  }
  const int perStage = (blocks + 2) / stages;
  std::vector<int> boundaries{0};
  for (int k = 0; k < stages; ++k)
    boundaries.push_back(boundaries.back() + perStage);
  boundaries.back() += 1; // the last stage's norm and logits take 2 slots
  return boundaries;
}

void predict(const Json& root, Cell& cell, double efficiency) {
  const Json& model = root.at("models").at(cell.model);
  const ScheduleShape shape = shapeOf(cell.schedule);
  const int size = cell.microBatchSize / shape.microBatchDivisor;
  const int count = cell.microBatches * shape.microBatchDivisor;
  const int64_t batch = static_cast<int64_t>(size) * count;
  const tpipe::Config config =
      tpipe::parseConfig(gptConfig(root, model, batch));
  tpipe::TuneOutcome outcome = tpipe::clusterCostModel(
      config, clusterFor(root, cell.gpus, efficiency), "published");
  const int blocks = model.at("layers");
  TuneCandidate want;
  want.ranks = cell.gpus;
  want.threadsPerStage = outcome.model.threads.front();
  want.microBatches = count;
  want.schedule = shape.kind;
  want.checkpoint = tpipe::CheckpointMode::kNever;
  want.inFlightLimit = shape.inFlightTimesRanks * cell.gpus;
  want.virtualStages = shape.oneLayerChunks ? (blocks + 2) / cell.gpus
      : tpipe::isVShaped(shape.kind)        ? 2
                                            : 1;
  want.boundaries = paperBoundaries(blocks, cell.gpus * want.virtualStages);
  const TuneCandidate got =
      tpipe::predictCandidate(outcome.model, outcome.request, want);
  cell.infeasible = got.infeasible;
  if (!got.infeasible.empty())
    return;
  cell.predicted =
      static_cast<double>(batch) / (got.predictedStepMs / 1000.0) / cell.gpus;
  cell.bubble = got.bubble;
  cell.predictedGb = static_cast<double>(*std::max_element(
                         got.peakBytes.begin(), got.peakBytes.end())) /
      1e9;
}

// The efficiency at which `cell` is predicted as published (bisection:
// throughput rises with efficiency).
double fitEfficiency(const Json& root, Cell cell) {
  double low = 0.02, high = 1.0;
  for (int i = 0; i < 40 && high - low > 1e-5; ++i) {
    const double mid = 0.5 * (low + high);
    predict(root, cell, mid);
    if (!cell.infeasible.empty())
      throw tpipe::UserError("the fit cell cannot run: " + cell.infeasible);
    (cell.predicted < cell.published ? low : high) = mid;
  }
  return 0.5 * (low + high);
}

std::vector<Cell> cellsOf(const Json& table) {
  std::vector<Cell> cells;
  const Json& settings = table.at("settings");
  for (auto it = table.at("samples_per_gpu_s").begin();
       it != table.at("samples_per_gpu_s").end();
       ++it) {
    for (size_t k = 0; k < settings.size(); ++k) {
      const Json& setting = settings[k];
      for (size_t j = 0; j < setting.at("micro_batches").size(); ++j) {
        Cell c;
        c.table = table.at("name");
        c.model = setting.at("model");
        c.schedule = it.key();
        c.gpus = setting.at("gpus");
        c.microBatchSize = setting.at("micro_batch_size");
        c.microBatches = setting.at("micro_batches")[j];
        c.published = it.value()[k][j];
        c.publishedGb = table.at("memory_gb").at(it.key())[k][j];
        cells.push_back(c);
      }
    }
  }
  return cells;
}

double median(std::vector<double> values) {
  if (values.empty())
    return 0.0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

} // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::cerr << "usage: cluster_bench OUT.json [PUBLISHED.json]\n";
    return 2;
  }
  const std::string path = argc > 2 ? argv[2]
                                    : std::string(TPIPE_SOURCE_DIR) +
          "/benchmarks/published/zero_bubble.json";
  try {
    const Json root = tpipe::readJsonFile(path, "published");
    std::printf("%s\n\n", root.at("source").get<std::string>().c_str());
    Json out = {{"source", root.at("source")}, {"tables", Json::array()}};
    std::vector<double> allErrors;
    double allWorst = 0.0;
    const auto start = std::chrono::steady_clock::now();
    for (const Json& table : root.at("tables")) {
      std::vector<Cell> cells = cellsOf(table);
      // The fit cell: the first model's 1F1B at its most micro-batches.
      size_t fit = cells.size();
      for (size_t i = 0; i < cells.size(); ++i) {
        if (cells[i].schedule == "1F1B" && cells[i].model == cells[0].model &&
            (fit == cells.size() ||
             cells[i].microBatches > cells[fit].microBatches))
          fit = i;
      }
      if (fit == cells.size())
        throw tpipe::UserError(
            table.at("name").get<std::string>() + ": no 1F1B cell to fit on");
      const double efficiency = fitEfficiency(root, cells[fit]);
      std::printf(
          "== %s: efficiency %.3f fitted on %s, %d GPUs, %d x %d, 1F1B\n",
          table.at("name").get<std::string>().c_str(),
          efficiency,
          cells[fit].model.c_str(),
          cells[fit].gpus,
          cells[fit].microBatches,
          cells[fit].microBatchSize);
      std::printf(
          "%-6s %4s %3s %4s %-7s %10s %10s %7s %7s %9s %9s\n",
          "model",
          "gpus",
          "b",
          "m",
          "sched",
          "published",
          "predicted",
          "error",
          "bubble",
          "mem pub",
          "mem pred");
      std::vector<double> errors;
      double worst = 0.0;
      Json rows = Json::array();
      for (size_t i = 0; i < cells.size(); ++i) {
        Cell& c = cells[i];
        predict(root, c, efficiency);
        Json row = {
            {"model", c.model},
            {"gpus", c.gpus},
            {"micro_batch_size", c.microBatchSize},
            {"micro_batches", c.microBatches},
            {"schedule", c.schedule},
            {"published", c.published},
            {"published_memory_gb", c.publishedGb},
            {"fit", i == fit}};
        std::printf(
            "%-6s %4d %3d %4d %-7s %10.2f",
            c.model.c_str(),
            c.gpus,
            c.microBatchSize,
            c.microBatches,
            c.schedule.c_str(),
            c.published);
        if (!c.infeasible.empty()) {
          std::printf("  infeasible: %s\n", c.infeasible.c_str());
          row["infeasible"] = c.infeasible;
          rows.push_back(row);
          continue;
        }
        std::printf(
            " %10.2f %+6.1f%% %6.1f%% %9.0f %9.1f%s\n",
            c.predicted,
            100.0 * c.error(),
            100.0 * c.bubble,
            c.publishedGb,
            c.predictedGb,
            i == fit ? "  (fit)" : "");
        row["predicted"] = c.predicted;
        row["error"] = c.error();
        row["bubble"] = c.bubble;
        row["predicted_memory_gb"] = c.predictedGb;
        rows.push_back(row);
        if (i != fit) {
          errors.push_back(std::abs(c.error()));
          worst = std::max(worst, std::abs(c.error()));
        }
      }
      std::printf(
          "%s: median |error| %.1f%%, worst %.1f%% over %zu predicted cells\n\n",
          table.at("name").get<std::string>().c_str(),
          100.0 * median(errors),
          100.0 * worst,
          errors.size());
      allErrors.insert(allErrors.end(), errors.begin(), errors.end());
      allWorst = std::max(allWorst, worst);
      out["tables"].push_back(
          {{"name", table.at("name")},
           {"efficiency", efficiency},
           {"median_abs_error", median(errors)},
           {"worst_abs_error", worst},
           {"cells", rows}});
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    std::printf(
        "all tables: median |error| %.1f%%, worst %.1f%% over %zu cells "
        "(goal: median <= 8%%, worst <= 15%%); %.1f s\n",
        100.0 * median(allErrors),
        100.0 * allWorst,
        allErrors.size(),
        seconds);
    out["median_abs_error"] = median(allErrors);
    out["worst_abs_error"] = allWorst;
    std::ofstream(argv[1]) << out.dump(1) << "\n";
  } catch (const std::exception& error) {
    std::cerr << "cluster_bench: " << error.what() << "\n";
    return 2;
  }
  return 0;
}
