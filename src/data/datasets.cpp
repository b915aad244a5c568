// Datasets named in configs: Fashion-MNIST (IDX .gz files), character-level
// text, token files, the user's own tensors (torch.save files), and
// synthetic data from a seeded random teacher.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#ifndef TPIPE_NO_ZLIB
#include <zlib.h>
#endif

#include <array>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <caffe2/serialize/inline_container.h>
#include <torch/csrc/jit/serialization/unpickler.h>
#include <torch/nn/functional/activation.h>

#include "data/tensor_files.h"
#include "host_memory.h"
#include "tpipe/model.h"
#include "tpipe/partition.h"

namespace tpipe {
namespace {

// A data file must be a regular file: a directory, a device such as
// /dev/zero or a FIFO is named as what it is, not as missing.
void requireRegularFile(
    const std::string& path,
    const std::string& hint,
    const std::string& flag = "data.path") {
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0)
    throw ConfigError(flag + ": " + path + " not found" + hint);
  if (S_ISDIR(info.st_mode))
    throw ConfigError(flag + ": " + path + " is a directory, not a file");
  if (!S_ISREG(info.st_mode)) {
    throw ConfigError(
        flag + ": " + path +
        " is not a regular file (a device, FIFO or socket); give a file");
  }
}

#ifdef TPIPE_NO_ZLIB
using gzFile = void*;
inline gzFile gzopen(const char*, const char*) {
  return nullptr;
}
inline int gzread(gzFile, void*, unsigned) {
  return -1;
}
inline int gzclose(gzFile) {
  return 0;
}
inline unsigned long crc32(unsigned long, const unsigned char*, unsigned) {
  return 0;
}
#endif

class GzipFile {
 public:
  explicit GzipFile(const std::string& path)
      : path_(path), file_(gzopen(path.c_str(), "rb")) {
#ifdef TPIPE_NO_ZLIB
    throw ConfigError(
        "data.path: this tpipe was built without zlib and cannot read " + path);
#endif
    if (file_ == nullptr)
      throw ConfigError("data.path: cannot open " + path);
  }
  ~GzipFile() {
    gzclose(file_);
  }
  GzipFile(const GzipFile&) = delete;
  GzipFile& operator=(const GzipFile&) = delete;

  void read(void* buffer, size_t bytes) {
    auto* out = static_cast<char*>(buffer);
    while (bytes > 0) {
      const unsigned chunk =
          static_cast<unsigned>(std::min<size_t>(bytes, 1u << 30));
      const int got = gzread(file_, out, chunk);
      if (got <= 0)
        throw ConfigError("data.path: " + path_ + " is truncated or not gzip");
      crc_ = crc32(
          crc_,
          reinterpret_cast<const unsigned char*>(out),
          static_cast<unsigned>(got));
      size_ += static_cast<uint64_t>(got);
      out += got;
      bytes -= static_cast<size_t>(got);
    }
  }

  // After the payload: nothing more to read, and the gzip trailer (CRC-32
  // and length of everything read) matches. zlib's gzread returns a short
  // read without an error when the file ends inside the trailer, so a cut
  // or flipped trailer is checked here, against the file's last 8 bytes.
  void expectEnd() {
    char extra = 0;
    const int got = gzread(file_, &extra, 1);
    if (got > 0) {
      throw ConfigError(
          "data.path: " + path_ + " holds more bytes than its header declares");
    }
    std::ifstream raw(path_, std::ios::binary);
    std::array<unsigned char, 8> tail{};
    raw.seekg(-8, std::ios::end);
    raw.read(reinterpret_cast<char*>(tail.data()), 8);
    auto little = [&](int at) {
      return uint32_t{tail[at]} | (uint32_t{tail[at + 1]} << 8) |
          (uint32_t{tail[at + 2]} << 16) | (uint32_t{tail[at + 3]} << 24);
    };
    if (got < 0 || !raw || little(0) != static_cast<uint32_t>(crc_) ||
        little(4) != static_cast<uint32_t>(size_)) {
      throw ConfigError(
          "data.path: " + path_ +
          " is damaged (truncated, or its gzip checksum does not match)");
    }
  }

  uint32_t bigEndian32() {
    std::array<unsigned char, 4> b{};
    read(b.data(), 4);
    return (uint32_t{b[0]} << 24) | (uint32_t{b[1]} << 16) |
        (uint32_t{b[2]} << 8) | b[3];
  }

