// Tied parameters: one weight used by layers on different stages (a GPT's
// token embedding and its LM head). Each stage keeps its own copy; their
// gradients are summed before the optimizer step, so the copies stay equal
// bit for bit, as Megatron's embedding group does.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tpipe/pipeline.h"

namespace tpipe {
namespace runtime {

struct TiedGroup {
  // One entry per use, in layer order: "layer.parameter", its stage, its
  // tensor (a tensor shared by layers appears once per use).
  std::vector<std::string> names;
  std::vector<int> stages;
  std::vector<at::Tensor> tensors;
};

// The declared groups (parameter names, as namedParameters names them) and
// the detected ones (one tensor in layers of two stages), whose uses fall on
// more than one stage. Checks names and shapes (c10::Error naming them) and
// copies the first use's values into the other copies.
std::vector<TiedGroup> findTiedGroups(
    const LayerList& layers,
    const std::vector<int>& boundaries,
    const std::vector<std::vector<std::string>>& declared);

// A bidirectional schedule's further chains run copies of the layers
// (copies[c - 1] for chain c, stages c * L .. c * L + L - 1 where L is the
// partition's stage count). Each trainable parameter and its copies form
// one group, as a tie does: their gradients are summed and the optimizer
// steps every copy alike. A tied group gains its copies' uses.
std::vector<TiedGroup> withChainCopies(
    std::vector<TiedGroup> groups,
    const LayerList& layers,
    const std::vector<LayerList>& copies,
    const std::vector<int>& boundaries);

// Each group's copies take its first use's values (an original's, under
// dualpipe): at the start, and after the originals are loaded.
void makeCopiesEqual(const std::vector<TiedGroup>& groups);

bool isTied(const std::vector<TiedGroup>& groups, const at::Tensor& tensor);

// Sums each group's gradient over its copies on this process's stages (in
// stage order) and, with a communicator, over every process (its replicas'
// sums averaged), and writes the total into every local copy. Copies that
// are one tensor count once: autograd has summed their uses already.
void sumTiedGradients(
    const std::vector<TiedGroup>& groups,
    const std::function<bool(int stage)>& isLocalStage,
    Communicator* communicator);

// Across processes without a collective, for steps without a barrier: each
// process holding copies of a group sends its local sum (in stage order)
// to every other process holding one, and adds the sums it receives in
// process order, its own in its place, then averages over the replicas. So
// every copy ends equal bit for bit, and only the holders wait, each for
// the others' ends of the step. With two holders (a tie between two ranks,
// dualpipe's every parameter and its copy) the sum equals the collective's
// bit for bit. `processesOf(stage)`: the processes running the stage, one
// per replica. One message per peer and dtype, through `send` and
// `receive` (`slot` numbers the dtype, in the groups' order).
struct TieMessages {
  std::function<void(int process, int slot, const at::Tensor& flat)> send;
  std::function<at::Tensor(int process, int slot, const at::Tensor& like)>
      receive;
};
void exchangeTiedGradients(
    const std::vector<TiedGroup>& groups,
    const std::function<std::vector<int>(int stage)>& processesOf,
    int me,
    int replicas,
    const TieMessages& messages);

// How many dtypes exchangeTiedGradients may send per peer: its slots.
constexpr int kTieDtypeSlots = 2;

} // namespace runtime
} // namespace tpipe
