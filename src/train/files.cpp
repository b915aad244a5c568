// Checked writes: every byte, the fsync and the close checked; atomic
// replacement of regular files; output paths checked before a run; one
// writer per checkpoint directory (see files.h).
#include "train/files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "tpipe/config.h"
#include "tpipe/errors.h"

namespace tpipe {

namespace fs = std::filesystem;

[[noreturn]] void writeFailed(const fs::path& path, int error) {
  throw WriteFailure(
      "cannot write " + path.string() + ": " + std::strerror(error));
}

void syncDirectory(const fs::path& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0)
    writeFailed(dir, errno);
  const int status = ::fsync(fd);
  const int error = errno;
  ::close(fd);
  if (status != 0)
    writeFailed(dir, error);
}

namespace {

// Every byte to an open descriptor, retrying short writes; closes it and
// throws on failure.
void writeAll(int fd, const fs::path& path, const std::string& bytes) {
  if (fd < 0)
    writeFailed(path, errno);
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR)
      continue;
    if (n <= 0) {
      const int error = n < 0 ? errno : ENOSPC;
      ::close(fd);
      writeFailed(path, error);
    }
    done += static_cast<size_t>(n);
  }
}

} // namespace

// Every byte written or an exception: short writes, fsync and close checked.
void writeChecked(const fs::path& path, const std::string& bytes) {
  const int fd =
      ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  writeAll(fd, path, bytes);
  if (::fsync(fd) != 0) {
    const int error = errno;
    ::close(fd);
    writeFailed(path, error);
  }
  if (::close(fd) != 0)
    writeFailed(path, errno);
}

void writeFileAtomically(
    const std::filesystem::path& path,
    const std::string& bytes) {
  const fs::path temporary = path.string() + ".tmp";
  std::error_code error;
  try {
    writeChecked(temporary, bytes);
  } catch (const WriteFailure&) {
    fs::remove(temporary, error); // a partial file helps no one
    throw;
  }
  fs::rename(temporary, path, error);
  if (error)
    writeFailed(path, error.value());
  syncDirectory(
      path.parent_path().empty() ? fs::path(".") : path.parent_path());
}

namespace {

std::string readLockText(int fd) {
  char text[32] = {0};
  const ssize_t n = ::pread(fd, text, sizeof text - 1, 0);
  std::string pid = n > 0 ? std::string(text, static_cast<size_t>(n)) : "";
  while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' '))
    pid.pop_back();
  return pid;
}

bool isLiveProcess(const std::string& pid) {
  if (pid.empty() || pid.size() > 9 ||
      pid.find_first_not_of("0123456789") != std::string::npos)
    return false;
  return ::kill(static_cast<pid_t>(std::stol(pid)), 0) == 0 || errno == EPERM;
}

// The holder takes the lock and only then writes its PID, so a run that
// loses the race by microseconds can read an empty file, or the PID of the
// dead run before it; it waits briefly for the live holder's PID.
std::string lockHolder(int fd) {
  std::string pid = readLockText(fd);
  for (int tries = 0; tries < 200 && !isLiveProcess(pid); ++tries) {
    ::usleep(10000);
    pid = readLockText(fd);
  }
  return isLiveProcess(pid) ? pid : "unknown";
}

} // namespace

DirectoryLock::DirectoryLock(
    const std::string& dir,
    Mode mode,
    const std::string& flag) {
  const fs::path file = fs::path(dir) / ".tpipe-lock";
  const bool write = mode == Mode::kWrite;
  fd_ = ::open(
      file.c_str(), (write ? O_RDWR | O_CREAT : O_RDONLY) | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    if (!write && errno == ENOENT)
      return; // no run has written there since locks exist
    if (errno == ENOTDIR) {
      throw ConfigError(
          flag + " " + dir +
          ": is a file, not a directory (a checkpoint directory, as train "
          "--save writes)");
    }
    throw ConfigError(
        flag + " " + dir + ": cannot open its lock file " + file.string() +
        " (" + std::strerror(errno) + ")");
  }
  if (::flock(fd_, (write ? LOCK_EX : LOCK_SH) | LOCK_NB) != 0) {
    const int error = errno;
    const std::string holder = lockHolder(fd_);
    ::close(fd_);
    fd_ = -1;
    if (error == EWOULDBLOCK) {
      throw ConfigError(
          flag + " " + dir + ": another run (PID " + holder +
          ") is writing checkpoints there; wait for it to end, or choose "
          "another directory");
    }
    throw ConfigError(
        flag + " " + dir + ": cannot lock it (" + std::strerror(error) + ")");
  }
  if (write) {
    const std::string pid = std::to_string(::getpid()) + "\n";
    if (::pwrite(fd_, pid.data(), pid.size(), 0) !=
            static_cast<ssize_t>(pid.size()) ||
        ::ftruncate(fd_, static_cast<off_t>(pid.size())) != 0) {
      const int error = errno;
      ::close(fd_);
      fd_ = -1;
      throw ConfigError(
          flag + " " + dir + ": cannot write its lock file (" +
          std::strerror(error) + ")");
    }
  }
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0)
    ::close(fd_); // releases the flock
}

bool sameDirectory(const std::string& a, const std::string& b) {
  std::error_code error;
  if (fs::equivalent(a, b, error))
    return true;
  const fs::path left = fs::weakly_canonical(a, error);
  const fs::path right = fs::weakly_canonical(b, error);
  return !error && left == right;
}

