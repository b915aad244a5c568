#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>

#include <nlohmann/json.hpp>

#include "tpipe/partition.h"
#include "tpipe/plan.h"
#include "tpipe/schedule.h"

namespace tpipe {
namespace {

TEST(PartitionTest, UniformPutsTheRemainderFirst) {
  EXPECT_EQ(uniformBoundaries(10, 4), (std::vector<int>{0, 3, 6, 8, 10}));
  EXPECT_EQ(uniformBoundaries(3, 3), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(balanceOf({0, 3, 6, 8, 10}), (std::vector<int>{3, 3, 2, 2}));
}

TEST(PartitionTest, MoreStagesThanLayersIsAClearError) {
  try {
    uniformBoundaries(3, 4);
    FAIL();
  } catch (const PartitionError& error) {
    EXPECT_STREQ(
        error.what(),
        "cannot split 3 layers into 4 stages: every stage needs at "
        "least one layer");
  }
  EXPECT_THROW(uniformBoundaries(3, 0), PartitionError);
}

TEST(PartitionTest, BalanceIsChecked) {
  EXPECT_EQ(balanceBoundaries({2, 1, 3}, 6), (std::vector<int>{0, 2, 3, 6}));
  try {
    balanceBoundaries({2, 2}, 5);
    FAIL();
  } catch (const PartitionError& error) {
    EXPECT_STREQ(error.what(), "balance sums to 4 layers, but the model has 5");
  }
  EXPECT_THROW(balanceBoundaries({3, 0, 2}, 5), PartitionError);
  EXPECT_THROW(balanceBoundaries({}, 5), PartitionError);
}

double bottleneck(const std::vector<double>& w, const std::vector<int>& b) {
  double worst = 0;
  for (size_t k = 0; k + 1 < b.size(); ++k) {
    double sum = 0;
    for (int i = b[k]; i < b[k + 1]; ++i)
      sum += w[i];
    worst = std::max(worst, sum);
  }
  return worst;
}

// Every contiguous split of n layers into k non-empty stages: each choice
// of k - 1 cut positions among the n - 1 gaps.
std::vector<std::vector<int>> allSplits(int n, int k) {
  std::vector<std::vector<int>> splits;
  for (unsigned mask = 0; mask < (1u << (n - 1)); ++mask) {
    if (__builtin_popcount(mask) != k - 1)
      continue;
    std::vector<int> boundaries{0};
    for (int gap = 1; gap < n; ++gap) {
      if (mask & (1u << (gap - 1)))
        boundaries.push_back(gap);
    }
    boundaries.push_back(n);
    splits.push_back(boundaries);
  }
  return splits;
}

TEST(PartitionTest, MinMaxIsOptimalAgainstBruteForce) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<double> weight(0.1, 10.0);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 9);
    const int k = 1 + static_cast<int>(rng() % n);
    std::vector<double> w(n);
    for (auto& x : w)
      x = weight(rng);
    const auto found = minMaxBoundaries(w, k);
    ASSERT_EQ(found.size(), static_cast<size_t>(k + 1));
    double best = 1e300;
    for (const auto& split : allSplits(n, k)) {
      best = std::min(best, bottleneck(w, split));
    }
    EXPECT_NEAR(bottleneck(w, found), best, 1e-9) << "trial " << trial;
  }
}

PartitionProblem randomProblem(std::mt19937& rng, int n, int k) {
  std::uniform_real_distribution<double> time(0.1, 5.0);
  std::uniform_int_distribution<int64_t> bytes(1, 1000);
  PartitionProblem problem;
  for (int i = 0; i < n; ++i) {
    LayerCost layer;
    layer.name = "l" + std::to_string(i);
    layer.forwardMs = time(rng);
    layer.backwardMs = 2 * time(rng);
    layer.paramBytes = rng() % 3 == 0 ? 0 : bytes(rng);
    layer.activationBytes = bytes(rng);
    layer.stashBytes = bytes(rng);
    problem.layers.push_back(layer);
  }
  const bool capped = rng() % 2 == 0, speeds = rng() % 2 == 0,
             links = rng() % 2 == 0;
  for (int d = 0; d < k; ++d) {
    DeviceSpec device;
    device.name = "cpu:" + std::to_string(d);
    if (speeds)
      device.speed = std::uniform_real_distribution<double>(0.5, 2.0)(rng);
    if (capped)
      device.memoryBytes =
          std::uniform_int_distribution<int64_t>(1500, 9000)(rng);
    if (links)
      device.linkBytesPerMs =
          std::uniform_real_distribution<double>(50, 2000)(rng);
    problem.devices.push_back(device);
  }
  const char* schedules[] = {"gpipe", "1f1b", "zb-h1"};
  const CheckpointMode modes[] = {
      CheckpointMode::kAlways,
      CheckpointMode::kExceptLast,
      CheckpointMode::kNever};
  ScheduleSpec spec;
  spec.source = schedules[rng() % 3];
  spec.checkpoint = modes[rng() % 3];
  spec.microBatches = 1 + static_cast<int>(rng() % 4);
  spec.ranks = k;
  const double optimizerFactor = static_cast<double>(rng() % 3);
  problem.memory =
      memoryModelOf(makeSchedule(spec), optimizerFactor, bytes(rng));
  problem.stages = k;
  return problem;
}

