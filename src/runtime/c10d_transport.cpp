// Point-to-point transfers over c10d (runtime/c10d_transport.h): Gloo
// through host memory, NCCL between GPUs. The communicator it rides on is
// communicator.cpp's.
#include "runtime/c10d_transport.h"

#ifndef TPIPE_NO_C10D
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <set>
#include <sstream>
#include <thread>

#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

#include "runtime/c10d_world.h"
#include "runtime/socket_channels.h"
#include "tpipe/errors.h"

namespace tpipe {
namespace runtime {
namespace {

constexpr int64_t kMessageMagic = 0x7470697065; // "tpipe"
constexpr int kHeaderSize = 14;
constexpr int kMessageMaxDims = kHeaderSize - 8;

// Gives up on a transfer after a failure. Not every backend can abort one
// (NCCL's work in some versions): it is then left to the run's end.
void abandon(const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->abort();
  } catch (const std::exception&) {
  }
}

struct PendingSend {
  c10::intrusive_ptr<c10d::Work> work;
  int peer;
};

// Waits for a process's sends on a thread of its own, in the order posted,
// and lets go of each (and of its tensor) once it has landed: the compute
// thread never blocks on a send, and a step holds only the tensors still
// in flight, not every activation and gradient it sent. (Gloo's send work
// says it is complete only once waited for, so polling cannot do this.)
class SendReaper {
 public:
  using Wait = std::function<void(const PendingSend&)>;
  explicit SendReaper(Wait wait)
      : wait_(std::move(wait)), thread_([this] { loop(); }) {}
  ~SendReaper() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      for (auto& send : queue_)
        abandon(send.work);
    }
    wake_.notify_all();
    thread_.join();
  }
  SendReaper(const SendReaper&) = delete;
  SendReaper& operator=(const SendReaper&) = delete;

  void add(PendingSend send) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(send));
    }
    wake_.notify_all();
  }

  // Blocks until every added send has landed; throws the first failure.
  void drain() {
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return queue_.empty(); });
    std::string error = std::move(error_);
    error_.clear();
    TORCH_CHECK(error.empty(), error);
  }

  // After a failed step: abandons what is still in flight.
  void discard() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& send : queue_)
        abandon(send.work);
    }
    std::unique_lock<std::mutex> lock(mutex_);
    wake_.wait(lock, [&] { return queue_.empty(); });
    error_.clear();
  }

 private:
  void loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty())
        return;
      const PendingSend send = queue_.front();
      lock.unlock();
      std::string failure;
      try {
        wait_(send);
      } catch (const c10::Error& e) {
        failure = e.what_without_backtrace();
      } catch (const std::exception& e) {
        failure = e.what();
      }
      lock.lock();
      if (error_.empty() && !failure.empty())
        error_ = std::move(failure);
      queue_.pop_front();
      wake_.notify_all();
    }
  }

  Wait wait_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<PendingSend> queue_;
  std::string error_; // first failure since the last drain
  bool stopping_ = false;
  std::thread thread_; // last: starts once the rest is built
};

} // namespace

class ProcessGroupTransport final : public Transport {
 public:
  ProcessGroupTransport(
      std::vector<int> placement,
      Communicator& communicator,
      int stages,
      int microBatches,
      int slots,
      c10::Device dataDevice)
      : placement_(std::move(placement)),
        communicator_(communicator),
        impl_(communicator.impl()),
        stages_(stages),
        microBatches_(microBatches),
        partsPerTransfer_(2 * std::max(slots, 1)),
        dataDevice_(dataDevice),
        sends_([this](const PendingSend& send) {
          impl_.wait(send.work, send.peer, "sending to it");
        }) {
    if (!dataDevice_.is_cpu())
      joinDeviceGroups();
    else if (socketChannelsWanted())
      sockets_ = impl_.sockets.get();
  }

  void begin(int boundaries) override {
    local_.begin(boundaries);
    if (sockets_) {
      try {
        sockets_->begin();
      } catch (const std::runtime_error& error) {
        TORCH_CHECK(false, error.what());
      }
    }
    sends_.discard();
    abortPosted(); // what a failed step left
    shapes_.reset();
  }

