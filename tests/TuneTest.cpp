// The tuner: its search over a cost model with known answers, and the
// cluster planner on a GPT-3-sized stack.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <stdexcept>
#include <thread>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "statistics.h"
#include "train/machine_load.h"
#include "model/layer_types.h"
#include "tpipe/config.h"
#include "tpipe/model.h"
#include "tpipe/tuning.h"
#include "tpipe/tune.h"

using namespace tpipe;

namespace {

// ms = perSample * n.
SizeCurve powerCurve(double perSample) {
  return SizeCurve::proportional(1.0, perSample);
}

// `layers` equal layers; one thread: forward 1 ms per sample (backward 2);
// two threads `speedup` times faster.
CostModel equalLayers(int layers, double speedup) {
  CostModel model;
  model.threads = {2, 1};
  for (int l = 0; l < layers; ++l) {
    LayerModel layer;
    layer.name = std::to_string(l);
    layer.forward = {powerCurve(1.0 / speedup), powerCurve(1.0)};
    layer.backward = {powerCurve(2.0 / speedup), powerCurve(2.0)};
    layer.paramBytes = 1000;
    layer.activationBytesPerSample = 100;
    layer.stashBytesPerSample = 100;
    model.layers.push_back(layer);
  }
  return model;
}

TuneRequest twoCores(int devices = 2) {
  TuneRequest request;
  request.batchSize = 16;
  for (int d = 0; d < devices; ++d)
    request.devices.push_back({"cpu:" + std::to_string(d)});
  request.cores = 2;
  return request;
}

const TuneCandidate& choiceOf(const TuneResult& result) {
  return result.candidates[result.choice];
}

} // namespace

TEST(TuneTest, OneStageWithAllThreadsWinsWhenThreadsScalePerfectly) {
  const TuneResult result = tunePlans(equalLayers(4, 2.0), twoCores());
  const TuneCandidate& choice = choiceOf(result);
  EXPECT_EQ(choice.ranks, 1);
  EXPECT_EQ(choice.threadsPerStage, 2);
  // 16 samples x 4 layers x 3 ms per sample, on two perfectly used threads.
  EXPECT_NEAR(choice.predictedStepMs, 16 * 4 * 3 / 2.0, 1e-6);
  bool said = false;
  for (const auto& note : result.notes)
    said = said || note.find("pipelining does not pay") != std::string::npos;
  EXPECT_TRUE(said);
}

TEST(TuneTest, PipeliningWinsWhenThreadsDoNotScale) {
  const TuneResult result = tunePlans(equalLayers(4, 1.0), twoCores());
  const TuneCandidate& choice = choiceOf(result);
  EXPECT_EQ(choice.ranks, 2);
  EXPECT_EQ(choice.threadsPerStage, 1);
  EXPECT_GT(choice.microBatches, 1);
  // Never slower than one stage, and the ranking is by prediction.
  for (size_t i = 1; i < result.candidates.size(); ++i) {
    if (!result.candidates[i].infeasible.empty())
      break;
    EXPECT_LE(
        result.candidates[i - 1].predictedStepMs,
        result.candidates[i].predictedStepMs);
  }
}

// Training runs the choice as the tuner predicted it: the resolver, given
// the candidate's request, gives its boundaries, micro-batches, threads and
// simulated step, for a built-in schedule and for `auto` (built from the
// calibrated stage costs, not unit costs).
TEST(TuneTest, TheChoicesPlanIsTheOnePredicted) {
  const CostModel model = equalLayers(5, 1.0);
  for (ScheduleKind kind : {ScheduleKind::kOneFOneB, ScheduleKind::kAuto}) {
    TuneRequest request = twoCores();
    request.schedules = {kind};
    const TuneResult result = tunePlans(model, request);
    const TuneCandidate& choice = choiceOf(result);
    ASSERT_EQ(choice.ranks, 2) << choice.label();
    const Plan plan = resolvePlan(candidatePlanRequest(model, request, choice));
    EXPECT_EQ(plan.boundaries, choice.boundaries) << choice.label();
    EXPECT_EQ(plan.schedule.microBatches, choice.microBatches);
    EXPECT_EQ(plan.schedule.ranks, 2);
    EXPECT_EQ(plan.checkpoint, choice.checkpoint);
    EXPECT_EQ(plan.threadsPerDevice, choice.threadsPerStage);
    // No per-step or held-activation costs in this model: the prediction
    // is the simulated pipeline alone.
    EXPECT_NEAR(plan.simulation.makespan, choice.predictedStepMs, 1e-9)
        << choice.label();
  }
}

// Plans that run the same instructions are one candidate: on one stage
// except_last recomputes nothing (the only stage is the last), and with one
// micro-batch fill-drain and 1F1B are the same list.
TEST(TuneTest, PlansRunningTheSameInstructionsAreListedOnce) {
  const TuneResult result = tunePlans(equalLayers(4, 2.0), twoCores());
  int oneMicroBatch = 0;
  for (const auto& c : result.candidates) {
    if (c.ranks != 1)
      continue;
    EXPECT_NE(c.checkpoint, CheckpointMode::kExceptLast) << c.label();
    if (c.microBatches == 1 && c.checkpoint == CheckpointMode::kNever) {
      ++oneMicroBatch;
      EXPECT_EQ(c.schedule, ScheduleKind::kGpipe) << c.label();
    }
  }
  EXPECT_EQ(oneMicroBatch, 1);
  // Two stages at 2 micro-batches: ZB-H2 runs ZB-H1's instructions, and the
  // three ZB-V variants one program; at 4 micro-batches ZB-H2 differs.
  auto count = [&](ScheduleKind kind, int microBatches) {
    return std::count_if(
        result.candidates.begin(),
        result.candidates.end(),
        [&](const TuneCandidate& c) {
          return c.ranks == 2 && c.microBatches == microBatches &&
              c.checkpoint == CheckpointMode::kNever && c.schedule == kind &&
              c.infeasible.empty();
        });
  };
  EXPECT_EQ(count(ScheduleKind::kZeroBubbleH1, 2), 1);
  EXPECT_EQ(count(ScheduleKind::kZeroBubbleH2, 2), 0);
  EXPECT_EQ(count(ScheduleKind::kZeroBubbleV, 2), 1);
  EXPECT_EQ(count(ScheduleKind::kZeroBubbleVHalf, 2), 0);
  EXPECT_EQ(count(ScheduleKind::kZeroBubbleVMin, 2), 0);
  EXPECT_EQ(count(ScheduleKind::kZeroBubbleH2, 4), 1);
  EXPECT_TRUE(std::any_of(
      result.notes.begin(), result.notes.end(), [](const std::string& note) {
        return note.find("same instructions as a simpler one") !=
            std::string::npos;
      }));
  // Asked for 1F1B alone, one stage and one micro-batch is still there.
  TuneRequest only = twoCores();
  only.schedules = {ScheduleKind::kOneFOneB};
  bool found = false;
  for (const auto& c : tunePlans(equalLayers(4, 2.0), only).candidates)
    found = found || (c.ranks == 1 && c.microBatches == 1);
  EXPECT_TRUE(found);
}

// Holding activations costs time only beyond one micro-batch per stage, the
// working set the layers were profiled with: a one-stage, one-micro-batch
// plan pays nothing, fill-drain over 4 pays for the 3 it holds beyond one.
TEST(TuneTest, HeldActivationsAreChargedBeyondOneMicroBatch) {
  CostModel model = equalLayers(4, 2.0);
  TuneRequest request = twoCores();
  request.stageCounts = {1};
  request.microBatches = {1, 4};
  request.schedules = {ScheduleKind::kGpipe};
  request.checkpoints = {CheckpointMode::kNever};
  auto stepOf = [&](const TuneResult& result, int m) {
    for (const auto& c : result.candidates) {
      if (c.microBatches == m)
        return c;
    }
    ADD_FAILURE() << "no candidate with " << m << " micro-batches";
    return TuneCandidate{};
  };
  const TuneResult free = tunePlans(model, request);
  model.heldByteMs = 1e-3;
  const TuneResult charged = tunePlans(model, request);
  EXPECT_DOUBLE_EQ(
      stepOf(charged, 1).predictedStepMs, stepOf(free, 1).predictedStepMs);
  const TuneCandidate four = stepOf(charged, 4);
  EXPECT_NEAR(
      four.predictedStepMs - stepOf(free, 4).predictedStepMs,
      1e-3 * 0.75 * static_cast<double>(four.peakActivationBytes),
      1e-9);
}

// Among plans equally fast, fewer devices, then fewer stages a device, then
// the plainer schedule, then less recomputation, then fewer micro-batches.
TEST(TuneTest, SimplerPlansComeFirst) {
  TuneCandidate a, b;
  b.ranks = 2;
  EXPECT_TRUE(isSimplerPlan(a, b));
  EXPECT_FALSE(isSimplerPlan(b, a));
  b = a;
  b.schedule = ScheduleKind::kOneFOneB;
  EXPECT_TRUE(isSimplerPlan(a, b));
  b = a;
  b.checkpoint = CheckpointMode::kAlways;
  EXPECT_TRUE(isSimplerPlan(a, b));
  b = a;
  b.microBatches = 2;
  EXPECT_TRUE(isSimplerPlan(a, b));
  EXPECT_FALSE(isSimplerPlan(a, a));
  // DualPipe holds the other chain's copy of a stage beside each of its
  // own: no simpler than a V of two stages a device, which is listed first.
  TuneCandidate v = a, dual = a;
  v.ranks = dual.ranks = 2;
  v.virtualStages = 2;
  v.schedule = ScheduleKind::kZeroBubbleV;
  dual.schedule = ScheduleKind::kDualPipe;
  EXPECT_TRUE(isSimplerPlan(v, dual));
  EXPECT_FALSE(isSimplerPlan(dual, v));
  b = v;
  b.virtualStages = 1;
  b.schedule = ScheduleKind::kZeroBubbleH1;
  EXPECT_TRUE(isSimplerPlan(b, v));
}

TEST(TuneTest, PredictionsAreAnchoredToThePlansMeasuredInTurn) {
  auto plan =
      [](int ranks, int microBatches, double predicted, double measured) {
        TuneCandidate c;
        c.ranks = ranks;
        c.microBatches = microBatches;
        c.predictedStepMs = predicted;
        c.samplesPerSecond = 1000.0 / predicted;
        c.measuredStepMs = measured;
        return c;
      };
  TuneResult result;
  result.candidates = {
      plan(1, 1, 10.0, 13.0),  // one device: measured x1.3, and x1.5 twice
      plan(2, 4, 11.0, 9.9),   // two devices: measured x0.9
      plan(1, 2, 12.0, 18.0),  //
      plan(2, 8, 14.0, -1.0),  // not measured: its count's x0.9
      plan(1, 4, 15.0, -1.0),  // x1.5 (the median of 1.3, 1.5, 1.5)
      plan(4, 16, 20.0, -1.0), // no four-device plan measured: x1.4
      plan(1, 8, 30.0, 45.0)};
  TuneCandidate refused = plan(8, 1, 1.0, -1.0);
  refused.infeasible = "too big";
  result.candidates.push_back(refused);
  result.choice = 1; // the two-device plan measured fastest
  const std::string note = anchorToMeasured(result);
  const auto& all = result.candidates;
  ASSERT_EQ(all.size(), 8u);
  // Re-ranked by anchored predictions, the choice followed to its place.
  EXPECT_EQ(result.choice, 0u);
  EXPECT_EQ(all[0].ranks, 2);
  EXPECT_NEAR(all[0].predictedStepMs, 9.9, 1e-9);
  EXPECT_NEAR(all[0].samplesPerSecond, 1000.0 / 9.9, 1e-9);
  EXPECT_EQ(all[1].microBatches, 8);
  EXPECT_NEAR(all[1].predictedStepMs, 14.0 * 0.9, 1e-9);
  EXPECT_NEAR(all[2].predictedStepMs, 13.0, 1e-9); // its own measurement
  EXPECT_EQ(all[2].microBatches, 1);
  EXPECT_EQ(all[3].microBatches, 2);
  EXPECT_NEAR(all[4].predictedStepMs, 15.0 * 1.5, 1e-9);
  EXPECT_EQ(all[5].ranks, 4);
  EXPECT_NEAR(all[5].predictedStepMs, 20.0 * 1.4, 1e-9);
  EXPECT_NEAR(all[6].predictedStepMs, 45.0, 1e-9);
  EXPECT_FALSE(all[7].infeasible.empty()); // untouched, still last
  EXPECT_NEAR(all[7].predictedStepMs, 1.0, 1e-9);
  EXPECT_NE(note.find("4 plans measured"), std::string::npos) << note;
  EXPECT_NE(note.find("2 devices x0.90"), std::string::npos) << note;
  EXPECT_NE(note.find("others x1.40"), std::string::npos) << note;

  TuneResult unmeasured;
  unmeasured.candidates = {plan(1, 1, 10.0, -1.0)};
  EXPECT_EQ(anchorToMeasured(unmeasured), "");
  EXPECT_EQ(unmeasured.candidates[0].predictedStepMs, 10.0);
}

