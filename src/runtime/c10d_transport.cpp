// Everything that touches c10d: rendezvous, process groups, point-to-point
// transfers, collectives. No other file includes c10d headers.
#include "runtime/c10d_transport.h"

#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <functional>
#include <sstream>
#include <thread>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#ifdef TPIPE_NO_C10D
// Built without Gloo's headers: one process only.
namespace tpipe {
WorldInfo worldFromEnvironment() {
  const char* size = std::getenv("WORLD_SIZE");
  TORCH_CHECK(
      size == nullptr || std::string(size) == "1",
      "WORLD_SIZE=",
      size,
      " but this tpipe was built without c10d (Gloo headers missing)");
  return WorldInfo{};
}
struct Communicator::Impl {};
Communicator::Communicator(
    const WorldInfo&,
    int,
    std::chrono::milliseconds,
    const std::string&) {
  TORCH_CHECK(
      false, "this tpipe was built without c10d (Gloo headers missing)");
}
Communicator::~Communicator() = default;
int Communicator::rank() const {
  return 0;
}
int Communicator::worldSize() const {
  return 1;
}
int Communicator::pipelineRanks() const {
  return 1;
}
int Communicator::replicas() const {
  return 1;
}
int Communicator::replica() const {
  return 0;
}
int Communicator::stageRank() const {
  return 0;
}
std::chrono::milliseconds Communicator::timeout() const {
  return {};
}
std::vector<std::string> Communicator::reportFailure(
    const std::string& line,
    std::chrono::milliseconds) {
  return {line};
}
double Communicator::clockOffsetUs(double* errorUs) {
  *errorUs = 0.0;
  return 0.0;
}
std::vector<std::string> Communicator::gatherText(const std::string& mine) {
  return {mine};
}
std::vector<double> Communicator::sum(const std::vector<double>& values) {
  return values;
}
void Communicator::sumInPlace(at::Tensor&) {}
void Communicator::rideNextSum(const std::vector<double>&) {}
std::vector<double> Communicator::ridersSummed() {
  return {};
}
std::vector<int64_t> Communicator::broadcast(
    const std::vector<int64_t>& values) {
  return values;
}
void Communicator::startAveraging(const std::vector<at::Tensor>&) {}
void Communicator::finishAveraging() {}
void Communicator::barrier() {}
namespace runtime {
std::unique_ptr<Transport> makeProcessGroupTransport(
    const std::vector<int>&,
    Communicator&,
    int,
    int,
    int,
    c10::Device) {
  TORCH_CHECK(
      false, "this tpipe was built without c10d (Gloo headers missing)");
}
c10::Device transferDevice(const std::vector<c10::Device>&, int, bool) {
  return c10::kCPU;
}
} // namespace runtime
} // namespace tpipe
#else

#include <unistd.h>

#include <future>
#include <iostream>
#include <thread>

#include <c10/core/impl/VirtualGuardImpl.h>
#include <nlohmann/json.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef TPIPE_USE_NCCL
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL // the header's guard; a CUDA LibTorch may not define it
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "runtime/network.h"
#include "runtime/store.h"
#include "json_input.h"
#include "tpipe/errors.h"

namespace tpipe {
namespace {

int environmentInt(const char* name, int fallback, bool* found = nullptr) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0')
    return fallback;
  if (found)
    *found = true;
  char* end = nullptr;
  const long parsed = std::strtol(value, &end, 10);
  if (end == value || *end != '\0' || parsed < 0 || parsed >= (1L << 30)) {
    throw UserError(
        std::string("environment variable ") + name + "='" + value +
        "' is not a non-negative integer");
  }
  return static_cast<int>(parsed);
}

} // namespace

WorldInfo worldFromEnvironment() {
  WorldInfo world;
  bool rankFound = false, sizeFound = false;
  // torchrun first, then Open MPI, then SLURM.
  world.rank = environmentInt("RANK", -1, &rankFound);
  world.worldSize = environmentInt("WORLD_SIZE", -1, &sizeFound);
  if (!rankFound)
    world.rank = environmentInt("OMPI_COMM_WORLD_RANK", -1, &rankFound);
  if (!sizeFound)
    world.worldSize = environmentInt("OMPI_COMM_WORLD_SIZE", -1, &sizeFound);
  if (!rankFound)
    world.rank = environmentInt("SLURM_PROCID", -1, &rankFound);
  if (!sizeFound)
    world.worldSize = environmentInt("SLURM_NTASKS", -1, &sizeFound);
  world.localRank = environmentInt("LOCAL_RANK", -1);
  if (world.localRank < 0)
    world.localRank = environmentInt("OMPI_COMM_WORLD_LOCAL_RANK", -1);
  if (world.localRank < 0)
    world.localRank = environmentInt("SLURM_LOCALID", 0);
  if (!rankFound && !sizeFound)
    return WorldInfo{};
  if (!rankFound || !sizeFound)
    throw UserError(
        "a rank and a world size must both be set (RANK and WORLD_SIZE)");
  if (world.worldSize < 1)
    throw UserError(
        "WORLD_SIZE must be >= 1, got " + std::to_string(world.worldSize));
  if (world.rank >= world.worldSize) {
    throw UserError(
        "RANK " + std::to_string(world.rank) + " is not below WORLD_SIZE " +
        std::to_string(world.worldSize));
  }
  if (const char* addr = std::getenv("MASTER_ADDR")) {
    if (*addr)
      world.masterAddr = addr;
  }
  world.masterPort = environmentInt("MASTER_PORT", 29500);
  if (world.masterPort <= 0 || world.masterPort >= 65536) {
    throw UserError(
        "MASTER_PORT must be a TCP port, got " +
        std::to_string(world.masterPort));
  }
  world.fromEnvironment = true;
  return world;
}

