// The tuner: which plan to run. It enumerates candidate plans (stage count,
// intra-op threads per stage, data-parallel width, micro-batches, schedule,
// checkpoint mode), asks the plan resolver for each one's time-optimal
// partition within the memory caps, predicts each step with the simulator
// under a calibrated cost model, and ranks them. Pure: no LibTorch, no
// threads. Measuring the cost model is the caller's job (`tpipe tune`
// profiles the job; `--cluster` derives it from FLOPs and bandwidths).
//
//   tpipe::CostModel model = ...;          // calibrated per job
//   tpipe::TuneRequest request;
//   request.batchSize = 256;
//   request.devices = {{"cpu:0"}, {"cpu:1"}};
//   request.cores = 2;
//   tpipe::TuneResult result = tpipe::tunePlans(model, request);
//   tpipe::printTuneTable(std::cout, result, 10);
//
// The prediction of one candidate: the simulated makespan of its schedule,
// where each stage's forward and backward are the sums of its layers' curves
// at the candidate's micro-batch size and threads, plus the runtime's cost
// per compute instruction, with the split backward of zero-bubble schedules
// scaled by the measured split overhead; plus the fixed cost per step
// (optimizer, loss, batch) and, with replicas, the gradient all-reduce after
// the flush (not overlapped). With overlapSteps, a plan of several ranks is
// predicted by its steady back-to-back step instead of the makespan.
// docs/tune.md states what this leaves out.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "tpipe/costs.h"
#include "tpipe/plan.h"
#include "tpipe/schedule.h"

namespace tpipe {

struct LayerModel {
  std::string name;
  // One curve per entry of CostModel::threads: ms against micro-batch size.
  std::vector<SizeCurve> forward, backward;
  int64_t paramBytes = 0;
  double activationBytesPerSample = 0.0; // the output, what crosses a link
  double stashBytesPerSample = 0.0;      // kept for the backward
  bool weightGradientInPlace = false;    // LayerCost's
};

struct Link {
  double latencyMs = 0.0;
  double bytesPerMs = 0.0; // 0: free
  double msFor(double bytes) const {
    return bytesPerMs > 0.0 ? latencyMs + bytes / bytesPerMs : latencyMs;
  }
};

struct CostModel {
  std::vector<LayerModel> layers;
  std::vector<int> threads{1}; // the intra-op thread counts the curves cover
  double inputBytesPerSample = 0.0;
  double instructionMs = 0.0; // runtime cost of one compute instruction
  // Per entry of threads, where calibrated apart (OpenMP teams of several
  // threads cost more per small operation); empty: instructionMs for all.
  std::vector<double> threadInstructionMs;
  double instructionMsAt(int threads) const;
  double stepMs = 0.0;        // per step: optimizer, loss, batch assembly
  double splitBackward = 1.0; // (input + weight pass) / fused backward
  // Per byte of activations a device holds at its peak beyond one
  // micro-batch per stage: schedules holding more micro-batches run slower
  // than their instruction counts say (the working set leaves the caches),
  // measured as GPipe against 1F1B.
  double heldByteMs = 0.0;
  // Stages of one process run at once on shared memory bandwidth: their
  // compute is this much slower than the layers measured alone.
  double concurrentSlowdown = 1.0;
  // Per forward and (input) backward, added where stage workers outnumber
  // the cores (TuneRequest::cores): a worker woken by a peer's activation or
  // gradient waits for a core, among workers evicting one another's caches.
  // The fair sharing of the cores themselves is the simulation's
  // (CoreSharing).
  double sharedWakeupMs = 0.0;
  double noise = 0.0; // relative; plans closer than it are equal
  std::string source; // "measured now", "cluster.json", ...