namespace {

TuneCandidate predictedPlan(int ranks, int microBatches, double predicted) {
  TuneCandidate c;
  c.ranks = ranks;
  c.microBatches = microBatches;
  c.predictedStepMs = predicted;
  c.samplesPerSecond = 1000.0 / predicted;
  return c;
}

// The same under `kind`, two stages a device where it is a V.
TuneCandidate scheduledPlan(
    int ranks,
    int microBatches,
    ScheduleKind kind,
    double predicted) {
  TuneCandidate c = predictedPlan(ranks, microBatches, predicted);
  c.schedule = kind;
  c.virtualStages = kind == ScheduleKind::kZeroBubbleV ? 2 : 1;
  c.stages = ranks * c.virtualStages;
  return c;
}

// Rounds beside a neighbour: plan k `calm[k]` ms a step calm and 1.3x in
// every other round's burst (the neighbour on a whole core), each pair of
// rounds `spread` off. Steps and loads, a list a plan.
std::pair<std::vector<std::vector<double>>, std::vector<std::vector<double>>>
roundsInBursts(const std::vector<double>& calm, double spread, int rounds) {
  std::vector<std::vector<double>> steps(calm.size()), loads(calm.size());
  for (int round = 0; round < rounds; ++round) {
    const bool burst = round % 2 == 1;
    const double jitter = 1.0 + ((round / 2) % 2 ? spread : -spread);
    for (size_t k = 0; k < calm.size(); ++k) {
      steps[k].push_back(jitter * (burst ? 1.3 : 1.0) * calm[k]);
      loads[k].push_back(burst ? 1.0 : 0.0);
    }
  }
  return {steps, loads};
}

} // namespace

// The simplest plan is run in turn however its prediction came out, so a
// noisy calibration cannot leave the fallback out of the measurement.
TEST(TuneTest, TheSimplestPlanIsAlwaysAContender) {
  TuneResult result;
  result.candidates = {
      predictedPlan(1, 4, 10.0),
      predictedPlan(1, 2, 10.5),
      predictedPlan(2, 8, 11.0),
      predictedPlan(1, 8, 11.5),
      predictedPlan(2, 4, 12.0),
      predictedPlan(1, 1, 16.0), // the simplest, beyond the 25% band
      predictedPlan(4, 8, 19.0),
      predictedPlan(1, 16, 25.0)}; // beyond twice the fastest
  result.choice = 0;
  std::vector<size_t> contenders = measurementContenders(result);
  std::sort(contenders.begin(), contenders.end());
  // The top four with at most two of a device count (the third one-device
  // plan gives way to the next two-device one), the four-device plan (its
  // count's fastest) and the simplest; never a plan over twice the fastest.
  EXPECT_EQ(contenders, (std::vector<size_t>{0, 1, 2, 4, 5, 6}));

  result.candidates[5].predictedStepMs = 21.0; // now over twice: left out
  std::swap(result.candidates[5], result.candidates[6]);
  contenders = measurementContenders(result);
  EXPECT_EQ(std::count(contenders.begin(), contenders.end(), 6u), 0);
  EXPECT_EQ(std::count(contenders.begin(), contenders.end(), 5u), 1);

  // A device count whose every plan a spoiled calibration put over twice
  // the fastest still has its fastest measured, within 4x, and the next of
  // the count predicted within 10% of it; beyond, not.
  result.candidates = {
      predictedPlan(1, 1, 10.0),
      predictedPlan(1, 2, 10.5),
      predictedPlan(2, 2, 23.0),
      predictedPlan(2, 4, 24.0),
      predictedPlan(2, 8, 25.0),
      predictedPlan(4, 8, 41.0)};
  contenders = measurementContenders(result);
  std::sort(contenders.begin(), contenders.end());
  EXPECT_EQ(contenders, (std::vector<size_t>{0, 1, 2, 3}));
  result.candidates[3].predictedStepMs = 25.5; // over 10% behind 23
  result.candidates[4].predictedStepMs = 26.0;
  contenders = measurementContenders(result);
  std::sort(contenders.begin(), contenders.end());
  EXPECT_EQ(contenders, (std::vector<size_t>{0, 1, 2}));

  // One stage under 1F1B differs from gpipe at its micro-batch count only in
  // the activations held: one of the two is measured, and the place goes to
  // the next plan.
  result.candidates = {
      predictedPlan(1, 2, 10.0),
      predictedPlan(1, 2, 10.2),
      predictedPlan(1, 1, 10.4),
      predictedPlan(2, 2, 11.0),
      predictedPlan(2, 4, 11.5)};
  result.candidates[1].schedule = ScheduleKind::kOneFOneB;
  contenders = measurementContenders(result);
  std::sort(contenders.begin(), contenders.end());
  EXPECT_EQ(contenders, (std::vector<size_t>{0, 2, 3, 4}));
  result.candidates[1].microBatches = 4; // no longer twins
  contenders = measurementContenders(result);
  std::sort(contenders.begin(), contenders.end());
  EXPECT_EQ(contenders, (std::vector<size_t>{0, 1, 2, 3, 4}));
  // The prediction's choice (the simpler of two near ties) is measured in
  // place of its twin, which the top four had picked.
  result.candidates[1].microBatches = 2;
  result.candidates[0].schedule = ScheduleKind::kOneFOneB;
  result.candidates[1].schedule = ScheduleKind::kGpipe;
  result.choice = 1;
  contenders = measurementContenders(result);
  std::sort(contenders.begin(), contenders.end());
  EXPECT_EQ(contenders, (std::vector<size_t>{1, 2, 3, 4}));
}

// A calibration's noise moves plans that split the backward and plans that
// do not apart, so the fastest of each kind is measured where the ranking
// left it out, within 1.5x of the fastest.
TEST(TuneTest, BothKindsOfBackwardAreMeasured) {
  using K = ScheduleKind;
  TuneResult result;
  result.candidates = {
      scheduledPlan(1, 1, K::kGpipe, 10.0),
      scheduledPlan(1, 2, K::kOneFOneB, 10.5),
      scheduledPlan(2, 4, K::kOneFOneB, 11.0),
      scheduledPlan(2, 2, K::kInterleaved, 11.5),
      scheduledPlan(2, 4, K::kInterleaved, 12.6),  // past 10% of 2-device's
      scheduledPlan(2, 2, K::kZeroBubbleH1, 13.0), // the fastest to split
      scheduledPlan(2, 4, K::kZeroBubbleH1, 13.5)};
  for (size_t interleaved : {3, 4}) {
    result.candidates[interleaved].virtualStages = 2;
    result.candidates[interleaved].stages = 4;
  }
  result.choice = 0;
  std::vector<size_t> contenders = measurementContenders(result);
  std::sort(contenders.begin(), contenders.end());
  EXPECT_EQ(contenders, (std::vector<size_t>{0, 1, 2, 3, 5}));

  // Beyond 1.5x of the fastest, not.
  result.candidates[5].predictedStepMs = 15.5;
  result.candidates[6].predictedStepMs = 16.0;
  contenders = measurementContenders(result);
  std::sort(contenders.begin(), contenders.end());
  EXPECT_EQ(contenders, (std::vector<size_t>{0, 1, 2, 3}));

  // Where the ranking measures one that splits it, nothing more joins.
  result.candidates[3] = scheduledPlan(2, 2, K::kZeroBubbleH2, 11.5);
  result.candidates[5].predictedStepMs = 13.0;
  contenders = measurementContenders(result);
  std::sort(contenders.begin(), contenders.end());
  EXPECT_EQ(contenders, (std::vector<size_t>{0, 1, 2, 3}));
}

// Beside a neighbour, contenders clearly behind after the first rounds
// make way for the next plans, by predictions scaled as their device
// count's measured plans were.
TEST(TuneTest, PlansANeighbourSlowedMakeWayForTheNext) {
  TuneResult result;
  result.candidates = {
      predictedPlan(1, 1, 10.0),  // measured 1.5x the fastest figure
      predictedPlan(2, 4, 11.0),  // measured: the fastest
      predictedPlan(1, 2, 11.5),  // measured 1.4x
      predictedPlan(2, 2, 12.0),  // next: 12 x 15 / 11 = 16.4
      predictedPlan(3, 4, 12.5),  // no three-device plan measured
      predictedPlan(2, 8, 12.8),  // next: 17.5
      predictedPlan(2, 16, 15.0), // 20.5: over 25% behind
      predictedPlan(4, 4, 13.0)};
  result.candidates[7].infeasible = "does not fit";
  const std::vector<size_t> measured{0, 1, 2};
  std::vector<size_t> next =
      contendersBesideANeighbour(result, measured, {22.5, 15.0, 21.0});
  EXPECT_EQ(next, (std::vector<size_t>{1, 3, 5}));
  // Nothing clearly behind: the slowest but the simplest makes way for
  // the fastest's simpler neighbour (2 stages at 2 micro-batches).
  next = contendersBesideANeighbour(result, measured, {15.5, 15.0, 16.4});
  EXPECT_EQ(next, (std::vector<size_t>{0, 1, 3}));
  // One stage the fastest, which has no simpler neighbour: the fastest
  // two-device plan's (2 stages at 2 micro-batches).
  next = contendersBesideANeighbour(result, measured, {15.0, 15.5, 16.4});
  EXPECT_EQ(next, (std::vector<size_t>{0, 1, 3}));
  // The fastest the simplest too: the other makes way, for its simpler
  // neighbour on two devices (one stage has none).
  next = contendersBesideANeighbour(result, {0, 1}, {15.0, 15.5});
  EXPECT_EQ(next, (std::vector<size_t>{0, 3}));
  // Room for one more than waits within 25%: the plans shrink to those.
  result.candidates[5].predictedStepMs = 14.0; // 19.1
  next = contendersBesideANeighbour(result, measured, {22.5, 15.0, 21.0});
  EXPECT_EQ(next, (std::vector<size_t>{1, 3}));
  EXPECT_THROW(
      contendersBesideANeighbour(result, measured, {15.0}),
      std::invalid_argument);
}

// One stage under 1F1B runs as under gpipe at its micro-batch count: where
// one of the two was measured, or has just joined, the other takes no place.
TEST(TuneTest, ATwinOfAMeasuredPlanTakesNoPlace) {
  auto oneStage = [](int microBatches, ScheduleKind kind, double ms) {
    TuneCandidate c = predictedPlan(1, microBatches, ms);
    c.schedule = kind;
    return c;
  };
  TuneResult result;
  result.candidates = {
      oneStage(2, ScheduleKind::kGpipe, 10.0),     // measured: the fastest
      oneStage(1, ScheduleKind::kGpipe, 10.5),     // measured, 27% behind
      predictedPlan(2, 4, 11.0),                   // measured, makes way
      oneStage(2, ScheduleKind::kOneFOneB, 10.2),  // 0's twin
      predictedPlan(2, 2, 11.2),                   // joins first
      oneStage(4, ScheduleKind::kGpipe, 10.6),     // joins second
      oneStage(4, ScheduleKind::kOneFOneB, 10.7)}; // 5's twin
  // One stage the fastest: the two-stage plan's simpler neighbour first,
  // then the prediction's order, twins left out.
  EXPECT_EQ(
      contendersBesideANeighbour(result, {0, 1, 2}, {15.0, 19.0, 18.0}),
      (std::vector<size_t>{0, 4, 5}));
  // No longer twins: the prediction's order again after the neighbour.
  result.candidates[3].microBatches = 8;
  EXPECT_EQ(
      contendersBesideANeighbour(result, {0, 1, 2}, {15.0, 19.0, 18.0}),
      (std::vector<size_t>{0, 4, 3}));
}

