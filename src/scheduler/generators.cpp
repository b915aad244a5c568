// Schedule generators: each decides only the order of compute on every rank;
// `lower` adds the transfers and recomputation every generator needs alike.
#include <algorithm>
#include <deque>
#include <functional>
#include <sstream>

#include "scheduler/compute_order.h"
#include "tpipe/schedule.h"

namespace tpipe {
namespace scheduling {

// Receives go right before the compute that needs them and sends right
// after the compute that produced them. A checkpointed micro-batch recomputes
// before it waits for its gradient, so the recompute overlaps that wait.
// The micro-batch that checkpoint mode except_last keeps whole: in a
// fill-drain order (every rank runs all its forwards before any backward)
// the one whose backward starts the drain, else the last (1F1B's last stage
// runs its backward right after its forward). Derived from the order, so a
// schedule read back from a CSV keeps the same one.
int keptMicroBatch(const ComputeOrder& order, int microBatches) {
  int firstBackward = -1;
  for (const auto& steps : order) {
    bool backwardSeen = false;
    for (const ComputeStep& step : steps) {
      if (step.pass == Pass::kForward && backwardSeen)
        return microBatches - 1;
      if (step.pass != Pass::kForward && !backwardSeen) {
        backwardSeen = true;
        if (firstBackward < 0)
          firstBackward = step.microBatch;
      }
    }
  }
  return firstBackward >= 0 ? firstBackward : microBatches - 1;
}

// The instruction of a backward step: whole, input pass or weight pass.
Instruction backwardInstruction(const ComputeStep& step) {
  switch (step.pass) {
    case Pass::kBackward:
      return Backward{step.stage, step.microBatch};
    case Pass::kBackwardInput:
      return BackwardInput{step.stage, step.microBatch};
    default:
      return BackwardWeight{step.stage, step.microBatch};
  }
}

Schedule lower(
    std::string name,
    int ranks,
    int virtualStages,
    int microBatches,
    CheckpointMode mode,
    const ComputeOrder& order,
    int chains) {
  const int kept = keptMicroBatch(order, microBatches);
  Schedule schedule;
  schedule.name = std::move(name);
  schedule.ranks = ranks;
  schedule.virtualStages = virtualStages;
  schedule.microBatches = microBatches;
  schedule.chains = chains;
  schedule.perRank.resize(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    auto& list = schedule.perRank[rank];
    const auto& steps = order[rank];
    list.reserve(3 * steps.size()); // a receive, the step, a send: most steps
    for (size_t k = 0; k < steps.size(); ++k) {
      const ComputeStep& step = steps[k];
      const int s = step.stage;
      const int mb = step.microBatch;
      const bool checkpointed = isCheckpointed(mode, mb, kept);
      if (step.overlapsNext) {
        // One overlapped step: both receives before it, both sends after.
        if (k + 1 >= steps.size() || steps[k + 1].pass != Pass::kBackward) {
          throw ScheduleError(
              "an overlapped forward must be followed by a whole backward");
        }
        const ComputeStep& back = steps[++k];
        if (schedule.hasPrevious(s))
          list.emplace_back(RecvActivation{s, mb});
        if (isCheckpointed(mode, back.microBatch, kept))
          list.emplace_back(Recompute{back.stage, back.microBatch});
        if (schedule.hasNext(back.stage))
          list.emplace_back(RecvGrad{back.stage, back.microBatch});
        list.emplace_back(Forward{s, mb, checkpointed, true});
        list.emplace_back(Backward{back.stage, back.microBatch});
        if (schedule.hasNext(s))
          list.emplace_back(SendActivation{s, mb});
        if (schedule.hasPrevious(back.stage))
          list.emplace_back(SendGrad{back.stage, back.microBatch});
        continue;
      }
      switch (step.pass) {
        case Pass::kForward:
          if (schedule.hasPrevious(s))
            list.emplace_back(RecvActivation{s, mb});
          list.emplace_back(Forward{s, mb, checkpointed});
          if (schedule.hasNext(s))
            list.emplace_back(SendActivation{s, mb});
          break;
        case Pass::kBackward:
        case Pass::kBackwardInput:
          if (checkpointed)
            list.emplace_back(Recompute{s, mb});
          if (schedule.hasNext(s))
            list.emplace_back(RecvGrad{s, mb});
          list.push_back(backwardInstruction(step));
          if (schedule.hasPrevious(s))
            list.emplace_back(SendGrad{s, mb});
          break;
        case Pass::kBackwardWeight:
          list.push_back(backwardInstruction(step));
          break;
      }
    }
  }
  return schedule;
}

void requireCounts(int ranks, int microBatches, int virtualStages) {
  if (ranks < 1) {
    throw ScheduleError(
        "schedule: stages per virtual stage (ranks) must be "
        ">= 1, got " +
        std::to_string(ranks));
  }
  if (microBatches < 1) {
    throw ScheduleError(
        "schedule: micro-batches must be >= 1, got " +
        std::to_string(microBatches));
  }
  if (virtualStages < 1) {
    throw ScheduleError(
        "schedule: virtual stages must be >= 1, got " +
        std::to_string(virtualStages));
  }
}

// 2p stages in a V: rank r holds stages r and 2p - 1 - r.
std::vector<int> vPlacement(int ranks) {
  std::vector<int> placement(2 * ranks);
  for (int s = 0; s < 2 * ranks; ++s)
    placement[s] = s < ranks ? s : 2 * ranks - 1 - s;
  return placement;
}

} // namespace scheduling

namespace {

using scheduling::ComputeOrder;
using scheduling::ComputeStep;
using scheduling::lower;
using scheduling::Pass;
using scheduling::requireCounts;
using scheduling::vPlacement;

// 1F1B's compute order for one rank: `warmup` forwards, then alternate one
// forward and one backward, then drain the remaining backwards.
std::vector<ComputeStep> oneFOneBOrder(
    int stage,
    int warmup,
    int microBatches,
    Pass backward) {
  std::vector<ComputeStep> steps;
  for (int mb = 0; mb < warmup; ++mb) {
    steps.push_back({Pass::kForward, stage, mb});
  }
  for (int k = 0; k < microBatches - warmup; ++k) {
    steps.push_back({Pass::kForward, stage, warmup + k});
    steps.push_back({backward, stage, k});
  }
  for (int mb = microBatches - warmup; mb < microBatches; ++mb) {
    steps.push_back({backward, stage, mb});
  }
  return steps;
}

} // namespace

CheckpointMode parseCheckpointMode(const std::string& name) {
  if (name == "always")
    return CheckpointMode::kAlways;
  if (name == "except_last")
    return CheckpointMode::kExceptLast;
  if (name == "never")
    return CheckpointMode::kNever;
  throw ScheduleError(
      "unknown checkpoint mode '" + name +
      "' (expected always, except_last or never)");
}

const char* checkpointModeName(CheckpointMode mode) {
  switch (mode) {
    case CheckpointMode::kAlways:
      return "always";
    case CheckpointMode::kExceptLast:
      return "except_last";
    case CheckpointMode::kNever:
      return "never";
  }
  return "?";
}

bool isCheckpointed(CheckpointMode mode, int microBatch, int keptMicroBatch) {
  switch (mode) {
    case CheckpointMode::kAlways:
      return true;
    case CheckpointMode::kExceptLast:
      return microBatch != keptMicroBatch;
    case CheckpointMode::kNever:
      return false;
  }
  return false;
}

const std::vector<std::string>& scheduleNames() {
  static const std::vector<std::string> names = {
      "gpipe",
      "1f1b",
      "interleaved-1f1b",
      "zb-h1",
      "zb-h2",
      "zb-v",
      "zb-v-half",
      "zb-v-min",
      "auto",
      "dualpipev",
      "dualpipe"};
  return names;
}

// Fill-drain: all forwards, then all backwards in micro-batch order. The
// order of the backwards is the order in which each parameter's gradient
// sums its micro-batches' parts, and float addition is not associative:
// running them as every other schedule (and a sequential micro-batched
// loop) does keeps gpipe's gradients bit-identical to theirs. Reversed, the
// last rounding bits differed, and ill-conditioned models (batch norm over
// a few samples) amplified that into visibly different training.
Schedule gpipeSchedule(int ranks, int microBatches, CheckpointMode mode) {
  requireCounts(ranks, microBatches, 1);
  ComputeOrder order(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    for (int mb = 0; mb < microBatches; ++mb) {
      order[rank].push_back({Pass::kForward, rank, mb});
    }
    for (int mb = 0; mb < microBatches; ++mb) {
      order[rank].push_back({Pass::kBackward, rank, mb});
    }
  }
  return lower("gpipe", ranks, 1, microBatches, mode, order);
}

// PipeDream-flush: stage s runs p - s - 1 warm-up forwards, so at most p - s
// micro-batches are stashed at once.
Schedule oneFOneBSchedule(int ranks, int microBatches, CheckpointMode mode) {
  requireCounts(ranks, microBatches, 1);
  ComputeOrder order(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    const int warmup = std::min(ranks - rank - 1, microBatches);
    order[rank] = oneFOneBOrder(rank, warmup, microBatches, Pass::kBackward);
  }
  return lower("1f1b", ranks, 1, microBatches, mode, order);
}

// Megatron-LM's interleaved 1F1B: rank r holds model chunks (stages)
// r, r + p, ..., and walks them in groups of p micro-batches, so the
// pipeline fills v times faster. Needs m to be a multiple of p.
Schedule interleavedSchedule(
    int ranks,
    int microBatches,
    int virtualStages,
    CheckpointMode mode) {
  requireCounts(ranks, microBatches, virtualStages);
  if (virtualStages == 1) {
    Schedule schedule = oneFOneBSchedule(ranks, microBatches, mode);
    schedule.name = "interleaved-1f1b";
    return schedule;
  }
  if (microBatches % ranks != 0) {
    throw ScheduleError(
        "interleaved-1f1b needs micro-batches to be a multiple of the "
        "pipeline ranks: " +
        std::to_string(microBatches) + " % " + std::to_string(ranks) + " != 0");
  }
  const int total = microBatches * virtualStages;
  auto microBatchOfStep = [&](int k) {
    return (k / (ranks * virtualStages)) * ranks + k % ranks;
  };
  ComputeOrder order(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    auto forward = [&](int k) {
      const int chunk = (k / ranks) % virtualStages;
      return ComputeStep{
          Pass::kForward, chunk * ranks + rank, microBatchOfStep(k)};
    };
    auto backward = [&](int k) {
      const int chunk = virtualStages - 1 - (k / ranks) % virtualStages;
      return ComputeStep{
          Pass::kBackward, chunk * ranks + rank, microBatchOfStep(k)};
    };
    const int warmup = microBatches == ranks
        ? total
        : std::min(total, (ranks - rank - 1) * 2 + (virtualStages - 1) * ranks);
    auto& steps = order[rank];
    for (int k = 0; k < warmup; ++k)
      steps.push_back(forward(k));
    for (int k = 0; k < total - warmup; ++k) {
      steps.push_back(forward(warmup + k));
      steps.push_back(backward(k));
    }
    for (int k = total - warmup; k < total; ++k)
      steps.push_back(backward(k));
  }
  return lower(
      "interleaved-1f1b", ranks, virtualStages, microBatches, mode, order);
}

// Zero-bubble ZB-H1 (Qi et al. 2023): 1F1B with the backward split into B
// (input gradient, on the critical path) and W (weight gradient). Stage s
// holds back its first s W passes and runs them in the drain, where 1F1B
// idles; every stage then stashes at most p micro-batches, 1F1B's peak.
Schedule zeroBubbleH1Schedule(
    int ranks,
    int microBatches,
    CheckpointMode mode) {
  requireCounts(ranks, microBatches, 1);
  ComputeOrder order(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    const int warmup = std::min(ranks - rank - 1, microBatches);
    auto& steps = order[rank];
    int nextWeight = 0;
    int inputsDone = 0;
    for (const ComputeStep& step :
         oneFOneBOrder(rank, warmup, microBatches, Pass::kBackwardInput)) {
      steps.push_back(step);
      if (step.pass != Pass::kBackwardInput)
        continue;
      ++inputsDone;
      const bool steady = step.microBatch < microBatches - warmup;
      if (!steady || inputsDone > rank) {
        steps.push_back({Pass::kBackwardWeight, rank, nextWeight++});
      }
    }
    while (nextWeight < microBatches) {
      steps.push_back({Pass::kBackwardWeight, rank, nextWeight++});
    }
  }
  return lower("zb-h1", ranks, 1, microBatches, mode, order);
}

Schedule forwardOnlySchedule(
    int ranks,
    int virtualStages,
    int microBatches,
    const std::vector<int>& placement) {
  requireCounts(ranks, microBatches, virtualStages);
  Schedule placed;
  placed.ranks = ranks;
  placed.virtualStages = virtualStages;
  placed.placement = placement;
  ComputeOrder order(ranks);
  for (int rank = 0; rank < ranks; ++rank) {
    for (int stage : placed.stagesOfRank(rank)) {
      for (int mb = 0; mb < microBatches; ++mb) {
        order[rank].push_back({Pass::kForward, stage, mb});
      }
    }
  }
  Schedule schedule = lower(
      "forward-only",
      ranks,
      virtualStages,
      microBatches,
      CheckpointMode::kNever,
      order);
  schedule.training = false;
  schedule.placement = placement;
  return schedule;
}

// DeepSeek's DualPipe order for one rank, shared by DualPipeV (the ranks
// as one arm of a V) and DualPipe (each half of the ranks as one arm):
// `halfRanks` ranks per arm, this rank `halfRank` steps from the arm's start,
// `chunkMicroBatches` through each of its two chunks. Chunk 0 is the stage
// that goes out along the arm, chunk 1 the one coming back; `stageOf` and
// `microBatchOf` name them in the schedule. Eight phases; I is an input
// pass whose weight pass waits in a queue for a W.
void appendDualPipeOrder(
    std::vector<ComputeStep>& steps,
    int halfRanks,
    int halfRank,
    int chunkMicroBatches,
    const std::function<int(int chunk)>& stageOf,
    const std::function<int(int chunk, int index)>& microBatchOf) {
  const int h = halfRank, H = halfRanks, n = chunkMicroBatches;
  int next[2] = {0, 0}, nextBackward[2] = {0, 0};
  std::deque<std::pair<int, int>> weights; // (stage, micro-batch)
  auto forward = [&](int chunk, bool overlapped = false) {
    steps.push_back(
        {Pass::kForward,
         stageOf(chunk),
         microBatchOf(chunk, next[chunk]++),
         overlapped});
  };
  auto backward = [&](int chunk, bool split) {
    const int stage = stageOf(chunk);
    const int mb = microBatchOf(chunk, nextBackward[chunk]++);
    steps.push_back(
        {split ? Pass::kBackwardInput : Pass::kBackward, stage, mb});
    if (split)
      weights.emplace_back(stage, mb);
  };
  auto weight = [&] {
    steps.push_back(
        {Pass::kBackwardWeight, weights.front().first, weights.front().second});
    weights.pop_front();
  };
  // Forward of `chunkF` overlapped with the whole backward of the other.
  auto pair = [&](int chunkF) {
    forward(chunkF, true);
    backward(1 - chunkF, false);
  };
  // 1: warm-up forwards of chunk 0.
  for (int i = 0; i < (H - h - 1) * 2; ++i)
    forward(0);
  // 2: forwards of both chunks.
  for (int i = 0; i < h + 1; ++i) {
    forward(0);
    forward(1);
  }
  // 3: chunk 1's split backward, its weight pass at once, a forward.
  for (int i = 0; i < H - h - 1; ++i) {
    backward(1, true);
    weight();
    forward(1);
  }
  // 4: the steady state, overlapped pairs (the arm's last rank starts with a
  // forward and a backward apart).
  for (int i = 0; i < n - 2 * H + h + 1; ++i) {
    if (i == 0 && h == H - 1) {
      forward(0);
      backward(1, false);
    } else {
      pair(0);
    }
    pair(1);
  }
  // 5: chunk 1's backwards, each with a pair.
  for (int i = 0; i < H - h - 1; ++i) {
    backward(1, false);
    pair(1);
  }
  // 6: backwards of both chunks; from the middle on, split.
  bool split = false;
  for (int i = 0; i < h + 1; ++i) {
    if (i == (h + 1) / 2 && h % 2 == 1)
      split = true;
    backward(1, split);
    if (i == (h + 1) / 2 && h % 2 == 0)
      split = true;
    backward(0, split);
  }
  // 7: a queued weight pass, then chunk 0's split backward.
  for (int i = 0; i < H - h - 1; ++i) {
    weight();
    backward(0, true);
  }
  // 8: the remaining weight passes.
  while (!weights.empty())
    weight();
}

// DeepSeek's DualPipeV (as torch.distributed.pipelining's
// ScheduleDualPipeV builds it): rank r holds stage r (chunk 0, going down)
// and stage 2p - 1 - r (chunk 1, coming back), one arm of p ranks.
Schedule dualPipeVSchedule(int ranks, int microBatches, CheckpointMode mode) {
  requireCounts(ranks, microBatches, 2);
  const int p = ranks, m = microBatches;
  if (m < 2 * p) {
    throw ScheduleError(
        "schedule 'dualpipev' needs at least as many micro-batches as stages (" +
        std::to_string(2 * p) + " for " + std::to_string(p) + " ranks), got " +
        std::to_string(m));
  }
  ComputeOrder order(p);
  for (int r = 0; r < p; ++r) {
    appendDualPipeOrder(
        order[r],
        p,
        r,
        m,
        [&](int chunk) { return chunk == 0 ? r : 2 * p - 1 - r; },
        [](int, int index) { return index; });
  }
  Schedule schedule = lower("dualpipev", p, 2, m, mode, order);
  schedule.placement = vPlacement(p);
  return schedule;
}

// DualPipe: the first chain runs stages 0 .. p - 1 on ranks 0 .. p - 1, the
// second (stages p .. 2p - 1) on ranks p - 1 .. 0, which is zb-v's V
// placement. Each half of the ranks is one arm: a rank's chunk 0 is the
// chain that enters on its side (the first chain on ranks 0 .. p/2 - 1),
// chunk 1 the other; chain c's k-th micro-batch is micro-batch 2k + c.
Schedule dualPipeSchedule(int ranks, int microBatches, CheckpointMode mode) {
  requireCounts(ranks, microBatches, 2);
  const int p = ranks, m = microBatches;
  if (p % 2 != 0) {
    throw ScheduleError(
        "schedule 'dualpipe' needs an even number of ranks (its two halves "
        "mirror each other), got " +
        std::to_string(p));
  }
  if (m < 2 * p || m % 2 != 0) {
    throw ScheduleError(
        "schedule 'dualpipe' needs an even number of micro-batches, at least "
        "as many as its stages (2 chains x " +
        std::to_string(p) + " = " + std::to_string(2 * p) + "), got " +
        std::to_string(m));
  }
  ComputeOrder order(p);
  for (int r = 0; r < p; ++r) {
    const int secondHalf = r >= p / 2 ? 1 : 0;
    auto chainOf = [secondHalf](int chunk) { return chunk ^ secondHalf; };
    appendDualPipeOrder(
        order[r],
        p / 2,
        std::min(r, p - 1 - r),
        m / 2,
        [&](int chunk) { return chainOf(chunk) == 0 ? r : 2 * p - 1 - r; },
        [&](int chunk, int index) { return 2 * index + chainOf(chunk); });
  }
  Schedule schedule = lower("dualpipe", p, 2, m, mode, order, 2);
  schedule.placement = vPlacement(p);
  return schedule;
}

bool isVShaped(ScheduleKind kind) {
  return kind == ScheduleKind::kZeroBubbleV ||
      kind == ScheduleKind::kZeroBubbleVHalf ||
      kind == ScheduleKind::kZeroBubbleVMin || kind == ScheduleKind::kDualPipeV;
}

const char* scheduleKindName(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::kGpipe:
      return "gpipe";
    case ScheduleKind::kOneFOneB:
      return "1f1b";
    case ScheduleKind::kInterleaved:
      return "interleaved-1f1b";
    case ScheduleKind::kZeroBubbleH1:
      return "zb-h1";
    case ScheduleKind::kZeroBubbleH2:
      return "zb-h2";
    case ScheduleKind::kZeroBubbleV:
      return "zb-v";
    case ScheduleKind::kAuto:
      return "auto";
    case ScheduleKind::kDualPipeV:
      return "dualpipev";
    case ScheduleKind::kZeroBubbleVHalf:
      return "zb-v-half";
    case ScheduleKind::kZeroBubbleVMin:
      return "zb-v-min";
    case ScheduleKind::kDualPipe:
      return "dualpipe";
  }
  return "?";
}

