// Point-to-point latency and bandwidth between two local processes over the
// c10d transport tpipe uses across processes (Gloo, loopback). Ping-pong:
// rank 0 sends an activation, rank 1 answers with a gradient of the same
// size; one-way time = round trip / 2. Writes JSON to argv[1].
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "runtime/c10d_transport.h"

namespace {

using tpipe::runtime::Direction;

double pingPong(
    tpipe::runtime::Transport& transport,
    int rank,
    int64_t bytes,
    int rounds) {
  const at::Tensor payload = at::zeros({bytes / 4}, at::kFloat);
  std::vector<double> times;
  for (int round = 0; round < rounds + 2; ++round) {
    transport.begin(1);
    const auto start = std::chrono::steady_clock::now();
    if (rank == 0) {
      transport.send(Direction::kActivation, 0, 0, {payload, nullptr});
      transport.receive(Direction::kGradient, 0, 0);
    } else {
      tpipe::runtime::Payload got =
          transport.receive(Direction::kActivation, 0, 0);
      transport.send(Direction::kGradient, 0, 0, std::move(got));
    }
    transport.end();
    if (round >= 2) {
      times.push_back(std::chrono::duration<double, std::micro>(
                          std::chrono::steady_clock::now() - start)
                          .count());
    }
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2] / 2.0; // one way
}

int runRank(int rank, int port, const std::string& out) {
  tpipe::WorldInfo world;
  world.rank = rank;
  world.worldSize = 2;
  world.masterPort = port;
  tpipe::Communicator communicator(world, 2, std::chrono::seconds(60));
  auto transport =
      tpipe::runtime::makeProcessGroupTransport({}, communicator, 2, 1);
  nlohmann::json rows = nlohmann::json::array();
  if (rank == 0)
    std::printf("%12s %14s %14s\n", "bytes", "one-way us", "GB/s");
  for (int64_t bytes :
       {int64_t{4},
        int64_t{1} << 10,
        int64_t{64} << 10,
        int64_t{1} << 20,
        int64_t{16} << 20,
        int64_t{64} << 20}) {
    const int rounds = bytes >= (16 << 20) ? 10 : 200;
    const double us = pingPong(*transport, rank, bytes, rounds);
    const double gbs = static_cast<double>(bytes) / (us * 1e-6) / 1e9;
    if (rank == 0) {
      std::printf(
          "%12lld %14.1f %14.3f\n", static_cast<long long>(bytes), us, gbs);
      rows.push_back({{"bytes", bytes}, {"one_way_us", us}, {"gb_per_s", gbs}});
    }
  }
  if (rank == 0) {
    std::ofstream(out)
        << nlohmann::
               json{{"transport", "c10d Gloo over loopback, two processes"}, {"rows", rows}}
                   .dump(1)
        << '\n';
    std::printf(
        "(median of ping-pongs; each message is a 96-byte header plus the tensor)\nwrote %s\n",
        out.c_str());
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "p2p.json";
  const int port = 21000 + static_cast<int>(::getpid() % 20000);
  const pid_t child = ::fork();
  if (child == 0)
    ::_exit(runRank(1, port, out));
  const int result = runRank(0, port, out);
  int status = 0;
  ::waitpid(child, &status, 0);
  return result != 0 ? result : (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}
