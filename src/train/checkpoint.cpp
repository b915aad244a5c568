// Checkpoint writing and reading (see checkpoint.h).
#include "train/checkpoint.h"

#include "json_input.h"
#include "train/parts.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <type_traits>

#include <nlohmann/json.hpp>
#include <torch/serialize.h>

namespace tpipe {
namespace {

namespace fs = std::filesystem;

// FNV-1a, 64 bits: catches flipped or truncated bytes (not an adversary).
std::string checksum(const std::string& bytes) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (unsigned char c : bytes) {
    hash ^= c;
    hash *= 0x100000001b3ULL;
  }
  char text[17];
  std::snprintf(
      text, sizeof text, "%016llx", static_cast<unsigned long long>(hash));
  return text;
}

std::string readFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    throw ConfigError("--resume: cannot read " + path.string());
  std::ostringstream bytes;
  bytes << in.rdbuf();
  return bytes.str();
}

nlohmann::json readJson(const fs::path& path) {
  try {
    return parseJsonText(readFile(path), path.string());
  } catch (const ConfigError& error) {
    throw ConfigError(std::string("--resume: ") + error.what());
  }
}

// The tensors a checkpoint holds: every parameter and buffer, named as
// nn.Sequential's state_dict; across processes only this rank's stages
// (under dualpipe a stage's copy, by its original's names, where the rank
// runs the copy). In one process the copies follow the originals
// (Pipeline::refreshChainCopies).
std::vector<std::pair<std::string, torch::Tensor>> checkpointTensors(
    const Pipeline& pipe,
    Communicator* communicator) {
  std::vector<std::pair<std::string, torch::Tensor>> tensors;
  const Schedule& schedule = pipe.schedule();
  const int stages = communicator ? schedule.stages() : schedule.chainLength();
  for (int s = 0; s < stages; ++s) {
    if (communicator && schedule.rankOfStage(s) != communicator->stageRank())
      continue;
    for (const auto& layer : pipe.stageLayers(s)) {
      for (const auto& item : layer.module.ptr()->named_parameters()) {
        tensors.emplace_back(layer.name + "." + item.key(), item.value());
      }
      for (const auto& item : layer.module.ptr()->named_buffers()) {
        tensors.emplace_back(layer.name + "." + item.key(), item.value());
      }
    }
  }
  return tensors;
}

// A tied copy is written as its group's first tensor when the file holds
// that one: one storage in the file, under every name, as a tied
// nn.Module's state_dict has it.
std::vector<std::pair<std::string, torch::Tensor>> withTiesShared(
    std::vector<std::pair<std::string, torch::Tensor>> tensors,
    const Pipeline& pipe) {
  for (const auto& group : pipe.options().tiedParameters) {
    auto first = std::find_if(tensors.begin(), tensors.end(), [&](auto& t) {
      return t.first == group.front();
    });
    if (first == tensors.end())
      continue;
    for (auto& item : tensors) {
      if (std::find(group.begin() + 1, group.end(), item.first) != group.end())
        item.second = first->second;
    }
  }
  return tensors;
}

// The three files of a state, serialized in memory first.
std::map<std::string, std::string> stateFiles(
    Pipeline& pipe,
    torch::optim::Optimizer& optimizer,
    Communicator* communicator) {
  c10::Dict<std::string, torch::Tensor> weights;
  for (const auto& item :
       withTiesShared(checkpointTensors(pipe, communicator), pipe)) {
    weights.insert(
        item.first, item.second.detach().to(torch::kCPU).contiguous());
  }
  std::map<std::string, std::string> files;
  const std::vector<char> model = torch::pickle_save(weights);
  files["model.pt"] = std::string(model.begin(), model.end());
  std::ostringstream optimizerBytes;
  torch::save(optimizer, optimizerBytes);
  files["optimizer.pt"] = optimizerBytes.str();
  c10::List<torch::Tensor> generators;
  for (const auto& state : pipe.generatorStates())
    generators.push_back(state);
  const std::vector<char> generatorBytes = torch::pickle_save(generators);
  files["generators.pt"] =
      std::string(generatorBytes.begin(), generatorBytes.end());
  return files;
}