// The simplest plan within the noise of the fastest is the choice, so the
// fastest plan's simpler neighbours join before plans the prediction puts
// ahead: the same schedule family at half the micro-batches, not a plan
// that stops splitting the backward nor one at a quarter.
TEST(TuneTest, TheFastestPlansSimplerNeighbourJoinsFirst) {
  TuneResult result;
  result.candidates = {
      scheduledPlan(
          2, 4, ScheduleKind::kZeroBubbleH2, 10.0),    // measured: the fastest
      scheduledPlan(1, 1, ScheduleKind::kGpipe, 10.5), // measured, makes way
      scheduledPlan(2, 4, ScheduleKind::kZeroBubbleV, 10.6), // measured, stays
      scheduledPlan(
          2, 2, ScheduleKind::kZeroBubbleV, 10.7),        // next by prediction
      scheduledPlan(2, 2, ScheduleKind::kOneFOneB, 10.8), // does not split
      scheduledPlan(2, 1, ScheduleKind::kZeroBubbleH1, 10.9),  // a quarter
      scheduledPlan(2, 2, ScheduleKind::kZeroBubbleH1, 10.9)}; // the neighbour
  const std::vector<size_t> measured{0, 1, 2};
  const std::vector<double> figures{15.0, 22.5, 15.3};
  EXPECT_EQ(
      contendersBesideANeighbour(result, measured, figures),
      (std::vector<size_t>{0, 2, 6}));
  // None clearly behind: the slowest that stays makes way for the
  // neighbour all the same, but not the simplest plan measured.
  EXPECT_EQ(
      contendersBesideANeighbour(result, {0, 2, 4}, {15.0, 15.9, 15.3}),
      (std::vector<size_t>{0, 4, 6}));
  EXPECT_EQ(
      contendersBesideANeighbour(result, measured, {15.0, 15.9, 15.3}),
      (std::vector<size_t>{0, 1, 6}));
  EXPECT_EQ(
      contendersBesideANeighbour(result, {0, 1}, {15.0, 15.9}),
      (std::vector<size_t>{0, 1}));
  // One stage read the fastest: it has no simpler neighbour, and those of
  // the fastest plan on several devices come in (not the next by
  // prediction, zb-v at 4).
  EXPECT_EQ(
      contendersBesideANeighbour(result, {0, 1}, {15.9, 15.0}),
      (std::vector<size_t>{1, 6}));
  // Predicted over 25% behind the fastest plan's prediction, the only
  // simpler neighbour: within 50%, it joins all the same.
  result.candidates[6].predictedStepMs = 12.6;
  EXPECT_EQ(
      contendersBesideANeighbour(result, {0, 1}, {15.9, 15.0}),
      (std::vector<size_t>{1, 6}));
  EXPECT_EQ(
      contendersBesideANeighbour(result, measured, figures),
      (std::vector<size_t>{0, 2, 6}));
  // Over 50% behind: the next by prediction instead.
  result.candidates[6].predictedStepMs = 15.1;
  EXPECT_EQ(
      contendersBesideANeighbour(result, {0, 1}, {15.9, 15.0}),
      (std::vector<size_t>{1, 2}));
  EXPECT_EQ(
      contendersBesideANeighbour(result, measured, figures),
      (std::vector<size_t>{0, 2, 3}));
}

// Of the simpler neighbours predicted 25-50% behind the fastest only the
// simplest joins, first, and only where it is simpler than every neighbour
// within 25%.
TEST(TuneTest, OnlyTheSimplestFarNeighbourJoins) {
  using K = ScheduleKind;
  TuneResult result;
  // The fastest measured, one stage making way and ZB-H2 staying; two
  // neighbours far behind by prediction (ZB-H1 at 2 the simpler), and 1F1B,
  // the next by prediction.
  result.candidates = {
      scheduledPlan(2, 4, K::kDualPipe, 10.0),
      scheduledPlan(1, 1, K::kGpipe, 10.5),
      scheduledPlan(2, 4, K::kZeroBubbleH2, 10.6),
      scheduledPlan(2, 4, K::kZeroBubbleH1, 13.0),
      scheduledPlan(2, 2, K::kZeroBubbleH1, 13.5),
      scheduledPlan(2, 4, K::kOneFOneB, 11.0)};
  const std::vector<size_t> measured{0, 1, 2};
  const std::vector<double> figures{15.0, 22.5, 15.3};
  EXPECT_EQ(
      contendersBesideANeighbour(result, measured, figures),
      (std::vector<size_t>{0, 2, 4}));
  // ZB-H1 at 4 now a near neighbour: the simpler far one still comes
  // first, and the near one with a second place.
  result.candidates[3].predictedStepMs = 12.4;
  EXPECT_EQ(
      contendersBesideANeighbour(result, measured, figures),
      (std::vector<size_t>{0, 2, 4}));
  EXPECT_EQ(
      contendersBesideANeighbour(
          result, {0, 1, 2, 5}, {15.0, 22.5, 15.3, 18.0}),
      (std::vector<size_t>{0, 2, 4, 3}));
  // A far neighbour no simpler than a near one stays out: ZB-H1 at 2 near,
  // ZB-H1 at 4 far, and the second place stays free (nothing else waits
  // within 25% of the fastest).
  result.candidates[3].predictedStepMs = 13.5;
  result.candidates[4].predictedStepMs = 12.4;
  EXPECT_EQ(
      contendersBesideANeighbour(
          result, {0, 1, 2, 5}, {15.0, 22.5, 15.3, 18.0}),
      (std::vector<size_t>{0, 2, 4}));
}

// A simpler neighbour of the fastest, measured 14% behind it, stays (its
// figure is no surer than a prediction in that band); 26% behind, it makes
// way. Plans that are no neighbour make way past 10%.
TEST(TuneTest, AMeasuredSimplerNeighbourStaysWithin25Percent) {
  using K = ScheduleKind;
  TuneResult result;
  // Measured: the fastest, its simpler neighbour ZB-H1 at 2, and a
  // three-stage plan that is no neighbour; then ZB-H1 at 4, a neighbour
  // that joins, and three-stage ZB-H2, the next by prediction.
  result.candidates = {
      scheduledPlan(2, 4, K::kDualPipe, 10.0),
      scheduledPlan(2, 2, K::kZeroBubbleH1, 11.0),
      scheduledPlan(3, 4, K::kZeroBubbleH1, 10.5),
      scheduledPlan(2, 4, K::kZeroBubbleH1, 10.8),
      scheduledPlan(3, 4, K::kZeroBubbleH2, 10.9)};
  const std::vector<size_t> measured{0, 1, 2};
  EXPECT_EQ(
      contendersBesideANeighbour(result, measured, {14.0, 16.0, 16.0}),
      (std::vector<size_t>{0, 1, 3}));
  EXPECT_EQ(
      contendersBesideANeighbour(result, measured, {14.0, 17.6, 16.0}),
      (std::vector<size_t>{0, 3, 4}));
}

// On a machine that slows by a tenth for seconds at a time, with bursts on
// single steps (too few for a neighbour): the plan measured fastest by
// quartiles is held against the others round by round.
TEST(TuneTest, MeasuredPlansAreComparedRoundByRound) {
  TuneResult result;
  result.candidates = {
      predictedPlan(1, 2, 10.0),  // measured fastest
      predictedPlan(1, 1, 11.0),  // the simplest: 2% slower in every round
      predictedPlan(2, 4, 12.0)}; // 8% slower in every round
  result.choice = 0;
  std::vector<double> machine;
  for (int r = 0; r < 15; ++r)
    machine.push_back(r % 3 == 0 ? 1.0 : 1.12); // 5 fast rounds of 15
  std::vector<std::vector<double>> steps(3);
  for (int r = 0; r < 15; ++r) {
    steps[0].push_back(10.0 * machine[r]);
    // Bursts hit three of the simplest plan's five fast rounds: its lower
    // quartile is a slow round's, 14% above the fastest's.
    const bool burst = r == 0 || r == 3 || r == 6;
    steps[1].push_back(10.2 * machine[r] * (burst ? 1.5 : 1.0));
    steps[2].push_back(10.8 * machine[r]);
  }
  chooseByMeasurement(result, {0, 1, 2}, steps);
  EXPECT_EQ(result.choice, 1u) << result.notes.back();
  EXPECT_NEAR(result.candidates[0].measuredStepMs, 10.0, 1e-9);
  EXPECT_NEAR(result.candidates[1].measuredStepMs, 10.2 * 1.12, 1e-9);
  EXPECT_NE(
      result.notes.back().find("round by round 2.0% faster"), std::string::npos)
      << result.notes.back();

  // Without the simplest plan, the 8% slower one is not within the noise.
  TuneResult two = result;
  two.choice = 0;
  chooseByMeasurement(two, {0, 2}, {steps[0], steps[2]});
  EXPECT_EQ(two.choice, 0u) << two.notes.back();
  EXPECT_NE(two.notes.back().find("the fastest"), std::string::npos);

  EXPECT_THROW(
      chooseByMeasurement(two, {0, 2}, {steps[0], {1.0}}),
      std::invalid_argument);
}

// A plan on more devices is chosen over one on fewer only when it measures
// at least 10% faster; among plans on as many devices, 5% decides.
TEST(TuneTest, MoreDevicesMustMeasureTenPercentFaster) {
  auto chooseBetween = [](int ranks, double faster) {
    TuneResult result;
    result.candidates = {
        predictedPlan(ranks, 4, 10.0), predictedPlan(1, 1, 10.0)};
    result.choice = 0;
    std::vector<std::vector<double>> steps(2);
    for (int r = 0; r < 15; ++r) {
      const double machine = 1.0 + 0.02 * (r % 3);
      steps[0].push_back(10.0 * machine);
      steps[1].push_back(10.0 * faster * machine);
    }
    chooseByMeasurement(result, {0, 1}, steps);
    return result.candidates[result.choice].microBatches;
  };
  EXPECT_EQ(chooseBetween(2, 1.07), 1); // two stages 7% faster: one stage
  EXPECT_EQ(chooseBetween(2, 1.12), 4); // 12% faster: two stages
  EXPECT_EQ(chooseBetween(1, 1.07), 4); // on one device, 7% decides
}

// A plan measured no slower than one within the noise is within it too: one
// stage on two threads runs in two modes, so its lower quartile can be the
// fast one while its round-by-round ratio is the slow one's.
TEST(TuneTest, APlanNoSlowerThanOneWithinTheNoiseIsWithinIt) {
  TuneResult result;
  result.candidates = {
      predictedPlan(2, 4, 10.0),  // dualpipe: the fastest
      predictedPlan(1, 2, 10.0),  // steady, 8% behind round by round
      predictedPlan(1, 1, 10.0)}; // two modes: 10.6 ms and 12 ms
  result.choice = 0;
  std::vector<std::vector<double>> steps(3);
  for (int r = 0; r < 15; ++r) {
    const double machine = 1.0 + 0.01 * (r % 3);
    steps[0].push_back(10.0 * machine);
    steps[1].push_back(10.8 * machine);
    steps[2].push_back((r % 3 == 0 ? 10.6 : 12.0) * machine);
  }
  // Round by round the two-mode plan is 20% behind, past the 10% a plan on
  // fewer devices is allowed; its figure is under the steady plan's.
  TuneResult both = result;
  chooseByMeasurement(both, {0, 1, 2}, steps);
  EXPECT_EQ(both.candidates[both.choice].microBatches, 1) << both.notes.back();
  EXPECT_NE(both.notes.back().find("no slower than 1 stage"), std::string::npos)
      << both.notes.back();
  // Alone beside the fastest, it is not within the noise.
  TuneResult alone = result;
  chooseByMeasurement(alone, {0, 2}, {steps[0], steps[2]});
  EXPECT_EQ(alone.candidates[alone.choice].ranks, 2) << alone.notes.back();
}