ScheduleSource::ScheduleSource(const std::string& text) {
  for (auto kind :
       {ScheduleKind::kGpipe,
        ScheduleKind::kOneFOneB,
        ScheduleKind::kInterleaved,
        ScheduleKind::kZeroBubbleH1,
        ScheduleKind::kZeroBubbleH2,
        ScheduleKind::kZeroBubbleV,
        ScheduleKind::kAuto,
        ScheduleKind::kDualPipeV,
        ScheduleKind::kZeroBubbleVHalf,
        ScheduleKind::kZeroBubbleVMin,
        ScheduleKind::kDualPipe}) {
    if (text == scheduleKindName(kind)) {
      kind_ = kind;
      known_ = true;
      return;
    }
  }
  auto endsWith = [&](const char* suffix) {
    const size_t n = std::char_traits<char>::length(suffix);
    return text.size() > n && text.compare(text.size() - n, n, suffix) == 0;
  };
  if (endsWith(".json") || endsWith(".csv")) {
    path_ = text;
    return;
  }
  unknown_ = text;
}

ScheduleSource ScheduleSource::file(const std::string& path) {
  ScheduleSource source;
  source.known_ = false;
  source.path_ = path;
  return source;
}

std::string ScheduleSource::text() const {
  if (isFile())
    return path_;
  return known_ ? scheduleKindName(kind_) : unknown_;
}

