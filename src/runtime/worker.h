// Device workers and the tensor exchange between stages. Threads, locks and
// queues of the runtime live here and nowhere else.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include <ATen/core/Tensor.h>

namespace tpipe {
namespace runtime {

// Thrown inside a worker whose step was ended by another worker's error.
class StepAborted : public std::runtime_error {
 public:
  StepAborted() : std::runtime_error("step aborted by another stage") {}
};

// Tagged mailboxes, one per stage boundary and direction. A receive names
// the micro-batch it waits for, so the order of sends never matters; each
// mailbox holds at most one tensor per micro-batch (bounded by the
// micro-batch count). abort() wakes every waiter with StepAborted.
class Exchange {
 public:
  enum class Direction { kActivation = 0, kGradient = 1 };

  void reset(int boundaries) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto& slots : slots_) {
      slots.assign(static_cast<size_t>(std::max(boundaries, 0)), {});
    }
    aborted_ = false;
  }

  void put(Direction direction, int boundary, int microBatch,
           at::Tensor tensor) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_) throw StepAborted();
      auto& slot = slots_[static_cast<int>(direction)].at(boundary);
      if (!slot.emplace(microBatch, std::move(tensor)).second) {
        throw std::logic_error("micro-batch " + std::to_string(microBatch) +
                               " sent twice over boundary " +
                               std::to_string(boundary));
      }
    }
    changed_.notify_all();
  }

  at::Tensor take(Direction direction, int boundary, int microBatch) {
    std::unique_lock<std::mutex> lock(mutex_);
    auto& slot = slots_[static_cast<int>(direction)].at(boundary);
    changed_.wait(lock, [&] { return aborted_ || slot.count(microBatch) > 0; });
    if (aborted_) throw StepAborted();
    auto found = slot.find(microBatch);
    at::Tensor tensor = std::move(found->second);
    slot.erase(found);
    return tensor;
  }

  void abort() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      aborted_ = true;
      for (auto& slots : slots_) {
        for (auto& slot : slots) slot.clear();
      }
    }
    changed_.notify_all();
  }

 private:
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<std::unordered_map<int, at::Tensor>> slots_[2];
  bool aborted_ = false;
};

// Counts finished jobs so the caller can wait for all of them.
class Latch {
 public:
  explicit Latch(int count) : count_(count) {}
  void countDown() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--count_ == 0) done_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [&] { return count_ == 0; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_;
  int count_;
};

// One thread per device, alive as long as the pipeline. Jobs run in the
// order posted; a job must not throw (the executor catches everything).
class DeviceWorker {
 public:
  explicit DeviceWorker(std::function<void()> onStart)
      : thread_([this, onStart = std::move(onStart)] {
          onStart();
          loop();
        }) {}

  ~DeviceWorker() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_one();
    thread_.join();
  }

  DeviceWorker(const DeviceWorker&) = delete;
  DeviceWorker& operator=(const DeviceWorker&) = delete;

  void post(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    wake_.notify_one();
  }

 private:
  void loop() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
        if (jobs_.empty()) return;
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<std::function<void()>> jobs_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace runtime
}  // namespace tpipe