struct Communicator::Impl {
  WorldInfo world;
  int pipelineRanks = 1;
  std::chrono::milliseconds timeout{60000};
  std::shared_ptr<runtime::StoreServer> storeServer; // rank 0
  c10::intrusive_ptr<c10d::Store> store;
  int storeCalls = 0; // numbers the keys of store collectives
  c10::intrusive_ptr<c10d::ProcessGroupGloo> worldGroup;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> replicaGroup; // D > 1 only
  // Gradient buckets posted by startAveraging, in posting order.
  struct Average {
    std::vector<at::Tensor> gradients; // where the means go
    std::vector<at::Tensor> joined;    // the bucket, flat, being reduced
    c10::intrusive_ptr<c10d::Work> work;
  };
  std::vector<Average> averages;
  std::vector<double> riders, ridersSummed; // rideNextSum

  // The same pipeline rank in the next replica: whom a stuck reduction is
  // blamed on.
  int nextReplica() const {
    const int replicas = world.worldSize / pipelineRanks;
    const int replica = world.rank / pipelineRanks;
    return (replica + 1) % replicas * pipelineRanks +
        world.rank % pipelineRanks;
  }

  // Runs `body` (posting or waiting for an operation with `peer`), turning
  // any failure into an error naming the peer: Gloo reports a closed
  // connection from the call itself or from the wait, and a silent peer
  // as a timeout.
  template <class Body>
  auto withPeer(int peer, const std::string& what, Body body)
      -> decltype(body()) {
    try {
      return body();
    } catch (const std::exception& error) {
      std::string reason = error.what();
      const auto newline = reason.find('\n');
      if (newline != std::string::npos)
        reason.resize(newline);
      std::ostringstream message;
      message << "lost rank " << peer << " (pipeline rank "
              << peer % pipelineRanks << ", replica " << peer / pipelineRanks
              << ") while " << what << ": ";
      // Gloo closes a pair when any wait on it times out (a send's, on
      // the send thread), and the other waits on it then say so.
      if (reason.find("imed out") != std::string::npos ||
          reason.find("Application timeout") != std::string::npos) {
        message << "no answer within " << timeout.count() / 1000.0 << " s";
      } else {
        message << reason;
      }
      TORCH_CHECK(false, message.str());
    }
  }

  void wait(
      const c10::intrusive_ptr<c10d::Work>& work,
      int peer,
      const std::string& what) {
    withPeer(peer, what, [&] { return work->wait(timeout); });
  }

  // Posts a collective and waits for it, any failure naming `peer`.
  template <class Post>
  void complete(int peer, const std::string& what, Post post) {
    wait(withPeer(peer, what, post), peer, what);
  }
};

