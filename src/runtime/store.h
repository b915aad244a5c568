// tpipe's rendezvous store: a c10d::Store over TCP that admits only the
// ranks of one job, and never lets a peer hold anyone up past the timeout.
//
// Why not c10d's TCPStore: LibTorch 1.13's listens on every interface, waits
// without bound for a client that sends half a message, allocates whatever
// length a message announces, and admits any process that reaches the port.
//
// What this one promises:
// - The server listens on one address (MASTER_ADDR's, loopback for local
//   jobs), from one thread that polls every connection: a slow or silent
//   client holds up nobody but itself, and is dropped when a message stays
//   incomplete for frameTimeout. Messages are length-prefixed and capped
//   (kMaxMessageBytes); unauthenticated connections may send only the
//   handshake (a few dozen bytes) and are capped in number.
// - Handshake: the server greets with a protocol line and a random nonce;
//   the client answers with its rank and a keyed hash (SipHash-2-4, keyed
//   by the job token) of the nonce; the server answers with its own proof,
//   so each side knows the other holds the token. Wrong proofs are refused
//   with a reason the client prints.
// - Every client call (connect, request, wait) ends by its deadline with a
//   c10::Error naming the store's address and what was awaited.
//
// What a hostile host that can reach the port can still do: open
// connections up to the cap and so delay or deny rendezvous (the ranks then
// fail with a timeout naming the store), and observe traffic (nothing is
// encrypted: keys hold addresses and the run description, never the
// token). It cannot read or write keys, or join the job, without the token.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace tpipe {
namespace runtime {

constexpr size_t kMaxMessageBytes = 1 << 20;

// Hex digest of SipHash-2-4 with a key derived from `secret`: a job's
// proof of the token, and the run-description fingerprint.
std::string keyedHash(const std::string& secret, const std::string& message);

class StoreServer;

// Runs the server on its own thread until destroyed.
std::shared_ptr<StoreServer> startStoreServer(
    const std::string& bindAddress,
    int port,
    const std::string& token,
    std::chrono::milliseconds frameTimeout);

class RendezvousStore : public c10d::Store {
 public:
  // Connects (retrying refused connections until the timeout: the server
  // may start later) and completes the handshake as `rank`.
  RendezvousStore(
      const std::string& address,
      int port,
      int rank,
      const std::string& token,
      std::chrono::milliseconds timeout);
  ~RendezvousStore() override;

  // Shares this connection (calls are serialized); newer LibTorch asks.
  c10::intrusive_ptr<c10d::Store> clone();

  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> compareSet(
      const std::string& key,
      const std::vector<uint8_t>& expected,
      const std::vector<uint8_t>& desired) override;
  std::vector<uint8_t> get(const std::string& key) override;
  int64_t add(const std::string& key, int64_t value) override;
  bool deleteKey(const std::string& key) override;
  bool check(const std::vector<std::string>& keys) override;
  int64_t getNumKeys() override;
  void wait(const std::vector<std::string>& keys) override;
  void wait(
      const std::vector<std::string>& keys,
      const std::chrono::milliseconds& timeout) override;

 private:
  struct Connection;
  std::shared_ptr<Connection> connection_;
  explicit RendezvousStore(std::shared_ptr<Connection> connection);
};

} // namespace runtime
} // namespace tpipe
