// Random numbers for dropout, drawn from the running stage's own generator
// (stageDropout, stageGenerator: tpipe/layers.h). LibTorch's dropout draws from
// the process-wide generator, so a pipeline that replays each stage's masks
// must swap its stream in under one lock, and two stages with dropout then
// never run a forward at the same time. The registry's dropout (StageDropout in
// model/layers.cpp), and a layer that is LibTorch's plain Dropout (runLayer),
// draw instead from the generator the executor points this thread at while a
// stage runs; outside a stage (the sequential model, a plain loop) from the
// device's default generator, as at::dropout does, with the same numbers.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace torch {
namespace nn {
class Module;
} // namespace nn
} // namespace torch

namespace tpipe {

// This thread's stage generator; unset while no stage runs. What
// stageGenerator() (tpipe/layers.h) returns.
c10::optional<at::Generator>& stageGeneratorSlot();

// Whether a layer's module is LibTorch's plain Dropout (not in place):
// runLayer then runs it as stageDropout (tpipe/layers.h), so it draws its
// stage's stream as the registry's does. A Dropout inside another module is
// that module's to call, and draws from the default generator.
bool runsAsStageDropout(const torch::nn::Module& layerModule);

} // namespace tpipe
