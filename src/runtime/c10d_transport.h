// The c10d transport, seen from the rest of the runtime (no c10d types).
#pragma once

#include <memory>

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
std::unique_ptr<Transport> makeProcessGroupTransport(
    const std::vector<int>& placement,
    Communicator& communicator,
    int stages,
    int microBatches,
    int slots);

} // namespace runtime
} // namespace tpipe
