// Runs the tpipe binary as a user would.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <fstream>
#include <string>
#include <vector>
#include <sys/wait.h>

namespace {

struct Result {
  int status;
  std::string output; // stdout and stderr
};

Result runTpipe(const std::string& arguments) {
  const char* binary = std::getenv("TPIPE_BINARY");
  EXPECT_NE(binary, nullptr) << "TPIPE_BINARY is not set (run through ctest)";
  if (binary == nullptr)
    return {-1, ""};
  const std::string command = std::string(binary) + " " + arguments + " 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  std::string output;
  std::array<char, 4096> buffer{};
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) {
    output.append(buffer.data(), n);
  }
  const int status = pclose(pipe);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output};
}

TEST(CliTest, ScheduleJsonHasPerStageOps) {
  const Result r = runTpipe(
      "schedule --stages 2 --micro-batches 3 --schedule 1f1b --checkpoint never --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto json = nlohmann::json::parse(r.output);
  ASSERT_EQ(json["stages"].size(), 2u);
  EXPECT_EQ(json["stages"][1][0]["op"], "recv_activation");
  EXPECT_EQ(json["stages"][1][1]["op"], "forward");
  EXPECT_EQ(json["stages"][1][1]["micro_batch"], 0);
  EXPECT_NEAR(json["simulation"]["bubble_fraction"].get<double>(), 0.25, 1e-12);
}

TEST(CliTest, ScheduleTableAndTimeline) {
  const Result r = runTpipe(
      "schedule --stages 4 --micro-batches 8 --schedule zb-h1 --checkpoint never");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 0: F0 F1 F2 F3 b0 w0"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("timeline"), std::string::npos);
  // Unit costs, 8 micro-batches: the weight passes fill the way down and
  // back (3 x (F + I) + W = 7 <= 8 W).
  EXPECT_NE(r.output.find("span bubble floor 0.00%"), std::string::npos)
      << r.output;
  const Result few = runTpipe(
      "schedule --stages 4 --micro-batches 4 --schedule zb-h1 --checkpoint never");
  ASSERT_EQ(few.status, 0) << few.output;
  // 4 micro-batches: 7 - 4 = 3 idle units against 12 of work.
  EXPECT_NE(few.output.find("span bubble floor 20.00%"), std::string::npos)
      << few.output;
}

TEST(CliTest, BadScheduleExitsWithStatusTwo) {
  const Result r =
      runTpipe("schedule --stages 2 --micro-batches 3 --schedule nope");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("unknown schedule 'nope'"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos);
}

// A schedule moved through torch.distributed.pipelining's CSV trains here.
TEST(CliTest, AnActionCsvScheduleTrains) {
  const std::string root = TPIPE_SOURCE_DIR;
  const std::string file = testing::TempDir() + "/tpipe_cli_schedule.csv";
  const Result csv =
      runTpipe("schedule --stages 2 --micro-batches 4 --schedule zb-h2 --csv");
  ASSERT_EQ(csv.status, 0) << csv.output;
  EXPECT_EQ(csv.output.rfind("0F0,", 0), 0u) << csv.output;
  std::ofstream(file) << csv.output;
  const Result train = runTpipe(
      "train " + root +
      "/configs/mlp_synthetic.json --set train.steps=3 --set pipeline.schedule=" +
      file);
  EXPECT_EQ(train.status, 0) << train.output;
  EXPECT_NE(train.output.find("done: 3 steps"), std::string::npos)
      << train.output;
}

// pipeline.schedule "auto": the first steps measure the stages, the rest
// run the schedule built from them, and training is unchanged by it.
TEST(CliTest, AnAutoScheduleIsBuiltFromTheFirstStepsAndTrainsTheSame) {
  const std::string root = TPIPE_SOURCE_DIR;
  std::vector<std::vector<double>> losses;
  for (const char* schedule : {"auto", "1f1b"}) {
    const std::string metrics =
        testing::TempDir() + "/tpipe_cli_auto_" + schedule + ".jsonl";
    const Result r = runTpipe(
        "train " + root +
        "/configs/mlp_synthetic.json --set train.steps=12 --set pipeline.schedule=" +
        schedule + " --metrics " + metrics);
    ASSERT_EQ(r.status, 0) << r.output;
    if (std::string(schedule) == "auto") {
      EXPECT_NE(
          r.output.find("schedule auto: built from the measured stage times"),
          std::string::npos)
          << r.output;
    }
    std::ifstream in(metrics);
    std::string line;
    losses.emplace_back();
    while (std::getline(in, line)) {
      const auto record = nlohmann::json::parse(line);
      if (record.contains("loss"))
        losses.back().push_back(record["loss"].get<double>());
    }
  }
  ASSERT_EQ(losses[0].size(), 12u);
  ASSERT_EQ(losses[1].size(), 12u);
  for (size_t i = 0; i < 12; ++i)
    EXPECT_NEAR(losses[0][i], losses[1][i], 1e-6) << "step " << i + 1;
}

// A user error exits 2 from every command, whichever layer finds it.
TEST(CliTest, ABadScheduleFileExitsTwoFromTrainAndValidate) {
  const std::string root = TPIPE_SOURCE_DIR;
  const std::string file = testing::TempDir() + "/tpipe_cli_bad_schedule.json";
  std::ofstream(file) << "{\"ranks\": 2, \"stages\": [[]]}";
  for (const char* command : {"train", "validate", "plan"}) {
    const Result r = runTpipe(
        std::string(command) + " " + root +
        "/configs/mlp_synthetic.json --set pipeline.schedule=" + file);
    EXPECT_EQ(r.status, 2) << command << ": " << r.output;
    EXPECT_NE(r.output.find("schedule file " + file), std::string::npos)
        << command << ": " << r.output;
  }
}

} // namespace

