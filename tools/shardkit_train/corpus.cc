#include "tools/shardkit_train/corpus.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/io/mapped_file.h"
#include "common/tensor/random.h"
#include "tools/shardkit_train/options.h"

namespace shardkit::train {

std::uint64_t fnv1a64(const void* data, std::size_t n, std::uint64_t h) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

namespace {

// Note [--data bounds]: the file is opened without blocking (a FIFO with no writer would block open() forever),
// then fstat of the opened descriptor decides (no race with a path swapped after a check): a regular file of at
// most kMaxDataBytes, read whole; a size that changes while it is read is an error.
absl::StatusOr<std::string> read_data_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return absl::NotFoundError(absl::StrCat("cannot read data file '", path, "': ", std::strerror(errno)));
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    return absl::NotFoundError(absl::StrCat("cannot read data file '", path, "': ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected --data to name a regular file, found ", io::file_kind_name(st.st_mode), ": '", path, "'"));
  }
  if (st.st_size > kMaxDataBytes) {
    return absl::InvalidArgumentError(absl::StrCat("expected a data file of at most ", kMaxDataBytes,
                                                   " bytes (1 GiB; it is read whole), found ", st.st_size,
                                                   " bytes in '", path, "'"));
  }
  std::string bytes(static_cast<std::size_t>(st.st_size), '\0');
  std::size_t got = 0;
  while (got < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + got, bytes.size() - got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return absl::DataLossError(absl::StrCat("reading data file '", path, "': ", std::strerror(errno)));
    if (n == 0) break;
    got += static_cast<std::size_t>(n);
  }
  char extra;
  if (got != bytes.size() || ::read(fd, &extra, 1) > 0) {
    return absl::DataLossError(absl::StrCat("data file '", path, "' changed size while it was read (", st.st_size,
                                            " bytes when opened)"));
  }
  return bytes;
}

}  // namespace

absl::StatusOr<Corpus> load_corpus(const std::string& path, std::int64_t context) {
  Corpus c;
  if (path.empty()) {
    c.bytes = std::string(embedded_corpus());
    c.source = "embedded";
  } else {
    auto bytes = read_data_file(path);
    if (!bytes.ok()) return bytes.status();
    c.bytes = std::move(*bytes);
    c.source = path;
    if (c.bytes.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("expected a non-empty data file, found 0 bytes in '", path, "'"));
    }
  }
  if (static_cast<std::int64_t>(c.bytes.size()) < context + 2) {
    return absl::InvalidArgumentError(absl::StrCat("expected at least ", context + 2, " bytes of data (one window of the model's context + 1), found ",
                                                   c.bytes.size(), " in '", c.source, "'"));
  }
  c.fingerprint = fnv1a64(c.bytes.data(), c.bytes.size());
  return c;
}

std::pair<Tensor, Tensor> batch(const Corpus& corpus, std::uint64_t seed, std::int64_t step, int rank, int world,
                                std::int64_t rows, std::int64_t context) {
  Generator gen(seed, 1'000'000 + static_cast<std::uint64_t>(step));
  const std::uint64_t positions = corpus.bytes.size() - static_cast<std::uint64_t>(context);  // windows of context+1
  std::vector<std::int64_t> x, y;
  x.reserve(static_cast<std::size_t>(rows * context));
  y.reserve(static_cast<std::size_t>(rows * context));
  for (std::int64_t r = 0; r < rows * world; ++r) {
    const std::uint64_t start = gen.next_below(positions);
    if (r / rows != rank) continue;
    for (std::int64_t t = 0; t < context; ++t) {
      x.push_back(static_cast<unsigned char>(corpus.bytes[start + static_cast<std::uint64_t>(t)]));
      y.push_back(static_cast<unsigned char>(corpus.bytes[start + static_cast<std::uint64_t>(t) + 1]));
    }
  }
  return {Tensor::from_int64(x, {rows, context}), Tensor::from_int64(y, {rows, context})};
}

}  // namespace shardkit::train
