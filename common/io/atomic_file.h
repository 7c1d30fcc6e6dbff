// AtomicFileWriter: write a file so that readers see either the old file or the complete new one.
//
// Note [atomic replace]: the bytes go to a fresh temporary file in the destination's directory
// ("<path>.tmp-<pid>-<16 hex digits>", created with O_EXCL | O_NOFOLLOW, so a file or symlink planted under
// that name is never written through), then commit() flushes them (fsync), renames the temporary over
// `path` (rename(2) is atomic within one file system, and replaces a symlink at `path` rather than writing
// to its target) and fsyncs the directory so the rename survives a crash. A writer that is destroyed
// without a successful commit() removes its temporary file: a failed or abandoned write leaves the previous
// file untouched. The checkpoint writers of common/io use the same primitive.
//
// Thread-safety: one writer belongs to one thread; different writers (different paths) are independent.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace shardkit::io {

class AtomicFileWriter {
 public:
  // Creates the temporary file. FailedPrecondition naming the path and the reason (missing directory,
  // permission denied, ...) when it cannot.
  static absl::StatusOr<AtomicFileWriter> create(const std::string& path);

  AtomicFileWriter(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter& operator=(AtomicFileWriter&& other) noexcept;
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  ~AtomicFileWriter();

  // Appends bytes (buffered). ResourceExhausted / FailedPrecondition with the reason (disk full, ...).
  absl::Status write(absl::Span<const std::byte> bytes);
  absl::Status write(std::string_view text);
  // Hands the buffered bytes to the kernel (no fsync): after it, they are in the temporary file even if the
  // process is killed. Errors as write().
  absl::Status flush();

  // Flushes, fsyncs, renames over the destination and fsyncs its directory. The writer is finished
  // afterwards whatever the outcome (on error the temporary file is removed and `path` is unchanged).
  absl::Status commit();

  const std::string& path() const { return path_; }
  const std::string& temp_path() const { return temp_path_; }

 private:
  AtomicFileWriter(std::string path, std::string temp_path, int fd);
  absl::Status write_all(const std::byte* data, std::size_t n);
  absl::Status flush_buffer();
  void abandon();

  std::string path_;
  std::string temp_path_;
  int fd_ = -1;
  std::vector<std::byte> buffer_;
};

}  // namespace shardkit::io
