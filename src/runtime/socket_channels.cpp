// Same-host transfers over Unix domain sockets (runtime/socket_channels.h).
#include "runtime/socket_channels.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>
#include <poll.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <stdexcept>
#include <thread>

#include <ATen/ops/empty.h>

#include "runtime/transport.h"

namespace tpipe {
namespace runtime {
namespace {

constexpr int64_t kSocketMagic = 0x7470697065736f63; // "tpipesoc"
constexpr int kSocketMaxDims = 8;

// What precedes each tensor on a stream.
struct Header {
  int64_t magic, key, slot, count, dtype, dims, bytes;
  int64_t shape[kSocketMaxDims];
};

// What a connecting rank first sends: its rank, and the listener's secret,
// which only ranks that read the rendezvous store (the job token guards
// it) know; any other local process that finds the abstract name is shut
// out.
struct Hello {
  int64_t magic, rank;
  char secret[32];
};

[[noreturn]] void failWithErrno(const std::string& what) {
  throw std::runtime_error(what + ": " + std::strerror(errno));
}

// The boot and the network namespace: two processes that share both can
// reach each other's abstract socket names.
std::string hostIdentity() {
  std::ifstream bootFile("/proc/sys/kernel/random/boot_id");
  std::string boot;
  std::getline(bootFile, boot);
  char link[128];
  const ssize_t length = ::readlink("/proc/self/ns/net", link, sizeof link);
  if (boot.empty() || length <= 0)
    return "";
  return boot + "/" + std::string(link, static_cast<size_t>(length));
}

sockaddr_un abstractAddress(const std::string& name, socklen_t* length) {
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  // A leading NUL: Linux's abstract namespace, gone with the socket.
  std::memcpy(address.sun_path + 1, name.data(), name.size());
  *length =
      static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
  return address;
}

// Silence beyond `timeout` fails a read or a send. A send buffer as large
// as the system allows (net.core.wmem_max) lets a micro-batch's activation
// leave at once and wait in the kernel until the receiver reads it.
void configure(int fd, std::chrono::milliseconds timeout) {
  const int buffer = 64 << 20;
  ::setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &buffer, sizeof buffer);
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>(timeout.count() % 1000 * 1000);
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
}

// Reads exactly `size` bytes; a closed stream or silence beyond the
// socket's timeout is an error (or StepAborted once `aborted`).
void readExactly(
    int fd,
    void* into,
    size_t size,
    const std::atomic<bool>& aborted,
    std::chrono::milliseconds timeout) {
  auto* bytes = static_cast<char*>(into);
  while (size > 0) {
    const ssize_t got = ::recv(fd, bytes, size, MSG_WAITALL);
    if (got > 0) {
      bytes += got, size -= static_cast<size_t>(got);
      continue;
    }
    if (got < 0 && errno == EINTR)
      continue;
    if (aborted)
      throw StepAborted();
    if (got == 0)
      throw std::runtime_error("connection closed");
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      throw std::runtime_error(
          "timed out after " + std::to_string(timeout.count() / 1000.0) + " s");
    }
    failWithErrno("reading from the socket");
  }
}

struct Message {
  Header header;
  at::Tensor tensor;
};

// Bytes of one tensor's message still to send: its header, then its data.
struct Outgoing {
  Header header;
  at::Tensor data; // contiguous
  size_t sent = 0;

  size_t total() const {
    return sizeof header + static_cast<size_t>(header.bytes);
  }

  // One sendmsg from where it stopped; the bytes it took, or -1.
  ssize_t sendSome(int fd, int flags) {
    iovec parts[2];
    int count = 0;
    if (sent < sizeof header) {
      parts[count++] = {
          reinterpret_cast<char*>(&header) + sent, sizeof header - sent};
    }
    const size_t dataSent = sent > sizeof header ? sent - sizeof header : 0;
    if (header.bytes > 0) {
      parts[count++] = {
          static_cast<char*>(data.data_ptr()) + dataSent,
          static_cast<size_t>(header.bytes) - dataSent};
    }
    msghdr message{};
    message.msg_iov = parts;
    message.msg_iovlen = static_cast<size_t>(count);
    const ssize_t took = ::sendmsg(fd, &message, flags | MSG_NOSIGNAL);
    if (took > 0)
      sent += static_cast<size_t>(took);
    return took;
  }
};

} // namespace

