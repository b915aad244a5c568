// Files that must not be lost or half-written, and paths the user names.
//
// Every write that matters goes through writeChecked (each short write, the
// fsync and the close checked) and, for a file that replaces another,
// writeFileAtomically (a temporary beside it, renamed over it, the directory
// fsync'ed): readers see the old file or the new one. A failure throws
// WriteFailure naming the path and the reason.
#pragma once

#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

namespace tpipe {

struct Config;

class WriteFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

[[noreturn]] void writeFailed(const std::filesystem::path& path, int error);
void syncDirectory(const std::filesystem::path& dir);
void writeChecked(const std::filesystem::path& path, const std::string& bytes);
void writeFileAtomically(
    const std::filesystem::path& path,
    const std::string& bytes);

// One writer per checkpoint directory: an exclusive flock on DIR/.tpipe-lock,
// held while the object lives and released by the kernel when the process
// dies, so a dead holder leaves nothing behind. A second writer is refused
// (ConfigError) naming the holder's PID; kRead (a shared lock) refuses to
// read a directory while another run writes it.
class DirectoryLock {
 public:
  enum class Mode { kWrite, kRead };
  DirectoryLock(const std::string& dir, Mode mode, const std::string& flag);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

// Whether two directory arguments name one directory (`d` and `d/`, or a
// symlink to it), not whether they are spelled alike.
bool sameDirectory(const std::string& a, const std::string& b);

// Output files the user names (--trace, --timeline, --report, --metrics):
// checked before a run (a directory, a missing parent, a FIFO or an
// unwritable place throws ConfigError naming `flag`), and written so that a
// regular file is replaced atomically, a symlink is written through to its
// target, and a character device (/dev/stdout, /dev/null) is streamed to,
// never replaced. A failed write throws ConfigError with the reason.
void checkOutputPath(const std::string& flag, const std::string& path);
void writeOutputFile(const std::string& path, const std::string& bytes);

// What a run reads, which none of its outputs may replace: a file (the
// config, data.path, a scripted model, a profile, --input), a directory of
// files (fashion-mnist's data.path: the files in it), or a checkpoint
// directory (its checkpoint.json, model.pt, lock, state-* and rank-* files;
// other files in it, such as metrics kept beside the checkpoint, are the
// user's).
struct RunInput {
  enum class Kind { kFile, kDirectory, kCheckpoint };
  std::string name; // the flag or key that named it: "data.path", "--resume"
  std::string path; // empty: none
  Kind kind = Kind::kFile;
};

// The files a config names: data.path, data.eval_path, model.torchscript.
std::vector<RunInput> inputsOf(const Config& config);

// An output flag and the path it names; empty: none.
struct RunOutput {
  std::string flag;
  std::string path;
};

// Throws ConfigError, naming both flags, where an output would replace an
// input, however the two are spelled (relative, through symlinks, hard
// links), or where two outputs name one file. Character devices
// (/dev/stdout, /dev/null) are streamed to, never replaced, and pass.
void refuseOutputsOverInputs(
    const std::vector<RunOutput>& outputs,
    const std::vector<RunInput>& inputs);

} // namespace tpipe