  // Known shapes: one message per transfer, and this process's receives
  // posted ahead of the executor, so data lands while the workers compute:
  // all of the step's at its start, or a window of them (each posted
  // receive holds its buffer).
  void expect(const StepShapes& shapes) override {
    shapes_ = shapes;
    std::lock_guard<std::mutex> lock(receiving_);
    toPost_.clear();
    nextPost_ = 0;
    for (const auto& r : shapes.receives) {
      const int peer = peerOf(r.direction, r.boundary, false);
      if (peer != communicator_.rank() && !bySocket(peer))
        toPost_.push_back(r);
    }
    fillPostWindow();
  }

  void send(Direction direction, int boundary, int microBatch, Payload payload)
      override {
    const int peer = peerOf(direction, boundary, true);
    if (peer == communicator_.rank())
      return local_.send(direction, boundary, microBatch, std::move(payload));
    if (bySocket(peer)) {
      try {
        return sockets_->send(
            peer, key(direction, boundary, microBatch), payload.tensors);
      } catch (const std::exception& error) {
        impl_.blame(
            peer,
            "sending the " + describe(direction, boundary, microBatch),
            error);
      }
    }
    // On the CPU for Gloo; on this process's GPU for NCCL, which starts
    // once the current stream reaches it: first, the sender's copies.
    const auto& tensors = payload.tensors;
    if (payload.ready && !dataDevice_.is_cpu()) {
      payload.ready->block(c10::impl::VirtualGuardImpl(dataDevice_.type())
                               .getStream(dataDevice_));
    }
    const int count = static_cast<int>(tensors.size());
    TORCH_CHECK(
        2 * count <= partsPerTransfer_,
        "cannot send ",
        count,
        " tensors in one transfer (at most ",
        partsPerTransfer_ / 2,
        ")");
    for (int slot = 0; slot < count; ++slot) {
      const at::Tensor& tensor = tensors[slot];
      if (shapes_) {
        sendData(direction, boundary, microBatch, slot, tensor, peer);
        continue;
      }
      TORCH_CHECK(
          tensor.dim() <= kMessageMaxDims,
          "cannot send a tensor of ",
          tensor.dim(),
          " dimensions (at most ",
          kMessageMaxDims,
          ")");
      at::Tensor header = at::empty({kHeaderSize}, at::kLong);
      int64_t* h = header.data_ptr<int64_t>();
      std::fill(h, h + kHeaderSize, 0);
      h[0] = kMessageMagic;
      h[1] = microBatch;
      h[2] = boundary;
      h[3] = static_cast<int64_t>(direction);
      h[4] = static_cast<int64_t>(tensor.scalar_type());
      h[5] = tensor.dim();
      h[6] = slot;
      h[7] = count;
      for (int64_t d = 0; d < tensor.dim(); ++d)
        h[8 + d] = tensor.size(d);
      postSend(
          header.to(dataDevice_),
          peer,
          direction,
          boundary,
          microBatch,
          2 * slot);
      postSend(
          tensor.contiguous(),
          peer,
          direction,
          boundary,
          microBatch,
          2 * slot + 1);
    }
  }

  Payload receive(Direction direction, int boundary, int microBatch) override {
    const int peer = peerOf(direction, boundary, false);
    if (peer == communicator_.rank())
      return local_.receive(direction, boundary, microBatch);
    if (bySocket(peer)) {
      try {
        return {
            sockets_->receive(peer, key(direction, boundary, microBatch)),
            nullptr};
      } catch (const StepAborted&) {
        throw;
      } catch (const std::exception& error) {
        impl_.blame(
            peer,
            "receiving the " + describe(direction, boundary, microBatch),
            error);
      }
    }
    if (postThrough(key(direction, boundary, microBatch)))
      return takePosted(direction, boundary, microBatch, peer);
    Payload payload;
    int count = 1;
    for (int slot = 0; slot < count; ++slot) {
      payload.tensors.push_back(
          receiveSlot(direction, boundary, microBatch, slot, peer, &count));
    }
    return payload;
  }

  void abort() override {
    local_.abort();
    if (sockets_)
      sockets_->abort();
    std::lock_guard<std::mutex> lock(receiving_);
    if (current_)
      abandon(current_);
    abortAllPosted();
  }

  std::string describe() const override {
    if (!dataDevice_.is_cpu())
      return "over NCCL from " + dataDevice_.str();
    std::string bySockets, byGloo;
    for (int peer : neighbours()) {
      std::string& list = bySocket(peer) ? bySockets : byGloo;
      list += (list.empty() ? "" : ", ") + std::to_string(peer);
    }
    std::string text;
    if (!bySockets.empty())
      text = "over Unix sockets to rank(s) " + bySockets + " (this host)";
    if (!byGloo.empty()) {
      text += (text.empty() ? "" : "; ") +
          std::string("over Gloo through host memory to rank(s) ") + byGloo;
    }
    return text.empty() ? "none (one rank)" : text;
  }

