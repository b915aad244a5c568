// The communicator (tpipe/distributed.h): the world from the environment,
// rendezvous through the store, clock offsets, the collectives of the step
// (sums, broadcasts, gradient averaging). Built without Gloo's headers
// (TPIPE_NO_C10D) it and the c10d transport are stubs: one process only.
#include <exception>
#include "runtime/c10d_transport.h"

#include <algorithm>
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
Communicator::FailureAccounts Communicator::reportFailure(
    const std::string& line,
    std::chrono::milliseconds) {
  return {{line}, {false}};
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

#include <c10/core/impl/VirtualGuardImpl.h>
#include <nlohmann/json.hpp>

#include "runtime/network.h"
#include "runtime/store.h"
#include "json_input.h"
#include "tpipe/errors.h"
#include "runtime/c10d_world.h"

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

// Set in a job's store by its first rank to fail: a rank that a restart
// policy starts again while the old job's rank 0 still winds down (its
// store still answering) must wait for the new job, not join the old one.
const char* const kEndedKey = "tpipe/ended";

struct EndedJob {}; // the store reached belongs to a job that has failed

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
void claimRank(
    c10d::Store& store,
    const WorldInfo& world,
    std::chrono::milliseconds timeout) {
  if (store.check({kEndedKey}))
    throw EndedJob{};
  const int64_t claims = store.add(claimKey(world.rank), 1);
  if (claims > 1) {
    // The first claim may be this rank's previous process, in a job whose
    // failure its other ranks are about to mark.
    const auto deadline = std::chrono::steady_clock::now() +
        std::min(timeout, std::chrono::milliseconds(3000));
    while (std::chrono::steady_clock::now() < deadline) {
      bool ended = false;
      try {
        ended = store.check({kEndedKey});
      } catch (const std::exception&) {
        ended = true; // the store's host is gone with its job
      }
      if (ended)
        throw EndedJob{};
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
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
    const std::string& socketTicket,
    std::chrono::milliseconds timeout) {
  char host[256] = "?";
  gethostname(host, sizeof host - 1);
  nlohmann::json mine = {
      {"address", local.address},
      {"interface", local.interface},
      {"host", host},
      {"sockets", socketTicket}};
  try {
    mine["run"] = nlohmann::json::parse(runDescription);
  } catch (const nlohmann::json::exception&) {
    TORCH_INTERNAL_ASSERT(false, "the run description is not JSON");
  }
  const std::string text = mine.dump();
  claimRank(store, world, timeout);
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
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  impl_->sockets =
      std::make_unique<runtime::SocketChannels>(world.rank, timeout);
  std::vector<nlohmann::json> ranks;
  for (bool said = false;;) {
    impl_->store = joinStore(world, timeout, impl_->storeServer);
    try {
      ranks = agreeOnRun(
          *impl_->store,
          world,
          local,
          runDescription,
          impl_->sockets->ticket(),
          timeout);
      break;
    } catch (const EndedJob&) {
      impl_->store.reset();
      if (std::chrono::steady_clock::now() > deadline) {
        throw UserError(
            "rank " + std::to_string(world.rank) + ": the job at " +
            world.masterAddr + ":" + std::to_string(world.masterPort) +
            " has failed, and no new one started there within " +
            std::to_string(timeout.count() / 1000) + " s");
      }
      if (!said) {
        std::cout << "rank " << world.rank << ": the job at "
                  << world.masterAddr << ":" << world.masterPort
                  << " is ending after a failure; waiting for its restart"
                  << std::endl;
        said = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  }
  const auto explain = explainGloo(ranks, timeout);
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
  std::vector<std::string> tickets;
  for (const auto& rank : ranks)
    tickets.push_back(rank.value("sockets", ""));
  try {
    impl_->sockets->connect(tickets);
  } catch (const std::runtime_error& error) {
    TORCH_CHECK(false, "connecting to the ranks on this host: ", error.what());
  }
}

Communicator::~Communicator() {
  // Leaving through an error: tell a restarted rank that this job is over.
  if (std::uncaught_exceptions() > 0 && impl_ && impl_->store) {
    try {
      impl_->store->set(kEndedKey, std::vector<uint8_t>{1});
    } catch (const std::exception&) {
    }
  }
}

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

Communicator::FailureAccounts Communicator::reportFailure(
    const std::string& line,
    std::chrono::milliseconds grace) {
  const auto ranks = static_cast<size_t>(worldSize());
  FailureAccounts accounts;
  accounts.lines.resize(ranks);
  accounts.closed.assign(ranks, false);
  accounts.lines[static_cast<size_t>(rank())] = line;
  for (int peer : impl_->closedPeerList())
    accounts.closed[static_cast<size_t>(peer)] = true;
  auto key = [](int r) { return "tpipe/failure/" + std::to_string(r); };
  auto closedKey = [](int r) { return "tpipe/closed/" + std::to_string(r); };
  try {
    auto& store = *impl_->store;
    store.set(kEndedKey, std::vector<uint8_t>{1});
    for (size_t r = 0; r < ranks; ++r) {
      if (accounts.closed[r])
        store.set(closedKey(static_cast<int>(r)), std::vector<uint8_t>{1});
    }
    store.set(key(rank()), std::vector<uint8_t>(line.begin(), line.end()));
    const auto now = [] { return std::chrono::steady_clock::now(); };
    auto deadline = now() + grace;
    // A rank seen closing may still be alive: Gloo closes a pair whose wait
    // timed out, and that rank posts its account moments later.
    const auto linger = std::chrono::milliseconds(300);
    for (;;) {
      bool onlyClosedMissing = true, closedMissing = false;
      for (size_t r = 0; r < ranks; ++r) {
        if (!accounts.lines[r].empty())
          continue;
        const int peer = static_cast<int>(r);
        if (store.check({key(peer)})) {
          const std::vector<uint8_t> value = store.get(key(peer));
          accounts.lines[r].assign(value.begin(), value.end());
          continue;
        }
        if (!accounts.closed[r] && store.check({closedKey(peer)}))
          accounts.closed[r] = true;
        if (accounts.closed[r])
          closedMissing = true;
        else
          onlyClosedMissing = false;
      }
      if (onlyClosedMissing && !closedMissing)
        break;
      if (onlyClosedMissing)
        deadline = std::min(deadline, now() + linger);
      if (now() >= deadline)
        break;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  } catch (const std::exception& error) {
    // The store's host is gone: only the accounts read so far are known.
    const std::string what = error.what();
    accounts.storeLost = what.substr(0, what.find('\n'));
  }
  return accounts;
}

std::chrono::milliseconds Communicator::timeout() const {
  return impl_->timeout;
}

at::Tensor Communicator::Impl::sumOverSockets(const at::Tensor& mine) {
  const int64_t key = -(++socketSums); // transfers' keys are >= 0
  const std::string what = "summing across the world";
  auto withRank = [&](int peer, const auto& body) {
    try {
      return body();
    } catch (const std::exception& error) {
      blame(peer, what, error);
    }
  };
  if (world.rank != 0) {
    withRank(0, [&] {
      sockets->send(0, key, {mine});
      return 0;
    });
    return withRank(0, [&] { return sockets->receive(0, key).at(0); });
  }
  at::Tensor total = mine.clone();
  for (int peer = 1; peer < world.worldSize; ++peer)
    total += withRank(peer, [&] { return sockets->receive(peer, key).at(0); });
  for (int peer = 1; peer < world.worldSize; ++peer) {
    withRank(peer, [&] {
      sockets->send(peer, key, {total});
      return 0;
    });
  }
  return total;
}

std::vector<double> Communicator::sum(const std::vector<double>& values) {
  std::vector<double> all = values;
  all.insert(all.end(), impl_->riders.begin(), impl_->riders.end());
  std::vector<at::Tensor> tensors{
      at::empty({static_cast<int64_t>(all.size())}, at::kDouble)};
  std::copy(all.begin(), all.end(), tensors[0].data_ptr<double>());
  if (impl_->sockets->reachesAll(worldSize())) {
    tensors[0] = impl_->sumOverSockets(tensors[0]);
  } else {
    impl_->complete(
        rank() == 0 ? 1 % worldSize() : 0, "summing across the world", [&] {
          return impl_->worldGroup->allreduce(tensors);
        });
  }
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

} // namespace tpipe
#endif // TPIPE_NO_C10D
