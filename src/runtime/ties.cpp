#include "runtime/ties.h"

#include <algorithm>
#include <map>
#include <set>

#include <ATen/core/grad_mode.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

namespace tpipe {
namespace runtime {
namespace {

struct Use {
  std::string name;
  int stage;
  at::Tensor tensor;
};

std::vector<Use> parameterUses(
    const LayerList& layers,
    const std::vector<int>& boundaries) {
  std::vector<Use> uses;
  int stage = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    while (static_cast<int>(l) >= boundaries[stage + 1])
      ++stage;
    for (const auto& item : layers[l].module.ptr()->named_parameters()) {
      if (item.value().requires_grad())
        uses.push_back(
            {layers[l].name + "." + item.key(), stage, item.value()});
    }
  }
  return uses;
}

TiedGroup declaredGroup(
    const std::vector<std::string>& names,
    const std::vector<Use>& uses) {
  TORCH_CHECK(
      names.size() >= 2,
      "a tied group names at least two parameters, got ",
      names.size());
  TiedGroup group;
  for (const auto& name : names) {
    auto use = std::find_if(
        uses.begin(), uses.end(), [&](const Use& u) { return u.name == name; });
    TORCH_CHECK(
        use != uses.end(),
        "tied parameter '",
        name,
        "' is not a trainable parameter of any layer (names are "
        "\"<layer>.<parameter>\", e.g. \"0.weight\")");
    group.names.push_back(use->name);
    group.stages.push_back(use->stage);
    group.tensors.push_back(use->tensor);
  }
  const at::Tensor& first = group.tensors.front();
  for (size_t i = 1; i < group.tensors.size(); ++i) {
    TORCH_CHECK(
        group.tensors[i].sizes() == first.sizes() &&
            group.tensors[i].scalar_type() == first.scalar_type(),
        "tied parameters '",
        group.names.front(),
        "' ",
        first.sizes(),
        " and '",
        group.names[i],
        "' ",
        group.tensors[i].sizes(),
        " differ in shape or dtype");
  }
  return group;
}

bool sameTensor(const at::Tensor& a, const at::Tensor& b) {
  return a.unsafeGetTensorImpl() == b.unsafeGetTensorImpl();
}

// The group's copies on the stages `isLocalStage` accepts, each tensor once
// (uses of one tensor are summed by autograd already).
std::vector<at::Tensor> localCopies(
    const TiedGroup& group,
    const std::function<bool(int stage)>& isLocalStage) {
  std::vector<at::Tensor> copies;
  for (size_t i = 0; i < group.tensors.size(); ++i) {
    if (!isLocalStage(group.stages[i]))
      continue;
    const bool seen =
        std::any_of(copies.begin(), copies.end(), [&](const at::Tensor& c) {
          return sameTensor(c, group.tensors[i]);
        });
    if (!seen)
      copies.push_back(group.tensors[i]);
  }
  return copies;
}

} // namespace

void makeCopiesEqual(const std::vector<TiedGroup>& groups) {
  at::NoGradGuard noGrad;
  for (const auto& group : groups) {
    for (size_t i = 1; i < group.tensors.size(); ++i) {
      if (!sameTensor(group.tensors[i], group.tensors.front()))
        group.tensors[i].copy_(group.tensors.front());
    }
  }
}

std::vector<TiedGroup> findTiedGroups(
    const LayerList& layers,
    const std::vector<int>& boundaries,
    const std::vector<std::vector<std::string>>& declared) {
  const std::vector<Use> uses = parameterUses(layers, boundaries);
  std::vector<TiedGroup> groups;
  for (const auto& names : declared)
    groups.push_back(declaredGroup(names, uses));
  // One tensor used on two stages is tied without being declared.
  std::map<const c10::TensorImpl*, TiedGroup> shared;
  std::vector<const c10::TensorImpl*> order;
  for (const auto& use : uses) {
    if (isTied(groups, use.tensor))
      continue;
    auto& group = shared[use.tensor.unsafeGetTensorImpl()];
    if (group.names.empty())
      order.push_back(use.tensor.unsafeGetTensorImpl());
    group.names.push_back(use.name);
    group.stages.push_back(use.stage);
    group.tensors.push_back(use.tensor);
  }
  for (const auto* key : order) {
    TiedGroup& group = shared[key];
    const auto [low, high] =
        std::minmax_element(group.stages.begin(), group.stages.end());
    if (*low != *high)
      groups.push_back(std::move(group));
  }
  makeCopiesEqual(groups);
  return groups;
}

std::vector<TiedGroup> withChainCopies(
    std::vector<TiedGroup> groups,
    const LayerList& layers,
    const std::vector<LayerList>& copies,
    const std::vector<int>& boundaries) {
  const int chainLength = static_cast<int>(boundaries.size()) - 1;
  // Each copy's parameters by the original's name; the layers align.
  std::vector<std::map<std::string, at::Tensor>> copied(copies.size());
  for (size_t c = 0; c < copies.size(); ++c) {
    for (const auto& use : parameterUses(copies[c], boundaries))
      copied[c][use.name] = use.tensor;
  }
  // `name` by value: it may be one of the group's own, which this grows.
  auto addCopies = [&](TiedGroup& group, std::string name, int stage) {
    for (size_t c = 0; c < copies.size(); ++c) {
      group.names.push_back(name);
      group.stages.push_back(stage + static_cast<int>(c + 1) * chainLength);
      group.tensors.push_back(copied[c].at(name));
    }
  };
  for (auto& group : groups) {
    const size_t uses = group.names.size();
    for (size_t i = 0; i < uses; ++i)
      addCopies(group, group.names[i], group.stages[i]);
  }
  // Every other parameter; a tensor two layers share gains each layer's
  // copy, as the copies are tensors of their own.
  for (const auto& use : parameterUses(layers, boundaries)) {
    auto holder = std::find_if(groups.begin(), groups.end(), [&](auto& g) {
      return std::any_of(g.tensors.begin(), g.tensors.end(), [&](auto& t) {
        return sameTensor(t, use.tensor);
      });
    });
    if (holder == groups.end()) {
      groups.emplace_back();
      holder = groups.end() - 1;
    } else if (
        std::find(holder->names.begin(), holder->names.end(), use.name) !=
        holder->names.end()) {
      continue;
    }
    holder->names.push_back(use.name);
    holder->stages.push_back(use.stage);
    holder->tensors.push_back(use.tensor);
    addCopies(*holder, use.name, use.stage);
  }
  // The copies were taken before the declared ties were made equal.
  makeCopiesEqual(groups);
  return groups;
}

bool isTied(const std::vector<TiedGroup>& groups, const at::Tensor& tensor) {
  for (const auto& group : groups) {
    for (const auto& member : group.tensors) {
      if (sameTensor(member, tensor))
        return true;
    }
  }
  return false;
}

void sumTiedGradients(
    const std::vector<TiedGroup>& groups,
    const std::function<bool(int stage)>& isLocalStage,
    Communicator* communicator) {
  at::NoGradGuard noGrad;
  // Across processes: each group's local sum, awaiting the world's.
  struct Pending {
    std::vector<at::Tensor> copies;
    at::Tensor total;
  };
  std::vector<Pending> pending;
  for (const auto& group : groups) {
    std::vector<at::Tensor> copies = localCopies(group, isLocalStage);
    if (copies.empty() && !communicator)
      continue;
    if (!communicator && copies.size() < 2)
      continue; // one tensor: autograd summed its uses
    const bool allDefined =
        std::all_of(copies.begin(), copies.end(), [](const at::Tensor& c) {
          return c.grad().defined() && c.grad().device() == c.device();
        });
    if (!communicator && allDefined) {
      // In place on the first copy's gradient (the same sum, in the same
      // order, as from zeros): dualpipe ties every parameter, and each pass
      // over its gradients costs.
      at::Tensor& total = copies.front().mutable_grad();
      for (size_t i = 1; i < copies.size(); ++i)
        total.add_(copies[i].grad().to(total.device()));
      for (size_t i = 1; i < copies.size(); ++i)
        copies[i].mutable_grad().copy_(total);
      continue;
    }
    const at::Tensor& model = group.tensors.front();
    const c10::Device device =
        copies.empty() ? c10::Device(at::kCPU) : copies.front().device();
    at::Tensor total = at::zeros(model.sizes(), model.options().device(device));
    for (const auto& copy : copies) {
      if (copy.grad().defined())
        total.add_(copy.grad().to(device));
    }
    pending.push_back({std::move(copies), std::move(total)});
  }
  // Across processes: one collective per dtype for every group, their
  // totals flattened (dualpipe ties each parameter to its copy).
  std::map<at::ScalarType, std::vector<Pending*>> byType;
  for (auto& item : pending) {
    if (communicator) // in one process each total is already the sum
      byType[item.total.scalar_type()].push_back(&item);
  }
  for (auto& entry : byType) {
    std::vector<at::Tensor> flat;
    for (const Pending* item : entry.second)
      flat.push_back(item->total.to(at::kCPU).reshape({-1}));
    at::Tensor host = at::cat(flat); // the process group is Gloo's
    communicator->sumInPlace(host);
    host.div_(communicator->replicas());
    int64_t offset = 0;
    for (Pending* item : entry.second) {
      const int64_t size = item->total.numel();
      at::Tensor summed = at::empty_like(item->total);
      summed.copy_(host.narrow(0, offset, size).view(item->total.sizes()));
      item->total = std::move(summed);
      offset += size;
    }
  }
  for (auto& [copies, total] : pending) {
    for (auto& copy : copies) {
      if (copy.grad().defined()) {
        copy.mutable_grad().copy_(total);
      } else {
        copy.mutable_grad() = total.to(copy.device());
      }
    }
  }
}

void exchangeTiedGradients(
    const std::vector<TiedGroup>& groups,
    const std::function<std::vector<int>(int stage)>& processesOf,
    int me,
    int replicas,
    const TieMessages& messages) {
  at::NoGradGuard noGrad;
  // The groups' dtypes in order: every process finds the same slots.
  std::vector<at::ScalarType> dtypes;
  for (const auto& group : groups) {
    const at::ScalarType dtype = group.tensors.front().scalar_type();
    if (std::find(dtypes.begin(), dtypes.end(), dtype) == dtypes.end())
      dtypes.push_back(dtype);
  }
  TORCH_CHECK(
      static_cast<int>(dtypes.size()) <= kTieDtypeSlots,
      "tied parameters across processes come in ",
      dtypes.size(),
      " dtypes; steps without a barrier carry at most ",
      kTieDtypeSlots,
      " (set pipeline.overlap_steps to false)");
  auto slotOf = [&](const at::Tensor& tensor) {
    return static_cast<int>(
        std::find(dtypes.begin(), dtypes.end(), tensor.scalar_type()) -
        dtypes.begin());
  };
  struct Held {
    std::vector<at::Tensor> copies; // distinct, on this process's stages
    std::vector<int> holders;       // ascending, this process among them
    at::Tensor partial;             // on the host
  };
  std::vector<Held> held;
  std::set<int> peers;
  for (const TiedGroup& group : groups) {
    Held item;
    item.copies = localCopies(group, [&](int stage) {
      const std::vector<int> processes = processesOf(stage);
      return std::find(processes.begin(), processes.end(), me) !=
          processes.end();
    });
    if (item.copies.empty())
      continue;
    std::set<int> holders;
    for (int stage : group.stages) {
      const std::vector<int> processes = processesOf(stage);
      holders.insert(processes.begin(), processes.end());
    }
    item.holders.assign(holders.begin(), holders.end());
    const at::Tensor& model = group.tensors.front();
    const at::Tensor& only = item.copies.front().grad();
    if (item.copies.size() == 1 && only.defined() && only.is_cpu() &&
        only.is_contiguous()) {
      item.partial = only; // added to in place at the end: one pass
    } else {
      // From zeros, as the collective's local sum starts.
      item.partial = at::zeros(model.sizes(), model.options().device(at::kCPU));
      for (const auto& copy : item.copies) {
        if (copy.grad().defined())
          item.partial.add_(copy.grad().to(at::kCPU));
      }
    }
    for (int process : item.holders) {
      if (process != me)
        peers.insert(process);
    }
    held.push_back(std::move(item));
  }
  auto shares = [](const Held& item, int process) {
    return std::binary_search(
        item.holders.begin(), item.holders.end(), process);
  };
  // Everything sent before anything is awaited: no two holders wait on
  // each other.
  for (int peer : peers) {
    for (int slot = 0; slot < static_cast<int>(dtypes.size()); ++slot) {
      std::vector<at::Tensor> flat;
      for (const Held& item : held) {
        if (shares(item, peer) && slotOf(item.partial) == slot)
          flat.push_back(item.partial.reshape({-1}));
      }
      if (!flat.empty())
        messages.send(peer, slot, at::cat(flat));
    }
  }
  // Per held group, per holder: its sum.
  std::vector<std::map<int, at::Tensor>> sums(held.size());
  for (size_t k = 0; k < held.size(); ++k)
    sums[k][me] = held[k].partial;
  for (int peer : peers) {
    for (int slot = 0; slot < static_cast<int>(dtypes.size()); ++slot) {
      int64_t size = 0;
      for (const Held& item : held) {
        if (shares(item, peer) && slotOf(item.partial) == slot)
          size += item.partial.numel();
      }
      if (size == 0)
        continue;
      const at::Tensor flat = messages.receive(
          peer, slot, at::empty({size}, at::TensorOptions(dtypes[slot])));
      int64_t offset = 0;
      for (size_t k = 0; k < held.size(); ++k) {
        const at::Tensor& partial = held[k].partial;
        if (!shares(held[k], peer) || slotOf(partial) != slot)
          continue;
        sums[k][peer] =
            flat.narrow(0, offset, partial.numel()).view(partial.sizes());
        offset += partial.numel();
      }
    }
  }
  for (size_t k = 0; k < held.size(); ++k) {
    if (sums[k].size() == 2 && replicas == 1 && held[k].copies.size() == 1 &&
        held[k].copies.front().grad().is_same(held[k].partial)) {
      // Two holders: a + b is b + a to the bit, so the other's sum is added
      // to this one's gradient in place.
      for (const auto& [process, sum] : sums[k]) {
        if (process != me)
          held[k].partial.add_(sum);
      }
      continue;
    }
    at::Tensor total = at::zeros_like(held[k].partial);
    for (const auto& [process, sum] : sums[k]) // ascending: std::map
      total.add_(sum);
    if (replicas > 1)
      total.div_(replicas);
    for (auto& copy : held[k].copies) {
      if (copy.grad().defined()) {
        copy.mutable_grad().copy_(total);
      } else {
        copy.mutable_grad() = total.to(copy.device());
      }
    }
  }
}

} // namespace runtime
} // namespace tpipe
