#include "common/io/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <random>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardkit::io {
namespace {

constexpr std::size_t kBufferBytes = std::size_t{1} << 20;

std::string ErrnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

std::string DirectoryOf(const std::string& path) {
  const std::size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

absl::StatusOr<AtomicFileWriter> AtomicFileWriter::create(const std::string& path) {
  if (path.empty() || path.back() == '/') {
    return absl::InvalidArgumentError(absl::StrCat("expected a file path to write, found '", path, "'"));
  }
  std::random_device rd;
  for (int attempt = 0;; ++attempt) {
    const std::uint64_t tag = (std::uint64_t{rd()} << 32) ^ rd();
    std::string temp = absl::StrFormat("%s.tmp-%d-%016x", path, static_cast<int>(::getpid()), tag);
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd >= 0) return AtomicFileWriter(path, std::move(temp), fd);
    const int err = errno;
    if (err == EEXIST && attempt < 8) continue;  // a name collision (or a planted file): draw another name
    return absl::FailedPreconditionError(absl::StrCat("cannot create '", temp, "' to write '", path, "': ", ErrnoText(err)));
  }
}

AtomicFileWriter::AtomicFileWriter(std::string path, std::string temp_path, int fd)
    : path_(std::move(path)), temp_path_(std::move(temp_path)), fd_(fd) {
  buffer_.reserve(kBufferBytes);
}

AtomicFileWriter::AtomicFileWriter(AtomicFileWriter&& other) noexcept
    : path_(std::move(other.path_)),
      temp_path_(std::move(other.temp_path_)),
      fd_(std::exchange(other.fd_, -1)),
      buffer_(std::move(other.buffer_)) {}

AtomicFileWriter& AtomicFileWriter::operator=(AtomicFileWriter&& other) noexcept {
  if (this != &other) {
    abandon();
    path_ = std::move(other.path_);
    temp_path_ = std::move(other.temp_path_);
    fd_ = std::exchange(other.fd_, -1);
    buffer_ = std::move(other.buffer_);
  }
  return *this;
}

AtomicFileWriter::~AtomicFileWriter() { abandon(); }

void AtomicFileWriter::abandon() {
  if (fd_ < 0) return;
  ::close(fd_);
  ::unlink(temp_path_.c_str());
  fd_ = -1;
}

absl::Status AtomicFileWriter::write_all(const std::byte* data, std::size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(fd_, data, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = w < 0 ? errno : ENOSPC;
      const std::string msg = absl::StrCat("cannot write '", temp_path_, "' (for '", path_, "'): ", ErrnoText(err));
      abandon();
      return err == ENOSPC || err == EDQUOT ? absl::ResourceExhaustedError(msg) : absl::FailedPreconditionError(msg);
    }
    data += w;
    n -= static_cast<std::size_t>(w);
  }
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::flush_buffer() {
  if (buffer_.empty()) return absl::OkStatus();
  absl::Status s = write_all(buffer_.data(), buffer_.size());
  buffer_.clear();
  return s;
}

absl::Status AtomicFileWriter::write(absl::Span<const std::byte> bytes) {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat("write to '", path_, "' after it was finished"));
  if (buffer_.size() + bytes.size() <= kBufferBytes) {
    buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
    return absl::OkStatus();
  }
  if (absl::Status s = flush_buffer(); !s.ok()) return s;
  if (bytes.size() >= kBufferBytes) return write_all(bytes.data(), bytes.size());
  buffer_.insert(buffer_.end(), bytes.begin(), bytes.end());
  return absl::OkStatus();
}

absl::Status AtomicFileWriter::flush() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat("flush of '", path_, "' after it was finished"));
  return flush_buffer();
}

absl::Status AtomicFileWriter::write(std::string_view text) {
  return write(absl::Span<const std::byte>(reinterpret_cast<const std::byte*>(text.data()), text.size()));
}

absl::Status AtomicFileWriter::commit() {
  if (fd_ < 0) return absl::FailedPreconditionError(absl::StrCat("commit of '", path_, "' after it was finished"));
  if (absl::Status s = flush_buffer(); !s.ok()) return s;
  if (::fsync(fd_) != 0) {
    const int err = errno;
    abandon();
    return absl::FailedPreconditionError(absl::StrCat("cannot flush '", temp_path_, "' to disk: ", ErrnoText(err)));
  }
  const int fd = std::exchange(fd_, -1);
  if (::close(fd) != 0) {
    const int err = errno;
    ::unlink(temp_path_.c_str());
    return absl::FailedPreconditionError(absl::StrCat("cannot close '", temp_path_, "': ", ErrnoText(err)));
  }
  if (::rename(temp_path_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    ::unlink(temp_path_.c_str());
    return absl::FailedPreconditionError(
        absl::StrCat("cannot rename '", temp_path_, "' to '", path_, "': ", ErrnoText(err)));
  }
  // Make the rename durable. Some file systems refuse fsync on a directory (EINVAL): nothing more to do there.
  const std::string dir = DirectoryOf(path_);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    const int rc = ::fsync(dfd);
    const int err = errno;
    ::close(dfd);
    if (rc != 0 && err != EINVAL) {
      return absl::FailedPreconditionError(
          absl::StrCat("wrote '", path_, "' but cannot flush its directory '", dir, "': ", ErrnoText(err)));
    }
  }
  return absl::OkStatus();
}

}  // namespace shardkit::io
