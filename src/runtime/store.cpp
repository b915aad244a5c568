// tpipe's rendezvous store (see store.h).
#include "runtime/store.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <iostream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <c10/util/Exception.h>

namespace tpipe {
namespace runtime {
namespace {

using Clock = std::chrono::steady_clock;
using Bytes = std::vector<uint8_t>;

// ---- SipHash-2-4 --------------------------------------------------------

uint64_t rotl(uint64_t x, int b) {
  return (x << b) | (x >> (64 - b));
}

uint64_t sipHash(uint64_t k0, uint64_t k1, const std::string& message) {
  uint64_t v0 = 0x736f6d6570736575ULL ^ k0, v1 = 0x646f72616e646f6dULL ^ k1;
  uint64_t v2 = 0x6c7967656e657261ULL ^ k0, v3 = 0x7465646279746573ULL ^ k1;
  auto round = [&] {
    v0 += v1;
    v1 = rotl(v1, 13);
    v1 ^= v0;
    v0 = rotl(v0, 32);
    v2 += v3;
    v3 = rotl(v3, 16);
    v3 ^= v2;
    v0 += v3;
    v3 = rotl(v3, 21);
    v3 ^= v0;
    v2 += v1;
    v1 = rotl(v1, 17);
    v1 ^= v2;
    v2 = rotl(v2, 32);
  };
  const size_t n = message.size();
  for (size_t i = 0; i + 8 <= n; i += 8) {
    uint64_t m = 0;
    for (int b = 0; b < 8; ++b)
      m |= static_cast<uint64_t>(static_cast<uint8_t>(message[i + b]))
          << (8 * b);
    v3 ^= m;
    round();
    round();
    v0 ^= m;
  }
  uint64_t last = static_cast<uint64_t>(n & 0xff) << 56;
  for (size_t i = n - n % 8, b = 0; i < n; ++i, ++b) {
    last |= static_cast<uint64_t>(static_cast<uint8_t>(message[i])) << (8 * b);
  }
  v3 ^= last;
  round();
  round();
  v0 ^= last;
  v2 ^= 0xff;
  for (int i = 0; i < 4; ++i)
    round();
  return v0 ^ v1 ^ v2 ^ v3;
}

// ---- Messages: u32 length, then an op byte and fields -------------------

enum Op : uint8_t {
  kHello = 1,
  kSet,
  kGet,
  kAdd,
  kCompareSet,
  kDelete,
  kCheck,
  kNumKeys,
  kWait,
  kOk,
  kError
};

class Writer {
 public:
  explicit Writer(uint8_t op) {
    bytes_.push_back(op);
  }
  Writer& text(const std::string& value) {
    return raw(value.data(), value.size());
  }
  Writer& bytes(const Bytes& value) {
    return raw(value.data(), value.size());
  }
  Writer& number(int64_t value) {
    for (int b = 7; b >= 0; --b)
      bytes_.push_back(
          static_cast<uint8_t>(static_cast<uint64_t>(value) >> (8 * b)));
    return *this;
  }
  // The framed message.
  Bytes frame() const {
    Bytes out(4 + bytes_.size());
    const uint32_t n = static_cast<uint32_t>(bytes_.size());
    for (int b = 0; b < 4; ++b)
      out[b] = static_cast<uint8_t>(n >> (8 * (3 - b)));
    std::copy(bytes_.begin(), bytes_.end(), out.begin() + 4);
    return out;
  }

