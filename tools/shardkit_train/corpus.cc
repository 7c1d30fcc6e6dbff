#include "tools/shardkit_train/corpus.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/tensor/random.h"

namespace shardkit::train {

std::uint64_t fnv1a64(const void* data, std::size_t n, std::uint64_t h) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

absl::StatusOr<Corpus> load_corpus(const std::string& path, std::int64_t context) {
  Corpus c;
  if (path.empty()) {
    c.bytes = std::string(embedded_corpus());
    c.source = "embedded";
  } else {
    if (std::error_code ec; std::filesystem::is_directory(path, ec)) {
      return absl::InvalidArgumentError(absl::StrCat("expected --data to name a file, found the directory '", path, "'"));
    }
    std::ifstream in(path, std::ios::binary);
    if (!in) {
      return absl::NotFoundError(absl::StrCat("cannot read data file '", path, "': ", std::strerror(errno)));
    }
    std::ostringstream ss;
    ss << in.rdbuf();
    c.bytes = ss.str();
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
