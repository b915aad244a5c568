// The c10d transport, seen from the rest of the runtime (no c10d types).
#pragma once

#include <memory>
#include <vector>

#include <c10/core/Device.h>

#include "runtime/transport.h"
#include "tpipe/distributed.h"

namespace tpipe {
namespace runtime {

// Point-to-point over the communicator's world group: stage s of this
// replica lives on process replica * P + s % P. Boundaries whose two stages
// share this process go through a LocalTransport. Each tensor of a transfer
// (the activation, then its skips; at most `slots`) is a message; without
// known shapes (Transport::expect) each is preceded by a small header
// (micro-batch, boundary, slot, count, dtype, shape), so receivers allocate
// before the data arrives and reject what they did not expect.
// `placement`: each stage's pipeline rank (empty: stage % pipeline ranks).
// `dataDevice`: where this process's transfers live. The CPU sends over the
// world's Gloo group; a GPU (when carriesDeviceTensors) over one NCCL group
// per remote boundary and direction, so tensors never pass through host
// memory. NCCL matches by order: the schedule must send and receive each
// boundary's transfers in the same micro-batch order on both sides
// (transfersInOrder in pipeline.cpp checks it).
std::unique_ptr<Transport> makeProcessGroupTransport(
    const std::vector<int>& placement,
    Communicator& communicator,
    int stages,
    int microBatches,
    int slots,
    c10::Device dataDevice);

// Where pipeline rank `rank`'s transfers to other processes live: its GPU
// when NCCL can carry them (a build with TPIPE_USE_NCCL, `nccl` allowed, a
// CUDA device no other rank names: NCCL cannot pair a GPU with itself),
// else the CPU (Gloo, through host memory).
c10::Device transferDevice(
    const std::vector<c10::Device>& rankDevices,
    int rank,
    bool nccl);

} // namespace runtime
} // namespace tpipe