namespace {

std::string jobToken(const WorldInfo& world) {
  const char* token = std::getenv("TPIPE_JOB_TOKEN");
  if (token && *token)
    return token;
  if (world.rank == 0 &&
      !runtime::isLoopbackAddress(runtime::numericAddress(world.masterAddr))) {
    std::cerr
        << "tpipe: warning: TPIPE_JOB_TOKEN is not set: any process that reaches "
        << world.masterAddr << ":" << world.masterPort
        << " can join this job (set the same secret on every host)\n";
  }
  return "";
}

std::string rankList(const std::vector<int>& ranks) {
  std::string text;
  for (int rank : ranks)
    text += (text.empty() ? "" : ", ") + std::to_string(rank);
  return text;
}

std::string claimKey(int rank) {
  return "tpipe/claims/" + std::to_string(rank);
}

// Polls for every rank's key until the deadline; names those that never came.
std::vector<nlohmann::json> gatherRanks(
    c10d::Store& store,
    const WorldInfo& world,
    std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<nlohmann::json> ranks(world.worldSize);
  std::vector<int> missing;
  for (;;) {
    missing.clear();
    for (int r = 0; r < world.worldSize; ++r) {
      const std::string key = "tpipe/rank/" + std::to_string(r);
      if (!ranks[r].is_null())
        continue;
      if (!store.check({key})) {
        missing.push_back(r);
        continue;
      }
      const std::vector<uint8_t> value = store.get(key);
      ranks[r] = nlohmann::json::parse(std::string(value.begin(), value.end()));
    }
    if (missing.empty() || std::chrono::steady_clock::now() > deadline)
      break;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  if (!missing.empty()) {
    std::vector<int> twice;
    for (int r = 0; r < world.worldSize; ++r) {
      if (store.add(claimKey(r), 0) > 1)
        twice.push_back(r);
    }
    throw UserError(
        "rank(s) " + rankList(missing) + " of WORLD_SIZE " +
        std::to_string(world.worldSize) + " did not join within " +
        std::to_string(timeout.count() / 1000) + " s" +
        (twice.empty() ? " (started? same MASTER_ADDR, MASTER_PORT and "
                         "WORLD_SIZE?)"
                       : "; RANK " + rankList(twice) +
                 " was given to two processes (each needs its own RANK)"));
  }
  return ranks;
}

// Two processes started with one RANK: the second to claim it is told so,
// instead of meeting a Gloo connection problem later.
void claimRank(c10d::Store& store, const WorldInfo& world) {
  const int64_t claims = store.add(claimKey(world.rank), 1);
  if (claims > 1) {
    throw UserError(
        "RANK " + std::to_string(world.rank) +
        " is taken: another process of this job joined with it first (each "
        "process needs its own RANK, 0 to WORLD_SIZE - 1 = " +
        std::to_string(world.worldSize - 1) + ")");
  }
}

// Every rank publishes what it advertises and what it runs, then waits for
// all the others (naming those that never come) and compares.
std::vector<nlohmann::json> agreeOnRun(
    c10d::Store& store,
    const WorldInfo& world,
    const runtime::LocalAddress& local,
    const std::string& runDescription,
    std::chrono::milliseconds timeout) {
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  nlohmann::json mine = {
      {"address", local.address},
      {"interface", local.interface},
      {"host", host}};
  try {
    mine["run"] = nlohmann::json::parse(runDescription);
  } catch (const nlohmann::json::exception&) {
    TORCH_INTERNAL_ASSERT(false, "the run description is not JSON");
  }
  const std::string text = mine.dump();
  claimRank(store, world);
  store.set(
      "tpipe/rank/" + std::to_string(world.rank),
      std::vector<uint8_t>(text.begin(), text.end()));
  const std::vector<nlohmann::json> ranks = gatherRanks(store, world, timeout);
  std::vector<int> differing;
  std::string key;
  for (int r = 0; r < world.worldSize; ++r) {
    const std::string difference =
        firstDifference(ranks[0]["run"], ranks[r]["run"]);
    if (difference.empty())
      continue;
    differing.push_back(r);
    if (key.empty())
      key = difference;
  }
  // Every rank reaches the same verdict from the same keys; rank 0 hosts the
  // store, so it waits (bounded) until the others have read them.
  store.set(
      "tpipe/compared/" + std::to_string(world.rank), std::vector<uint8_t>{1});
  if (world.rank == 0) {
    std::vector<std::string> compared;
    for (int r = 0; r < world.worldSize; ++r)
      compared.push_back("tpipe/compared/" + std::to_string(r));
    try {
      store.wait(compared, std::min(timeout, std::chrono::milliseconds(10000)));
    } catch (const std::exception&) {
      // A rank that died meanwhile is named by what follows.
    }
  }
  if (!differing.empty()) {
    throw UserError(
        "the ranks disagree about the run: rank(s) " + rankList(differing) +
        " differ from rank 0, first at '" + key +
        "' (give every rank the same config and overrides)");
  }
  return ranks;
}

// Runs `make` on a thread of its own and gives up after `limit`: a peer
// whose Gloo connection never completes cannot hold this rank longer.
template <class Make>
auto bounded(
    std::chrono::milliseconds limit,
    const std::function<std::string()>& explain,
    Make make) -> decltype(make()) {
  using Result = decltype(make());
  auto task = std::make_shared<std::packaged_task<Result()>>(std::move(make));
  std::future<Result> result = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (result.wait_for(limit) != std::future_status::ready)
    throw UserError(explain());
  try {
    return result.get();
  } catch (const std::exception& error) {
    const std::string reason = error.what();
    throw UserError(
        explain() + " (" + reason.substr(0, reason.find('\n')) + ")");
  }
}

} // namespace

namespace {

// Rank 0 starts the store on MASTER_ADDR's address; every rank connects and
// proves the token.
c10::intrusive_ptr<c10d::Store> joinStore(
    const WorldInfo& world,
    std::chrono::milliseconds timeout,
    std::shared_ptr<runtime::StoreServer>& server) {
  const std::string token = jobToken(world);
  const std::string master = runtime::numericAddress(world.masterAddr);
  try {
    if (world.rank == 0) {
      const std::string bind =
          runtime::isLoopbackAddress(master) ? "127.0.0.1" : master;
      server = runtime::startStoreServer(
          bind,
          world.masterPort,
          token,
          std::min(timeout, std::chrono::milliseconds(10000)));
    }
    return c10::make_intrusive<runtime::RendezvousStore>(
        master, world.masterPort, world.rank, token, timeout);
  } catch (const c10::Error& error) {
    throw UserError(
        "rendezvous failed for rank " + std::to_string(world.rank) + ": " +
        error.what_without_backtrace());
  }
}

// What to say when the Gloo pairs do not connect in time.
std::function<std::string()> explainGloo(
    const std::vector<nlohmann::json>& ranks,
    std::chrono::milliseconds timeout) {
  return [ranks, timeout] {
    std::string where;
    for (size_t r = 0; r < ranks.size(); ++r) {
      where += (r ? ", " : "") + std::to_string(r) + " at " +
          ranks[r].value("address", "?") + " (" + ranks[r].value("host", "?") +
          ")";
    }
    return "could not connect to every rank over Gloo within " +
        std::to_string(timeout.count() / 1000) +
        " s; the ranks advertise: " + where +
        ". Each host must reach the others' addresses on any TCP port "
        "(Gloo listens on ephemeral ports)";
  };
}

// A Gloo group over `prefix` of the store, bounded by the timeout.
c10::intrusive_ptr<c10d::ProcessGroupGloo> glooGroup(
    const c10::intrusive_ptr<c10d::Store>& store,
    const std::string& prefix,
    int rank,
    int size,
    const c10::intrusive_ptr<c10d::ProcessGroupGloo::Options>& options,
    const std::function<std::string()>& explain) {
  const auto limit = options->timeout + std::chrono::milliseconds(2000);
  return bounded(limit, explain, [store, prefix, rank, size, options] {
    return c10::make_intrusive<c10d::ProcessGroupGloo>(
        c10::make_intrusive<c10d::PrefixStore>(prefix, store),
        rank,
        size,
        options);
  });
}

} // namespace

Communicator::Communicator(
    const WorldInfo& world,
    int pipelineRanks,
    std::chrono::milliseconds timeout,
    const std::string& runDescription)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(pipelineRanks >= 1, "pipeline ranks must be >= 1");
  if (world.worldSize % pipelineRanks != 0) {
    throw UserError(
        "a world of " + std::to_string(world.worldSize) +
        " processes cannot hold replicas of a " +
        std::to_string(pipelineRanks) +
        "-rank pipeline: WORLD_SIZE must be data_parallel x pipeline ranks");
  }
  impl_->world = world;
  impl_->pipelineRanks = pipelineRanks;
  impl_->timeout = timeout;
  const runtime::LocalAddress local =
      runtime::advertisedAddress(world.masterAddr, world.masterPort);
  std::cout << "rank " << world.rank << ": interface "
            << local.interface << ", address " << local.address << " ("
            << local.why << ")" << std::endl;
  impl_->store = joinStore(world, timeout, impl_->storeServer);
  const auto explain = explainGloo(
      agreeOnRun(*impl_->store, world, local, runDescription, timeout),
      timeout);
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(
      c10d::ProcessGroupGloo::createDeviceForHostname(local.address));
  options->threads = 2;
  impl_->worldGroup = glooGroup(
      impl_->store,
      "tpipe/world",
      world.rank,
      world.worldSize,
      options,
      explain);
  if (replicas() > 1) {
    impl_->replicaGroup = glooGroup(
        impl_->store,
        "tpipe/stage" + std::to_string(stageRank()),
        replica(),
        replicas(),
        options,
        explain);
  }
}

