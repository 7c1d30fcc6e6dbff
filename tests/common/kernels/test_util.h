// Shared helpers for the kernel tests: random data and the sizes every kernel is checked at.
#pragma once

#include <cstdint>
#include <vector>

#include "common/tensor/random.h"

namespace shardkit::kernels::testing {

// The sizes the Foundation issue asks every kernel to be checked at: empty, one, a short tail, just
// under a reduction block, and just over 2^20 (many blocks plus a tail).
inline const std::vector<std::int64_t>& TestSizes() {
  static const std::vector<std::int64_t> sizes = {0, 1, 7, 1023, (std::int64_t{1} << 20) + 3};
  return sizes;
}

inline std::vector<float> RandomFloats(std::int64_t n, std::uint64_t seed, float lo = -1.f, float hi = 1.f) {
  std::vector<float> v(static_cast<std::size_t>(n));
  Generator gen(seed);
  gen.fill_uniform(v.data(), n, lo, hi);
  return v;
}

}  // namespace shardkit::kernels::testing
