// The client of the tests' fork server (fork_server.cpp): runs one tpipe
// command line in a fork of the server named by TPIPE_FORK_SOCKET, on this
// process's standard streams, environment, directory, umask and CPUs, and
// ends as that command ended: its exit status, or its signal. Signals sent
// to this process (INT, TERM, HUP, QUIT, USR1, USR2) go on to the command;
// if this process is killed, the server kills the command. Links no
// LibTorch, so it starts in a millisecond.
//
//   TPIPE_FORK_SOCKET=... tpipe_forked ARGUMENTS...   (as `tpipe ARGUMENTS...`)
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fcntl.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fork_protocol.h"

extern char** environ;

namespace {

volatile sig_atomic_t command = 0;

void forward(int signal) {
  if (command > 0)
    ::kill(command, signal);
}

// `error`: the errno of the call that failed; 0 where none did.
[[noreturn]] void fail(const std::string& what, int error = 0) {
  const std::string reason =
      error != 0 ? std::string(": ") + std::strerror(error) : "";
  std::fprintf(stderr, "tpipe_forked: %s%s\n", what.c_str(), reason.c_str());
  std::_Exit(125);
}

} // namespace

int main(int argc, char** argv) {
  const char* socketPath = std::getenv("TPIPE_FORK_SOCKET");
  if (socketPath == nullptr)
    fail("TPIPE_FORK_SOCKET is not set");
  const int connection = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::strncpy(address.sun_path, socketPath, sizeof(address.sun_path) - 1);
  if (::connect(
          connection, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
      0) {
    const int error = errno; // before the message's allocations
    fail(std::string("no fork server at ") + socketPath, error);
  }

  fork_protocol::Request request;
  std::vector<char> directory(1 << 16);
  if (::getcwd(directory.data(), directory.size()) == nullptr)
    fail("getcwd", errno);
  request.directory = directory.data();
  request.umask = ::umask(0);
  ::umask(request.umask);
  cpu_set_t cpus;
  if (::sched_getaffinity(0, sizeof(cpus), &cpus) == 0)
    for (int cpu = 0; cpu < CPU_SETSIZE; ++cpu)
      if (CPU_ISSET(cpu, &cpus))
        request.cpus.push_back(cpu);
  request.arguments.assign(argv, argv + argc);
  for (char** entry = environ; *entry != nullptr; ++entry)
    request.environment.emplace_back(*entry);
  std::vector<int> open;
  for (int fd = 0; fd < 3; ++fd)
    if (::fcntl(fd, F_GETFD) != -1)
      open.push_back(fd);

  // Held until the command's pid is known, then forwarded.
  struct sigaction handler {};
  handler.sa_handler = forward;
  sigemptyset(&handler.sa_mask);
  sigset_t forwarded;
  sigemptyset(&forwarded);
  for (int signal : {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2}) {
    ::sigaction(signal, &handler, nullptr);
    sigaddset(&forwarded, signal);
  }
  ::sigprocmask(SIG_BLOCK, &forwarded, nullptr);
  if (!fork_protocol::sendRequest(connection, request, open))
    fail("sending the command", errno);
  int32_t pid = 0;
  if (!fork_protocol::receiveInt(connection, pid) || pid <= 0)
    fail("the fork server refused the command");
  command = pid;
  ::sigprocmask(SIG_UNBLOCK, &forwarded, nullptr);
  int32_t status = 0;
  if (!fork_protocol::receiveInt(connection, status))
    fail("the fork server ended before the command did");
  if (WIFEXITED(status))
    std::_Exit(WEXITSTATUS(status));
  const int signal = WTERMSIG(status);
  struct sigaction plain {};
  plain.sa_handler = SIG_DFL;
  ::sigaction(signal, &plain, nullptr);
  ::kill(::getpid(), signal);
  std::_Exit(128 + signal);
}