Communicator::~Communicator() = default;

int Communicator::rank() const {
  return impl_->world.rank;
}
int Communicator::worldSize() const {
  return impl_->world.worldSize;
}
int Communicator::pipelineRanks() const {
  return impl_->pipelineRanks;
}
int Communicator::replicas() const {
  return worldSize() / pipelineRanks();
}
int Communicator::replica() const {
  return rank() / pipelineRanks();
}
int Communicator::stageRank() const {
  return rank() % pipelineRanks();
}
namespace {

double nowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::vector<uint8_t> bytesOf(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}

} // namespace

double Communicator::clockOffsetUs(double* errorUs) {
  const std::string call = "tpipe/clock/" + std::to_string(++impl_->storeCalls);
  auto& store = *impl_->store;
  constexpr int kRounds = 5;
  *errorUs = 0.0;
  if (rank() == 0) {
    for (int r = 1; r < worldSize(); ++r) {
      for (int k = 0; k < kRounds; ++k) {
        const std::string key =
            call + "/" + std::to_string(r) + "/" + std::to_string(k);
        store.wait({key + "/ping"}, impl_->timeout);
        store.set(key + "/pong", bytesOf(std::to_string(nowUs())));
      }
    }
    return 0.0;
  }
  double best = 0.0, bestRoundTrip = 1e300;
  for (int k = 0; k < kRounds; ++k) {
    const std::string key =
        call + "/" + std::to_string(rank()) + "/" + std::to_string(k);
    const double sent = nowUs();
    store.set(key + "/ping", bytesOf("?"));
    store.wait({key + "/pong"}, impl_->timeout);
    const std::vector<uint8_t> reply = store.get(key + "/pong");
    const double received = nowUs();
    const double theirs = std::stod(std::string(reply.begin(), reply.end()));
    if (received - sent < bestRoundTrip) {
      bestRoundTrip = received - sent;
      best = theirs - 0.5 * (sent + received);
    }
  }
  *errorUs = 0.5 * bestRoundTrip;
  return best;
}

std::vector<std::string> Communicator::gatherText(const std::string& mine) {
  const std::string call =
      "tpipe/gather/" + std::to_string(++impl_->storeCalls) + "/";
  auto& store = *impl_->store;
  store.set(call + std::to_string(rank()), bytesOf(mine));
  if (rank() != 0)
    return {};
  std::vector<std::string> all;
  for (int r = 0; r < worldSize(); ++r) {
    const std::string key = call + std::to_string(r);
    store.wait({key}, impl_->timeout);
    const std::vector<uint8_t> value = store.get(key);
    all.emplace_back(value.begin(), value.end());
  }
  return all;
}

std::vector<std::string> Communicator::reportFailure(
    const std::string& line,
    std::chrono::milliseconds grace) {
  std::vector<std::string> lines(static_cast<size_t>(worldSize()));
  lines[static_cast<size_t>(rank())] = line;
  auto key = [](int r) { return "tpipe/failure/" + std::to_string(r); };
  try {
    auto& store = *impl_->store;
    store.set(key(rank()), std::vector<uint8_t>(line.begin(), line.end()));
    const auto deadline = std::chrono::steady_clock::now() + grace;
    for (;;) {
      bool all = true;
      for (int r = 0; r < worldSize(); ++r) {
        if (!lines[static_cast<size_t>(r)].empty())
          continue;
        if (store.check({key(r)})) {
          const std::vector<uint8_t> value = store.get(key(r));
          lines[static_cast<size_t>(r)].assign(value.begin(), value.end());
        } else {
          all = false;
        }
      }
      if (all || std::chrono::steady_clock::now() >= deadline)
        break;
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  } catch (const std::exception&) {
    // The store's host is gone: only this rank's account is known.
  }
  return lines;
}

std::chrono::milliseconds Communicator::timeout() const {
  return impl_->timeout;
}

std::vector<double> Communicator::sum(const std::vector<double>& values) {
  std::vector<double> all = values;
  all.insert(all.end(), impl_->riders.begin(), impl_->riders.end());
  std::vector<at::Tensor> tensors{
      at::empty({static_cast<int64_t>(all.size())}, at::kDouble)};
  std::copy(all.begin(), all.end(), tensors[0].data_ptr<double>());
  impl_->complete(
      rank() == 0 ? 1 % worldSize() : 0, "summing across the world", [&] {
        return impl_->worldGroup->allreduce(tensors);
      });
  const double* data = tensors[0].data_ptr<double>();
  impl_->riders.clear();
  impl_->ridersSummed.assign(data + values.size(), data + all.size());
  return std::vector<double>(data, data + values.size());
}

void Communicator::sumInPlace(at::Tensor& tensor) {
  std::vector<at::Tensor> tensors{tensor};
  impl_->complete(
      rank() == 0 ? 1 % worldSize() : 0,
      "summing a tensor across the world",
      [&] { return impl_->worldGroup->allreduce(tensors); });
}

void Communicator::rideNextSum(const std::vector<double>& values) {
  impl_->riders.insert(impl_->riders.end(), values.begin(), values.end());
  impl_->ridersSummed.clear();
}

std::vector<double> Communicator::ridersSummed() {
  return std::move(impl_->ridersSummed);
}

std::vector<int64_t> Communicator::broadcast(
    const std::vector<int64_t>& values) {
  std::vector<at::Tensor> tensors{
      at::empty({static_cast<int64_t>(values.size())}, at::kLong)};
  std::copy(values.begin(), values.end(), tensors[0].data_ptr<int64_t>());
  impl_->complete(0, "receiving rank 0's broadcast", [&] {
    return impl_->worldGroup->broadcast(tensors);
  });
  const int64_t* data = tensors[0].data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + values.size());
}

