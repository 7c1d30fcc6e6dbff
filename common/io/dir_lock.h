// DirectoryLock: one writer per directory, across processes.
//
// Note [directory lock]
// A writer takes an exclusive flock(2) on "<dir>/.lock" (created if missing, opened with O_NOFOLLOW: a
// symlink planted there is refused, never followed) and writes its pid into it. The lock belongs to the open
// file, so it is released when the holder closes it or dies (also on SIGKILL): a crashed run never leaves a
// stale lock behind, and the pid in the file is only informative. flock conflicts between two opens of the
// same file even inside one process, so two writers that are threads of one process exclude each other too.
// The lock does not stop a writer that does not take it; every writer of common/io's checkpoints does.
//
// Thread-safety: one DirectoryLock object belongs to one thread; movable, not copyable.
#pragma once

#include <string>

#include "absl/status/statusor.h"

namespace shardkit::io {

class DirectoryLock {
 public:
  // The lock file's name inside the directory.
  static constexpr char kFileName[] = ".lock";

  // Takes the lock on `dir` (which must exist) without waiting. FailedPrecondition when another writer
  // holds it: "checkpoint directory 'd' is in use by another run (pid 1234 holds 'd/.lock')" (the pid when
  // the file names one); FailedPrecondition naming the path and the reason when the lock file cannot be
  // opened (a symlink: "Too many levels of symbolic links", permission denied, ...) or is not a regular file.
  static absl::StatusOr<DirectoryLock> acquire(const std::string& dir);

  DirectoryLock(DirectoryLock&& other) noexcept;
  DirectoryLock& operator=(DirectoryLock&& other) noexcept;
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  ~DirectoryLock();  // releases the lock (the file stays)

  const std::string& dir() const { return dir_; }

 private:
  DirectoryLock(std::string dir, int fd) : dir_(std::move(dir)), fd_(fd) {}
  std::string dir_;
  int fd_ = -1;
};

}  // namespace shardkit::io
