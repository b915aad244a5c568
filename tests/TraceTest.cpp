#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <torch/torch.h>

#include "tpipe/pipeline.h"
#include "tpipe/curves.h"
#include "tpipe/trace.h"

namespace tpipe {
namespace {

torch::nn::Sequential net() {
  torch::manual_seed(0);
  return torch::nn::Sequential(
      torch::nn::Linear(16, 32),
      torch::nn::Tanh(),
      torch::nn::Linear(32, 32),
      torch::nn::ReLU(),
      torch::nn::Linear(32, 4));
}

torch::Tensor loss(const torch::Tensor& out, const torch::Tensor& y) {
  return torch::nn::functional::cross_entropy(out, y);
}

struct Recorded {
  std::vector<torch::Tensor> grads;
  double loss = 0;
  Trace trace;
};

Recorded run(const std::string& schedule, bool record, int steps = 3) {
  torch::nn::Sequential model = net();
  PipelineOptions options;
  options.devices = {"cpu:0", "cpu:1", "cpu:2"};
  options.microBatches = 4;
  options.schedule = schedule;
  options.record = record;
  Pipeline pipe(layersOf(model), options);
  torch::manual_seed(1);
  torch::Tensor x = torch::randn({16, 16});
  torch::Tensor y = torch::randint(0, 4, {16}, torch::kLong);
  Recorded result;
  for (int s = 0; s < steps; ++s)
    result.loss = pipe.trainStep(x, y, loss).item<double>();
  pipe.forward(x); // inference is not recorded
  for (const auto& p : pipe.parameters())
    result.grads.push_back(p.grad().clone());
  result.trace = pipe.trace();
  return result;
}

int computeInstructions(const Schedule& schedule) {
  int count = 0;
  for (const auto& list : schedule.perRank) {
    for (const auto& instruction : list)
      count += isCompute(instruction);
  }
  return count;
}

TEST(TraceTest, ChromeTraceHasOneEventPerComputeInstruction) {
  for (const char* schedule : {"gpipe", "zb-h1"}) {
    const Recorded r = run(schedule, true);
    ASSERT_EQ(r.trace.steps.size(), 3u);
    const nlohmann::json json =
        nlohmann::json::parse(chromeTrace(r.trace).dump());
    int compute = 0, instants = 0, threads = 0;
    for (const auto& event : json["traceEvents"]) {
      ASSERT_TRUE(event.contains("ph"));
      if (event["ph"] == "X") {
        ASSERT_GE(event["dur"].get<double>(), 0.0);
        const std::string cat = event["cat"];
        if (cat == "forward" || cat == "backward" || cat == "recompute" ||
            cat == "backward_input" || cat == "backward_weight") {
          ++compute;
          EXPECT_TRUE(std::regex_match(
              event["name"].get<std::string>(), std::regex("[FBRbw][0-9]+")));
          EXPECT_TRUE(event["args"].contains("micro_batch"));
          EXPECT_TRUE(event["args"].contains("stage"));
        }
      }
      if (event["ph"] == "i")
        ++instants;
      if (event["ph"] == "M" && event["name"] == "thread_name")
        ++threads;
    }
    EXPECT_EQ(compute, 3 * computeInstructions(r.trace.schedule)) << schedule;
    EXPECT_EQ(instants, 4); // three step starts and the end
    EXPECT_EQ(threads, 3);
  }
}

TEST(TraceTest, TransfersCarryTheirBytes) {
  const Recorded r = run("1f1b", true, 1);
  int transfers = 0;
  for (const auto& event : r.trace.steps[0].events) {
    const Instruction& instruction =
        r.trace.schedule.perRank[event.rank][event.index];
    if (!isCompute(instruction)) {
      ++transfers;
      EXPECT_EQ(event.bytes, 4 * 32 * 4)
          << shortLabel(instruction); // 4 samples x 32 floats
    }
  }
  EXPECT_EQ(
      transfers,
      2 * 2 * 2 * 4); // 2 boundaries x (act + grad) x (send + recv) x 4
}

TEST(TraceTest, ReportAddsUp) {
  const Recorded r = run("1f1b", true);
  const BubbleReport report = bubbleReport(r.trace);
  ASSERT_EQ(report.ranks.size(), 3u);
  for (const auto& rank : report.ranks) {
    EXPECT_NEAR(rank.busyMs + rank.idleMs, rank.wallMs, 1e-9);
    EXPECT_NEAR(rank.busyMs, rank.computeMs + rank.communicationMs, 1e-9);
    EXPECT_GE(rank.idleMs, 0.0);
    EXPECT_GT(rank.computeMs, 0.0);
  }
  EXPECT_GT(report.measuredBubble, 0.0);
  EXPECT_LT(report.measuredBubble, 1.0);
  EXPECT_NEAR(report.theoreticalBubble, 2.0 / 6.0, 1e-12);
  EXPECT_GT(report.simulatedStepMs, 0.0);
  // Back to back: never longer than with the barrier; the measured
  // interval is the recorded starts' mean spacing.
  EXPECT_GT(report.simulatedSteadyStepMs, 0.0);
  EXPECT_LE(report.simulatedSteadyStepMs, report.simulatedStepMs + 1e-9);
  const double firstToLastUs =
      r.trace.steps.back().originUs - r.trace.steps.front().originUs;
  EXPECT_NEAR(report.measuredStartToStartMs, firstToLastUs / 2000.0, 1e-9);
  EXPECT_GT(report.measuredStartToStartMs, 0.0);
  const auto json = bubbleReportToJson(report);
  EXPECT_EQ(json["ranks"].size(), 3u);
  EXPECT_TRUE(json["definitions"].contains("measured_bubble"));
}

// The overlap of a forward paired with a backward (DualPipeV's pairs) is
// measured from the recorded events: 0 where the two ran one after the
// other, as a CPU worker runs them; 1 where the shorter part ran entirely
// under the longer. The report carries it, and a costs file reads it back.
TEST(TraceTest, PairsMeasureTheirOverlap) {
  torch::nn::Sequential model = net();
  PipelineOptions options;
  options.devices = {"cpu:0", "cpu:1"};
  options.virtualStages = 2;
  options.microBatches = 4;
  options.schedule = "dualpipev";
  options.record = true;
  options.keepSteps = 1;
  Pipeline pipe(layersOf(model), options);
  torch::manual_seed(1);
  pipe.trainStep(torch::randn({16, 16}), torch::randint(0, 4, {16}), loss);
  Trace trace = pipe.trace();
  std::set<int> paired; // stages whose forwards pair with a backward
  for (const auto& list : trace.schedule.perRank) {
    for (const auto& instruction : list) {
      const auto* f = std::get_if<Forward>(&instruction);
      if (f && f->overlapsBackward)
        paired.insert(f->stage);
    }
  }
  ASSERT_FALSE(paired.empty());
  const BubbleReport sequential = bubbleReport(trace);
  for (int s : paired)
    EXPECT_EQ(sequential.measuredCosts[s].overlap, 0.0) << "stage " << s;
  // Each pair's backward moved to start with its forward.
  auto& events = trace.steps.front().events;
  for (auto& event : events) {
    const auto* f =
        std::get_if<Forward>(&trace.schedule.perRank[event.rank][event.index]);
    if (!f || !f->overlapsBackward)
      continue;
    TraceEvent* backward = nullptr;
    for (auto& other : events) {
      if (other.rank == event.rank && other.index > event.index &&
          isCompute(trace.schedule.perRank[other.rank][other.index]) &&
          (!backward || other.index < backward->index))
        backward = &other;
    }
    ASSERT_NE(backward, nullptr);
    const double length = backward->endUs - backward->startUs;
    backward->startUs = event.startUs;
    backward->endUs = event.startUs + length;
  }
  const BubbleReport hidden = bubbleReport(trace);
  for (int s : paired)
    EXPECT_EQ(hidden.measuredCosts[s].overlap, 1.0) << "stage " << s;
  const auto costs = stageCostsFromJson(
      bubbleReportToJson(hidden), trace.schedule.stages(), "report");
  for (int s : paired)
    EXPECT_EQ(costs[s].overlap, 1.0) << "stage " << s;
  EXPECT_LT(hidden.simulatedStepMs, sequential.simulatedStepMs);
  // Costs a schedule's sums could overflow are refused, naming the value.
  nlohmann::json huge = bubbleReportToJson(hidden);
  huge["stage_costs"][0]["forward_ms"] = 1e300;
  try {
    stageCostsFromJson(huge, trace.schedule.stages(), "report");
    ADD_FAILURE() << "1e300 ms accepted";
  } catch (const ConfigError& error) {
    EXPECT_NE(
        std::string(error.what())
            .find("stage_costs[0].forward_ms: expected a non-negative number "
                  "up to 1e9, got 1e+300"),
        std::string::npos)
        << error.what();
  }
}

// Minimal XML well-formedness: every tag closes in order, attributes quoted.
bool wellFormed(const std::string& xml, std::string& why) {
  std::vector<std::string> open;
  const std::regex tag(
      R"(<(/?)([a-zA-Z]+)((?:\s+[a-zA-Z0-9:-]+="[^"<]*")*)\s*(/?)>)");
  size_t position = 0;
  for (auto it = std::sregex_iterator(xml.begin(), xml.end(), tag);
       it != std::sregex_iterator();
       ++it) {
    const auto& m = *it;
    const std::string between = xml.substr(position, m.position() - position);
    if (between.find('<') != std::string::npos) {
      why = "stray '<' near " + between.substr(0, 40);
      return false;
    }
    position = m.position() + m.length();
    if (m[1] == "/") {
      if (open.empty() || open.back() != m[2]) {
        why = "unbalanced </" + m[2].str() + ">";
        return false;
      }
      open.pop_back();
    } else if (m[4] != "/") {
      open.push_back(m[2]);
    }
  }
  why = open.empty() ? "" : "unclosed <" + open.back() + ">";
  return open.empty();
}

TEST(TraceTest, TimelineSvgIsWellFormed) {
  const Recorded r = run("zb-h1", true);
  const std::string svg = timelineSvg(r.trace);
  std::string why;
  EXPECT_TRUE(wellFormed(svg, why)) << why;
  EXPECT_EQ(svg.rfind("<svg", 0), 0u);
  EXPECT_NE(svg.find("bubble"), std::string::npos);
  EXPECT_NE(svg.find("backward weight (W)"), std::string::npos); // legend
  EXPECT_NE(svg.find("cpu:2"), std::string::npos); // a row per device
}

TEST(TraceTest, RecordingChangesNothingInResults) {
  for (const char* schedule : {"gpipe", "1f1b"}) {
    const Recorded off = run(schedule, false);
    const Recorded on = run(schedule, true);
    EXPECT_TRUE(off.trace.steps.empty());
    EXPECT_EQ(off.loss, on.loss);
    for (size_t i = 0; i < off.grads.size(); ++i)
      EXPECT_TRUE(torch::equal(off.grads[i], on.grads[i]));
  }
}

// The points of the polyline of class `name`, as (x, y) pairs.
std::vector<std::pair<double, double>> polyline(
    const std::string& svg,
    const std::string& name) {
  const std::regex line(
      "<polyline class=\"" + name + "\"[^>]*points=\"([^\"]*)\"");
  std::smatch match;
  std::vector<std::pair<double, double>> points;
  if (!std::regex_search(svg, match, line))
    return points;
  std::istringstream in(match[1].str());
  std::string pair;
  while (in >> pair) {
    const size_t comma = pair.find(',');
    points.emplace_back(
        std::stod(pair.substr(0, comma)), std::stod(pair.substr(comma + 1)));
  }
  return points;
}

// Curves from metrics lines: one point per record, later records of a step
// replacing earlier ones, lines still being written skipped, x growing with
// the step and y falling as the loss grows (SVG's y points down).
TEST(TraceTest, CurvesDrawEveryRecordOnce) {
  std::string lines;
  for (int step = 1; step <= 30; ++step) {
    lines +=
        nlohmann::json{
            {"step", step},
            {"loss", 3.0 - 0.05 * step},
            {"samples_per_s", 1000 + step}}
            .dump() +
        "\n";
  }
  lines += "{\"step\": 30, \"loss\": 2.0}\n"; // step 30 redone after a resume
  lines +=
      nlohmann::json{{"step", 10}, {"eval_loss", 2.5}, {"eval_accuracy", 0.4}}
          .dump() +
      "\n";
  lines +=
      nlohmann::json{{"step", 30}, {"eval_loss", 1.9}, {"eval_accuracy", 0.7}}
          .dump() +
      "\n";
  lines += "{\"step\": 31, \"lo"; // cut mid-line
  const std::string svg = curvesSvg(lines, "a <run> & co");
  const auto loss = polyline(svg, "loss");
  ASSERT_EQ(loss.size(), 30u);
  for (size_t i = 1; i < loss.size(); ++i)
    EXPECT_GT(loss[i].first, loss[i - 1].first);
  EXPECT_GT(loss[10].second, loss[1].second);
  // The redone step 30 (loss 2.0) is drawn above step 29 (loss 1.55).
  EXPECT_LT(loss[29].second, loss[28].second);
  EXPECT_EQ(polyline(svg, "eval-loss").size(), 2u);
  EXPECT_EQ(polyline(svg, "eval-accuracy").size(), 2u);
  EXPECT_EQ(polyline(svg, "samples-per-s").size(), 30u);
  EXPECT_NE(svg.find("a &lt;run&gt; &amp; co"), std::string::npos);
  EXPECT_NE(svg.find(">eval accuracy<"), std::string::npos);
  EXPECT_NE(svg.find(">step<"), std::string::npos);
  // Nothing yet: a picture that says so, not an error.
  EXPECT_NE(
      curvesSvg("", "t").find("no training records yet"), std::string::npos);
}

// A diverged run's losses (1e308 and -1e308: their difference overflows),
// losses a rounding step apart at 1e20 (a tick step below one unit in the
// last place, which once looped for ever), all-equal huge losses and steps
// at both ends of the doubles: each is drawn inside its panel, with a
// handful of ticks.
TEST(TraceTest, CurvesOfExtremeValuesStayInsideTheirPanels) {
  auto record = [](double step, double loss) {
    return nlohmann::json{{"step", step}, {"loss", loss}}.dump() + "\n";
  };
  const double huge = std::numeric_limits<double>::max();
  const std::vector<std::string> cases = {
      record(1, 1e308) + record(2, -1e308) + record(3, 0.5),
      record(1, -1e20) + record(2, std::nextafter(-1e20, 0.0)),
      record(1, -1e20) + record(2, -1e20),
      record(-huge, huge) + record(huge, -huge),
      record(1, 5e-324) + record(2, 0.0)};
  for (const std::string& lines : cases) {
    const std::string svg = curvesSvg(lines, "t");
    const auto loss = polyline(svg, "loss");
    ASSERT_EQ(loss.size(), 2u + (lines.find("0.5") != std::string::npos))
        << lines;
    for (const auto& [x, y] : loss) {
      EXPECT_TRUE(x >= 80 && x <= 820) << x << " in\n" << lines;
      EXPECT_TRUE(y >= 60 && y <= 360) << y << " in\n" << lines;
    }
    size_t texts = 0;
    for (size_t at = svg.find("<text"); at != std::string::npos;
         at = svg.find("<text", at + 1))
      ++texts;
    EXPECT_LT(texts, 40u) << lines;
    EXPECT_EQ(svg.find("nan"), std::string::npos) << lines;
    EXPECT_EQ(svg.find("inf"), std::string::npos) << lines;
  }
}

} // namespace
} // namespace tpipe