 private:
  Writer& raw(const void* data, size_t size) {
    number(static_cast<int64_t>(size));
    const auto* p = static_cast<const uint8_t*>(data);
    bytes_.insert(bytes_.end(), p, p + size);
    return *this;
  }
  Bytes bytes_;
};

// Reads fields back; a malformed message throws std::runtime_error.
class Reader {
 public:
  explicit Reader(const Bytes& payload) : payload_(payload) {
    if (payload.empty())
      throw std::runtime_error("empty message");
    op_ = payload[0];
  }
  uint8_t op() const {
    return op_;
  }
  bool done() const {
    return at_ == payload_.size();
  }
  int64_t number() {
    need(8);
    uint64_t value = 0;
    for (int b = 0; b < 8; ++b)
      value = (value << 8) | payload_[at_++];
    return static_cast<int64_t>(value);
  }
  Bytes bytes() {
    const int64_t size = number();
    if (size < 0)
      throw std::runtime_error("negative length");
    need(static_cast<size_t>(size));
    Bytes out(
        payload_.begin() + static_cast<std::ptrdiff_t>(at_),
        payload_.begin() + static_cast<std::ptrdiff_t>(at_ + size));
    at_ += static_cast<size_t>(size);
    return out;
  }
  std::string text() {
    const Bytes raw = bytes();
    return std::string(raw.begin(), raw.end());
  }

 private:
  void need(size_t n) const {
    if (payload_.size() - at_ < n)
      throw std::runtime_error("truncated message");
  }
  const Bytes& payload_;
  size_t at_ = 1;
  uint8_t op_ = 0;
};

// Complete frames at the front of `buffer` (removed); throws on a length
// over `limit`.
bool takeFrame(Bytes& buffer, size_t limit, Bytes& payload) {
  if (buffer.size() < 4)
    return false;
  const uint32_t n = (uint32_t{buffer[0]} << 24) | (uint32_t{buffer[1]} << 16) |
      (uint32_t{buffer[2]} << 8) | uint32_t{buffer[3]};
  if (n > limit)
    throw std::runtime_error(
        "a message of " + std::to_string(n) + " bytes (limit " +
        std::to_string(limit) + ")");
  if (buffer.size() < 4 + static_cast<size_t>(n))
    return false;
  payload.assign(buffer.begin() + 4, buffer.begin() + 4 + n);
  buffer.erase(buffer.begin(), buffer.begin() + 4 + n);
  return true;
}

const char kGreeting[] = "TPIPE-STORE/1";
constexpr size_t kHandshakeLimit = 256;
constexpr size_t kMaxPendingHandshakes = 64;
constexpr size_t kMaxConnections = 4096;
constexpr size_t kMaxStoredBytes = size_t{256} << 20;

std::string randomNonce() {
  std::random_device device;
  std::string nonce;
  const char* digits = "0123456789abcdef";
  for (int i = 0; i < 32; ++i)
    nonce += digits[device() % 16];
  return nonce;
}

std::string clientProof(
    const std::string& token,
    const std::string& nonce,
    int64_t rank) {
  return keyedHash(token, nonce + ":client:" + std::to_string(rank));
}

std::string serverProof(const std::string& token, const std::string& nonce) {
  return keyedHash(token, nonce + ":server");
}

sockaddr_storage resolve(
    const std::string& address,
    int port,
    socklen_t& length) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int status = getaddrinfo(
      address.c_str(), std::to_string(port).c_str(), &hints, &found);
  TORCH_CHECK(
      status == 0 && found,
      "cannot resolve '",
      address,
      "': ",
      gai_strerror(status));
  sockaddr_storage out{};
  std::memcpy(&out, found->ai_addr, found->ai_addrlen);
  length = found->ai_addrlen;
  freeaddrinfo(found);
  return out;
}

void setNonBlocking(int fd) {
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL, 0) | O_NONBLOCK);
}

int millisecondsLeft(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - Clock::now())
                        .count();
  return static_cast<int>(
      std::max<int64_t>(0, std::min<int64_t>(left, 1 << 30)));
}

// poll, resumed after a signal handler ran: a launched rank told to stop
// (SIGTERM, when another rank failed) is at that moment posting its account
// of the failure, and a store call cut short lost it: both survivors of a
// dead rank then said that the other had sent none.
int pollUntil(pollfd& fds, Clock::time_point deadline) {
  for (;;) {
    const int ready = poll(&fds, 1, millisecondsLeft(deadline));
    if (ready >= 0 || errno != EINTR)
      return ready;
  }
}

bool interruptedOrWouldBlock() {
  return errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK;
}

} // namespace

