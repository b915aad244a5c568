#include "runtime/memory.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#include "tpipe/partition.h"

// LibTorch 2.3 made Allocator::allocate non-const.
#if TORCH_VERSION_MAJOR > 2 || \
    (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 3)
#define TPIPE_ALLOCATE_CONST
#else
#define TPIPE_ALLOCATE_CONST const
#endif

namespace tpipe {
namespace memory {
namespace {

struct DeviceCounters {
  std::atomic<int64_t> live{0};
  std::atomic<int64_t> peak{0};
  std::atomic<int64_t> capacity{0};
  std::mutex labelMutex;
  std::string label;
};

std::array<DeviceCounters, kMaxDevices>& counters() {
  static std::array<DeviceCounters, kMaxDevices> all;
  return all;
}

thread_local int currentDevice = kUnattributed;

// Each block carries a header saying who was charged, so the free credits
// the same device; data and context stay the same pointer, as LibTorch's
// raw_allocate requires. 64 bytes keep the default alignment.
constexpr size_t kHeader = 64;

struct Header {
  int64_t bytes;
  int device;
};

c10::DeleterFnPtr baseDeleter = nullptr;

void release(void* data) {
  if (data == nullptr)
    return;
  char* block = static_cast<char*>(data) - kHeader;
  const auto* header = reinterpret_cast<const Header*>(block);
  if (header->device >= 0)
    counters()[header->device].live -= header->bytes;
  baseDeleter(block);
}

// A block of `bytes` from `base`, owned raw: freed by base's raw deleter.
char* rawBlock(c10::Allocator* base, size_t bytes) {
  c10::DataPtr inner = base->allocate(bytes);
  TORCH_INTERNAL_ASSERT(
      inner.get() == inner.get_context(),
      "the wrapped CPU allocator uses contexts");
  return static_cast<char*>(inner.release_context());
}

// The allocators below wrap another's blocks, each with a header of
// kHeader bytes in front of the data.
class WrappingAllocator : public c10::Allocator {
 public:
  explicit WrappingAllocator(c10::DeleterFnPtr release) : release_(release) {}

  c10::DeleterFnPtr raw_deleter() const override {
    return release_;
  }

  // Pure virtual from LibTorch 2.3 on; a plain member before.
  void copy_data(void* destination, const void* source, std::size_t count)
      const {
    std::memcpy(destination, source, count);
  }

 protected:
  c10::DataPtr dataAfterHeader(char* block) const {
    void* data = block + kHeader;
    return c10::DataPtr(data, data, release_, c10::Device(c10::kCPU));
  }

 private:
  c10::DeleterFnPtr release_;
};

class CountingAllocator final : public WrappingAllocator {
 public:
  explicit CountingAllocator(c10::Allocator* base)
      : WrappingAllocator(&release), base_(base) {}

  c10::DataPtr allocate(size_t n) TPIPE_ALLOCATE_CONST override {
    const int device = currentDevice;
    const auto bytes = static_cast<int64_t>(n);
    if (device >= 0)
      charge(device, bytes);
    char* block = rawBlock(base_, n + kHeader);
    new (block) Header{bytes, device};
    return dataAfterHeader(block);
  }

 private:
  static void charge(int device, int64_t bytes) {
    DeviceCounters& c = counters()[device];
    const int64_t live = c.live.fetch_add(bytes) + bytes;
    const int64_t capacity = c.capacity.load();
    if (capacity > 0 && live > capacity) {
      c.live -= bytes;
      std::string label;
      {
        std::lock_guard<std::mutex> lock(c.labelMutex);
        label = c.label;
      }
      TORCH_CHECK(
          false,
          "out of memory on ",
          label,
          ": allocating ",
          formatBytes(bytes),
          " with ",
          formatBytes(live - bytes),
          " in use exceeds the capacity of ",
          formatBytes(capacity));
    }
    int64_t peak = c.peak.load();
    while (live > peak && !c.peak.compare_exchange_weak(peak, live)) {
    }
  }

