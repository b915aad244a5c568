// Real processes over loopback: tpipe launch, and ranks started by hand.
#include <gtest/gtest.h>

#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <sys/wait.h>
#include <utility>
#include <vector>

#include "runtime/network.h"

namespace {

namespace fs = std::filesystem;

struct Result {
  int status;
  std::string output;
  double seconds;
};

Result shell(const std::string& command) {
  const auto start = std::chrono::steady_clock::now();
  FILE* pipe = popen((command + " 2>&1").c_str(), "r");
  std::string output;
  std::array<char, 4096> buffer{};
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0)
    output.append(buffer.data(), n);
  const int status = pclose(pipe);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, output, seconds};
}

std::string binary() {
  const char* path = std::getenv("TPIPE_BINARY");
  return path ? path : "tpipe";
}

// The binary itself, where binary() may be the fork server's client
// (tests/support/with_fork_server.sh): for a command the test stops,
// resumes or runs in the background, whose pid must be tpipe's.
std::string binaryProcess() {
  const char* path = std::getenv("TPIPE_PROCESS_BINARY");
  return path ? path : binary();
}

// The same commands with the tests' fault hook (TPIPE_FAULT).
std::string faultyBinary() {
  const char* path = std::getenv("TPIPE_FAULTY_BINARY");
  return path ? path : "tpipe_faulty";
}

class DistributedTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_NE(std::getenv("TPIPE_BINARY"), nullptr) << "run through ctest";
    dir_ = fs::temp_directory_path() /
        ("tpipe-dist-" + std::to_string(::getpid()) + "-" +
         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    config_ = (dir_ / "config.json").string();
    std::ofstream(config_) << R"({
      "model": {"input_shape": [24], "layers": [
        {"type": "linear", "out_features": 32}, {"type": "tanh"},
        {"type": "linear", "out_features": 32}, {"type": "relu"},
        {"type": "linear", "out_features": 5}]},
      "data": {"dataset": "synthetic", "samples": 512},
      "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 4, "schedule": "1f1b"},
      "train": {"batch_size": 32, "steps": 12, "seed": 4,
                "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9}}
    })";
  }
  void TearDown() override {
    fs::remove_all(dir_);
  }

  std::string path(const std::string& name) const {
    return (dir_ / name).string();
  }

  // The one-process run of this test's config (plus `settings`) that the
  // process runs are compared with; its exit status.
  int trainThreaded(const std::string& settings, const std::string& metrics)
      const {
    return shell(
               binary() + " train " + config_ + settings + " --metrics " +
               path(metrics))
        .status;
  }

  static std::vector<double> losses(const std::string& file) {
    std::vector<double> values;
    std::ifstream in(file);
    std::string line;
    while (std::getline(in, line)) {
      const auto record = nlohmann::json::parse(line);
      if (record.contains("loss")) {
        values.push_back(
            record["loss"].is_null() // JSON has no NaN
                ? std::numeric_limits<double>::quiet_NaN()
                : record["loss"].get<double>());
      }
    }
    return values;
  }

  // The run's last evaluation loss; NaN when it has none.
  static double evalLoss(const std::string& file) {
    double value = std::numeric_limits<double>::quiet_NaN();
    std::ifstream in(file);
    std::string line;
    while (std::getline(in, line)) {
      const auto record = nlohmann::json::parse(line);
      if (record.contains("eval_loss") && record["eval_loss"].is_number())
        value = record["eval_loss"].get<double>();
    }
    return value;
  }

  // Each pair of saved state dicts holds the same keys and equal tensors,
  // bit for bit, as Python's torch reads them: one interpreter for all the
  // pairs (each start imports torch, about 2 s here).
  static void expectEqualStateDicts(
      const std::vector<std::pair<std::string, std::string>>& pairs) {
    std::string list;
    for (const auto& [a, b] : pairs)
      list += "('" + a + "', '" + b + "'), ";
    const std::string check =
        "/usr/bin/python3 -c \"import torch\n"
        "for p, q in [" +
        list +
        "]:\n"
        "    a, b = torch.load(p), torch.load(q)\n"
        "    assert a.keys() == b.keys(), (p, q)\n"
        "    assert all(torch.equal(a[k], b[k]) for k in a), (p, q)\"";
    EXPECT_EQ(std::system(check.c_str()), 0) << check;
  }

  static void expectSameLosses(
      const std::vector<double>& a,
      const std::vector<double>& b,
      double tolerance) {
    ASSERT_EQ(a.size(), b.size());
    ASSERT_FALSE(a.empty());
    for (size_t i = 0; i < a.size(); ++i)
      EXPECT_NEAR(a[i], b[i], tolerance) << "step " << i + 1;
  }

  // No process of this test may outlive it. A peer started in the
  // background may still be on its way out (a busy machine): wait for it,
  // bounded, rather than sample once.
  void expectNoOrphans() const {
    // A rank runs as `tpipe train CONFIG`, or forked from the launcher,
    // as `tpipe launch ... CONFIG`: "[t]rain" and "[l]aunch" match them but
    // not this pgrep's own shell. A command run in the fork server's fork,
    // and the ranks its launcher forks, carry the server's command line
    // instead: any of them but the server itself is left behind.
    std::string pattern = "[t]rain " + config_ + "|[l]aunch .*" + config_;
    std::string server;
    if (const char* pid = std::getenv("TPIPE_FORK_SERVER_PID");
        pid != nullptr && *pid != '\0') {
      pattern +=
          "|[f]ork-server " + std::string(std::getenv("TPIPE_FORK_SOCKET"));
      server = " | grep -vx " + std::string(pid);
    }
    Result r;
    for (int attempt = 0; attempt < 100; ++attempt) {
      r = shell("pgrep -f '" + pattern + "'" + server + " || true");
      if (r.output.empty())
        return;
      ::usleep(100 * 1000);
    }
    EXPECT_EQ(r.output, "") << "left behind after 10 s: " << r.output;
  }

  // A job killed at step 25 and resumed from step 20's checkpoint drops
  // the records rank 0 wrote after step 20 and redoes as many steps: 5
  // with a barrier between steps, 4 when steps are posted ahead (rank 0's
  // part of step 25 meets the lost rank before step 24's decision is in).
  static void expectRedoneAsDropped(const std::string& output) {
    const std::string dropped = "--metrics: dropped ";
    const size_t at = output.find(dropped);
    ASSERT_NE(at, std::string::npos) << output;
    const int records = std::atoi(output.c_str() + at + dropped.size());
    EXPECT_TRUE(records == 4 || records == 5) << output;
    EXPECT_NE(
        output.find(
            "dropped " + std::to_string(records) + " record(s) after step 20"),
        std::string::npos)
        << output;
    EXPECT_NE(
        output.find(
            std::to_string(records) + " step(s) redone after the last failure"),
        std::string::npos)
        << output;
  }

  fs::path dir_;
  std::string config_;
};