std::string keyedHash(const std::string& secret, const std::string& message) {
  const uint64_t k0 = sipHash(
      0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL, "tpipe-key-0:" + secret);
  const uint64_t k1 = sipHash(
      0x0706050403020100ULL, 0x0f0e0d0c0b0a0908ULL, "tpipe-key-1:" + secret);
  char text[33];
  std::snprintf(
      text,
      sizeof text,
      "%016llx%016llx",
      static_cast<unsigned long long>(sipHash(k0, k1, message)),
      static_cast<unsigned long long>(sipHash(k1, k0, message)));
  return text;
}

// ---- Server ------------------------------------------------------------

class StoreServer {
 public:
  StoreServer(
      const std::string& bindAddress,
      int port,
      std::string token,
      std::chrono::milliseconds frameTimeout)
      : token_(std::move(token)), frameTimeout_(frameTimeout) {
    socklen_t length = 0;
    sockaddr_storage address = resolve(bindAddress, port, length);
    listener_ = socket(address.ss_family, SOCK_STREAM, 0);
    TORCH_CHECK(
        listener_ >= 0,
        "store: cannot create a socket: ",
        std::strerror(errno));
    const int on = 1;
    setsockopt(listener_, SOL_SOCKET, SO_REUSEADDR, &on, sizeof on);
    if (bind(listener_, reinterpret_cast<sockaddr*>(&address), length) != 0 ||
        listen(listener_, 128) != 0) {
      const std::string reason = std::strerror(errno);
      close(listener_);
      TORCH_CHECK(
          false,
          "cannot listen on ",
          bindAddress,
          ":",
          port,
          " for the rendezvous store (",
          reason,
          "; is MASTER_PORT taken, or MASTER_ADDR not an address of this host?)");
    }
    setNonBlocking(listener_);
    if (pipe(wake_) != 0)
      TORCH_CHECK(false, "store: pipe: ", std::strerror(errno));
    thread_ = std::thread([this] { serve(); });
  }

  ~StoreServer() {
    stop_ = true;
    const char byte = 0;
    (void)!write(wake_[1], &byte, 1);
    thread_.join();
    for (auto& client : clients_)
      close(client.fd);
    close(listener_);
    close(wake_[0]);
    close(wake_[1]);
  }
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

 private:
  struct Client {
    int fd = -1;
    std::string peer, nonce;
    bool authenticated = false;
    bool closing = false; // close once `out` is flushed
    Bytes in, out;
    Clock::time_point since; // accepted, or the first byte of a partial message
    Bytes pending;           // a GET or WAIT that waits for keys
  };

  void serve() {
    while (!stop_) {
      std::vector<pollfd> fds{{listener_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
      for (const auto& client : clients_) {
        fds.push_back(
            {client.fd,
             static_cast<short>(POLLIN | (client.out.empty() ? 0 : POLLOUT)),
             0});
      }
      poll(fds.data(), fds.size(), 200);
      if (fds[0].revents & POLLIN)
        accept();
      for (size_t i = 0; i < clients_.size(); ++i) {
        if (fds.size() > i + 2 && fds[i + 2].fd == clients_[i].fd)
          service(clients_[i], fds[i + 2].revents);
      }
      dropStale();
    }
  }

  void accept() {
    for (;;) {
      sockaddr_storage address{};
      socklen_t length = sizeof address;
      const int fd =
          ::accept(listener_, reinterpret_cast<sockaddr*>(&address), &length);
      if (fd < 0)
        return;
      const size_t handshaking = static_cast<size_t>(
          std::count_if(clients_.begin(), clients_.end(), [](const Client& c) {
            return !c.authenticated;
          }));
      if (handshaking >= kMaxPendingHandshakes ||
          clients_.size() >= kMaxConnections) {
        close(fd);
        continue;
      }
      setNonBlocking(fd);
      Client client;
      client.fd = fd;
      char host[NI_MAXHOST] = "?";
      getnameinfo(
          reinterpret_cast<sockaddr*>(&address),
          length,
          host,
          sizeof host,
          nullptr,
          0,
          NI_NUMERICHOST);
      client.peer = host;
      client.nonce = randomNonce();
      client.since = Clock::now();
      client.out = Writer(kOk).text(kGreeting).text(client.nonce).frame();
      clients_.push_back(std::move(client));
    }
  }

  void service(Client& client, short events) {
    if (events & (POLLIN | POLLHUP | POLLERR)) {
      uint8_t buffer[65536];
      const ssize_t n = recv(client.fd, buffer, sizeof buffer, 0);
      if (n <= 0) {
        if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK))
          client.closing = true, client.out.clear();
      } else {
        if (client.in.empty())
          client.since = Clock::now();
        client.in.insert(client.in.end(), buffer, buffer + n);
        handleInput(client);
      }
    }
    if ((events & POLLOUT) && !client.out.empty()) {
      const ssize_t n =
          send(client.fd, client.out.data(), client.out.size(), MSG_NOSIGNAL);
      if (n > 0)
        client.out.erase(client.out.begin(), client.out.begin() + n);
      if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
        client.closing = true, client.out.clear();
    }
  }

