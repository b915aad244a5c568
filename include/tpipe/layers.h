// The layer list: the model as tpipe sees it, an ordered list of named
// LibTorch modules with their skip connections, and what can be said of it
// without running a pipeline. The floor under the runtime, the profiler and
// the model builders (docs/architecture.md).
//
//   torch::nn::Sequential net(torch::nn::Linear(32, 64), torch::nn::ReLU());
//   tpipe::LayerList layers = tpipe::layersOf(net);  // named "0", "1"
//   torch::Tensor y = tpipe::runSequential(layers, x);
//
// Random layers and recomputation: see tpipe/pipeline.h's header comment.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/container/sequential.h>

#include "tpipe/costs.h"

namespace tpipe {

// Whether a layer draws random numbers (see the header comment).
enum class Randomness {
  kAuto,  // dropout-like modules and unknown modules draw; known ones do not
  kNone,  // declared deterministic: its stage skips the generator swap
  kDraws, // declared random: its stage's numbers are replayed on recompute
  // Declared to draw only through stageDropout or stageGenerator() (below):
  // replayed on recompute like kDraws, from the stage's own generator, with
  // no lock, so stages draw side by side. A LibTorch dropout or any other
  // draw inside such a layer would not be replayed.
  kStageGenerator,
};

// Randomness for your own modules that a pipeline replays without the
// process-wide lock (tpipe/pipeline.h's header comment). While a pipeline
// runs a stage, stageGenerator() is that stage's own generator (pass it to
// torch::randn and kin); elsewhere it is unset. stageDropout is
// at::dropout's arithmetic (a Bernoulli(1 - p) mask scaled by 1 / (1 - p))
// drawn from it, and plain at::dropout where it is unset, with the same
// numbers. Declare the layer Randomness::kStageGenerator.
c10::optional<at::Generator> stageGenerator();
torch::Tensor stageDropout(const torch::Tensor& x, double p, bool training);

// How a layer takes back the skip tensor it pops (NamedLayer::pop).
enum class SkipMerge {
  kAdd,      // output = layer(x) + skip (a residual)
  kConcat,   // output = cat({layer(x), skip}, 1): channels (a U-Net)
  kArgument, // output = layer(x, skip): a module whose forward takes both
};

struct NamedLayer {
  std::string name; // parameter names are "<name>.<parameter>"
  torch::nn::AnyModule module;
  Randomness randomness = Randomness::kAuto;
  // Skip connections that may jump over stages (torchgpipe's stash and
  // pop). The layer's output, after its own merge, is also kept under each
  // name in `stash`; the later layer naming it in `pop` takes it back,
  // merged into that layer's output by `merge` (kArgument: passed to its
  // forward, exactly one pop). Each name is stashed once and popped once.
  // A stashed tensor travels with the activations over every stage
  // boundary it crosses, and its gradient back with theirs.
  std::vector<std::string> stash{};
  std::vector<std::string> pop{};
  SkipMerge merge = SkipMerge::kAdd;
};
using LayerList = std::vector<NamedLayer>;

// The plain sequential model: each layer in order, with its skips. A
// pipelined step is transparent against this. Throws c10::Error naming the
// layer when the skips are malformed (a name popped before it is stashed,
// stashed twice, never popped).
torch::Tensor runSequential(const LayerList& layers, const torch::Tensor& x);

// The children of a Sequential, named "0", "1", ... as PyTorch names them.
LayerList layersOf(const torch::nn::Sequential& sequential);

// Parameter elements per layer.
std::vector<int64_t> parameterCounts(const LayerList& layers);

// Why a schedule of several chains (dualpipe: each further chain runs a
// copy of every layer) cannot run `layers`, or "" when it can: a layer
// that keeps running statistics (the copies would update them apart), or
// one whose module cannot be copied (not a torch::nn::Cloneable). Copies
// each layer to find out.
std::string whyLayersCannotBeCopied(const LayerList& layers);

// Costs known without running anything: each layer's parameter bytes (what
// PartitionMethod::kParameters balances) and weightGradientInPlace, no
// times.
std::vector<LayerCost> parameterCosts(const LayerList& layers);

// Whether the runtime's direct weight gradients
// (PipelineOptions::directWeightGradients) add this layer's weight gradient
// into the parameter's in place: a LibTorch Linear that merges no skip.
// parameterCosts and the profiler record it (LayerCost::
// weightGradientInPlace); planning clears it under autocast (which keeps
// autograd's backward), and the memory model uses it where the option is on
// or a schedule splits its backward. The runtime asks the same.
bool addsWeightGradientInPlace(const NamedLayer& layer);

} // namespace tpipe
