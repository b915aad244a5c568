#include <cmath>

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "runtime/memory.h"
#include "tpipe/profile.h"

namespace tpipe {
namespace {

LayerList stack() {
  torch::manual_seed(0);
  return layersOf(torch::nn::Sequential(
      torch::nn::Linear(256, 512),
      torch::nn::ReLU(),
      torch::nn::Flatten(),
      torch::nn::Linear(512, 64)));
}

at::Tensor sample(int64_t n) {
  return torch::randn({n, 256});
}

TEST(ProfileTest, RecordsBytesOfParametersOutputsAndStash) {
  ProfileOptions options;
  options.microBatchSize = 16;
  options.repeats = 3;
  const Profile profile = profileLayers(stack(), sample, options);
  ASSERT_EQ(profile.layers.size(), 4u);
  EXPECT_EQ(profile.inputBytes, 16 * 256 * 4);
  const auto& linear = profile.layers[0].cost;
  EXPECT_EQ(linear.paramBytes, (256 * 512 + 512) * 4);
  EXPECT_EQ(linear.activationBytes, 16 * 512 * 4);
  EXPECT_GE(linear.stashBytes, linear.activationBytes); // at least its output
  EXPECT_EQ(profile.layers[1].cost.paramBytes, 0);
  EXPECT_EQ(
      profile.layers[2].cost.stashBytes, 0); // flatten of a 2-D input is a view
  for (const auto& layer : profile.layers) {
    EXPECT_GT(layer.cost.forwardMs, 0.0);
    EXPECT_GE(layer.cost.backwardMs, 0.0);
  }
  EXPECT_EQ(profile.fitSizes, (std::vector<int64_t>{8, 16, 32}));
}

// A skip alive across a layer's end crosses a boundary there too: it is
// charged to that layer's activation bytes, and the popping layer's time
// includes the merge.
TEST(ProfileTest, SkipsAliveAcrossALayerEndCountAsItsActivation) {
  LayerList layers = stack();
  layers[0].stash = {"wide"};   // [16, 512]
  layers[1].stash = {"narrow"}; // [16, 512], popped by a concat below
  layers[3].pop = {"narrow"};
  layers[3].merge = SkipMerge::kConcat; // [16, 64 + 512]
  layers[2].pop = {"wide"};             // add: [16, 512]
  ProfileOptions options;
  options.microBatchSize = 16;
  options.repeats = 2;
  const Profile profile = profileLayers(layers, sample, options);
  const int64_t row = 16 * 512 * 4;
  EXPECT_EQ(profile.layers[0].cost.activationBytes, 2 * row);
  EXPECT_EQ(profile.layers[1].cost.activationBytes, 3 * row);
  EXPECT_EQ(profile.layers[2].cost.activationBytes, 2 * row);
  EXPECT_EQ(profile.layers[3].cost.activationBytes, 16 * (64 + 512) * 4);
}

TEST(ProfileTest, TheSizeCurveIsExactOnAPowerLawAndBendsWithTheData) {
  // t = 0.01 n^0.8: a straight line in log space.
  std::vector<int64_t> sizes{8, 16, 32, 64};
  std::vector<double> times;
  for (int64_t n : sizes)
    times.push_back(0.01 * std::pow(static_cast<double>(n), 0.8));
  const SizeCurve power = fitSizeCurve(sizes, times);
  EXPECT_NEAR(power.at(24), 0.01 * std::pow(24.0, 0.8), 1e-9);
  EXPECT_LT(power.worstResidual, 1e-9);
  // Past the measured sizes it goes on along the end slope.
  EXPECT_NEAR(power.at(128), 0.01 * std::pow(128.0, 0.8), 1e-9);
  // Small sizes inefficient: t = 1 + 0.1 n is not a power law; the curve
  // passes through every measured point and bends between them.
  times.clear();
  for (int64_t n : sizes)
    times.push_back(1.0 + 0.1 * static_cast<double>(n));
  const SizeCurve bent = fitSizeCurve(sizes, times);
  for (size_t i = 0; i < sizes.size(); ++i)
    EXPECT_NEAR(bent.at(static_cast<double>(sizes[i])), times[i], 1e-9);
  EXPECT_NEAR(bent.at(24), 3.4, 0.05);
  // Its roughness: each inner point against its neighbours' power law.
  EXPECT_GT(bent.worstResidual, 0.01);
  EXPECT_LT(bent.worstResidual, 0.1);
  // One size: proportional to n.
  const SizeCurve one = fitSizeCurve({10}, {2.0});
  EXPECT_NEAR(one.at(20), 4.0, 1e-9);
}

// Measured times are noisy (a shared CI machine): only a loose check here;
// the fit's arithmetic is tested exactly above.
TEST(ProfileTest, TheFitPredictsAHeldOutMicroBatchSize) {
  torch::manual_seed(1);
  LayerList heavy =
      layersOf(torch::nn::Sequential(torch::nn::Linear(1024, 1024)));
  auto input = [](int64_t n) { return torch::randn({n, 1024}); };
  ProfileOptions options;
  options.microBatchSize = 64;
  options.repeats = 7;
  const Profile profile = profileLayers(heavy, input, options);
  // Held out: 96 samples was never measured; time it the same way.
  ProfileOptions heldOut = options;
  heldOut.microBatchSize = 96;
  const Profile measured = profileLayers(heavy, input, heldOut);
  const double predicted =
      profile.layers[0].forward.at(96) + profile.layers[0].backward.at(96);
  const double actual =
      measured.layers[0].cost.forwardMs + measured.layers[0].cost.backwardMs;
  EXPECT_GT(predicted / actual, 1.0 / 3)
      << "predicted " << predicted << " ms, measured " << actual << " ms";
  EXPECT_LT(predicted / actual, 3.0)
      << "predicted " << predicted << " ms, measured " << actual << " ms";
  EXPECT_GT(
      profile.layers[0].forward.at(128), profile.layers[0].forward.at(32));
}

TEST(ProfileTest, JsonRoundTripAndScaling) {
  ProfileOptions options;
  options.microBatchSize = 4;
  options.repeats = 1;
  const Profile profile = profileLayers(stack(), sample, options);
  const Profile back = profileFromJson(profileToJson(profile));
  ASSERT_EQ(back.layers.size(), profile.layers.size());
  EXPECT_EQ(back.layers[0].cost.paramBytes, profile.layers[0].cost.paramBytes);
  EXPECT_DOUBLE_EQ(
      back.layers[3].backward.at(7), profile.layers[3].backward.at(7));
  const auto doubled = back.costsAt(8);
  EXPECT_EQ(
      doubled[0].activationBytes, 2 * profile.layers[0].cost.activationBytes);
  EXPECT_THROW(
      profileFromJson(nlohmann::json::parse(R"({"layers": [{"name": "x"}]})")),
      ConfigError);
  EXPECT_THROW(
      profileFromJson(nlohmann::json::parse(
          R"({"layers": [{"forward_ms": -1, "backward_ms": 1}]})")),
      ConfigError);
}

TEST(ProfileTest, AllocatorChargesTheThreadsDevice) {
  memory::install();
  const int64_t before = memory::liveBytes(3);
  at::Tensor t;
  {
    memory::DeviceScope scope(3);
    t = torch::empty({1000}, torch::kFloat);
  }
  EXPECT_EQ(memory::liveBytes(3) - before, 4000);
  EXPECT_GE(memory::peakBytes(3), memory::liveBytes(3));
  t = at::Tensor();
  EXPECT_EQ(memory::liveBytes(3), before);
  // Allocations on other threads without a device are not charged.
  std::thread([&] { t = torch::empty({1000}); }).join();
  EXPECT_EQ(memory::liveBytes(3), before);
}

} // namespace
} // namespace tpipe