  c10::Allocator* base_;
};

// ---- the cache of large host blocks ----------------------------------------
//
// glibc maps every block above its largest heap threshold (32 MiB) and
// unmaps it at free, and a worker thread's arena gives its heaps back as
// they empty: a step that allocates the same large activations every time
// faults them in again, a page per 4 KiB, under the process's mmap lock
// that the other workers' faults wait on. The cache keeps freed blocks of
// 1 MiB and more by size for the next allocation of that size.
//
// Blocks are kept by size, not split, so the cache may hold more than the
// process's peak: a step's sizes peak at different times. It is bounded:
// a block comes from the system only when none of its size is kept, and
// when that would make the large blocks held (live and kept) more than
// twice the most ever live at once, every kept block goes back first; so
// does all of it when the system refuses a block. (Giving every kept block
// back at each allocation from the system, to hold no more than the peak,
// emptied the cache every step: on a two-stage CNN 32 of a step's 67 large
// blocks still came from the system.)
constexpr size_t kCachedFrom = size_t{1} << 20;
constexpr size_t kCacheGranule = size_t{64} << 10;

// In front of every block (64 bytes keep the base's alignment): its cached
// size, 0 for a block too small to cache, freed to the base at once.
struct CacheHeader {
  size_t bytes;
};

c10::DeleterFnPtr cacheBaseDeleter = nullptr;
c10::Allocator* cacheBase = nullptr;

struct CacheState {
  std::mutex mutex;
  std::unordered_map<size_t, std::vector<char*>> free;
  int64_t cachedBytes = 0, hits = 0, misses = 0;
  int64_t liveBytes = 0, peakLiveBytes = 0; // of blocks the cache sized

  // Under `mutex`: every cached block back to the base.
  void flush() {
    for (auto& [bytes, blocks] : free) {
      for (char* block : blocks)
        cacheBaseDeleter(block);
    }
    free.clear();
    cachedBytes = 0;
  }
};

CacheState& cacheState() {
  static CacheState* state = new CacheState; // outlives static tensors
  return *state;
}

void releaseToCache(void* data) {
  if (data == nullptr)
    return;
  char* block = static_cast<char*>(data) - kHeader;
  const size_t bytes = reinterpret_cast<const CacheHeader*>(block)->bytes;
  if (bytes == 0) {
    cacheBaseDeleter(block);
    return;
  }
  CacheState& cache = cacheState();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.free[bytes].push_back(block);
  cache.cachedBytes += static_cast<int64_t>(bytes);
  cache.liveBytes -= static_cast<int64_t>(bytes);
}

class CachingAllocator final : public WrappingAllocator {
 public:
  CachingAllocator() : WrappingAllocator(&releaseToCache) {}

  c10::DataPtr allocate(size_t n) TPIPE_ALLOCATE_CONST override {
    const size_t wanted = n + kHeader;
    char* block = nullptr;
    size_t bytes = 0;
    if (wanted >= kCachedFrom) {
      bytes = (wanted + kCacheGranule - 1) / kCacheGranule * kCacheGranule;
      block = take(bytes);
    } else {
      block = rawBlock(cacheBase, wanted);
    }
    new (block) CacheHeader{bytes};
    return dataAfterHeader(block);
  }

