// The communicator's state behind tpipe/distributed.h, shared by the two
// files that touch c10d: communicator.cpp (rendezvous, clocks, collectives)
// and c10d_transport.cpp (point-to-point transfers). No other file includes
// c10d headers.
#pragma once
#ifndef TPIPE_NO_C10D

#include <chrono>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#ifdef TPIPE_USE_NCCL
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL // the header's guard; a CUDA LibTorch may not define it
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif

#include "runtime/socket_channels.h"
#include "runtime/store.h"
#include "tpipe/distributed.h"

namespace tpipe {

struct Communicator::Impl {
  WorldInfo world;
  int pipelineRanks = 1;
  std::chrono::milliseconds timeout{60000};
  std::shared_ptr<runtime::StoreServer> storeServer; // rank 0
  c10::intrusive_ptr<c10d::Store> store;
  int storeCalls = 0; // numbers the keys of store collectives
  // Unix-socket channels to the ranks on this host: transfers, and the
  // per-step sums when the whole world is on it.
  std::unique_ptr<runtime::SocketChannels> sockets;
  int64_t socketSums = 0; // numbers the sums' keys
  // The world's sum of `mine` (every rank on this host): the others send
  // theirs to rank 0, which adds them in rank order and sends the total
  // back. Two socket hops instead of Gloo's ring through its threads.
  at::Tensor sumOverSockets(const at::Tensor& mine);
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
      noteIfClosed(peer, reason);
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

  // Peers whose connection this rank saw close (end of stream, reset,
  // broken pipe): their process ended, unlike a silent peer's, so a failed
  // step's accounts are not waited for from them. Noted from any thread that
  // waits on a peer.
  std::mutex closedMutex;
  std::set<int> closedPeers;
  void noteIfClosed(int peer, const std::string& reason) {
    // Our sockets say "connection closed"; Gloo "Connection closed by peer".
    // Gloo's "Socket closed" is this side's own closing, and says nothing.
    for (const char* closed :
         {"onnection closed", "reset by peer", "Broken pipe"}) {
      if (reason.find(closed) != std::string::npos) {
        std::lock_guard<std::mutex> lock(closedMutex);
        closedPeers.insert(peer);
        return;
      }
    }
  }
  std::vector<int> closedPeerList() {
    std::lock_guard<std::mutex> lock(closedMutex);
    return {closedPeers.begin(), closedPeers.end()};
  }

  // A failure outside c10d (a socket's), worded as withPeer words Gloo's.
  [[noreturn]] void blame(
      int peer,
      const std::string& what,
      const std::exception& error) {
    const std::string reason = error.what();
    withPeer(peer, what, [&]() -> int { throw std::runtime_error(reason); });
    TORCH_INTERNAL_ASSERT(false, "unreachable");
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

} // namespace tpipe
#endif // TPIPE_NO_C10D