namespace tpipe {
namespace {

// Profiling runs the caller's own modules: it must hand them back exactly as
// it found them (values, gradients, buffers, device, random stream).
TEST(ProfileTest, LeavesTheCallersModulesAsFound) {
  torch::manual_seed(3);
  torch::nn::Sequential net(
      torch::nn::Linear(8, 8),
      torch::nn::BatchNorm1d(8),
      torch::nn::Dropout(0.5),
      torch::nn::Linear(8, 4));
  const LayerList layers = layersOf(net);
  for (auto& p : net->parameters())
    p.mutable_grad() = torch::full_like(p, 0.25);
  std::vector<torch::Tensor> grads, gradValues, values, buffers;
  for (auto& p : net->parameters()) {
    grads.push_back(p.grad());
    gradValues.push_back(p.grad().clone());
    values.push_back(p.detach().clone());
  }
  for (auto& b : net->buffers())
    buffers.push_back(b.clone());
  const torch::Tensor nextRandom = [] {
    auto generator = at::detail::getDefaultCPUGenerator().clone();
    return torch::rand({4}, generator);
  }();
  ProfileOptions options;
  options.microBatchSize = 4;
  options.repeats = 2;
  profileLayers(
      layers,
      [](int64_t n) {
        return torch::randn({n, 8});
      },
      options);
  const auto parameters = net->parameters();
  for (size_t i = 0; i < parameters.size(); ++i) {
    EXPECT_TRUE(torch::equal(parameters[i], values[i])) << "parameter " << i;
    EXPECT_TRUE(parameters[i].grad().is_same(grads[i]))
        << "the caller's .grad tensor " << i;
    EXPECT_TRUE(torch::equal(parameters[i].grad(), gradValues[i]))
        << "gradient " << i;
    EXPECT_TRUE(parameters[i].device().is_cpu());
  }
  const auto after = net->buffers();
  for (size_t i = 0; i < after.size(); ++i)
    EXPECT_TRUE(torch::equal(after[i], buffers[i])) << "buffer " << i;
  EXPECT_TRUE(torch::equal(torch::rand({4}), nextRandom))
      << "the default generator moved";
}

// The tuner's stop: a hook that throws ends the profile at the next layer,
// not after every layer at every size, and leaves the caller's layers and
// thread count as they were.
TEST(ProfileTest, AHookThatThrowsEndsTheProfileAtTheNextLayer) {
  torch::manual_seed(5);
  torch::nn::Sequential net(
      torch::nn::Linear(8, 8),
      torch::nn::Tanh(),
      torch::nn::Linear(8, 8),
      torch::nn::Linear(8, 4));
  const LayerList layers = layersOf(net);
  std::vector<torch::Tensor> values;
  for (auto& p : net->parameters())
    values.push_back(p.detach().clone());
  struct Stop {};
  int calls = 0;
  ProfileOptions options;
  options.microBatchSize = 4;
  options.repeats = 2;
  options.threads = 1;
  options.beforeEachLayer = [&] {
    if (++calls == 3)
      throw Stop{};
  };
  const auto sample = [](int64_t n) { return torch::randn({n, 8}); };
  const int callerThreads = at::get_num_threads();
  at::set_num_threads(2);
  EXPECT_THROW(profileLayers(layers, sample, options), Stop);
  EXPECT_EQ(calls, 3) << "the layer after the stop was measured";
  EXPECT_EQ(at::get_num_threads(), 2) << "the caller's thread count";
  at::set_num_threads(callerThreads);
  const auto parameters = net->parameters();
  for (size_t i = 0; i < parameters.size(); ++i) {
    EXPECT_TRUE(torch::equal(parameters[i], values[i])) << "parameter " << i;
    EXPECT_FALSE(parameters[i].grad().defined()) << "gradient " << i;
  }
  // A hook that lets the profile go on is called before every layer, at
  // every size, in every round.
  calls = 0;
  options.beforeEachLayer = [&] { ++calls; };
  const Profile whole = profileLayers(layers, sample, options);
  EXPECT_EQ(
      calls,
      static_cast<int>(
          layers.size() * whole.fitSizes.size() *
          static_cast<size_t>(whole.rounds)));
}

} // namespace
} // namespace tpipe
