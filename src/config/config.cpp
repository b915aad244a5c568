#include "tpipe/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "json_input.h"
#include "model/layer_types.h"
#include "layers/skip_rules.h"
#include "tpipe/schedule.h"

namespace tpipe {

const char* const kFashionMnistPath = "/usr/share/datasets/fashion-mnist";
const char* const kDefaultTextPath = "/usr/share/common-licenses/GPL-3";

namespace {

using Json = nlohmann::json;

// The default ceiling of an integer in a config: what an int holds.
constexpr int64_t kLargestInteger = 2147483647;

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw ConfigError(path + ": " + what);
}

std::string shown(const Json& value) {
  std::string text = value.dump();
  if (text.size() > 60)
    text = text.substr(0, 57) + "...";
  return text;
}

size_t editDistance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j)
    row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t above = row[j];
      row[j] = std::min(
          {row[j] + 1,
           row[j - 1] + 1,
           diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = above;
    }
  }
  return row[b.size()];
}

std::string didYouMean(
    const std::string& key,
    const std::vector<std::string>& known) {
  std::string best;
  size_t bestDistance = std::max<size_t>(3, key.size() / 2) + 1;
  for (const auto& candidate : known) {
    const size_t d = editDistance(key, candidate);
    if (d < bestDistance) {
      bestDistance = d;
      best = candidate;
    }
  }
  std::string hint;
  if (!best.empty())
    hint = " (did you mean '" + best + "'?)";
  std::string list;
  for (const auto& candidate : known)
    list += (list.empty() ? "" : ", ") + candidate;
  return hint + "; known keys: " + list;
}

// Reads the keys of one JSON object, remembering which were asked for, so
// that finish() can reject the rest as unknown.
class ObjectReader {
 public:
  ObjectReader(const Json& json, std::string path)
      : json_(json), path_(std::move(path)) {
    if (!json_.is_object())
      fail(path_, "expected an object, got " + shown(json_));
  }

  std::string at(const std::string& key) const {
    return path_.empty() ? key : path_ + "." + key;
  }

  const Json* find(const std::string& key) {
    if (std::find(known_.begin(), known_.end(), key) == known_.end())
      known_.push_back(key);
    auto it = json_.find(key);
    return it == json_.end() ? nullptr : &*it;
  }

  const Json& require(const std::string& key) {
    const Json* value = find(key);
    if (value == nullptr)
      fail(at(key), "missing (required)");
    return *value;
  }

  int64_t integer(
      const std::string& key,
      int64_t fallback,
      int64_t min,
      const char* expectation,
      int64_t max = kLargestInteger) {
    const Json* value = find(key);
    if (value == nullptr)
      return fallback;
    return checkInteger(*value, at(key), min, expectation, max);
  }

  double number(
      const std::string& key,
      double fallback,
      double min,
      double max,
      const char* expectation) {
    const Json* value = find(key);
    if (value == nullptr)
      return fallback;
    if (!value->is_number() || value->get<double>() < min ||
        value->get<double>() > max || !std::isfinite(value->get<double>())) {
      fail(
          at(key),
          std::string("expected ") + expectation + ", got " + shown(*value));
    }
    return value->get<double>();
  }

  bool boolean(const std::string& key, bool fallback) {
    const Json* value = find(key);
    if (value == nullptr)
      return fallback;
    if (!value->is_boolean())
      fail(at(key), "expected true or false, got " + shown(*value));
    return value->get<bool>();
  }

  std::string choice(
      const std::string& key,
      const std::string& fallback,
      const std::vector<std::string>& allowed) {
    const Json* value = find(key);
    if (value == nullptr)
      return fallback;
    std::string list;
    for (const auto& option : allowed)
      list += (list.empty() ? "" : ", ") + option;
    if (!value->is_string())
      fail(at(key), "expected one of " + list + ", got " + shown(*value));
    const std::string text = value->get<std::string>();
    if (std::find(allowed.begin(), allowed.end(), text) == allowed.end()) {
      fail(at(key), "unknown value '" + text + "'; expected one of " + list);
    }
    return text;
  }

  // A name or a list of names ("s1" or ["s1", "s2"]); absent: none.
  std::vector<std::string> names(const std::string& key) {
    const Json* value = find(key);
    if (value == nullptr)
      return {};
    const bool one = value->is_string();
    std::vector<std::string> names;
    for (const Json& item : one ? Json::array({*value}) : *value) {
      if (!item.is_string() || item.get<std::string>().empty())
        break;
      names.push_back(item.get<std::string>());
    }
    if ((!one && !value->is_array()) || value->empty() ||
        names.size() != (one ? 1 : value->size())) {
      fail(at(key), "expected a name or a list of names, got " + shown(*value));
    }
    return names;
  }

