// What other processes ask of this machine's cores while the tuner times a
// plan: the figure a neighbour's bursts are held against (tune.h,
// stepsAtTheLoadTrainingMeets).
#pragma once

#include <chrono>
#include <unordered_map>

namespace tpipe {

// One moment's reading: what each other process's threads had wanted of
// the cores so far, or where that is not read (othersCoresBetween), the
// machine's busy CPU time and this process's own.
struct CpuClock {
  double busySeconds = -1.0; // every process's, from /proc/stat
  double ownSeconds = 0.0;
  // Per thread id, the nanoseconds it ran and waited to run.
  std::unordered_map<long, unsigned long long> othersDemand;
  std::chrono::steady_clock::time_point at;
};

CpuClock readCpuClock();

// The cores other processes wanted between two readings: the time their
// threads ran or waited to run, over the wall time. A plan cannot change
// it: a neighbour spinning in wall-clock bursts wants a core for as long
// whatever we run, while the cores it gets (/proc/stat's busy time) are
// what the plan left it: beside one, training plans left it 0.31 cores (one
// stage on two threads), 0.39 (zb-v) and 0.43 (dualpipe), and it wanted
// 0.49-0.54 under each. A thread begun meanwhile counts whole, up to the
// interval (as every thread), one ended meanwhile is lost. Where the kernel
// keeps no schedstat, or the machine runs over a thousand threads (each reading
// would take over 10 ms), the cores other processes kept busy; negative where
// neither could be read.
double othersCoresBetween(const CpuClock& from, const CpuClock& to);

} // namespace tpipe
