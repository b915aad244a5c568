// Pipeline schedules as data.
//
// A schedule is one ordered instruction list per rank (a worker that owns a
// device). Rank r hosts stages r, r + R, r + 2R, ... where R is the rank
// count; with one virtual stage per rank, rank and stage coincide. Generators
// are pure functions of (ranks, micro-batches, virtual stages, checkpoint
// mode); `validate` checks any schedule, generated or loaded from JSON, before
// the runtime executes it; `simulate` predicts its timeline from costs.
//
// Nothing here touches tensors or threads: this header is plain C++.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <stdexcept>
#include <string>
#include <variant>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tpipe/costs.h"
#include "tpipe/errors.h"

namespace tpipe {

// Which micro-batches keep only their stage input during the forward and
// recompute the rest right before their backward (GPipe / torchgpipe).
enum class CheckpointMode {
  kAlways,     // every micro-batch
  kExceptLast, // all but one micro-batch (torchgpipe's except_last): the
               // last, or in fill-drain orders (gpipe) the one whose
               // backward starts the drain
  kNever,      // keep every activation
};

CheckpointMode parseCheckpointMode(const std::string& name);
const char* checkpointModeName(CheckpointMode mode);
// True when `microBatch` is rematerialized, where `keptMicroBatch` is the
// one except_last keeps whole (the schedule's generator says which).
bool isCheckpointed(CheckpointMode mode, int microBatch, int keptMicroBatch);

// What the runtime does for each instruction, roughly:
//
// Forward          x = stage 0 ? input[mb] : received[mb]
//                  y = stage(x) (no-grad and keep only x when checkpointed)
//                  last stage: loss[mb] = lossFn(y, target[mb]) * |mb| /
//                  |batch|
//                  overlapsBackward: this forward and the rank's next
//                  compute instruction, a Backward (of another micro-batch,
//                  possibly of another stage), are one overlapped step
//                  (PyTorch's OVERLAP_F_B, DualPipe's paired F and B); the
//                  receives of both come before it, the sends of both after.
//                  On CPU the two run one after the other.
struct Forward {
  int stage;
  int microBatch;
  bool checkpointed;
  bool overlapsBackward = false;
};
// Recompute        restore the RNG state of Forward; y = stage(x) with grad
struct Recompute {
  int stage;
  int microBatch;
};
// Backward         dx, dW += d(y or loss)/d(x, W) given dy; free the stash
struct Backward {
  int stage;
  int microBatch;
};
// BackwardInput    dx = dy/dx given dy, graph retained (zero-bubble "B")
struct BackwardInput {
  int stage;
  int microBatch;
};
// BackwardWeight   dW += dy/dW given dy, then free the stash (zero-bubble "W")
struct BackwardWeight {
  int stage;
  int microBatch;
};
// SendActivation   channel(stage -> stage + 1).put(mb, y.detach())
struct SendActivation {
  int stage;
  int microBatch;
};
// RecvActivation   received[mb] = channel(stage - 1 -> stage).take(mb)
struct RecvActivation {
  int stage;
  int microBatch;
};
// SendGrad         channel(stage -> stage - 1).put(mb, dx)
struct SendGrad {
  int stage;
  int microBatch;
};
// RecvGrad         dy = channel(stage + 1 -> stage).take(mb)
struct RecvGrad {
  int stage;
  int microBatch;
};

using Instruction = std::variant<
    Forward,
    Recompute,
    Backward,
    BackwardInput,
    BackwardWeight,
    SendActivation,
    RecvActivation,
    SendGrad,
    RecvGrad>;

// JSON / display name of the instruction's kind, e.g. "forward".
const char* opName(const Instruction& instruction);
int stageOf(const Instruction& instruction);
int microBatchOf(const Instruction& instruction);
bool isCompute(const Instruction& instruction);
// Short label used in timelines and traces: "F3", "B3", "R3", "b3", "w3",
// "send act 3 -> stage 2", ...
std::string shortLabel(const Instruction& instruction);

struct Schedule {
  std::string name; // generator name, or "custom"
  // false: an inference schedule (forwards and activation transfers only).
  bool training = true;
  int ranks = 0;
  int virtualStages = 1;
  int microBatches = 0;
  std::vector<std::vector<Instruction>> perRank;
  // The rank of each stage; empty: stage s runs on rank s % ranks (one
  // stage per rank, or interleaved). ZB-V lays stages in a V instead.
  std::vector<int> placement;

