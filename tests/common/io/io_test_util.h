// Helpers for the common/io tests: a scratch directory, whole-file reads and writes, tensors of known bytes.
#pragma once

#include <stdlib.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "common/tensor/tensor.h"
#include "gtest/gtest.h"

namespace shardkit::io::testing {

// A fresh directory under gtest's temp dir, removed with its contents at scope exit.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl = ::testing::TempDir() + "shardkit_io_XXXXXX";
    const char* d = ::mkdtemp(tmpl.data());
    EXPECT_NE(d, nullptr) << "mkdtemp " << tmpl;
    path_ = d ? d : "";
  }
  ~ScratchDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }
  // Names of the directory's entries, sorted.
  std::vector<std::string> listing() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(path_)) out.push_back(e.path().filename().string());
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  std::string path_;
};

inline std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good()) << path;
}

// Element i of a pattern tensor holds the low bytes of ((i + 1) * 0x9E3779B97F4A7C15 + seed) >> 17: arbitrary bit
// patterns (NaNs with payloads, infinities, subnormals, negative zero among them), so a round trip that
// converts instead of copying shows. interop_safetensors.py computes the same values.
inline Tensor PatternTensor(DType dtype, const Shape& shape, std::uint64_t seed) {
  TensorOptions o;
  o.dtype = dtype;
  Tensor t = Tensor::empty(shape, o);
  auto* out = static_cast<unsigned char*>(t.raw_data());
  const std::size_t es = dtype_size(dtype);
  for (std::int64_t i = 0; i < t.numel(); ++i) {
    const std::uint64_t x = ((static_cast<std::uint64_t>(i) + 1) * 0x9E3779B97F4A7C15ull + seed) >> 17;
    std::memcpy(out + static_cast<std::size_t>(i) * es, &x, es);  // little-endian: the low bytes
  }
  return t;
}

inline std::string Bytes(const Tensor& t) {
  if (t.nbytes() == 0) return {};
  return std::string(static_cast<const char*>(t.raw_data()), t.nbytes());
}

inline std::string Bytes(absl::Span<const std::byte> b) {
  return std::string(reinterpret_cast<const char*>(b.data()), b.size());
}

}  // namespace shardkit::io::testing