nlohmann::json writeState(
    const fs::path& dir,
    const std::string& name,
    const std::map<std::string, std::string>& files) {
  const fs::path staging = dir / (name + ".tmp");
  fs::remove_all(staging);
  fs::create_directories(staging);
  nlohmann::json sums = nlohmann::json::object();
  for (const auto& [file, bytes] : files) {
    writeChecked(staging / file, bytes);
    sums[file] = {{"bytes", bytes.size()}, {"fnv1a64", checksum(bytes)}};
  }
  writeChecked(staging / "checksums.json", sums.dump() + "\n");
  syncDirectory(staging);
  const fs::path state = dir / name;
  fs::remove_all(
      state); // an uncommitted leftover: the committed state has another step
  std::error_code error;
  fs::rename(staging, state, error);
  if (error)
    writeFailed(state, error.value());
  syncDirectory(dir);
  return sums;
}

void removeOtherStates(const fs::path& dir, const std::string& keep) {
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string file = entry.path().filename().string();
    if (file.rfind("state-", 0) == 0 && file != keep)
      fs::remove_all(entry.path());
  }
}

void verify(const fs::path& state, const nlohmann::json& sums) {
  if (!sums.is_object())
    throw ConfigError("--resume: " + state.string() + " lists no checksums");
  for (const char* file : {"model.pt", "optimizer.pt", "generators.pt"}) {
    const fs::path path = state / file;
    if (!sums.contains(file))
      throw ConfigError("--resume: no checksum recorded for " + path.string());
    const std::string bytes = readFile(path);
    const auto& expected = sums[file];
    if (bytes.size() != expected.value("bytes", size_t{0}) ||
        checksum(bytes) != expected.value("fnv1a64", "")) {
      throw ConfigError(
          "--resume: " + path.string() +
          " is damaged (its size or checksum differs from the " +
          "one recorded when it was saved)");
    }
  }
}

} // namespace

std::string runFingerprint(const Config& config) {
  const nlohmann::json description = describeConfig(config);
  const nlohmann::json identity = {
      {"model", description["model"]},
      {"data", description["data"]},
      {"seed", config.train.seed},
      {"optimizer", config.train.optimizer.type}};
  return checksum(identity.dump());
}

nlohmann::json runDescription(const Config& config) {
  const nlohmann::json description = describeConfig(config);
  nlohmann::json train = description["train"];
  // What may change between a run's pieces without changing its numbers.
  for (const char* key : {"steps", "eval_every", "checkpoint_every"})
    train.erase(key);
  return {
      {"model", description["model"]},
      {"data", description["data"]},
      {"train", train}};
}