TEST_F(DistributedTest, TwoAndFourProcessesMatchTheThreadedRun) {
  const std::string four =
      " --set 'pipeline.devices=[\"cpu:0\",\"cpu:1\",\"cpu:2\",\"cpu:3\"]'";
  ASSERT_EQ(trainThreaded("", "threaded.jsonl"), 0);
  const Result two = shell(
      binary() + " launch --nproc 2 " + config_ + " --metrics " +
      path("two.jsonl"));
  ASSERT_EQ(two.status, 0) << two.output;
  EXPECT_NE(
      two.output.find(
          "[rank 0] processes: 2 (1 replica(s) x 2 pipeline ranks)"),
      std::string::npos)
      << two.output;
  expectSameLosses(
      losses(path("threaded.jsonl")), losses(path("two.jsonl")), 1e-7);

  ASSERT_EQ(trainThreaded(four, "threaded4.jsonl"), 0);
  const Result r4 = shell(
      binary() + " launch --nproc 4 " + config_ + four + " --metrics " +
      path("four.jsonl"));
  ASSERT_EQ(r4.status, 0) << r4.output;
  expectSameLosses(
      losses(path("threaded4.jsonl")), losses(path("four.jsonl")), 1e-7);
  expectNoOrphans();
}

// Ranks of one host talk over Unix sockets (transfers and the per-step
// sums), others over Gloo: TPIPE_P2P=gloo forces Gloo, and both give the
// threaded run's losses, with replicas (whose sums add four ranks) too.
TEST_F(DistributedTest, SocketsAndGlooCarryTheSameRun) {
  const std::string replicas = " --set pipeline.data_parallel=2";
  for (const std::string& settings : {std::string(), replicas}) {
    const std::string nproc = settings.empty() ? "2" : "4";
    ASSERT_EQ(
        trainThreaded("", "threaded.jsonl"), 0); // replicas need processes
    const Result sockets = shell(
        binary() + " launch --nproc " + nproc + " " + config_ + settings +
        " --metrics " + path("sockets.jsonl"));
    ASSERT_EQ(sockets.status, 0) << sockets.output;
    EXPECT_NE(
        sockets.output.find(
            "[rank 0] processes: " + nproc + " (" +
            (settings.empty() ? "1" : "2") +
            " replica(s) x 2 pipeline ranks), rendezvous over tpipe's store + "
            "Gloo, transfers over Unix sockets to rank(s) 1 (this host)"),
        std::string::npos)
        << sockets.output;
    const Result gloo = shell(
        "TPIPE_P2P=gloo " + binary() + " launch --nproc " + nproc + " " +
        config_ + settings + " --metrics " + path("gloo.jsonl"));
    ASSERT_EQ(gloo.status, 0) << gloo.output;
    EXPECT_NE(
        gloo.output.find(
            "transfers over Gloo through host memory to rank(s) 1\n"),
        std::string::npos)
        << gloo.output;
    // Replicas add their losses in another order than one process does.
    const double tolerance = settings.empty() ? 1e-7 : 1e-5;
    const auto bySockets = losses(path("sockets.jsonl"));
    expectSameLosses(losses(path("threaded.jsonl")), bySockets, tolerance);
    expectSameLosses(bySockets, losses(path("gloo.jsonl")), 1e-12);
  }
  expectNoOrphans();
}

