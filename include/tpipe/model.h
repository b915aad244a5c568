// A config's model and data as values: the layer list built from
// model.layers (with shape inference) or a TorchScript file, and the
// dataset of config.data. The floor below the training run (tpipe/trainer.h),
// implemented in src/model/ and src/data/.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "tpipe/config.h"
#include "tpipe/pipeline.h"

namespace tpipe {

struct BuiltModel {
  LayerList layers;
  // shapes[0] is the input (per sample); shapes[i + 1] is layer i's output.
  std::vector<std::vector<int64_t>> shapes;
  bool integerInput = false;   // token ids (embedding first)
  int64_t inputVocabulary = 0; // with token ids: the first layer's rows
  int64_t parameterCount = 0;  // a tied weight counted once
  // "tied_to" pairs as PipelineOptions::tiedParameters names them.
  std::vector<std::vector<std::string>> tiedParameters;
};

// Builds the layers, inferring each input size from model.input_shape.
// Throws ConfigError naming the first layer whose input does not fit:
// "model.layers[4] (linear): expects an input of rank >= 1 ...".
// Weights are initialized from `seed`.
BuiltModel buildModel(const ModelConfig& model, uint64_t seed);
// The same, checking the pipeline's stage count and balance against the
// built model (a TorchScript model's layers are counted once loaded).
BuiltModel buildModel(const Config& config);

// A layer that tracks statistics over the whole batch while normalizing per
// micro-batch (torchgpipe's deferred batch norm), named like PyTorch's
// BatchNorm2d in state dicts. Created by buildModel for "batchnorm2d".
void setBatchNormMicroBatches(const BuiltModel& model, int microBatches);

struct Dataset {
  at::Tensor trainInputs, trainTargets;
  at::Tensor evalInputs, evalTargets;
  std::string description;
};

// Loads config.data; throws ConfigError naming missing files and the Debian
// package that provides them, or a model whose output cannot fit the loss.
Dataset loadDataset(const Config& config, const BuiltModel& model);

// Checks that the model's output shape fits the loss and the data's targets.
void checkLossFits(const Config& config, const BuiltModel& model);

} // namespace tpipe