struct SocketChannels::Impl {
  struct Channel {
    int peer = -1;
    int fd = -1;
    // Receiving: one worker reads at a time; messages for other keys wait
    // here for theirs.
    std::mutex receiveMutex;
    std::condition_variable arrived;
    bool reading = false;
    std::map<int64_t, std::vector<at::Tensor>> slots;
    std::map<int64_t, int64_t> missing;
    // Sending: what the socket could not take at once, oldest first; the
    // front is being written by `sender`.
    std::mutex sendMutex;
    std::condition_variable sendChanged;
    std::deque<Outgoing> queue;
    std::string sendError;
    std::thread sender;
  };

  int rank;
  std::chrono::milliseconds timeout;
  std::map<int, std::unique_ptr<Channel>> channels;
  std::atomic<bool> aborted{false};
  std::atomic<bool> broken{false};
  std::atomic<bool> stopping{false};

  Channel& channel(int peer) {
    auto found = channels.find(peer);
    if (found == channels.end())
      throw std::logic_error(
          "no socket channel to rank " + std::to_string(peer));
    return *found->second;
  }

  void sendLoop(Channel& c) {
    std::unique_lock<std::mutex> lock(c.sendMutex);
    for (;;) {
      c.sendChanged.wait(lock, [&] { return stopping || !c.queue.empty(); });
      if (stopping)
        return;
      Outgoing& front = c.queue.front(); // deque: stays put while pushed to
      lock.unlock();
      std::string failure;
      while (front.sent < front.total()) {
        if (front.sendSome(c.fd, 0) >= 0)
          continue;
        if (errno == EINTR)
          continue;
        failure = errno == EAGAIN || errno == EWOULDBLOCK
            ? "timed out after " + std::to_string(timeout.count() / 1000.0) +
                " s while the rank did not read"
            : std::string("sending: ") + std::strerror(errno);
        break;
      }
      lock.lock();
      if (!failure.empty()) {
        if (c.sendError.empty())
          c.sendError = aborted ? "step aborted" : failure;
        c.queue.clear();
      } else {
        c.queue.pop_front();
      }
      c.sendChanged.notify_all();
    }
  }

  // Under c.receiveMutex: files a message under its key.
  void file(Channel& c, Message message) {
    const Header& h = message.header;
    auto& slots = c.slots[h.key];
    if (slots.empty()) {
      slots.resize(static_cast<size_t>(h.count));
      c.missing[h.key] = h.count;
    }
    if (static_cast<int64_t>(slots.size()) != h.count ||
        slots[static_cast<size_t>(h.slot)].defined()) {
      throw std::runtime_error(
          "sent message " + std::to_string(h.key) + " slot " +
          std::to_string(h.slot) + " twice or with another count");
    }
    slots[static_cast<size_t>(h.slot)] = std::move(message.tensor);
    --c.missing[h.key];
  }

  Message readMessage(Channel& c) {
    Message message;
    Header& h = message.header;
    readExactly(c.fd, &h, sizeof h, aborted, timeout);
    if (h.magic != kSocketMagic || h.dims < 0 || h.dims > kSocketMaxDims ||
        h.count < 1 || h.slot < 0 || h.slot >= h.count || h.dtype < 0 ||
        h.dtype >= static_cast<int64_t>(c10::ScalarType::NumOptions)) {
      throw std::runtime_error(
          "sent a message tpipe did not expect (a different version on that "
          "rank?)");
    }
    const auto dtype = static_cast<c10::ScalarType>(h.dtype);
    message.tensor = at::empty(
        at::IntArrayRef(h.shape, static_cast<size_t>(h.dims)),
        at::TensorOptions().dtype(dtype));
    if (static_cast<int64_t>(message.tensor.nbytes()) != h.bytes)
      throw std::runtime_error("sent a message whose size fits no tensor");
    readExactly(
        c.fd,
        message.tensor.data_ptr(),
        static_cast<size_t>(h.bytes),
        aborted,
        timeout);
    return message;
  }

  int listener = -1;
  std::string ticket;
  std::string secret; // in the ticket; a connecting rank must present it

  void accept(std::set<int> below);
};

namespace {

int listenOn(const std::string& name) {
  const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    return -1;
  socklen_t length = 0;
  const sockaddr_un address = abstractAddress(name, &length);
  if (::bind(fd, reinterpret_cast<const sockaddr*>(&address), length) != 0 ||
      ::listen(fd, SOMAXCONN) != 0) {
    ::close(fd);
    return -1;
  }
  return fd;
}

// A ticket: "<boot id>/<network namespace> <socket name> <secret>".
struct Ticket {
  std::string identity, name, secret;
};

Ticket parseTicket(const std::string& text) {
  Ticket ticket;
  std::istringstream(text) >> ticket.identity >> ticket.name >> ticket.secret;
  return ticket;
}

bool sameHost(const Ticket& mine, const Ticket& theirs) {
  return !mine.identity.empty() && mine.identity == theirs.identity &&
      theirs.secret.size() == sizeof(Hello::secret);
}

std::string randomSecret() {
  std::random_device device; // /dev/urandom
  static const char digits[] = "0123456789abcdef";
  std::string secret(sizeof(Hello::secret), '0');
  for (char& c : secret)
    c = digits[device() % 16];
  return secret;
}

} // namespace