// Beside a neighbour, plans are held against each other as training meets
// them: one stage on two threads, the fastest calm, which the neighbour's
// bursts slow 1.8x, loses to two one-thread stages that they slow 1.25x.
TEST(TuneTest, BesideANeighbourPlansAreHeldAsTrainingMeetsThem) {
  auto choose = [](double oneStageBurst, bool bursts, int oneStageThreads) {
    TuneResult result;
    result.candidates = {
        predictedPlan(1, 1, 10.0),
        predictedPlan(2, 4, 10.0),
        predictedPlan(2, 8, 10.0)};
    result.candidates[0].threadsPerStage = oneStageThreads;
    result.choice = 0;
    std::vector<std::vector<double>> steps(3);
    for (int r = 0; r < 15; ++r) {
      const bool burst = bursts && r % 2 == 0 && r < 12; // 6 rounds of 15
      steps[0].push_back(10.0 * (burst ? oneStageBurst : 1.0));
      steps[1].push_back(10.6 * (burst ? 1.25 : 1.0));
      steps[2].push_back(11.0 * (burst ? 1.3 : 1.0));
    }
    chooseByMeasurement(result, {0, 1, 2}, steps);
    return result;
  };
  // As trained: one stage 13.2 ms, two stages 11.66, 13% apart, past the
  // noise of their means (8.5%). Calm, one stage measured 6% faster.
  const TuneResult busy = choose(1.8, true, 1);
  EXPECT_EQ(busy.candidates[busy.choice].ranks, 2) << busy.notes.back();
  EXPECT_EQ(busy.candidates[busy.choice].microBatches, 4);
  EXPECT_NE(
      busy.notes.back().find("as training meets a neighbour's bursts"),
      std::string::npos)
      << busy.notes.back();
  EXPECT_NE(busy.notes.back().find("(measured 13.20 ms)"), std::string::npos)
      << busy.notes.back();
  // Slowed 1.5x, one stage trains 12.0 ms, 3% behind: the simpler plan.
  const TuneResult close = choose(1.5, true, 1);
  EXPECT_EQ(close.candidates[close.choice].ranks, 1) << close.notes.back();
  EXPECT_NE(close.notes.back().find("within"), std::string::npos);
  // On two threads, one stage holds as many cores as two one-thread stages
  // and saves nothing: 3% behind, it is not let off its lead.
  const TuneResult asManyCores = choose(1.5, true, 2);
  EXPECT_EQ(asManyCores.candidates[asManyCores.choice].ranks, 2)
      << asManyCores.notes.back();
  EXPECT_TRUE(holdsLess(predictedPlan(1, 1, 10.0), predictedPlan(2, 1, 10.0)));
  TuneCandidate twoThreads = predictedPlan(1, 1, 10.0);
  twoThreads.threadsPerStage = 2;
  EXPECT_FALSE(holdsLess(twoThreads, predictedPlan(2, 1, 10.0)));
  EXPECT_FALSE(holdsLess(predictedPlan(2, 1, 10.0), predictedPlan(2, 4, 10.0)));
  // On as many devices as the fastest, a simpler plan 3% behind is not let
  // off its lead: two stages at 4 micro-batches 3% behind those at 8.
  TuneResult twoDevices;
  twoDevices.candidates = {
      predictedPlan(2, 4, 10.0), predictedPlan(2, 8, 10.0)};
  twoDevices.choice = 0;
  std::vector<std::vector<double>> twoSteps(2);
  for (int r = 0; r < 15; ++r) {
    const bool burst = r % 2 == 0 && r < 12;
    twoSteps[0].push_back(11.3 * (burst ? 1.25 : 1.0));
    twoSteps[1].push_back(11.0 * (burst ? 1.25 : 1.0));
  }
  TuneResult calmTwo = twoDevices;
  chooseByMeasurement(twoDevices, {0, 1}, twoSteps);
  EXPECT_EQ(twoDevices.candidates[twoDevices.choice].microBatches, 8)
      << twoDevices.notes.back();
  // Calm, 5% decides among plans on as many devices: the simpler.
  for (auto& steps : twoSteps)
    for (double& step : steps)
      step = step > 12.0 ? step / 1.25 : step;
  chooseByMeasurement(calmTwo, {0, 1}, twoSteps);
  EXPECT_EQ(calmTwo.candidates[calmTwo.choice].microBatches, 4)
      << calmTwo.notes.back();
  // Without bursts the calm comparison stands: one stage, the fastest.
  const TuneResult quiet = choose(1.8, false, 1);
  EXPECT_EQ(quiet.candidates[quiet.choice].ranks, 1) << quiet.notes.back();
  EXPECT_NE(quiet.notes.back().find("lower quartile"), std::string::npos);
}

// Beside a neighbour, a choice the figures of many plans cannot settle is
// measured alone with its closest rivals: the fastest other plans, however
// far behind they read.
TEST(TuneTest, BesideANeighbourTheChoiceMeetsItsRivalsAlone) {
  TuneResult result;
  result.candidates = {
      predictedPlan(1, 1, 10.0),
      predictedPlan(2, 2, 10.0),
      predictedPlan(2, 4, 10.0),
      predictedPlan(2, 8, 10.0)};
  result.choice = 0;
  using Rivals = std::vector<size_t>;
  // The simpler chosen within the noise: the fastest and the next.
  EXPECT_EQ(
      rivalsOfTheChoice(result, {0, 1, 2, 3}, {10.3, 10.0, 10.8, 10.4}),
      (Rivals{1, 3}));
  // The fastest chosen: the next two, the nearer first.
  EXPECT_EQ(
      rivalsOfTheChoice(result, {0, 1, 2, 3}, {10.0, 10.9, 10.5, 10.6}),
      (Rivals{2, 3}));
  // However far behind: a lead past 10% may be luck.
  EXPECT_EQ(
      rivalsOfTheChoice(result, {0, 1, 2, 3}, {10.0, 11.5, 12.0, 13.0}),
      (Rivals{1, 2}));
  // Two plans measured: the other alone.
  EXPECT_EQ(rivalsOfTheChoice(result, {0, 2}, {10.0, 10.1}), (Rivals{2}));
  // The choice not measured, or measured alone: no rival.
  EXPECT_TRUE(rivalsOfTheChoice(result, {1, 2}, {10.0, 10.1}).empty());
  EXPECT_TRUE(rivalsOfTheChoice(result, {0}, {10.0}).empty());
  EXPECT_THROW(
      rivalsOfTheChoice(result, {0, 1}, {10.0}), std::invalid_argument);
  // The simplest plan within 10% of the fastest joins them, however far
  // down it read, where it holds no more of the machine than the fastest.
  TuneResult wider;
  wider.candidates = {
      predictedPlan(1, 1, 10.0),
      predictedPlan(2, 2, 10.0),
      predictedPlan(2, 4, 10.0),
      predictedPlan(2, 8, 10.0),
      predictedPlan(3, 4, 10.0)};
  wider.candidates[0].threadsPerStage = 2;
  wider.choice = 4;
  const std::vector<size_t> all{0, 1, 2, 3, 4};
  // One stage on two threads holds less than three stages.
  EXPECT_EQ(
      rivalsOfTheChoice(wider, all, {10.5, 10.6, 10.3, 10.2, 10.0}),
      (Rivals{3, 2, 0}));
  // It holds both cores, as two one-thread stages do: not simpler here.
  wider.choice = 2;
  EXPECT_EQ(
      rivalsOfTheChoice(wider, all, {10.5, 10.6, 10.0, 10.2, 10.1}),
      (Rivals{4, 3, 1}));
  // Past 10% it stays out; already a rival, it is not named twice.
  EXPECT_EQ(
      rivalsOfTheChoice(wider, all, {10.5, 11.2, 10.0, 10.2, 10.1}),
      (Rivals{4, 3}));
  EXPECT_EQ(
      rivalsOfTheChoice(wider, all, {10.5, 10.1, 10.0, 10.2, 10.3}),
      (Rivals{1, 3}));
  // One stage on two threads chosen, the simplest near the fastest, but
  // two-stage plans among its rivals, against which it is let off nothing:
  // the simplest of the others near their fastest joins, the plan a final
  // it loses names.
  wider.choice = 0;
  EXPECT_EQ(
      rivalsOfTheChoice(wider, all, {10.3, 10.4, 10.2, 10.8, 10.0}),
      (Rivals{4, 2, 1}));
  // Its rivals all three-stage plans, it is let off against them: none joins.
  wider.candidates.push_back(predictedPlan(3, 8, 10.0));
  const std::vector<size_t> withThreeStages{0, 1, 4, 5};
  EXPECT_EQ(
      rivalsOfTheChoice(wider, withThreeStages, {10.3, 10.4, 10.0, 10.1}),
      (Rivals{4, 5}));

  // Turns alternately calm and in a burst that wants a whole core: one
  // stage `oneStageBurst` ms a step in it (10 calm), two stages 13 (10.5).
  auto duel = [&](size_t choice, double oneStageBurst, bool neighbour) {
    TuneResult r = result;
    r.choice = choice;
    std::vector<std::vector<double>> steps(2), loads(2);
    const size_t plans[2] = {choice, choice == 0 ? size_t{1} : size_t{0}};
    for (int round = 0; round < 20; ++round) {
      const bool burst = neighbour && round % 2 == 1;
      for (size_t k = 0; k < 2; ++k) {
        const bool oneStage = plans[k] == 0;
        steps[k].push_back(
            burst ? (oneStage ? oneStageBurst : 13.0)
                  : (oneStage ? 10.0 : 10.5));
        loads[k].push_back(burst ? 1.0 : 0.0);
      }
    }
    settleByAFinal(r, {plans[1]}, steps, loads);
    return r;
  };
  // Slowed 2x in bursts, one stage trains at 14.5 ms against 11.9: the
  // two stages, though one stage was chosen.
  TuneResult settled = duel(0, 20.0, true);
  EXPECT_EQ(settled.choice, 1u) << settled.notes.back();
  EXPECT_NE(settled.notes.back().find("chosen instead"), std::string::npos);
  EXPECT_NEAR(settled.candidates[0].measuredStepMs, 14.46, 0.01);
  EXPECT_NEAR(settled.candidates[1].measuredStepMs, 11.91, 0.01);
  // Slowed 1.2x, one stage runs no slower: the simpler, though two stages
  // were chosen.
  settled = duel(1, 12.0, true);
  EXPECT_EQ(settled.choice, 0u) << settled.notes.back();
  EXPECT_NE(settled.notes.back().find("runs no slower"), std::string::npos)
      << settled.notes.back();
  // The choice `choiceCalm` ms a step calm, its rival 10, both 1.3x in
  // every other round's burst, and each pair of rounds `spread` off.
  auto jitteredDuel = [&](size_t choice,
                          size_t rival,
                          double choiceCalm,
                          double spread) {
    TuneResult r = result;
    r.choice = choice;
    const auto [steps, loads] = roundsInBursts({choiceCalm, 10.0}, spread, 20);
    settleByAFinal(r, {rival}, steps, loads);
    return r;
  };
  // One stage, on fewer devices and cores, 2% behind as training meets the
  // neighbour: the simpler, however closely the duel knows the two figures;
  // 6% behind, past kFinalMargin, the faster, however widely they spread.
  auto noisyDuel = [&](double oneStageCalm, double spread) {
    return jitteredDuel(0, 1, oneStageCalm, spread);
  };
  settled = noisyDuel(10.2, 0.01);
  EXPECT_EQ(settled.choice, 0u) << settled.notes.back();
  EXPECT_NE(
      settled.notes.back().find("the simplest within 5.0% of the fastest"),
      std::string::npos)
      << settled.notes.back();
  settled = noisyDuel(10.2, 0.08);
  EXPECT_EQ(settled.choice, 0u) << settled.notes.back();
  settled = noisyDuel(10.6, 0.2);
  EXPECT_EQ(settled.choice, 1u) << settled.notes.back();
  EXPECT_NE(settled.notes.back().find("past 5.0%"), std::string::npos)
      << settled.notes.back();
  // Two plans on as many devices: the simpler (2 micro-batches) within
  // kFinalMargin, as a plan on fewer devices is; past it, the faster.
  auto sameDevicesDuel = [&](double simplerCalm, double spread) {
    return jitteredDuel(1, 2, simplerCalm, spread);
  };
  settled = sameDevicesDuel(10.2, 0.01);
  EXPECT_EQ(settled.choice, 1u) << settled.notes.back();
  EXPECT_NE(settled.notes.back().find("the simplest within"), std::string::npos)
      << settled.notes.back();
  settled = sameDevicesDuel(10.0, 0.08);
  EXPECT_EQ(settled.choice, 1u) << settled.notes.back();
  settled = sameDevicesDuel(10.6, 0.01);
  EXPECT_EQ(settled.choice, 2u) << settled.notes.back();
  EXPECT_NE(settled.notes.back().find("past 5.0%"), std::string::npos)
      << settled.notes.back();
  // A neighbour wanting half a core in every turn, steadily: the plans are
  // held by their mean steps. One stage, chosen, 10% behind, is past any
  // margin the simpler plan is allowed.
  auto steadyDuel = [&](double oneStage) {
    TuneResult r = result;
    r.choice = 0;
    std::vector<std::vector<double>> steps(2), loads(2);
    for (int round = 0; round < 20; ++round) {
      const double jitter = round % 2 ? 1.01 : 0.99;
      steps[0].push_back(jitter * oneStage);
      steps[1].push_back(jitter * 10.0);
      loads[0].push_back(0.5);
      loads[1].push_back(0.5);
    }
    settleByAFinal(r, {1}, steps, loads);
    return r;
  };
  settled = steadyDuel(11.0);
  EXPECT_EQ(settled.choice, 1u) << settled.notes.back();
  EXPECT_NE(
      settled.notes.back().find("as training meets a neighbour's bursts"),
      std::string::npos)
      << settled.notes.back();
  EXPECT_NEAR(settled.candidates[0].measuredStepMs, 11.0, 1e-9);
  settled = steadyDuel(10.02); // within the figures' 0.3%
  EXPECT_EQ(settled.choice, 0u) << settled.notes.back();
  // Gone, the neighbour leaves nothing to settle: the choice stands.
  settled = duel(1, 12.0, false);
  EXPECT_EQ(settled.choice, 1u);
  EXPECT_NE(settled.notes.back().find("no longer showed"), std::string::npos);
  EXPECT_THROW(
      settleByAFinal(settled, {1}, {{10.0}, {10.0}}, {{0.0}, {0.0}}),
      std::invalid_argument);

  // Three finalists, each `calm[k]` ms a step calm and 1.3x in every other
  // round's burst, each pair of rounds `spread` off.
  auto final = [&](size_t choice,
                   const Rivals& rivals,
                   const std::vector<double>& calm,
                   double spread) {
    TuneResult r = result;
    r.choice = choice;
    const auto [steps, loads] = roundsInBursts(calm, spread, 20);
    settleByAFinal(r, rivals, steps, loads);
    return r;
  };
  // One stage chosen, 6% behind the third finalist: that one, not the
  // runner-up the choice would have met alone.
  settled = final(0, {2, 1}, {10.6, 10.2, 10.0}, 0.001);
  EXPECT_EQ(settled.choice, 1u) << settled.notes.back();
  EXPECT_NE(
      settled.notes.back().find("alone in turn with 2 stages"),
      std::string::npos)
      << settled.notes.back();
  EXPECT_NE(settled.notes.back().find(" and 2 stages"), std::string::npos)
      << settled.notes.back();
  EXPECT_NE(settled.notes.back().find("chosen instead"), std::string::npos);
  EXPECT_NEAR(
      settled.candidates[0].measuredStepMs /
          settled.candidates[1].measuredStepMs,
      1.06,
      0.002);
  EXPECT_NEAR(
      settled.candidates[2].measuredStepMs /
          settled.candidates[1].measuredStepMs,
      1.02,
      0.002);
  // Within kFinalMargin, one stage stands.
  settled = final(0, {2, 1}, {10.02, 10.2, 10.0}, 0.08);
  EXPECT_EQ(settled.choice, 0u) << settled.notes.back();
  EXPECT_NE(settled.notes.back().find("the simplest within"), std::string::npos)
      << settled.notes.back();
  // One stage on two threads within the figures' error holds as many cores
  // as the fastest: the fastest.
  TuneResult twoThreaded = result;
  twoThreaded.candidates[0].threadsPerStage = 2;
  std::swap(result, twoThreaded);
  settled = final(0, {2, 1}, {10.02, 10.2, 10.0}, 0.08);
  std::swap(result, twoThreaded);
  EXPECT_EQ(settled.choice, 1u) << settled.notes.back();
  EXPECT_NE(settled.notes.back().find("on as many cores"), std::string::npos)
      << settled.notes.back();
  // On as many devices, the simplest of the two-device plans within
  // kFinalMargin: 2 micro-batches, 1% behind 4.
  settled = final(3, {1, 2}, {10.4, 10.2, 10.1}, 0.08);
  EXPECT_EQ(settled.choice, 1u) << settled.notes.back();
  EXPECT_NE(settled.notes.back().find("(1.0% behind it)"), std::string::npos)
      << settled.notes.back();
  // Rivals that repeat, or a list of steps missing.
  EXPECT_THROW(
      final(0, {1, 1}, {10.0, 10.0, 10.0}, 0.0), std::invalid_argument);
  EXPECT_THROW(
      final(0, {0, 1}, {10.0, 10.0, 10.0}, 0.0), std::invalid_argument);
  EXPECT_THROW(final(0, {1, 2}, {10.0, 10.0}, 0.0), std::invalid_argument);
}

