// `tpipe tune --cluster`: a cost model from shape inference and a cluster
// description, for machines we do not have. Nothing is built or run, so a
// 175-billion-parameter stack plans in a second. Assumptions: docs/tune.md.
#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "model/layer_types.h"
#include "tpipe/tuning.h"

namespace tpipe {
namespace {

using Json = nlohmann::json;

[[noreturn]] void bad(const std::string& where, const std::string& what) {
  throw ConfigError(where + ": " + what);
}

// A number at `key` of `object` in [min, max]; `fallback` when absent
// (NaN: required).
double numberAt(
    const Json& object,
    const std::string& path,
    const char* key,
    double fallback,
    double min,
    double max) {
  const std::string where = path.empty() ? key : path + "." + key;
  if (!object.is_object())
    bad(path, "expected an object, got " + object.dump());
  if (!object.contains(key)) {
    if (std::isnan(fallback))
      bad(where, "missing (required)");
    return fallback;
  }
  const Json& value = object[key];
  if (!value.is_number() || !(value.get<double>() >= min) ||
      !(value.get<double>() <= max)) {
    bad(where,
        "expected a number in [" + Json(min).dump() + ", " + Json(max).dump() +
            "], got " + value.dump());
  }
  return value.get<double>();
}

// A count: a whole number at `key` in [min, max], required. A fractional
// node count (1.5 nodes of 8) had planned for 12 devices.
int countAt(const Json& object, const char* key, int min, int max) {
  const double value = numberAt(object, "cluster", key, NAN, min, max);
  if (value != std::floor(value))
    bad(std::string("cluster.") + key,
        "expected a whole number, got " + object[key].dump());
  return static_cast<int>(value);
}

const Json& objectAt(const Json& root, const std::string& key) {
  if (!root.contains(key))
    bad("cluster." + key, "missing (required)");
  if (!root[key].is_object())
    bad("cluster." + key, "expected an object, got " + root[key].dump());
  return root[key];
}

Link linkFrom(const Json& root, const std::string& key) {
  const Json& link = objectAt(root, key);
  const std::string path = "cluster." + key;
  const double gbPerS = numberAt(link, path, "bandwidth_gb_s", NAN, 1e-6, 1e9);
  const double latencyUs = numberAt(link, path, "latency_us", 0.0, 0.0, 1e9);
  return {latencyUs / 1000.0, gbPerS * 1e6};
}

int64_t memoryOf(const Json& device) {
  if (!device.contains("memory"))
    bad("cluster.device.memory", "missing (required), e.g. \"80GiB\"");
  return parseBytes(device["memory"], "cluster.device.memory");
}

void checkKeys(
    const Json& object,
    const std::string& path,
    std::initializer_list<const char*> known) {
  for (auto it = object.begin(); it != object.end(); ++it) {
    bool ok = false;
    for (const char* key : known)
      ok = ok || it.key() == key;
    if (!ok)
      bad(path + "." + it.key(), "unknown key");
  }
}

struct Cluster {
  int devices = 1;
  Topology topology;
  DeviceSpec device;
  double flopsPerMs = 0.0; // peak x efficiency
  // Memory bandwidth for the roofline (bytes per ms); 0: compute-bound at
  // every size, time proportional to the samples.
  double memoryBytesPerMs = 0.0;
  double bytesPerValue = 2.0;
  double optimizerBytesPerParameter = -1.0; // < 0: from the config
  double instructionMs = 0.0;
  // Attention keeps its scores on chip (FlashAttention): they are neither
  // written to memory nor kept for the backward.
  bool flashAttention = false;
};

Cluster parseCluster(const Json& root) {
  if (!root.is_object())
    bad("cluster", "expected an object");
  checkKeys(
      root,
      "cluster",
      {"nodes",
       "devices_per_node",
       "device",
       "intra_node",
       "inter_node",
       "bytes_per_value",
       "optimizer_bytes_per_parameter",
       "instruction_us",
       "flash_attention"});
  Cluster c;
  const int nodes = countAt(root, "nodes", 1, 1 << 20);
  const int perNode = countAt(root, "devices_per_node", 1, 1024);
  if (static_cast<int64_t>(nodes) * perNode > (1 << 20))
    bad("cluster",
        std::to_string(nodes) + " nodes of " + std::to_string(perNode) +
            " devices are more than 1048576 devices");
  c.devices = nodes * perNode;
  c.topology.devicesPerNode = perNode;
  c.topology.intraNode = linkFrom(root, "intra_node");
  c.topology.interNode = root.contains("inter_node")
      ? linkFrom(root, "inter_node")
      : c.topology.intraNode;
  const Json& device = objectAt(root, "device");
  checkKeys(
      device,
      "cluster.device",
      {"name", "peak_tflops", "efficiency", "memory", "memory_gb_s"});
  c.device.name = device.value("name", std::string("device"));
  c.device.memoryBytes = memoryOf(device);
  const double tflops =
      numberAt(device, "cluster.device", "peak_tflops", NAN, 1e-6, 1e9);
  const double efficiency =
      numberAt(device, "cluster.device", "efficiency", 0.5, 1e-3, 1.0);
  c.flopsPerMs = tflops * 1e12 / 1e3 * efficiency;
  c.memoryBytesPerMs =
      numberAt(device, "cluster.device", "memory_gb_s", 0.0, 0.0, 1e9) * 1e6;
  c.bytesPerValue = numberAt(root, "cluster", "bytes_per_value", 2.0, 1.0, 8.0);
  c.optimizerBytesPerParameter = numberAt(
      root, "cluster", "optimizer_bytes_per_parameter", -1.0, 0.0, 64.0);
  c.instructionMs =
      numberAt(root, "cluster", "instruction_us", 0.0, 0.0, 1e6) / 1000.0;
  if (root.contains("flash_attention")) {
    if (!root["flash_attention"].is_boolean()) {
      bad("cluster.flash_attention",
          "expected true or false, got " + root["flash_attention"].dump());
    }
    c.flashAttention = root["flash_attention"].get<bool>();
  }
  return c;
}

// One layer's time against the micro-batch size n: the roofline's
// max(FLOPs / effective FLOP/s, bytes moved / bandwidth), where the weights
// are read once per micro-batch and the activations once per sample. Small
// micro-batches of a large layer are bound by reading its weights, so time
// stops falling with n below the ridge: what one efficiency for all shapes
// misses. The memory-bound operations inside a layer (a block's norms,
// softmax, dropout) run as kernels of their own between the products, so
// their traffic adds to the time rather than hiding under it: a narrower
// block with more heads spends more of its time there. Without a bandwidth:
// proportional to n, FLOPs only.
SizeCurve rooflineCurve(
    const Cluster& cluster,
    double flopsPerSample,
    double fixedBytes,
    double bytesPerSample,
    double memoryBoundBytesPerSample) {
  if (cluster.memoryBytesPerMs <= 0.0)
    return SizeCurve::proportional(1.0, flopsPerSample / cluster.flopsPerMs);
  SizeCurve curve;
  for (double n = 1.0; n <= 65536.0; n *= 2.0) {
    curve.sizes.push_back(n);
    curve.ms.push_back(
        std::max(
            n * flopsPerSample / cluster.flopsPerMs,
            (fixedBytes + n * bytesPerSample) / cluster.memoryBytesPerMs) +
        n * memoryBoundBytesPerSample / cluster.memoryBytesPerMs);
  }
  return curve;
}

CostModel analyticModel(const Config& config, const Cluster& cluster) {
  CostModel model;
  model.threads = {1};
  model.instructionMs = cluster.instructionMs;
  if (!config.model.torchscript.empty()) {
    throw ConfigError(
        "model.torchscript: tune --cluster derives costs from a layer list's "
        "facts; a TorchScript model's are known only by running it");
  }
  const std::vector<LayerFacts> facts = modelFacts(config.model);
  double input = cluster.bytesPerValue;
  for (int64_t d : config.model.inputShape)
    input *= static_cast<double>(d);
  model.inputBytesPerSample = input;
  for (size_t l = 0; l < facts.size(); ++l) {
    const LayerFacts& f = facts[l];
    LayerModel layer;
    layer.name = std::to_string(l) + " " + config.model.layers[l].type;
    layer.paramBytes = static_cast<int64_t>(
        static_cast<double>(f.parameters) * cluster.bytesPerValue);
    double output = cluster.bytesPerValue;
    for (int64_t d : f.output)
      output *= static_cast<double>(d);
    const double moved =
        (f.movedElements -
         (cluster.flashAttention ? f.attentionMovedElements : 0.0)) *
        cluster.bytesPerValue;
    layer.forward = {rooflineCurve(
        cluster,
        f.forwardFlops,
        static_cast<double>(layer.paramBytes),
        input + output,
        moved)};
    // The backward: twice the FLOPs; reads the weights and writes their
    // gradients, reads the output's gradient and the input, writes the
    // input's gradient.
    layer.backward = {rooflineCurve(
        cluster,
        2.0 * f.forwardFlops,
        2.0 * static_cast<double>(layer.paramBytes),
        2.0 * input + output,
        2.0 * moved)};
    input = output;
    // A stage ending here also sends the skips alive across its end.
    layer.activationBytesPerSample =
        output + f.skipElements * cluster.bytesPerValue;
    layer.stashBytesPerSample =
        (f.savedElements -
         (cluster.flashAttention ? f.attentionSavedElements : 0.0)) *
        cluster.bytesPerValue;
    model.layers.push_back(layer);
  }
  return model;
}

} // namespace

TuneOutcome tuneForCluster(
    const Config& config,
    const nlohmann::json& json,
    const std::string& source) {
  TuneOutcome outcome = clusterCostModel(config, json, source);
  outcome.result = tunePlans(outcome.model, outcome.request);
  return outcome;
}

TuneOutcome clusterCostModel(
    const Config& config,
    const nlohmann::json& json,
    const std::string& source) {
  const Cluster cluster = parseCluster(json);
  TuneOutcome outcome;
  outcome.model = analyticModel(config, cluster);
  outcome.model.source = source + " (FLOPs and bytes from shape inference)";
  TuneRequest request;
  request.batchSize = config.train.batchSize;
  request.devices.assign(static_cast<size_t>(cluster.devices), cluster.device);
  request.topology = cluster.topology;
  request.replicate = true;
  // Across processes steps are posted without a barrier, as threads post
  // them: each stage's update waits only for its own replicas' average.
  request.overlapSteps = config.pipeline.overlapSteps;
  request.speculativeUpdates =
      config.pipeline.overlapSteps && config.train.checksGradients()
      ? SpeculativeUpdates::kEveryPlan
      : SpeculativeUpdates::kNone;
  const auto& o = config.train.optimizer;
  request.optimizerFactor = cluster.optimizerBytesPerParameter >= 0
      ? cluster.optimizerBytesPerParameter / cluster.bytesPerValue
      : optimizerStateFactor(o.type, o.momentum);
  outcome.calibration.push_back(
      std::to_string(cluster.devices) + " devices (" +
      std::to_string(cluster.topology.devicesPerNode) + " per node), " +
      formatBytes(cluster.device.memoryBytes) + " each, " +
      std::to_string(cluster.flopsPerMs / 1e9) + " effective TFLOP/s");
  outcome.request = std::move(request);
  return outcome;
}

} // namespace tpipe
