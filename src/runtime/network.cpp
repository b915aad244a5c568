#include "runtime/network.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "tpipe/errors.h"

namespace tpipe {
namespace runtime {
namespace {

std::string numeric(const sockaddr* address) {
  char host[NI_MAXHOST] = "";
  const socklen_t length = address->sa_family == AF_INET6 ? sizeof(sockaddr_in6)
                                                          : sizeof(sockaddr_in);
  getnameinfo(address, length, host, sizeof host, nullptr, 0, NI_NUMERICHOST);
  return host;
}

// The interface holding `address`, or "" when none does.
std::string interfaceOf(const std::string& address) {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0)
    return "";
  std::string name;
  for (ifaddrs* item = all; item; item = item->ifa_next) {
    if (!item->ifa_addr ||
        (item->ifa_addr->sa_family != AF_INET &&
         item->ifa_addr->sa_family != AF_INET6))
      continue;
    if (numeric(item->ifa_addr) == address) {
      name = item->ifa_name;
      break;
    }
  }
  freeifaddrs(all);
  return name;
}

// The first IPv4 (else IPv6) address of a named interface.
std::string addressOf(const std::string& interface, const char* variable) {
  ifaddrs* all = nullptr;
  if (getifaddrs(&all) != 0)
    throw UserError(std::string(variable) + ": cannot list interfaces");
  std::string found, fallback;
  for (ifaddrs* item = all; item; item = item->ifa_next) {
    if (!item->ifa_addr || interface != item->ifa_name)
      continue;
    if (item->ifa_addr->sa_family == AF_INET && found.empty())
      found = numeric(item->ifa_addr);
    if (item->ifa_addr->sa_family == AF_INET6 && fallback.empty())
      fallback = numeric(item->ifa_addr);
  }
  freeifaddrs(all);
  if (found.empty())
    found = fallback;
  if (found.empty()) {
    throw UserError(
        std::string(variable) + "=" + interface +
        ": no such interface with an address on this host");
  }
  return found;
}

} // namespace

std::string numericAddress(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int status = getaddrinfo(host.c_str(), nullptr, &hints, &found);
  if (status != 0 || !found)
    throw UserError(
        "MASTER_ADDR=" + host + " does not resolve: " + gai_strerror(status));
  // Prefer IPv4: Gloo and most clusters use it.
  const addrinfo* chosen = found;
  for (const addrinfo* item = found; item; item = item->ai_next) {
    if (item->ai_family == AF_INET) {
      chosen = item;
      break;
    }
  }
  const std::string address = numeric(chosen->ai_addr);
  freeaddrinfo(found);
  return address;
}

int freeLoopbackPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0)
    throw std::runtime_error(
        std::string("cannot open a socket: ") + std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof address;
  const bool ok =
      ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  const int error = errno;
  ::close(fd);
  if (!ok)
    throw std::runtime_error(
        std::string("cannot find a free loopback port: ") +
        std::strerror(error));
  return ntohs(address.sin_port);
}

bool isLoopbackAddress(const std::string& address) {
  return address.rfind("127.", 0) == 0 || address == "::1" ||
      address == "localhost";
}

LocalAddress advertisedAddress(const std::string& masterAddr, int masterPort) {
  const std::string master = numericAddress(masterAddr);
  LocalAddress local;
  for (const char* variable : {"GLOO_SOCKET_IFNAME", "TPIPE_GLOO_INTERFACE"}) {
    const char* interface = std::getenv(variable);
    if (interface && *interface) {
      local.interface = interface;
      local.address = addressOf(interface, variable);
      local.why = std::string(variable) + "=" + interface;
      break;
    }
  }
  if (local.address.empty() && isLoopbackAddress(master)) {
    local = {interfaceOf("127.0.0.1"), "127.0.0.1", "MASTER_ADDR is loopback"};
  }
  if (local.address.empty()) {
    addrinfo hints{};
    hints.ai_socktype = SOCK_DGRAM;
    hints.ai_flags = AI_NUMERICHOST;
    addrinfo* target = nullptr;
    if (getaddrinfo(
            master.c_str(),
            std::to_string(masterPort).c_str(),
            &hints,
            &target) != 0 ||
        !target) {
      throw UserError("MASTER_ADDR=" + masterAddr + " is not a usable address");
    }
    const int fd = socket(target->ai_family, SOCK_DGRAM, 0);
    const bool routed =
        fd >= 0 && connect(fd, target->ai_addr, target->ai_addrlen) == 0;
    const std::string reason = std::strerror(errno);
    sockaddr_storage name{};
    socklen_t length = sizeof name;
    if (routed)
      getsockname(fd, reinterpret_cast<sockaddr*>(&name), &length);
    if (fd >= 0)
      close(fd);
    freeaddrinfo(target);
    if (!routed) {
      throw UserError(
          "no route from this host to MASTER_ADDR=" + masterAddr + " (" +
          reason +
          "); set GLOO_SOCKET_IFNAME to the interface that reaches it");
    }
    local.address = numeric(reinterpret_cast<sockaddr*>(&name));
    local.interface = interfaceOf(local.address);
    local.why = "routes to MASTER_ADDR " + master;
  }
  if (isLoopbackAddress(local.address) && !isLoopbackAddress(master)) {
    throw UserError(
        "this rank would advertise the loopback address " + local.address +
        " (" + local.why + ") while MASTER_ADDR=" + masterAddr +
        " is another host: peers could never reach it; set GLOO_SOCKET_IFNAME to the interface that "
        "reaches MASTER_ADDR");
  }
  if (local.interface.empty())
    local.interface = "?";
  return local;
}

} // namespace runtime
} // namespace tpipe