// Steps without a barrier across processes: each rank updates after its
// own part and the ranks agree through notes. With a clip that binds on
// some steps (speculative updates undone, the step after run again),
// batch norm and dropout on the ranks (restored for the rerun) and Adam,
// the run equals the run with a barrier bit for bit: losses and saved
// parameters, over Unix sockets and over Gloo, on 2 and 4 processes, and
// with data-parallel replicas.
TEST_F(DistributedTest, PostedStepsAcrossProcessesEqualStepsWithABarrier) {
  const std::string normed = path("normed.json");
  std::ofstream(normed) << R"({
    "model": {"input_shape": [2, 6, 6], "layers": [
      {"type": "conv2d", "out_channels": 4, "kernel_size": 3, "padding": 1},
      {"type": "batchnorm2d"}, {"type": "relu"}, {"type": "dropout", "p": 0.2},
      {"type": "flatten"}, {"type": "linear", "out_features": 16},
      {"type": "tanh"}, {"type": "dropout", "p": 0.1},
      {"type": "linear", "out_features": 5}]},
    "data": {"dataset": "synthetic", "samples": 512},
    "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 4,
                 "schedule": "zb-h2", "balance": [4, 5]},
    "train": {"batch_size": 32, "steps": 30, "seed": 4, "clip_grad_norm": 1.0,
              "optimizer": {"type": "adam", "lr": 0.01}}
  })";
  auto launch = [&](const std::string& env,
                    const std::string& nproc,
                    const std::string& job,
                    const std::string& name) {
    const Result r = shell(
        env + binary() + " launch --nproc " + nproc + " " + job + " --save " +
        path(name) + " --metrics " + path(name + ".jsonl"));
    EXPECT_EQ(r.status, 0) << r.output;
    return r.output;
  };
  const std::string barrier = " --set pipeline.overlap_steps=false";
  const std::string posted = launch("", "2", normed, "posted");
  EXPECT_NE(
      posted.find("[rank 0] steps: without a barrier between them"),
      std::string::npos)
      << posted;
  EXPECT_NE(
      posted.find("step(s) run again after a wrong speculative update"),
      std::string::npos)
      << posted;
  const std::string withBarrier = launch("", "2", normed + barrier, "barrier");
  EXPECT_EQ(withBarrier.find("steps: without a barrier"), std::string::npos);
  launch("TPIPE_P2P=gloo ", "2", normed, "gloo");
  expectSameLosses(
      losses(path("barrier.jsonl")), losses(path("posted.jsonl")), 0.0);
  expectSameLosses(
      losses(path("barrier.jsonl")), losses(path("gloo.jsonl")), 0.0);
  std::vector<std::pair<std::string, std::string>> saved;
  for (const std::string run : {"posted", "gloo"}) {
    for (const std::string rank : {"rank-0", "rank-1"}) {
      saved.emplace_back(
          path(run + "/" + rank + "/model.pt"),
          path("barrier/" + rank + "/model.pt"));
    }
  }
  expectEqualStateDicts(saved);
  const std::string four = config_ +
      " --set 'pipeline.devices=[\"cpu:0\",\"cpu:1\",\"cpu:2\",\"cpu:3\"]'"
      " --set pipeline.schedule=zb-h2 --set pipeline.micro_batches=8"
      " --set train.clip_grad_norm=0.8 --set train.on_nonfinite=skip"
      " --set train.steps=30";
  launch("", "4", four, "four-posted");
  launch("", "4", four + barrier, "four-barrier");
  expectSameLosses(
      losses(path("four-barrier.jsonl")),
      losses(path("four-posted.jsonl")),
      0.0);
  // 2 replicas x 2 ranks: each stage's gradients averaged across the
  // replicas before its update, the losses and norms summed over all four.
  const std::string replicas = normed + " --set pipeline.data_parallel=2";
  launch("", "4", replicas, "dp-posted");
  launch("", "4", replicas + barrier, "dp-barrier");
  expectSameLosses(
      losses(path("dp-barrier.jsonl")), losses(path("dp-posted.jsonl")), 0.0);
  expectNoOrphans();
}

// ZB-V and DualPipeV place two stages on each rank in a V: the transport
// follows the placement (and DualPipeV's overlapped pairs), and the losses
// equal the threaded run's. DualPipe lays its two chains on the same V:
// each process holds a stage and the copy of another, their gradients
// summed across the processes, its losses ending on both.
TEST_F(DistributedTest, AVShapedScheduleMatchesTheThreadedRun) {
  for (const std::string schedule : {"zb-v", "dualpipev", "dualpipe"}) {
    const std::string v = " --set pipeline.schedule=" + schedule;
    ASSERT_EQ(trainThreaded(v, schedule + "-threaded.jsonl"), 0);
    const Result r = shell(
        binary() + " launch --nproc 2 " + config_ + v + " --metrics " +
        path(schedule + "-two.jsonl"));
    ASSERT_EQ(r.status, 0) << r.output;
    EXPECT_NE(
        r.output.find("4 stages on cpu:0 cpu:1 cpu:1 cpu:0"), std::string::npos)
        << r.output;
    expectSameLosses(
        losses(path(schedule + "-threaded.jsonl")),
        losses(path(schedule + "-two.jsonl")),
        1e-7);
    // Without a barrier between steps: dualpipe's losses end on both
    // processes and are told per micro-batch, and each parameter's sum with
    // its copy goes between the two holders.
    EXPECT_NE(
        r.output.find("[rank 0] steps: without a barrier between them"),
        std::string::npos)
        << r.output;
    ASSERT_EQ(
        shell(
            binary() + " launch --nproc 2 " + config_ + v +
            " --set pipeline.overlap_steps=false --metrics " +
            path(schedule + "-barrier.jsonl"))
            .status,
        0);
    expectSameLosses(
        losses(path(schedule + "-barrier.jsonl")),
        losses(path(schedule + "-two.jsonl")),
        0.0);
    // Evaluation forwards through the processes too (dualpipe's first chain).
    EXPECT_NEAR(
        evalLoss(path(schedule + "-threaded.jsonl")),
        evalLoss(path(schedule + "-two.jsonl")),
        1e-6);
  }
  expectNoOrphans();
}

