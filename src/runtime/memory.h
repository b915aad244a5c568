// Per-device accounting of CPU memory: a wrapping CPU allocator charges each
// allocation to the device whose worker thread allocates it (a thread-local
// index), and frees to the device that was charged. Installed on demand
// (profiling, memory reports, capacities); without it nothing is counted.
#pragma once

#include <cstdint>
#include <string>

#include <c10/core/Device.h>

namespace tpipe {
namespace memory {

constexpr int kMaxDevices = 64;
constexpr int kUnattributed = -1;

// Accounting slots: one per device of a live pipeline. acquireSlot resets
// the slot's counters and capacity; throws when all are taken.
int acquireSlot();
void releaseSlot(int slot);

// Wraps LibTorch's CPU allocator; idempotent and permanent for the process.
// Installs the host cache beneath it first.
void install();
bool installed();

// glibc's heap keeps what a step frees (tpipe::keepFreedHostMemory's
// settings), set once per process; whether they took effect (not where the
// user's own malloc settings are in the environment).
bool keepHeapMemory();

// The cache of freed host blocks of 1 MiB and more (glibc would unmap or
// trim them), beneath the accounting: where keepHeapMemory took effect and
// TPIPE_HOST_CACHE is not 0, once per process.
void installHostCache();

struct HostCacheStats {
  bool installed = false;
  int64_t cachedBytes = 0;   // freed, kept for the next allocation
  int64_t hits = 0;          // allocations a kept block served
  int64_t misses = 0;        // allocations of a size none was kept of
  int64_t peakLiveBytes = 0; // the most bytes of its sizes live at once
};
HostCacheStats hostCacheStats();

// Every kept block back to the system.
void releaseHostCache();

// The device charged for allocations on this thread (kUnattributed: none).
void setThreadDevice(int device);
int threadDevice();

// A capacity per device (0: none). An allocation that would exceed it
// throws c10::Error naming `label`, the bytes in use and the capacity.
void setCapacity(int device, int64_t bytes, const std::string& label);

int64_t liveBytes(int device);
int64_t peakBytes(int device);
void resetPeak(int device); // peak := live

// An accelerator's own allocator statistics (CUDA's caching allocator in
// TPIPE_USE_CUDA builds); false for devices it cannot report on. Several
// ranks sharing one GPU share its numbers.
bool acceleratorStats(c10::Device device, int64_t* live, int64_t* peak);
void resetAcceleratorPeak(c10::Device device);

// Charges the current thread's allocations to `device` for a scope.
class DeviceScope {
 public:
  explicit DeviceScope(int device) : previous_(threadDevice()) {
    setThreadDevice(device);
  }
  ~DeviceScope() {
    setThreadDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_;
};

} // namespace memory
} // namespace tpipe