 private:
  std::string path_;
  gzFile file_;
  unsigned long crc_ = crc32(0, nullptr, 0);
  uint64_t size_ = 0; // uncompressed bytes read
};

// A tensor of the given shape that costs no memory and reads nothing: what a
// rank holds in place of data its stages never use.
at::Tensor standIn(at::IntArrayRef sizes, at::ScalarType dtype) {
  return at::zeros({1}, at::TensorOptions().dtype(dtype)).expand(sizes);
}

at::Tensor standIn(const at::Tensor& like, at::ScalarType dtype) {
  return standIn(like.sizes(), dtype);
}

// IDX format: magic (0x0803 images / 0x0801 labels), big-endian dims, bytes.
std::vector<int64_t> readIdxShape(
    GzipFile& file,
    const std::string& path,
    uint32_t magic,
    int dims) {
  const uint32_t found = file.bigEndian32();
  if (found != magic) {
    throw ConfigError(
        "data.path: " + path +
        " is not an IDX file of the expected kind (magic " +
        std::to_string(found) + ")");
  }
  std::vector<int64_t> shape;
  for (int d = 0; d < dims; ++d)
    shape.push_back(file.bigEndian32());
  return shape;
}

at::Tensor readIdx(const std::string& path, uint32_t magic, int dims) {
  GzipFile file(path);
  const std::vector<int64_t> shape = readIdxShape(file, path, magic, dims);
  int64_t count = 1;
  for (int64_t size : shape)
    count *= size;
  at::Tensor bytes = at::empty(shape, at::kByte);
  file.read(bytes.data_ptr<uint8_t>(), static_cast<size_t>(count));
  file.expectEnd();
  return bytes;
}

// Images and labels pair up one to one, and every label is a class the
// model outputs: a swapped or damaged label file fails here, not mid-run.
void checkLabels(
    const at::Tensor& images,
    const at::Tensor& labels,
    const std::string& imagesPath,
    const std::string& labelsPath,
    int64_t classes) {
  if (images.size(0) != labels.size(0)) {
    throw ConfigError(
        "data.path: " + imagesPath + " holds " +
        std::to_string(images.size(0)) + " images but " + labelsPath +
        " holds " + std::to_string(labels.size(0)) + " labels");
  }
  if (labels.numel() == 0)
    return;
  const int64_t largest = labels.max().item<int64_t>();
  if (largest >= classes) {
    throw ConfigError(
        "data.path: " + labelsPath + " holds label " + std::to_string(largest) +
        ", but the model outputs " + std::to_string(classes) + " classes");
  }
}

Dataset fashionMnist(
    const Config& config,
    const BuiltModel& model,
    DataNeeds needs) {
  const std::string& dir = config.data.path;
  const char* names[] = {
      "train-images-idx3-ubyte.gz",
      "train-labels-idx1-ubyte.gz",
      "t10k-images-idx3-ubyte.gz",
      "t10k-labels-idx1-ubyte.gz"};
  struct stat info {};
  if (::stat(dir.c_str(), &info) == 0 && !S_ISDIR(info.st_mode)) {
    throw ConfigError(
        "data.path: " + dir +
        " is not a directory (fashion-mnist reads the four IDX files in one)");
  }
  for (const char* name : names) {
    requireRegularFile(
        dir + "/" + name,
        " (Debian's package dataset-fashion-mnist provides it: "
        "apt-get install dataset-fashion-mnist)");
  }
  // A pixel is one of 256 bytes: the float each becomes, by the very ops
  // (torchvision's ToTensor, then Normalize), is looked up in one pass.
  // Those ops on 60000 images took a pass each and full-size temporaries of
  // 188 MB of fresh pages, about 0.5 s at every start of every rank.
  at::Tensor pixelValues = at::arange(256, at::kFloat).div_(255.0);
  if (config.data.normalize)
    pixelValues.sub_(0.2860).div_(0.3530);
  auto images = [&](const char* name) {
    const std::string path = dir + "/" + name;
    if (!needs.inputs) {
      GzipFile file(path);
      std::vector<int64_t> shape = readIdxShape(file, path, 0x803, 3);
      shape.insert(shape.begin() + 1, 1);
      return standIn(shape, at::kFloat);
    }
    const at::Tensor bytes = readIdx(path, 0x803, 3);
    at::Tensor x = at::empty(bytes.sizes(), at::kFloat);
    const uint8_t* from = bytes.data_ptr<uint8_t>();
    const float* value = pixelValues.data_ptr<float>();
    float* to = x.data_ptr<float>();
    at::parallel_for(
        0, bytes.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i)
            to[i] = value[from[i]];
        });
    return x.unsqueeze(1);
  };
  auto labels = [&](const char* name) {
    return readIdx(dir + "/" + name, 0x801, 1).to(at::kLong);
  };
  Dataset data;
  data.trainInputs = images(names[0]);
  data.trainTargets = labels(names[1]);
  data.evalInputs = images(names[2]);
  data.evalTargets = labels(names[3]);
  const int64_t classes = model.shapes.back().back();
  for (int part : {0, 2}) {
    checkLabels(
        part == 0 ? data.trainInputs : data.evalInputs,
        part == 0 ? data.trainTargets : data.evalTargets,
        dir + "/" + names[part],
        dir + "/" + names[part + 1],
        classes);
  }
  data.description =
      "fashion-mnist: " + std::to_string(data.trainInputs.size(0)) +
      " training and " + std::to_string(data.evalInputs.size(0)) +
      " test images";
  return data;
}