  void handleInput(Client& client) {
    Bytes payload;
    try {
      while (client.pending.empty() &&
             takeFrame(
                 client.in,
                 client.authenticated ? kMaxMessageBytes : kHandshakeLimit,
                 payload)) {
        client.since = Clock::now();
        if (!client.authenticated) {
          handshake(client, payload);
        } else {
          answer(client, payload);
        }
        if (client.closing)
          return;
      }
    } catch (const std::exception& error) {
      refuse(client, std::string("malformed message: ") + error.what());
    }
  }

  void handshake(Client& client, const Bytes& payload) {
    Reader reader(payload);
    if (reader.op() != kHello)
      return refuse(client, "expected the tpipe store handshake");
    const int64_t rank = reader.number();
    const std::string proof = reader.text();
    if (proof != clientProof(token_, client.nonce, rank)) {
      std::cerr << "tpipe: the rendezvous store refused a client from "
                << client.peer << " claiming rank " << rank
                << ": it does not hold this job's token\n";
      return refuse(
          client,
          "the job token differs (set the same TPIPE_JOB_TOKEN on every rank)");
    }
    client.authenticated = true;
    append(client, Writer(kOk).text(serverProof(token_, client.nonce)));
  }

  void refuse(Client& client, const std::string& reason) {
    client.in.clear();
    append(client, Writer(kError).text(reason));
    client.closing = true;
  }

  void append(Client& client, const Writer& message) {
    const Bytes frame = message.frame();
    client.out.insert(client.out.end(), frame.begin(), frame.end());
  }

  bool has(const std::vector<std::string>& keys) const {
    return std::all_of(keys.begin(), keys.end(), [&](const std::string& key) {
      return data_.count(key) > 0;
    });
  }

  void store(const std::string& key, Bytes value) {
    auto found = data_.find(key);
    if (found != data_.end())
      stored_ -= found->second.size() + key.size();
    if (stored_ + value.size() + key.size() > kMaxStoredBytes)
      throw std::runtime_error("the store is full");
    stored_ += value.size() + key.size();
    data_[key] = std::move(value);
    for (auto& other : clients_) {
      if (!other.pending.empty()) {
        const Bytes request = std::move(other.pending);
        other.pending.clear();
        answer(other, request);
        handleInput(other);
      }
    }
  }

  static Bytes numberBytes(int64_t value) {
    Bytes out;
    for (int b = 7; b >= 0; --b)
      out.push_back(
          static_cast<uint8_t>(static_cast<uint64_t>(value) >> (8 * b)));
    return out;
  }

  static std::vector<std::string> keysOf(Reader& reader) {
    std::vector<std::string> keys;
    while (!reader.done())
      keys.push_back(reader.text());
    return keys;
  }