  std::string string(const std::string& key, const std::string& fallback) {
    const Json* value = find(key);
    if (value == nullptr)
      return fallback;
    if (!value->is_string() || value->get<std::string>().empty()) {
      fail(at(key), "expected a non-empty string, got " + shown(*value));
    }
    return value->get<std::string>();
  }

  void finish() const {
    for (auto it = json_.begin(); it != json_.end(); ++it) {
      if (std::find(known_.begin(), known_.end(), it.key()) == known_.end()) {
        fail(
            at(it.key()),
            "unknown key '" + it.key() + "'" + didYouMean(it.key(), known_));
      }
    }
  }

  // Integers beyond `max` are refused rather than truncated (a count of
  // 2^32 + 1 must not run as 1).
  static int64_t checkInteger(
      const Json& value,
      const std::string& path,
      int64_t min,
      const char* expectation,
      int64_t max = kLargestInteger) {
    const bool tooLarge = value.is_number_unsigned() &&
        value.get<uint64_t>() > static_cast<uint64_t>(max);
    if (!value.is_number_integer() || value.get<int64_t>() < min) {
      fail(
          path,
          std::string("expected ") + expectation + ", got " + shown(value));
    }
    if (tooLarge || value.get<int64_t>() > max) {
      fail(
          path,
          std::string("expected ") + expectation + " up to " +
              std::to_string(max) + ", got " + shown(value));
    }
    return value.get<int64_t>();
  }

 private:
  const Json& json_;
  std::string path_;
  std::vector<std::string> known_;
};

Json checkParam(
    const ParamRule& rule,
    const Json& value,
    const std::string& path) {
  auto positivePair = [&](int64_t min, const char* expectation) {
    if (value.is_array()) {
      if (value.size() != 2)
        fail(
            path,
            std::string("expected ") + expectation + ", got " + shown(value));
      return Json::array(
          {ObjectReader::checkInteger(value[0], path + "[0]", min, expectation),
           ObjectReader::checkInteger(
               value[1], path + "[1]", min, expectation)});
    }
    const int64_t n = ObjectReader::checkInteger(value, path, min, expectation);
    return Json::array({n, n});
  };
  using Kind = ParamKind;
  switch (rule.kind) {
    case Kind::kPositive:
      return ObjectReader::checkInteger(value, path, 1, "a positive integer");
    case Kind::kNonNegative:
      return ObjectReader::checkInteger(
          value, path, 0, "a non-negative integer");
    case Kind::kSize2:
      return positivePair(1, "a positive integer or a pair of them");
    case Kind::kSize2NonNegative:
      return positivePair(0, "a non-negative integer or a pair of them");
    case Kind::kBool:
      if (!value.is_boolean())
        fail(path, "expected true or false, got " + shown(value));
      return value;
    case Kind::kProbability:
      if (!value.is_number() || value.get<double>() < 0 ||
          value.get<double>() >= 1) {
        fail(path, "expected a number in [0, 1), got " + shown(value));
      }
      return value;
    case Kind::kPositiveNumber:
      if (!value.is_number() || value.get<double>() <= 0) {
        fail(path, "expected a positive number, got " + shown(value));
      }
      return value;
  }
  return value;
}