TEST_F(
    DistributedTest,
    DataParallelTimesPipelineMatchesOneProcessOverTheGlobalBatch) {
  ASSERT_EQ(trainThreaded("", "threaded.jsonl"), 0);
  const Result r = shell(
      binary() + " launch --nproc 4 " + config_ +
      " --set pipeline.data_parallel=2 --metrics " + path("dp.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("2 replica(s) x 2 pipeline ranks"), std::string::npos)
      << r.output;
  expectSameLosses(
      losses(path("threaded.jsonl")), losses(path("dp.jsonl")), 1e-5);
  // Without the processes the replicas need, a clear error.
  const Result alone =
      shell(binary() + " train " + config_ + " --set pipeline.data_parallel=2");
  EXPECT_EQ(alone.status, 2);
  EXPECT_NE(
      alone.output.find(
          "need 4 processes; start them with `tpipe launch --nproc 4`"),
      std::string::npos)
      << alone.output;
}

// Each stage's gradients start their all-reduce when its last weight pass
// ends (zb-v: two stages per rank, split backward); the result is the one
// reduced after the step, bit for bit, and the one-process run's.
TEST_F(DistributedTest, GradientSyncOverlappedWithTheBackwardChangesNoResult) {
  const std::string v = " --set pipeline.schedule=zb-v";
  ASSERT_EQ(trainThreaded(v, "threaded.jsonl"), 0);
  const std::string dp = " --set pipeline.data_parallel=2";
  const Result overlapped = shell(
      binary() + " launch --nproc 4 " + config_ + v + dp + " --metrics " +
      path("overlapped.jsonl"));
  ASSERT_EQ(overlapped.status, 0) << overlapped.output;
  const Result after = shell(
      binary() + " launch --nproc 4 " + config_ + v + dp +
      " --set pipeline.overlap_grad_sync=false --metrics " +
      path("after.jsonl"));
  ASSERT_EQ(after.status, 0) << after.output;
  expectSameLosses(
      losses(path("overlapped.jsonl")), losses(path("after.jsonl")), 0.0);
  expectSameLosses(
      losses(path("threaded.jsonl")), losses(path("overlapped.jsonl")), 1e-5);
  expectNoOrphans();
}

// A NaN in one batch (rank 0's input at step 3): "skip" skips that update on
// every stage and process alike, so the run goes on exactly as the threaded
// one does; "stop" ends every rank naming the step.
TEST_F(DistributedTest, ANonFiniteStepIsSkippedOrStopsOnEveryRankAlike) {
  const std::string fault = "TPIPE_FAULT=0:3:nan ";
  const std::string skip = " --set train.on_nonfinite=skip";
  const Result threaded = shell(
      fault + faultyBinary() + " train " + config_ + skip + " --metrics " +
      path("threaded.jsonl"));
  ASSERT_EQ(threaded.status, 0) << threaded.output;
  EXPECT_NE(
      threaded.output.find(
          "step 4: the loss became NaN; its update is skipped on every stage"),
      std::string::npos)
      << threaded.output;
  const Result processes = shell(
      fault + faultyBinary() + " launch --nproc 2 " + config_ + skip +
      " --metrics " + path("processes.jsonl"));
  ASSERT_EQ(processes.status, 0) << processes.output;
  EXPECT_NE(
      processes.output.find("[rank 0] step 4: the loss became NaN"),
      std::string::npos)
      << processes.output;
  auto withoutStep4 = [](std::vector<double> losses) {
    EXPECT_TRUE(std::isnan(losses.at(3)));
    losses.erase(losses.begin() + 3);
    return losses;
  };
  expectSameLosses(
      withoutStep4(losses(path("threaded.jsonl"))),
      withoutStep4(losses(path("processes.jsonl"))),
      1e-6);
  const Result stopped =
      shell(fault + faultyBinary() + " launch --nproc 2 " + config_);
  EXPECT_EQ(stopped.status, 1) << stopped.output;
  EXPECT_NE(
      stopped.output.find("the loss became NaN at step 4"), std::string::npos)
      << stopped.output;
  expectNoOrphans();
}

// The clipping norm is one norm over every stage and rank, each replica's
// (equal, averaged) gradients counted once: clipped runs match.
TEST_F(DistributedTest, GradientClippingMatchesAcrossProcessesAndReplicas) {
  const std::string clip = " --set train.clip_grad_norm=0.05";
  ASSERT_EQ(trainThreaded(clip, "threaded.jsonl"), 0);
  const Result r = shell(
      binary() + " launch --nproc 4 " + config_ + clip +
      " --set pipeline.data_parallel=2 --metrics " + path("dp.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  // One replica: the norm rides with the step's loss sum.
  const Result two = shell(
      binary() + " launch --nproc 2 " + config_ + clip + " --metrics " +
      path("two.jsonl"));
  ASSERT_EQ(two.status, 0) << two.output;
  expectSameLosses(
      losses(path("threaded.jsonl")), losses(path("two.jsonl")), 1e-6);
  const Result unclipped = shell(
      binary() + " train " + config_ + " --metrics " + path("plain.jsonl"));
  ASSERT_EQ(unclipped.status, 0) << unclipped.output;
  expectSameLosses(
      losses(path("threaded.jsonl")), losses(path("dp.jsonl")), 1e-5);
  // And the clip did something.
  EXPECT_NE(
      losses(path("threaded.jsonl")).back(),
      losses(path("plain.jsonl")).back());
}

// A head tied to the embedding on another process: its gradient is summed
// across the processes (and replicas), the losses are the threaded run's,
// and each process's copy is the other's bit for bit after training. Steps
// without a barrier exchange the two copies' sums between their holders
// instead of a collective: the same losses and parameters, bit for bit.
TEST_F(DistributedTest, TiedWeightsStayEqualAcrossProcesses) {
  const std::string tied = path("tied.json");
  std::ofstream(tied) << R"({
    "model": {"input_shape": [8], "layers": [
      {"type": "embedding", "num_embeddings": 256, "embedding_dim": 16},
      {"type": "position_embedding"},
      {"type": "layernorm"},
      {"type": "linear", "out_features": 256, "bias": false, "tied_to": 0}]},
    "data": {"dataset": "text", "path": "/usr/share/common-licenses/GPL-3", "seq_len": 8},
    "pipeline": {"devices": ["cpu:0", "cpu:1"], "micro_batches": 2, "balance": [2, 2]},
    "train": {"batch_size": 8, "steps": 6, "seed": 1, "clip_grad_norm": 0.5,
              "optimizer": {"type": "adam", "lr": 0.01}}
  })";
  ASSERT_EQ(
      shell(
          binary() + " train " + tied + " --metrics " + path("threaded.jsonl"))
          .status,
      0);
  const Result r = shell(
      binary() + " launch --nproc 2 " + tied + " --save " + path("ckpt") +
      " --metrics " + path("two.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(
      r.output.find("[rank 0] steps: without a barrier between them"),
      std::string::npos)
      << r.output;
  expectSameLosses(
      losses(path("threaded.jsonl")), losses(path("two.jsonl")), 1e-5);
  const Result barrier = shell(
      binary() + " launch --nproc 2 " + tied +
      " --set pipeline.overlap_steps=false --save " + path("barrier") +
      " --metrics " + path("barrier.jsonl"));
  ASSERT_EQ(barrier.status, 0) << barrier.output;
  expectSameLosses(
      losses(path("barrier.jsonl")), losses(path("two.jsonl")), 0.0);
  expectEqualStateDicts(
      {{path("ckpt/rank-0/model.pt"), path("barrier/rank-0/model.pt")},
       {path("ckpt/rank-1/model.pt"), path("barrier/rank-1/model.pt")}});
  const Result dp = shell(
      binary() + " launch --nproc 4 " + tied +
      " --set pipeline.data_parallel=2 --metrics " + path("dp.jsonl"));
  ASSERT_EQ(dp.status, 0) << dp.output;
  expectSameLosses(
      losses(path("threaded.jsonl")), losses(path("dp.jsonl")), 1e-5);
  const std::string check =
      "/usr/bin/python3 -c \"import torch; "
      "a = torch.load('" +
      path("ckpt/rank-0/model.pt") +
      "')['0.weight']; "
      "b = torch.load('" +
      path("ckpt/rank-1/model.pt") +
      "')['3.weight']; "
      "assert torch.equal(a, b), (a - b).abs().max()\"";
  EXPECT_EQ(std::system(check.c_str()), 0) << check;
  expectNoOrphans();
}

// Skips across processes: "a" passes a whole stage by, "b" is a residual
// into the next stage, "c" a concat two stages on. Each transfer carries the
// activation and the skips crossing its boundary, with known shapes (one
// message per tensor) and, under bf16 autocast, with headers.
TEST_F(DistributedTest, SkipConnectionsCrossProcessesAsInOne) {
  const std::string skips = path("skips.json");
  std::ofstream(skips) << R"({
    "model": {"input_shape": [24], "layers": [
      {"type": "linear", "out_features": 16, "stash": ["a", "c"]},
      {"type": "tanh", "stash": "b"},
      {"type": "linear", "out_features": 16, "pop": "b"},
      {"type": "relu"},
      {"type": "linear", "out_features": 16},
      {"type": "tanh", "pop": "a"},
      {"type": "linear", "out_features": 16, "pop": "c", "merge": "concat"},
      {"type": "linear", "out_features": 5}]},
    "data": {"dataset": "synthetic", "samples": 256},
    "pipeline": {"devices": ["cpu:0", "cpu:1", "cpu:2", "cpu:3"], "micro_batches": 4,
                 "schedule": "1f1b", "balance": [2, 2, 2, 2]},
    "train": {"batch_size": 16, "steps": 6, "seed": 2, "eval_every": 3,
              "optimizer": {"type": "sgd", "lr": 0.1, "momentum": 0.9}}
  })";
  // Evaluation runs the inference pass across the processes too.
  auto evalLosses = [](const std::string& file) {
    std::vector<double> values;
    std::ifstream in(file);
    std::string line;
    while (std::getline(in, line)) {
      const auto record = nlohmann::json::parse(line);
      if (record.contains("eval_loss"))
        values.push_back(record["eval_loss"].get<double>());
    }
    return values;
  };
  for (const std::string precision : {"fp32", "bf16"}) {
    SCOPED_TRACE(precision);
    const std::string set = " --set train.precision=" + precision;
    ASSERT_EQ(
        shell(
            binary() + " train " + skips + set + " --metrics " +
            path("threaded-" + precision + ".jsonl"))
            .status,
        0);
    const Result r = shell(
        binary() + " launch --nproc 4 " + skips + set + " --metrics " +
        path("four-" + precision + ".jsonl"));
    ASSERT_EQ(r.status, 0) << r.output;
    expectSameLosses(
        losses(path("threaded-" + precision + ".jsonl")),
        losses(path("four-" + precision + ".jsonl")),
        1e-6);
    expectSameLosses(
        evalLosses(path("threaded-" + precision + ".jsonl")),
        evalLosses(path("four-" + precision + ".jsonl")),
        1e-6);
  }
  expectNoOrphans();
}

// A peer that exits mid-step is named by the survivor, which exits at once
// instead of waiting out the timeout.
TEST_F(DistributedTest, ADeadRankIsNamedAtOnceWithoutALauncher) {
  // Rank 1 dies; then rank 0, whose process holds the rendezvous store, so
  // that rank 1's account can reach no one and only its own view remains.
  for (const int dying : {1, 0}) {
    const int survivor = 1 - dying;
    const int port = tpipe::runtime::freeLoopbackPort();
    ASSERT_GT(port, 0);
    const std::string env =
        "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
        " WORLD_SIZE=2 ";
    const std::string timeout = " --set pipeline.timeout_s=30";
    const std::string dead = std::to_string(dying);
    const Result r = shell(
        "(" + env + "RANK=" + dead + " TPIPE_FAULT=" + dead + ":3:exit " +
        faultyBinary() + " train " + config_ + timeout + " > " +
        path("rank" + dead + ".log") + " 2>&1 &) ; " + env +
        "RANK=" + std::to_string(survivor) + " " + binary() + " train " +
        config_ + timeout);
    EXPECT_EQ(r.status, 1) << r.output;
    EXPECT_NE(
        r.output.find(
            "lost rank " + dead + " (pipeline rank " + dead + ", replica 0)"),
        std::string::npos)
        << r.output;
    // Its closed connection says the process ended: the account it will
    // never send is not waited for.
    EXPECT_NE(
        r.output.find(
            "lost: rank(s) " + dead +
            " ended (their connections closed) without an account"),
        std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("sent no account"), std::string::npos) << r.output;
    EXPECT_LT(r.seconds, 20.0)
        << "a dead peer must be noticed long before the 30 s timeout";
  }
  expectNoOrphans();
}

// A rank stopped (SIGSTOP) until the others gave up on it and ended, rank 0
// with the rendezvous store, wakes to find no store: it cannot know whether
// rank 0 sent an account, and says so instead of "sent no account".
TEST_F(DistributedTest, ARankWokenAfterTheStoresHostEndedSaysTheStoreIsGone) {
  const int port = tpipe::runtime::freeLoopbackPort();
  ASSERT_GT(port, 0);
  const std::string env =
      "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
      " WORLD_SIZE=3 ";
  const std::string job = " train " + config_ +
      " --set 'pipeline.devices=[\"cpu:0\",\"cpu:1\",\"cpu:2\"]'"
      " --set pipeline.timeout_s=2";
  const Result r = shell(
      env + "RANK=1 TPIPE_FAULT=1:3:stop " + faultyBinary() + job + " > " +
      path("woken.log") + " 2>&1 & stopped=$!; " + env + "RANK=2 " +
      binaryProcess() + job + " > " + path("rank2.log") + " 2>&1 & other=$!; " +
      env + "RANK=0 " + binary() + job + " > " + path("rank0.log") +
      " 2>&1; wait $other; kill -CONT $stopped; wait $stopped; echo woken $?");
  EXPECT_NE(r.output.find("woken 1"), std::string::npos) << r.output;
  std::ifstream in(path("woken.log"));
  const std::string woken(
      (std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(woken.find("sent no account"), std::string::npos) << woken;
  // Rank 0 is either seen to close (its process ended) or, not seen, its
  // account is unknown because the store went with it.
  const bool storeGone =
      woken.find(
          "lost: rank(s) 0: no account could be read, the store "
          "stopped answering (rendezvous store at 127.0.0.1:") !=
      std::string::npos;
  const bool seenEnded = woken.find("lost: rank(s) 0") != std::string::npos &&
      woken.find("ended (their connections closed)") != std::string::npos;
  EXPECT_TRUE(storeGone || seenEnded) << woken;
  expectNoOrphans();
}

TEST_F(DistributedTest, AHungRankTimesOutAndTheLauncherEndsIt) {
  const Result r = shell(
      "TPIPE_FAULT=1:3:hang " + faultyBinary() + " launch --nproc 2 " +
      config_ + " --set pipeline.timeout_s=2");
  EXPECT_NE(r.status, 0);
  EXPECT_NE(
      r.output.find("lost rank 1 (pipeline rank 1, replica 0)"),
      std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("no answer within 2 s"), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("ending the other ranks"), std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 30.0);
  expectNoOrphans();
}

// Every live rank says what it was doing when a peer froze (SIGSTOP), and
// all of them name the rank that never answered.
TEST_F(DistributedTest, AStoppedRankIsNamedByEveryLiveRank) {
  const Result r = shell(
      "TPIPE_FAULT=1:3:stop " + faultyBinary() + " launch --nproc 3 " +
      config_ +
      " --set 'pipeline.devices=[\"cpu:0\",\"cpu:1\",\"cpu:2\"]'"
      " --set pipeline.timeout_s=2");
  EXPECT_NE(r.status, 0);
  // Each live rank's account: printed by itself, and by the others. The
  // launcher's SIGTERM once the first has exited does not cut off the other's
  // own report.
  for (const char* rank : {"0", "2"}) {
    EXPECT_NE(
        r.output.find(
            std::string("[rank ") + rank + "] tpipe: error: rank " + rank +
            ": "),
        std::string::npos)
        << r.output;
    const std::string account = std::string("rank ") + rank + ": stage " + rank;
    const size_t at = r.output.find(account);
    ASSERT_NE(at, std::string::npos) << r.output;
    const std::string line = r.output.substr(at, r.output.find('\n', at) - at);
    EXPECT_NE(line.find("last completed: "), std::string::npos) << line;
    EXPECT_NE(line.find("lost rank 1 (pipeline rank 1"), std::string::npos)
        << line;
    EXPECT_NE(line.find("(tag "), std::string::npos) << line;
  }
  EXPECT_NE(
      r.output.find("lost: rank(s) 1 sent no account within 2.0 s"),
      std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 40.0);
  expectNoOrphans();
}

// One trace, one timeline and one bubble report of every rank, on rank 0's
// clock, from a multi-process run.
TEST_F(DistributedTest, EveryRankIsInOneTraceAndReport) {
  const Result r = shell(
      binary() + " launch --nproc 2 " + config_ + " --trace " +
      path("trace.json") + " --timeline " + path("timeline.svg") +
      " --report " + path("report.json") + " --memory-report");
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(
      r.output.find("[rank 0] clocks on rank 0's: rank 1 "), std::string::npos)
      << r.output;
  // One memory table, each device measured by the process that runs it.
  for (const std::string device : {"cpu:0", "cpu:1"}) {
    const auto row = r.output.find("[rank 0] " + device + " ");
    ASSERT_NE(row, std::string::npos) << r.output;
    const std::string line =
        r.output.substr(row, r.output.find('\n', row) - row);
    EXPECT_EQ(line.find(" 0 B "), std::string::npos) << line;
  }
  EXPECT_NE(r.output.find("[rank 0] bubble: measured"), std::string::npos)
      << r.output;
  std::ifstream traceFile(path("trace.json"));
  const auto trace = nlohmann::json::parse(traceFile);
  std::set<int> processes;
  for (const auto& event : trace["traceEvents"]) {
    if (event["ph"] == "X")
      processes.insert(event["pid"].get<int>());
  }
  EXPECT_EQ(processes, (std::set<int>{0, 1}));
  std::ifstream reportFile(path("report.json"));
  const auto report = nlohmann::json::parse(reportFile);
  ASSERT_EQ(report["ranks"].size(), 2u);
  for (const auto& rank : report["ranks"])
    EXPECT_GT(rank["compute_ms"].get<double>(), 0.0) << report.dump();
  EXPECT_TRUE(fs::exists(path("timeline.svg")));
}

// A device's declared memory binds the process that runs it.
TEST_F(DistributedTest, ADeclaredCapacityBindsAcrossProcesses) {
  const Result r = shell(
      binary() + " launch --nproc 2 " + config_ +
      " --set 'pipeline.devices=[{\"name\": \"cpu:0\", \"memory\": \"16KiB\"}, \"cpu:1\"]'");
  // Every rank reaches the same verdict from the shared costs, before the
  // first step: no rank is left to call another lost. The first to exit
  // ends the others, so on a busy machine a slower rank may be ended before
  // it prints its own copy of the verdict: one copy is what is certain.
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(
      r.output.find("] tpipe: error: the plan does not fit: stage 0"),
      std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("whose capacity is 16.00 KiB"), std::string::npos)
      << r.output;
  EXPECT_EQ(r.output.find("lost rank"), std::string::npos) << r.output;
  expectNoOrphans();
}

// Under dualpipe each rank saves the stages it runs, a copy under its
// original's names, and takes them back.
TEST_F(DistributedTest, ResumedRunMatchesTheUninterruptedOne) {
  for (const std::string schedule : {"1f1b", "dualpipe"}) {
    SCOPED_TRACE(schedule);
    const std::string run =
        config_ + " --set pipeline.schedule=" + schedule + " --metrics ";
    const std::string ckpt = path(schedule + "-ckpt");
    const std::string parts = path(schedule + "-parts.jsonl");
    ASSERT_EQ(
        shell(
            binary() + " launch --nproc 2 " + run +
            path(schedule + "-whole.jsonl"))
            .status,
        0);
    const Result first = shell(
        binary() + " launch --nproc 2 " + run + parts + " --save " + ckpt +
        " --stop-after 5");
    ASSERT_EQ(first.status, 0) << first.output;
    EXPECT_TRUE(fs::exists(ckpt + "/rank-0/model.pt"));
    EXPECT_TRUE(fs::exists(ckpt + "/rank-1/model.pt"));
    const Result rest = shell(
        binary() + " launch --nproc 2 " + run + parts + " --resume " + ckpt);
    ASSERT_EQ(rest.status, 0) << rest.output;
    expectSameLosses(
        losses(path(schedule + "-whole.jsonl")), losses(parts), 0.0);
    // One process reads every rank's files: the run goes on in one process.
    const Result oneProcess = shell(
        binary() + " train " + config_ + " --set pipeline.schedule=" +
        schedule + " --resume " + ckpt + " --set train.steps=14");
    EXPECT_EQ(oneProcess.status, 0) << oneProcess.output;
    EXPECT_NE(
        oneProcess.output.find(
            "the checkpoint was written by 2 pipeline rank(s), this run has "
            "one process"),
        std::string::npos)
        << oneProcess.output;
  }
}

// pipeline.elastic with launch --min-nproc: a 3-rank job whose rank 1 dies
// for good at step 25 (checkpoint_every 10) goes on with 2 ranks from step
// 20, re-planned, its checkpoint re-sharded by layer name (Adam's state
// with the weights). Its losses equal an uninterrupted 3-rank run's, and
// exactly those of a run stopped at step 20 and resumed by hand on 2 ranks.
// A rank that hangs (SIGSTOP) is left out the same way. A world below
// min_ranks, or an elastic config that fixes the stage count,
// is refused with exit 2.
TEST_F(DistributedTest, ALostRankLeavesTheJobToTheRanksThatRemain) {
  const std::string elastic = config_ +
      " --set 'pipeline.devices=[\"cpu:0\",\"cpu:1\",\"cpu:2\"]'"
      " --set pipeline.elastic.min_ranks=2 --set train.steps=40"
      " --set train.checkpoint_every=10"
      " --set 'train.optimizer={\"type\":\"adam\",\"lr\":0.01}'";
  const Result restarted = shell(
      "TPIPE_FAULT=1:25:exit:" + path("gone") + " " + faultyBinary() +
      " launch --nproc 3 --max-restarts 2 --min-nproc 2 " + elastic +
      " --save " + path("ck") + " --metrics " + path("shrunk.jsonl"));
  ASSERT_EQ(restarted.status, 0) << restarted.output;
  for (const char* said :
       {"launch: rank 1 failed (exit status 17); restart 1 of 2: 2 ranks "
        "(without rank 1's place), resuming from step 20 in",
        "pipeline: 2 stages on cpu:0 cpu:1",
        "the checkpoint was written by 3 pipeline rank(s), this run has 2 "
        "pipeline rank(s)",
        "launch: first step after the restart,"}) {
    EXPECT_NE(restarted.output.find(said), std::string::npos)
        << said << "\n"
        << restarted.output;
  }
  expectRedoneAsDropped(restarted.output);
  const Result whole = shell(
      binary() + " launch --nproc 3 " + elastic + " --metrics " +
      path("whole.jsonl"));
  ASSERT_EQ(whole.status, 0) << whole.output;
  const Result first = shell(
      binary() + " launch --nproc 3 " + elastic + " --save " + path("hand") +
      " --stop-after 20 --metrics " + path("hand.jsonl"));
  ASSERT_EQ(first.status, 0) << first.output;
  const Result rest = shell(
      binary() + " launch --nproc 2 " + elastic + " --resume " + path("hand") +
      " --metrics " + path("hand.jsonl"));
  ASSERT_EQ(rest.status, 0) << rest.output;
  const std::vector<double> shrunk = losses(path("shrunk.jsonl"));
  ASSERT_EQ(shrunk.size(), 40u);
  expectSameLosses(shrunk, losses(path("hand.jsonl")), 0.0);
  expectSameLosses(shrunk, losses(path("whole.jsonl")), 1e-6);

  // A rank that hangs is named by the rank that lost it, and left out.
  const Result hung = shell(
      "TPIPE_FAULT=1:15:stop:" + path("hung") + " " + faultyBinary() +
      " launch --nproc 3 --max-restarts 1 --min-nproc 2 " + elastic +
      " --set pipeline.timeout_s=5 --set train.steps=30 --save " +
      path("ck-hung") + " --metrics " + path("hung.jsonl"));
  ASSERT_EQ(hung.status, 0) << hung.output;
  EXPECT_NE(
      hung.output.find("having lost rank 1; restart 1 of 1: 2 ranks (without "
                       "rank 1's place), resuming from step 10"),
      std::string::npos)
      << hung.output;
  EXPECT_EQ(losses(path("hung.jsonl")).size(), 30u);

  const Result tooFew = shell(
      binary() + " launch --nproc 2 " + elastic +
      " --set pipeline.elastic.min_ranks=3");
  EXPECT_EQ(tooFew.status, 2) << tooFew.output;
  EXPECT_NE(
      tooFew.output.find(
          "pipeline.elastic: a world of 2 process(es) with "
          "pipeline.data_parallel 1 leaves 2 pipeline rank(s), below "
          "min_ranks 3"),
      std::string::npos)
      << tooFew.output;
  const Result fixed =
      shell(binary() + " validate " + elastic + " --set pipeline.stages=3");
  EXPECT_EQ(fixed.status, 2) << fixed.output;
  EXPECT_NE(
      fixed.output.find("pipeline.stages: fixes the stage count"),
      std::string::npos)
      << fixed.output;
  expectNoOrphans();
}

// tpipe launch --max-restarts: a 3-rank job whose rank 1 dies at step 25
// (once) with checkpoint_every 10 goes on from step 20 by itself; its losses
// from step 21 on equal those of a run stopped at step 20 and resumed by
// hand, and its metrics hold each step once. A fault that comes back every
// time spends the restarts and ends with a clear error.
TEST_F(DistributedTest, AFailedRankRestartsTheJobFromTheLastCheckpoint) {
  const std::string job = " launch --nproc 3 --max-restarts 2 " + config_ +
      " --set 'pipeline.devices=[\"cpu:0\",\"cpu:1\",\"cpu:2\"]'"
      " --set train.steps=40 --set train.checkpoint_every=10";
  const Result restarted = shell(
      "TPIPE_FAULT=1:25:exit:" + path("fired") + " " + faultyBinary() + job +
      " --save " + path("ck") + " --metrics " + path("restarted.jsonl"));
  ASSERT_EQ(restarted.status, 0) << restarted.output;
  for (const char* said :
       {"[rank 1] exited with status 17; ending the other ranks",
        "launch: rank 1 failed (exit status 17); restart 1 of 2: 3 ranks, "
        "resuming from step 20 in",
        "--resume auto: resuming from",
        "launch: first step after the restart,"}) {
    EXPECT_NE(restarted.output.find(said), std::string::npos)
        << said << "\n"
        << restarted.output;
  }
  expectRedoneAsDropped(restarted.output);
  const Result first = shell(
      binary() + job + " --save " + path("by-hand") +
      " --stop-after 20 --metrics " + path("by-hand.jsonl"));
  ASSERT_EQ(first.status, 0) << first.output;
  const Result rest = shell(
      binary() + job + " --save " + path("by-hand") + " --metrics " +
      path("by-hand.jsonl"));
  ASSERT_EQ(rest.status, 0) << rest.output;
  const std::vector<double> a = losses(path("restarted.jsonl")),
                            b = losses(path("by-hand.jsonl"));
  ASSERT_EQ(a.size(), 40u); // one record per step
  expectSameLosses(a, b, 0.0);

  const Result hopeless = shell(
      "TPIPE_FAULT=1:25:exit " + faultyBinary() + job + " --save " +
      path("hopeless"));
  EXPECT_EQ(hopeless.status, 17) << hopeless.output;
  EXPECT_NE(hopeless.output.find("restart 2 of 2"), std::string::npos)
      << hopeless.output;
  EXPECT_NE(
      hopeless.output.find(
          "launch: rank 1 failed (exit status 17) and no restarts are left (2 "
          "used); giving up"),
      std::string::npos)
      << hopeless.output;
  const Result unsaved = shell(binary() + job);
  EXPECT_EQ(unsaved.status, 2);
  EXPECT_NE(
      unsaved.output.find("--max-restarts needs --save DIR"), std::string::npos)
      << unsaved.output;
}

// A rank that freezes (SIGSTOP: a host that stops answering) fails the job
// like one that exits: the other rank names it after timeout_s, the launcher
// ends both (the stopped one too) and the restart finishes the job from the
// last checkpoint, one metrics record per step.
TEST_F(DistributedTest, AStoppedRankRestartsTheJobToo) {
  const Result r = shell(
      "TPIPE_FAULT=1:15:stop:" + path("stopped") + " " + faultyBinary() +
      " launch --nproc 2 --max-restarts 1 " + config_ +
      " --set 'pipeline.devices=[\"cpu:0\",\"cpu:1\"]'"
      " --set pipeline.timeout_s=5 --set train.steps=30"
      " --set train.checkpoint_every=10 --save " +
      path("ck-stop") + " --metrics " + path("stop.jsonl"));
  ASSERT_EQ(r.status, 0) << r.output;
  for (const char* said :
       {"restart 1 of 1: 2 ranks, resuming from step 10",
        "--resume auto: resuming from"}) {
    EXPECT_NE(r.output.find(said), std::string::npos) << said << "\n"
                                                      << r.output;
  }
  EXPECT_EQ(losses(path("stop.jsonl")).size(), 30u);
}

// Ranks that run different models, seeds or schedules would train a wrong
// model or deadlock: rendezvous compares their runs first.
TEST_F(DistributedTest, RanksThatDisagreeAboutTheRunStopNamingTheKey) {
  const int port = tpipe::runtime::freeLoopbackPort();
  ASSERT_GT(port, 0);
  const std::string env =
      "MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) +
      " WORLD_SIZE=2 ";
  // Rank 0 runs a model whose first stage emits 40 features; rank 1 expects 32.
  const Result r = shell(
      "(" + env + "RANK=0 " + binaryProcess() + " train " + config_ +
      " --set model.layers.2.out_features=40 > " + path("rank0.log") +
      " 2>&1 &) ; " + env + "RANK=1 " + binary() + " train " + config_ +
      " --set pipeline.timeout_s=10");
  EXPECT_EQ(r.status, 2) << r.output;
  EXPECT_NE(
      r.output.find(
          "rank(s) 1 differ from rank 0, first at 'model.layers[2].out_features'"),
      std::string::npos)
      << r.output;
  EXPECT_LT(r.seconds, 10.0);
  expectNoOrphans();
}

} // namespace