// A final goes on until its figures settle what it decides: which plan is
// fastest, and whether a simpler plan that holds no more lags it by more
// than 5%.
TEST(TuneTest, AFinalGoesOnUntilItsDecisionIsSettled) {
  const std::vector<TuneCandidate> finalists{
      predictedPlan(2, 4, 10.0),  // the fastest
      predictedPlan(2, 2, 10.0),  // simpler, on as many devices
      predictedPlan(3, 4, 10.0)}; // on more devices
  auto figures = [](std::vector<double> ms, std::vector<double> errors) {
    StepsAtALoad f;
    f.stepMs = std::move(ms);
    f.relativeError = std::move(errors);
    return f;
  };
  const std::vector<double> looselyKnown{0.013, 0.015, 0.010};
  // 7.4% behind, known within 2.0%: past the margin, not clearly.
  EXPECT_FALSE(
      aFinalIsSettled(finalists, figures({10.0, 10.74, 11.5}, looselyKnown)));
  // Known within 1.5%, or far past the margin: settled.
  EXPECT_TRUE(aFinalIsSettled(
      finalists, figures({10.0, 10.74, 11.5}, {0.005, 0.005, 0.005})));
  EXPECT_TRUE(
      aFinalIsSettled(finalists, figures({10.0, 11.2, 11.5}, looselyKnown)));
  // A plan on more devices is let off nothing: only its order counts.
  EXPECT_TRUE(
      aFinalIsSettled(finalists, figures({10.0, 11.2, 10.74}, looselyKnown)));
  // Too close to tell which is fastest.
  EXPECT_FALSE(
      aFinalIsSettled(finalists, figures({10.0, 10.1, 11.5}, looselyKnown)));
  EXPECT_FALSE(
      aFinalIsSettled(finalists, figures({10.0, 11.2, 10.2}, looselyKnown)));
  // No neighbour showed: nothing to settle.
  EXPECT_TRUE(aFinalIsSettled(finalists, StepsAtALoad{}));
  EXPECT_THROW(
      aFinalIsSettled(finalists, figures({10.0, 10.1}, {0.01, 0.01})),
      std::invalid_argument);
}

// One stage on intra-op threads that span every core the plans share holds
// the whole machine: OpenMP's pool spins between operations. Against three
// one-thread stages on two cores it saves nothing, and 4% behind them it is
// not let off; on four cores, two threads leave two free.
TEST(TuneTest, OneStageOnEveryCoreHoldsTheWholeMachine) {
  TuneCandidate oneStage = predictedPlan(1, 1, 10.0);
  oneStage.threadsPerStage = 2;
  const TuneCandidate threeStages = predictedPlan(3, 4, 10.0);
  EXPECT_TRUE(holdsLess(oneStage, threeStages));
  EXPECT_FALSE(holdsLess(oneStage, threeStages, 2));
  EXPECT_TRUE(holdsLess(oneStage, threeStages, 4));
  // One-thread stages hold what they did.
  EXPECT_TRUE(holdsLess(predictedPlan(2, 2, 10.0), threeStages, 2));
  EXPECT_TRUE(holdsLess(predictedPlan(1, 1, 10.0), threeStages, 2));

  TuneResult result;
  result.candidates = {oneStage, threeStages, predictedPlan(3, 8, 10.0)};
  auto final = [&](int cores) {
    TuneResult r = result;
    r.cores = cores;
    r.choice = 0;
    const auto [steps, loads] = roundsInBursts({10.4, 10.0, 10.6}, 0.001, 20);
    settleByAFinal(r, {1, 2}, steps, loads);
    return r;
  };
  TuneResult settled = final(2);
  EXPECT_EQ(settled.choice, 1u) << settled.notes.back();
  EXPECT_NE(settled.notes.back().find("on as many cores"), std::string::npos)
      << settled.notes.back();
  settled = final(4);
  EXPECT_EQ(settled.choice, 0u) << settled.notes.back();
  // Where the final's lag is that close to the margin, it is not settled
  // for a plan that is let off; it is for one that is not.
  const StepsAtALoad figures{{10.45, 10.0, 10.6}, {0.012, 0.012, 0.012}, true};
  EXPECT_TRUE(aFinalIsSettled(result.candidates, figures, 2));
  EXPECT_FALSE(aFinalIsSettled(result.candidates, figures, 4));
}

// Beside a neighbour a pipeline that keeps the backward whole reads faster in
// turn, against one that splits it, than it trains: within the final's
// margin of a plan that splits it, it is let off nothing for being simpler.
TEST(TuneTest, AWholeBackwardIsNotLetOffAgainstASplitOne) {
  using K = ScheduleKind;
  TuneResult result;
  result.candidates = {
      scheduledPlan(2, 2, K::kZeroBubbleV, 10.0),   // the fastest
      scheduledPlan(2, 2, K::kOneFOneB, 10.0),      // the simplest, whole
      scheduledPlan(2, 2, K::kZeroBubbleH1, 10.0)}; // simpler than the V
  ASSERT_TRUE(isSimplerPlan(result.candidates[1], result.candidates[2]));
  ASSERT_TRUE(isSimplerPlan(result.candidates[2], result.candidates[0]));
  const auto rounds = roundsInBursts({10.0, 10.2, 10.2}, 0.01, 16);
  TuneResult settled = result;
  settled.choice = 0;
  settleByAFinal(settled, {1, 2}, rounds.first, rounds.second, {});
  EXPECT_EQ(settled.choice, 2u) << settled.notes.back();
  EXPECT_NE(
      settled.notes.back().find("let off nothing: it keeps the backward whole"),
      std::string::npos)
      << settled.notes.back();
  // The final names the simplest plan near the fastest that may be let off:
  // ZB-H1 joins the two closest rivals, though 1F1B is among them.
  result.choice = 0;
  using Rivals = std::vector<size_t>;
  result.candidates.push_back(scheduledPlan(2, 4, K::kZeroBubbleH2, 10.0));
  EXPECT_EQ(
      rivalsOfTheChoice(result, {0, 1, 3, 2}, {10.0, 10.1, 10.2, 10.9}),
      (Rivals{1, 3, 2}));
  // Against a fastest that keeps it whole too, the simplest is chosen.
  const auto even = roundsInBursts({10.2, 10.0, 10.2}, 0.01, 16);
  result.candidates[0] = scheduledPlan(2, 4, K::kOneFOneB, 10.0);
  settled = result;
  settled.choice = 1;
  settleByAFinal(settled, {0, 2}, even.first, even.second, {});
  EXPECT_EQ(settled.choice, 1u) << settled.notes.back();
}

// A final's figures pooled with the rounds in turn before it: the machine's
// drift between the two windows cancels, and a plan one window read ahead
// by chance is held to both.
TEST(TuneTest, AFinalIsPooledWithTheRoundsInTurnBeforeIt) {
  TuneResult result;
  result.candidates = {
      predictedPlan(2, 4, 10.0),
      predictedPlan(2, 2, 10.0), // the simplest
      predictedPlan(2, 8, 10.0)};
  // The final alone reads 2 micro-batches 6% behind 4, past kFinalMargin.
  const auto rounds = roundsInBursts({10.0, 10.6, 11.5}, 0.02, 16);
  auto settle = [&](const StepsAtALoad& inTurn) {
    TuneResult r = result;
    r.choice = 0;
    settleByAFinal(r, {1, 2}, rounds.first, rounds.second, inTurn);
    return r;
  };
  const TuneResult alone = settle({});
  ASSERT_EQ(alone.choice, 0u) << alone.notes.back();
  EXPECT_EQ(alone.notes.back().find("pooled"), std::string::npos);
  // The rounds in turn just before, the whole machine 9% slower then, read
  // it 1% behind, each figure known as closely as the final's: pooled,
  // about 3.5% behind, and the simplest within the margin.
  const StepsAtALoad finalAlone =
      stepsBesideANeighbour(rounds.first, rounds.second);
  ASSERT_EQ(finalAlone.stepMs.size(), 3u);
  StepsAtALoad inTurn;
  const double before = 1.09 * finalAlone.stepMs[0];
  inTurn.stepMs = {before, 1.01 * before, 1.15 * before};
  inTurn.relativeError = finalAlone.relativeError;
  const TuneResult pooled = settle(inTurn);
  EXPECT_EQ(pooled.choice, 1u) << pooled.notes.back();
  EXPECT_NE(
      pooled.notes.back().find("pooled with their rounds in turn"),
      std::string::npos)
      << pooled.notes.back();
  EXPECT_NE(pooled.notes.back().find("% slower)"), std::string::npos)
      << pooled.notes.back();
  const double behind =
      pooled.candidates[1].measuredStepMs / pooled.candidates[0].measuredStepMs;
  EXPECT_NEAR(
      behind,
      std::sqrt(1.01 * finalAlone.stepMs[1] / finalAlone.stepMs[0]),
      0.002);
  EXPECT_LT(behind, 1.04);
  // The pooled figures stand between the two windows' levels.
  EXPECT_GT(pooled.candidates[0].measuredStepMs, finalAlone.stepMs[0]);
  EXPECT_LT(pooled.candidates[0].measuredStepMs, before);
  // Rounds in turn known far less closely weigh next to nothing.
  for (double& e : inTurn.relativeError)
    e *= 30.0;
  EXPECT_EQ(settle(inTurn).choice, 0u);
  // Figures that do not cover every finalist are left out.
  inTurn.stepMs.pop_back();
  const TuneResult partial = settle(inTurn);
  EXPECT_EQ(partial.choice, 0u);
  EXPECT_EQ(partial.notes.back().find("pooled"), std::string::npos);
}

