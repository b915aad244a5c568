// The tuner checked by measurement. For each config, `tpipe tune --quick`
// (what pipeline.auto runs before training) chooses a plan `--repeat` times,
// each in a fresh process; a grid of plans (every distinct choice, the top
// predicted, a spread over the rest of the ranking) is trained in turn by
// `tpipe train` of the config with each plan, a fresh process per run, in 5
// alternating rounds (a fresh process here runs up to 10% faster or slower
// than the next): the step a user meets, the mean over the runs of each
// run's mean step (runs of 4 s quiet, 8 s busy). Tunes and rounds alternate, so
// that predictions and measurements span the same minutes. With --busy,
// everything is done again while another process spins one core in bursts of
// 0.1-0.9 s, as jobs starting and stopping do (the grid's runs of one round
// meet one draw of bursts, each round its own). Reports, per config and machine
// state:
// - how often the most frequent choice was chosen, and how much slower the
//   other choices measured;
// - each choice's measured step over the best measured in the grid;
// - prediction error: median over the grid, and worst for the choice;
// and `cluster` times the GPT-3 plan on 1024 devices.
//
//   tune_bench OUT.json [--repeat N] [--busy | --busy-only] [CONFIG ...]
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "json_input.h"
#include "tpipe/trainer.h"
#include "tpipe/tuning.h"
#include "statistics.h"

using namespace tpipe;

namespace {

// The other process of --busy: one core spinning and resting in turn,
// 0.1-0.9 s each, until killed; the lengths drawn from `seed`.
pid_t startBusyNeighbour(unsigned seed) {
  const pid_t child = ::fork();
  if (child != 0)
    return child;
  std::mt19937 random(seed);
  std::uniform_int_distribution<int> ms(100, 900);
  volatile double sink = 0.0;
  for (;;) {
    const auto until = std::chrono::steady_clock::now() +
        std::chrono::milliseconds(ms(random));
    while (std::chrono::steady_clock::now() < until)
      sink = sink + 1.0;
    const int rest = ms(random);
    const timespec pause{rest / 1000, (rest % 1000) * 1000000L};
    ::nanosleep(&pause, nullptr);
  }
}

void stopBusyNeighbour(pid_t child) {
  if (child <= 0)
    return;
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
}

// The --busy neighbour as the tunes and the training runs meet it. Tunes
// meet it running, as a job started at any moment does. Each training run
// of the grid meets bursts drawn from its round's seed, started with the
// run, so the plans held against each other in a round meet the same
// bursts (common random numbers) and their five rounds five draws: with
// bursts drawn afresh for every run, a plan's runs spread 1.2-1.3x, and the
// grid trained two Fashion plans 5.8% apart that seven alternating fresh
// runs of each put 1.4% apart.
class BusyNeighbour {
 public:
  // Nothing runs until a tune or a run asks for it.
  explicit BusyNeighbour(bool on) : on_(on) {}
  ~BusyNeighbour() {
    stopBusyNeighbour(pid_);
  }
  BusyNeighbour(const BusyNeighbour&) = delete;
  BusyNeighbour& operator=(const BusyNeighbour&) = delete;

  void running() {
    restart(static_cast<unsigned>(::getpid()) ^ ++restarts_ * 2654435761u);
  }
  void seeded(unsigned seed) {
    restart(seed);
  }

 private:
  void restart(unsigned seed) {
    if (!on_)
      return;
    stopBusyNeighbour(pid_);
    pid_ = startBusyNeighbour(seed);
  }

