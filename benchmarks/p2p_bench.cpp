// Point-to-point latency and bandwidth between two local processes: c10d's
// Gloo over loopback against the Unix-socket channels tpipe uses between
// ranks of one host (runtime/socket_channels.h). Ping-pong:
// rank 0 sends an activation, rank 1 answers with a gradient of the same
// size; one-way time = round trip / 2. Writes JSON to argv[1].
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include "runtime/c10d_transport.h"
#include "runtime/memory.h"

namespace {

using tpipe::runtime::Direction;

// One-way time of a ping-pong, the median of `rounds`. With shapes
// known, the shapes are announced (expect), so each transfer is one
// message and the receive is posted at the round's start; otherwise a
// header and the data, the receive posted when reached.
double pingPong(
    tpipe::runtime::Transport& transport,
    int rank,
    int64_t bytes,
    int rounds,
    bool known) {
  const at::Tensor payload = at::zeros({1, std::max<int64_t>(1, bytes / 4)});
  tpipe::runtime::StepShapes shapes;
  shapes.perSample = {{{payload.size(1)}}};
  shapes.microBatchSizes = {1};
  shapes.receives = {
      {rank == 0 ? Direction::kGradient : Direction::kActivation, 0, 0}};
  std::vector<double> times;
  for (int round = 0; round < rounds + 2; ++round) {
    transport.begin(1);
    if (known)
      transport.expect(shapes);
    const auto start = std::chrono::steady_clock::now();
    if (rank == 0) {
      transport.send(Direction::kActivation, 0, 0, {{payload}, nullptr});
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
  // Both ranks build the Gloo transport first, then the socket one.
  ::setenv("TPIPE_P2P", "gloo", 1);
  auto gloo = tpipe::runtime::makeProcessGroupTransport(
      {}, communicator, 2, 1, 1, c10::Device(c10::kCPU));
  ::unsetenv("TPIPE_P2P");
  auto sockets = tpipe::runtime::makeProcessGroupTransport(
      {}, communicator, 2, 1, 1, c10::Device(c10::kCPU));
  nlohmann::json rows = nlohmann::json::array();
  if (rank == 0) {
    std::printf(
        "%12s %14s %14s %12s %10s %12s %12s\n",
        "bytes",
        "gloo hdr+data",
        "gloo 1 msg us",
        "socket us",
        "speed-up",
        "gloo GB/s",
        "socket GB/s");
  }
  for (int64_t bytes :
       {int64_t{4},
        int64_t{1} << 10,
        int64_t{64} << 10,
        int64_t{1} << 20,
        int64_t{16} << 20,
        int64_t{64} << 20}) {
    const int rounds = bytes >= (16 << 20) ? 10 : 200;
    // Side by side, alternating: Gloo's two protocols, then the sockets.
    std::vector<double> header, known, socket;
    for (int turn = 0; turn < 2; ++turn) {
      header.push_back(pingPong(*gloo, rank, bytes, rounds, false));
      known.push_back(pingPong(*gloo, rank, bytes, rounds, true));
      socket.push_back(pingPong(*sockets, rank, bytes, rounds, true));
    }
    auto best = [](const std::vector<double>& times) {
      return *std::min_element(times.begin(), times.end());
    };
    const double withHeader = best(header), oneMessage = best(known),
                 bySocket = best(socket);
    auto gbs = [&](double us) {
      return static_cast<double>(bytes) / (us * 1e-6) / 1e9;
    };
    if (rank == 0) {
      std::printf(
          "%12lld %14.1f %14.1f %12.1f %10.2f %12.3f %12.3f\n",
          static_cast<long long>(bytes),
          withHeader,
          oneMessage,
          bySocket,
          oneMessage / bySocket,
          gbs(oneMessage),
          gbs(bySocket));
      rows.push_back(
          {{"bytes", bytes},
           {"gloo_header_and_data_one_way_us", withHeader},
           {"gloo_one_message_one_way_us", oneMessage},
           {"socket_one_way_us", bySocket},
           {"gloo_gb_per_s", gbs(oneMessage)},
           {"socket_gb_per_s", gbs(bySocket)}});
    }
  }
  if (rank == 0) {
    std::ofstream(out) << nlohmann::json{
        {"transport",
         "two processes on one host: c10d Gloo over loopback TCP against "
         "tpipe's Unix-socket channels"},
        {"rows", rows}}
                              .dump(1)
                       << '\n';
    std::printf(
        "(one-way time: median of ping-pongs / 2, the better of two "
        "alternating turns; gloo hdr+data: a 112-byte header, then the "
        "tensor; gloo 1 msg: shapes known ahead, receive posted first; "
        "socket: the same-host channel tpipe launch uses)\nwrote %s\n",
        out.c_str());
  }
  return 0;
}

} // namespace

int main(int argc, char** argv) {
  const std::string out = argc > 1 ? argv[1] : "p2p.json";
  const int port = 21000 + static_cast<int>(::getpid() % 20000);
  // What a training process's host memory does (a Pipeline installs it):
  // received tensors reuse the blocks the last ones freed.
  tpipe::memory::installHostCache();
  const pid_t child = ::fork();
  if (child == 0)
    ::_exit(runRank(1, port, out));
  const int result = runRank(0, port, out);
  int status = 0;
  ::waitpid(child, &status, 0);
  return result != 0 ? result : (WIFEXITED(status) ? WEXITSTATUS(status) : 1);
}
