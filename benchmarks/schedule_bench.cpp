// Simulated schedules side by side: the Zero Bubble paper's span bubble, the
// step with a barrier (today's runtime) and back-to-back without one
// (post-validation), peak micro-batches held, for p in {4, 8, 16, 32} and m
// in {p, 2p, 4p, 8p}, under unit costs and GPT-like costs; and auto's search
// time. Pure: no tensors. The measured counterpart on CPU is
// `pipeline_bench ... schedules` (benchmarks/run schedules runs both).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tpipe/schedule.h"

namespace {

using tpipe::CheckpointMode;
using tpipe::Schedule;
using tpipe::StageCosts;

struct CostCase {
  const char* name;
  StageCosts stage; // a whole stage; ZB-V's half-stages cost half
};

// GPT-like: T_B ~ T_F, T_W ~ 0.6 T_F, a transfer ~3% of T_F (the ratios the
// Zero Bubble paper profiles for its GPT settings).
std::vector<CostCase> costCases() {
  StageCosts unit;
  StageCosts gpt;
  gpt.forward = 1.0, gpt.backwardInput = 0.98, gpt.backwardWeight = 0.6;
  gpt.backward = gpt.backwardInput + gpt.backwardWeight;
  gpt.recompute = gpt.forward, gpt.transfer = 0.03;
  // The top of the published range of T_W / T_F.
  StageCosts heavyWeights = gpt;
  heavyWeights.backwardWeight = 0.75;
  heavyWeights.backward = gpt.backwardInput + heavyWeights.backwardWeight;
  return {
      {"unit", unit},
      {"gpt-like", gpt},
      {"gpt-like, T_W = 0.75 T_F", heavyWeights}};
}

// What a micro-batch keeps between its input pass and its weight pass, as a
// fraction of what its forward stashed, in the Zero Bubble paper's memory
// model (its Table 1: M_W = 32bsh against M_B = 34bsh + 5as^2b, about 0.3
// to 0.45 for its GPT settings without flash attention). tpipe's runtime
// keeps the whole graph until the weight pass: 1.
constexpr double kPaperWeightMemory = 0.4;

StageCosts halved(StageCosts c) {
  c.forward /= 2, c.backward /= 2, c.backwardInput /= 2;
  c.backwardWeight /= 2, c.recompute /= 2;
  return c;
}

int peakHeld(const Schedule& schedule) {
  int worst = 0;
  for (const auto& list : schedule.perRank) {
    int held = 0;
    for (const tpipe::Instruction& instruction : list) {
      if (std::holds_alternative<tpipe::Forward>(instruction))
        worst = std::max(worst, ++held);
      else if (
          std::holds_alternative<tpipe::Backward>(instruction) ||
          std::holds_alternative<tpipe::BackwardWeight>(instruction))
        --held;
    }
  }
  return worst;
}

} // namespace

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "schedule.json";
  nlohmann::json rows = nlohmann::json::array();
  std::printf(
      "simulated schedules; span bubble = the Zero Bubble paper's measure; step = with a barrier "
      "(as tpipe runs today), steady = back-to-back without one, both / m (F+B+W);\n"
      "held = peak micro-batches on a rank (zb-v, zb-v-half, zb-v-min, dualpipev: half-stages, 2p = 1F1B's p;\n"
      "       dualpipe: whole stages of both chains, parameters doubled);\n"
      "auto-2p/.4: a 2p limit where a micro-batch waiting for its weight pass counts 0.4 (the paper's M_W / M_B)\n"
      "dualpipe(v)'s pairs run one part after the other (overlap 0, as on CPU)\n"
      "floor = the least span bubble any one-stage-per-rank split schedule can have, at any memory\n"
      "        (spanBubbleLowerBound: the way down and back that the weight passes must fill)\n");
  for (const CostCase& costs : costCases()) {
    std::printf("\n== %s costs\n", costs.name);
    std::printf(
        "%4s %4s %-10s %8s %8s %8s %5s %9s\n",
        "p",
        "m",
        "schedule",
        "bubble",
        "step",
        "steady",
        "held",
        "search ms");
    for (int p : {4, 8, 16, 32}) {
      for (int m : {p, 2 * p, 3 * p, 4 * p, 8 * p}) {
        const auto mode = CheckpointMode::kNever;
        const StageCosts& c = costs.stage;
        const double work =
            m * (c.forward + c.backwardInput + c.backwardWeight);
        struct Entry {
          std::string name;
          Schedule schedule;
          double searchMs = -1;
        };
        std::vector<Entry> entries;
        entries.push_back({"1f1b", tpipe::oneFOneBSchedule(p, m, mode)});
        entries.push_back({"zb-h1", tpipe::zeroBubbleH1Schedule(p, m, mode)});
        entries.push_back({"zb-h2", tpipe::zeroBubbleH2Schedule(p, m, mode)});
        entries.push_back({"zb-v", tpipe::zeroBubbleVSchedule(p, m, mode)});
        entries.push_back(
            {"zb-v-half", tpipe::zeroBubbleVHalfSchedule(p, m, mode)});
        entries.push_back(
            {"zb-v-min", tpipe::zeroBubbleVMinSchedule(p, m, mode)});
        if (m >= 2 * p) {
          entries.push_back(
              {"dualpipev", tpipe::dualPipeVSchedule(p, m, mode)});
          entries.push_back({"dualpipe", tpipe::dualPipeSchedule(p, m, mode)});
        }
        struct AutoCase {
          const char* name;
          int limit;
          double weightPassMemory;
        };
        for (const AutoCase& a :
             {AutoCase{"auto-p", p, 1.0},
              AutoCase{"auto-2p", 2 * p, 1.0},
              AutoCase{"auto-2p/.4", 2 * p, kPaperWeightMemory}}) {
          const auto start = std::chrono::steady_clock::now();
          Schedule s = tpipe::autoSchedule(
              p,
              m,
              mode,
              {c},
              std::vector<int>(p, a.limit),
              a.weightPassMemory);
          const double ms = std::chrono::duration<double, std::milli>(
                                std::chrono::steady_clock::now() - start)
                                .count();
          entries.push_back({a.name, std::move(s), ms});
        }
        const double floor = tpipe::spanBubbleLowerBound(p, m, {c});
        for (const Entry& e : entries) {
          const std::vector<StageCosts> stageCosts{
              e.schedule.virtualStages == 2 && e.schedule.chains == 1
                  ? halved(c)
                  : c};
          const tpipe::Simulation sim = tpipe::simulate(e.schedule, stageCosts);
          const double steady = tpipe::steadyStepTime(e.schedule, stageCosts);
          const int held = peakHeld(e.schedule);
          std::printf(
              "%4d %4d %-10s %7.2f%% %8.3f %8.3f %5d",
              p,
              m,
              e.name.c_str(),
              100 * sim.spanBubble,
              sim.makespan / work,
              steady / work,
              held);
          if (e.searchMs >= 0)
            std::printf(" %9.0f", e.searchMs);
          std::printf("\n");
          rows.push_back(
              {{"costs", costs.name},
               {"p", p},
               {"m", m},
               {"schedule", e.name},
               {"span_bubble", sim.spanBubble},
               {"step_over_work", sim.makespan / work},
               {"steady_over_work", steady / work},
               {"peak_held", held},
               {"search_ms", e.searchMs}});
        }
        std::printf("%4d %4d %-10s %7.2f%%\n", p, m, "floor", 100 * floor);
        rows.push_back(
            {{"costs", costs.name},
             {"p", p},
             {"m", m},
             {"schedule", "floor"},
             {"span_bubble", floor}});
      }
    }
  }
  std::ofstream(out) << nlohmann::json{{"simulated", rows}}.dump(1) << '\n';
  std::printf("\nwrote %s\n", out.c_str());
  return 0;
}