namespace {

Schedule loadMatching(const ScheduleSpec& spec) {
  const std::string& file = spec.source.path();
  Schedule loaded =
      file.size() > 4 && file.compare(file.size() - 4, 4, ".csv") == 0
      ? loadScheduleCsv(file, spec.checkpoint)
      : loadScheduleFile(file);
  // A bidirectional schedule's chains each run the plan's stages.
  if (loaded.ranks != spec.ranks ||
      loaded.virtualStages != spec.virtualStages * loaded.chains) {
    throw ScheduleError(
        "schedule " + file + " is for " + std::to_string(loaded.ranks) +
        " rank(s) x " + std::to_string(loaded.virtualStages) +
        " virtual stage(s); the pipeline has " + std::to_string(spec.ranks) +
        " x " + std::to_string(spec.virtualStages));
  }
  if (loaded.microBatches != spec.microBatches) {
    throw ScheduleError(
        "schedule " + file + " has " + std::to_string(loaded.microBatches) +
        " micro-batches; the pipeline has " +
        std::to_string(spec.microBatches));
  }
  if (!loaded.training)
    throw ScheduleError("schedule " + file + " is an inference schedule");
  return loaded;
}

// Every rank lists every micro-batch of each of its stages: bounded so a
// typo cannot ask for gigabytes of instructions.
void checkSize(const ScheduleSpec& spec) {
  const int64_t size =
      int64_t{spec.ranks} * spec.virtualStages * spec.microBatches;
  if (spec.ranks < 1 || spec.microBatches < 1 || spec.virtualStages < 1 ||
      size > (int64_t{1} << 22)) {
    throw ScheduleError(
        "a schedule of " + std::to_string(spec.ranks) + " rank(s) x " +
        std::to_string(spec.virtualStages) + " virtual stage(s) x " +
        std::to_string(spec.microBatches) +
        " micro-batches is out of range (each at least 1, "
        "their product at most 4194304)");
  }
}

} // namespace

