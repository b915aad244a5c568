// A fork server for the shell tests' tpipe commands, so that a hundred short
// commands do not each pay LibTorch's start: 0.65-0.75 s of CPU before
// `main` (the dynamic linker's relocations of the libraries Debian's
// libtorch_cpu needs, and operator registration), against a few milliseconds
// for a fork. `tpipe_forked` (fork_client.cpp) sends it a command line, its
// environment, working directory, umask, CPU affinity and its standard
// streams; the server forks, and the fork runs the same `runCommandLine` as
// the shipped binary, on the client's streams, then ends as tpipe ends. The
// client exits with the fork's status, or dies of its signal.
//
// The server runs no LibTorch code and starts no thread (a fork copies only
// the calling thread), as tpipe's own launcher does before it forks ranks.
// A command whose environment differs from the server's in a variable that a
// library reads while it loads (OpenMP's, OpenBLAS's, the dynamic linker's)
// runs the tpipe binary anew instead, in the fork.
//
// Without `--fork-server`, this binary is tpipe: a fork that re-executes
// /proc/self/exe (the launcher beside other threads) gets tpipe again.
//
//   tpipe_fork_server --fork-server SOCKET TPIPE_BINARY
#include <algorithm>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include <poll.h>
#include <sched.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli/commands.h"
#include "fork_protocol.h"

extern char** environ;

namespace {

// `error`: the errno of the call that failed; 0 where none did.
[[noreturn]] void fail(const std::string& what, int error = 0) {
  const std::string reason =
      error != 0 ? std::string(": ") + std::strerror(error) : "";
  std::fprintf(
      stderr, "tpipe_fork_server: %s%s\n", what.c_str(), reason.c_str());
  std::exit(1);
}

// Variables that libraries read once, as they load: the server read them at
// its own start, so a fork could not honour a command's other values.
bool readWhileLoading(const std::string& entry) {
  for (const char* prefix :
       {"OMP_",
        "GOMP_",
        "KMP_",
        "OPENBLAS_",
        "MKL_",
        "LD_",
        "MALLOC_",
        "GLIBC_"})
    if (entry.rfind(prefix, 0) == 0)
      return true;
  return false;
}

std::vector<std::string> loadTimeEnvironment(
    const std::vector<std::string>& environment) {
  std::vector<std::string> picked;
  for (const std::string& entry : environment)
    if (readWhileLoading(entry))
      picked.push_back(entry);
  std::sort(picked.begin(), picked.end());
  return picked;
}

std::vector<char*> pointers(std::vector<std::string>& strings) {
  std::vector<char*> result;
  for (std::string& s : strings)
    result.push_back(s.data());
  result.push_back(nullptr);
  return result;
}

// In the fork: become the client's command, then run it as tpipe would.
[[noreturn]] void runCommand(
    fork_protocol::Request& request,
    const std::vector<int>& streams,
    const std::vector<std::string>& serverLoadTimeEnvironment,
    const std::string& tpipeBinary,
    pid_t server) {
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != server)
    std::_Exit(137);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  for (int stream = 0; stream < 3; ++stream) {
    if (streams[stream] < 0)
      ::close(stream);
    else if (::dup2(streams[stream], stream) < 0)
      std::_Exit(126);
  }
  for (int fd : streams)
    if (fd > 2)
      ::close(fd);
  if (::chdir(request.directory.c_str()) != 0) {
    std::fprintf(
        stderr,
        "tpipe_fork_server: cannot enter %s\n",
        request.directory.c_str());
    std::_Exit(126);
  }
  ::umask(request.umask);
  if (!request.cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : request.cpus)
      CPU_SET(cpu, &set);
    ::sched_setaffinity(0, sizeof(set), &set);
  }
  request.arguments[0] = tpipeBinary;
  std::vector<char*> argv = pointers(request.arguments);
  std::vector<char*> envp = pointers(request.environment);
  if (loadTimeEnvironment(request.environment) != serverLoadTimeEnvironment) {
    ::execve(tpipeBinary.c_str(), argv.data(), envp.data());
    std::_Exit(127);
  }
  static std::vector<std::string> environment; // outlives the command
  environment = std::move(request.environment);
  static std::vector<char*> environmentPointers;
  environmentPointers = pointers(environment);
  environ = environmentPointers.data();
  tpipe::endProcess(
      tpipe::runCommandLine(static_cast<int>(argv.size()) - 1, argv.data()));
}