  bool carriesNotes() const override {
    return dataDevice_.is_cpu();
  }

  void sendNote(int peer, int64_t key, const std::vector<double>& values)
      override {
    at::Tensor note =
        at::empty({static_cast<int64_t>(values.size())}, at::kDouble);
    std::copy(values.begin(), values.end(), note.data_ptr<double>());
    sendNoteTensor(peer, key, note);
  }

  std::vector<double> receiveNote(int peer, int64_t key, int count) override {
    const at::Tensor note =
        receiveNoteTensor(peer, key, at::empty({count}, at::kDouble));
    const double* data = note.data_ptr<double>();
    return std::vector<double>(data, data + count);
  }

  void sendNoteTensor(int peer, int64_t key, const at::Tensor& flat) override {
    const std::string what = "sending a note on the posted step";
    if (bySocket(peer)) {
      try {
        return sockets_->send(peer, noteSocketKey(key), {flat});
      } catch (const std::exception& error) {
        impl_.blame(peer, what, error);
      }
    }
    std::vector<at::Tensor> tensors{flat};
    sends_.add(
        {impl_.withPeer(
             peer,
             what,
             [&] {
               return impl_.worldGroup->send(tensors, peer, noteTag(key));
             }),
         peer});
  }

  at::Tensor receiveNoteTensor(int peer, int64_t key, const at::Tensor& like)
      override {
    const std::string what = "receiving its note on the posted step";
    at::Tensor note;
    if (bySocket(peer)) {
      try {
        note = sockets_->receive(peer, noteSocketKey(key)).at(0);
      } catch (const StepAborted&) {
        throw;
      } catch (const std::exception& error) {
        impl_.blame(peer, what, error);
      }
    } else {
      std::vector<at::Tensor> tensors{at::empty(like.sizes(), like.options())};
      impl_.complete(peer, what, [&] {
        return impl_.worldGroup->recv(tensors, peer, noteTag(key));
      });
      note = tensors[0];
    }
    TORCH_CHECK(
        note.scalar_type() == like.scalar_type() &&
            note.numel() == like.numel(),
        "rank ",
        peer,
        " sent a note of ",
        note.numel(),
        " ",
        note.scalar_type(),
        " values where tpipe expected ",
        like.numel(),
        " ",
        like.scalar_type(),
        " (a different config or version on that rank?)");
    return note;
  }

  void end() override {
    sends_.drain();
    if (sockets_) {
      int peer = -1;
      try {
        sockets_->drain(&peer);
      } catch (const std::exception& error) {
        impl_.blame(peer, "sending to it", error);
      }
    }
  }

 private:
  // One transfer's receives, a message per tensor.
  struct Posted {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<at::Tensor> tensors;
    int peer;
  };

  static int64_t key(Direction direction, int boundary, int microBatch) {
    return (static_cast<int64_t>(boundary) * 2 + static_cast<int>(direction)) *
        (int64_t{1} << 32) +
        microBatch;
  }

  int peerOf(Direction direction, int boundary, bool sending) const {
    const bool towardsLater = (direction == Direction::kActivation) == sending;
    return towardsLater ? processOf(boundary + 1) : processOf(boundary);
  }

  std::string describe(Direction direction, int boundary, int microBatch)
      const {
    return std::string(
               direction == Direction::kActivation ? "activation"
                                                   : "gradient") +
        " of micro-batch " + std::to_string(microBatch) + " (tag " +
        std::to_string(tag(direction, boundary, microBatch, 1)) + ")";
  }