  bool on_;
  pid_t pid_ = 0;
  unsigned restarts_ = 0;
};

ScheduleKind scheduleNamed(const std::string& name) {
  const ScheduleSource source(name);
  if (!source.isBuiltIn())
    throw std::runtime_error("unknown schedule " + name);
  return source.kind();
}

TuneCandidate candidateOf(const nlohmann::json& json) {
  TuneCandidate c;
  c.stages = json.at("stages");
  c.ranks = json.at("ranks");
  c.microBatches = json.at("micro_batches");
  c.schedule = scheduleNamed(json.at("schedule"));
  c.checkpoint = parseCheckpointMode(json.at("checkpoint"));
  c.virtualStages = json.at("virtual_stages");
  c.threadsPerStage = json.at("threads_per_stage");
  c.dataParallel = json.at("data_parallel");
  c.boundaries = json.at("boundaries").get<std::vector<int>>();
  c.predictedStepMs = json.value("predicted_step_ms", 0.0);
  c.measuredStepMs = json.value("measured_step_ms", -1.0);
  return c;
}

std::string keyOf(const TuneCandidate& c) {
  std::string key = c.label() + " @";
  for (int b : c.boundaries)
    key += " " + std::to_string(b);
  return key;
}

// One fresh `tpipe tune --quick --json` process: its candidates, choice
// first, and its notes (what it measured and why it chose).
std::vector<TuneCandidate> tuneInAFreshProcess(
    const std::string& tpipe,
    const std::string& config,
    std::vector<std::string>& notes) {
  const std::string command =
      "'" + tpipe + "' tune '" + config + "' --quick --json 2>/dev/null";
  FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe)
    throw std::runtime_error("cannot run " + command);
  std::string text;
  char buffer[65536];
  size_t n;
  while ((n = std::fread(buffer, 1, sizeof buffer, pipe)) > 0)
    text.append(buffer, n);
  if (::pclose(pipe) != 0)
    throw std::runtime_error(command + " failed");
  const nlohmann::json result = nlohmann::json::parse(text);
  std::vector<TuneCandidate> out{candidateOf(result.at("choice"))};
  notes = result.value("notes", std::vector<std::string>{});
  for (const auto& c : result.at("candidates")) {
    if (!c.contains("infeasible"))
      out.push_back(candidateOf(c));
  }
  return out;
}

// A plan's step as a user meets it: `tpipe train` of the config with that
// plan, in a fresh process, for about `seconds` of steps; the mean step
// (from the metrics' elapsed_s) past the run's first fifth (a fresh
// process's first steps are slower, for a handful of them): what the run's
// throughput says. A neighbour's bursts of 0.1-0.9 s slow a share of the
// steps; the median step of a one-second window landed in them or out of
// them by chance (one plan's five runs spanned 1.68x by it), and the mean
// of two seconds still spread a plan's runs over 1.6x.
double trainedStepMs(
    const std::string& tpipe,
    const nlohmann::json& config,
    const TuneCandidate& c,
    const std::string& scratch,
    double seconds) {
  const std::string configPath = scratch + "/plan.json";
  const std::string metricsPath = scratch + "/metrics.jsonl";
  std::ofstream(configPath) << configWithPlan(config, c).dump();
  const int steps = std::clamp(
      static_cast<int>(
          std::ceil(1000.0 * seconds / std::max(c.predictedStepMs, 1.0))),
      20,
      1000);
  const std::string command = "'" + tpipe + "' train '" + configPath +
      "' --set train.steps=" + std::to_string(steps) +
      " --set train.eval_every=0 --set data.eval_samples=16 --metrics '" +
      metricsPath + "' >/dev/null 2>&1";
  std::remove(metricsPath.c_str());
  if (std::system(command.c_str()) != 0)
    throw std::runtime_error(command + " failed");
  std::vector<double> elapsed;
  std::ifstream metrics(metricsPath);
  for (std::string line; std::getline(metrics, line);) {
    const auto record = nlohmann::json::parse(line);
    if (record.contains("loss") && record.contains("elapsed_s"))
      elapsed.push_back(record["elapsed_s"].get<double>());
  }
  const size_t first = elapsed.size() / 5;
  if (elapsed.size() < 3 || first + 1 >= elapsed.size())
    throw std::runtime_error("too few steps recorded by " + command);
  return 1000.0 * (elapsed.back() - elapsed[first]) /
      static_cast<double>(elapsed.size() - 1 - first);
}

