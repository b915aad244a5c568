// Moving activations and gradients between stages. The executor talks to a
// Transport only; LocalTransport hands tensors between worker threads of one
// process, and the c10d transport (c10d_transport.cpp, the only file that
// includes c10d) sends them to stages in other processes.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

namespace tpipe {
namespace runtime {

// Thrown inside a worker whose step was ended by another worker's error.
class StepAborted : public std::runtime_error {
 public:
  StepAborted() : std::runtime_error("step aborted by another stage") {}
};

enum class Direction { kActivation = 0, kGradient = 1 };

// What crosses a boundary for one micro-batch: the activation (or its
// gradient), then the skips travelling with it. On an accelerator, `ready`
// is recorded on the sender's copy stream: the receiver's stream waits for
// it before use.
struct Payload {
  std::vector<at::Tensor> tensors;
  std::shared_ptr<c10::Event> ready;
};

inline int64_t bytesOf(const std::vector<at::Tensor>& tensors) {
  int64_t bytes = 0;
  for (const auto& tensor : tensors)
    bytes += tensor.defined() ? static_cast<int64_t>(tensor.nbytes()) : 0;
  return bytes;
}

// What will cross each boundary in a step, when every transfer's shape is
// known ahead (fixed-shape models).
struct StepShapes {
  // Per boundary, per slot (the activation, then its skips), one sample's.
  std::vector<std::vector<std::vector<int64_t>>> perSample;
  std::vector<int64_t> microBatchSizes;
  at::ScalarType dtype = at::kFloat;
  // The receives of this process's ranks, in schedule order.
  struct Receive {
    Direction direction;
    int boundary, microBatch;
  };
  std::vector<Receive> receives;
  int receivesAhead = 0; // posted at once; 0: all
  std::vector<int64_t> shapeOf(int boundary, int slot, int microBatch) const {
    std::vector<int64_t> shape{microBatchSizes.at(microBatch)};
    const auto& rest = perSample.at(boundary).at(slot);
    shape.insert(shape.end(), rest.begin(), rest.end());
    return shape;
  }
};

// Boundary b lies between stages b and b + 1: activations cross it forward,
// gradients backward. A receive names the micro-batch it waits for.
class Transport {
 public:
  virtual ~Transport() = default;
  // A new step over `boundaries` boundaries; clears what an aborted step
  // left.
  virtual void begin(int boundaries) = 0;
  // Hands the tensor over without waiting for the receiver.
  virtual void send(
      Direction direction,
      int boundary,
      int microBatch,
      Payload payload) = 0;
  // Blocks until the tensor arrives; throws StepAborted after abort().
  virtual Payload receive(
      Direction direction,
      int boundary,
      int microBatch) = 0;
  // Wakes every waiting receive with StepAborted.
  virtual void abort() = 0;
  // Waits until every send of the step has left; throws on a failed send.
  virtual void end() {}
  // After begin(), with the step's shapes known: a transport may then send
  // data without a header and post this process's receives at once, so
  // they land while the workers compute.
  virtual void expect(const StepShapes& shapes) {}
  // How transfers leave this process, for the log ("over Gloo ...").
  virtual std::string describe() const {
    return "within this process";
  }
  // Across processes: a few values to process `process` of the world,
  // kept apart from the transfers, under `key` (>= 0, one message each):
  // what ranks tell each other to agree on a posted step.
  virtual bool carriesNotes() const {
    return false;
  }
  virtual void sendNote(
      int process,
      int64_t key,
      const std::vector<double>& values) {
    throw std::logic_error("this transport carries no notes");
  }
  // Blocks until process `process`'s note `key` of `count` values arrives.
  virtual std::vector<double> receiveNote(int process, int64_t key, int count) {
    throw std::logic_error("this transport carries no notes");
  }
  // The same for a flat host tensor of any dtype (tied gradients); the
  // receiver names what it expects by `like`'s dtype and size.
  virtual void sendNoteTensor(
      int process,
      int64_t key,
      const at::Tensor& flat) {
    throw std::logic_error("this transport carries no notes");
  }
  virtual at::Tensor receiveNoteTensor(
      int process,
      int64_t key,
      const at::Tensor& like) {
    throw std::logic_error("this transport carries no notes");
  }
};

// Tagged mailboxes, one per boundary and direction, each holding at most one
// tensor per micro-batch (so bounded by the micro-batch count).
class LocalTransport final : public Transport {
 public:
  void begin(int boundaries) override {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& slots : slots_)
      slots.assign(static_cast<size_t>(std::max(boundaries, 0)), {});
    aborted_ = false;
  }

  void send(Direction direction, int boundary, int microBatch, Payload payload)
      override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_)
        throw StepAborted();
      auto& slot = slots_[static_cast<int>(direction)].at(boundary);
      if (!slot.emplace(microBatch, std::move(payload)).second) {
        throw std::logic_error(
            "micro-batch " + std::to_string(microBatch) +
            " sent twice over boundary " + std::to_string(boundary));
      }
    }
    changed_.notify_all();
  }

  Payload receive(Direction direction, int boundary, int microBatch) override {
    std::unique_lock<std::mutex> lock(mutex_);
    auto& slot = slots_[static_cast<int>(direction)].at(boundary);
    changed_.wait(lock, [&] { return aborted_ || slot.count(microBatch) > 0; });
    if (aborted_)
      throw StepAborted();
    auto found = slot.find(microBatch);
    Payload payload = std::move(found->second);
    slot.erase(found);
    return payload;
  }

  void abort() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      aborted_ = true;
      for (auto& slots : slots_) {
        for (auto& slot : slots)
          slot.clear();
      }
    }
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::unordered_map<int, Payload>> slots_[2];
  bool aborted_ = false;
};

} // namespace runtime
} // namespace tpipe
