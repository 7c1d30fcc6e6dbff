#include "common/tensor/random.h"

#include <cmath>

namespace shardkit {

std::array<std::uint32_t, 4> philox4x32(std::array<std::uint32_t, 4> c, std::uint64_t key) {
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  std::uint32_t k0 = static_cast<std::uint32_t>(key), k1 = static_cast<std::uint32_t>(key >> 32);
  for (int round = 0; round < 10; ++round) {
    const std::uint64_t p0 = std::uint64_t{kM0} * c[0];
    const std::uint64_t p1 = std::uint64_t{kM1} * c[2];
    c = {static_cast<std::uint32_t>(p1 >> 32) ^ c[1] ^ k0, static_cast<std::uint32_t>(p1),
         static_cast<std::uint32_t>(p0 >> 32) ^ c[3] ^ k1, static_cast<std::uint32_t>(p0)};
    k0 += kW0;
    k1 += kW1;
  }
  return c;
}

std::array<std::uint32_t, 4> Generator::block(std::uint64_t index) const {
  return philox4x32({static_cast<std::uint32_t>(index), static_cast<std::uint32_t>(index >> 32),
                     static_cast<std::uint32_t>(stream_), static_cast<std::uint32_t>(stream_ >> 32)},
                    seed_);
}

namespace {
// 24 random bits -> [0, 1).
inline float unit(std::uint32_t x) { return static_cast<float>(x >> 8) * (1.0f / 16777216.0f); }
}  // namespace

void Generator::fill_uniform(float* out, std::int64_t n, float lo, float hi) {
  const float scale = hi - lo;
  for (std::int64_t i = 0; i < n; i += 4) {
    const auto b = block(offset_++);
    for (std::int64_t j = 0; j < 4 && i + j < n; ++j) out[i + j] = lo + scale * unit(b[j]);
  }
}

void Generator::fill_normal(float* out, std::int64_t n, float mean, float stddev) {
  constexpr double kTwoPi = 6.283185307179586;
  for (std::int64_t i = 0; i < n; i += 2) {
    const auto b = block(offset_++);
    // 53-bit-ish uniforms in (0, 1] from two words each, computed in double for a clean tail.
    const double u1 = (static_cast<double>((std::uint64_t{b[0]} << 21) ^ b[1]) + 1.0) / 9007199254740993.0;
    const double u2 = static_cast<double>((std::uint64_t{b[2]} << 21) ^ b[3]) / 9007199254740992.0;
    const double r = std::sqrt(-2.0 * std::log(u1));
    out[i] = static_cast<float>(mean + stddev * r * std::cos(kTwoPi * u2));
    if (i + 1 < n) out[i + 1] = static_cast<float>(mean + stddev * r * std::sin(kTwoPi * u2));
  }
}

std::uint64_t Generator::next_below(std::uint64_t bound) {
  const auto b = block(offset_++);
  const std::uint64_t x = (std::uint64_t{b[0]} << 32) | b[1];
  return x % bound;
}

}  // namespace shardkit