SocketChannels::SocketChannels(int rank, std::chrono::milliseconds timeout)
    : impl_(std::make_unique<Impl>()) {
  impl_->rank = rank;
  impl_->timeout = timeout;
  static std::atomic<int> made{0};
  const std::string identity =
      socketChannelsWanted() ? hostIdentity() : std::string();
  const std::string name = "tpipe-" + std::to_string(::getpid()) + "-" +
      std::to_string(rank) + "-" + std::to_string(made++);
  impl_->listener = identity.empty() ? -1 : listenOn(name);
  if (impl_->listener >= 0) {
    impl_->secret = randomSecret();
    impl_->ticket = identity + " " + name + " " + impl_->secret;
  }
}

const std::string& SocketChannels::ticket() const {
  return impl_->ticket;
}

void SocketChannels::connect(const std::vector<std::string>& tickets) {
  std::set<int> below;
  const int rank = impl_->rank;
  const Ticket mine = parseTicket(impl_->ticket);
  try {
    for (int peer = 0; peer < static_cast<int>(tickets.size()); ++peer) {
      const Ticket theirs = parseTicket(tickets[static_cast<size_t>(peer)]);
      if (peer == rank || !sameHost(mine, theirs))
        continue;
      if (peer < rank) {
        below.insert(peer);
        continue;
      }
      const int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
      if (fd < 0)
        failWithErrno("cannot open a socket");
      configure(fd, impl_->timeout);
      auto channel = std::make_unique<Impl::Channel>();
      channel->peer = peer, channel->fd = fd;
      impl_->channels[peer] = std::move(channel);
      socklen_t length = 0;
      const sockaddr_un address = abstractAddress(theirs.name, &length);
      if (::connect(fd, reinterpret_cast<const sockaddr*>(&address), length) !=
          0) {
        failWithErrno(
            "cannot connect to rank " + std::to_string(peer) +
            "'s socket on this host");
      }
      Hello hello{kSocketMagic, rank, {}};
      std::memcpy(hello.secret, theirs.secret.data(), sizeof hello.secret);
      if (::send(fd, &hello, sizeof hello, MSG_NOSIGNAL) != sizeof hello)
        failWithErrno("cannot greet rank " + std::to_string(peer));
    }
    impl_->accept(std::move(below));
  } catch (...) {
    for (auto& [peer, channel] : impl_->channels)
      ::close(channel->fd);
    impl_->channels.clear();
    throw;
  }
  if (impl_->listener >= 0)
    ::close(impl_->listener);
  impl_->listener = -1;
}

void SocketChannels::Impl::accept(std::set<int> below) {
  while (!below.empty()) {
    pollfd waiting{listener, POLLIN, 0};
    const int ready = ::poll(&waiting, 1, static_cast<int>(timeout.count()));
    if (ready < 0 && errno == EINTR)
      continue;
    if (ready == 0) {
      throw std::runtime_error(
          "rank " + std::to_string(*below.begin()) +
          " did not connect its socket within " +
          std::to_string(timeout.count() / 1000.0) + " s");
    }
    const int fd = ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0)
      failWithErrno("accepting a rank's socket");
    configure(fd, timeout);
    Hello hello{};
    try {
      readExactly(fd, &hello, sizeof hello, aborted, timeout);
    } catch (const std::runtime_error&) {
      hello.magic = 0;
    }
    if (hello.magic != kSocketMagic ||
        !below.count(static_cast<int>(hello.rank)) ||
        std::memcmp(hello.secret, secret.data(), sizeof hello.secret) != 0) {
      ::close(fd);
      continue; // not one of ours
    }
    auto channel = std::make_unique<Channel>();
    channel->peer = static_cast<int>(hello.rank), channel->fd = fd;
    channels[channel->peer] = std::move(channel);
    below.erase(static_cast<int>(hello.rank));
  }
}

SocketChannels::~SocketChannels() {
  if (impl_->listener >= 0)
    ::close(impl_->listener);
  for (auto& [peer, channel] : impl_->channels) {
    {
      std::lock_guard<std::mutex> lock(channel->sendMutex);
      impl_->stopping = true;
    }
    ::shutdown(channel->fd, SHUT_RDWR); // a blocked send returns
    channel->sendChanged.notify_all();
  }
  for (auto& [peer, channel] : impl_->channels) {
    if (channel->sender.joinable())
      channel->sender.join();
    ::close(channel->fd);
  }
}

