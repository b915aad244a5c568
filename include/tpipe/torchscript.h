// Models defined in Python: a scripted or traced module's top-level
// children, in order, are the layer list.
//
//   # Python
//   torch.jit.script(nn.Sequential(nn.Linear(6, 12), nn.Tanh(),
//   ...)).save("m.pt")
//   // C++
//   tpipe::Pipeline pipe(tpipe::loadTorchScript("m.pt"), options);
//
// Each layer keeps the scripted child's own tensors (training updates the
// loaded module), named as PyTorch names them ("0.weight", "2.attn.qkv.bias"),
// so Pipeline::namedParameters() and checkpoints match the Python model's
// state_dict. Scripted layers count as drawing random numbers (kAuto), so
// dropout inside them is replayed on recompute.
#pragma once

#include <string>

#include <torch/csrc/jit/api/module.h>

#include "tpipe/pipeline.h"

namespace tpipe {

LayerList layersOf(const torch::jit::Module& module);

// torch::jit::load with errors that name the file; throws UserError.
LayerList loadTorchScript(const std::string& path);

} // namespace tpipe