namespace {

// Where writing `path` lands: its symlinks followed to their target.
fs::path throughSymlinks(fs::path path) {
  std::error_code error;
  for (int hops = 0; hops < 40 && fs::is_symlink(path, error); ++hops) {
    const fs::path target = fs::read_symlink(path, error);
    if (error)
      break;
    path = target.is_absolute() ? target : path.parent_path() / target;
  }
  return path;
}

// A character device is written as a stream: opened as it is, never
// created, truncated or renamed over.
void streamTo(const fs::path& device, const std::string& bytes) {
  const int fd = ::open(device.c_str(), O_WRONLY | O_CLOEXEC);
  writeAll(fd, device, bytes);
  if (::close(fd) != 0)
    writeFailed(device, errno);
}

// Where `path` lands, symlinks followed, as an absolute path without . or ..
// (the file need not exist).
fs::path landingPlace(const std::string& path) {
  std::error_code error;
  const fs::path target = fs::weakly_canonical(throughSymlinks(path), error);
  return error ? fs::absolute(path, error).lexically_normal() : target;
}

bool isCharacterDevice(const fs::path& path) {
  struct stat info {};
  return ::stat(path.c_str(), &info) == 0 && S_ISCHR(info.st_mode);
}

bool sameFile(const fs::path& a, const fs::path& b) {
  std::error_code error;
  return a == b || fs::equivalent(a, b, error);
}

// `file`'s first component below `dir`, or empty where it is not below it.
fs::path firstComponentBelow(const fs::path& file, const fs::path& dir) {
  const fs::path relative = file.lexically_relative(dir);
  if (relative.empty() || *relative.begin() == "..")
    return {};
  return *relative.begin();
}

bool replaces(const fs::path& output, const RunInput& input) {
  const fs::path source = landingPlace(input.path);
  switch (input.kind) {
    case RunInput::Kind::kFile:
      return sameFile(output, source);
    case RunInput::Kind::kDirectory: {
      std::error_code error;
      return output.parent_path() == source &&
          fs::is_regular_file(output, error);
    }
    case RunInput::Kind::kCheckpoint: {
      const std::string first = firstComponentBelow(output, source).string();
      return first == "checkpoint.json" || first == ".tpipe-lock" ||
          first == "model.pt" || first.rfind("state-", 0) == 0 ||
          first.rfind("rank-", 0) == 0;
    }
  }
  return false;
}

} // namespace

std::vector<RunInput> inputsOf(const Config& config) {
  auto named = [](const std::string& name, const std::string& path) {
    std::error_code error;
    return RunInput{
        name,
        path,
        fs::is_directory(path, error) ? RunInput::Kind::kDirectory
                                      : RunInput::Kind::kFile};
  };
  return {
      named("data.path", config.data.path),
      named("data.eval_path", config.data.evalPath),
      named("model.torchscript", config.model.torchscript)};
}

void refuseOutputsOverInputs(
    const std::vector<RunOutput>& outputs,
    const std::vector<RunInput>& inputs) {
  std::vector<std::pair<const RunOutput*, fs::path>> written;
  for (const RunOutput& output : outputs) {
    if (output.path.empty())
      continue;
    const fs::path target = landingPlace(output.path);
    if (isCharacterDevice(target))
      continue;
    for (const RunInput& input : inputs) {
      if (!input.path.empty() && replaces(target, input)) {
        throw ConfigError(
            output.flag + " " + output.path + ": would replace " +
            (input.kind == RunInput::Kind::kFile ? "" : "a file of ") +
            input.name + " (" + input.path +
            "), which this run reads; name another file");
      }
    }
    for (const auto& [other, place] : written) {
      if (sameFile(target, place)) {
        throw ConfigError(
            output.flag + " " + output.path + ": " + other->flag + " " +
            other->path + " names the same file; name one file each");
      }
    }
    written.emplace_back(&output, target);
  }
}

void checkOutputPath(const std::string& flag, const std::string& path) {
  if (path.empty())
    return;
  const fs::path target = throughSymlinks(path);
  struct stat info {};
  if (::stat(target.c_str(), &info) == 0) {
    if (S_ISDIR(info.st_mode)) {
      throw ConfigError(
          flag + " " + path + ": is a directory; name a file (in it)");
    }
    if (S_ISCHR(info.st_mode)) {
      if (::access(target.c_str(), W_OK) != 0) {
        throw ConfigError(
            flag + " " + path + ": cannot write (" + std::strerror(errno) +
            ")");
      }
      return;
    }
    if (!S_ISREG(info.st_mode)) {
      throw ConfigError(
          flag + " " + path +
          ": is a FIFO, socket or block device; name a regular file (or a "
          "character device such as /dev/stdout)");
    }
  }
  const fs::path parent =
      target.parent_path().empty() ? fs::path(".") : target.parent_path();
  struct stat parentInfo {};
  if (::stat(parent.c_str(), &parentInfo) != 0 ||
      !S_ISDIR(parentInfo.st_mode)) {
    throw ConfigError(
        flag + " " + path + ": its directory " + parent.string() +
        " does not exist");
  }
  if (::access(parent.c_str(), W_OK) != 0) {
    throw ConfigError(
        flag + " " + path + ": cannot write in " + parent.string() + " (" +
        std::strerror(errno) + ")");
  }
}

void writeOutputFile(const std::string& path, const std::string& bytes) {
  const fs::path target = throughSymlinks(path);
  struct stat info {};
  const bool exists = ::stat(target.c_str(), &info) == 0;
  if (exists && !S_ISREG(info.st_mode) && !S_ISCHR(info.st_mode)) {
    throw ConfigError(
        path + " is not a regular file or character device; not replaced");
  }
  // A full disk or a device that refuses is the user's to fix: exit 2.
  try {
    if (exists && S_ISCHR(info.st_mode))
      streamTo(target, bytes);
    else
      writeFileAtomically(target, bytes);
  } catch (const WriteFailure& failure) {
    throw ConfigError(failure.what());
  }
}

} // namespace tpipe
