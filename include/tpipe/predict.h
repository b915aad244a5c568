// Inference with a trained checkpoint (`tpipe predict`): the config's model
// and pipeline, the checkpoint's weights (by layer name, so on any stage
// count), inputs from a torch.save file, outputs to one.
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

#include "tpipe/config.h"

namespace tpipe {

struct PredictOptions {
  std::string resumeDir; // a checkpoint directory, as `train --save` writes
  // torch.save(X) or torch.save({"inputs": X, ...}): samples shaped like
  // model.input_shape (floating, or token ids for an embedding first).
  std::string inputPath;
  // The outputs in input order, as one tensor that Python's torch.load
  // reads; written by the process that holds the last stage (across
  // processes) and checked before anything runs.
  std::string outputPath;
  // The config's file, if it came from one: outputPath may not replace it
  // (nor the input, the checkpoint's files or the config's data files).
  std::string configPath;
  std::ostream* log = nullptr; // null: std::cout
};

struct PredictSummary {
  int64_t samples = 0;
  double seconds = 0.0; // the pipelined forwards alone
  bool wroteOutput = false;
};

// Micro-batched pipelined inference in eval mode (no-grad; batch norm uses
// its running statistics), in chunks of train.batch_size split as the
// config's micro-batches, in bf16 when the config trains in bf16. Bad
// inputs, a missing or foreign checkpoint and unwritable outputs throw
// ConfigError naming them.
PredictSummary predict(const Config& config, const PredictOptions& options);

} // namespace tpipe
