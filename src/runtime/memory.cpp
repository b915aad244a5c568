#include "runtime/memory.h"

#include <array>
#include <atomic>
#include <cstring>
#include <mutex>

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

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) TPIPE_ALLOCATE_CONST override {
    const int device = currentDevice;
    const auto bytes = static_cast<int64_t>(n);
    if (device >= 0)
      charge(device, bytes);
    c10::DataPtr inner = base_->allocate(n + kHeader);
    TORCH_INTERNAL_ASSERT(
        inner.get() == inner.get_context(),
        "the wrapped CPU allocator uses contexts");
    char* block = static_cast<char*>(inner.release_context());
    new (block) Header{bytes, device};
    void* data = block + kHeader;
    return c10::DataPtr(data, data, &release, c10::Device(c10::kCPU));
  }

  c10::DeleterFnPtr raw_deleter() const override {
    return &release;
  }

  // Pure virtual from LibTorch 2.3 on; a plain member before.
  void copy_data(void* destination, const void* source, std::size_t count)
      const {
    std::memcpy(destination, source, count);
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