  // Bidirectional schedules (DualPipe) run the model's stages twice over:
  // `chains` copies of them, each a chain of chainLength() stages. Micro-
  // batch mb enters chain mb % chains at its first stage and leaves it at
  // its last; stage s of chain c (stage c * chainLength() + s) holds a copy
  // of stage s's layers, whose gradients the runtime sums with the
  // original's. One chain (every other schedule): stage s passes to s + 1.
  int chains = 1;

  int stages() const {
    return ranks * virtualStages;
  }
  int chainLength() const {
    return stages() / chains;
  }
  int chainOf(int microBatch) const {
    return microBatch % chains;
  }
  // The stage of the model (a layer range of the partition) `stage` runs.
  int modelStage(int stage) const {
    return stage % chainLength();
  }
  bool runs(int stage, int microBatch) const {
    return stage / chainLength() == chainOf(microBatch);
  }
  int firstStageOf(int microBatch) const {
    return chainOf(microBatch) * chainLength();
  }
  int lastStageOf(int microBatch) const {
    return firstStageOf(microBatch) + chainLength() - 1;
  }
  // Whether `stage` receives activations from, and sends gradients to, the
  // stage before it; whether it sends activations to the stage after it.
  bool hasPrevious(int stage) const {
    return modelStage(stage) > 0;
  }
  bool hasNext(int stage) const {
    return modelStage(stage) + 1 < chainLength();
  }
  int rankOfStage(int stage) const {
    return placement.empty() ? stage % ranks : placement[stage];
  }
  // Some backward runs as an input pass and a weight pass.
  bool splitsBackward() const {
    for (const auto& list : perRank) {
      for (const auto& instruction : list) {
        if (std::holds_alternative<BackwardInput>(instruction))
          return true;
      }
    }
    return false;
  }
  // The stages rank `rank` runs, in increasing order.
  std::vector<int> stagesOfRank(int rank) const {
    std::vector<int> stages;
    for (int s = 0; s < this->stages(); ++s) {
      if (rankOfStage(s) == rank)
        stages.push_back(s);
    }
    return stages;
  }
};

enum class ScheduleKind {
  kGpipe,        // "gpipe": fill-drain
  kOneFOneB,     // "1f1b"
  kInterleaved,  // "interleaved-1f1b": virtual stages per rank
  kZeroBubbleH1, // "zb-h1": backward split into input and weight passes
  kZeroBubbleH2, // "zb-h2": more warm-up forwards, near-zero bubble
  kZeroBubbleV,  // "zb-v": two stages per rank in a V (rank r holds stages r
                 // and 2p - 1 - r): zero bubble at 1F1B's memory
  kAuto,         // "auto": the list scheduler; unit costs until `tpipe train`
                 // measures the stages (after its first recorded steps)
  kDualPipeV,    // "dualpipev": DeepSeek's DualPipeV, the V of zb-v with one
                 // micro-batch's forward overlapped with another's backward
  kZeroBubbleVHalf, // "zb-v-half": the V of zb-v holding about half of
                    // 1F1B's activations (V-Half's bound, Qi et al. 2024)
  kDualPipe,        // "dualpipe": DeepSeek's bidirectional DualPipe, two
                    // chains of the model's stages (parameters doubled),
                    // micro-batches entering from both ends
  kZeroBubbleVMin,  // "zb-v-min": the V of zb-v holding about a third of
                    // 1F1B's activations (V-Min's bound, Qi et al. 2024)
};
const char* scheduleKindName(ScheduleKind kind);
// Whether the kind lays two stages on each rank in a V (zb-v, dualpipev):
// such a schedule needs 2 virtual stages, and configs default to them.
bool isVShaped(ScheduleKind kind);

// Which schedule to run: a built-in generator or a schedule file (as
// `tpipe schedule --json` writes it). Text converts implicitly, so options
// read `schedule = "1f1b"` or `schedule = "mine.json"`: a name from
// scheduleNames() is that generator, text ending in .json (tpipe's format)
// or .csv (torch.distributed.pipelining's action CSV) a file; any other
// text is kept as an unknown name that makeSchedule rejects, listing the
// names.
class ScheduleSource {
 public:
  ScheduleSource(ScheduleKind kind = ScheduleKind::kGpipe)
      : kind_(kind), known_(true) {}
  ScheduleSource(const std::string& text);
  ScheduleSource(const char* text) : ScheduleSource(std::string(text)) {}
  static ScheduleSource file(const std::string& path);

