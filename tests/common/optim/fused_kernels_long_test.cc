// Opt-in (label "long"): the bf16 rounding pass of the fused kernels against the plain scalar rounding on
// every one of the 2^32 fp32 bit patterns. The default suite checks every class of input
// (fused_kernels_test.cc); this settles the rest. About 20 s in a Release build.
#include <bit>
#include <cstdint>
#include <vector>

#include "common/optim/fused_kernels.h"
#include "gtest/gtest.h"
#include "rounding_reference.h"

namespace shardkit::optim::testing {
namespace {

TEST(FusedRoundingLongTest, Bf16PassMatchesScalarReferenceOnEveryFloat) {
  constexpr std::uint64_t kChunk = std::uint64_t{1} << 16;
  std::vector<float> src(kChunk);
  std::vector<bf16_t> dst(kChunk);
  for (std::uint64_t base = 0; base < (std::uint64_t{1} << 32); base += kChunk) {
    for (std::uint64_t j = 0; j < kChunk; ++j) src[j] = std::bit_cast<float>(static_cast<std::uint32_t>(base + j));
    fused::round_to_bf16(src.data(), dst.data(), static_cast<std::int64_t>(kChunk));
    for (std::uint64_t j = 0; j < kChunk; ++j) {
      const std::uint32_t bits = static_cast<std::uint32_t>(base + j);
      ASSERT_EQ(dst[j].bits, RefBf16Bits(bits)) << "input bits " << std::hex << bits;
    }
  }
}

}  // namespace
}  // namespace shardkit::optim::testing