bool fitsEverywhere(const PartitionPlan& plan) {
  for (const auto& stage : plan.stages) {
    if (stage.capacityBytes > 0 && stage.memoryBytes > stage.capacityBytes)
      return false;
  }
  return true;
}

TEST(PartitionTest, OptimalMatchesBruteForceWithMemorySpeedsAndLinks) {
  std::mt19937 rng(2024);
  int feasibleCases = 0, infeasibleCases = 0;
  for (int trial = 0; trial < 600; ++trial) {
    const int n = 1 + static_cast<int>(rng() % 10);
    const int k = 1 + static_cast<int>(rng() % std::min(n, 5));
    const PartitionProblem problem = randomProblem(rng, n, k);
    double best = std::numeric_limits<double>::infinity();
    for (const auto& split : allSplits(n, k)) {
      const PartitionPlan plan = evaluatePartition(problem, split);
      if (fitsEverywhere(plan))
        best = std::min(best, plan.bottleneckMs);
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    if (std::isinf(best)) {
      EXPECT_THROW(optimalPartition(problem), PartitionError);
      ++infeasibleCases;
      continue;
    }
    const PartitionPlan plan = optimalPartition(problem);
    EXPECT_TRUE(fitsEverywhere(plan));
    EXPECT_NEAR(plan.bottleneckMs, best, 1e-9 * best);
    EXPECT_EQ(
        optimalPartition(problem).boundaries, plan.boundaries); // deterministic
    ++feasibleCases;
  }
  EXPECT_GT(feasibleCases, 200);
  EXPECT_GT(infeasibleCases, 20);
}

TEST(PartitionTest, ProfileOnlyPlanSumsForwardAndBackward) {
  PartitionProblem problem;
  for (double t : {1.0, 2.0, 3.0, 4.0, 5.0, 6.0})
    problem.layers.push_back({"", t, t, 0, 0, 0});
  problem.devices.assign(3, DeviceSpec{"cpu", 1.0, 0, 0.0});
  problem.stages = 3;
  const PartitionPlan plan = optimalPartition(problem);
  // Stage times 2, 4, ..., 12: {2+4+6, 8+10, 12} beats {2+4+6+8, 10, 12}.
  EXPECT_EQ(plan.boundaries, (std::vector<int>{0, 3, 5, 6}));
  EXPECT_DOUBLE_EQ(plan.bottleneckMs, 18.0);
}

// A stage's backward workspace holds one weight-sized gradient before it is
// added, unless every parameter-owning layer adds its own in place.
TEST(PartitionTest, WeightGradientsAddedInPlaceNeedNoWorkspace) {
  PartitionProblem problem;
  for (int i = 0; i < 4; ++i) // parameters 1000, output 10, nothing kept
    problem.layers.push_back({"l" + std::to_string(i), 1, 1, 1000, 10, 0});
  problem.layers[1].paramBytes = 0; // an activation
  for (auto& layer : problem.layers)
    layer.weightGradientInPlace = true;
  problem.layers[3].weightGradientInPlace = false;
  problem.devices.assign(2, DeviceSpec{"cpu", 1.0, 0, 0.0});
  problem.stages = 2;
  auto activations = [&](bool inPlace) {
    problem.memory.weightGradientsInPlace = inPlace;
    const PartitionPlan plan = evaluatePartition(problem, {0, 2, 4});
    return std::make_pair(
        plan.stages[0].activationBytes, plan.stages[1].activationBytes);
  };
  // Input of each micro-batch held (10), two layers' gradients of input and
  // output (2 x 10), and the weight gradient where one is allocated: stage
  // 1 holds a layer that adds none in place, so autograd walks it all.
  EXPECT_EQ(activations(true), std::make_pair(int64_t{20}, int64_t{1030}));
  EXPECT_EQ(activations(false), std::make_pair(int64_t{1020}, int64_t{1030}));
}

TEST(PartitionTest, InfeasibleRequestsAreExplained) {
  PartitionProblem problem;
  for (int i = 0; i < 4; ++i)
    problem.layers.push_back({"l" + std::to_string(i), 1, 1, 100, 10, 10});
  problem.layers[2].paramBytes = 10000;
  problem.layers[2].name = "huge";
  problem.devices = {{"cpu:0", 1.0, 1000, 0.0}, {"cpu:1", 1.0, 2000, 0.0}};
  problem.stages = 2;
  try {
    optimalPartition(problem);
    FAIL();
  } catch (const PartitionError& error) {
    EXPECT_NE(
        std::string(error.what())
            .find("layer 2 ('huge') alone needs 29.34 KiB"),
        std::string::npos)
        << error.what();
    EXPECT_NE(
        std::string(error.what()).find("largest device's 1.95 KiB (cpu:1)"),
        std::string::npos)
        << error.what();
  }
  problem.layers[2].paramBytes = 100;
  problem.devices = {{"cpu:0", 1.0, 600, 0.0}};
  problem.stages = 1;
  try {
    optimalPartition(problem);
    FAIL();
  } catch (const PartitionError& error) {
    // k layers: 2 x 100k parameter bytes + 10k stashed + the stage input (10,
    // none for the first stage) + a workspace of one weight gradient and two
    // activation gradients (120): two layers need 540-550 B.
    EXPECT_NE(
        std::string(error.what()).find("the model needs 960 B on one device"),
        std::string::npos)
        << error.what();
    EXPECT_NE(
        std::string(error.what()).find("2 devices of this size would fit"),
        std::string::npos)
        << error.what();
  }
}

TEST(PartitionTest, InFlightMicroBatchesFollowTheSchedule) {
  const CheckpointMode never = CheckpointMode::kNever;
  EXPECT_EQ(
      memoryModelOf(gpipeSchedule(4, 8, never), 0, 0).stashed,
      (std::vector<int>{8, 8, 8, 8}));
  const MemoryModel oneFOneB =
      memoryModelOf(oneFOneBSchedule(4, 8, never), 0, 0);
  EXPECT_EQ(oneFOneB.stashed, (std::vector<int>{4, 3, 2, 1}));
  EXPECT_EQ(oneFOneB.live, oneFOneB.stashed); // nothing rematerialized
  EXPECT_TRUE(oneFOneB.keepsEverything());
  EXPECT_EQ(memoryModelOf(oneFOneBSchedule(4, 2, never), 0, 0).stashedAt(0), 2);
  // Rematerialization keeps the stage inputs, and whole graphs only for the
  // micro-batch being recomputed (and the last, with except_last).
  const MemoryModel remat =
      memoryModelOf(gpipeSchedule(4, 8, CheckpointMode::kAlways), 0, 0);
  EXPECT_EQ(remat.stashed, (std::vector<int>{8, 8, 8, 8}));
  EXPECT_EQ(remat.live, (std::vector<int>{1, 1, 1, 1}));
  EXPECT_FALSE(remat.keepsEverything());
  // A split backward's weight pass adds Linear gradients in place, as the
  // direct weight gradients do.
  EXPECT_FALSE(memoryModelOf(oneFOneBSchedule(4, 8, never), 0, 0)
                   .weightGradientsInPlace);
  EXPECT_TRUE(memoryModelOf(oneFOneBSchedule(4, 8, never), 0, 0, true)
                  .weightGradientsInPlace);
  ScheduleSpec zeroBubble{ScheduleKind::kZeroBubbleH1};
  zeroBubble.ranks = 4;
  zeroBubble.microBatches = 8;
  EXPECT_TRUE(
      memoryModelOf(makeSchedule(zeroBubble), 0, 0).weightGradientsInPlace);
  EXPECT_EQ(formatBytes(512LL << 20), "512.00 MiB");
  EXPECT_EQ(formatBytes(12), "12 B");
}

// Posted steps that check the gradients may update a rank before the step
// is decided, keeping its parameters, gradients and optimizer state to undo
// it through the next step: every stage holds them twice. In one process a
// plan of one rank runs on the caller and posts no step.
TEST(PartitionTest, SpeculativeUpdatesChargeAnUndoCopyOfTheParameters) {
  PlanRequest request;
  for (int i = 0; i < 4; ++i)
    request.layers.push_back({"l" + std::to_string(i), 1, 1, 1000, 10, 10});
  request.optimizerFactor = 1.0; // sgd with momentum
  request.microBatches = 2;
  request.schedule = ScheduleKind::kOneFOneB;
  auto memories = [&](int devices, SpeculativeUpdates updates) {
    PlanRequest copy = request;
    copy.devices.assign(devices, DeviceSpec{"cpu", 1.0, 0, 0.0});
    copy.speculativeUpdates = updates;
    std::vector<int64_t> bytes;
    for (const StageReport& stage : resolvePlan(copy).stages) {
      bytes.push_back(stage.memoryBytes);
      EXPECT_EQ(stage.paramBytes, 1000 * (4 / devices));
    }
    return bytes;
  };
  const auto none = memories(2, SpeculativeUpdates::kNone);
  const auto speculative = memories(2, SpeculativeUpdates::kSeveralRanks);
  ASSERT_EQ(speculative.size(), 2u);
  for (size_t k = 0; k < speculative.size(); ++k) // (2 + 1) x 2000 more
    EXPECT_EQ(speculative[k] - none[k], 6000) << "stage " << k;
  EXPECT_EQ(
      memories(1, SpeculativeUpdates::kSeveralRanks),
      memories(1, SpeculativeUpdates::kNone));
  EXPECT_EQ(
      memories(1, SpeculativeUpdates::kEveryPlan).front() -
          memories(1, SpeculativeUpdates::kNone).front(),
      12000);
  // The plan says why its memory doubled.
  PlanRequest posted = request;
  posted.devices.assign(2, DeviceSpec{"cpu", 1.0, 0, 0.0});
  posted.speculativeUpdates = SpeculativeUpdates::kSeveralRanks;
  const std::vector<std::string> notes = resolvePlan(posted).notes;
  EXPECT_TRUE(std::any_of(notes.begin(), notes.end(), [](const auto& note) {
    return note.find("posted steps that check the gradients keep them") !=
        std::string::npos;
  }));

  // A capacity the undo copy overflows: the verdict says what it is, and
  // that steps with a barrier would fit.
  const int64_t fitsNone = *std::max_element(none.begin(), none.end()) + 100;
  request.devices.assign(2, DeviceSpec{"cpu", 1.0, fitsNone, 0.0});
  request.speculativeUpdates = SpeculativeUpdates::kSeveralRanks;
  const Feasibility verdict = checkFeasibility(request, 0);
  EXPECT_FALSE(verdict.fits);
  EXPECT_NE(
      verdict.problem.find("half of that kept to undo posted steps' updates"),
      std::string::npos)
      << verdict.problem;
  ASSERT_FALSE(verdict.fixes.empty());
  EXPECT_EQ(verdict.fixes.front().rfind("pipeline.overlap_steps=false", 0), 0u)
      << verdict.fixes.front();
}

// A re-plan from measured stage times goes through the resolver: the
// partition stays, `auto` is rebuilt for the given per-stage costs, and the
// predicted step is theirs.
// With every device's memory declared, `auto` holds what each device has
// room for instead of 1F1B's p micro-batches: room for more lets the search
// fill the bubble, and room for fewer than p gives a plan that fits where
// 1F1B's memory would not.
TEST(PartitionTest, AutoHoldsWhatEachDeviceHasRoomFor) {
  PlanRequest request;
  for (int l = 0; l < 4; ++l)
    request.layers.push_back(
        {"l" + std::to_string(l), 1.0, 2.0, 1000, 100, 1000});
  // GPT-like stages (T_W ~ 0.6 T_F, transfers 3%): room beyond p pays.
  StageCosts gpt;
  gpt.forward = 1.0, gpt.backwardInput = 0.98, gpt.backwardWeight = 0.6;
  gpt.backward = gpt.backwardInput + gpt.backwardWeight, gpt.transfer = 0.03;
  request.stageCosts.assign(4, gpt);
  request.partition = PartitionMethod::kBalance;
  request.balance = {1, 1, 1, 1};
  request.schedule = ScheduleKind::kAuto;
  request.microBatches = 8;
  request.checkpoint = CheckpointMode::kNever;
  auto onDevices = [&](const std::vector<int64_t>& capacities) {
    PlanRequest r = request;
    for (size_t d = 0; d < capacities.size(); ++d) {
      DeviceSpec device;
      device.name = "cpu:" + std::to_string(d);
      device.memoryBytes = capacities[d];
      r.devices.push_back(device);
    }
    return resolvePlan(r);
  };
  const Plan unlimited = onDevices({0, 0, 0, 0});
  ASSERT_EQ(unlimited.stages.size(), 4u);
  auto noteWith = [](const Plan& plan, const std::string& text) {
    for (const std::string& note : plan.notes) {
      if (note.find(text) != std::string::npos)
        return true;
    }
    return false;
  };
  // Room for every micro-batch: each device holds up to m = 8.
  const int64_t ample = int64_t{1} << 30;
  const Plan roomy = onDevices({ample, ample, ample, ample});
  EXPECT_TRUE(noteWith(
      roomy, "micro-batches in flight per device from its memory: 8, 8, 8, 8"));
  EXPECT_FALSE(roomy.overCapacity());
  EXPECT_LT(roomy.simulation.makespan, unlimited.simulation.makespan - 1e-9);
  EXPECT_GT(roomy.stages.front().inFlight, 4);

  // One byte short of what 1F1B's 4 micro-batches take on each device.
  std::vector<int64_t> short1;
  for (const StageReport& stage : unlimited.stages)
    short1.push_back(stage.memoryBytes - 1);
  const Plan tight = onDevices(short1);
  EXPECT_TRUE(noteWith(tight, "from its memory: 3, 3, 3, 3"))
      << tight.notes.size();
  EXPECT_FALSE(tight.overCapacity());
  for (const StageReport& stage : tight.stages)
    EXPECT_LE(stage.inFlight, 3);
  // The same devices under 1F1B's memory: over capacity.
  request.schedule = ScheduleKind::kOneFOneB;
  EXPECT_TRUE(onDevices(short1).overCapacity());
}

TEST(PartitionTest, MeasuredStageCostsRebuildTheAutoScheduleOfAPlan) {
  PlanRequest request;
  for (int l = 0; l < 6; ++l)
    request.layers.push_back({"l" + std::to_string(l), 1.0, 2.0, 1000});
  request.devices = {{"cpu:0"}, {"cpu:1"}};
  request.partition = PartitionMethod::kParameters;
  request.schedule = ScheduleKind::kAuto;
  request.microBatches = 8;
  request.checkpoint = CheckpointMode::kNever;
  request.threadsPerDevice = 3;
  const Plan unit = resolvePlan(request);
  EXPECT_EQ(unit.threadsPerDevice, 3);
  EXPECT_EQ(unit.boundaries, (std::vector<int>{0, 3, 6}));

  // The second stage measured three times as slow as the first.
  std::vector<StageCosts> measured(2);
  measured[1].forward = 3.0;
  measured[1].backward = 6.0;
  measured[1].backwardInput = 3.0;
  measured[1].backwardWeight = 3.0;
  const Plan replanned = resolvePlan(pinnedRequest(request, unit, measured));
  EXPECT_EQ(replanned.boundaries, unit.boundaries);
  EXPECT_EQ(replanned.partition, PartitionMethod::kBalance);
  EXPECT_EQ(replanned.threadsPerDevice, 3);
  ScheduleSpec spec;
  spec.source = ScheduleKind::kAuto;
  spec.ranks = 2;
  spec.microBatches = 8;
  spec.checkpoint = CheckpointMode::kNever;
  spec.costs = measured;
  const Schedule expected = makeSchedule(spec);
  EXPECT_EQ(scheduleToJson(replanned.schedule), scheduleToJson(expected));
  EXPECT_NE(scheduleToJson(replanned.schedule), scheduleToJson(unit.schedule));
  EXPECT_DOUBLE_EQ(
      replanned.simulation.makespan, simulate(expected, measured).makespan);
  // The slow stage bounds the step: 8 micro-batches of 3 + 6 ms.
  EXPECT_GE(replanned.simulation.makespan, 8 * 9.0);

  // A recorded run of fused backwards times no input or weight pass (and
  // one without checkpoints no recompute): those are derived, not free.
  std::vector<StageCosts> fused = measured;
  for (StageCosts& c : fused)
    c.backwardInput = c.backwardWeight = c.recompute = 0.0;
  const Plan fromFused = resolvePlan(pinnedRequest(request, unit, fused));
  EXPECT_DOUBLE_EQ(
      fromFused.simulation.makespan, replanned.simulation.makespan);

  // Per-stage costs fix the partition, so a searching method is refused.
  request.stageCosts = measured;
  try {
    resolvePlan(request);
    FAIL();
  } catch (const PartitionError& error) {
    EXPECT_NE(
        std::string(error.what()).find("per-stage costs (2) need partition"),
        std::string::npos)
        << error.what();
  }
}

} // namespace
} // namespace tpipe
