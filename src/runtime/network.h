// Which local address a rank advertises to its peers, and which address the
// rendezvous store listens on. Plain POSIX sockets; no c10d here.
#pragma once

#include <string>

namespace tpipe {
namespace runtime {

struct LocalAddress {
  std::string interface; // "eth0", "lo"
  std::string address;   // numeric, "10.0.0.2"
  std::string
      why; // "routes to MASTER_ADDR 10.0.0.1", "GLOO_SOCKET_IFNAME=eth1"
};

// MASTER_ADDR as a numeric address (resolving a host name); UserError when
// it does not resolve.
std::string numericAddress(const std::string& host);

bool isLoopbackAddress(const std::string& numeric);

// The address this rank advertises to the others: the interface named by
// GLOO_SOCKET_IFNAME (PyTorch's variable) or TPIPE_GLOO_INTERFACE, else the
// local end of a route to MASTER_ADDR (a connected UDP socket's name; no
// packet is sent). Refuses a loopback address when MASTER_ADDR is not
// loopback: peers on other hosts could never reach it.
LocalAddress advertisedAddress(const std::string& masterAddr, int masterPort);

// A TCP port the kernel just handed out on loopback, free again when
// returned (a port derived from a pid could fall in the ephemeral range,
// held by another connection). Throws std::runtime_error, naming errno,
// where none can be had.
int freeLoopbackPort();

} // namespace runtime
} // namespace tpipe