// A neighbour's bursts met one plan's turns less often than the other's by
// chance; the load measured each turn puts both at the load training meets.
TEST(TuneTest, TheNeighboursLoadEvensOutTheTurnsItMet) {
  // A turn with the neighbour on for a share of its time runs at the calm
  // rate and the burst's, mixed in that share: one stage 70 ms a step calm
  // and 280 in a burst, two stages 75 and 150.
  auto stepAt = [](double calm, double burst, double load) {
    return 1.0 / ((1.0 - load) / calm + load / burst);
  };
  std::vector<std::vector<double>> steps(2), loads(2);
  for (int r = 0; r < 15; ++r) {
    const double jitter = r % 2 ? 1.0 : -1.0;
    const double oneStageLoad = r % 3 == 0 ? 0.6 : 0.0; // 5 turns of 15
    const double twoStageLoad = r % 5 == 0 ? 0.0 : 0.6; // 12 turns of 15
    loads[0].push_back(oneStageLoad);
    loads[1].push_back(twoStageLoad);
    steps[0].push_back(stepAt(70.0, 280.0, oneStageLoad) + jitter);
    steps[1].push_back(stepAt(75.0, 150.0, twoStageLoad) + jitter);
  }
  ASSERT_TRUE(aNeighbourShows(steps));
  const StepsAtALoad atLoad = stepsAtTheLoadTrainingMeets(steps, loads);
  ASSERT_EQ(atLoad.stepMs.size(), 2u);
  // Over the time the turns took, 0.41 cores: the bursty turns ran longer
  // (a mean over turns says 0.34).
  double loadTime = 0.0, span = 0.0;
  for (size_t k = 0; k < 2; ++k) {
    for (int r = 0; r < 15; ++r) {
      loadTime += loads[k][r] * steps[k][r];
      span += steps[k][r];
    }
  }
  const double trainingLoad = loadTime / span;
  EXPECT_NEAR(trainingLoad, 0.41, 0.01);
  const double oneStage = stepAt(70.0, 280.0, trainingLoad);
  EXPECT_NEAR(atLoad.stepMs[0], oneStage, 1.0);
  EXPECT_NEAR(atLoad.stepMs[1], stepAt(75.0, 150.0, trainingLoad), 1.0);
  // A line through the ms a step reads one stage 8% slow.
  const double alongSteps =
      70.0 + (stepAt(70.0, 280.0, 0.6) - 70.0) / 0.6 * trainingLoad;
  EXPECT_GT(alongSteps, 1.05 * oneStage);
  EXPECT_GT(atLoad.relativeError[0], 0.0);
  EXPECT_LT(atLoad.relativeError[0], 0.01);
  EXPECT_EQ(stepsAsTrainingMeetsThem(steps, loads), atLoad.stepMs);
  // Their own turns put one stage 11% ahead (89 against 100 ms).
  const std::vector<double> byTurns = stepsAsTrainingMeetsThem(steps);
  EXPECT_LT(byTurns[0], 0.9 * byTurns[1]);

  auto choose = [&](const std::vector<std::vector<double>>& withLoads) {
    TuneResult result;
    result.candidates = {predictedPlan(1, 1, 10.0), predictedPlan(2, 4, 10.0)};
    result.choice = 0;
    chooseByMeasurement(result, {0, 1}, steps, withLoads);
    return result;
  };
  const TuneResult measured = choose(loads);
  EXPECT_EQ(measured.candidates[measured.choice].ranks, 2)
      << measured.notes.back();
  EXPECT_NE(
      measured.notes.back().find("at the load a neighbour put on training"),
      std::string::npos)
      << measured.notes.back();
  EXPECT_EQ(choose({}).candidates[choose({}).choice].ranks, 1);

  // Loads not read, or too even to say anything: no figures.
  std::vector<std::vector<double>> unread = loads;
  unread[1][4] = -1.0;
  EXPECT_TRUE(stepsAtTheLoadTrainingMeets(steps, unread).stepMs.empty());
  std::vector<std::vector<double>> even(2, std::vector<double>(15, 0.3));
  even[0][0] = 0.35;
  EXPECT_TRUE(stepsAtTheLoadTrainingMeets(steps, even).stepMs.empty());
  EXPECT_TRUE(stepsAtTheLoadTrainingMeets(steps, {loads[0]}).stepMs.empty());
}

// Rounds too long for one burst to slow them as a whole count few slowed
// rounds: the load other processes put on the turns still shows the
// neighbour, and the plans are held at it.
TEST(TuneTest, TheLoadShowsANeighbourTheRoundsMiss) {
  std::vector<std::vector<double>> steps(2), busy(2), quiet(2);
  for (int r = 0; r < 15; ++r) {
    const double load = r % 2 ? 0.9 : 0.1;
    for (size_t k = 0; k < 2; ++k) {
      busy[k].push_back(load);
      quiet[k].push_back(r % 4 == 0 ? 0.1 : 0.0);
    }
    // A tenth slower at the burst's load: no round 15% above the calm ones.
    steps[0].push_back(20.0 * (1.0 + 0.12 * load));
    steps[1].push_back(21.0 * (1.0 + 0.04 * load));
  }
  EXPECT_EQ(roundsSlowedByBursts(steps), 0);
  EXPECT_FALSE(aNeighbourShows(steps));
  EXPECT_TRUE(aNeighbourShows(steps, busy));
  EXPECT_FALSE(aNeighbourShows(steps, quiet)); // 0.03 cores
  const std::optional<LoadSummary> load = loadOver(steps, busy);
  ASSERT_TRUE(load.has_value());
  EXPECT_NEAR(load->mean, (7 * 0.9 + 8 * 0.1) / 15.0, 1e-9);
  EXPECT_GT(load->overTime, load->mean); // loaded turns ran longer
  EXPECT_EQ(load->least, 0.1);
  EXPECT_EQ(load->most, 0.9);
  EXPECT_FALSE(loadOver(steps, {busy[0]}).has_value());
  EXPECT_EQ(stepsAtTheLoadTrainingMeets(steps, busy).stepMs.size(), 2u);
  EXPECT_TRUE(stepsAtTheLoadTrainingMeets(steps, quiet).stepMs.empty());
  const StepsAtALoad fitted = stepsBesideANeighbour(steps, busy);
  EXPECT_TRUE(fitted.fittedToTheLoad);
  EXPECT_EQ(fitted.stepMs, stepsAtTheLoadTrainingMeets(steps, busy).stepMs);
  EXPECT_TRUE(stepsBesideANeighbour(steps, quiet).stepMs.empty());

  // Turns of a second average bursts out: half a core in every turn is a
  // neighbour all the same, held by each plan's mean step, with no line to
  // fit to a load that did not vary.
  const std::vector<std::vector<double>> steady(
      2, std::vector<double>(15, 0.5));
  EXPECT_TRUE(aNeighbourShows(steps, steady));
  EXPECT_TRUE(stepsAtTheLoadTrainingMeets(steps, steady).stepMs.empty());
  const StepsAtALoad held = stepsBesideANeighbour(steps, steady);
  ASSERT_EQ(held.stepMs.size(), 2u);
  EXPECT_FALSE(held.fittedToTheLoad);
  EXPECT_EQ(held.stepMs, stepsAsTrainingMeetsThem(steps));
  EXPECT_NEAR(held.relativeError[0], relativeStandardError(steps[0]), 1e-12);
  EXPECT_GT(held.relativeError[0], 0.0);
  const std::vector<std::vector<double>> steadyAndQuiet(
      2, std::vector<double>(15, 0.03));
  EXPECT_FALSE(aNeighbourShows(steps, steadyAndQuiet));
}

// Three processes spinning on a machine of two cores want three, whatever
// they get: the figure a neighbour's bursts are held against is what it
// asks, which no plan changes.
TEST(TuneTest, ASpinningNeighbourWantsACoreWhateverItGets) {
  if (::access("/proc/self/schedstat", R_OK) != 0)
    GTEST_SKIP() << "this kernel keeps no schedstat";
  std::vector<pid_t> spinners;
  for (int i = 0; i < 3; ++i) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      for (volatile unsigned long n = 0;; n = n + 1) {
      }
    }
    spinners.push_back(pid);
  }
  const CpuClock before = readCpuClock();
  std::this_thread::sleep_for(std::chrono::milliseconds(400));
  const double wanted = othersCoresBetween(before, readCpuClock());
  for (pid_t pid : spinners) {
    ::kill(pid, SIGKILL);
    ::waitpid(pid, nullptr, 0);
  }
  EXPECT_GT(wanted, 2.7);
  EXPECT_LT(wanted, 3.0 + std::thread::hardware_concurrency());
}

