#include "common/io/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"

namespace shardkit::io {
namespace {

std::string ErrnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

// The pid the holder wrote, or "" (a holder between open and write, or a file of something else).
std::string HolderPid(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return "";
  const std::string text(absl::StripAsciiWhitespace(absl::string_view(buf, static_cast<std::size_t>(n))));
  long pid = 0;
  return absl::SimpleAtoi(text, &pid) && pid > 0 ? text : "";
}

}  // namespace

absl::StatusOr<DirectoryLock> DirectoryLock::acquire(const std::string& dir) {
  const std::string path = absl::StrCat(dir, "/", kFileName);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK, 0644);
  if (fd < 0) {
    const int err = errno;
    return absl::FailedPreconditionError(absl::StrCat("cannot open the lock file '", path, "' of checkpoint directory '",
                                                      dir, "': ", ErrnoText(err)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat("cannot use the lock file '", path, "' of checkpoint directory '",
                                                      dir, "': expected a regular file, found another kind"));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    const std::string pid = err == EWOULDBLOCK ? HolderPid(fd) : "";
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return absl::FailedPreconditionError(absl::StrCat("checkpoint directory '", dir, "' is in use by another run (",
                                                        pid.empty() ? "a process" : "pid " + pid, " holds '", path,
                                                        "')"));
    }
    return absl::FailedPreconditionError(absl::StrCat("cannot lock '", path, "': ", ErrnoText(err)));
  }
  // Informative only (Note [directory lock]); a failure to record the pid does not matter.
  const std::string pid = absl::StrCat(::getpid(), "\n");
  if (::ftruncate(fd, 0) == 0) (void)!::pwrite(fd, pid.data(), pid.size(), 0);
  return DirectoryLock(dir, fd);
}

DirectoryLock::DirectoryLock(DirectoryLock&& other) noexcept
    : dir_(std::move(other.dir_)), fd_(std::exchange(other.fd_, -1)) {}

DirectoryLock& DirectoryLock::operator=(DirectoryLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    dir_ = std::move(other.dir_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);
}

}  // namespace shardkit::io
