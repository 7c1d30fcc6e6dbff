#include "common/base/copy_bytes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace shardkit {
namespace {

// Every pair of source and destination offsets within a cache line, at sizes around the thresholds copy_bytes
// switches at (2 KiB, the 256-byte loop step, 64-byte lines): the destination holds exactly the source's bytes,
// and not one byte before or after it changes.
// Both copies: the one copy_bytes picks on this CPU, and the line-aligned loop, which only some CPUs pick.
class CopyBytesExactness : public ::testing::TestWithParam<void (*)(void*, const void*, std::size_t)> {};

TEST_P(CopyBytesExactness, CopiesExactlyTheBytesAtEveryRelativeOffset) {
  const auto copy = GetParam();
  constexpr std::size_t kGuard = 128;
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{63}, std::size_t{2047}, std::size_t{2048},
                              std::size_t{2049}, std::size_t{2048 + 255}, std::size_t{70001}}) {
    std::vector<std::uint8_t> src(n + 2 * kGuard);
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 131 + 7);
    std::vector<std::uint8_t> dst(n + 2 * kGuard);
    for (std::size_t so = 0; so < 64; so += 4) {
      for (std::size_t d_off = 0; d_off < 64; ++d_off) {
        std::fill(dst.begin(), dst.end(), std::uint8_t{0xA5});
        copy(dst.data() + kGuard / 2 + d_off, src.data() + kGuard / 2 + so, n);
        for (std::size_t i = 0; i < dst.size(); ++i) {
          const std::size_t at = kGuard / 2 + d_off;
          const std::uint8_t want = i >= at && i < at + n ? src[kGuard / 2 + so + (i - at)] : std::uint8_t{0xA5};
          ASSERT_EQ(dst[i], want) << "n " << n << ", source offset " << so << ", destination offset " << d_off
                                  << ", byte " << i;
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Copies, CopyBytesExactness, ::testing::Values(&copy_bytes, &copy_bytes_line_aligned),
                         [](const auto& info) { return info.index == 0 ? "copy_bytes" : "line_aligned"; });

// The loop is for the CPUs measured to need it (AMD family 25, Zen 3 / Zen 4); Zen 5 (family 26) was measured to
// copy faster with memcpy; other vendors and unknown CPUs keep memcpy.
TEST(CopyPathFor, PicksTheLineAlignedLoopOnlyForAmdFamily25) {
  EXPECT_EQ(copy_path_for({.vendor = "AuthenticAMD", .family = 25}), CopyPath::line_aligned);
  EXPECT_EQ(copy_path_for({.vendor = "AuthenticAMD", .family = 26}), CopyPath::memcpy);
  EXPECT_EQ(copy_path_for({.vendor = "AuthenticAMD", .family = 23}), CopyPath::memcpy);
  EXPECT_EQ(copy_path_for({.vendor = "GenuineIntel", .family = 6}), CopyPath::memcpy);
  EXPECT_EQ(copy_path_for({.vendor = "GenuineIntel", .family = 25}), CopyPath::memcpy);
  EXPECT_EQ(copy_path_for({}), CopyPath::memcpy);
}

// CPUID on x86 names a vendor and a family; the family is the displayed one (never the raw 15 that hides an
// extended family on AMD).
TEST(ThisCpu, ReadsVendorAndDisplayedFamily) {
#if defined(__x86_64__)
  const CpuIdentity cpu = this_cpu();
  EXPECT_EQ(cpu.vendor.size(), 12u) << cpu.vendor;
  EXPECT_GT(cpu.family, 0u);
  if (cpu.vendor == "AuthenticAMD") {
    EXPECT_GT(cpu.family, 15u);
  }
#else
  GTEST_SKIP() << "CPUID is read on x86-64 only";
#endif
}

}  // namespace
}  // namespace shardkit