  // Per-layer costs at a micro-batch size and thread count (one of threads).
  std::vector<LayerCost> costsAt(double microBatchSize, int threads) const;
};

// How devices are connected: a replica's ranks are consecutive devices;
// devices [k * devicesPerNode, (k + 1) * devicesPerNode) share a node.
struct Topology {
  int devicesPerNode = 0; // 0: all on one node
  Link intraNode, interNode;
};

struct TuneRequest {
  int64_t batchSize = 1;
  // The devices a plan may use, in rank order (capacity, speed).
  std::vector<DeviceSpec> devices;
  // CPU cores the stage workers share (each takes `threads` of them);
  // 0: every device computes on its own (GPUs, a cluster).
  int cores = 0;
  Topology topology;
  // Empty: every stage count from 1 to min(devices, layers).
  std::vector<int> stageCounts;
  // Empty: every count that splits the batch (per replica) evenly, up to
  // 1024, and the powers of two up to 256.
  std::vector<int> microBatches;
  // Empty: every built-in schedule.
  std::vector<ScheduleKind> schedules;
  // Empty: never, except_last, always.
  std::vector<CheckpointMode> checkpoints;
  // Data parallel: false keeps one replica; true fills the devices with
  // devices / stages replicas (stage counts that divide the devices).
  bool replicate = false;
  double optimizerFactor = 0.0;
  // Steps overlap (pipeline.overlap_steps, in one process): a plan of
  // several ranks and one replica is predicted by its back-to-back step
  // (steadyStepTime), which staggered schedules (ZB-H2, ZB-V) shorten.
  bool overlapSteps = false;
  // PipelineOptions::directWeightGradients, for the memory model.
  bool directWeightGradients = true;
  SpeculativeUpdates speculativeUpdates = SpeculativeUpdates::kNone;
};

struct TuneCandidate {
  int stages = 1; // pipeline stages (virtual included)
  int ranks = 1;  // devices per replica
  int virtualStages = 1;
  int microBatches = 1;
  // `auto`: micro-batches each rank may hold in flight; 0: its ranks (1F1B's
  // memory). The search leaves it 0.
  int inFlightLimit = 0;
  int threadsPerStage = 1;
  int dataParallel = 1;
  ScheduleKind schedule = ScheduleKind::kGpipe;
  CheckpointMode checkpoint = CheckpointMode::kNever;
  std::vector<int> boundaries;
  double predictedStepMs = 0.0;
  double bubble = 0.0; // simulated idle share of the pipeline
  double allReduceMs = 0.0;
  std::vector<int64_t> peakBytes;  // per device of a replica
  int64_t peakActivationBytes = 0; // the most any device holds
  double samplesPerSecond = 0.0;
  std::string infeasible;       // why it cannot run; empty: it can
  double measuredStepMs = -1.0; // set by the caller; < 0: not measured
  std::string label() const;    // "2 x 1 thr, 8 mb, 1f1b, never"
  int devices() const {         // every replica's ranks
    return ranks * dataParallel;
  }
};

struct TuneResult {
  // Feasible ones first, fastest first; then the infeasible with reasons.
  std::vector<TuneCandidate> candidates;
  size_t choice = 0;
  std::vector<std::string> notes; // the choice's reasons, what was skipped
  // The CPU cores the plans share (TuneRequest::cores); 0: none shared.
  int cores = 0;
  std::string costSource;
  double searchMs = 0.0; // wall time of the search itself
  int feasible() const;
};

// Throws UserError when nothing can run, naming the reasons seen.
TuneResult tunePlans(const CostModel& model, const TuneRequest& request);

// One candidate's prediction: `shape` gives ranks, dataParallel,
// threadsPerStage, microBatches, schedule, checkpoint and inFlightLimit, and
// may pin virtualStages (interleaved schedules; else the search's) and
// boundaries (non-empty: this partition instead of the time-optimal one);
// the rest is filled in (infeasible set when it cannot run).
TuneCandidate predictCandidate(
    const CostModel& model,
    const TuneRequest& request,
    const TuneCandidate& shape);

// The plan request of a feasible candidate as it was predicted, which
// training resolves and runs: its boundaries (an explicit balance),
// schedule (`auto` built from the calibrated stage costs), micro-batches,
// checkpoint mode and threads per stage, over the model's costs at its
// micro-batch size. Throws UserError for a request tunePlans would refuse.
PlanRequest candidatePlanRequest(
    const CostModel& model,
    const TuneRequest& request,
    const TuneCandidate& candidate);

// How many rounds a neighbour's burst slowed, from the same roundSteps as
// chooseByMeasurement: rounds where the plans ran, by their median, more
// than 15% above their own lower quartiles together. Rounds of a quiet
// machine are within a few percent of each other; with a neighbour that
// spins in bursts, the tuner measures for longer, so that the rounds meet
// bursts in about the share a training run does.
int roundsSlowedByBursts(const std::vector<std::vector<double>>& roundSteps);

// Bursts slowed at least 4 rounds of 15: a neighbour, not a quiet machine's
// jitter (two or three of 15 rounds of tiny steps can look slowed). Or,
// where roundLoads holds the cores other processes wanted during each turn
// (as stepsAtTheLoadTrainingMeets), they wanted kNeighbourCores or more over
// the turns' time: a Fashion CNN tune of 8 plans, whose rounds of half a
// second a burst slows only in part, counted 3 slowed rounds of 15 beside a
// neighbour that wanted half a core, and chose one stage by calm figures
// (1.20x the best in training). However steady the load: turns of a second
// average bursts of 0.1-0.9 s out, and a reference tune whose every turn
// met 0.41-0.68 cores compared its plans as if calm, let one stage off
// 10%, and chose it 5.3% behind the best in training. A quiet machine's
// other processes wanted 0.02 cores.
constexpr double kNeighbourCores = 0.25;
bool aNeighbourShows(
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads = {});

// The cores other processes wanted during the turns of plans measured in
// turn (roundLoads[k][r]: during plan k's turn in round r): over the turns'
// time (each turn weighed by its step), their mean, standard deviation and
// range. Empty where some turn's load is unknown (negative) or the lists do
// not match roundSteps.
struct LoadSummary {
  double overTime = 0.0, mean = 0.0, spread = 0.0, least = 0.0, most = 0.0;
};
std::optional<LoadSummary> loadOver(
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads);

// Each plan's step at the load a neighbour puts on a training run, where
// roundLoads[k][r] holds the cores other processes wanted during plan k's
// turn in round r: the time their threads ran or waited to run, which no
// plan changes (the cores they got, read from the machine's busy time,
// depend on what the plan left them: 0.31 beside one stage, 0.43 beside
// dualpipe, and a plan taken at the pooled figure was misjudged by up to
// 16%). A neighbour that spins in bursts meets some plans' turns more than
// others' by chance (over 15 turns, 0.24 cores on one plan's and 0.38 on
// another's), which left a plan's mean uncertain by 5-11%; the load
// explained 80-97% of how its turns varied. Per plan, its steps a
// millisecond (not its ms a step) moved along their least-squares slope
// from its turns' mean load to the load over the time every plan's turns
// took (each turn weighed by its step: bursts lengthen the turns they
// meet), and turned back into ms a step. A neighbour that wants a core for
// a share of the time leaves a run the rate it gets in and out of bursts,
// mixed in that share, so the rate is what is linear in the load: a line
// through the ms a step over-read by 4-12% plans that a burst slows 1.5-2x
// at half a core, more for those slowed most. relativeError: the fit's
// standard error there, over the figure. Empty unless a neighbour shows
// (aNeighbourShows), every turn has a load and they spread by more than a tenth
// of a core.
struct StepsAtALoad {
  std::vector<double> stepMs;
  std::vector<double> relativeError;
  bool fittedToTheLoad = false;
};
StepsAtALoad stepsAtTheLoadTrainingMeets(
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads);

// Each plan's step beside a neighbour and how closely it is known: at the
// load training meets where that load varied enough to fit a line to
// (stepsAtTheLoadTrainingMeets, fittedToTheLoad set), else as training meets
// the bursts (stepsAsTrainingMeetsThem) known as closely as each plan's mean
// step (its relative standard error). Empty where no neighbour shows
// (aNeighbourShows).
StepsAtALoad stepsBesideANeighbour(
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads);

// Each plan's step as a training run meets it, from the same roundSteps:
// the median of the rounds no burst slowed, and the rounds a burst slowed
// at what they took, in their share of the rounds. Beside a neighbour
// (bursts in at least 4 rounds of 15), a plan's own rounds more than 15%
// above its lower quartile are its bursts, whether or not the round's
// other plans met them. A neighbour's bursts
// slow a share of a run's steps, and its throughput carries them (a plan
// trained at a median step of 9.8 ms and a mean of 13.7-16.5 beside one);
// a calm round's slow tail is the tuner's own, where plans take turns in
// one process (the mean of every round put the one-stage Fashion plan
// 13-17% above training, quiet and busy).
// Where a neighbour shows and roundLoads were measured, the steps at the
// load training meets (stepsAtTheLoadTrainingMeets).
std::vector<double> stepsAsTrainingMeetsThem(
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads = {});

// Predictions re-anchored to the plans measured in turn (measuredStepMs >=
// 0): a calibration run seconds earlier in a fresh process misjudges every
// plan of one shape alike, by up to a third, while plans measured
// side by side do not. A measured plan's prediction becomes its
// measurement; the others of a device count are scaled by the median
// measured / predicted of its measured plans, of a count with none by the
// median over every measured plan. The list is re-ranked, the choice
// kept. Returns what was scaled, for a note; empty when nothing was
// measured.
std::string anchorToMeasured(TuneResult& result);

// The plans to run in turn when the prediction cannot tell them apart:
// up to 4 within 25% of the fastest predicted, at most 2 of them on one
// device count and one of one-stage gpipe and 1F1B at a micro-batch count
// (they differ only in the activations held), the predicted choice, the
// fastest predicted on each device count within 4x the fastest (a
// calibration a busy second spoiled misjudges all plans of one shape
// alike, by up to 2x) with the next of its count predicted within 10% of
// it (a neighbour reorders near ties of one shape), and the simplest plan
// within twice the fastest, which the choice falls back to when nothing
// measures clearly faster: measured every time, so a run's noisy calibration
// cannot leave it out. Where none of those splits the backward (or none
// keeps it whole), the fastest that does within 1.5x of the fastest: the
// calibration times the split passes apart, and its noise moves the two
// kinds apart. Positions in result.candidates; empty when nothing is
// feasible.
std::vector<size_t> measurementContenders(const TuneResult& result);

// Beside a neighbour, after the first rounds of the contenders (positions
// `measured`, their figures as training meets the neighbour, e.g.
// stepsAsTrainingMeetsThem): those within kClearlyBehind of the fastest
// stay, and its simpler neighbours (below) within 25% of it, and the others
// make way for as many plans not yet measured: first
// the fastest plan's simpler neighbours (as many devices or one fewer, its
// micro-batch count or half, the backward split as it is) predicted within
// 25% of its prediction, and the simplest within 50% where it is simpler
// than each of those, the simplest first (where the fastest is one
// stage, which has none, those on several devices of the fastest plan
// measured on several devices); then the fastest
// first by their predictions, each scaled as its device count's measured
// plans were, within 25% of the fastest figure. The calm prediction chose
// the contenders, and a neighbour slows shapes unequally:
// one stage on two threads, which every operation makes wait for both
// cores, trained Fashion CNN 1.2x slower there than two one-thread stages,
// and one to three of six contenders were one-stage plans. Positions in
// result.candidates; the same plans where none is clearly behind or none
// can take a place. Where none is clearly behind, the slowest plan but the
// fastest and the simplest measured makes way all the same, for the
// fastest's simplest neighbour or, where it has none, the next plan
// waiting.
constexpr double kClearlyBehind = 1.10;
std::vector<size_t> contendersBesideANeighbour(
    const TuneResult& result,
    const std::vector<size_t>& measured,
    const std::vector<double>& figures);

// The choice among the plans measured in turn. roundSteps[k] holds plan
// measured[k]'s ms per step, a value a round (its turn's mean) in round
// order, as many as every other plan's. Each plan's measuredStepMs becomes its
// lower-quartile step, and the lowest is the fastest. Every other plan is held
// against the fastest round by round, by the median of its per-round ratios: a
// machine that slows for seconds at a time slows both steps of a round
// alike, and a burst on one step does not move a median. The simplest
// plan within the noise of the fastest is chosen: twice the spread of
// those ratios' median, at least 5%, and at least 10% where the fastest
// runs on more devices. Beside a neighbour (aNeighbourShows) the plans are
// held against each other as training meets them instead
// (stepsAsTrainingMeetsThem, at the neighbour's load where roundLoads has
// it), within the figures' combined standard error, at least 5%, and only
// a plan that holds less of the machine than the fastest (holdsLess) is let
// off its lead: holding as much, the fastest is chosen. A note says what was
// chosen and why.
// Throws std::invalid_argument unless there is one list per plan, all as
// long.
void chooseByMeasurement(
    TuneResult& result,
    const std::vector<size_t>& measured,
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads = {});

// Beside a neighbour, the choice is measured once more alone in turn with
// its closest rivals, since chooseByMeasurement's figures (`figures`, one
// per plan in `measured`, as training meets the neighbour) cannot settle
// it: the kRivalsInTheFinal fastest plans other than the choice, however
// far behind they read. Among four to eight plans whose rounds meet bursts
// of 0.1-0.9 s unequally, one stage read within 5% of the fastest in about
// one busy tune of five and trained 7-12% behind the best, and one plan
// read 11% ahead of the rest and trained 13% behind the best. With the
// runner-up alone, two busy reference tunes of five met the plan that
// trained fastest (two-device zb-v at 2 micro-batches, third in their
// turns) in neither; with two rivals every tune met it. A few plans alone
// take turns of a second or less, so they meet the bursts alike. Their
// positions in result.candidates, the fastest first; none where the choice
// was not measured or was the only plan measured. Then, where it is neither
// the choice nor one of them, the simplest plan within kFinalAdmission of
// the fastest that may be let off its lead (as settleByAFinal has it): the
// final names the simplest plan within kFinalMargin, and in turn, among more
// plans, a plan reads up to twice that further off. Where that plan is the
// choice, and the choice holds more of the machine than a rival, the simplest
// of the other plans near their fastest joins instead: the plan the final names
// if the choice loses.
constexpr size_t kRivalsInTheFinal = 2;
constexpr double kFinalAdmission = 0.10;
std::vector<size_t> rivalsOfTheChoice(
    const TuneResult& result,
    const std::vector<size_t>& measured,
    const std::vector<double>& figures);

// The choice and its rivals measured alone in turn (roundSteps[0] and
// roundLoads[0] the choice's, [k] rivals[k - 1]'s, as chooseByMeasurement's),
// each as stepsBesideANeighbour has it, and pooled with `inTurn`, the same
// plans' figures from the rounds in turn before the final (in the same
// order; ignored unless there is a figure and an error for each): each
// plan's log step fitted as its own plus its window's, every figure
// weighted by its inverse variance, so that the machine's drift from one
// window to the next cancels, and the pooled figures stand at both
// windows' level. The simplest plan within kFinalMargin of the fastest that
// holds no more of the machine than it (holdsLess, or on as many devices
// with as many threads each) is chosen: plans this close are alike as far
// as a busy tune can tell, and the simplest is the one plan every tune
// names. A pipeline that keeps the backward whole is let off nothing
// against a fastest that splits it: in turn it reads faster against such a
// plan than it trains. The finalists' measuredStepMs become these figures.
// Where the neighbour no longer shows in these rounds, the choice stands. A
// note says what was measured and what it decided. Throws std::invalid_argument
// unless the rivals are plans other than the choice and each other, and there
// is a list of steps for each finalist, all as long.
constexpr double kFinalMargin = 0.05;
void settleByAFinal(
    TuneResult& result,
    const std::vector<size_t>& rivals,
    const std::vector<std::vector<double>>& roundSteps,
    const std::vector<std::vector<double>>& roundLoads,
    const StepsAtALoad& inTurn = {});

// Whether the finalists' figures so far (each as stepsBesideANeighbour has
// it, in the order of `finalists`) settle what settleByAFinal decides: for
// each plan, its lag behind the fastest known within kFinalError, or more
// than twice its error away from every bound that decides, the fastest's
// figure and, for a simpler plan that holds no more of the machine,
// kFinalMargin. Settled where there is no figure. Until stop 83 only the
// order was settled: a busy Fashion final stopped after 12 rounds with
// ZB-H1 at 2 micro-batches 7.4% behind dualpipe at 4, known within 2.0%,
// and chose dualpipe, which trained 5.5% behind ZB-H1.
constexpr double kFinalError = 0.015;
// `cores`: the CPU cores the finalists share (TuneResult::cores).
bool aFinalIsSettled(
    const std::vector<TuneCandidate>& finalists,
    const StepsAtALoad& figures,
    int cores = 0);

// Whether plan `a` holds less of the machine than `b`: fewer devices, and
// fewer threads over them. On CPU devices that share a machine's cores, one
// stage on two threads holds both cores of a 2-core machine, as two
// one-thread stages do: beside a neighbour it was let off 4-5% for the
// device it saved, and chosen 4.6-5.3% behind the best in training. Where
// `a` runs its stages on several intra-op threads that span all `cores`
// the plans share (> 0), it holds the whole machine, however many stage
// threads `b` has: OpenMP's pool spins between operations, where a stage
// thread with nothing to do sleeps. Let off 4.1% against three one-thread
// stages, one stage on two threads trained 15.6% behind the best.
bool holdsLess(const TuneCandidate& a, const TuneCandidate& b, int cores = 0);

// The order in which plans that run equally fast are preferred: fewer
// devices, fewer stages a device (DualPipe's copies of the other chain's
// stages count), the plainer schedule (gpipe, 1f1b, ...),
// less recomputation, fewer micro-batches.
bool isSimplerPlan(const TuneCandidate& a, const TuneCandidate& b);

nlohmann::json tuneResultToJson(const TuneResult& result);
nlohmann::json tuneCandidateToJson(const TuneCandidate& candidate);
// The ranked table: top K feasible, a line per infeasible group, the choice.
void printTuneTable(std::ostream& out, const TuneResult& result, int top);

} // namespace tpipe