// Every distinct choice, the top 5 predicted, then every few places down
// the ranking: about 10 plans.
std::vector<TuneCandidate> gridOf(
    const std::vector<TuneCandidate>& choices,
    const std::vector<TuneCandidate>& ranked) {
  std::vector<TuneCandidate> grid;
  auto add = [&](const TuneCandidate& c) {
    for (const auto& g : grid) {
      if (keyOf(g) == keyOf(c))
        return;
    }
    grid.push_back(c);
  };
  for (const auto& c : choices)
    add(c);
  for (size_t i = 0; i < std::min<size_t>(5, ranked.size()); ++i)
    add(ranked[i]);
  const size_t rest = ranked.size() > 5 ? ranked.size() - 5 : 0;
  for (size_t k = 1; k <= 5 && rest > 0; ++k)
    add(ranked[5 + (rest - 1) * k / 5]);
  return grid;
}

// The tunes and the grid's training runs, interleaved: round r runs tune r
// (while r < repeats), then every grid plan once, so that the predictions
// and the measurements they are held against span the same minutes. The
// machine drifts by 10-30% over minutes: a grid trained after all the tunes
// carried that drift into every error (one reference grid trained 7.5-37.5%
// slower than every tune had predicted). The grid is built from the first
// tune; a later tune's new choice joins it then, and is trained again at the
// end until it has 3 runs. Then the grid's two fastest and the choices train
// as many rounds again, alternating.
struct TunedAndTrained {
  std::vector<TuneCandidate> choices;             // each tune's
  std::vector<std::vector<TuneCandidate>> ranked; // each tune's ranking
  std::vector<std::vector<std::string>> notes;    // each tune's
  std::vector<TuneCandidate> grid;
  std::vector<double> measured;          // per grid plan, the mean of its runs
  std::vector<std::vector<double>> runs; // per grid plan, in run order
  // Per grid plan, the round of each of its runs (-1: trained at the end).
  std::vector<std::vector<int>> roundOfRun;
};

TunedAndTrained tuneAndTrainInTurn(
    const std::string& tpipe,
    const std::string& path,
    int repeats,
    int rounds,
    double runSeconds,
    BusyNeighbour& neighbour) {
  nlohmann::json config;
  std::ifstream(path) >> config;
  char pattern[] = "/tmp/tune-bench-XXXXXX";
  const char* scratch = ::mkdtemp(pattern);
  if (!scratch)
    throw std::runtime_error("cannot make a scratch directory");
  TunedAndTrained out;
  std::vector<std::vector<double>>& runs = out.runs;
  // `bursts`: the seed of the neighbour's bursts the run meets.
  auto train = [&](size_t g, int round, unsigned bursts) {
    neighbour.seeded(bursts);
    runs[g].push_back(
        trainedStepMs(tpipe, config, out.grid[g], scratch, runSeconds));
    out.roundOfRun[g].push_back(round);
  };
  for (int round = 0; round < std::max(repeats, rounds); ++round) {
    if (round < repeats) {
      out.notes.emplace_back();
      neighbour.running();
      std::vector<TuneCandidate> run =
          tuneInAFreshProcess(tpipe, path, out.notes.back());
      out.choices.push_back(run.front());
      out.ranked.emplace_back(run.begin() + 1, run.end());
      std::cout << "run " << round + 1 << ": " << run.front().label()
                << ", predicted " << run.front().predictedStepMs << " ms"
                << std::endl;
      const bool inGrid = std::any_of(
          out.grid.begin(), out.grid.end(), [&](const TuneCandidate& g) {
            return keyOf(g) == keyOf(run.front());
          });
      if (round == 0)
        out.grid = gridOf(out.choices, out.ranked.front());
      else if (!inGrid)
        out.grid.push_back(run.front());
      runs.resize(out.grid.size());
      out.roundOfRun.resize(out.grid.size());
    }
    if (round < rounds) {
      for (size_t g = 0; g < out.grid.size(); ++g)
        train(g, round, 1 + round);
    }
  }
  for (size_t g = 0; g < out.grid.size(); ++g) {
    while (runs[g].size() < std::min<size_t>(3, rounds))
      train(g, -1, 1 + static_cast<unsigned>(runs[g].size()));
  }
  // The grid's two fastest and every choice trained again, side by side,
  // as many rounds more: the least of ten plans' means is low by its own
  // luck (its runs met fewer bursts, or the machine's faster minutes), and
  // choice / best held each choice against that.
  std::vector<size_t> fastest(out.grid.size());
  for (size_t g = 0; g < fastest.size(); ++g)
    fastest[g] = g;
  std::sort(fastest.begin(), fastest.end(), [&](size_t a, size_t b) {
    return mean(runs[a]) < mean(runs[b]);
  });
  std::vector<size_t> contenders(
      fastest.begin(), fastest.begin() + std::min<size_t>(2, fastest.size()));
  for (const auto& c : out.choices) {
    for (size_t g = 0; g < out.grid.size(); ++g) {
      if (keyOf(out.grid[g]) == keyOf(c) &&
          std::find(contenders.begin(), contenders.end(), g) ==
              contenders.end())
        contenders.push_back(g);
    }
  }
  for (int round = 0; round < rounds; ++round) {
    for (size_t g : contenders)
      train(g, -1, 101 + round);
  }
  std::system(("rm -rf '" + std::string(scratch) + "'").c_str());
  for (auto& r : runs)
    out.measured.push_back(mean(r));
  return out;
}