  // Slot `slot` of a transfer without known shapes: its header (whose
  // first says how many tensors follow), then its data.
  at::Tensor receiveSlot(
      Direction direction,
      int boundary,
      int microBatch,
      int slot,
      int peer,
      int* count) {
    const std::string receiving =
        "receiving the " + describe(direction, boundary, microBatch);
    auto receiveInto = [&](std::vector<at::Tensor>& tensors, int part) {
      waitReceive(
          impl_.withPeer(
              peer,
              receiving,
              [&] {
                return post(
                    false,
                    tensors,
                    direction,
                    boundary,
                    peer,
                    tag(direction, boundary, microBatch, part));
              }),
          peer,
          receiving);
    };
    std::vector<at::Tensor> header{
        at::empty({kHeaderSize}, onDevice(at::kLong))};
    receiveInto(header, 2 * slot);
    const at::Tensor hostHeader = header[0].to(at::kCPU);
    const int64_t* h = hostHeader.data_ptr<int64_t>();
    TORCH_CHECK(
        h[0] == kMessageMagic && h[1] == microBatch && h[2] == boundary &&
            h[3] == static_cast<int64_t>(direction) && h[5] >= 0 &&
            h[5] <= kMessageMaxDims && h[6] == slot && h[7] > slot &&
            2 * h[7] <= partsPerTransfer_ && (slot == 0 || h[7] == *count),
        "rank ",
        peer,
        " sent a message tpipe did not expect for the ",
        describe(direction, boundary, microBatch),
        " over boundary ",
        boundary,
        " (a different config or version on that rank?)");
    *count = static_cast<int>(h[7]);
    TORCH_CHECK(
        h[4] >= 0 && h[4] < static_cast<int64_t>(c10::ScalarType::NumOptions),
        "rank ",
        peer,
        " sent an unknown dtype code ",
        h[4]);
    const auto dtype = static_cast<c10::ScalarType>(h[4]);
    std::vector<int64_t> shape(h + 8, h + 8 + h[5]);
    std::vector<at::Tensor> data{at::empty(shape, onDevice(dtype))};
    receiveInto(data, 2 * slot + 1);
    return data[0];
  }

  // One message per tensor: the receiver knows the shape, and says what it
  // expects.
  void sendData(
      Direction direction,
      int boundary,
      int microBatch,
      int slot,
      const at::Tensor& tensor,
      int peer) {
    const auto& slots = shapes_->perSample.at(boundary);
    TORCH_CHECK(
        slot < static_cast<int>(slots.size()),
        "the ",
        describe(direction, boundary, microBatch),
        " has more tensors than the ",
        slots.size(),
        " shape inference promised");
    const std::vector<int64_t> shape =
        shapes_->shapeOf(boundary, slot, microBatch);
    TORCH_CHECK(
        tensor.sizes() == at::IntArrayRef(shape) &&
            tensor.scalar_type() == shapes_->dtype,
        "the ",
        describe(direction, boundary, microBatch),
        " has shape ",
        tensor.sizes(),
        " (",
        tensor.scalar_type(),
        "), but shape inference promised ",
        at::IntArrayRef(shape),
        " (",
        shapes_->dtype,
        ") to the rank receiving it");
    postSend(
        tensor.contiguous(),
        peer,
        direction,
        boundary,
        microBatch,
        2 * slot + 1);
  }

  // Part 0 is a header, part 1 the data; the send thread waits for it.
  void postSend(
      const at::Tensor& tensor,
      int peer,
      Direction direction,
      int boundary,
      int microBatch,
      int part) {
    std::vector<at::Tensor> tensors{tensor};
    sends_.add(
        {impl_.withPeer(
             peer,
             "sending the " + describe(direction, boundary, microBatch),
             [&] {
               return post(
                   true,
                   tensors,
                   direction,
                   boundary,
                   peer,
                   tag(direction, boundary, microBatch, part));
             }),
         peer});
  }

  // Whether the receive is posted, posting it first (with those before it)
  // when the executor reaches it before its turn in the window.
  bool postThrough(int64_t k) {
    std::lock_guard<std::mutex> lock(receiving_);
    while (!posted_.count(k) && nextPost_ < toPost_.size())
      postNext();
    return posted_.count(k) > 0;
  }

  // Posts receives in schedule order until the window is full; under
  // receiving_.
  void fillPostWindow() {
    const size_t window = shapes_->receivesAhead > 0
        ? static_cast<size_t>(shapes_->receivesAhead)
        : toPost_.size();
    while (nextPost_ < toPost_.size() && posted_.size() < window)
      postNext();
  }