std::unique_ptr<DirectoryLock> prepareSaveDirectory(
    const std::string& dir,
    const CheckpointIdentity& identity,
    bool overwrite,
    bool resumingFromIt,
    bool lock) {
  std::error_code error;
  fs::create_directories(dir, error);
  if (error)
    throw ConfigError(
        "--save " + dir + ": cannot create it (" + error.message() + ")");
  const fs::path probe =
      fs::path(dir) / (".tpipe-probe-" + std::to_string(::getpid()));
  const int fd =
      ::open(probe.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  const bool written = fd >= 0 && ::write(fd, "x", 1) == 1;
  const int reason = errno;
  if (fd >= 0)
    ::close(fd);
  fs::remove(probe, error);
  if (!written)
    throw ConfigError(
        "--save " + dir + ": cannot write there (" + std::strerror(reason) +
        ")");
  // Locked before anything is read: of two runs started together on one
  // directory, the second is refused here.
  auto held = lock ? std::make_unique<DirectoryLock>(
                         dir, DirectoryLock::Mode::kWrite, "--save")
                   : nullptr;
  const fs::path pointer = fs::path(dir) / "checkpoint.json";
  if (resumingFromIt || overwrite || !fs::exists(pointer))
    return held;
  std::string run = "?";
  int64_t step = -1;
  try {
    const nlohmann::json json = readJson(pointer);
    run = json.value("run", "?");
    step = json.value("step", int64_t{-1});
  } catch (const std::exception&) {
  }
  const std::string whose =
      run == identity.run ? "this run (started afresh)" : "a different run";
  throw ConfigError(
      "--save " + dir + ": holds a checkpoint at step " + std::to_string(step) +
      " of " + whose + "; resume it with --resume " + dir +
      ", save elsewhere, or pass --overwrite to replace it");
}

void saveCheckpoint(
    const std::string& root,
    int64_t step,
    Pipeline& pipe,
    torch::optim::Optimizer& optimizer,
    const CheckpointIdentity& identity,
    Communicator* communicator) try {
  // A failed write is told apart from others: the last commit stands.
  const bool distributed = communicator != nullptr;
  const fs::path dir = distributed
      ? fs::path(root) / ("rank-" + std::to_string(communicator->stageRank()))
      : fs::path(root);
  const bool writer = !distributed || communicator->replica() == 0;
  const std::string name = "state-" + std::to_string(step);
  if (writer) {
    fs::create_directories(dir);
    writeState(dir, name, stateFiles(pipe, optimizer, communicator));
  }
  if (distributed)
    communicator->barrier(); // every rank's state is written
  if (!distributed || communicator->rank() == 0) {
    nlohmann::json pointer = {
        {"step", step},
        {"state", name},
        {"run", identity.run},
        {"identity", identity.description},
        {"optimizer", identity.optimizer},
        {"stages", pipe.schedule().stages()}};
    if (distributed)
      pointer["pipeline_ranks"] = communicator->pipelineRanks();
    if (!distributed)
      pointer["files"] = readJson(dir / name / "checksums.json");
    writeFileAtomically(
        fs::path(root) / "checkpoint.json", pointer.dump() + "\n");
  }
  if (distributed)
    communicator->barrier(); // committed
  if (!writer)
    return;
  // The newest weights for Python, then the older states: after the commit.
  const fs::path link = dir / "model.pt.tmp";
  fs::remove(link);
  fs::create_hard_link(dir / name / "model.pt", link);
  fs::rename(link, dir / "model.pt");
  removeOtherStates(dir, name);
} catch (const WriteFailure& failure) {
  throw std::runtime_error(
      std::string("checkpoint: ") + failure.what() +
      " (the previous checkpoint is intact)");
}

namespace {

// checkpoint.json against this run: its optimizer, step and state.
void checkPointer(
    const nlohmann::json& json,
    const fs::path& pointer,
    const CheckpointIdentity& identity) {
  if (json.contains("pipeline_ranks") &&
      (!json["pipeline_ranks"].is_number_integer() ||
       json["pipeline_ranks"].get<int>() < 1)) {
    throw ConfigError(
        "--resume: " + pointer.string() + " is damaged: pipeline_ranks is " +
        json["pipeline_ranks"].dump());
  }
  const std::string savedOptimizer =
      json.value("optimizer", identity.optimizer);
  if (savedOptimizer != identity.optimizer) {
    throw ConfigError(
        "--resume: the checkpoint holds " + savedOptimizer +
        " optimizer state, but "
        "train.optimizer.type is " +
        identity.optimizer);
  }
  if (!json.contains("step") || !json["step"].is_number_integer() ||
      !json.contains("state") || !json["state"].is_string()) {
    throw ConfigError(
        "--resume: " + pointer.string() + " names no step and state");
  }
  // The state is a directory beside the pointer, named for its step: a
  // negative step or a path elsewhere ("../x") is a damaged pointer.
  const int64_t step = json["step"].get<int64_t>();
  if (step < 0 ||
      json["state"].get<std::string>() != "state-" + std::to_string(step)) {
    throw ConfigError(
        "--resume: " + pointer.string() + " is damaged: it names step " +
        std::to_string(step) + " and state '" +
        json["state"].get<std::string>() +
        "' (expected state-<step>, step >= 0)");
  }
}

std::string shortJson(const nlohmann::json& value) {
  std::string text = value.dump();
  return text.size() > 60 ? text.substr(0, 57) + "..." : text;
}

std::string joinKey(const std::string& path, const std::string& key) {
  return path.empty() ? key : path + "." + key;
}

// The first key, as a JSON path, whose value differs between the run that
// wrote a checkpoint and this one, with both values; empty when equal.
std::string firstDifference(
    const nlohmann::json& saved,
    const nlohmann::json& now,
    const std::string& path) {
  if (saved.is_object() && now.is_object()) {
    for (const auto& item : saved.items()) {
      if (!now.contains(item.key()))
        return joinKey(path, item.key()) + " is in the checkpoint's run only";
      std::string found = firstDifference(
          item.value(), now[item.key()], joinKey(path, item.key()));
      if (!found.empty())
        return found;
    }
    for (const auto& item : now.items()) {
      if (!saved.contains(item.key()))
        return joinKey(path, item.key()) + " is new in this run";
    }
    return "";
  }
  if (saved.is_array() && now.is_array()) {
    for (size_t i = 0; i < std::min(saved.size(), now.size()); ++i) {
      std::string found = firstDifference(
          saved[i], now[i], path + "[" + std::to_string(i) + "]");
      if (!found.empty())
        return found;
    }
    if (saved.size() != now.size()) {
      return path + " has " + std::to_string(saved.size()) +
          " entries in the checkpoint's run, " + std::to_string(now.size()) +
          " in this one";
    }
    return "";
  }
  if (saved != now)
    return path + " was " + shortJson(saved) + ", is " + shortJson(now);
  return "";
}

// The checkpoint must be this run's: the same model, data and training
// settings. Returns what changed when the user accepted changes.
std::string checkSameRun(
    const nlohmann::json& json,
    const CheckpointIdentity& identity) {
  std::string difference;
  if (json.contains("identity") && !identity.description.is_null()) {
    difference = firstDifference(json["identity"], identity.description, "");
  } else if (json.value("run", identity.run) != identity.run) {
    difference =
        "the run's fingerprint (model, data, seed or optimizer) differs";
  }
  if (difference.empty())
    return "";
  if (!identity.acceptChanges) {
    throw ConfigError(
        "--resume: the checkpoint was written by another run: " + difference +
        "; resume with the config that wrote it, or pass --resume-changed "
        "to continue with this change deliberately");
  }
  return "continuing with a changed config: " + difference;
}

std::string layerOf(const std::string& tensorName) {
  return tensorName.substr(0, tensorName.find('.'));
}

std::string listed(const std::set<std::string>& names) {
  std::string text;
  for (const auto& name : names)
    text += (text.empty() ? "" : ", ") + name;
  return text;
}

// The checkpoint's tensors and the model's, compared by layer name: a model
// with fewer (or other) layers is named, not left to LibTorch's loader.
void checkSameLayers(
    const c10::impl::GenericDict& weights,
    const std::vector<std::pair<std::string, torch::Tensor>>& tensors,
    const Pipeline& pipe) {
  std::set<std::string> ours, missing, extra;
  for (const auto& item : tensors) {
    ours.insert(item.first);
    if (!weights.contains(item.first))
      missing.insert(layerOf(item.first));
  }
  for (const auto& entry : weights) {
    const std::string name = entry.key().toStringRef();
    if (ours.count(name) == 0)
      extra.insert(layerOf(name));
  }
  if (missing.empty() && extra.empty())
    return;
  std::string text =
      "--resume: the checkpoint's layers differ from this "
      "model's (" +
      std::to_string(pipe.layers().size()) + " layers)";
  if (!extra.empty())
    text += "; only the checkpoint has layer(s) " + listed(extra);
  if (!missing.empty())
    text += "; only this model has layer(s) " + listed(missing);
  throw ConfigError(text);
}

c10::impl::GenericDict readWeights(const fs::path& file) {
  const std::string bytes = readFile(file);
  return torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()))
      .toGenericDict();
}