LayerSpec parseLayer(const Json& json, const std::string& path) {
  ObjectReader reader(json, path);
  const Json& typeValue = reader.require("type");
  std::vector<std::string> types;
  for (const auto& entry : layerTypes())
    types.push_back(entry.name);
  if (!typeValue.is_string())
    fail(
        reader.at("type"),
        "expected a layer type string, got " + shown(typeValue));
  const std::string type = typeValue.get<std::string>();
  const LayerType* rules = findLayerType(type);
  if (rules == nullptr) {
    std::string hint = didYouMean(type, types);
    hint.replace(hint.find("; known keys"), 12, "; known types");
    fail(reader.at("type"), "unknown layer type '" + type + "'" + hint);
  }
  LayerSpec spec{type, Json::object()};
  for (const ParamRule& rule : rules->params) {
    const Json* value = reader.find(rule.key);
    if (value != nullptr) {
      spec.params[rule.key] = checkParam(rule, *value, reader.at(rule.key));
    } else if (std::string(rule.key) == "stride" && rule.fallback.is_null()) {
      spec.params["stride"] =
          spec.params["kernel_size"]; // pools: stride = kernel
    } else if (rule.fallback.is_null()) {
      fail(reader.at(rule.key), "missing (required for " + type + ")");
    } else {
      spec.params[rule.key] =
          checkParam(rule, rule.fallback, reader.at(rule.key));
    }
  }
  spec.tiedTo = static_cast<int>(reader.integer(
      "tied_to", -1, 0, "the index of an earlier layer", 1 << 30));
  spec.stash = reader.names("stash");
  spec.pop = reader.names("pop");
  spec.merge = reader.choice("merge", "add", {"add", "concat"});
  if (spec.pop.empty() && reader.find("merge") != nullptr)
    fail(reader.at("merge"), "needs a pop (the skip it merges)");
  reader.finish();
  return spec;
}

// Stashes and pops pair up (model/skip_rules.h), named by the layer.
void checkSkipNames(const std::vector<LayerSpec>& layers) {
  std::vector<LayerSkips> skips;
  for (const auto& layer : layers)
    skips.push_back({layer.stash, layer.pop, false});
  if (const auto problem = findSkipProblem(skips)) {
    const auto& layer = layers[problem->layer];
    const bool popping = problem->what.find("popped") != std::string::npos;
    fail(
        "model.layers[" + std::to_string(problem->layer) + "]." +
            (popping && !layer.pop.empty() ? "pop" : "stash"),
        problem->what);
  }
}

std::vector<int64_t> parseShape(const Json& json, const std::string& path) {
  if (!json.is_array() || json.empty()) {
    fail(
        path,
        "expected a non-empty list of positive integers, got " + shown(json));
  }
  std::vector<int64_t> shape;
  for (size_t i = 0; i < json.size(); ++i) {
    shape.push_back(ObjectReader::checkInteger(
        json[i],
        path + "[" + std::to_string(i) + "]",
        1,
        "a positive integer"));
  }
  return shape;
}

DeviceConfig parseDevice(const Json& json, const std::string& path) {
  if (json.is_string())
    return {json.get<std::string>(), 0, 1.0};
  ObjectReader reader(json, path);
  DeviceConfig device;
  device.name = reader.string("name", "");
  if (device.name.empty())
    fail(reader.at("name"), "missing (required)");
  if (const Json* memory = reader.find("memory")) {
    device.memoryBytes = parseBytes(*memory, reader.at("memory"));
  }
  device.speed = reader.number("speed", 1.0, 1e-9, 1e9, "a positive number");
  reader.finish();
  return device;
}

} // namespace

int configuredStages(const PipelineConfig& p) {
  if (p.stages > 0)
    return p.stages;
  if (!p.balance.empty())
    return static_cast<int>(p.balance.size());
  return static_cast<int>(p.devices.size()) * p.virtualStages;
}

int64_t parseBytes(const Json& value, const std::string& path) {
  if (value.is_number_integer() && value.get<int64_t>() > 0)
    return value.get<int64_t>();
  if (!value.is_string()) {
    fail(
        path,
        "expected a size such as \"512MiB\" or a positive byte count, got " +
            shown(value));
  }
  const std::string text = value.get<std::string>();
  size_t end = 0;
  double number = 0;
  try {
    number = std::stod(text, &end);
  } catch (const std::exception&) {
    fail(path, "expected a size such as \"512MiB\", got " + shown(value));
  }
  std::string unit = text.substr(end);
  unit.erase(std::remove(unit.begin(), unit.end(), ' '), unit.end());
  static const std::map<std::string, double> units = {
      {"", 1},
      {"B", 1},
      {"KB", 1e3},
      {"MB", 1e6},
      {"GB", 1e9},
      {"TB", 1e12},
      {"KiB", 1024.0},
      {"MiB", 1048576.0},
      {"GiB", 1073741824.0},
      {"TiB", 1099511627776.0}};
  auto it = units.find(unit);
  if (it == units.end() || !std::isfinite(number) || number <= 0) {
    fail(
        path,
        "expected a size such as \"512MiB\" (units B, KB, MB, GB, KiB, MiB, GiB), got " +
            shown(value));
  }
  const double bytes = number * it->second;
  if (bytes < 1.0)
    fail(path, "less than one byte: " + shown(value));
  if (bytes > 9.0e18)
    fail(path, "too large: " + shown(value));
  return static_cast<int64_t>(std::llround(bytes));
}