std::string fixedText(double ms) {
  char text[32];
  std::snprintf(text, sizeof text, "%.2f", ms);
  return text;
}

struct Summary {
  int sameChoice = 0, repeats = 0;
  double othersSlower = 0.0;  // the other choices against the usual one
  double worstOverBest = 0.0; // a choice's measured step over the grid's best
  double medianError = 0.0;   // |predicted - measured| / measured, the grid
  double worstChoiceError = 0.0;
  // The tuner's own measurement of its choice (where it ran the near ties),
  // else its prediction, against this process's measurement: what a user
  // expects from the choice line.
  double worstExpectedError = 0.0;
  // The same two errors with each tune held against the grid's round that
  // ran right after it (the same minute) instead of the mean of every
  // round: this machine's speed steps by a quarter and back for a minute
  // or more at a time, and a mean over five minutes carries that into
  // every tune's error.
  double pairedMedianError = 0.0;
  double pairedWorstChoiceError = 0.0;
  // The usual choice's slowest training run over its fastest: how far the
  // machine itself moved meanwhile.
  double machineSpread = 0.0;
};

// The run of grid plan `g` in round `round`, or null.
const double* runInRound(const TunedAndTrained& trial, size_t g, int round) {
  const auto& rounds = trial.roundOfRun[g];
  const auto found = std::find(rounds.begin(), rounds.end(), round);
  return found == rounds.end() ? nullptr
                               : &trial.runs[g][found - rounds.begin()];
}