// Next-symbol prediction over a sequence (bytes of a text, or token ids).
// The last tenth is held out, cut into non-overlapping windows of seq_len + 1
// symbols; training windows start every data.stride symbols of the rest
// (overlapping when stride < seq_len), so a small text still yields many
// distinct samples.
Dataset nextSymbol(
    const std::vector<int64_t>& symbols,
    const Config& config,
    const std::string& unit) {
  const std::string& path = config.data.path;
  const int64_t window = config.data.seqLen + 1;
  const int64_t size = static_cast<int64_t>(symbols.size());
  const int64_t held = std::max<int64_t>(window, size / 10);
  const int64_t trainSize = size - held;
  if (trainSize < window) {
    throw ConfigError(
        "data.seq_len: " + path + " has " + std::to_string(size) + " " + unit +
        ", too few for a training and a held-out window of " +
        std::to_string(window));
  }
  const int64_t stride = config.data.stride > 0
      ? config.data.stride
      : std::max<int64_t>(1, config.data.seqLen / 4);
  auto windowsOf = [&](int64_t begin, int64_t end, int64_t step) {
    const int64_t count = (end - begin - window) / step + 1;
    at::Tensor all = at::empty({count, window}, at::kLong);
    auto* out = all.data_ptr<int64_t>();
    for (int64_t w = 0; w < count; ++w) {
      std::copy_n(symbols.begin() + begin + w * step, window, out + w * window);
    }
    return all;
  };
  const at::Tensor train = windowsOf(0, trainSize, stride);
  const at::Tensor heldOut = windowsOf(trainSize, size, window);
  Dataset data;
  data.trainInputs = train.narrow(1, 0, window - 1).contiguous();
  data.trainTargets = train.narrow(1, 1, window - 1).contiguous();
  data.evalInputs = heldOut.narrow(1, 0, window - 1).contiguous();
  data.evalTargets = heldOut.narrow(1, 1, window - 1).contiguous();
  data.description = path + ": " + std::to_string(size) + " " + unit + ", " +
      std::to_string(train.size(0)) + " training windows (stride " +
      std::to_string(stride) + ") and " + std::to_string(heldOut.size(0)) +
      " held-out windows of " + std::to_string(window - 1);
  return data;
}