  // GET and WAIT wait (the connection stays pending) until the keys exist.
  void answerWait(Client& client, const Bytes& payload, Reader& reader) {
    const std::vector<std::string> keys = keysOf(reader);
    if (!has(keys)) {
      client.pending = payload; // answered when the keys arrive
      return;
    }
    if (reader.op() == kWait)
      return append(client, Writer(kOk));
    append(client, Writer(kOk).bytes(data_[keys.at(0)]));
  }

  void answerAdd(Client& client, Reader& reader) {
    const std::string key = reader.text();
    int64_t value = reader.number();
    if (data_.count(key))
      value += std::stoll(std::string(data_[key].begin(), data_[key].end()));
    const std::string text = std::to_string(value);
    store(key, Bytes(text.begin(), text.end()));
    append(client, Writer(kOk).number(value));
  }

  void answerCompareSet(Client& client, Reader& reader) {
    const std::string key = reader.text();
    const Bytes expected = reader.bytes(), desired = reader.bytes();
    auto found = data_.find(key);
    const bool matches =
        found == data_.end() ? expected.empty() : found->second == expected;
    if (matches)
      store(key, desired);
    found = data_.find(key);
    append(
        client,
        Writer(kOk).bytes(found == data_.end() ? expected : found->second));
  }

  void answerDelete(Client& client, Reader& reader) {
    const std::string key = reader.text();
    auto found = data_.find(key);
    if (found != data_.end())
      stored_ -= found->second.size() + key.size();
    const bool erased = data_.erase(key) > 0;
    append(client, Writer(kOk).number(erased ? 1 : 0));
  }

  void answer(Client& client, const Bytes& payload) {
    Reader reader(payload);
    switch (reader.op()) {
      case kSet: {
        const std::string key = reader.text();
        store(key, reader.bytes());
        return append(client, Writer(kOk));
      }
      case kGet:
      case kWait:
        return answerWait(client, payload, reader);
      case kAdd:
        return answerAdd(client, reader);
      case kCompareSet:
        return answerCompareSet(client, reader);
      case kDelete:
        return answerDelete(client, reader);
      case kCheck: {
        const std::vector<std::string> keys = keysOf(reader);
        return append(client, Writer(kOk).number(has(keys) ? 1 : 0));
      }
      case kNumKeys:
        return append(
            client, Writer(kOk).number(static_cast<int64_t>(data_.size())));
      default:
        return refuse(client, "unknown request");
    }
  }

  // Drops closed connections, handshakes that never finished, and messages
  // left incomplete for longer than frameTimeout.
  void dropStale() {
    const auto now = Clock::now();
    for (auto& client : clients_) {
      const bool stalled = (!client.authenticated || !client.in.empty()) &&
          now - client.since > frameTimeout_;
      if (stalled && !client.closing) {
        client.closing = true;
        client.out.clear();
      }
    }
    auto gone = std::remove_if(
        clients_.begin(), clients_.end(), [](const Client& client) {
          if (!client.closing || !client.out.empty())
            return false;
          close(client.fd);
          return true;
        });
    clients_.erase(gone, clients_.end());
  }

  std::string token_;
  std::chrono::milliseconds frameTimeout_;
  int listener_ = -1;
  int wake_[2] = {-1, -1};
  std::atomic<bool> stop_{false};
  std::vector<Client> clients_;
  std::map<std::string, Bytes> data_;
  size_t stored_ = 0;
  std::thread thread_;
};

std::shared_ptr<StoreServer> startStoreServer(
    const std::string& bindAddress,
    int port,
    const std::string& token,
    std::chrono::milliseconds frameTimeout) {
  return std::make_shared<StoreServer>(bindAddress, port, token, frameTimeout);
}

// ---- Client ------------------------------------------------------------

struct RendezvousStore::Connection {
  std::mutex mutex;
  int fd = -1;
  std::string where; // "10.0.0.1:29500"
  std::chrono::milliseconds timeout{60000};
  Bytes in;

  ~Connection() {
    if (fd >= 0)
      close(fd);
  }

  [[noreturn]] void fail(const std::string& what) const {
    TORCH_CHECK(false, "rendezvous store at ", where, ": ", what);
  }