// Copies the checkpoint's weights into this process's stages. `weights`
// holds the stages of `written` (this process's own when the layout is
// the one that wrote it; every stage otherwise).
void restoreWeights(
    const c10::impl::GenericDict& weights,
    const std::vector<std::pair<std::string, torch::Tensor>>& written,
    Pipeline& pipe,
    Communicator* communicator) {
  checkSameLayers(weights, written, pipe);
  torch::NoGradGuard noGrad;
  for (const auto& [name, target] : checkpointTensors(pipe, communicator)) {
    const torch::Tensor saved = weights.at(name).toTensor();
    if (saved.sizes() != target.sizes()) {
      throw ConfigError(
          "--resume: '" + name + "' has a different shape in the checkpoint");
    }
    target.copy_(saved);
  }
  if (!communicator)
    pipe.refreshChainCopies();
}

// What a resume onto another layout says of what carries over.
const char* const kCarriedOver =
    ": weights and optimizer state carry over by layer name; the stages' "
    "random generators are re-seeded, so dropout masks differ from an "
    "uninterrupted run";

// The stages' generator states; on another stage count they stay freshly
// seeded, and the returned note says so.
std::string restoreGenerators(const fs::path& file, Pipeline& pipe) {
  const std::string bytes = readFile(file);
  std::vector<torch::Tensor> generators;
  for (const auto& value :
       torch::pickle_load(std::vector<char>(bytes.begin(), bytes.end()))
           .toTensorList()) {
    generators.push_back(value);
  }
  const size_t stages = pipe.generatorStates().size();
  if (generators.size() == stages) {
    pipe.setGeneratorStates(generators);
    return "";
  }
  return "the checkpoint has " + std::to_string(generators.size()) +
      " stage(s), this pipeline " + std::to_string(stages) + kCarriedOver;
}