  bool isFile() const {
    return !path_.empty();
  }
  bool isBuiltIn() const {
    return path_.empty() && known_;
  }
  ScheduleKind kind() const {
    return kind_;
  } // when isBuiltIn()
  const std::string& path() const {
    return path_;
  } // when isFile()
  // The name or the path, as written.
  std::string text() const;
  bool operator==(const ScheduleSource& other) const {
    return text() == other.text();
  }
  bool operator!=(const ScheduleSource& other) const {
    return !(*this == other);
  }

 private:
  ScheduleKind kind_ = ScheduleKind::kGpipe;
  bool known_ = false;
  std::string path_, unknown_;
};

struct ScheduleSpec {
  ScheduleSource source;
  int ranks = 1;
  int microBatches = 1;
  int virtualStages = 1;
  CheckpointMode checkpoint = CheckpointMode::kExceptLast;
  // For "auto" (the list scheduler): the stages' costs (one entry: every
  // stage alike; default unit costs) and the micro-batches in flight each
  // rank may hold (0: `ranks`, 1F1B's memory), or one limit per rank
  // (non-empty: instead of inFlightLimit; resolvePlan derives them from the
  // devices' memory).
  std::vector<StageCosts> costs{StageCosts{}};
  int inFlightLimit = 0;
  std::vector<int> inFlightLimits{};
  double weightPassMemory = 1.0; // see autoSchedule
};

// Names accepted by makeSchedule.
const std::vector<std::string>& scheduleNames();

// Generators. All throw ScheduleError for impossible requests.
Schedule gpipeSchedule(int ranks, int microBatches, CheckpointMode mode);
Schedule oneFOneBSchedule(int ranks, int microBatches, CheckpointMode mode);
Schedule interleavedSchedule(
    int ranks,
    int microBatches,
    int virtualStages,
    CheckpointMode mode);
Schedule zeroBubbleH1Schedule(int ranks, int microBatches, CheckpointMode mode);
// Up to 2p - 1 micro-batches in flight per stage; the list scheduler below
// with unit costs (F = B = W), which then leaves no bubble for m >= 2p.
Schedule zeroBubbleH2Schedule(int ranks, int microBatches, CheckpointMode mode);
// The zero-bubble list scheduler with measured per-stage costs (forward,
// backwardInput, backwardWeight, transfer) and a per-stage limit of
// micro-batches in flight (forwarded, weight pass not yet done). A
// micro-batch whose input pass is done counts `weightPassMemory` (what its
// weight pass still keeps, as a fraction of what its forward stashed: the
// Zero Bubble paper's M_W / M_B; 1 in tpipe's runtime, which keeps the
// graph). Returns 1F1B, ZB-H1 or ZB-H2 instead where that fits the limits
// and simulates faster, so it is never worse than them. Named "auto". The
// heuristic's steps are in src/scheduler/generators.cpp (GreedyZeroBubble).
Schedule autoSchedule(
    int ranks,
    int microBatches,
    CheckpointMode mode,
    const std::vector<StageCosts>& costs,
    const std::vector<int>& limit,
    double weightPassMemory = 1.0);
// torch.distributed.pipelining's compute-only action CSV: one row per rank,
// actions like "0F1" (stage 0 forward of micro-batch 1), with "I" and "W"
// for the split backward and "B" for the whole one. Transfers and recomputes
// are not written; reading derives them (recomputes from `mode`) and
// validates the result. Stage s must run on rank s % ranks.
std::string scheduleToCsv(const Schedule& schedule);
// The same with the transfers (PyTorch's lowered form): SEND_F, RECV_F,
// SEND_B and RECV_B cells in each rank's order; recomputes are not written.
// Reading such a file keeps its communication order (the validator checks
// it) and derives recomputes from the checkpoint mode.
std::string scheduleToCsvWithComms(const Schedule& schedule);
Schedule scheduleFromCsv(const std::string& text, CheckpointMode mode);
Schedule loadScheduleCsv(const std::string& path, CheckpointMode mode);

// 2p stages on p ranks in a V, from the list scheduler with unit costs and
// p micro-batches of each stage in flight.
Schedule zeroBubbleVSchedule(int ranks, int microBatches, CheckpointMode mode);
// The same V under about half of 1F1B's activation memory: at most p + 2
// half-stage micro-batches stashed on a rank at once (P / 2 + 1 whole ones,
// where 1F1B's first rank holds P), the V-Half bound of "Pipeline
// Parallelism with Controllable Memory" (Qi et al., 2024). Laid by tpipe's
// list scheduler under that bound, not by the paper's building blocks.
Schedule zeroBubbleVHalfSchedule(
    int ranks,
    int microBatches,
    CheckpointMode mode);
// The same V under about a third of 1F1B's activation memory, the paper's
// V-Min: at most ceil(2p / 3) + 2 half-stage micro-batches stashed on a
// rank (1F1B's first rank holds 2p halves). Laid by the list scheduler
// under that bound; it trades bubble for the memory.
int zeroBubbleVMinLimit(int ranks);
Schedule zeroBubbleVMinSchedule(
    int ranks,
    int microBatches,
    CheckpointMode mode);
// DeepSeek's DualPipeV on p ranks in a V (rank r holds stages r and
// 2p - 1 - r): eight phases per rank, the steady one pairing a forward of
// one stage with the full backward of the other (overlapsBackward), the
// rest split backwards whose weight passes fill the ends. Needs m >= 2p
// micro-batches (as many as stages). Equals torch.distributed.pipelining's
// ScheduleDualPipeV action for action.
Schedule dualPipeVSchedule(int ranks, int microBatches, CheckpointMode mode);
// DeepSeek's DualPipe on p ranks (p even): micro-batches enter from both
// ends, the even ones at rank 0, the odd ones at rank p - 1. Rank r holds
// stage r of the first chain and, as the second chain's stage p - 1 - r, a
// copy of the model's stage p - 1 - r (2 chains, 2 stages per rank, placed
// in a V). The order is DualPipeV's eight phases with each half of the
// ranks as one arm of the V. Needs an even m >= 2p.
Schedule dualPipeSchedule(int ranks, int microBatches, CheckpointMode mode);
// Inference: every rank forwards its stages' micro-batches in order, with
// the stages placed as `placement` says (empty: s % ranks).
Schedule forwardOnlySchedule(
    int ranks,
    int virtualStages,
    int microBatches,
    const std::vector<int>& placement = {});
// Dispatches on spec.source and validates the result. A schedule file must
// match the spec's ranks, virtual stages and micro-batches.
Schedule makeSchedule(const ScheduleSpec& spec);

class ScheduleError : public UserError {
 public:
  using UserError::UserError;
};

// Throws ScheduleError naming the first violated rule: every micro-batch
// forwarded and backwarded exactly once per stage (B and W once each when
// split), forward before backward, recompute exactly for checkpointed
// forwards, every send matched by its receive, and a unit-cost dry run that
// finishes (a stall lists the stuck instruction of every rank).
void validate(const Schedule& schedule);

// Transports that pair a boundary's sends with its receives by order alone
// (NCCL) need each boundary's transfers, per direction, received in the
// micro-batch order they are sent. Empty when they are (every built-in
// schedule); else the first boundary where they are not, with both orders.
std::string transferOrderMismatch(const Schedule& schedule);

// Per-stage costs in any time unit. Transfer is the time from the end of a
// send on one stage to the data being available on the neighbour.
struct TimedInstruction {
  int rank;
  int index; // position in schedule.perRank[rank]
  double start;
  double end;
};

struct Simulation {
  double makespan = 0.0;
  std::vector<double> busy;    // per rank: compute time incl. recompute
  std::vector<double> idle;    // per rank: makespan - busy
  double bubbleFraction = 0.0; // sum(idle) / (ranks * makespan)
  // The Zero Bubble paper's measure: each rank's idle time between its
  // first compute and its last, the worst rank's against one rank's work
  // plus that idle. Warm-up before a rank's first forward is not counted,
  // as the next step's work may fill it (see steadyStepTime).
  std::vector<double> span; // per rank: last compute end - first start
  double spanBubble = 0.0;
  // Per stage: peak count of micro-batches with anything stashed (input or
  // activations), and of those holding a full activation graph.
  std::vector<int> peakStashed;
  std::vector<int> peakLive;
  std::vector<TimedInstruction> timeline;
  bool finished = true; // false: a stall; `stuck` says where
  std::string stuck;
};

// Runs the schedule's instruction lists against the costs (one entry per
// stage, one per stage of a chain, or one entry for all). Receives wait for
// their send; sends never block. Never throws on a stall: see
// Simulation::finished.
Simulation simulate(
    const Schedule& schedule,
    const std::vector<StageCosts>& costs);

// Ranks that compute on shared CPU cores (more stage workers than cores):
// while the ranks computing at once ask for more cores than there are, the
// operating system shares them fairly and every one of them runs slower by
// demand / cores. All computing ranks slow alike, so the schedule unfolds
// in the same order, only stretched where it oversubscribes; a rank waiting
// for a transfer takes no core.
struct CoreSharing {
  double cores = 0.0;        // 0 or less: each rank computes on its own
  double coresPerRank = 1.0; // what one computing rank takes (its threads)
};
// The simulation's makespan stretched by that sharing: the integral over
// the step of max(1, computing ranks x coresPerRank / cores).
double sharedCoresMakespan(
    const Schedule& schedule,
    const Simulation& simulation,
    const CoreSharing& sharing);

// The time per step of back-to-back steps when no barrier separates them
// (optimizer post-validation): each rank starts its part of the next step
// as soon as its own part of this one is done. Simulates three steps in a
// row and returns the mean of the last two; compare with makespan, the
// step with a barrier. With `sharing`, each run's makespan is stretched as
// sharedCoresMakespan does. Throws ScheduleError when the schedule stalls.
double steadyStepTime(
    const Schedule& schedule,
    const std::vector<StageCosts>& costs,
    const CoreSharing& sharing = {});

// The textbook bubble (p - 1) / (m + p - 1) of fill-drain and 1F1B.
double theoreticalBubble(int stages, int microBatches);
// For a schedule: (p - 1) / (v m + p - 1) with p ranks and v virtual stages
// (Megatron's interleaved bubble; v = 1 is the line above). For DualPipe and
// DualPipeV, DeepSeek's idle (PP/2 - 1)(F&B + B - 3W) and (PP - 1)(F&B + B -
// 3W) over the step, with equal stages and F = I = W (a pair not
// overlapped): 2 (arm - 1) units against 3 per stage and micro-batch a rank
// runs.
double theoreticalBubble(const Schedule& schedule);
// The formula theoreticalBubble used, with what it assumes, for reports.
std::string theoreticalBubbleFormula(const Schedule& schedule);

// A floor under Simulation::spanBubble for any split-backward schedule with
// one stage per rank (1F1B-shaped, ZB-H1, ZB-H2, auto), whatever its memory
// limit. Rank r's span holds at least: the way down to the last stage,
// which then runs all m forwards and input passes before its last input
// pass, the way back up, and rank r's own weight pass for that micro-batch.
// Zero only when the weight passes fill the way down and up:
// m W >= (p - 1)(F + I + 2 T_comm) + W under equal stages. `costs`: one
// entry for all stages, or one per stage.
double spanBubbleLowerBound(
    int ranks,
    int microBatches,
    const std::vector<StageCosts>& costs);

void printInstructions(std::ostream& out, const Schedule& schedule);
void printSimulation(
    std::ostream& out,
    const Schedule& schedule,
    const Simulation& simulation,
    int width = 72);

nlohmann::json scheduleToJson(const Schedule& schedule);
Schedule scheduleFromJson(const nlohmann::json& json); // then validate()
// Reads, parses and validates a schedule file (as `tpipe schedule --json`
// writes it); throws ScheduleError naming the file.
Schedule loadScheduleFile(const std::string& path);
nlohmann::json simulationToJson(
    const Schedule& schedule,
    const Simulation& simulation);

} // namespace tpipe