nlohmann::json benchConfig(
    const std::string& tpipe,
    const std::string& path,
    int repeats,
    bool busy,
    Summary& summary) {
  loadConfig(path); // a bad config is refused before any run
  std::cout << "== " << path << (busy ? " (busy)" : " (quiet)") << std::endl;
  // Beside the neighbour a plan's step swings with the share of its run the
  // bursts took: its runs train twice as long there.
  TunedAndTrained trial;
  {
    BusyNeighbour neighbour(busy);
    trial = tuneAndTrainInTurn(
        tpipe, path, repeats, 5, busy ? 8.0 : 4.0, neighbour);
  }
  const std::vector<TuneCandidate>& choices = trial.choices;
  const std::vector<TuneCandidate>& grid = trial.grid;
  const std::vector<double>& measured = trial.measured;
  std::map<std::string, double> measuredOf;
  for (size_t g = 0; g < grid.size(); ++g)
    measuredOf[keyOf(grid[g])] = measured[g];
  const double best = *std::min_element(measured.begin(), measured.end());
  std::map<std::string, int> counts;
  for (const auto& c : choices)
    ++counts[keyOf(c)];
  std::string usual;
  for (const auto& [key, count] : counts) {
    if (usual.empty() || count > counts[usual])
      usual = key;
  }
  summary = Summary{};
  summary.repeats = repeats;
  summary.sameChoice = counts[usual];
  std::map<std::string, size_t> gridIndexOf;
  for (size_t g = 0; g < grid.size(); ++g)
    gridIndexOf[keyOf(grid[g])] = g;
  const std::vector<double>& usualRuns = trial.runs[gridIndexOf[usual]];
  summary.machineSpread =
      *std::max_element(usualRuns.begin(), usualRuns.end()) /
      *std::min_element(usualRuns.begin(), usualRuns.end());
  nlohmann::json runs = nlohmann::json::array();
  for (size_t t = 0; t < choices.size(); ++t) {
    const TuneCandidate& c = choices[t];
    const double ms = measuredOf[keyOf(c)];
    if (const double* paired =
            runInRound(trial, gridIndexOf[keyOf(c)], static_cast<int>(t)))
      summary.pairedWorstChoiceError = std::max(
          summary.pairedWorstChoiceError,
          std::abs(c.predictedStepMs - *paired) / *paired);
    summary.othersSlower =
        std::max(summary.othersSlower, ms / measuredOf[usual] - 1.0);
    summary.worstOverBest = std::max(summary.worstOverBest, ms / best);
    const double error = std::abs(c.predictedStepMs - ms) / ms;
    summary.worstChoiceError = std::max(summary.worstChoiceError, error);
    const double expected =
        c.measuredStepMs >= 0 ? c.measuredStepMs : c.predictedStepMs;
    summary.worstExpectedError =
        std::max(summary.worstExpectedError, std::abs(expected - ms) / ms);
    nlohmann::json row = tuneCandidateToJson(c);
    row["measured_step_ms"] = ms;
    runs.push_back(row);
  }
  // Each tune's ranking by plan: its prediction of every grid plan it
  // ranked, and its own measurement of those it ran in turn (the mean of
  // its rounds, each after another plan's step): how far that figure,
  // which anchors the predictions, is from training's. The grid's error
  // pools every tune's.
  std::vector<std::map<std::string, const TuneCandidate*>> rankingOf(
      trial.ranked.size());
  for (size_t t = 0; t < trial.ranked.size(); ++t) {
    for (const auto& c : trial.ranked[t])
      rankingOf[t][keyOf(c)] = &c;
  }
  std::vector<double> errors, pairedErrors;
  std::vector<std::vector<double>> errorsOfTune(trial.ranked.size());
  nlohmann::json rows = nlohmann::json::array();
  std::printf(
      "pred ms and tuner ms: the tunes' median; error: of that median\n");
  std::printf(
      "%-48s %10s %10s %8s %10s\n",
      "plan",
      "pred ms",
      "meas ms",
      "error",
      "tuner ms");
  for (size_t g = 0; g < grid.size(); ++g) {
    const std::string key = keyOf(grid[g]);
    std::vector<double> predictions, tunedMs;
    for (size_t t = 0; t < rankingOf.size(); ++t) {
      const auto found = rankingOf[t].find(key);
      if (found == rankingOf[t].end())
        continue;
      const TuneCandidate& c = *found->second;
      predictions.push_back(c.predictedStepMs);
      if (c.measuredStepMs >= 0)
        tunedMs.push_back(c.measuredStepMs);
      const double e = std::abs(c.predictedStepMs - measured[g]) / measured[g];
      errors.push_back(e);
      errorsOfTune[t].push_back(e);
      if (const double* paired = runInRound(trial, g, static_cast<int>(t)))
        pairedErrors.push_back(std::abs(c.predictedStepMs - *paired) / *paired);
    }
    const double predicted =
        predictions.empty() ? grid[g].predictedStepMs : median(predictions);
    const double error = (predicted - measured[g]) / measured[g];
    const std::string tuned =
        tunedMs.empty() ? std::string("-") : fixedText(median(tunedMs));
    std::printf(
        "%-48s %10.2f %10.2f %+7.1f%% %10s%s\n",
        grid[g].label().c_str(),
        predicted,
        measured[g],
        100.0 * error,
        tuned.c_str(),
        counts.count(key)
            ? ("  <- chosen " + std::to_string(counts[key]) + "x").c_str()
            : "");
    nlohmann::json row = tuneCandidateToJson(grid[g]);
    row["predicted_step_ms"] = predicted;
    row["measured_step_ms"] = measured[g];
    row["predicted_step_ms_each_tune"] = predictions;
    row["measured_step_ms_each_run"] = trial.runs[g];
    if (!tunedMs.empty())
      row["tuner_measured_step_ms"] = median(tunedMs);
    rows.push_back(row);
  }
  summary.medianError = median(errors);
  summary.pairedMedianError = pairedErrors.empty() ? 0.0 : median(pairedErrors);
  std::printf("grid |error| median per tune:");
  for (const auto& e : errorsOfTune)
    std::printf(" %.1f%%", e.empty() ? 0.0 : 100.0 * median(e));
  std::printf(" (pooled below)\n");
  std::printf(
      "same choice %d/%d, others +%.1f%%; choice / best measured <= %.3f; "
      "|error| median %.1f%%, choice's worst %.1f%% (as measured by the "
      "tuner: %.1f%%)\n",
      summary.sameChoice,
      summary.repeats,
      100.0 * summary.othersSlower,
      summary.worstOverBest,
      100.0 * summary.medianError,
      100.0 * summary.worstChoiceError,
      100.0 * summary.worstExpectedError);
  std::printf(
      "each tune against the round right after it: |error| median %.1f%%, "
      "choice's worst %.1f%%; the choice's own runs span x%.2f\n\n",
      100.0 * summary.pairedMedianError,
      100.0 * summary.pairedWorstChoiceError,
      summary.machineSpread);
  return {
      {"config", path},
      {"busy", busy},
      {"repeats", repeats},
      {"same_choice", summary.sameChoice},
      {"others_slower", summary.othersSlower},
      {"choice_over_best", summary.worstOverBest},
      {"median_abs_error", summary.medianError},
      {"worst_choice_abs_error", summary.worstChoiceError},
      {"worst_choice_expected_abs_error", summary.worstExpectedError},
      {"paired_median_abs_error", summary.pairedMedianError},
      {"paired_worst_choice_abs_error", summary.pairedWorstChoiceError},
      {"choice_runs_max_over_min", summary.machineSpread},
      {"choices", runs},
      {"tune_notes", trial.notes},
      {"grid", rows}};
}