namespace {

void parseModel(const Json& json, Config& config) {
  ObjectReader model(json, "model");
  if (const Json* shape = model.find("input_shape")) {
    config.model.inputShape = parseShape(*shape, "model.input_shape");
  }
  if (const Json* script = model.find("torchscript")) {
    if (!script->is_string() || script->get<std::string>().empty())
      fail("model.torchscript", "expected the path of a TorchScript file");
    if (model.find("layers"))
      fail("model.layers", "give either layers or torchscript, not both");
    config.model.torchscript = script->get<std::string>();
    model.finish();
    return;
  }
  const Json& layers = model.require("layers");
  if (!layers.is_array() || layers.empty()) {
    fail(
        "model.layers",
        "expected a non-empty list of layers, got " + shown(layers));
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    const std::string path = "model.layers[" + std::to_string(i) + "]";
    config.model.layers.push_back(parseLayer(layers[i], path));
    if (config.model.layers.back().tiedTo >= static_cast<int>(i)) {
      fail(
          path + ".tied_to",
          std::string("must name an earlier layer (") +
              (i == 0 ? "there is none" : "0 to " + std::to_string(i - 1)) +
              "), got " + std::to_string(config.model.layers.back().tiedTo));
    }
  }
  checkSkipNames(config.model.layers);
  model.finish();
}

void parseData(const Json& json, Config& config) {
  ObjectReader data(json, "data");
  auto& d = config.data;
  d.dataset = data.choice(
      "dataset",
      "",
      {"fashion-mnist", "text", "tokens", "tensors", "synthetic"});
  if (d.dataset.empty())
    fail("data.dataset", "missing (required)");
  if (d.dataset == "tokens" && !data.find("path"))
    fail("data.path", "missing (required for tokens: a flat uint16 file)");
  if (d.dataset == "tensors" && !data.find("path")) {
    fail(
        "data.path",
        "missing (required for tensors: a file written by torch.save({\"inputs\": X, "
        "\"targets\": Y}, path))");
  }
  const std::string defaultPath = d.dataset == "fashion-mnist"
      ? kFashionMnistPath
      : d.dataset == "text" ? kDefaultTextPath
                            : "";
  d.path = data.string("path", defaultPath);
  d.evalPath = data.string("eval_path", "");
  if (!d.evalPath.empty() && d.dataset != "tensors")
    fail("data.eval_path", "only the tensors dataset reads an evaluation file");
  d.shuffle = data.boolean("shuffle", true);
  d.normalize = data.boolean("normalize", false);
  d.seqLen = data.integer("seq_len", 64, 1, "a positive integer");
  d.stride = data.integer("stride", 0, 0, "a non-negative integer");
  d.samples = data.integer("samples", 1024, 1, "a positive integer");
  d.evalSamples = data.integer("eval_samples", 0, 0, "a non-negative integer");
  data.finish();
}

// A text or image dataset fixes the model's input shape.
void checkInputShape(Config& config) {
  const auto& d = config.data;
  if (d.dataset == "text" || d.dataset == "tokens") {
    config.model.tokenInput = true;
    if (config.model.inputShape.empty())
      config.model.inputShape = {d.seqLen};
    if (config.model.inputShape != std::vector<int64_t>{d.seqLen}) {
      fail(
          "model.input_shape",
          "a " + d.dataset + " model's input is [seq_len] = [" +
              std::to_string(d.seqLen) + "]");
    }
  }
  if (d.dataset == "fashion-mnist") {
    if (config.model.inputShape.empty())
      config.model.inputShape = {1, 28, 28};
    if (config.model.inputShape != std::vector<int64_t>{1, 28, 28}) {
      fail("model.input_shape", "fashion-mnist images are [1, 28, 28]");
    }
  }
  if (config.model.inputShape.empty())
    fail(
        "model.input_shape",
        "missing (required for synthetic and tensors data)");
}

std::vector<DeviceConfig> parseDevices(const Json& devices) {
  if (!devices.is_array() || devices.empty()) {
    fail(
        "pipeline.devices",
        "expected a non-empty list of devices such as \"cpu:0\", got " +
            shown(devices));
  }
  std::vector<DeviceConfig> parsed;
  std::set<std::string> seen;
  for (size_t i = 0; i < devices.size(); ++i) {
    const std::string path = "pipeline.devices[" + std::to_string(i) + "]";
    parsed.push_back(parseDevice(devices[i], path));
    const std::string& name = parsed.back().name;
    const bool cpu = name.rfind("cpu", 0) == 0,
               cuda = name.rfind("cuda", 0) == 0;
    const size_t colon = name.find(':');
    const bool indexOk = colon == std::string::npos
        ? name == "cpu" || name == "cuda"
        : colon + 1 < name.size() &&
            name.find_first_not_of("0123456789", colon + 1) ==
                std::string::npos;
    if (!(cpu || cuda) || !indexOk ||
        (colon != std::string::npos && colon != (cpu ? 3u : 4u))) {
      fail(
          path,
          "unknown device '" + name + "' (expected \"cpu:N\" or \"cuda:N\")");
    }
    if (!seen.insert(name).second)
      fail(path, "device '" + name + "' is listed twice");
  }
  return parsed;
}

ScheduleSource parseScheduleSource(ObjectReader& pipeline) {
  if (const Json* custom = pipeline.find("schedule");
      custom && custom->is_string()) {
    const ScheduleSource source(custom->get<std::string>());
    if (source.isFile())
      return source; // validated when the plan loads it
  }
  std::vector<std::string> names = scheduleNames();
  names.push_back("a schedule file (*.json, *.csv)");
  return ScheduleSource(pipeline.choice("schedule", "gpipe", names));
}

void parseBalance(ObjectReader& pipeline, PipelineConfig& p) {
  if (const Json* balance = pipeline.find("balance")) {
    if (!balance->is_array() || balance->empty()) {
      fail(
          "pipeline.balance",
          "expected a list of layers per stage, got " + shown(*balance));
    }
    for (size_t i = 0; i < balance->size(); ++i) {
      p.balance.push_back(static_cast<int>(ObjectReader::checkInteger(
          (*balance)[i],
          "pipeline.balance[" + std::to_string(i) + "]",
          1,
          "a positive integer")));
    }
    if (!pipeline.find("partition"))
      p.partition = PartitionMethod::kBalance;
    if (p.partition != PartitionMethod::kBalance) {
      fail(
          "pipeline.balance",
          "given together with partition '" +
              std::string(partitionMethodName(p.partition)) +
              "': a balance fixes the partition; drop one of the two");
    }
  }
  if (p.partition == PartitionMethod::kBalance && p.balance.empty()) {
    fail("pipeline.balance", "missing (required by partition 'balance')");
  }
}

// The pipeline's keys against each other and the model.
void checkPipeline(const Config& config) {
  const auto& p = config.pipeline;
  const int stages = configuredStages(p);
  if (!p.balance.empty() && static_cast<int>(p.balance.size()) != stages) {
    fail(
        "pipeline.balance",
        "has " + std::to_string(p.balance.size()) + " entries for " +
            std::to_string(stages) + " stages");
  }
  if (config.model.torchscript.empty())
    checkPipelineFitsLayers(p, config.model.layers.size());
  if (stages % p.virtualStages != 0 ||
      stages / p.virtualStages > static_cast<int>(p.devices.size())) {
    fail(
        "pipeline.stages",
        std::to_string(stages) + " stages with " +
            std::to_string(p.virtualStages) +
            " virtual stage(s) per device need " +
            std::to_string((stages + p.virtualStages - 1) / p.virtualStages) +
            " devices, got " + std::to_string(p.devices.size()));
  }
}

// With "auto" the tuner chooses the plan: a hand-picked setting next to it
// would be silently overridden, so it is an error.
void checkAutoLeavesPlanOpen(const Json& pipeline) {
  for (const char* key :
       {"stages",
        "micro_batches",
        "schedule",
        "virtual_stages",
        "checkpoint",
        "partition",
        "balance",
        "threads_per_device",
        "data_parallel"}) {
    if (pipeline.contains(key)) {
      fail(
          std::string("pipeline.") + key,
          "is chosen by the tuner when pipeline.auto is true; remove one of "
          "them (`tpipe tune CONFIG --write OUT` writes the choice out)");
    }
  }
}

void parsePipeline(const Json& json, Config& config) {
  ObjectReader pipeline(json, "pipeline");
  auto& p = config.pipeline;
  p.devices = parseDevices(pipeline.require("devices"));
  p.stages = static_cast<int>(
      pipeline.integer("stages", 0, 1, "a positive integer", 4096));
  p.microBatches = static_cast<int>(
      pipeline.integer("micro_batches", 1, 1, "a positive integer", 65536));
  p.schedule = parseScheduleSource(pipeline);
  // zb-v and dualpipev always lay two stages on each device.
  const bool vShaped = p.schedule.isBuiltIn() && isVShaped(p.schedule.kind());
  p.virtualStages = static_cast<int>(pipeline.integer(
      "virtual_stages", vShaped ? 2 : 1, 1, "a positive integer", 64));
  p.checkpoint = parseCheckpointMode(pipeline.choice(
      "checkpoint", "except_last", {"always", "except_last", "never"}));
  p.partition = parsePartitionMethod(pipeline.choice(
      "partition", "uniform", {"uniform", "parameters", "time", "balance"}));
  parseBalance(pipeline, p);
  p.threadsPerDevice = static_cast<int>(pipeline.integer(
      "threads_per_device", 0, 0, "a non-negative integer", 1024));
  p.dataParallel = static_cast<int>(
      pipeline.integer("data_parallel", 1, 1, "a positive integer", 65536));
  p.timeoutS = pipeline.number(
      "timeout_s", 60.0, 0.1, 86400.0, "a number of seconds in [0.1, 86400]");
  p.overlapGradSync = pipeline.boolean("overlap_grad_sync", true);
  p.overlapSteps = pipeline.boolean("overlap_steps", true);
  p.directWeightGradients = pipeline.boolean("direct_weight_gradients", true);
  p.nccl = pipeline.boolean("nccl", true);
  p.autoTune = pipeline.boolean("auto", false);
  if (const Json* elastic = pipeline.find("elastic")) {
    ObjectReader e(*elastic, "pipeline.elastic");
    p.elasticMinRanks = static_cast<int>(
        e.integer("min_ranks", 1, 1, "a positive integer", 4096));
    e.finish();
    if (p.elasticMinRanks > static_cast<int>(p.devices.size())) {
      fail(
          "pipeline.elastic.min_ranks",
          std::to_string(p.elasticMinRanks) + " ranks need as many devices, " +
              std::to_string(p.devices.size()) + " listed");
    }
    for (const char* fixed : {"stages", "balance"}) {
      if (json.contains(fixed)) {
        fail(
            std::string("pipeline.") + fixed,
            "fixes the stage count, which pipeline.elastic leaves to the "
            "world's size; remove one of them");
      }
    }
  }
  pipeline.finish();
  if (p.autoTune)
    checkAutoLeavesPlanOpen(json);
  checkPipeline(config);
}

OptimizerConfig parseOptimizer(const Json& optimizer);
void checkBatch(const Config& config);

void parseTrain(const Json& json, Config& config) {
  ObjectReader train(json, "train");
  auto& t = config.train;
  t.batchSize = train.integer("batch_size", 64, 1, "a positive integer");
  t.steps = train.integer(
      "steps", 100, 0, "a non-negative integer", int64_t{1} << 40);
  t.loss = train.choice("loss", "cross_entropy", {"cross_entropy", "mse"});
  t.seed = static_cast<uint64_t>(train.integer(
      "seed",
      0,
      0,
      "a non-negative integer",
      std::numeric_limits<int64_t>::max()));
  t.evalEvery = train.integer("eval_every", 0, 0, "a non-negative integer");
  t.checkpointEvery =
      train.integer("checkpoint_every", 0, 0, "a non-negative integer");
  t.logEvery = train.integer("log_every", 0, 0, "a non-negative integer");
  t.clipGradNorm = train.number(
      "clip_grad_norm", 0.0, 0.0, 1e30, "a non-negative number (0: off)");
  t.onNonFinite = train.choice("on_nonfinite", "stop", {"stop", "skip"});
  t.precision = train.choice("precision", "fp32", {"fp32", "bf16"});
  if (const Json* optimizer = train.find("optimizer"))
    t.optimizer = parseOptimizer(*optimizer);
  train.finish();
  checkBatch(config);
}

OptimizerConfig parseOptimizer(const Json& optimizer) {
  OptimizerConfig opt;
  {
    ObjectReader o(optimizer, "train.optimizer");
    opt.type = o.choice("type", "sgd", {"sgd", "adam", "adamw"});
    const bool adam = opt.type != "sgd";
    opt.lr =
        o.number("lr", adam ? 1e-3 : 0.1, 0.0, 1e6, "a non-negative number");
    opt.momentum = o.number("momentum", 0.0, 0.0, 1.0, "a number in [0, 1]");
    opt.weightDecay = o.number(
        "weight_decay",
        opt.type == "adamw" ? 0.01 : 0.0,
        0.0,
        1e6,
        "a non-negative number");
    opt.beta1 = o.number("beta1", 0.9, 0.0, 0.999999, "a number in [0, 1)");
    opt.beta2 = o.number("beta2", 0.999, 0.0, 0.999999, "a number in [0, 1)");
    opt.eps = o.number("eps", 1e-8, 1e-30, 1.0, "a small positive number");
    opt.warmupSteps = o.integer("warmup_steps", 0, 0, "a non-negative integer");
    opt.decay = o.choice("decay", "none", {"none", "cosine"});
    opt.minLr = o.number("min_lr", 0.0, 0.0, 1e6, "a non-negative number");
    if (!adam && (o.find("beta1") || o.find("beta2"))) {
      fail("train.optimizer", "beta1/beta2 apply to adam and adamw, not sgd");
    }
    if (adam && optimizer.contains("momentum")) {
      fail("train.optimizer.momentum", "applies to sgd; adam uses beta1");
    }
    o.finish();
  }
  return opt;
}

void checkBatch(const Config& config) {
  const auto& t = config.train;
  if (t.batchSize % config.pipeline.dataParallel != 0) {
    fail(
        "train.batch_size",
        "batch size " + std::to_string(t.batchSize) +
            " does not split evenly over " +
            std::to_string(config.pipeline.dataParallel) +
            " data-parallel replicas");
  }
  if (t.batchSize / config.pipeline.dataParallel <
      config.pipeline.microBatches) {
    fail(
        "train.batch_size",
        "batch size " +
            std::to_string(t.batchSize / config.pipeline.dataParallel) +
            " per replica is smaller than pipeline.micro_batches (" +
            std::to_string(config.pipeline.microBatches) + ")");
  }
}

} // namespace