Schedule makeSchedule(const ScheduleSpec& spec) {
  if (spec.source.isFile())
    return loadMatching(spec);
  if (!spec.source.isBuiltIn()) {
    std::ostringstream message;
    message << "unknown schedule '" << spec.source.text()
            << "' (expected one of:";
    for (const auto& name : scheduleNames())
      message << ' ' << name;
    message << ", or a schedule file *.json)";
    throw ScheduleError(message.str());
  }
  checkSize(spec);
  const ScheduleKind kind = spec.source.kind();
  if (isVShaped(kind) && spec.virtualStages != 2) {
    throw ScheduleError(
        "schedule '" + spec.source.text() +
        "' lays two stages on each rank: it needs 2 virtual "
        "stages, got " +
        std::to_string(spec.virtualStages));
  }
  if (kind != ScheduleKind::kInterleaved && !isVShaped(kind) &&
      spec.virtualStages != 1) {
    throw ScheduleError(
        "schedule '" + spec.source.text() +
        "' has one stage per rank; virtual stages (" +
        std::to_string(spec.virtualStages) +
        ") need 'interleaved-1f1b', 'zb-v' or 'dualpipev'");
  }
  Schedule schedule;
  switch (kind) {
    case ScheduleKind::kGpipe:
      schedule = gpipeSchedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kOneFOneB:
      schedule =
          oneFOneBSchedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kInterleaved:
      schedule = interleavedSchedule(
          spec.ranks, spec.microBatches, spec.virtualStages, spec.checkpoint);
      break;
    case ScheduleKind::kZeroBubbleH1:
      schedule =
          zeroBubbleH1Schedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kZeroBubbleH2:
      schedule =
          zeroBubbleH2Schedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kZeroBubbleV:
      schedule =
          zeroBubbleVSchedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kDualPipeV:
      schedule =
          dualPipeVSchedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kZeroBubbleVHalf:
      schedule = zeroBubbleVHalfSchedule(
          spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kZeroBubbleVMin:
      schedule = zeroBubbleVMinSchedule(
          spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kDualPipe:
      schedule =
          dualPipeSchedule(spec.ranks, spec.microBatches, spec.checkpoint);
      break;
    case ScheduleKind::kAuto:
      schedule = autoSchedule(
          spec.ranks,
          spec.microBatches,
          spec.checkpoint,
          spec.costs,
          !spec.inFlightLimits.empty()
              ? spec.inFlightLimits
              : std::vector<int>(
                    spec.ranks,
                    spec.inFlightLimit > 0 ? spec.inFlightLimit : spec.ranks),
          spec.weightPassMemory);
      break;
  }
  validate(schedule);
  return schedule;
}

} // namespace tpipe