// Across processes each rank keeps (and later saves) the optimizer state of
// its own stages only: state read for other stages' parameters would be
// stale in this rank's next checkpoint, and could override the fresh state
// of the rank that trains them when a later layout reads both files.
void keepOnlyOwnOptimizerState(
    torch::optim::Optimizer& optimizer,
    const Pipeline& pipe,
    Communicator* communicator) {
  auto& state = optimizer.state();
  using StateMap = std::decay_t<decltype(state)>;
  std::set<typename StateMap::key_type> own;
  for (const auto& item : checkpointTensors(pipe, communicator))
    own.insert(stateKeyOf<StateMap>(item.second)); // buffers have no state
  for (auto it = state.begin(); it != state.end();) {
    if (own.count(it->first) == 0)
      it = state.erase(it);
    else
      ++it;
  }
}

} // namespace

std::optional<int64_t> committedStep(const std::string& dir) {
  const fs::path pointer = fs::path(dir) / "checkpoint.json";
  std::error_code error;
  if (!fs::exists(pointer, error))
    return std::nullopt;
  std::ifstream in(pointer);
  const nlohmann::json json = nlohmann::json::parse(in, nullptr, false);
  if (!json.is_object() || !json.contains("step") ||
      !json["step"].is_number_integer())
    return std::nullopt;
  return json["step"].get<int64_t>();
}

Resumed loadCheckpoint(
    const std::string& root,
    Pipeline& pipe,
    torch::optim::Optimizer& optimizer,
    const CheckpointIdentity& identity,
    Communicator* communicator) {
  const fs::path pointer = fs::path(root) / "checkpoint.json";
  if (!fs::exists(pointer))
    throw ConfigError("--resume: " + pointer.string() + " not found");
  const nlohmann::json json = readJson(pointer);
  checkPointer(json, pointer, identity);
  const std::string changed = checkSameRun(json, identity);
  const std::string stateName = json["state"].get<std::string>();
  // 0: one process wrote it (DIR/state-N), else that many pipeline ranks
  // (DIR/rank-r/state-N).
  const int writtenBy = json.value("pipeline_ranks", 0);
  const int ranksNow = communicator ? communicator->pipelineRanks() : 0;
  std::vector<fs::path> states;
  if (writtenBy == 0) {
    states.push_back(fs::path(root) / stateName);
    verify(states.back(), json.value("files", nlohmann::json()));
  } else {
    for (int rank = 0; rank < writtenBy; ++rank) {
      if (writtenBy == ranksNow && rank != communicator->stageRank())
        continue; // the same layout: this rank's own files suffice
      states.push_back(
          fs::path(root) / ("rank-" + std::to_string(rank)) / stateName);
      verify(states.back(), readJson(states.back() / "checksums.json"));
    }
  }
  const bool sameLayout = writtenBy == ranksNow;
  // Weights go by layer name: from another layout, every stage's file is
  // read and each process takes its own stages' tensors.
  c10::impl::GenericDict weights = readWeights(states.front() / "model.pt");
  for (size_t k = 1; k < states.size(); ++k) {
    for (const auto& entry : readWeights(states[k] / "model.pt"))
      weights.insert_or_assign(entry.key(), entry.value());
  }
  restoreWeights(
      weights,
      checkpointTensors(pipe, sameLayout ? communicator : nullptr),
      pipe,
      communicator);
  // Optimizer state is stored by parameter position in the whole model,
  // which every layout shares; each file holds its writer's parameters, so
  // reading them in turn gathers every stage's.
  for (const fs::path& state : states) {
    std::istringstream optimizerBytes(readFile(state / "optimizer.pt"));
    try {
      torch::load(optimizer, optimizerBytes);
    } catch (const c10::Error& error) {
      throw ConfigError(
          "--resume: the optimizer state in " +
          (state / "optimizer.pt").string() +
          " does not fit this model's parameters (" +
          error.what_without_backtrace() + ")");
    }
  }
  if (communicator)
    keepOnlyOwnOptimizerState(optimizer, pipe, communicator);
  std::string note;
  if (sameLayout) {
    note = restoreGenerators(states.front() / "generators.pt", pipe);
  } else {
    auto layout = [](int ranks) {
      return ranks == 0 ? std::string("one process")
                        : std::to_string(ranks) + " pipeline rank(s)";
    };
    note = "the checkpoint was written by " + layout(writtenBy) +
        ", this run has " + layout(ranksNow) + kCarriedOver;
  }
  if (!changed.empty())
    note = note.empty() ? changed : changed + "; " + note;
  return {json["step"].get<int64_t>(), note};
}

} // namespace tpipe
