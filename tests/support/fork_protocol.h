// The fork server's wire format (fork_server.cpp, fork_client.cpp): one
// SOCK_SEQPACKET message from the client, its strings NUL-separated
// (directory, umask, CPUs, the argument count, the arguments, then the
// environment), with the client's open standard streams attached
// (SCM_RIGHTS); then two ints back: the fork's pid, and its wait status.
#pragma once

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include <sys/socket.h>
#include <sys/types.h>
#include <unistd.h>

namespace fork_protocol {

struct Request {
  std::string directory;
  mode_t umask = 022;
  std::vector<int> cpus; // empty: as the server's
  std::vector<std::string> arguments;
  std::vector<std::string> environment;
};

constexpr size_t kMaxMessage = 1 << 20;

inline std::string encode(const Request& request, unsigned streamsSent) {
  std::string text;
  auto put = [&](const std::string& s) {
    text += s;
    text.push_back('\0');
  };
  put(std::to_string(streamsSent));
  put(request.directory);
  put(std::to_string(request.umask));
  std::string cpus;
  for (int cpu : request.cpus)
    cpus += (cpus.empty() ? "" : ",") + std::to_string(cpu);
  put(cpus);
  put(std::to_string(request.arguments.size()));
  for (const std::string& a : request.arguments)
    put(a);
  for (const std::string& e : request.environment)
    put(e);
  return text;
}

// Sends the request with those of fds 0, 1, 2 that are open.
inline bool sendRequest(
    int socket,
    const Request& request,
    const std::vector<int>& openStreams) {
  unsigned sent = 0;
  std::vector<int> fds;
  for (int fd : openStreams) {
    sent |= 1u << fd;
    fds.push_back(fd);
  }
  std::string payload = encode(request, sent);
  iovec data{payload.data(), payload.size()};
  msghdr message{};
  message.msg_iov = &data;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(3 * sizeof(int))] = {};
  if (!fds.empty()) {
    message.msg_control = control;
    message.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
    cmsghdr* header = CMSG_FIRSTHDR(&message);
    header->cmsg_level = SOL_SOCKET;
    header->cmsg_type = SCM_RIGHTS;
    header->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
    std::memcpy(CMSG_DATA(header), fds.data(), fds.size() * sizeof(int));
  }
  return ::sendmsg(socket, &message, MSG_NOSIGNAL) ==
      static_cast<ssize_t>(payload.size());
}

// streams[i] is the client's fd i, received, or -1 where the client's was
// closed.
inline bool receiveRequest(
    int socket,
    Request& request,
    std::vector<int>& streams) {
  std::string buffer(kMaxMessage, '\0');
  iovec data{buffer.data(), buffer.size()};
  msghdr message{};
  message.msg_iov = &data;
  message.msg_iovlen = 1;
  alignas(cmsghdr) char control[CMSG_SPACE(3 * sizeof(int))] = {};
  message.msg_control = control;
  message.msg_controllen = sizeof(control);
  const ssize_t got = ::recvmsg(socket, &message, MSG_CMSG_CLOEXEC);
  std::vector<int> received;
  for (cmsghdr* h = CMSG_FIRSTHDR(&message); h != nullptr;
       h = CMSG_NXTHDR(&message, h)) {
    if (h->cmsg_level != SOL_SOCKET || h->cmsg_type != SCM_RIGHTS)
      continue;
    const size_t count = (h->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    received.resize(count);
    std::memcpy(received.data(), CMSG_DATA(h), count * sizeof(int));
  }
  auto refuse = [&] {
    for (int fd : received)
      ::close(fd);
    return false;
  };
  if (got <= 0 || (message.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) != 0)
    return refuse();
  buffer.resize(static_cast<size_t>(got));
  std::vector<std::string> fields;
  for (size_t start = 0; start < buffer.size();) {
    const size_t end = buffer.find('\0', start);
    if (end == std::string::npos)
      return refuse();
    fields.push_back(buffer.substr(start, end - start));
    start = end + 1;
  }
  if (fields.size() < 5)
    return refuse();
  try {
    const unsigned sent = static_cast<unsigned>(std::stoul(fields[0]));
    request.directory = fields[1];
    request.umask = static_cast<mode_t>(std::stoul(fields[2]));
    request.cpus.clear();
    for (size_t start = 0; start < fields[3].size();) {
      size_t end = fields[3].find(',', start);
      if (end == std::string::npos)
        end = fields[3].size();
      request.cpus.push_back(std::stoi(fields[3].substr(start, end - start)));
      start = end + 1;
    }
    const size_t count = std::stoul(fields[4]);
    if (count == 0 || 5 + count > fields.size())
      return refuse();
    request.arguments.assign(
        fields.begin() + 5, fields.begin() + 5 + static_cast<long>(count));
    request.environment.assign(
        fields.begin() + 5 + static_cast<long>(count), fields.end());
    streams.assign(3, -1);
    size_t next = 0;
    for (int fd = 0; fd < 3; ++fd) {
      if ((sent & (1u << fd)) == 0)
        continue;
      if (next >= received.size())
        return refuse();
      streams[fd] = received[next++];
    }
    if (next != received.size())
      return refuse();
  } catch (const std::exception&) {
    return refuse();
  }
  return true;
}

inline bool sendInt(int socket, int32_t value) {
  return ::send(socket, &value, sizeof(value), MSG_NOSIGNAL) == sizeof(value);
}

// false where the other side closed or failed; EINTR is retried.
inline bool receiveInt(int socket, int32_t& value) {
  for (;;) {
    const ssize_t got = ::recv(socket, &value, sizeof(value), 0);
    if (got == sizeof(value))
      return true;
    if (got < 0 && errno == EINTR)
      continue;
    return false;
  }
}

} // namespace fork_protocol