namespace {

std::string firstLineWith(const std::string& text, const std::string& prefix) {
  size_t at = text.find(prefix);
  if (at == std::string::npos)
    return "";
  return text.substr(at, text.find('\n', at) - at);
}

// "pipeline: 4 stages on cpu:0 ..., boundaries 0 3 7 11 15, 4 micro-batches"
std::vector<int> trainBoundaries(const std::string& output) {
  const std::string line = firstLineWith(output, "pipeline: ");
  const size_t at = line.find("boundaries ");
  std::vector<int> boundaries;
  if (at == std::string::npos)
    return boundaries;
  std::string rest = line.substr(at + 11, line.find(',', at) - at - 11);
  size_t position = 0;
  while (position < rest.size()) {
    size_t used = 0;
    boundaries.push_back(std::stoi(rest.substr(position), &used));
    position += used;
  }
  return boundaries;
}

// `plan --json` and `train` read one saved profile and show and run one plan.
TEST(CliTest, PlanAndTrainRunTheSamePlanFromOneProfile) {
  const std::string root = TPIPE_SOURCE_DIR;
  const std::string profile = testing::TempDir() + "/tpipe_cli_profile.json";
  for (const char* name :
       {"mlp_synthetic", "beyond_one_device", "char_transformer"}) {
    SCOPED_TRACE(name);
    const std::string config = root + "/configs/" + name + ".json";
    const Result profiled = runTpipe("profile " + config + " --out " + profile);
    ASSERT_EQ(profiled.status, 0) << profiled.output;
    std::vector<std::vector<int>> seen;
    for (int run = 0; run < 2; ++run) {
      const Result plan =
          runTpipe("plan " + config + " --profile " + profile + " --json");
      ASSERT_EQ(plan.status, 0) << plan.output;
      const auto json = nlohmann::json::parse(plan.output);
      seen.push_back(json["boundaries"].get<std::vector<int>>());
      EXPECT_EQ(json["stage_count"].get<size_t>() + 1, seen.back().size());
      EXPECT_NE(
          json["cost_source"].get<std::string>().find(profile),
          std::string::npos);
    }
    for (int run = 0; run < 2; ++run) {
      const Result train = runTpipe(
          "train " + config + " --profile " + profile +
          " --set train.steps=1 --set train.eval_every=0");
      ASSERT_EQ(train.status, 0) << train.output;
      seen.push_back(trainBoundaries(train.output));
      EXPECT_NE(
          firstLineWith(train.output, "plan: ").find("costs from " + profile),
          std::string::npos)
          << train.output;
    }
    for (const auto& boundaries : seen)
      EXPECT_EQ(boundaries, seen.front());
  }
}

// The default job tunes itself while training: `plan` cannot show a fixed
// plan for it, and says where the plan comes from instead.
TEST(CliTest, PlanOfATunedConfigPointsToTune) {
  const Result plan = runTpipe(
      "plan " + std::string(TPIPE_SOURCE_DIR) +
      "/configs/fashion_mnist_cnn.json");
  EXPECT_EQ(plan.status, 2) << plan.output;
  EXPECT_NE(plan.output.find("tpipe tune CONFIG"), std::string::npos)
      << plan.output;
}

TEST(CliTest, AProfileOfAnotherModelIsAClearError) {
  const std::string root = TPIPE_SOURCE_DIR;
  const std::string profile =
      testing::TempDir() + "/tpipe_cli_other_profile.json";
  ASSERT_EQ(
      runTpipe(
          "profile " + root + "/configs/mlp_synthetic.json --out " + profile)
          .status,
      0);
  const Result r = runTpipe(
      "train " + root + "/configs/beyond_one_device.json --profile " + profile);
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(
      r.output.find("holds 5 layers, the config's model 15"), std::string::npos)
      << r.output;
}

} // namespace
