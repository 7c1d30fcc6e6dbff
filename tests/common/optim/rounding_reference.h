// Plain scalar fp32 -> bf16 rounding for the kernel tests, written from the definition (round to nearest,
// ties to even; a NaN keeps its sign and payload and gets the quiet bit) with branches and no bit tricks,
// sharing no code with common/optim or common/tensor.
#pragma once

#include <cstdint>

namespace shardkit::optim::testing {

inline std::uint16_t RefBf16Bits(std::uint32_t f32_bits) {
  const std::uint32_t magnitude = f32_bits & 0x7fffffffu;
  if (magnitude > 0x7f800000u) return static_cast<std::uint16_t>((f32_bits >> 16) | 0x0040u);  // NaN
  std::uint32_t kept = f32_bits >> 16;          // sign, exponent, top 7 mantissa bits
  const std::uint32_t dropped = f32_bits & 0xffffu;
  const bool odd = (kept & 1u) != 0;
  if (dropped > 0x8000u || (dropped == 0x8000u && odd)) ++kept;  // may carry into the exponent: to inf
  return static_cast<std::uint16_t>(kept);
}

}  // namespace shardkit::optim::testing