// A thread one reading did not list counts as a newcomer, for at most the
// interval: a long-lived thread a listing missed is not its lifetime's load.
TEST(TuneTest, NoThreadWantsMoreThanTheInterval) {
  CpuClock before, after;
  before.othersRead = after.othersRead = true;
  after.at = before.at + std::chrono::milliseconds(100);
  before.others = {{101, {1'000'000'000ULL, 0}}};
  after.others = {
      {101, {1'050'000'000ULL, 0}},  // ran 50 ms of the 100
      {102, {24'000'000'000ULL, 0}}, // listed now only: 24 s of its life
      {103, {20'000'000ULL, 10'000'000ULL}}}; // begun meanwhile: 30 ms
  EXPECT_NEAR(othersCoresBetween(before, after), 0.5 + 1.0 + 0.3, 1e-6);
}

// In a container's PID namespace a neighbour outside it lists no threads:
// the busy time of our cores that no seen thread and none of ours took is
// its. Without it, a tune beside a neighbour there read 0.00 cores.
TEST(TuneTest, AProcessOutOfSightCountsByTheBusyTimeLeft) {
  CpuClock before, after;
  before.othersRead = after.othersRead = true;
  after.at = before.at + std::chrono::milliseconds(100);
  before.others = {{101, {1'000'000'000ULL, 0}}};
  after.others = {{101, {1'050'000'000ULL, 10'000'000ULL}}}; // 60 ms wanted
  EXPECT_NEAR(othersCoresBetween(before, after), 0.6, 1e-6);
  // Two cores busy throughout: 90 ms ours, 50 ms the seen thread's, so
  // 60 ms went to processes out of sight.
  before.busySeconds = 10.0;
  before.ownSeconds = 1.0;
  after.busySeconds = 10.2;
  after.ownSeconds = 1.09;
  EXPECT_NEAR(othersCoresBetween(before, after), 0.6 + 0.6, 1e-6);
  // Ticks of the busy time are coarser than the threads' nanoseconds: a
  // reading under what the seen threads ran takes nothing away.
  after.busySeconds = 10.12;
  EXPECT_NEAR(othersCoresBetween(before, after), 0.6, 1e-6);
  // Where threads are not read, the busy time alone.
  before.othersRead = after.othersRead = false;
  after.busySeconds = 10.2;
  EXPECT_NEAR(othersCoresBetween(before, after), 1.1, 1e-6);
  before.busySeconds = -1.0;
  EXPECT_LT(othersCoresBetween(before, after), 0.0);
}

// Rounds a burst slowed for every plan are counted; a quiet machine's
// jitter, or one plan's slow round, is not a burst.
TEST(TuneTest, CountsTheRoundsABurstSlowed) {
  std::vector<std::vector<double>> quiet(3), busy(3);
  for (int r = 0; r < 15; ++r) {
    const double jitter = 1.0 + 0.01 * (r % 5);        // 0-4%
    const double burst = r >= 3 && r < 12 ? 1.6 : 1.0; // 9 of 15 rounds
    for (size_t k = 0; k < 3; ++k) {
      quiet[k].push_back((10.0 + k) * jitter);
      busy[k].push_back((10.0 + k) * jitter * burst);
    }
  }
  quiet[0][7] *= 1.5; // one plan's slow round
  EXPECT_EQ(roundsSlowedByBursts(quiet), 0);
  EXPECT_EQ(roundsSlowedByBursts(busy), 9);
  EXPECT_EQ(roundsSlowedByBursts({}), 0);
  // As training meets them: bursts in their share (9 of 15 rounds at 1.6x),
  // where the plain median is a burst's; a calm round's slow tail left out.
  const std::vector<double> met = stepsAsTrainingMeetsThem(busy);
  EXPECT_NEAR(met[0], 10.2 * (6 + 9 * 1.6) / 15, 0.15);
  EXPECT_NEAR(met[2], 12.2 * (6 + 9 * 1.6) / 15, 0.2);
  EXPECT_GT(median(busy[0]), 15.0);
  // On a quiet machine one plan's slow turn stays its own tail.
  const std::vector<double> calm = stepsAsTrainingMeetsThem(quiet);
  EXPECT_NEAR(calm[0], median(quiet[0]), 1e-9);
  EXPECT_LT(calm[0], mean(quiet[0]) - 0.2); // the 1.5x round left out
  // Beside a neighbour, a burst that slows one plan's turn and spares the
  // others' counts for that plan too: here plan 0 alone is slowed 1.6x in
  // two rounds more, which round by round look calm.
  std::vector<std::vector<double>> ownBursts = busy;
  for (int r : {0, 1})
    ownBursts[0][r] *= 1.6;
  EXPECT_EQ(roundsSlowedByBursts(ownBursts), 9);
  const std::vector<double> own = stepsAsTrainingMeetsThem(ownBursts);
  EXPECT_NEAR(own[0], 10.2 * (4 + 11 * 1.6) / 15, 0.2);
  EXPECT_NEAR(own[1], met[1], 1e-9);
  // How long busy rounds go on: until their mean is pinned. Bursts spread
  // the rounds, so their mean is known less closely than a quiet one's,
  // and four times the rounds halve the error.
  EXPECT_GT(
      relativeStandardError(busy[0]), 3.0 * relativeStandardError(quiet[1]));
  std::vector<double> longer;
  for (int i = 0; i < 4; ++i)
    longer.insert(longer.end(), busy[0].begin(), busy[0].end());
  EXPECT_NEAR(
      relativeStandardError(longer),
      0.5 * relativeStandardError(busy[0]),
      0.05 * relativeStandardError(busy[0]));
  EXPECT_EQ(relativeStandardError({12.0}), 0.0);
  // A machine slow throughout has no bursts: each round is held against
  // the plans' own lower quartiles.
  for (auto& steps : busy)
    std::fill(steps.begin(), steps.end(), 30.0);
  busy[0][0] = 60.0;
  EXPECT_EQ(roundsSlowedByBursts(busy), 0); // no calm round to hold against
}

TEST(TuneTest, SmallMicroBatchesPayTheirFixedCost) {
  CostModel model = equalLayers(4, 1.0);
  model.instructionMs = 5.0; // dispatch dominates tiny micro-batches
  const TuneResult result = tunePlans(model, twoCores());
  EXPECT_LT(choiceOf(result).microBatches, 16);
  // The prediction adds the per-instruction cost: one stage, one
  // micro-batch, both threads: 16 x 4 x 3 + F + B dispatch.
  TuneCandidate shape;
  shape.threadsPerStage = 2;
  const TuneCandidate one = predictCandidate(model, twoCores(), shape);
  EXPECT_NEAR(one.predictedStepMs, 16 * 4 * 3 + 2 * 5.0, 1e-6);
}

TEST(TuneTest, StagesBeyondTheCoresShareThemAndPredictSlower) {
  CostModel model = equalLayers(4, 1.0);
  const TuneResult result = tunePlans(model, twoCores(4));
  EXPECT_LE(choiceOf(result).ranks, 2);
  TuneCandidate two, four;
  two.ranks = 2;
  four.ranks = 4;
  two.microBatches = four.microBatches = 16;
  two.threadsPerStage = four.threadsPerStage = 1;
  two.schedule = four.schedule = ScheduleKind::kOneFOneB;
  TuneRequest ownCores = twoCores(4);
  ownCores.cores = 4;
  auto predict = [&](const TuneCandidate& c, const TuneRequest& request) {
    return predictCandidate(model, request, c).predictedStepMs;
  };
  // Four workers on two cores run at half speed while all four compute,
  // not during fill and drain: slower than with a core each, faster than
  // every pass charged twice.
  const double shared = predict(four, twoCores(4));
  const double own = predict(four, ownCores);
  EXPECT_GT(shared, 1.5 * own);
  EXPECT_LT(shared, 2.0 * own);
  // What sharing costs beyond that is charged to the oversubscribed plan
  // alone, per pass a worker is woken for.
  model.sharedWakeupMs = 0.25;
  EXPECT_GE(predict(four, twoCores(4)), shared + 2 * 16 * 0.25);
  EXPECT_DOUBLE_EQ(predict(four, ownCores), own);
  const double twoCharged = predict(two, twoCores(4));
  model.sharedWakeupMs = 0.0;
  EXPECT_DOUBLE_EQ(twoCharged, predict(two, twoCores(4)));
}

TEST(TuneTest, MemoryCapsAreHardAndTheFastestPlanThatFitsIsChosen) {
  CostModel model = equalLayers(4, 2.0);
  for (auto& layer : model.layers)
    layer.paramBytes = 1 << 20; // 4 MiB of weights in all
  TuneRequest request = twoCores();
  for (auto& device : request.devices)
    device.memoryBytes = 6 << 20; // the whole needs 9 MiB, half of it 5
  const TuneResult result = tunePlans(model, request);
  const TuneCandidate& choice = choiceOf(result);
  EXPECT_EQ(choice.ranks, 2);
  for (int64_t bytes : choice.peakBytes)
    EXPECT_LE(bytes, 6 << 20);
  bool oneStageRefused = false;
  for (const auto& c : result.candidates) {
    if (c.ranks == 1) {
      EXPECT_FALSE(c.infeasible.empty());
      oneStageRefused = true;
    }
  }
  EXPECT_TRUE(oneStageRefused);
  bool said = false;
  for (const auto& note : result.notes)
    said = said || note.find("does not fit one device") != std::string::npos;
  EXPECT_TRUE(said);
  // Nothing fits at all: an error listing the reasons.
  for (auto& device : request.devices)
    device.memoryBytes = 1 << 20;
  EXPECT_THROW(tunePlans(model, request), UserError);
}

TEST(TuneTest, JsonCarriesEveryFieldOfTheChoiceAndCandidates) {
  TuneResult result = tunePlans(equalLayers(4, 1.0), twoCores());
  result.candidates[0].measuredStepMs = 12.5;
  const nlohmann::json json = tuneResultToJson(result);
  for (const char* key :
       {"stages",
        "micro_batches",
        "schedule",
        "checkpoint",
        "virtual_stages",
        "threads_per_stage",
        "boundaries",
        "predicted_step_ms",
        "peak_bytes"})
    EXPECT_TRUE(json["choice"].contains(key)) << key;
  EXPECT_EQ(json["candidates"][0]["measured_step_ms"], 12.5);
  EXPECT_EQ(
      json["candidates"].size(), static_cast<size_t>(result.candidates.size()));
}

TEST(TuneTest, ShapeInferenceCountsWhatTheBuilderBuilds) {
  for (const char* name :
       {"mlp_synthetic.json",
        "char_transformer.json",
        "fashion_mnist_cnn.json",
        "reference_mlp.json"}) {
    const Config config =
        loadConfig(std::string(TPIPE_SOURCE_DIR) + "/configs/" + name);
    const BuiltModel built = buildModel(config.model, 0);
    const std::vector<LayerFacts> facts = modelFacts(config.model);
    int64_t parameters = 0;
    for (size_t l = 0; l < facts.size(); ++l) {
      parameters += facts[l].parameters;
      EXPECT_EQ(facts[l].output, built.shapes[l + 1]) << name << " layer " << l;
    }
    EXPECT_EQ(parameters, built.parameterCount) << name;
  }
}

TEST(TuneTest, PlansGpt3On1024DevicesWithinTheirMemory) {
  const std::string dir = std::string(TPIPE_SOURCE_DIR) + "/configs/";
  const Config config = loadConfig(dir + "gpt3_175b.json");
  int64_t parameters = 0;
  for (const auto& f : modelFacts(config.model))
    parameters += f.parameters;
  EXPECT_NEAR(static_cast<double>(parameters) / 1e9, 175.0, 1.0);
  const TuneOutcome outcome = tuneForCluster(
      config,
      nlohmann::json::parse(R"({
        "nodes": 128, "devices_per_node": 8,
        "device": {"peak_tflops": 312, "efficiency": 0.5, "memory": "80GiB"},
        "intra_node": {"bandwidth_gb_s": 300, "latency_us": 5},
        "inter_node": {"bandwidth_gb_s": 25, "latency_us": 10},
        "optimizer_bytes_per_parameter": 12})"),
      "test");
  const TuneCandidate& choice = choiceOf(outcome.result);
  EXPECT_EQ(choice.ranks * choice.dataParallel, 1024);
  for (int64_t bytes : choice.peakBytes)
    EXPECT_LE(bytes, int64_t{80} << 30);
  // The ideal: 6 x parameters x tokens FLOPs over every device's effective
  // rate; pipelining can only add to it.
  const double ideal =
      6.0 * parameters * 1536.0 * 2048.0 / (1024 * 156e12) * 1000.0;
  EXPECT_GT(choice.predictedStepMs, ideal);
  EXPECT_LT(choice.predictedStepMs, 4 * ideal);
  EXPECT_THROW(
      tuneForCluster(
          config, nlohmann::json::parse(R"({"nodes": 1})"), "bad.json"),
      ConfigError);
}

// With the device's memory bandwidth the cluster model is a roofline: a
// 4096 x 4096 linear layer in bf16 reads 32 MiB of weights per micro-batch,
// so one sample costs as much as a few hundred (time flat below the ridge),
// while a large micro-batch is compute-bound and proportional again.
TEST(TuneTest, ClusterRooflineMakesSmallMicroBatchesBandwidthBound) {
  const Config config = parseConfig(nlohmann::json::parse(R"({
    "model": {"input_shape": [4096],
              "layers": [{"type": "linear", "out_features": 4096}]},
    "data": {"dataset": "synthetic", "samples": 64},
    "pipeline": {"devices": ["cpu:0"]},
    "train": {"batch_size": 64, "steps": 1, "loss": "mse"}})"));
  auto forwardAt = [&](const char* device, double n) {
    const nlohmann::json cluster = nlohmann::json::parse(
        std::string(R"({"nodes": 1, "devices_per_node": 1, "device": )") +
        device + R"(, "intra_node": {"bandwidth_gb_s": 100}})");
    const TuneOutcome outcome = tuneForCluster(config, cluster, "test");
    return outcome.model.layers.at(0).forward.at(0).at(n);
  };
  const char* roofline =
      R"({"peak_tflops": 100, "efficiency": 1, "memory": "80GiB", "memory_gb_s": 1000})";
  const char* flat =
      R"({"peak_tflops": 100, "efficiency": 1, "memory": "80GiB"})";
  const double weights = 4096.0 * 4097.0 * 2.0; // bytes, with the bias
  const double flops = 2.0 * 4096.0 * 4096.0;   // per sample
  // One sample: reading the weights at 1 TB/s, not 2 x 4096^2 FLOPs at
  // 100 TFLOP/s.
  EXPECT_NEAR(forwardAt(roofline, 1), (weights + 4 * 4096.0) / 1e9, 1e-6);
  EXPECT_NEAR(
      forwardAt(roofline, 2),
      forwardAt(roofline, 1),
      0.01 * forwardAt(roofline, 1));
  EXPECT_NEAR(forwardAt(roofline, 4096), 4096 * flops / 1e11, 1e-3);
  EXPECT_NEAR(forwardAt(flat, 1), flops / 1e11, 1e-9);
  EXPECT_NEAR(forwardAt(flat, 4096), 4096 * flops / 1e11, 1e-6);
}

// Nodes and devices per node are whole numbers (1.5 nodes of 8 had planned
// 12 devices), and their product is a device count tpipe can plan.
TEST(TuneTest, AClusterCountsWholeNodesAndDevices) {
  const Config config = parseConfig(nlohmann::json::parse(R"({
    "model": {"input_shape": [64], "layers": [{"type": "linear",
              "out_features": 64}]},
    "data": {"dataset": "synthetic", "samples": 8},
    "pipeline": {"devices": ["cpu:0"]},
    "train": {"batch_size": 8, "steps": 1, "loss": "mse"}})"));
  auto clusterWith = [](const std::string& counts) {
    return nlohmann::json::parse(
        "{" + counts +
        R"(, "device": {"peak_tflops": 100, "memory": "80GiB"},
           "intra_node": {"bandwidth_gb_s": 100}})");
  };
  auto refusal = [&](const std::string& counts) -> std::string {
    try {
      clusterCostModel(config, clusterWith(counts), "test");
    } catch (const ConfigError& error) {
      return error.what();
    }
    return "";
  };
  EXPECT_NE(
      refusal(R"("nodes": 1.5, "devices_per_node": 8)")
          .find("cluster.nodes: expected a whole number, got 1.5"),
      std::string::npos);
  EXPECT_NE(
      refusal(R"("nodes": 2, "devices_per_node": 2.5)")
          .find("cluster.devices_per_node: expected a whole number"),
      std::string::npos);
  EXPECT_NE(
      refusal(R"("nodes": 1048576, "devices_per_node": 8)")
          .find("more than 1048576 devices"),
      std::string::npos);
  EXPECT_EQ(
      clusterCostModel(
          config, clusterWith(R"("nodes": 2, "devices_per_node": 4)"), "test")
          .request.devices.size(),
      8u);
}

// A block's norms, softmax and dropout run as kernels of their own: with a
// bandwidth, their traffic (19 s h + 6.5 a s^2 elements forward, twice
// backward) adds to the products' time instead of hiding under it, so a
// narrow block with many heads costs more than its FLOPs say.
TEST(TuneTest, ClusterBlocksPayTheirMemoryBoundKernels) {
  const Config config = parseConfig(nlohmann::json::parse(R"({
    "model": {"input_shape": [1024, 2048],
              "layers": [{"type": "transformer_block", "heads": 32}]},
    "data": {"dataset": "synthetic", "samples": 8},
    "pipeline": {"devices": ["cpu:0"]},
    "train": {"batch_size": 8, "steps": 1, "loss": "mse"}})"));
  nlohmann::json cluster = nlohmann::json::parse(R"({"nodes": 1,
    "devices_per_node": 1,
    "device": {"peak_tflops": 100, "efficiency": 1, "memory": "80GiB",
               "memory_gb_s": 1000},
    "intra_node": {"bandwidth_gb_s": 100}})");
  const TuneOutcome outcome = clusterCostModel(config, cluster, "test");
  EXPECT_TRUE(outcome.result.candidates.empty()); // nothing searched
  const double s = 1024, h = 2048, a = 32;
  const double flops = 2 * s * h * h * 12 + 4 * s * s * h;
  const double moved = 2.0 * (19 * s * h + 6.5 * a * s * s); // bytes
  const LayerModel& block = outcome.model.layers.at(0);
  // Compute-bound at 8 samples: FLOPs at 100 TFLOP/s, plus the traffic at
  // 1 TB/s.
  EXPECT_NEAR(
      block.forward.at(0).at(8), 8 * (flops / 1e11 + moved / 1e9), 1e-3);
  EXPECT_NEAR(
      block.backward.at(0).at(8),
      8 * (2 * flops / 1e11 + 2 * moved / 1e9),
      1e-3);
  // FlashAttention keeps the scores on chip: 6.5 a s^2 fewer elements
  // moved, 1.25 a s^2 fewer kept for the backward.
  cluster["flash_attention"] = true;
  const LayerModel flash =
      clusterCostModel(config, cluster, "test").model.layers.at(0);
  EXPECT_NEAR(
      flash.forward.at(0).at(8),
      8 * (flops / 1e11 + 2.0 * 19 * s * h / 1e9),
      1e-3);
  EXPECT_NEAR(
      block.stashBytesPerSample - flash.stashBytesPerSample,
      2.0 * 1.25 * a * s * s,
      1.0);
  cluster["flash_attention"] = "yes";
  EXPECT_THROW(clusterCostModel(config, cluster, "test"), ConfigError);
}

// predictCandidate predicts the plan asked for: a pinned partition, the
// interleaved schedule's chunks per rank and auto's micro-batches in
// flight, which wins over what the devices' memory would allow.
TEST(TuneTest, MeasuredCandidatesGetOnePositiveStepEachAndBadCountsAreRefused) {
  const Config config = parseConfig(nlohmann::json::parse(R"({
    "model": {"input_shape": [16], "layers": [
      {"type": "linear", "out_features": 16}, {"type": "relu"},
      {"type": "linear", "out_features": 4}]},
    "data": {"dataset": "synthetic", "samples": 64},
    "pipeline": {"devices": ["cpu:0", "cpu:1"]},
    "train": {"batch_size": 16, "steps": 1, "loss": "cross_entropy"}})"));
  TuneCandidate whole;
  whole.threadsPerStage = 1;
  whole.boundaries = {0, 3};
  TuneCandidate split = whole; // two stages: steps posted ahead, overlapped
  split.ranks = 2;
  split.stages = 2;
  split.microBatches = 2;
  split.schedule = ScheduleKind::kOneFOneB;
  split.boundaries = {0, 2, 3};
  const std::vector<double> ms =
      measureCandidates(config, {whole, split}, 3, 2);
  ASSERT_EQ(ms.size(), 2u);
  for (double one : ms) {
    EXPECT_GT(one, 0.0);
    EXPECT_TRUE(std::isfinite(one));
  }
  EXPECT_THROW(measureCandidates(config, {whole}, 0, 2), std::invalid_argument);
  EXPECT_THROW(measureCandidates(config, {whole}, 3, 0), std::invalid_argument);
}

TEST(TuneTest, PredictsAPinnedPlan) {
  const Config config = parseConfig(nlohmann::json::parse(R"({
    "model": {"input_shape": [256], "layers": [
      {"type": "linear", "out_features": 256}, {"type": "linear", "out_features": 256},
      {"type": "linear", "out_features": 256}, {"type": "linear", "out_features": 256},
      {"type": "linear", "out_features": 256}, {"type": "linear", "out_features": 256},
      {"type": "linear", "out_features": 256}, {"type": "linear", "out_features": 256}]},
    "data": {"dataset": "synthetic", "samples": 64},
    "pipeline": {"devices": ["cpu:0"]},
    "train": {"batch_size": 64, "steps": 1, "loss": "mse"}})"));
  const TuneOutcome outcome = clusterCostModel(
      config,
      nlohmann::json::parse(R"({"nodes": 1, "devices_per_node": 2,
        "device": {"peak_tflops": 1, "efficiency": 1, "memory": "80GiB"},
        "intra_node": {"bandwidth_gb_s": 100}})"),
      "test");
  TuneCandidate shape;
  shape.ranks = 2;
  shape.threadsPerStage = outcome.model.threads.front();
  shape.microBatches = 16;
  shape.schedule = ScheduleKind::kOneFOneB;
  shape.checkpoint = CheckpointMode::kNever;
  shape.boundaries = {0, 2, 8};
  const TuneCandidate uneven =
      predictCandidate(outcome.model, outcome.request, shape);
  ASSERT_TRUE(uneven.infeasible.empty()) << uneven.infeasible;
  EXPECT_EQ(uneven.boundaries, shape.boundaries);
  shape.boundaries.clear();
  const TuneCandidate balanced =
      predictCandidate(outcome.model, outcome.request, shape);
  EXPECT_EQ(balanced.boundaries, (std::vector<int>{0, 4, 8}));
  // 6 of 8 equal layers on one rank: about 6/4 of the balanced step.
  EXPECT_GT(uneven.predictedStepMs, 1.3 * balanced.predictedStepMs);
  EXPECT_LT(uneven.predictedStepMs, 1.6 * balanced.predictedStepMs);

  shape.schedule = ScheduleKind::kInterleaved;
  shape.virtualStages = 4;
  const TuneCandidate chunks =
      predictCandidate(outcome.model, outcome.request, shape);
  ASSERT_TRUE(chunks.infeasible.empty()) << chunks.infeasible;
  EXPECT_EQ(chunks.virtualStages, 4);
  EXPECT_EQ(chunks.stages, 8);
  EXPECT_EQ(chunks.boundaries.size(), 9u);

  // auto: 2p in flight holds more than p, though 80 GiB would fit all 16.
  shape.schedule = ScheduleKind::kAuto;
  shape.virtualStages = 1;
  shape.inFlightLimit = 2;
  const TuneCandidate p =
      predictCandidate(outcome.model, outcome.request, shape);
  shape.inFlightLimit = 4;
  const TuneCandidate twoP =
      predictCandidate(outcome.model, outcome.request, shape);
  ASSERT_TRUE(p.infeasible.empty() && twoP.infeasible.empty());
  EXPECT_EQ(twoP.inFlightLimit, 4);
  EXPECT_LT(p.peakActivationBytes, twoP.peakActivationBytes);
  EXPECT_LE(twoP.peakActivationBytes, 2 * p.peakActivationBytes);
  EXPECT_EQ(tuneCandidateToJson(twoP).at("in_flight_limit"), 4);

  // dualpipe: one chain's partition, each stage's parameters (with their
  // gradients) held twice; an odd micro-batch count cannot split in two.
  shape.inFlightLimit = 0;
  shape.schedule = ScheduleKind::kOneFOneB;
  const TuneCandidate single =
      predictCandidate(outcome.model, outcome.request, shape);
  shape.schedule = ScheduleKind::kDualPipe;
  const TuneCandidate dual =
      predictCandidate(outcome.model, outcome.request, shape);
  ASSERT_TRUE(single.infeasible.empty() && dual.infeasible.empty())
      << dual.infeasible;
  EXPECT_EQ(dual.boundaries, (std::vector<int>{0, 4, 8}));
  const double fixedSingle =
      static_cast<double>(single.peakBytes[0] - single.peakActivationBytes);
  const double fixedDual =
      static_cast<double>(dual.peakBytes[0] - dual.peakActivationBytes);
  EXPECT_NEAR(fixedDual, 2 * fixedSingle, 0.01 * fixedSingle);
  shape.microBatches = 15;
  EXPECT_NE(
      predictCandidate(outcome.model, outcome.request, shape)
          .infeasible.find("even number of micro-batches"),
      std::string::npos);
}

// Across processes steps are posted without a barrier too: --cluster
// predicts a plan of several ranks by its back-to-back step (ZB-H2 below
// the barrier's step), with or without data-parallel replicas, and one
// stage as before.
TEST(TuneTest, ClusterPlansOverlapTheirSteps) {
  const auto tuneWith = [](bool overlap) {
    Config config = parseConfig(nlohmann::json::parse(R"({
      "model": {"input_shape": [1024], "layers": [
        {"type": "linear", "out_features": 1024}, {"type": "linear", "out_features": 1024},
        {"type": "linear", "out_features": 1024}, {"type": "linear", "out_features": 1024}]},
      "data": {"dataset": "synthetic", "samples": 64},
      "pipeline": {"devices": ["cpu:0"]},
      "train": {"batch_size": 64, "steps": 1, "loss": "mse"}})"));
    config.pipeline.overlapSteps = overlap;
    return tuneForCluster(
        config,
        nlohmann::json::parse(R"({"nodes": 1, "devices_per_node": 4,
          "device": {"peak_tflops": 100, "efficiency": 0.5, "memory": "80GiB"},
          "intra_node": {"bandwidth_gb_s": 100}})"),
        "test");
  };
  const TuneOutcome on = tuneWith(true), off = tuneWith(false);
  int lower = 0, replicated = 0, compared = 0;
  for (const TuneCandidate& a : on.result.candidates) {
    if (!a.infeasible.empty())
      continue;
    for (const TuneCandidate& b : off.result.candidates) {
      if (b.label() != a.label() || b.dataParallel != a.dataParallel)
        continue;
      ++compared;
      if (a.ranks == 1) {
        EXPECT_DOUBLE_EQ(a.predictedStepMs, b.predictedStepMs) << a.label();
      } else {
        EXPECT_LE(a.predictedStepMs, b.predictedStepMs + 1e-9) << a.label();
        lower += a.schedule == ScheduleKind::kZeroBubbleH2 &&
            a.predictedStepMs < b.predictedStepMs - 1e-9;
        replicated +=
            a.dataParallel > 1 && a.predictedStepMs < b.predictedStepMs - 1e-9;
      }
    }
  }
  EXPECT_GT(compared, 0);
  EXPECT_GT(lower, 0);
  EXPECT_GT(replicated, 0);
}

// With steps that overlap, a plan of several ranks is predicted by its
// back-to-back step: ZB-H2, whose ranks end staggered, then predicts below
// ZB-H1 (with a barrier they tie), and one stage is predicted as before.
TEST(TuneTest, OverlappingStepsRankSchedulesByTheirBackToBackStep) {
  const CostModel model = equalLayers(4, 1.0);
  auto predicted = [&](ScheduleKind kind, int ranks, bool overlap) {
    TuneRequest request = twoCores();
    request.schedules = {kind};
    request.stageCounts = {ranks};
    request.microBatches = {8};
    request.checkpoints = {CheckpointMode::kNever};
    request.overlapSteps = overlap;
    const TuneResult result = tunePlans(model, request);
    const TuneCandidate& choice = choiceOf(result);
    EXPECT_EQ(choice.ranks, ranks);
    const Plan plan = resolvePlan(candidatePlanRequest(model, request, choice));
    return std::make_pair(choice.predictedStepMs, plan);
  };
  const auto [h1Barrier, h1Plan] =
      predicted(ScheduleKind::kZeroBubbleH1, 2, false);
  const auto [h2Barrier, h2Plan] =
      predicted(ScheduleKind::kZeroBubbleH2, 2, false);
  const double h1Overlap =
      predicted(ScheduleKind::kZeroBubbleH1, 2, true).first;
  const double h2Overlap =
      predicted(ScheduleKind::kZeroBubbleH2, 2, true).first;
  EXPECT_NEAR(h2Barrier, h2Plan.simulation.makespan, 1e-9);
  EXPECT_NEAR(h1Barrier, h1Plan.simulation.makespan, 1e-9);
  EXPECT_LT(h2Overlap, h2Barrier);
  EXPECT_LT(h2Overlap, h1Overlap);
  EXPECT_LE(h1Overlap, h1Barrier);
  EXPECT_DOUBLE_EQ(
      predicted(ScheduleKind::kOneFOneB, 1, true).first,
      predicted(ScheduleKind::kOneFOneB, 1, false).first);
}