std::vector<char> readWhole(
    const std::string& path,
    const char* hint,
    const std::string& flag = "data.path") {
  requireRegularFile(path, hint, flag);
  std::ifstream file(path, std::ios::binary);
  return std::vector<char>(
      (std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
}

Dataset text(const Config& config) {
  const std::string& path = config.data.path;
  const std::vector<char> bytes = readWhole(
      path,
      path == kDefaultTextPath ? " (Debian's package base-files provides it)"
                               : "");
  std::vector<int64_t> symbols(bytes.size());
  std::array<double, 256> counts{};
  for (size_t i = 0; i < bytes.size(); ++i) {
    symbols[i] = static_cast<unsigned char>(bytes[i]);
    counts[symbols[i]] += 1;
  }
  Dataset data = nextSymbol(symbols, config, "bytes");
  const double size = static_cast<double>(bytes.size());
  double entropy = 0.0;
  for (double c : counts) {
    if (c > 0)
      entropy -= c / size * std::log(c / size);
  }
  data.description = "text " + data.description + "; unigram entropy " +
      std::to_string(entropy).substr(0, 5) + " nats";
  return data;
}

// A flat little-endian uint16 file of token ids, as GPT training scripts
// (nanoGPT's prepare.py) write them. Every id must have an embedding row and
// an output class.
Dataset tokens(const Config& config, const BuiltModel& model) {
  const std::string& path = config.data.path;
  const std::vector<char> bytes = readWhole(path, "");
  if (bytes.size() % 2 != 0) {
    throw ConfigError(
        "data.path: " + path + " has " + std::to_string(bytes.size()) +
        " bytes, not a whole number of uint16 tokens");
  }
  std::vector<int64_t> symbols(bytes.size() / 2);
  int64_t largest = 0;
  for (size_t i = 0; i < symbols.size(); ++i) {
    symbols[i] = static_cast<unsigned char>(bytes[2 * i]) |
        static_cast<int64_t>(static_cast<unsigned char>(bytes[2 * i + 1])) << 8;
    largest = std::max(largest, symbols[i]);
  }
  const int64_t classes = model.shapes.back().back();
  const int64_t rows = model.integerInput ? model.inputVocabulary : classes;
  if (largest >= std::min(classes, rows)) {
    throw ConfigError(
        "data.path: " + path + " holds token id " + std::to_string(largest) +
        ", but the model has " + std::to_string(rows) + " embedding rows and " +
        std::to_string(classes) +
        " output classes (both must exceed every id)");
  }
  Dataset data = nextSymbol(symbols, config, "tokens");
  data.description =
      "tokens " + data.description + "; largest id " + std::to_string(largest);
  return data;
}

// Inputs from N(0, 1); targets from a fixed random linear teacher: class
// argmax for cross-entropy, tanh of the projection for mse. Learnable, so a
// smoke run shows the loss falling.

// One torch.save({"inputs": X, "targets": Y}, path) file, read by
// LibTorch's own unpickler and checked against the model: the sample
// shapes, the dtypes, and every class label in range.
struct TensorPair {
  at::Tensor inputs, targets;
};

// A NaN or an infinity in the training data reaches the loss of whichever
// batch holds it and, through the update, every weight; eval loss turns NaN
// and stays so. Refused naming the first such sample. Scanned in blocks, so
// the check needs little memory beside the data.
void requireFinite(const at::Tensor& values, const std::string& where) {
  const at::Tensor rows = values.reshape({values.size(0), -1});
  const int64_t block = std::max<int64_t>(
      1, (int64_t{1} << 20) / std::max<int64_t>(1, rows.size(1)));
  for (int64_t first = 0; first < rows.size(0); first += block) {
    const at::Tensor part =
        rows.narrow(0, first, std::min(block, rows.size(0) - first));
    const at::Tensor bad = part.isfinite().logical_not().any(1);
    if (!bad.any().item<bool>())
      continue;
    const int64_t sample = first + bad.nonzero()[0][0].item<int64_t>();
    const at::Tensor row = rows[sample];
    const bool nan = row.isnan().any().item<bool>();
    throw ConfigError(
        where + " sample " + std::to_string(sample) + " holds " +
        (nan ? "NaN" : "an infinity") +
        "; training takes finite values (drop or fill that sample)");
  }
}

TensorPair readTensorFile(
    const std::string& key,
    const std::string& path,
    const Config& config,
    const BuiltModel& model,
    DataNeeds needs) {
  const std::string where = key + ": " + path;
  const c10::IValue value = readTorchSave(key, path);
  if (!value.isGenericDict()) {
    throw ConfigError(
        where + " holds a " + value.tagKind() +
        "; expected a dict {\"inputs\": tensor, \"targets\": tensor}");
  }
  const c10::impl::GenericDict dict = value.toGenericDict();
  TensorPair pair{
      tensorOfDict(dict, "inputs", where),
      tensorOfDict(dict, "targets", where)};
  at::Tensor& x = pair.inputs;
  at::Tensor& y = pair.targets;
  if (x.dim() == 0 || y.dim() == 0 || x.size(0) != y.size(0)) {
    throw ConfigError(
        where + ": \"inputs\" " + shapeText(x.sizes()) + " and \"targets\" " +
        shapeText(y.sizes()) + " do not hold the same number of samples");
  }
  x = modelInputs(x, where + ": \"inputs\"", model, needs.inputs);
  if (needs.inputs && !model.integerInput)
    requireFinite(x, where + ": \"inputs\"");
  const std::vector<int64_t>& out = model.shapes.back();
  if (config.train.loss == "cross_entropy") {
    const std::vector<int64_t> want(out.begin(), out.end() - 1);
    if (!at::isIntegralType(y.scalar_type(), false)) {
      throw ConfigError(
          where + ": \"targets\" are " +
          std::string(c10::toString(y.scalar_type())) +
          "; cross_entropy takes integer class indices");
    }
    if (y.sizes().slice(1) != at::IntArrayRef(want)) {
      throw ConfigError(
          where + ": \"targets\" samples are " + shapeText(y.sizes().slice(1)) +
          " but cross_entropy over the model's output " + shapeText(out) +
          " needs " + shapeText(want));
    }
    if (!needs.targets)
      return {x, standIn(y, at::kLong)};
    y = y.to(at::kLong).contiguous();
    const int64_t low = y.min().item<int64_t>(), high = y.max().item<int64_t>();
    if (low < 0 || high >= out.back()) {
      throw ConfigError(
          where + ": \"targets\" hold class " +
          std::to_string(low < 0 ? low : high) + ", but the model outputs " +
          std::to_string(out.back()) + " classes");
    }
  } else {
    if (!at::isFloatingType(y.scalar_type())) {
      throw ConfigError(
          where + ": \"targets\" are " +
          std::string(c10::toString(y.scalar_type())) +
          "; mse takes floating-point targets shaped like the output");
    }
    if (y.sizes().slice(1) != at::IntArrayRef(out)) {
      throw ConfigError(
          where + ": \"targets\" samples are " + shapeText(y.sizes().slice(1)) +
          " but the model outputs " + shapeText(out));
    }
    y = needs.targets ? y.to(at::kFloat).contiguous() : standIn(y, at::kFloat);
    if (needs.targets)
      requireFinite(y, where + ": \"targets\"");
  }
  return pair;
}

Dataset tensors(
    const Config& config,
    const BuiltModel& model,
    DataNeeds needs) {
  TensorPair train =
      readTensorFile("data.path", config.data.path, config, model, needs);
  Dataset data;
  const int64_t n = train.inputs.size(0);
  if (!config.data.evalPath.empty()) {
    TensorPair eval = readTensorFile(
        "data.eval_path", config.data.evalPath, config, model, needs);
    data.trainInputs = train.inputs, data.trainTargets = train.targets;
    data.evalInputs = eval.inputs, data.evalTargets = eval.targets;
  } else {
    // The last tenth is held out, as for text and tokens.
    const int64_t held = n >= 10 ? n / 10 : 0;
    data.trainInputs = train.inputs.narrow(0, 0, n - held);
    data.trainTargets = train.targets.narrow(0, 0, n - held);
    data.evalInputs = train.inputs.narrow(0, n - held, held);
    data.evalTargets = train.targets.narrow(0, n - held, held);
  }
  data.description = "tensors: " + std::to_string(data.trainInputs.size(0)) +
      " training samples from " + config.data.path + ", " +
      std::to_string(data.evalInputs.size(0)) + " evaluation samples " +
      (config.data.evalPath.empty() ? "held out"
                                    : "from " + config.data.evalPath);
  return data;
}

// The synthetic set is drawn whole: its inputs and targets (a lower bound
// of what drawing them takes) must fit in the host's available memory, or
// data.samples 2e9 fails in an allocation of 300 GB instead of naming it.
void checkSyntheticFitsHost(
    const Config& config,
    int64_t total,
    const std::vector<int64_t>& inShape,
    const std::vector<int64_t>& outShape,
    bool integerInput) {
  const int64_t available = availableMemoryBytes();
  if (available <= 0)
    return;
  double in = integerInput ? sizeof(int64_t) : sizeof(float);
  for (int64_t d : inShape)
    in *= static_cast<double>(d);
  double out = 1;
  for (int64_t d : outShape)
    out *= static_cast<double>(d);
  // Cross-entropy targets are class indices: one per position.
  out *= config.train.loss == "cross_entropy"
      ? static_cast<double>(sizeof(int64_t)) /
          static_cast<double>(outShape.back())
      : sizeof(float);
  const double bytes = static_cast<double>(total) * (in + out);
  if (bytes <= static_cast<double>(available))
    return;
  throw ConfigError(
      std::string(
          config.data.evalSamples > 0 ? "data.samples, data.eval_samples: "
                                      : "data.samples: ") +
      std::to_string(total) +
      " synthetic samples (training and evaluation) need " +
      formatBytes(static_cast<int64_t>(std::min(bytes, 9e18))) +
      ", and this host has " + formatBytes(available) +
      " available; ask for fewer samples");
}

Dataset synthetic(const Config& config, const BuiltModel& model) {
  at::Generator generator =
      at::make_generator<at::CPUGeneratorImpl>(config.train.seed + 12345);
  const int64_t evalCount = config.data.evalSamples > 0
      ? config.data.evalSamples
      : std::max<int64_t>(1, config.data.samples / 5);
  const int64_t total = config.data.samples + evalCount;
  const auto& inShape = model.shapes.front();
  const auto& outShape = model.shapes.back();
  checkSyntheticFitsHost(config, total, inShape, outShape, model.integerInput);
  std::vector<int64_t> shape{total};
  shape.insert(shape.end(), inShape.begin(), inShape.end());
  at::Tensor inputs;
  if (model.integerInput) {
    const int64_t vocab =
        config.model.layers.front().params["num_embeddings"].get<int64_t>();
    inputs = at::randint(vocab, shape, generator, at::kLong);
  } else {
    inputs = at::randn(shape, generator, at::kFloat);
  }
  at::Tensor flat = inputs.reshape({total, -1}).to(at::kFloat);
  int64_t outSize = 1;
  for (int64_t d : outShape)
    outSize *= d;
  at::Tensor targets;
  if (config.train.loss == "cross_entropy") {
    const int64_t classes = outShape.back();
    std::vector<int64_t> targetShape{total};
    targetShape.insert(targetShape.end(), outShape.begin(), outShape.end() - 1);
    const int64_t positions = outSize / classes;
    at::Tensor teacher =
        at::randn({flat.size(1), positions * classes}, generator, at::kFloat);
    targets = flat.matmul(teacher)
                  .reshape({total, positions, classes})
                  .argmax(2)
                  .reshape(targetShape);
  } else {
    at::Tensor teacher =
        at::randn({flat.size(1), outSize}, generator, at::kFloat) /
        std::sqrt(static_cast<double>(flat.size(1)));
    std::vector<int64_t> targetShape{total};
    targetShape.insert(targetShape.end(), outShape.begin(), outShape.end());
    targets = at::tanh(flat.matmul(teacher)).reshape(targetShape);
  }
  Dataset data;
  const int64_t n = config.data.samples;
  data.trainInputs = inputs.narrow(0, 0, n);
  data.trainTargets = targets.narrow(0, 0, n);
  data.evalInputs = inputs.narrow(0, n, evalCount);
  data.evalTargets = targets.narrow(0, n, evalCount);
  data.description = "synthetic: " + std::to_string(n) + " training and " +
      std::to_string(evalCount) + " evaluation samples";
  return data;
}

} // namespace

void checkLossFits(const Config& config, const BuiltModel& model) {
  const auto& out = model.shapes.back();
  const std::string& loss = config.train.loss;
  const std::string& dataset = config.data.dataset;
  if (loss == "cross_entropy") {
    if (out.size() != 1 && out.size() != 2) {
      throw ConfigError(
          "train.loss: cross_entropy needs an output of [classes] or [seq_len, classes] "
          "per sample; the model outputs " +
          shapeText(out));
    }
    if (dataset == "fashion-mnist" && (out.size() != 1 || out[0] < 10)) {
      throw ConfigError(
          "model.layers: fashion-mnist has 10 classes; the model outputs " +
          shapeText(out) +
          " per sample (end with a linear layer of out_features 10)");
    }
    if (dataset == "tokens" &&
        (out.size() != 2 || out[0] != config.data.seqLen)) {
      throw ConfigError(
          "model.layers: a token model predicts a token at each of " +
          std::to_string(config.data.seqLen) + " positions, [" +
          std::to_string(config.data.seqLen) +
          ", vocabulary]; the model outputs " + shapeText(out));
    }
    if (dataset == "text" &&
        (out.size() != 2 || out[0] != config.data.seqLen || out[1] < 256)) {
      throw ConfigError(
          "model.layers: a text model predicts 256 byte values at each of " +
          std::to_string(config.data.seqLen) + " positions, [" +
          std::to_string(config.data.seqLen) + ", 256]; the model outputs " +
          shapeText(out));
    }
  } else if (dataset != "synthetic" && dataset != "tensors") {
    throw ConfigError(
        "train.loss: mse needs regression targets; " + dataset +
        " has class labels (use cross_entropy)");
  }
}

std::string shapeText(at::IntArrayRef shape) {
  std::string text = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    text += (i ? ", " : "") + std::to_string(shape[i]);
  return text + "]";
}

at::Tensor tensorOfDict(
    const c10::impl::GenericDict& dict,
    const char* name,
    const std::string& where) {
  for (const auto& entry : dict) {
    if (entry.key().isString() && entry.key().toStringRef() == name) {
      if (!entry.value().isTensor()) {
        throw ConfigError(
            where + ": \"" + name + "\" is a " + entry.value().tagKind() +
            ", expected a tensor");
      }
      return entry.value().toTensor();
    }
  }
  throw ConfigError(
      where + ": missing key \"" + name +
      "\" (expected a dict such as {\"inputs\": tensor, \"targets\": tensor})");
}

namespace {

// A file mapped copy-on-write: tensors point into it, and their pages are
// read from disk when first touched, so a tensor nobody touches is never
// read, and none is copied. It lives as long as a tensor points into it.
class MappedFile {
 public:
  explicit MappedFile(const std::string& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat info {};
    TORCH_CHECK(fd >= 0 && ::fstat(fd, &info) == 0, "cannot open ", path);
    length_ = static_cast<size_t>(info.st_size);
    void* base =
        ::mmap(nullptr, length_, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    ::close(fd);
    TORCH_CHECK(base != MAP_FAILED, "cannot map ", path);
    base_ = static_cast<char*>(base);
  }
  ~MappedFile() {
    ::munmap(base_, length_);
  }
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  char* at(size_t offset) const {
    return base_ + offset;
  }
  // Whether [data, data + bytes) lies inside the file. A storage of no
  // bytes (a tensor with no elements) has no data pointer, and nothing to
  // read past the end: it was called truncated.
  bool holds(const void* data, size_t bytes) const {
    const char* begin = static_cast<const char*>(data);
    return bytes == 0 || (begin >= base_ && begin + bytes <= base_ + length_);
  }

 private:
  char* base_ = nullptr;
  size_t length_ = 0;
};

void releaseMapping(void* context) {
  delete static_cast<std::shared_ptr<MappedFile>*>(context);
}

// torch.save's zip stores each storage uncompressed and 64-byte aligned
// (data/<key>); the unpickler asks for each by key, and gets a pointer into
// the mapping instead of a copy.
c10::IValue unpickleMapped(const std::string& path) {
  caffe2::serialize::PyTorchStreamReader reader(path);
  auto mapping = std::make_shared<MappedFile>(path);
  const auto [pickle, pickleBytes] = reader.getRecord("data.pkl");
  size_t consumed = 0;
  auto readPickle = [&, &pickle = pickle, &pickleBytes = pickleBytes](
                        char* buffer, size_t wanted) -> size_t {
    const size_t n = std::min(wanted, pickleBytes - consumed);
    std::memcpy(buffer, static_cast<const char*>(pickle.get()) + consumed, n);
    consumed += n;
    return n;
  };
  auto readRecord = [&](const std::string& key) {
    char* data = mapping->at(reader.getRecordOffset("data/" + key));
    return at::DataPtr(
        data,
        new std::shared_ptr<MappedFile>(mapping),
        releaseMapping,
        at::Device(at::kCPU));
  };
  torch::jit::Unpickler unpickler(
      readPickle, nullptr, nullptr, readRecord, c10::nullopt);
  unpickler.set_version(reader.version());
  c10::IValue value = unpickler.parse_ivalue();
  // A storage the pickle says is larger than the file: refused before any
  // page past the end is touched.
  auto check = [&](const at::Tensor& tensor) {
    TORCH_CHECK(
        mapping->holds(tensor.storage().data(), tensor.storage().nbytes()),
        "a tensor's data runs past the end of the file (truncated?)");
  };
  if (value.isTensor())
    check(value.toTensor());
  if (value.isGenericDict()) {
    for (const auto& entry : value.toGenericDict()) {
      if (entry.value().isTensor())
        check(entry.value().toTensor());
    }
  }
  if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) {
      if (item.isTensor())
        check(item.toTensor());
    }
  }
  return value;
}

} // namespace

