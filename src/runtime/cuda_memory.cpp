// CUDA's caching allocator statistics: the one CUDA-specific file, built
// only with TPIPE_USE_CUDA.
#include <c10/cuda/CUDACachingAllocator.h>

#include "runtime/memory.h"

namespace tpipe {
namespace memory {

bool acceleratorStats(c10::Device device, int64_t* live, int64_t* peak) {
  if (!device.is_cuda())
    return false;
  const auto stats =
      c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
  const auto& allocated =
      stats.allocated_bytes[0]; // 0: the aggregate over pools
  *live = allocated.current;
  *peak = allocated.peak;
  return true;
}

void resetAcceleratorPeak(c10::Device device) {
  if (device.is_cuda())
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
}

} // namespace memory
} // namespace tpipe