void Communicator::startAveraging(const std::vector<at::Tensor>& gradients) {
  if (replicas() == 1)
    return;
  constexpr int64_t kBucketBytes = 25 << 20;
  std::vector<at::Tensor> bucket;
  int64_t bytes = 0;
  auto post = [&] {
    if (bucket.empty())
      return;
    std::vector<at::Tensor> flat;
    for (const auto& g : bucket)
      flat.push_back(g.reshape({-1}));
    Impl::Average average{std::move(bucket), {at::cat(flat)}, {}};
    average.work = impl_->withPeer(
        impl_->nextReplica(), "averaging gradients across replicas", [&] {
          return impl_->replicaGroup->allreduce(average.joined);
        });
    impl_->averages.push_back(std::move(average));
    bucket.clear();
    bytes = 0;
  };
  for (const auto& g : gradients) {
    if (!g.defined())
      continue;
    bucket.push_back(g);
    bytes += static_cast<int64_t>(g.nbytes());
    if (bytes >= kBucketBytes)
      post();
  }
  post();
}

void Communicator::finishAveraging() {
  auto averages = std::move(impl_->averages);
  impl_->averages.clear();
  for (auto& average : averages) {
    impl_->wait(
        average.work,
        impl_->nextReplica(),
        "averaging gradients across replicas");
    const at::Tensor mean = average.joined[0].div_(replicas());
    int64_t offset = 0;
    for (auto& g : average.gradients) {
      g.copy_(mean.narrow(0, offset, g.numel()).view(g.sizes()));
      offset += g.numel();
    }
  }
}

void Communicator::barrier() {
  impl_->complete(
      0, "waiting at a barrier", [&] { return impl_->worldGroup->barrier(); });
}

namespace runtime {
namespace {

constexpr int64_t kMagic = 0x7470697065; // "tpipe"
constexpr int kHeaderSize = 14;
constexpr int kMaxDims = kHeaderSize - 8;

// Gives up on a transfer after a failure. Not every backend can abort one
// (NCCL's work in some versions): it is then left to the run's end.
void abandon(const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->abort();
  } catch (const std::exception&) {
  }
}

struct PendingSend {
  c10::intrusive_ptr<c10d::Work> work;
  int peer;
};

// Waits for a process's sends on a thread of its own, in the order posted,
// and lets go of each (and of its tensor) once it has landed: the compute
// thread never blocks on a send, and a step holds only the tensors still
// in flight, not every activation and gradient it sent. (Gloo's send work
// says it is complete only once waited for, so polling cannot do this.)
class SendReaper {
 public:
  using Wait = std::function<void(const PendingSend&)>;
  explicit SendReaper(Wait wait)
      : wait_(std::move(wait)), thread_([this] { loop(); }) {}
  ~SendReaper() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      for (auto& send : queue_)
        abandon(send.work);
    }
    wake_.notify_all();
    thread_.join();
  }
  SendReaper(const SendReaper&) = delete;
  SendReaper& operator=(const SendReaper&) = delete;

  void add(PendingSend send) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(send));
    }
    wake_.notify_all();
  }

  // Blocks until every added send has landed; throws the first failure.
  void drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return queue_.empty(); });
    std::string error = std::move(error_);
    error_.clear();
    TORCH_CHECK(error.empty(), error);
  }

  // After a failed step: abandons what is still in flight.
  void discard() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& send : queue_)
        abandon(send.work);
    }
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return queue_.empty(); });
    error_.clear();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty())
        return;
      const PendingSend send = queue_.front();
      lock.unlock();
      std::string failure;
      try {
        wait_(send);
      } catch (const c10::Error& e) {
        failure = e.what_without_backtrace();
      } catch (const std::exception& e) {
        failure = e.what();
      }
      lock.lock();
      if (error_.empty() && !failure.empty())
        error_ = std::move(failure);
      queue_.pop_front();
      wake_.notify_all();
    }
  }

  Wait wait_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<PendingSend> queue_;
  std::string error_; // first failure since the last drain
  bool stopping_ = false;
  std::thread thread_; // last: starts once the rest is built
};

} // namespace

class ProcessGroupTransport final : public Transport {
 public:
  ProcessGroupTransport(
      std::vector<int> placement,
      Communicator& communicator,
      int stages,
      int microBatches,
      int slots,
      c10::Device dataDevice)
      : placement_(std::move(placement)),
        communicator_(communicator),
        impl_(communicator.impl()),
        stages_(stages),
        microBatches_(microBatches),
        partsPerTransfer_(2 * std::max(slots, 1)),
        dataDevice_(dataDevice),
        sends_([this](const PendingSend& send) {
          impl_.wait(send.work, send.peer, "sending to it");
        }) {
    if (!dataDevice_.is_cpu())
      joinDeviceGroups();
  }

