// `tpipe launch`: local ranks as child processes, their output prefixed,
// signals forwarded, and no rank left behind when one fails.
#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cctype>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <c10/util/Exception.h>

#include "runtime/network.h"
#include "tpipe/distributed.h"

namespace tpipe {
namespace {

std::atomic<int> forwardedSignal{0};

void onSignal(int signal) {
  forwardedSignal = signal;
}

struct Child {
  pid_t pid = -1;
  int output = -1;     // read end of its stdout + stderr
  std::string pending; // a partial line
  bool running = true;
  bool sawStep = false; // has logged a "step k/N" progress line
  int status = 0;
  // The first rank its error named as lost ("lost rank K"): a peer that
  // hung, which the launcher ends only after this rank failed.
  int named = -1;
};

void emit(int rank, const std::string& line) {
  std::string text = "[rank " + std::to_string(rank) + "] " + line + "\n";
  (void)!::write(STDOUT_FILENO, text.data(), text.size());
}

void drain(Child& child, int rank, bool all) {
  char buffer[4096];
  for (;;) {
    const ssize_t n = ::read(child.output, buffer, sizeof buffer);
    if (n <= 0)
      break;
    child.pending.append(buffer, static_cast<size_t>(n));
    if (!all)
      break;
  }
  size_t newline;
  while ((newline = child.pending.find_first_of("\n\r")) != std::string::npos) {
    if (newline > 0) {
      child.sawStep =
          child.sawStep || child.pending.compare(0, 5, "step ") == 0;
      const size_t lost = child.pending.find("lost rank ");
      if (child.named < 0 && lost < newline) {
        const char* digits = child.pending.c_str() + lost + 10;
        if (std::isdigit(static_cast<unsigned char>(*digits)))
          child.named = std::atoi(digits);
      }
      emit(rank, child.pending.substr(0, newline));
    }
    child.pending.erase(0, newline + 1);
  }
}

// A job token for the ranks of one launch, unless the user gave one.
std::string jobToken() {
  const char* given = std::getenv("TPIPE_JOB_TOKEN");
  if (given && *given)
    return given;
  std::random_device random;
  std::string token;
  char hex[17];
  for (int part = 0; part < 2; ++part) {
    std::snprintf(hex, sizeof hex, "%08x%08x", random(), random());
    token += hex;
  }
  return token;
}

// Whether this process runs one thread: /proc/self/task lists each.
bool singleThreaded() {
  DIR* tasks = ::opendir("/proc/self/task");
  if (tasks == nullptr)
    return false;
  int threads = 0;
  while (const dirent* entry = ::readdir(tasks)) {
    if (entry->d_name[0] != '.')
      ++threads;
  }
  ::closedir(tasks);
  return threads == 1;
}

class Launcher {
 public:
  Launcher(
      std::string executable,
      int processes,
      std::vector<std::string> arguments,
      std::chrono::steady_clock::time_point sinceFailure,
      RankMain rankMain)
      : executable_(std::move(executable)),
        arguments_(std::move(arguments)),
        children_(processes),
        sinceFailure_(sinceFailure),
        rankMain_(std::move(rankMain)) {
    const char* addr = std::getenv("MASTER_ADDR");
    masterAddr_ = addr && *addr ? addr : "127.0.0.1";
    masterPort_ = std::getenv("MASTER_PORT")
        ? std::getenv("MASTER_PORT")
        : std::to_string(runtime::freeLoopbackPort());
    token_ = jobToken();
  }

  LaunchOutcome run() {
    struct sigaction action {};
    action.sa_handler = onSignal;
    ::sigaction(SIGINT, &action, nullptr);
    ::sigaction(SIGTERM, &action, nullptr);
    for (int rank = 0; rank < static_cast<int>(children_.size()); ++rank)
      spawn(rank);
    while (pump()) {
    }
    for (int rank = 0; rank < static_cast<int>(children_.size()); ++rank) {
      Child& child = children_[rank];
      if (child.output < 0)
        continue;
      drain(child, rank, true);
      if (!child.pending.empty())
        emit(rank, child.pending);
      ::close(child.output);
    }
    LaunchOutcome outcome;
    outcome.status = result_;
    outcome.failedRank = failedRank_;
    outcome.lostRank = lostRank_;
    outcome.stopped = stopped_;
    outcome.failedAt = failedAt_;
    return outcome;
  }

