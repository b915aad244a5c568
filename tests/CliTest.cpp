// Runs the tpipe binary as a user would.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <string>
#include <sys/wait.h>

namespace {

struct Result {
  int status;
  std::string output;  // stdout and stderr
};

Result runTpipe(const std::string& arguments) {
  const char* binary = std::getenv("TPIPE_BINARY");
  EXPECT_NE(binary, nullptr) << "TPIPE_BINARY is not set (run through ctest)";
  if (binary == nullptr) return {-1, ""};
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
  const Result r = runTpipe("schedule --stages 2 --micro-batches 3 --schedule 1f1b --checkpoint never --json");
  ASSERT_EQ(r.status, 0) << r.output;
  const auto json = nlohmann::json::parse(r.output);
  ASSERT_EQ(json["stages"].size(), 2u);
  EXPECT_EQ(json["stages"][1][0]["op"], "recv_activation");
  EXPECT_EQ(json["stages"][1][1]["op"], "forward");
  EXPECT_EQ(json["stages"][1][1]["micro_batch"], 0);
  EXPECT_NEAR(json["simulation"]["bubble_fraction"].get<double>(), 0.25, 1e-12);
}

TEST(CliTest, ScheduleTableAndTimeline) {
  const Result r = runTpipe("schedule --stages 4 --micro-batches 8 --schedule zb-h1 --checkpoint never");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("rank 0: F0 F1 F2 F3 b0 w0"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("timeline"), std::string::npos);
}

TEST(CliTest, BadScheduleExitsWithStatusTwo) {
  const Result r = runTpipe("schedule --stages 2 --micro-batches 3 --schedule nope");
  EXPECT_EQ(r.status, 2);
  EXPECT_NE(r.output.find("unknown schedule 'nope'"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos);
}

}  // namespace
