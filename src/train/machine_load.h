// What other processes ask of this machine's cores while the tuner times a
// plan: the figure a neighbour's bursts are held against (tune.h,
// stepsAtTheLoadTrainingMeets).
#pragma once

#include <chrono>
#include <unordered_map>

namespace tpipe {

// What one thread of another process had taken of the cores so far.
struct ThreadTime {
  unsigned long long ranNs = 0;
  unsigned long long waitedNs = 0; // runnable, waiting for a core
};

// One moment's reading. Where the kernel keeps schedstat, every other
// process's threads this process can see; where it does not, or where some
// processes may be out of sight (a container's PID namespace), the busy
// time of the cores this process may run on and its own CPU time.
struct CpuClock {
  bool othersRead = false;
  std::unordered_map<long, ThreadTime> others; // per thread id
  double busySeconds = -1.0;                   // -1: not read
  double ownSeconds = 0.0;
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
// interval (as every thread), one ended meanwhile is lost. Processes out of
// sight count by the busy time no seen thread and no thread of ours took:
// the cores they got, not all they wanted, which beats a flat zero. Where
// the kernel keeps no schedstat, or the machine runs over a thousand threads
// (each reading would take over 10 ms), the busy time alone; negative where
// neither could be read.
double othersCoresBetween(const CpuClock& from, const CpuClock& to);

} // namespace tpipe
