// MappedFile: a regular file mapped read-only into memory (the readers of common/io parse in place).
//
// open(path) checks that `path` names a regular file (a FIFO, a device such as /dev/zero or a directory is
// refused: they have no length to validate against) and maps its whole length read-only and private. The
// bytes stay valid for as long as the MappedFile lives; it is move-only and unmaps in its destructor. An
// empty file maps nothing (bytes() is empty).
//
// Symlinks are followed: the files being read (a model downloaded into a Hugging Face cache, say) are often
// symlinks into a blob store. Writers refuse them instead (atomic_file.h).
//
// Note [mapped file truncation]: the mapping shows the file as it is, so a file truncated by another process
// while it is mapped makes a later read of the vanished pages raise SIGBUS. The readers validate every offset
// against the length seen at open(); they cannot defend against a file shrinking underneath them, which is
// the same contract as the reference safetensors implementation (and PyTorch's mmap loads). Do not truncate
// a file that is being read.
//
// Thread-safety: the bytes may be read from any thread; the object itself is not synchronised.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <string>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace shardkit::io {

// What a non-regular file is, for messages: "a directory", "a FIFO", "a character device", "a block device",
// "a socket", else "not a regular file".
const char* file_kind_name(mode_t mode);

class MappedFile {
 public:
  // NotFound when the file does not exist, FailedPrecondition when it is not a regular file or cannot be
  // opened or mapped; every message names the path and what was found.
  static absl::StatusOr<MappedFile> open(const std::string& path);

  MappedFile() = default;
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;
  ~MappedFile();

  absl::Span<const std::byte> bytes() const { return {data_, size_}; }
  std::size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  void unmap();

  const std::byte* data_ = nullptr;
  std::size_t size_ = 0;
  std::string path_;
};

}  // namespace shardkit::io