void checkPipelineFitsLayers(const PipelineConfig& p, size_t layers) {
  const int stages = configuredStages(p);
  int balanced = 0;
  for (int count : p.balance)
    balanced += count;
  if (!p.balance.empty() && balanced != static_cast<int>(layers)) {
    fail(
        "pipeline.balance",
        "sums to " + std::to_string(balanced) + " layers, but the model has " +
            std::to_string(layers));
  }
  if (stages > static_cast<int>(layers)) {
    fail(
        "pipeline.stages",
        "more stages (" + std::to_string(stages) + ") than layers (" +
            std::to_string(layers) + ")");
  }
}

Config parseConfig(const Json& json) {
  Config config;
  ObjectReader root(json, "");
  parseModel(root.require("model"), config);
  parseData(root.require("data"), config);
  checkInputShape(config);
  parsePipeline(root.require("pipeline"), config);
  parseTrain(root.require("train"), config);
  root.finish();
  return config;
}

void applyOverride(Json& json, const std::string& assignment) {
  const size_t equals = assignment.find('=');
  if (equals == std::string::npos || equals == 0) {
    throw ConfigError("--set '" + assignment + "': expected key.path=value");
  }
  const std::string path = assignment.substr(0, equals);
  const std::string text = assignment.substr(equals + 1);
  Json value;
  try {
    value = parseJsonText(text, "--set " + path);
  } catch (const ConfigError&) {
    value = text; // a bare string such as cpu:0 or 1f1b
  }
  Json* node = &json;
  // Errors name list elements as model.layers[1]; that spelling is taken
  // back as model.layers.1.
  std::string dotted;
  for (size_t i = 0; i < path.size(); ++i) {
    if (path[i] != '[') {
      dotted += path[i];
      continue;
    }
    const size_t close = path.find(']', i);
    if (close == std::string::npos)
      throw ConfigError("--set " + path + ": a '[' without its ']'");
    dotted += "." + path.substr(i + 1, close - i - 1);
    i = close;
  }
  std::stringstream parts(dotted);
  std::string part, walked;
  std::vector<std::string> keys;
  while (std::getline(parts, part, '.'))
    keys.push_back(part);
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string& key = keys[i];
    walked += (walked.empty() ? "" : ".") + key;
    const bool last = i + 1 == keys.size();
    if (node->is_array()) {
      if (key.empty() || key.size() > 9 ||
          key.find_first_not_of("0123456789") != std::string::npos ||
          std::stoul(key) >= node->size()) {
        throw ConfigError(
            "--set " + walked + ": no such list element (the list has " +
            std::to_string(node->size()) + ")");
      }
      node = &(*node)[std::stoul(key)];
    } else if (node->is_object()) {
      if (!last && !node->contains(key))
        (*node)[key] = Json::object();
      node = &(*node)[key];
    } else {
      throw ConfigError(
          "--set " + walked + ": " + shown(*node) + " has no keys");
    }
  }
  *node = value;
}

