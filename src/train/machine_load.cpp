#include "train/machine_load.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include <dirent.h>
#include <fcntl.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>

namespace tpipe {
namespace {

using Threads = std::unordered_map<long, ThreadTime>;

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
Threads readOthersThreads() {
  Threads threads;
  const long own = static_cast<long>(::getpid());
  DIR* proc = ::opendir("/proc");
  if (!proc)
    return threads;
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
        threads[tid] = ThreadTime{ran, waited};
    }
    ::closedir(tasks);
  }
  ::closedir(proc);
  return threads;
}

// Whether turns read what other threads wanted: where the kernel keeps
// schedstat and the machine runs few enough threads that a reading stays
// a few milliseconds (about 13 us a thread on a 2-core VM), decided once so
// that every turn of a tune is read alike. Elsewhere the busy time stands.
bool demandRead() {
  constexpr size_t kMostThreadsRead = 1000;
  static const bool read =
      schedstatKept() && readOthersThreads().size() <= kMostThreadsRead;
  return read;
}

// Whether some processes may be out of this one's sight: it runs in a PID
// namespace other than the machine's first (a container's), whose fixed
// inode number the kernel gives that one alone.
bool othersMayBeHidden() {
  static const bool hidden = [] {
    char link[64] = {};
    const ssize_t got = ::readlink("/proc/self/ns/pid", link, sizeof link - 1);
    return got > 0 && std::string(link, got) != "pid:[4026531836]";
  }();
  return hidden;
}

// The busy seconds of the cores this process may run on (/proc/stat's
// lines per core): a neighbour elsewhere on a larger host takes nothing
// from us. Negative where /proc/stat cannot be read.
double busySecondsOfOurCores() {
  cpu_set_t ours;
  CPU_ZERO(&ours);
  const bool pinned = ::sched_getaffinity(0, sizeof ours, &ours) == 0;
  std::ifstream stat("/proc/stat");
  if (!stat)
    return -1.0;
  unsigned long long busy = 0;
  bool anyCore = false;
  for (std::string line; std::getline(stat, line);) {
    int core = -1;
    // user nice system idle iowait irq softirq steal, in clock ticks
    unsigned long long f[8] = {};
    if (std::sscanf(
            line.c_str(),
            "cpu%d %llu %llu %llu %llu %llu %llu %llu %llu",
            &core,
            &f[0],
            &f[1],
            &f[2],
            &f[3],
            &f[4],
            &f[5],
            &f[6],
            &f[7]) != 9)
      continue; // the total line, or no core's
    if (pinned && (core < 0 || core >= CPU_SETSIZE || !CPU_ISSET(core, &ours)))
      continue;
    busy += f[0] + f[1] + f[2] + f[5] + f[6] + f[7];
    anyCore = true;
  }
  if (!anyCore)
    return -1.0;
  return static_cast<double>(busy) /
      static_cast<double>(::sysconf(_SC_CLK_TCK));
}

} // namespace

CpuClock readCpuClock() {
  CpuClock clock;
  if (demandRead()) {
    clock.othersRead = true;
    clock.others = readOthersThreads();
    if (!othersMayBeHidden()) {
      clock.at = std::chrono::steady_clock::now();
      return clock; // the busy time is not wanted beside it
    }
  }
  clock.at = std::chrono::steady_clock::now();
  timespec own{};
  ::clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &own);
  clock.ownSeconds = static_cast<double>(own.tv_sec) + 1e-9 * own.tv_nsec;
  clock.busySeconds = busySecondsOfOurCores();
  return clock;
}

double othersCoresBetween(const CpuClock& from, const CpuClock& to) {
  const double wall = std::chrono::duration<double>(to.at - from.at).count();
  if (wall <= 0.0)
    return -1.0;
  const bool busyRead = from.busySeconds >= 0.0 && to.busySeconds >= 0.0;
  const double othersBusy = busyRead
      ? (to.busySeconds - from.busySeconds) - (to.ownSeconds - from.ownSeconds)
      : 0.0;
  if (from.othersRead && to.othersRead) {
    // No thread can have run or waited longer than the interval. A thread
    // the first reading did not list counts whole, and that is not always a
    // new one: a busy reference tune read 241 cores in one turn (some
    // thread's 24 s in 0.1 s), and the fit to the load put every prediction
    // of that tune 6x too slow.
    const auto interval = static_cast<unsigned long long>(1e9 * wall);
    unsigned long long wanted = 0, ran = 0;
    for (const auto& [tid, now] : to.others) {
      const auto before = from.others.find(tid);
      const bool same = before != from.others.end() &&
          before->second.ranNs <= now.ranNs &&
          before->second.waitedNs <= now.waitedNs;
      const ThreadTime since = same
          ? ThreadTime{now.ranNs - before->second.ranNs,
                       now.waitedNs - before->second.waitedNs}
          : now;
      wanted += std::min(since.ranNs + since.waitedNs, interval);
      ran += std::min(since.ranNs, interval);
    }
    const double hidden = busyRead
        ? std::max(0.0, othersBusy - 1e-9 * static_cast<double>(ran))
        : 0.0;
    return (1e-9 * static_cast<double>(wanted) + hidden) / wall;
  }
  if (!busyRead)
    return -1.0;
  return std::max(0.0, othersBusy / wall);
}

} // namespace tpipe
