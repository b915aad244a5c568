// What this host can still give a process, read before anything large is
// allocated: the model, the data, the plan are each refused with their
// figures rather than met by a failed allocation or a swapping machine.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace tpipe {

// MemAvailable from /proc/meminfo; 0 when unknown (then nothing is refused).
inline int64_t availableMemoryBytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t value = 0;
  while (meminfo >> key >> value >> unit) {
    if (key == "MemAvailable:")
      return value * 1024;
  }
  return 0;
}

} // namespace tpipe
