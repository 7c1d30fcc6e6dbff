#include "common/io/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <system_error>
#include <utility>

#include "absl/strings/str_cat.h"

namespace shardkit::io {
namespace {

std::string ErrnoText(int err) { return std::error_code(err, std::generic_category()).message(); }

}  // namespace

const char* file_kind_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

absl::StatusOr<MappedFile> MappedFile::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer before fstat can refuse it.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) {
    const int err = errno;
    const std::string msg = absl::StrCat("cannot open '", path, "' for reading: ", ErrnoText(err));
    return err == ENOENT ? absl::NotFoundError(msg) : absl::FailedPreconditionError(msg);
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return absl::FailedPreconditionError(absl::StrCat("cannot stat '", path, "': ", ErrnoText(err)));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::FailedPreconditionError(
        absl::StrCat("expected '", path, "' to be a regular file, found ", file_kind_name(st.st_mode)));
  }
  MappedFile file;
  file.path_ = path;
  file.size_ = static_cast<std::size_t>(st.st_size);
  if (file.size_ > 0) {
    void* p = ::mmap(nullptr, file.size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      const int err = errno;
      ::close(fd);
      file.size_ = 0;
      return absl::FailedPreconditionError(
          absl::StrCat("cannot map '", path, "' (", st.st_size, " bytes): ", ErrnoText(err)));
    }
    file.data_ = static_cast<const std::byte*>(p);
  }
  ::close(fd);  // the mapping keeps the file
  return file;
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)),
      path_(std::move(other.path_)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    unmap();
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
    path_ = std::move(other.path_);
  }
  return *this;
}

MappedFile::~MappedFile() { unmap(); }

void MappedFile::unmap() {
  if (data_ != nullptr) ::munmap(const_cast<std::byte*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace shardkit::io
