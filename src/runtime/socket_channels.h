// Transfers between ranks on one host over Unix domain sockets, without
// c10d. Gloo's TCP path costs 100-300 us per message on loopback (its own
// threads hand every message on twice); a socket the receiving worker reads
// itself costs one system call on each side, so small, frequent transfers
// (an mlp's micro-batches) stop paying more than they compute.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

namespace tpipe {
namespace runtime {

// One stream socket to each rank on this host, read by the receiving
// worker itself; sends leave at once or, when the socket is full, from a
// thread of the channel's own, so a send never blocks the worker and two
// ranks sending to each other cannot deadlock. Messages carry a header
// (key, slot, count, dtype, shape) and arrive in send order; a receive that
// meets another key's message first keeps it for whoever asks for it.
// Transfers use keys >= 0; the communicator's sums use negative ones.
//
// Two ranks are "on one host" when their tickets (published in the
// rendezvous) name the same boot and the same network namespace, where an
// abstract Unix socket name is visible. A ticket also holds a random
// secret that a connecting rank must present: any local process can find
// an abstract name, but only ranks holding the job token read the store.
// TPIPE_P2P=gloo withholds the ticket, so a rank that sets it talks to every
// peer over Gloo. Failures are std::runtime_error saying what happened
// ("connection closed", "timed out after ..."); the caller names the peer.
class SocketChannels {
 public:
  // Listens, unless TPIPE_P2P=gloo or the host has no abstract sockets.
  SocketChannels(int rank, std::chrono::milliseconds timeout);
  ~SocketChannels();
  SocketChannels(const SocketChannels&) = delete;
  SocketChannels& operator=(const SocketChannels&) = delete;

  // What other ranks need to connect: empty when this rank does not listen.
  const std::string& ticket() const;
  // `tickets[r]`: rank r's ticket. Connects to the ranks above on this
  // host and accepts those below (a connect completes against the
  // listener's backlog, so no order of arrival deadlocks); blocks at most
  // the timeout for each.
  void connect(const std::vector<std::string>& tickets);

  bool reaches(int peer) const;
  // Whether every other rank of `worldSize` has a channel.
  bool reachesAll(int worldSize) const;
  // Copies the tensors out before returning or holds them until sent.
  void send(int peer, int64_t key, const std::vector<at::Tensor>& tensors);
  // Blocks until all `count` tensors of `key` from `peer` are in (the
  // first message says how many); StepAborted after abort().
  std::vector<at::Tensor> receive(int peer, int64_t key);
  // Before a step: refuses streams an aborted step left mid-message.
  void begin();
  // Wakes every wait with StepAborted; the streams are unusable after.
  void abort();
  // Waits until every send has left; throws the first failure, naming
  // the peer's rank in `failedPeer`.
  void drain(int* failedPeer);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Whether this process offers socket channels (TPIPE_P2P is not "gloo").
bool socketChannelsWanted();

} // namespace runtime
} // namespace tpipe