nlohmann::json benchCluster() {
  const std::string dir = std::string(TPIPE_SOURCE_DIR) + "/configs/";
  const Config config = loadConfig(dir + "gpt3_175b.json");
  const nlohmann::json cluster =
      readJsonFile(dir + "cluster_1024.json", "cluster_1024.json");
  const auto start = std::chrono::steady_clock::now();
  const TuneOutcome outcome =
      tuneForCluster(config, cluster, "cluster_1024.json");
  const double ms = std::chrono::duration<double, std::milli>(
                        std::chrono::steady_clock::now() - start)
                        .count();
  const TuneCandidate& choice =
      outcome.result.candidates[outcome.result.choice];
  std::printf(
      "== cluster: GPT-3 175B on 1024 devices planned in %.0f ms (%zu "
      "candidates): %s, %.0f ms per step, bubble %.1f%%\n",
      ms,
      outcome.result.candidates.size(),
      choice.label().c_str(),
      choice.predictedStepMs,
      100.0 * choice.bubble);
  return {
      {"plan_ms", ms},
      {"candidates", outcome.result.candidates.size()},
      {"choice", tuneCandidateToJson(choice)}};
}

} // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  const char* usage =
      "usage: tune_bench OUT.json [--repeat N] [--busy | --busy-only] "
      "[CONFIG ...]\n";
  if (!args.empty() && (args.front() == "--help" || args.front() == "-h")) {
    std::cout << usage;
    return 0;
  }
  if (args.empty() || args.front().rfind("-", 0) == 0) {
    std::cerr << usage;
    return 2;
  }
  const std::string out_path = args.front();
  int repeats = 1;
  bool busy = false;
  // --busy-only: for a change that only a neighbour's bursts reach.
  bool quiet = true;
  std::vector<std::string> configs;
  for (size_t i = 1; i < args.size(); ++i) {
    if (args[i] == "--repeat") {
      const std::string count = i + 1 < args.size() ? args[++i] : "";
      char* end = nullptr;
      const long value = std::strtol(count.c_str(), &end, 10);
      if (count.empty() || *end != '\0' || value < 1 || value > 1000) {
        std::cerr << "tune_bench: --repeat wants a count from 1 to 1000, got '"
                  << count << "'\n";
        return 2;
      }
      repeats = static_cast<int>(value);
    } else if (args[i] == "--busy")
      busy = true;
    else if (args[i] == "--busy-only")
      busy = true, quiet = false;
    else if (args[i].rfind("-", 0) == 0) {
      std::cerr << "tune_bench: unknown option " << args[i] << "\n" << usage;
      return 2;
    } else
      configs.push_back(args[i]);
  }
  const std::string self = argv[0];
  const std::string tpipe = self.substr(0, self.rfind('/') + 1) + "tpipe";
  if (configs.empty()) {
    const std::string dir = std::string(TPIPE_SOURCE_DIR) + "/configs/";
    for (const char* name :
         {"reference_mlp.json",
          "fashion_mnist_cnn.json",
          "mlp_synthetic.json",
          "char_transformer.json"})
      configs.push_back(dir + name);
  }
  nlohmann::json out = {{"configs", nlohmann::json::array()}};
  out["cluster"] = benchCluster();
  std::cout << std::endl;
  struct Row {
    std::string name;
    bool busy;
    Summary summary;
  };
  std::vector<Row> rows;
  for (const auto& path : configs) {
    std::vector<bool> states;
    if (quiet)
      states.push_back(false);
    if (busy)
      states.push_back(true);
    for (bool state : states) {
      Summary summary;
      out["configs"].push_back(
          benchConfig(tpipe, path, repeats, state, summary));
      rows.push_back({path.substr(path.rfind('/') + 1), state, summary});
    }
  }
  std::printf(
      "%-26s %-6s %8s %9s %12s %13s %13s %13s %8s %8s %8s\n",
      "config",
      "state",
      "same",
      "others",
      "choice/best",
      "median |err|",
      "choice |err|",
      "as measured",
      "paired",
      "choice",
      "machine");
  std::vector<double> medians;
  for (const auto& row : rows) {
    std::printf(
        "%-26s %-6s %5d/%-2d %+8.1f%% %12.3f %12.1f%% %12.1f%% %12.1f%% "
        "%7.1f%% %7.1f%% %7.2fx\n",
        row.name.c_str(),
        row.busy ? "busy" : "quiet",
        row.summary.sameChoice,
        row.summary.repeats,
        100.0 * row.summary.othersSlower,
        row.summary.worstOverBest,
        100.0 * row.summary.medianError,
        100.0 * row.summary.worstChoiceError,
        100.0 * row.summary.worstExpectedError,
        100.0 * row.summary.pairedMedianError,
        100.0 * row.summary.pairedWorstChoiceError,
        row.summary.machineSpread);
    medians.push_back(row.summary.medianError);
  }
  std::printf(
      "goals: same choice >= 4 of 5 and others within 5%%; choice/best <= "
      "1.05; median |err| <= 10%%; choice |err| <= 10%% in every run\n"
      "paired: the same two errors, each tune against the round trained "
      "right after it; machine: the choice's slowest run over its fastest\n");
  std::ofstream(out_path) << out.dump(1) << "\n";
  return 0;
}