Json readConfigJson(
    const std::string& path,
    const std::vector<std::string>& overrides) {
  std::ifstream probe(path);
  if (!probe)
    throw ConfigError(path + ": cannot open the config file");
  Json json = readJsonFile(path, path, /*allowComments=*/true);
  for (const auto& assignment : overrides)
    applyOverride(json, assignment);
  return json;
}

Config loadConfig(
    const std::string& path,
    const std::vector<std::string>& overrides) {
  return parseConfig(readConfigJson(path, overrides));
}

namespace {

nlohmann::json describeLayers(const ModelConfig& model) {
  nlohmann::json layers = nlohmann::json::array();
  for (const auto& layer : model.layers) {
    nlohmann::json item = layer.params;
    item["type"] = layer.type;
    if (layer.tiedTo >= 0)
      item["tied_to"] = layer.tiedTo;
    if (!layer.stash.empty())
      item["stash"] = layer.stash;
    if (!layer.pop.empty()) {
      item["pop"] = layer.pop;
      item["merge"] = layer.merge;
    }
    layers.push_back(item);
  }
  return layers;
}

} // namespace

nlohmann::json describeConfig(const Config& config) {
  const nlohmann::json layers = describeLayers(config.model);
  const auto& d = config.data;
  const auto& p = config.pipeline;
  const auto& t = config.train;
  const auto& o = t.optimizer;
  nlohmann::json devices = nlohmann::json::array();
  for (const auto& device : p.devices)
    devices.push_back(
        {{"name", device.name},
         {"memory", device.memoryBytes},
         {"speed", device.speed}});
  return {
      {"model",
       config.model.torchscript.empty()
           ? nlohmann::json{{"input_shape", config.model.inputShape}, {"layers", layers}}
           : nlohmann::json{
                 {"input_shape", config.model.inputShape},
                 {"torchscript", config.model.torchscript}}},
      {"data",
       {{"dataset", d.dataset},
        {"path", d.path},
        {"eval_path", d.evalPath},
        {"shuffle", d.shuffle},
        {"normalize", d.normalize},
        {"seq_len", d.seqLen},
        {"stride", d.stride},
        {"samples", d.samples},
        {"eval_samples", d.evalSamples}}},
      {"pipeline",
       {{"devices", devices},
        {"stages", p.stages},
        {"micro_batches", p.microBatches},
        {"schedule", p.schedule.text()},
        {"virtual_stages", p.virtualStages},
        {"checkpoint", checkpointModeName(p.checkpoint)},
        {"partition", partitionMethodName(p.partition)},
        {"balance", p.balance},
        {"threads_per_device", p.threadsPerDevice},
        {"data_parallel", p.dataParallel},
        {"timeout_s", p.timeoutS},
        {"overlap_grad_sync", p.overlapGradSync},
        {"overlap_steps", p.overlapSteps},
        {"direct_weight_gradients", p.directWeightGradients},
        {"nccl", p.nccl},
        {"auto", p.autoTune},
        {"elastic", {{"min_ranks", p.elasticMinRanks}}}}},
      {"train",
       {{"batch_size", t.batchSize},
        {"steps", t.steps},
        {"loss", t.loss},
        {"seed", t.seed},
        {"eval_every", t.evalEvery},
        {"checkpoint_every", t.checkpointEvery},
        {"clip_grad_norm", t.clipGradNorm},
        {"on_nonfinite", t.onNonFinite},
        {"precision", t.precision},
        {"optimizer",
         {{"type", o.type},
          {"lr", o.lr},
          {"momentum", o.momentum},
          {"weight_decay", o.weightDecay},
          {"beta1", o.beta1},
          {"beta2", o.beta2},
          {"eps", o.eps},
          {"warmup_steps", o.warmupSteps},
          {"decay", o.decay},
          {"min_lr", o.minLr}}}}}};
}

} // namespace tpipe
