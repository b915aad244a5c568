#include "train/machine_load.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <dirent.h>
#include <fcntl.h>
#include <time.h>
#include <unistd.h>

namespace tpipe {
namespace {

using Demand = std::unordered_map<long, unsigned long long>;

// Whether this kernel keeps schedstat (CONFIG_SCHED_INFO): asked once.
bool schedstatKept() {
  static const bool kept = ::access("/proc/self/schedstat", R_OK) == 0;
  return kept;
}

long numberNamed(const char* name) {
  char* end = nullptr;
  const long n = std::strtol(name, &end, 10);
  return *end == '\0' ? n : -1;
}

// Every other process's threads, from /proc/<pid>/task/<tid>/schedstat:
// a few dozen small reads, outside any timed step.
Demand readOthersDemand() {
  Demand demand;
  const long own = static_cast<long>(::getpid());
  DIR* proc = ::opendir("/proc");
  if (!proc)
    return demand;
  char path[64];
  char text[128];
  while (const dirent* process = ::readdir(proc)) {
    const long pid = numberNamed(process->d_name);
    if (pid <= 0 || pid == own)
      continue;
    std::snprintf(path, sizeof path, "/proc/%ld/task", pid);
    DIR* tasks = ::opendir(path);
    if (!tasks)
      continue; // ended meanwhile
    while (const dirent* task = ::readdir(tasks)) {
      const long tid = numberNamed(task->d_name);
      if (tid <= 0)
        continue;
      std::snprintf(
          path, sizeof path, "/proc/%ld/task/%ld/schedstat", pid, tid);
      const int fd = ::open(path, O_RDONLY | O_CLOEXEC);
      if (fd < 0)
        continue;
      const ssize_t got = ::read(fd, text, sizeof text - 1);
      ::close(fd);
      if (got <= 0)
        continue;
      text[got] = '\0';
      unsigned long long ran = 0, waited = 0;
      if (std::sscanf(text, "%llu %llu", &ran, &waited) == 2)
        demand[tid] = ran + waited;
    }
    ::closedir(tasks);
  }
  ::closedir(proc);
  return demand;
}

// Whether turns read what other threads wanted: where the kernel keeps
// schedstat and the machine runs few enough threads that a reading stays
// a few milliseconds (about 13 us a thread on a 2-core VM), decided once so
// that every turn of a tune is read alike. Elsewhere the busy time stands.
bool demandRead() {
  constexpr size_t kMostThreadsRead = 1000;
  static const bool read =
      schedstatKept() && readOthersDemand().size() <= kMostThreadsRead;
  return read;
}

} // namespace

CpuClock readCpuClock() {
  CpuClock clock;
  if (demandRead()) {
    clock.othersDemand = readOthersDemand();
    clock.at = std::chrono::steady_clock::now();
    return clock; // the busy time is not wanted beside it
  }
  clock.at = std::chrono::steady_clock::now();
  timespec own{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &own);
  clock.ownSeconds = static_cast<double>(own.tv_sec) + 1e-9 * own.tv_nsec;
  std::ifstream stat("/proc/stat");
  std::string label;
  // user nice system idle iowait irq softirq steal, in clock ticks
  unsigned long long field[8] = {};
  if (!(stat >> label) || label != "cpu")
    return clock;
  for (auto& f : field) {
    if (!(stat >> f))
      return clock;
  }
  const unsigned long long busy =
      field[0] + field[1] + field[2] + field[5] + field[6] + field[7];
  clock.busySeconds =
      static_cast<double>(busy) / static_cast<double>(::sysconf(_SC_CLK_TCK));
  return clock;
}

double othersCoresBetween(const CpuClock& from, const CpuClock& to) {
  const double wall = std::chrono::duration<double>(to.at - from.at).count();
  if (wall <= 0.0)
    return -1.0;
  if (demandRead()) {
    // No thread can have run or waited longer than the interval. A thread
    // the first reading did not list counts whole, and that is not always a
    // new one: a busy reference tune read 241 cores in one turn (some
    // thread's 24 s in 0.1 s), and the fit to the load put every prediction
    // of that tune 6x too slow.
    const auto interval = static_cast<unsigned long long>(1e9 * wall);
    unsigned long long wanted = 0;
    for (const auto& [tid, ns] : to.othersDemand) {
      const auto before = from.othersDemand.find(tid);
      const bool same =
          before != from.othersDemand.end() && before->second <= ns;
      wanted += std::min(same ? ns - before->second : ns, interval);
    }
    return 1e-9 * static_cast<double>(wanted) / wall;
  }
  if (from.busySeconds < 0.0 || to.busySeconds < 0.0)
    return -1.0;
  const double others =
      (to.busySeconds - from.busySeconds) - (to.ownSeconds - from.ownSeconds);
  return std::max(0.0, others / wall);
}

} // namespace tpipe