  void begin(int boundaries) override {
    local_.begin(boundaries);
    sends_.discard();
    abortPosted(); // what a failed step left
    shapes_.reset();
  }

  // Known shapes: one message per transfer, and this process's receives
  // posted ahead of the executor, so data lands while the workers compute:
  // all of the step's at its start, or a window of them (each posted
  // receive holds its buffer).
  void expect(const StepShapes& shapes) override {
    shapes_ = shapes;
    std::lock_guard<std::mutex> lock(receiving_);
    toPost_.clear();
    nextPost_ = 0;
    for (const auto& r : shapes.receives) {
      if (peerOf(r.direction, r.boundary, false) != communicator_.rank())
        toPost_.push_back(r);
    }
    fillPostWindow();
  }

  void send(Direction direction, int boundary, int microBatch, Payload payload)
      override {
    const int peer = peerOf(direction, boundary, true);
    if (peer == communicator_.rank())
      return local_.send(direction, boundary, microBatch, std::move(payload));
    // On the CPU for Gloo; on this process's GPU for NCCL, which starts
    // once the current stream reaches it: first, the sender's copies.
    const auto& tensors = payload.tensors;
    if (payload.ready && !dataDevice_.is_cpu()) {
      payload.ready->block(c10::impl::VirtualGuardImpl(dataDevice_.type())
                               .getStream(dataDevice_));
    }
    const int count = static_cast<int>(tensors.size());
    TORCH_CHECK(
        2 * count <= partsPerTransfer_,
        "cannot send ",
        count,
        " tensors in one transfer (at most ",
        partsPerTransfer_ / 2,
        ")");
    for (int slot = 0; slot < count; ++slot) {
      const at::Tensor& tensor = tensors[slot];
      if (shapes_) {
        sendData(direction, boundary, microBatch, slot, tensor, peer);
        continue;
      }
      TORCH_CHECK(
          tensor.dim() <= kMaxDims,
          "cannot send a tensor of ",
          tensor.dim(),
          " dimensions (at most ",
          kMaxDims,
          ")");
      at::Tensor header = at::empty({kHeaderSize}, at::kLong);
      int64_t* h = header.data_ptr<int64_t>();
      std::fill(h, h + kHeaderSize, 0);
      h[0] = kMagic;
      h[1] = microBatch;
      h[2] = boundary;
      h[3] = static_cast<int64_t>(direction);
      h[4] = static_cast<int64_t>(tensor.scalar_type());
      h[5] = tensor.dim();
      h[6] = slot;
      h[7] = count;
      for (int64_t d = 0; d < tensor.dim(); ++d)
        h[8 + d] = tensor.size(d);
      postSend(
          header.to(dataDevice_),
          peer,
          direction,
          boundary,
          microBatch,
          2 * slot);
      postSend(
          tensor.contiguous(),
          peer,
          direction,
          boundary,
          microBatch,
          2 * slot + 1);
    }
  }

  Payload receive(Direction direction, int boundary, int microBatch) override {
    const int peer = peerOf(direction, boundary, false);
    if (peer == communicator_.rank())
      return local_.receive(direction, boundary, microBatch);
    if (postThrough(key(direction, boundary, microBatch)))
      return takePosted(direction, boundary, microBatch, peer);
    Payload payload;
    int count = 1;
    for (int slot = 0; slot < count; ++slot) {
      payload.tensors.push_back(
          receiveSlot(direction, boundary, microBatch, slot, peer, &count));
    }
    return payload;
  }

  void abort() override {
    local_.abort();
    std::lock_guard<std::mutex> lock(receiving_);
    if (current_)
      abandon(current_);
    abortAllPosted();
  }

  void end() override {
    sends_.drain();
  }

 private:
  // One transfer's receives, a message per tensor.
  struct Posted {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<at::Tensor> tensors;
    int peer;
  };

  static int64_t key(Direction direction, int boundary, int microBatch) {
    return (static_cast<int64_t>(boundary) * 2 + static_cast<int>(direction)) *
        (int64_t{1} << 32) +
        microBatch;
  }

  int peerOf(Direction direction, int boundary, bool sending) const {
    const bool towardsLater = (direction == Direction::kActivation) == sending;
    return towardsLater ? processOf(boundary + 1) : processOf(boundary);
  }

  std::string describe(Direction direction, int boundary, int microBatch)
      const {
    return std::string(
               direction == Direction::kActivation ? "activation"
                                                   : "gradient") +
        " of micro-batch " + std::to_string(microBatch) + " (tag " +
        std::to_string(tag(direction, boundary, microBatch, 1)) + ")";
  }