  // Posts the next receive of toPost_, a message per tensor; under
  // receiving_.
  void postNext() {
    const StepShapes::Receive& r = toPost_[nextPost_++];
    Posted posted;
    posted.peer = peerOf(r.direction, r.boundary, false);
    const std::string what = describe(r.direction, r.boundary, r.microBatch);
    const int slots =
        static_cast<int>(shapes_->perSample.at(r.boundary).size());
    for (int slot = 0; slot < slots; ++slot) {
      std::vector<at::Tensor> buffer{at::empty(
          shapes_->shapeOf(r.boundary, slot, r.microBatch),
          onDevice(shapes_->dtype))};
      posted.works.push_back(
          impl_.withPeer(posted.peer, "receiving the " + what, [&] {
            return post(
                false,
                buffer,
                r.direction,
                r.boundary,
                posted.peer,
                tag(r.direction, r.boundary, r.microBatch, 2 * slot + 1));
          }));
      posted.tensors.push_back(buffer[0]);
    }
    posted_[key(r.direction, r.boundary, r.microBatch)] = std::move(posted);
  }

  Payload takePosted(
      Direction direction,
      int boundary,
      int microBatch,
      int peer) {
    Posted posted;
    {
      std::lock_guard<std::mutex> lock(receiving_);
      posted = posted_.at(key(direction, boundary, microBatch));
    }
    for (const auto& work : posted.works) {
      waitReceive(
          work,
          peer,
          "receiving the " + describe(direction, boundary, microBatch));
    }
    std::lock_guard<std::mutex> lock(receiving_);
    posted_.erase(key(direction, boundary, microBatch));
    fillPostWindow();
    return {std::move(posted.tensors), nullptr};
  }

  void abortPosted() {
    std::lock_guard<std::mutex> lock(receiving_);
    abortAllPosted();
    posted_.clear();
    toPost_.clear();
    nextPost_ = 0;
  }

  // Under receiving_.
  void abortAllPosted() {
    for (auto& [k, posted] : posted_) {
      for (auto& work : posted.works)
        abandon(work);
    }
  }

  at::TensorOptions onDevice(at::ScalarType dtype) const {
    return at::TensorOptions().dtype(dtype).device(dataDevice_);
  }

  // Posts one message to (sending) or from `peer` on the group that carries
  // a boundary's transfers in one direction: Gloo's world group, or the
  // NCCL group of that boundary's two processes (NCCL matches sends to
  // receives by order, not tag: one group per boundary and direction keeps
  // each in micro-batch order on both sides).
  c10::intrusive_ptr<c10d::Work> post(
      bool sending,
      std::vector<at::Tensor>& tensors,
      Direction direction,
      int boundary,
      int peer,
      int tag) {
    auto on = [&](const auto& group, int rank) {
      return sending ? group->send(tensors, rank, tag)
                     : group->recv(tensors, rank, tag);
    };
#ifdef TPIPE_USE_NCCL
    if (!dataDevice_.is_cpu()) {
      return on(
          deviceGroups_.at(groupKey(direction, boundary)),
          groupRank(boundary, peer));
    }
#endif
    return on(impl_.worldGroup, peer);
  }

  static int groupKey(Direction direction, int boundary) {
    return boundary * 2 + static_cast<int>(direction);
  }

  // In a boundary's group the earlier stage's process is 0, the later 1.
  int groupRank(int boundary, int process) const {
    return process == processOf(boundary) ? 0 : 1;
  }

  // A two-process NCCL group per remote boundary of this process and
  // direction (communicators are made at the first transfer).
  void joinDeviceGroups() {
#ifdef TPIPE_USE_NCCL
    const int me = communicator_.rank();
    for (int b = 0; b + 1 < stages_; ++b) {
      const int earlier = processOf(b), later = processOf(b + 1);
      if (earlier == later || (me != earlier && me != later))
        continue;
      for (Direction direction :
           {Direction::kActivation, Direction::kGradient}) {
        auto options = c10d::ProcessGroupNCCL::Options::create();
        options->timeout = impl_.timeout;
        const std::string prefix = "tpipe/nccl/replica" +
            std::to_string(communicator_.replica()) + "/boundary" +
            std::to_string(b) + "/" + std::to_string(groupKey(direction, b));
        auto group = c10::make_intrusive<c10d::ProcessGroupNCCL>(
            c10::make_intrusive<c10d::PrefixStore>(prefix, impl_.store),
            me == earlier ? 0 : 1,
            2,
            options);
        // NCCL makes a group's communicator at its first transfer, blocking
        // until both processes take part. Made lazily, a process posting
        // its receives could wait in one group while its peer waits in
        // another; made here, in one order on every process, they cannot.
        std::vector<at::Tensor> probe{at::zeros({1}, onDevice(at::kFloat))};
        const int peer = me == earlier ? later : earlier;
        impl_.complete(
            peer,
            "joining the NCCL group of boundary " + std::to_string(b),
            [&] {
              return me == earlier ? group->send(probe, 1, 0)
                                   : group->recv(probe, 0, 0);
            });
        deviceGroups_[groupKey(direction, b)] = std::move(group);
      }
    }
#else
    TORCH_CHECK(
        false,
        "tensors on ",
        dataDevice_,
        " need the NCCL transport, which this tpipe was built without");
#endif
  }

