// torch.save files, read with LibTorch's own unpickler: the tensors dataset
// and `tpipe predict`'s inputs. Private to src/data and src/train.
#pragma once

#include <string>

#include <ATen/core/ivalue.h>

#include "tpipe/model.h"

namespace tpipe {

// The value a torch.save file holds. An empty file, or one LibTorch cannot
// unpickle, is a ConfigError naming `flag` and the path.
c10::IValue readTorchSave(const std::string& flag, const std::string& path);

// "[2, 3]".
std::string shapeText(at::IntArrayRef shape);

// The tensor under `name` of a torch.save'd dict; ConfigError naming
// `where` when the key is missing or holds something else.
at::Tensor tensorOfDict(
    const c10::impl::GenericDict& dict,
    const char* name,
    const std::string& where);

// What a rank reads of a dataset: its first stage's inputs, its last
// stage's targets. What it does not need is checked for shape and dtype
// only (never read from disk) and held as a zero-sized stand-in of that
// shape. Only the tensors dataset, whose files are mapped, honours it.
struct DataNeeds {
  bool inputs = true, targets = true;
};

Dataset loadDataset(
    const Config& config,
    const BuiltModel& model,
    DataNeeds needs);

// `x` as the model takes it: samples shaped like model.input_shape, float32
// (any floating dtype converted), or int64 token ids in the embedding's
// range when the model starts with one. Errors name `where`. Not
// `needed`: checked for shape and dtype only, and a stand-in returned.
at::Tensor modelInputs(
    at::Tensor x,
    const std::string& where,
    const BuiltModel& model,
    bool needed = true);

} // namespace tpipe