  // Slot `slot` of a transfer without known shapes: its header (whose
  // first says how many tensors follow), then its data.
  at::Tensor receiveSlot(
      Direction direction,
      int boundary,
      int microBatch,
      int slot,
      int peer,
      int* count) {
    const std::string receiving =
        "receiving the " + describe(direction, boundary, microBatch);
    auto receiveInto = [&](std::vector<at::Tensor>& tensors, int part) {
      waitReceive(
          impl_.withPeer(
              peer,
              receiving,
              [&] {
                return post(
                    false,
                    tensors,
                    direction,
                    boundary,
                    peer,
                    tag(direction, boundary, microBatch, part));
              }),
          peer,
          receiving);
    };
    std::vector<at::Tensor> header{
        at::empty({kHeaderSize}, onDevice(at::kLong))};
    receiveInto(header, 2 * slot);
    const at::Tensor hostHeader = header[0].to(at::kCPU);
    const int64_t* h = hostHeader.data_ptr<int64_t>();
    TORCH_CHECK(
        h[0] == kMagic && h[1] == microBatch && h[2] == boundary &&
            h[3] == static_cast<int64_t>(direction) && h[5] >= 0 &&
            h[5] <= kMaxDims && h[6] == slot && h[7] > slot &&
            2 * h[7] <= partsPerTransfer_ && (slot == 0 || h[7] == *count),
        "rank ",
        peer,
        " sent a message tpipe did not expect for the ",
        describe(direction, boundary, microBatch),
        " over boundary ",
        boundary,
        " (a different config or version on that rank?)");
    *count = static_cast<int>(h[7]);
    TORCH_CHECK(
        h[4] >= 0 && h[4] < static_cast<int64_t>(c10::ScalarType::NumOptions),
        "rank ",
        peer,
        " sent an unknown dtype code ",
        h[4]);
    const auto dtype = static_cast<c10::ScalarType>(h[4]);
    std::vector<int64_t> shape(h + 8, h + 8 + h[5]);
    std::vector<at::Tensor> data{at::empty(shape, onDevice(dtype))};
    receiveInto(data, 2 * slot + 1);
    return data[0];
  }

  // One message per tensor: the receiver knows the shape, and says what it
  // expects.
  void sendData(
      Direction direction,
      int boundary,
      int microBatch,
      int slot,
      const at::Tensor& tensor,
      int peer) {
    const auto& slots = shapes_->perSample.at(boundary);
    TORCH_CHECK(
        slot < static_cast<int>(slots.size()),
        "the ",
        describe(direction, boundary, microBatch),
        " has more tensors than the ",
        slots.size(),
        " shape inference promised");
    const std::vector<int64_t> shape =
        shapes_->shapeOf(boundary, slot, microBatch);
    TORCH_CHECK(
        tensor.sizes() == at::IntArrayRef(shape) &&
            tensor.scalar_type() == shapes_->dtype,
        "the ",
        describe(direction, boundary, microBatch),
        " has shape ",
        tensor.sizes(),
        " (",
        tensor.scalar_type(),
        "), but shape inference promised ",
        at::IntArrayRef(shape),
        " (",
        shapes_->dtype,
        ") to the rank receiving it");
    postSend(
        tensor.contiguous(),
        peer,
        direction,
        boundary,
        microBatch,
        2 * slot + 1);
  }

  // Part 0 is a header, part 1 the data; the send thread waits for it.
  void postSend(
      const at::Tensor& tensor,
      int peer,
      Direction direction,
      int boundary,
      int microBatch,
      int part) {
    std::vector<at::Tensor> tensors{tensor};
    sends_.add(
        {impl_.withPeer(
             peer,
             "sending the " + describe(direction, boundary, microBatch),
             [&] {
               return post(
                   true,
                   tensors,
                   direction,
                   boundary,
                   peer,
                   tag(direction, boundary, microBatch, part));
             }),
         peer});
  }

  // Whether the receive is posted, posting it first (with those before it)
  // when the executor reaches it before its turn in the window.
  bool postThrough(int64_t k) {
    std::lock_guard<std::mutex> lock(receiving_);
    while (!posted_.count(k) && nextPost_ < toPost_.size())
      postNext();
    return posted_.count(k) > 0;
  }

  // Posts receives in schedule order until the window is full; under
  // receiving_.
  void fillPostWindow() {
    const size_t window = shapes_->receivesAhead > 0
        ? static_cast<size_t>(shapes_->receivesAhead)
        : toPost_.size();
    while (nextPost_ < toPost_.size() && posted_.size() < window)
      postNext();
  }

  // Posts the next receive of toPost_, a message per tensor; under
  // receiving_.
  void postNext() {
    const StepShapes::Receive& r = toPost_[nextPost_++];
    Posted posted;
    posted.peer = peerOf(r.direction, r.boundary, false);
    const std::string what = describe(r.direction, r.boundary, r.microBatch);
    const int slots =
        static_cast<int>(shapes_->perSample.at(r.boundary).size());
    for (int slot = 0; slot < slots; ++slot) {
      std::vector<at::Tensor> buffer{at::empty(
          shapes_->shapeOf(r.boundary, slot, r.microBatch),
          onDevice(shapes_->dtype))};
      posted.works.push_back(
          impl_.withPeer(posted.peer, "receiving the " + what, [&] {
            return post(
                false,
                buffer,
                r.direction,
                r.boundary,
                posted.peer,
                tag(r.direction, r.boundary, r.microBatch, 2 * slot + 1));
          }));
      posted.tensors.push_back(buffer[0]);
    }
    posted_[key(r.direction, r.boundary, r.microBatch)] = std::move(posted);
  }

  Payload takePosted(
      Direction direction,
      int boundary,
      int microBatch,
      int peer) {
    Posted posted;
    {
      std::lock_guard<std::mutex> lock(receiving_);
      posted = posted_.at(key(direction, boundary, microBatch));
    }
    for (const auto& work : posted.works) {
      waitReceive(
          work,
          peer,
          "receiving the " + describe(direction, boundary, microBatch));
    }
    std::lock_guard<std::mutex> lock(receiving_);
    posted_.erase(key(direction, boundary, microBatch));
    fillPostWindow();
    return {std::move(posted.tensors), nullptr};
  }

  void abortPosted() {
    std::lock_guard<std::mutex> lock(receiving_);
    abortAllPosted();
    posted_.clear();
    toPost_.clear();
    nextPost_ = 0;
  }

  // Under receiving_.
  void abortAllPosted() {
    for (auto& [k, posted] : posted_) {
      for (auto& work : posted.works)
        abandon(work);
    }
  }

  at::TensorOptions onDevice(at::ScalarType dtype) const {
    return at::TensorOptions().dtype(dtype).device(dataDevice_);
  }