  // The processes this one exchanges transfers with, ascending.
  std::vector<int> neighbours() const {
    const int me = communicator_.rank();
    std::set<int> peers;
    for (int b = 0; b + 1 < stages_; ++b) {
      const int earlier = processOf(b), later = processOf(b + 1);
      if (earlier != later && (me == earlier || me == later))
        peers.insert(me == earlier ? later : earlier);
    }
    return {peers.begin(), peers.end()};
  }

  bool bySocket(int peer) const {
    return sockets_ && sockets_->reaches(peer);
  }

  int processOf(int stage) const {
    const int rank = placement_.empty() ? stage % communicator_.pipelineRanks()
                                        : placement_[stage];
    return communicator_.replica() * communicator_.pipelineRanks() + rank;
  }

  // Notes live apart from transfers: on sockets far below the keys of the
  // communicator's sums (-1, -2, ...), over Gloo above every transfer's tag.
  static int64_t noteSocketKey(int64_t key) {
    return -(int64_t{1} << 40) - key;
  }
  int noteTag(int64_t key) const {
    return tag(Direction::kActivation, stages_, 0, 0) +
        static_cast<int>(key % (int64_t{1} << 20));
  }

  int tag(Direction direction, int boundary, int microBatch, int part) const {
    return ((boundary * 2 + static_cast<int>(direction)) * microBatches_ +
            microBatch) *
        partsPerTransfer_ +
        part;
  }

  void waitReceive(
      c10::intrusive_ptr<c10d::Work> work,
      int peer,
      const std::string& what) {
    {
      std::lock_guard<std::mutex> lock(receiving_);
      current_ = work;
    }
    try {
      impl_.wait(work, peer, what); // NOLINT: rethrows naming the peer
    } catch (...) {
      std::lock_guard<std::mutex> lock(receiving_);
      current_.reset();
      throw;
    }
    std::lock_guard<std::mutex> lock(receiving_);
    current_.reset();
  }

  std::vector<int> placement_;
  Communicator& communicator_;
  Communicator::Impl& impl_;
  int stages_;
  int microBatches_;
  int partsPerTransfer_;   // a header and a data message per tensor
  c10::Device dataDevice_; // where transfers live: CPU (Gloo) or a GPU
#ifdef TPIPE_USE_NCCL
  std::map<int, c10::intrusive_ptr<c10d::ProcessGroupNCCL>> deviceGroups_;
#endif
  LocalTransport local_;
  // The communicator's channels to this host's ranks, for CPU transfers.
  SocketChannels* sockets_ = nullptr;
  std::mutex receiving_;
  c10::intrusive_ptr<c10d::Work> current_;
  c10::optional<StepShapes> shapes_;
  std::unordered_map<int64_t, Posted> posted_; // by key(), under receiving_
  std::vector<StepShapes::Receive> toPost_;    // in schedule order
  size_t nextPost_ = 0;                        // under receiving_
  SendReaper sends_; // last: its thread waits through impl_
};

std::unique_ptr<Transport> makeProcessGroupTransport(
    const std::vector<int>& placement,
    Communicator& communicator,
    int stages,
    int microBatches,
    int slots,
    c10::Device dataDevice) {
  return std::make_unique<ProcessGroupTransport>(
      placement, communicator, stages, microBatches, slots, dataDevice);
}

c10::Device transferDevice(
    const std::vector<c10::Device>& rankDevices,
    int rank,
    bool nccl) {
#ifdef TPIPE_USE_NCCL
  const c10::Device mine = rankDevices.at(rank);
  const bool shared =
      std::count(rankDevices.begin(), rankDevices.end(), mine) > 1;
  return nccl && mine.is_cuda() && !shared ? mine : c10::Device(c10::kCPU);
#else
  return c10::kCPU;
#endif
}

} // namespace runtime
} // namespace tpipe
#endif // TPIPE_NO_C10D