int serve(const std::string& socketPath, const std::string& tpipeBinary) {
  ::prctl(PR_SET_PDEATHSIG, SIGTERM); // the test script that started it ended
  const pid_t self = ::getpid();
  std::vector<std::string> ownEnvironment;
  for (char** entry = environ; *entry != nullptr; ++entry)
    ownEnvironment.emplace_back(*entry);
  const std::vector<std::string> serverLoadTime =
      loadTimeEnvironment(ownEnvironment);

  sigset_t childSignals;
  sigemptyset(&childSignals);
  sigaddset(&childSignals, SIGCHLD);
  ::sigprocmask(SIG_BLOCK, &childSignals, nullptr);
  const int children =
      ::signalfd(-1, &childSignals, SFD_CLOEXEC | SFD_NONBLOCK);
  if (children < 0)
    fail("signalfd", errno);

  const int listener = ::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  // Bound under a temporary name and renamed once listening, so that a
  // client that finds the socket can connect to it.
  const std::string binding = socketPath + ".binding";
  if (binding.size() >= sizeof(address.sun_path))
    fail("socket path too long: " + socketPath);
  std::strcpy(address.sun_path, binding.c_str());
  ::unlink(binding.c_str());
  if (::bind(
          listener, reinterpret_cast<sockaddr*>(&address), sizeof(address)) !=
          0 ||
      ::listen(listener, 64) != 0 ||
      ::rename(binding.c_str(), socketPath.c_str()) != 0) {
    const int error = errno; // before the message's allocations
    fail("listen on " + socketPath, error);
  }

  std::map<pid_t, int> clientOf;  // running fork -> its client's connection
  std::map<int, pid_t> commandOf; // connection -> its fork
  for (;;) {
    std::vector<pollfd> watched{{listener, POLLIN, 0}, {children, POLLIN, 0}};
    for (const auto& [connection, pid] : commandOf)
      watched.push_back({connection, POLLIN, 0});
    if (::poll(watched.data(), watched.size(), -1) < 0) {
      if (errno == EINTR)
        continue;
      fail("poll", errno);
    }
    if (watched[1].revents != 0) {
      signalfd_siginfo drained;
      while (::read(children, &drained, sizeof(drained)) == sizeof(drained)) {
      }
      int status = 0;
      pid_t ended;
      while ((ended = ::waitpid(-1, &status, WNOHANG)) > 0) {
        const auto found = clientOf.find(ended);
        if (found == clientOf.end())
          continue;
        fork_protocol::sendInt(found->second, status);
        ::close(found->second);
        commandOf.erase(found->second);
        clientOf.erase(found);
      }
    }
    for (size_t i = 2; i < watched.size(); ++i) {
      // A client that hung up or sent more has died: its command dies too,
      // as a killed tpipe process would.
      if (watched[i].revents == 0)
        continue;
      const auto found = commandOf.find(watched[i].fd);
      if (found != commandOf.end())
        ::kill(found->second, SIGKILL);
    }
    if (watched[0].revents & POLLIN) {
      const int connection =
          ::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      if (connection < 0)
        continue;
      fork_protocol::Request request;
      std::vector<int> streams;
      if (!fork_protocol::receiveRequest(connection, request, streams)) {
        ::close(connection);
        continue;
      }
      std::fflush(nullptr);
      const pid_t command = ::fork();
      if (command == 0) {
        ::close(listener);
        ::close(children);
        for (const auto& [other, pid] : commandOf)
          ::close(other);
        ::close(connection);
        runCommand(request, streams, serverLoadTime, tpipeBinary, self);
      }
      for (int fd : streams)
        if (fd >= 0)
          ::close(fd);
      if (command < 0) {
        ::close(connection);
        continue;
      }
      fork_protocol::sendInt(connection, command);
      clientOf[command] = connection;
      commandOf[connection] = command;
    }
  }
}

} // namespace

int main(int argc, char** argv) {
  if (argc == 4 && std::string(argv[1]) == "--fork-server")
    return serve(argv[2], argv[3]);
  tpipe::endProcess(tpipe::runCommandLine(argc, argv));
}
