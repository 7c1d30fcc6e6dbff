// Branch-free, vectorisable widening of the storage dtypes to fp32 for the CPU kernels' inner loops.
// Same values as bf16_to_f32 / f16_to_f32 in common/tensor/dtype.h for every input (tested exhaustively),
// written so gcc's vectoriser can turn them into shifts, a multiply and a blend.
#pragma once

#include <bit>
#include <cstdint>

#include "common/tensor/dtype.h"

namespace shardkit::kernels {

inline float widen(float v) { return v; }

inline float widen(bf16_t v) { return std::bit_cast<float>(std::uint32_t{v.bits} << 16); }

// Note [f16 widening]: placing the f16 exponent and mantissa at fp32's bit positions (<< 13) gives an
// fp32 whose exponent is biased by 127 instead of 15; multiplying by 2^112 fixes the bias exactly, for
// normal and subnormal halves alike (an f16 subnormal lands on an fp32 subnormal, scaled into the normal
// range exactly). Only inf/NaN (exponent all ones) need a select.
inline float widen(f16_t v) {
  const std::uint32_t h = v.bits;
  const std::uint32_t sign = (h & 0x8000u) << 16;
  const std::uint32_t em = (h & 0x7fffu) << 13;
  const float mag = std::bit_cast<float>(em) * 0x1p112f;
  const std::uint32_t finite = std::bit_cast<std::uint32_t>(mag);
  const std::uint32_t special = 0x7f800000u | (em & 0x007fe000u);
  return std::bit_cast<float>(sign | (em >= (0x7c00u << 13) ? special : finite));
}

}  // namespace shardkit::kernels
