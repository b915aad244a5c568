// `tpipe launch`: local ranks as child processes, their output prefixed,
// signals forwarded, and no rank left behind when one fails.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <c10/util/Exception.h>

#include "tpipe/distributed.h"

namespace tpipe {
namespace {

std::atomic<int> forwardedSignal{0};

void onSignal(int signal) { forwardedSignal = signal; }

// A port the kernel just handed out on loopback; free again when returned.
int freePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, "launch: cannot open a socket: ", std::strerror(errno));
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = 0;
  socklen_t length = sizeof address;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  ::close(fd);
  TORCH_CHECK(ok, "launch: cannot find a free port: ", std::strerror(errno));
  return ntohs(address.sin_port);
}

struct Child {
  pid_t pid = -1;
  int output = -1;  // read end of its stdout + stderr
  std::string pending;  // a partial line
  bool running = true;
  int status = 0;
};

void emit(int rank, const std::string& line) {
  std::string text = "[rank " + std::to_string(rank) + "] " + line + "\n";
  (void)!::write(STDOUT_FILENO, text.data(), text.size());
}

void drain(Child& child, int rank, bool all) {
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(child.output, buffer, sizeof buffer);
    if (n <= 0) break;
    child.pending.append(buffer, static_cast<size_t>(n));
    if (!all) break;
  }
  size_t newline;
  while ((newline = child.pending.find_first_of("\n\r")) != std::string::npos) {
    if (newline > 0) emit(rank, child.pending.substr(0, newline));
    child.pending.erase(0, newline + 1);
  }
}

}  // namespace

int launchLocal(const std::string& executable, int processes, const std::vector<std::string>& arguments) {
  TORCH_CHECK(processes >= 1, "launch: --nproc must be >= 1, got ", processes);
  const char* addr = std::getenv("MASTER_ADDR");
  const std::string masterAddr = addr && *addr ? addr : "127.0.0.1";
  const std::string masterPort = std::getenv("MASTER_PORT") ? std::getenv("MASTER_PORT")
                                                            : std::to_string(freePort());
  // The ranks prove to each other that they belong to this launch.
  const char* givenToken = std::getenv("TPIPE_JOB_TOKEN");
  std::string token = givenToken && *givenToken ? givenToken : "";
  if (token.empty()) {
    std::random_device random;
    char hex[17];
    for (int part = 0; part < 2; ++part) {
      std::snprintf(hex, sizeof hex, "%08x%08x", random(), random());
      token += hex;
    }
  }
  std::vector<Child> children(static_cast<size_t>(processes));
  struct sigaction action {};
  action.sa_handler = onSignal;
  ::sigaction(SIGINT, &action, nullptr);
  ::sigaction(SIGTERM, &action, nullptr);
  const pid_t launcher = ::getpid();
  for (int rank = 0; rank < processes; ++rank) {
    int pipe[2];
    TORCH_CHECK(::pipe(pipe) == 0, "launch: pipe failed: ", std::strerror(errno));
    const pid_t pid = ::fork();
    TORCH_CHECK(pid >= 0, "launch: fork failed: ", std::strerror(errno));
    if (pid == 0) {
      // A rank never outlives the launcher.
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (::getppid() != launcher) ::_exit(1);
      ::dup2(pipe[1], STDOUT_FILENO);
      ::dup2(pipe[1], STDERR_FILENO);
      ::close(pipe[0]);
      ::close(pipe[1]);
      ::setenv("RANK", std::to_string(rank).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(processes).c_str(), 1);
      ::setenv("MASTER_ADDR", masterAddr.c_str(), 1);
      ::setenv("MASTER_PORT", masterPort.c_str(), 1);
      ::setenv("TPIPE_JOB_TOKEN", token.c_str(), 1);
      std::vector<std::string> words{executable, "train"};
      words.insert(words.end(), arguments.begin(), arguments.end());
      std::vector<char*> argv;
      for (auto& word : words) argv.push_back(word.data());
      argv.push_back(nullptr);
      ::execv(executable.c_str(), argv.data());
      std::fprintf(stderr, "launch: cannot run %s: %s\n", executable.c_str(), std::strerror(errno));
      ::_exit(127);
    }
    ::close(pipe[1]);
    ::fcntl(pipe[0], F_SETFL, ::fcntl(pipe[0], F_GETFL) | O_NONBLOCK);
    children[rank].pid = pid;
    children[rank].output = pipe[0];
  }
  int result = 0;
  int firstFailure = -1;
  auto endOthers = [&](int signal) {
    for (auto& child : children) {
      if (child.running) ::kill(child.pid, signal);
    }
  };
  auto deadline = std::chrono::steady_clock::time_point::max();
  for (;;) {
    std::vector<pollfd> fds;
    for (auto& child : children) {
      if (child.output >= 0) fds.push_back({child.output, POLLIN, 0});
    }
    if (!fds.empty()) ::poll(fds.data(), fds.size(), 100);
    for (int rank = 0; rank < processes; ++rank) {
      Child& child = children[rank];
      if (child.output < 0) continue;
      drain(child, rank, false);
    }
    if (const int signal = forwardedSignal.exchange(0)) {
      endOthers(signal);
      if (result == 0) result = 128 + signal;
      deadline = std::min(deadline, std::chrono::steady_clock::now() + std::chrono::seconds(10));
    }
    bool anyRunning = false;
    for (int rank = 0; rank < processes; ++rank) {
      Child& child = children[rank];
      if (!child.running) continue;
      int status = 0;
      if (::waitpid(child.pid, &status, WNOHANG) == child.pid) {
        child.running = false;
        child.status = status;
        const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (code != 0 && firstFailure < 0 && result == 0) {
          firstFailure = rank;
          result = code;
          emit(rank, "exited with status " + std::to_string(code) + "; ending the other ranks");
          endOthers(SIGTERM);
          deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
        }
      } else {
        anyRunning = true;
      }
    }
    if (std::chrono::steady_clock::now() > deadline) endOthers(SIGKILL);
    if (!anyRunning) break;
  }
  for (int rank = 0; rank < processes; ++rank) {
    Child& child = children[rank];
    if (child.output >= 0) {
      drain(child, rank, true);
      if (!child.pending.empty()) emit(rank, child.pending);
      ::close(child.output);
    }
  }
  return result;
}

}  // namespace tpipe
