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
TEST(CopyBytes, CopiesExactlyTheBytesAtEveryRelativeOffset) {
  constexpr std::size_t kGuard = 128;
  for (const std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{63}, std::size_t{2047}, std::size_t{2048},
                              std::size_t{2049}, std::size_t{2048 + 255}, std::size_t{70001}}) {
    std::vector<std::uint8_t> src(n + 2 * kGuard);
    for (std::size_t i = 0; i < src.size(); ++i) src[i] = static_cast<std::uint8_t>(i * 131 + 7);
    std::vector<std::uint8_t> dst(n + 2 * kGuard);
    for (std::size_t so = 0; so < 64; so += 4) {
      for (std::size_t d_off = 0; d_off < 64; ++d_off) {
        std::fill(dst.begin(), dst.end(), std::uint8_t{0xA5});
        copy_bytes(dst.data() + kGuard / 2 + d_off, src.data() + kGuard / 2 + so, n);
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

}  // namespace
}  // namespace shardkit
