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

namespace tpipe {

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

} // namespace tpipe