 private:
  static char* take(size_t bytes) {
    CacheState& cache = cacheState();
    const auto size = static_cast<int64_t>(bytes);
    {
      std::lock_guard<std::mutex> lock(cache.mutex);
      cache.liveBytes += size;
      cache.peakLiveBytes = std::max(cache.peakLiveBytes, cache.liveBytes);
      auto found = cache.free.find(bytes);
      if (found != cache.free.end() && !found->second.empty()) {
        char* block = found->second.back();
        found->second.pop_back();
        cache.cachedBytes -= size;
        ++cache.hits;
        return block;
      }
      ++cache.misses;
      if (cache.liveBytes + cache.cachedBytes > 2 * cache.peakLiveBytes)
        cache.flush();
    }
    try {
      return rawBlock(cacheBase, bytes);
    } catch (const c10::Error&) {
      {
        std::lock_guard<std::mutex> lock(cache.mutex);
        cache.flush();
      }
      try {
        return rawBlock(cacheBase, bytes);
      } catch (...) {
        std::lock_guard<std::mutex> lock(cache.mutex);
        cache.liveBytes -= size;
        throw;
      }
    }
  }
};

std::once_flag cacheOnce;
std::atomic<bool> cacheInstalled{false};

std::atomic<bool> isInstalled{false};

std::mutex slotMutex;
std::array<bool, kMaxDevices> slotTaken{};

} // namespace

int acquireSlot() {
  std::lock_guard<std::mutex> lock(slotMutex);
  for (int slot = 0; slot < kMaxDevices; ++slot) {
    if (slotTaken[slot])
      continue;
    slotTaken[slot] = true;
    DeviceCounters& c = counters()[slot];
    c.capacity = 0;
    c.peak = c.live.load();
    return slot;
  }
  TORCH_CHECK(
      false,
      "memory accounting: more than ",
      kMaxDevices,
      " devices in live pipelines and profilers");
}

void releaseSlot(int slot) {
  std::lock_guard<std::mutex> lock(slotMutex);
  if (slot >= 0 && slot < kMaxDevices) {
    slotTaken[slot] = false;
    counters()[slot].capacity = 0;
  }
}

void install() {
  static std::once_flag once;
  std::call_once(once, [] {
    // Under the accounting, so that a cached block counts as freed.
    installHostCache();
    c10::Allocator* base = c10::GetCPUAllocator();
    baseDeleter = base->raw_deleter();
    TORCH_CHECK(
        baseDeleter != nullptr,
        "memory accounting needs a CPU allocator with a raw deleter");
    static CountingAllocator allocator(base);
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
    isInstalled = true;
  });
}

bool installed() {
  return isInstalled;
}

bool keepHeapMemory() {
#if defined(__GLIBC__)
  static const bool kept = [] {
    for (const char* name :
         {"MALLOC_MMAP_THRESHOLD_",
          "MALLOC_TRIM_THRESHOLD_",
          "MALLOC_TOP_PAD_"}) {
      if (std::getenv(name) != nullptr)
        return false;
    }
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    if (tunables != nullptr &&
        std::strstr(tunables, "glibc.malloc.") != nullptr)
      return false;
    // glibc's largest mmap threshold (4 Mi longs); setting it also stops
    // glibc moving the threshold itself. -1: never trim.
    const int largest = static_cast<int>(4 * 1024 * 1024 * sizeof(long));
    return mallopt(M_MMAP_THRESHOLD, largest) == 1 &&
        mallopt(M_TRIM_THRESHOLD, -1) == 1;
  }();
  return kept;
#else
  return false;
#endif
}

void installHostCache() {
  std::call_once(cacheOnce, [] {
    const char* wanted = std::getenv("TPIPE_HOST_CACHE");
    if (!keepHeapMemory() || (wanted != nullptr && std::string(wanted) == "0"))
      return;
    TORCH_CHECK(
        !isInstalled,
        "the host-memory cache must be installed under the accounting");
    cacheBase = c10::GetCPUAllocator();
    cacheBaseDeleter = cacheBase->raw_deleter();
    if (cacheBaseDeleter == nullptr)
      return; // a CPU allocator of the user's that frees by context
    static CachingAllocator allocator;
    c10::SetCPUAllocator(&allocator, /*priority=*/100);
    // Not where the user's own allocator has a higher priority.
    cacheInstalled = c10::GetCPUAllocator() == &allocator;
  });
}

HostCacheStats hostCacheStats() {
  HostCacheStats stats;
  stats.installed = cacheInstalled;
  CacheState& cache = cacheState();
  std::lock_guard<std::mutex> lock(cache.mutex);
  stats.cachedBytes = cache.cachedBytes;
  stats.hits = cache.hits;
  stats.misses = cache.misses;
  stats.peakLiveBytes = cache.peakLiveBytes;
  return stats;
}

void releaseHostCache() {
  CacheState& cache = cacheState();
  std::lock_guard<std::mutex> lock(cache.mutex);
  cache.flush();
}

void setThreadDevice(int device) {
  TORCH_CHECK(
      device >= kUnattributed && device < kMaxDevices,
      "device index ",
      device,
      " out of range");
  currentDevice = device;
}

int threadDevice() {
  return currentDevice;
}

void setCapacity(int device, int64_t bytes, const std::string& label) {
  DeviceCounters& c = counters().at(device);
  {
    std::lock_guard<std::mutex> lock(c.labelMutex);
    c.label = label;
  }
  c.capacity = bytes;
}

int64_t liveBytes(int device) {
  return counters().at(device).live;
}
int64_t peakBytes(int device) {
  return counters().at(device).peak;
}
void resetPeak(int device) {
  counters().at(device).peak = counters().at(device).live.load();
}

#ifndef TPIPE_USE_CUDA
bool acceleratorStats(c10::Device, int64_t*, int64_t*) {
  return false;
}
void resetAcceleratorPeak(c10::Device) {}
#endif

} // namespace memory
} // namespace tpipe