c10::IValue readTorchSave(const std::string& flag, const std::string& path) {
  const std::string where = flag + ": " + path;
  requireRegularFile(path, "", flag);
  std::error_code sizeError;
  if (std::filesystem::file_size(path, sizeError) == 0 && !sizeError)
    throw ConfigError(where + " is empty (expected a torch.save file)");
  try {
    return unpickleMapped(path);
  } catch (const c10::Error& error) {
    throw ConfigError(
        where +
        " is not a torch.save file that LibTorch's unpickler reads (it reads "
        "what torch.save writes by default; " +
        error.what_without_backtrace() + ")" +
        (std::string(error.what_without_backtrace()).find("at 0x73") !=
                 std::string::npos
             ? "; a dict with a single key is beyond it: save the tensor "
               "itself (torch.save(X)) or a dict of two or more keys"
             : ""));
  }
}

at::Tensor modelInputs(
    at::Tensor x,
    const std::string& where,
    const BuiltModel& model,
    bool needed) {
  if (x.dim() == 0 || x.size(0) == 0)
    throw ConfigError(where + " holds no samples");
  const std::vector<int64_t>& in = model.shapes.front();
  if (x.sizes().slice(1) != at::IntArrayRef(in)) {
    throw ConfigError(
        where + " samples are " + shapeText(x.sizes().slice(1)) +
        " but model.input_shape is " + shapeText(in));
  }
  const std::string dtype = c10::toString(x.scalar_type());
  if (model.integerInput) {
    if (!at::isIntegralType(x.scalar_type(), false)) {
      throw ConfigError(
          where + " are " + dtype +
          " but the model starts with an embedding, which takes integer token "
          "ids");
    }
    if (!needed)
      return standIn(x, at::kLong);
    x = x.to(at::kLong).contiguous();
    const int64_t low = x.min().item<int64_t>(), high = x.max().item<int64_t>();
    if (low < 0 || high >= model.inputVocabulary) {
      throw ConfigError(
          where + " hold token id " + std::to_string(low < 0 ? low : high) +
          ", outside the embedding's num_embeddings " +
          std::to_string(model.inputVocabulary));
    }
    return x;
  }
  if (!at::isFloatingType(x.scalar_type())) {
    throw ConfigError(
        where + " are " + dtype +
        "; a model without an embedding first takes floating-point inputs");
  }
  return needed ? x.to(at::kFloat).contiguous() : standIn(x, at::kFloat);
}

Dataset loadDataset(const Config& config, const BuiltModel& model) {
  return loadDataset(config, model, DataNeeds{});
}

Dataset loadDataset(
    const Config& config,
    const BuiltModel& model,
    DataNeeds needs) {
  checkLossFits(config, model);
  if (config.data.dataset == "fashion-mnist") {
    Dataset data = fashionMnist(config, model, needs);
    if (config.data.evalSamples > 0 &&
        config.data.evalSamples < data.evalInputs.size(0)) {
      data.evalInputs = data.evalInputs.narrow(0, 0, config.data.evalSamples);
      data.evalTargets = data.evalTargets.narrow(0, 0, config.data.evalSamples);
    }
    return data;
  }
  if (config.data.dataset == "text")
    return text(config);
  if (config.data.dataset == "tokens")
    return tokens(config, model);
  if (config.data.dataset == "tensors")
    return tensors(config, model, needs);
  return synthetic(config, model);
}

} // namespace tpipe