 private:
  [[noreturn]] void startRank(int rank, int output, bool forked) {
    // A rank never outlives the launcher.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != launcher_)
      ::_exit(1);
    ::dup2(output, STDOUT_FILENO);
    ::dup2(output, STDERR_FILENO);
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", std::to_string(children_.size()).c_str(), 1);
    ::setenv("MASTER_ADDR", masterAddr_.c_str(), 1);
    ::setenv("MASTER_PORT", masterPort_.c_str(), 1);
    ::setenv("TPIPE_JOB_TOKEN", token_.c_str(), 1);
    // `launch --nproc N predict CONFIG ...` runs predict, `... train
    // CONFIG` and `... CONFIG` train.
    std::vector<std::string> words{executable_};
    if (arguments_.empty() ||
        (arguments_.front() != "predict" && arguments_.front() != "train"))
      words.push_back("train");
    words.insert(words.end(), arguments_.begin(), arguments_.end());
    std::vector<char*> argv;
    for (auto& word : words)
      argv.push_back(word.data());
    argv.push_back(nullptr);
    if (forked) {
      // `ps` and `top` would show every rank as the launcher.
      ::prctl(PR_SET_NAME, ("tpipe-rank-" + std::to_string(rank)).c_str());
      // What exec would have reset: the launcher's signal handlers and mask
      // are not the rank's.
      struct sigaction original {};
      original.sa_handler = SIG_DFL;
      for (const int signal : {SIGINT, SIGTERM, SIGALRM})
        ::sigaction(signal, &original, nullptr);
      sigset_t none;
      ::sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      int status = 1;
      try {
        status = rankMain_(static_cast<int>(words.size()), argv.data());
      } catch (...) {
        std::fprintf(stderr, "launch: rank %d ended by an exception\n", rank);
      }
      // Not std::exit: LibTorch's static destructors unregister every
      // operator, writing to pages the fork shares with the launcher, and
      // each copied page stops the other cores to flush their TLBs. That
      // teardown took a third of a short rank's CPU time, and the rank's
      // files are closed and its output is flushed here.
      std::cout.flush();
      std::cerr.flush();
      std::fflush(nullptr);
      ::_exit(status);
    }
    ::execv(executable_.c_str(), argv.data());
    std::fprintf(
        stderr,
        "launch: cannot run %s: %s\n",
        executable_.c_str(),
        std::strerror(errno));
    ::_exit(127);
  }

  void spawn(int rank) {
    int pipe[2];
    TORCH_CHECK(
        ::pipe(pipe) == 0, "launch: pipe failed: ", std::strerror(errno));
    const bool forked = rankMain_ && singleThreaded();
    // Output still buffered here would be written once more by the child.
    std::cout.flush();
    std::cerr.flush();
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    TORCH_CHECK(pid >= 0, "launch: fork failed: ", std::strerror(errno));
    if (pid == 0) {
      ::close(pipe[0]);
      startRank(rank, pipe[1], forked);
    }
    ::close(pipe[1]);
    ::fcntl(pipe[0], F_SETFL, ::fcntl(pipe[0], F_GETFL) | O_NONBLOCK);
    children_[rank].pid = pid;
    children_[rank].output = pipe[0];
  }

  void endOthers(int signal) {
    for (auto& child : children_) {
      if (child.running)
        ::kill(child.pid, signal);
    }
  }

  // Reaps a rank that exited, its output drained; the first failure ends
  // the others.
  void reap(int rank, int status) {
    Child& child = children_[rank];
    child.running = false;
    child.status = status;
    const int code =
        WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code == 0 || result_ != 0)
      return;
    result_ = code;
    failedRank_ = rank;
    lostRank_ = child.named;
    failedAt_ = std::chrono::steady_clock::now();
    emit(
        rank,
        "exited with status " + std::to_string(code) +
            "; ending the other ranks");
    // No rank can finish a step without the failed one, so there is nothing
    // to wait for beyond a brief exit: SIGCONT lets a stopped rank take its
    // SIGTERM, and whoever is still there after 3 s is killed.
    endOthers(SIGTERM);
    endOthers(SIGCONT);
    deadline_ = std::chrono::steady_clock::now() + std::chrono::seconds(3);
  }