  void sendAll(
      const Bytes& bytes,
      Clock::time_point deadline,
      const std::string& what) {
    size_t sent = 0;
    while (sent < bytes.size()) {
      pollfd fds{fd, POLLOUT, 0};
      if (pollUntil(fds, deadline) <= 0)
        fail("no progress while " + what);
      const ssize_t n =
          send(fd, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n < 0 && !interruptedOrWouldBlock())
        fail("connection lost while " + what);
      if (n > 0)
        sent += static_cast<size_t>(n);
    }
  }

  Bytes receive(Clock::time_point deadline, const std::string& what) {
    Bytes payload;
    for (;;) {
      try {
        if (takeFrame(in, kMaxMessageBytes, payload))
          return payload;
      } catch (const std::exception& error) {
        fail(std::string("a malformed answer: ") + error.what());
      }
      pollfd fds{fd, POLLIN, 0};
      const int ready = pollUntil(fds, deadline);
      if (ready <= 0) {
        fail(
            "no answer within " +
            std::to_string(timeout.count() / 1000.0).substr(0, 5) +
            " s while " + what);
      }
      uint8_t buffer[65536];
      const ssize_t n = recv(fd, buffer, sizeof buffer, 0);
      if (n == 0)
        fail("the store closed the connection while " + what);
      if (n < 0 && !interruptedOrWouldBlock())
        fail("connection lost while " + what);
      if (n > 0)
        in.insert(in.end(), buffer, buffer + n);
    }
  }

  // One request and its answer (kOk) under the lock.
  Bytes request(
      const Writer& message,
      const std::string& what,
      std::chrono::milliseconds limit) {
    std::lock_guard<std::mutex> lock(mutex);
    const auto deadline = Clock::now() + std::min(limit, timeout);
    sendAll(message.frame(), deadline, what);
    Bytes answer = receive(deadline, what);
    Reader reader(answer);
    if (reader.op() == kError)
      fail(reader.text());
    return answer;
  }

  // Connects, retrying refused connections until the deadline.
  void connect(
      const std::string& address,
      int port,
      Clock::time_point deadline) {
    socklen_t length = 0;
    const sockaddr_storage target = resolve(address, port, length);
    std::string lastError = "no answer";
    while (Clock::now() < deadline) {
      fd = socket(target.ss_family, SOCK_STREAM, 0);
      TORCH_CHECK(
          fd >= 0, "store: cannot create a socket: ", std::strerror(errno));
      setNonBlocking(fd);
      const int on = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &on, sizeof on);
      int status =
          ::connect(fd, reinterpret_cast<const sockaddr*>(&target), length);
      if (status != 0 && errno == EINPROGRESS) {
        pollfd fds{fd, POLLOUT, 0};
        if (poll(&fds, 1, std::min(millisecondsLeft(deadline), 1000)) == 1) {
          int error = 0;
          socklen_t size = sizeof error;
          getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &size);
          status = error == 0 ? 0 : -1;
          errno = error;
        } else {
          errno = ETIMEDOUT;
        }
      }
      if (status == 0)
        return;
      lastError = std::strerror(errno);
      close(fd);
      fd = -1;
      std::this_thread::sleep_for(
          std::chrono::milliseconds(std::min(200, millisecondsLeft(deadline))));
    }
    fail(
        "cannot connect within " +
        std::to_string(timeout.count() / 1000.0).substr(0, 5) + " s (" +
        lastError +
        "): is rank 0 running, and is the port reachable from this host?");
  }

  void handshake(
      int rank,
      const std::string& token,
      Clock::time_point deadline) {
    const std::string what =
        "waiting for the store's greeting (is another program listening on this port?)";
    Bytes greeting = receive(deadline, what);
    Reader reader(greeting);
    std::string protocol, nonce;
    try {
      protocol = reader.text();
      nonce = reader.text();
    } catch (const std::exception&) {
      fail(
          "the listener is not a tpipe rendezvous store (another program on the port?)");
    }
    if (reader.op() != kOk || protocol != kGreeting) {
      fail(
          "the listener is not a tpipe rendezvous store (another program on the port?)");
    }
    sendAll(
        Writer(kHello)
            .number(rank)
            .text(clientProof(token, nonce, rank))
            .frame(),
        deadline,
        "proving the token");
    Bytes answer = receive(deadline, "proving the job token");
    Reader proof(answer);
    if (proof.op() == kError)
      fail("refused this rank: " + proof.text());
    if (proof.text() != serverProof(token, nonce))
      fail("the store does not hold this job's token");
  }
};