  // Posts one message to (sending) or from `peer` on the group that carries
  // a boundary's transfers in one direction: Gloo's world group, or the
  // NCCL group of that boundary's two processes (NCCL matches sends to
  // receives by order, not tag: one group per boundary and direction keeps
  // each in micro-batch order on both sides).
  c10::intrusive_ptr<c10d::Work> post(
      bool sending,
      std::vector<at::Tensor>& tensors,
      Direction direction,
      int boundary,
      int peer,
      int tag) {
    auto on = [&](const auto& group, int rank) {
      return sending ? group->send(tensors, rank, tag)
                     : group->recv(tensors, rank, tag);
    };
#ifdef TPIPE_USE_NCCL
    if (!dataDevice_.is_cpu()) {
      return on(
          deviceGroups_.at(groupKey(direction, boundary)),
          groupRank(boundary, peer));
    }
#endif
    return on(impl_.worldGroup, peer);
  }

  static int groupKey(Direction direction, int boundary) {
    return boundary * 2 + static_cast<int>(direction);
  }

  // In a boundary's group the earlier stage's process is 0, the later 1.
  int groupRank(int boundary, int process) const {
    return process == processOf(boundary) ? 0 : 1;
  }

  // A two-process NCCL group per remote boundary of this process and
  // direction (communicators are made at the first transfer).
  void joinDeviceGroups() {
#ifdef TPIPE_USE_NCCL
    const int me = communicator_.rank();
    for (int b = 0; b + 1 < stages_; ++b) {
      const int earlier = processOf(b), later = processOf(b + 1);
      if (earlier == later || (me != earlier && me != later))
        continue;
      for (Direction direction :
           {Direction::kActivation, Direction::kGradient}) {
        auto options = c10d::ProcessGroupNCCL::Options::create();
        options->timeout = impl_.timeout;
        const std::string prefix = "tpipe/nccl/replica" +
            std::to_string(communicator_.replica()) + "/boundary" +
            std::to_string(b) + "/" + std::to_string(groupKey(direction, b));
        auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(
            c10::make_intrusive<c10d::PrefixStore>(prefix, impl_.store),
            me == earlier ? 0 : 1,
            2,
            options);
        // NCCL makes a group's communicator at its first transfer, blocking
        // until both processes take part. Made lazily, a process posting
        // its receives could wait in one group while its peer waits in
        // another; made here, in one order on every process, they cannot.
        std::vector<at::Tensor> probe{at::zeros({1}, onDevice(at::kFloat))};
        const int peer = me == earlier ? later : earlier;
        impl_.complete(
            peer,
            "joining the NCCL group of boundary " + std::to_string(b),
            [&] {
              return me == earlier ? group->send(probe, 1, 0)
                                   : group->recv(probe, 0, 0);
            });
        deviceGroups_[groupKey(direction, b)] = std::move(group);
      }
    }
#else
    TORCH_CHECK(
        false,
        "tensors on ",
        dataDevice_,
        " need the NCCL transport, which this tpipe was built without");
#endif
  }

  int processOf(int stage) const {
    const int rank = placement_.empty() ? stage % communicator_.pipelineRanks()
                                        : placement_[stage];
    return communicator_.replica() * communicator_.pipelineRanks() + rank;
  }

  int tag(Direction direction, int boundary, int microBatch, int part) const {
    return ((boundary * 2 + static_cast<int>(direction)) * microBatches_ +
            microBatch) *
        partsPerTransfer_ +
        part;
  }

  void waitReceive(
      c10::intrusive_ptr<c10d::Work> work,
      int peer,
      const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(receiving_);
      current_ = work;
    }
    try {
      impl_.wait(work, peer, what); // NOLINT: rethrows naming the peer
    } catch (...) {
      std::lock_guard<std::mutex> lock(receiving_);
      current_.reset();
      throw;
    }
    std::lock_guard<std::mutex> lock(receiving_);
    current_.reset();
  }

  std::vector<int> placement_;
  Communicator& communicator_;
  Communicator::Impl& impl_;
  int stages_;
  int microBatches_;
  int partsPerTransfer_;   // a header and a data message per tensor
  c10::Device dataDevice_; // where transfers live: CPU (Gloo) or a GPU
#ifdef TPIPE_USE_NCCL
  std::map<int, c10::intrusive_ptr<c10d::ProcessGroupNCCL>> deviceGroups_;
#endif
  LocalTransport local_;
  std::mutex receiving_;
  c10::intrusive_ptr<c10d::Work> current_;
  c10::optional<StepShapes> shapes_;
  std::unordered_map<int64_t, Posted> posted_; // by key(), under receiving_
  std::vector<StepShapes::Receive> toPost_;    // in schedule order
  size_t nextPost_ = 0;                        // under receiving_
  SendReaper sends_; // last: its thread waits through impl_
};

std::unique_ptr<Transport> makeProcessGroupTransport(
    const std::vector<int>& placement,
    Communicator& communicator,
    int stages,
    int microBatches,
    int slots,
    c10::Device dataDevice) {
  return std::make_unique<ProcessGroupTransport>(
      placement, communicator, stages, microBatches, slots, dataDevice);
}

c10::Device transferDevice(
    const std::vector<c10::Device>& rankDevices,
    int rank,
    bool nccl) {
#ifdef TPIPE_USE_NCCL
  const c10::Device mine = rankDevices.at(rank);
  const bool shared =
      std::count(rankDevices.begin(), rankDevices.end(), mine) > 1;
  return nccl && mine.is_cuda() && !shared ? mine : c10::Device(c10::kCPU);
#else
  return c10::kCPU;
#endif
}

} // namespace runtime
} // namespace tpipe
#endif // TPIPE_NO_C10D