bool SocketChannels::reaches(int peer) const {
  return impl_->channels.count(peer) > 0;
}

bool SocketChannels::reachesAll(int worldSize) const {
  return static_cast<int>(impl_->channels.size()) == worldSize - 1;
}

void SocketChannels::send(
    int peer,
    int64_t key,
    const std::vector<at::Tensor>& tensors) {
  Impl::Channel& c = impl_->channel(peer);
  const int count = static_cast<int>(tensors.size());
  for (int slot = 0; slot < count; ++slot) {
    const at::Tensor& tensor = tensors[static_cast<size_t>(slot)];
    if (!tensor.device().is_cpu()) {
      throw std::logic_error(
          "socket channels carry host memory; a tensor on " +
          tensor.device().str() + " must be copied to the CPU first");
    }
    if (tensor.dim() > kSocketMaxDims) {
      throw std::runtime_error(
          "cannot send a tensor of " + std::to_string(tensor.dim()) +
          " dimensions (at most " + std::to_string(kSocketMaxDims) + ")");
    }
    Outgoing out;
    out.data = tensor.contiguous();
    Header& h = out.header;
    h = Header{};
    h.magic = kSocketMagic, h.key = key, h.slot = slot, h.count = count;
    h.dtype = static_cast<int64_t>(tensor.scalar_type());
    h.dims = tensor.dim();
    h.bytes = static_cast<int64_t>(out.data.nbytes());
    for (int64_t d = 0; d < tensor.dim(); ++d)
      h.shape[d] = tensor.size(d);
    std::lock_guard<std::mutex> lock(c.sendMutex);
    if (!c.sendError.empty())
      throw std::runtime_error(c.sendError);
    if (c.queue.empty()) {
      // Mostly the socket takes it all now: no thread is woken.
      while (out.sent < out.total() &&
             (out.sendSome(c.fd, MSG_DONTWAIT) >= 0 || errno == EINTR)) {
      }
      if (out.sent == out.total())
        continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK)
        failWithErrno("sending");
    }
    c.queue.push_back(std::move(out));
    // Started at the first send the socket could not take: a job of many
    // ranks on one host keeps no idle thread per peer.
    if (!c.sender.joinable()) {
      Impl* impl = impl_.get();
      c.sender = std::thread([impl, &c] { impl->sendLoop(c); });
    }
    c.sendChanged.notify_all();
  }
}

std::vector<at::Tensor> SocketChannels::receive(int peer, int64_t key) {
  Impl::Channel& c = impl_->channel(peer);
  std::unique_lock<std::mutex> lock(c.receiveMutex);
  for (;;) {
    if (impl_->aborted)
      throw StepAborted();
    const auto found = c.missing.find(key);
    if (found != c.missing.end() && found->second == 0) {
      std::vector<at::Tensor> tensors = std::move(c.slots[key]);
      c.slots.erase(key);
      c.missing.erase(found);
      return tensors;
    }
    if (c.reading) {
      c.arrived.wait(lock);
      continue;
    }
    c.reading = true;
    lock.unlock();
    try {
      Message message = impl_->readMessage(c);
      lock.lock();
      c.reading = false;
      impl_->file(c, std::move(message));
    } catch (...) {
      if (!lock.owns_lock())
        lock.lock();
      c.reading = false;
      c.arrived.notify_all();
      throw;
    }
    c.arrived.notify_all();
  }
}

void SocketChannels::begin() {
  if (impl_->broken) {
    throw std::runtime_error(
        "an earlier step failed and left the socket streams mid-message");
  }
}

void SocketChannels::abort() {
  if (impl_->aborted.exchange(true))
    return;
  impl_->broken = true;
  for (auto& [peer, channel] : impl_->channels) {
    ::shutdown(channel->fd, SHUT_RDWR); // wakes blocked reads and sends
    std::lock_guard<std::mutex> lock(channel->receiveMutex);
    channel->arrived.notify_all();
  }
}

void SocketChannels::drain(int* failedPeer) {
  for (auto& [peer, channel] : impl_->channels) {
    std::unique_lock<std::mutex> lock(channel->sendMutex);
    channel->sendChanged.wait(lock, [&] {
      return channel->queue.empty() || !channel->sendError.empty();
    });
    if (!channel->sendError.empty()) {
      *failedPeer = peer;
      throw std::runtime_error(channel->sendError);
    }
  }
}

bool socketChannelsWanted() {
  const char* choice = std::getenv("TPIPE_P2P");
  return choice == nullptr || std::string(choice) != "gloo";
}

} // namespace runtime
} // namespace tpipe
