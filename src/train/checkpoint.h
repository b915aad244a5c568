// Checkpoints of a training run: what is written, how it is committed, and
// what is checked when it is read back.
//
// A checkpoint directory holds state-<step>/ (model.pt, optimizer.pt,
// generators.pt) and checkpoint.json naming the newest complete one with the
// size and checksum of each file. Every file is written through a checked
// write (each short write, the fsync and the close), then renamed into
// place and its directory fsync'ed; the rename of checkpoint.json is the
// commit point, and older states are removed only after it. A failed save
// throws with the reason and leaves the last committed checkpoint whole.
// DIR/model.pt is the newest weights too, for Python's torch.load.
//
// Across processes each pipeline rank of replica 0 writes its own stages
// under DIR/rank-<r>/ (checksums in state-<step>/checksums.json), and rank
// 0 commits checkpoint.json after a barrier.
//
// Weights are keyed by layer name (as nn.Sequential's state_dict) and the
// optimizer state by parameter position in the whole model, so a checkpoint
// resumes on another stage count, in one process or across any number:
// each process reads every writer's files and keeps its own stages'. The
// stages' random generators are then re-seeded, which the load reports.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include <torch/optim/optimizer.h>

#include <nlohmann/json.hpp>

#include "tpipe/config.h"
#include "tpipe/distributed.h"
#include "tpipe/pipeline.h"
#include "train/files.h"

namespace tpipe {

struct CheckpointIdentity {
  std::string run;       // runFingerprint(config)
  std::string optimizer; // "sgd", "adam", "adamw"
  // runDescription(config): compared key by key on resume, so a refusal
  // names the first key that differs.
  nlohmann::json description;
  // --resume-changed: a deliberate change (a new learning rate) resumes,
  // and the note says what changed.
  bool acceptChanges = false;
};

// What makes two runs the same run for checkpoints: the model, the data, the
// seed and the optimizer; not the pipeline layout or the step count.
std::string runFingerprint(const Config& config);
// The same as readable JSON, with the rest of what shapes the run's
// numbers (batch size, loss, optimizer settings, clipping, precision).
nlohmann::json runDescription(const Config& config);

// Before the first step: DIR can be created and written (a probe file is
// made and removed), is locked for this run when `lock` (the process that
// commits checkpoints), and holds no checkpoint that this run would
// overwrite (unless `overwrite`, or the run resumes from DIR itself).
std::unique_ptr<DirectoryLock> prepareSaveDirectory(
    const std::string& dir,
    const CheckpointIdentity& identity,
    bool overwrite,
    bool resumingFromIt,
    bool lock);

void saveCheckpoint(
    const std::string& dir,
    int64_t step,
    Pipeline& pipe,
    torch::optim::Optimizer& optimizer,
    const CheckpointIdentity& identity,
    Communicator* communicator);

// The step of DIR's last committed checkpoint (its checkpoint.json); none
// when DIR holds no checkpoint or the pointer names no step. Resuming
// checks the pointer fully (loadCheckpoint); this only says whether to.
std::optional<int64_t> committedStep(const std::string& dir);

struct Resumed {
  int64_t step = 0;
  std::string note; // e.g. generators re-seeded for another stage count
};

// Throws ConfigError naming the damaged, missing or mismatched file or key.
Resumed loadCheckpoint(
    const std::string& dir,
    Pipeline& pipe,
    torch::optim::Optimizer& optimizer,
    const CheckpointIdentity& identity,
    Communicator* communicator);

} // namespace tpipe