RendezvousStore::RendezvousStore(
    const std::string& address,
    int port,
    int rank,
    const std::string& token,
    std::chrono::milliseconds timeout)
    : c10d::Store(timeout), connection_(std::make_shared<Connection>()) {
  connection_->where = address + ":" + std::to_string(port);
  connection_->timeout = timeout;
  const auto deadline = Clock::now() + timeout;
  connection_->connect(address, port, deadline);
  connection_->handshake(rank, token, deadline);
}

RendezvousStore::RendezvousStore(std::shared_ptr<Connection> connection)
    : c10d::Store(connection->timeout), connection_(std::move(connection)) {}

RendezvousStore::~RendezvousStore() = default;

c10::intrusive_ptr<c10d::Store> RendezvousStore::clone() {
  return c10::intrusive_ptr<c10d::Store>(
      c10::intrusive_ptr<RendezvousStore>::reclaim(
          new RendezvousStore(connection_)));
}

void RendezvousStore::set(
    const std::string& key,
    const std::vector<uint8_t>& value) {
  connection_->request(
      Writer(kSet).text(key).bytes(value), "setting '" + key + "'", timeout_);
}

std::vector<uint8_t> RendezvousStore::compareSet(
    const std::string& key,
    const std::vector<uint8_t>& expected,
    const std::vector<uint8_t>& desired) {
  Bytes answer = connection_->request(
      Writer(kCompareSet).text(key).bytes(expected).bytes(desired),
      "comparing '" + key + "'",
      timeout_);
  return Reader(answer).bytes();
}

std::vector<uint8_t> RendezvousStore::get(const std::string& key) {
  Bytes answer = connection_->request(
      Writer(kGet).text(key), "waiting for '" + key + "'", timeout_);
  return Reader(answer).bytes();
}

int64_t RendezvousStore::add(const std::string& key, int64_t value) {
  Bytes answer = connection_->request(
      Writer(kAdd).text(key).number(value),
      "adding to '" + key + "'",
      timeout_);
  return Reader(answer).number();
}

bool RendezvousStore::deleteKey(const std::string& key) {
  Bytes answer = connection_->request(
      Writer(kDelete).text(key), "deleting '" + key + "'", timeout_);
  return Reader(answer).number() != 0;
}

bool RendezvousStore::check(const std::vector<std::string>& keys) {
  Writer message(kCheck);
  for (const auto& key : keys)
    message.text(key);
  Bytes answer = connection_->request(message, "checking keys", timeout_);
  return Reader(answer).number() != 0;
}

int64_t RendezvousStore::getNumKeys() {
  Bytes answer =
      connection_->request(Writer(kNumKeys), "counting keys", timeout_);
  return Reader(answer).number();
}

void RendezvousStore::wait(const std::vector<std::string>& keys) {
  wait(keys, timeout_);
}

// Callers (Gloo) may ask for LibTorch's 300 s default: the job's timeout
// bounds every wait all the same.
void RendezvousStore::wait(
    const std::vector<std::string>& keys,
    const std::chrono::milliseconds& timeout) {
  Writer message(kWait);
  std::string names;
  for (const auto& key : keys) {
    message.text(key);
    names += (names.empty() ? "'" : ", '") + key + "'";
  }
  const auto limit =
      timeout.count() > 0 ? std::min(timeout, timeout_) : timeout_;
  connection_->request(message, "waiting for " + names, limit);
}

} // namespace runtime
} // namespace tpipe