  // Forwards output and signals, reaps ranks; false once none runs.
  bool pump() {
    std::vector<pollfd> fds;
    for (auto& child : children_) {
      if (child.output >= 0)
        fds.push_back({child.output, POLLIN, 0});
    }
    if (!fds.empty())
      ::poll(fds.data(), fds.size(), 100);
    for (int rank = 0; rank < static_cast<int>(children_.size()); ++rank) {
      if (children_[rank].output >= 0)
        drain(children_[rank], rank, false);
    }
    noteFirstStep();
    if (const int signal = forwardedSignal.exchange(0)) {
      // The ranks finish their step and checkpoint; a second signal is
      // forwarded too.
      endOthers(signal);
      stopped_ = true;
      if (result_ == 0)
        result_ = 128 + signal;
      deadline_ = std::min(
          deadline_,
          std::chrono::steady_clock::now() + std::chrono::seconds(30));
    }
    bool anyRunning = false;
    std::vector<std::pair<int, int>> exited; // rank, status
    for (int rank = 0; rank < static_cast<int>(children_.size()); ++rank) {
      Child& child = children_[rank];
      if (!child.running)
        continue;
      int status = 0;
      if (::waitpid(child.pid, &status, WNOHANG) == child.pid) {
        drain(child, rank, true);
        exited.emplace_back(rank, status);
      } else {
        anyRunning = true;
      }
    }
    // A rank that lost a peer fails because of it, and the survivors of a
    // dead rank exit within a moment of it: when several are reaped at once,
    // the failure reported is the one that named no lost peer.
    std::stable_partition(exited.begin(), exited.end(), [&](const auto& e) {
      return children_[e.first].named < 0;
    });
    for (const auto& [rank, status] : exited)
      reap(rank, status);
    if (std::chrono::steady_clock::now() > deadline_)
      endOthers(SIGKILL);
    return anyRunning;
  }

  // A restart says how long after the failure training went on: when rank
  // 0's first progress line ("step k/N ...") comes through.
  void noteFirstStep() {
    if (sinceFailure_ == std::chrono::steady_clock::time_point{} ||
        firstStepSeen_ || children_.empty() || !children_[0].sawStep)
      return;
    firstStepSeen_ = true;
    const double seconds = std::chrono::duration<double>(
                               std::chrono::steady_clock::now() - sinceFailure_)
                               .count();
    char text[96];
    std::snprintf(
        text,
        sizeof text,
        "launch: first step after the restart, %.1f s after the failure\n",
        seconds);
    (void)!::write(STDOUT_FILENO, text, std::strlen(text));
  }

  std::string executable_;
  std::vector<std::string> arguments_;
  std::vector<Child> children_;
  std::chrono::steady_clock::time_point sinceFailure_, failedAt_;
  RankMain rankMain_;
  bool firstStepSeen_ = false, stopped_ = false;
  int failedRank_ = -1, lostRank_ = -1;
  std::string masterAddr_, masterPort_, token_;
  const pid_t launcher_ = ::getpid();
  int result_ = 0;
  std::chrono::steady_clock::time_point deadline_ =
      std::chrono::steady_clock::time_point::max();
};

} // namespace

int launchLocal(
    const std::string& executable,
    int processes,
    const std::vector<std::string>& arguments) {
  return launchAttempt(executable, processes, arguments).status;
}

LaunchOutcome launchAttempt(
    const std::string& executable,
    int processes,
    const std::vector<std::string>& arguments,
    std::chrono::steady_clock::time_point sinceFailure,
    const RankMain& rankMain) {
  TORCH_CHECK(processes >= 1, "launch: --nproc must be >= 1, got ", processes);
  return Launcher(executable, processes, arguments, sinceFailure, rankMain)
      .run();
}

} // namespace tpipe
