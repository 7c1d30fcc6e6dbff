// Element types and their scalar conversions.
//
// bf16 and f16 are storage formats: arithmetic on them is done in fp32 (DESIGN.md section 2). The
// conversions from fp32 round to nearest, ties to even; NaN stays NaN, overflow becomes infinity.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace shardkit {

enum class DType : std::uint8_t { f32 = 0, bf16 = 1, f16 = 2, i64 = 3 };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i64: return 8;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "f32";
    case DType::bf16: return "bf16";
    case DType::f16: return "f16";
    case DType::i64: return "i64";
  }
  return "?";
}

constexpr bool is_floating(DType t) { return t != DType::i64; }

// Raw 16-bit storage types: distinct types so overloads and templates can tell them apart.
struct bf16_t {
  std::uint16_t bits;
};
struct f16_t {
  std::uint16_t bits;
};

inline float bf16_to_f32(bf16_t v) { return std::bit_cast<float>(std::uint32_t{v.bits} << 16); }

inline bf16_t f32_to_bf16(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return bf16_t{static_cast<std::uint16_t>((x >> 16) | 0x40u)};
  x += 0x7fffu + ((x >> 16) & 1u);  // round to nearest, ties to even
  return bf16_t{static_cast<std::uint16_t>(x >> 16)};
}

inline float f16_to_f32(f16_t v) {
  const std::uint32_t h = v.bits;
  const std::uint32_t sign = (h & 0x8000u) << 16;
  const std::uint32_t em = h & 0x7fffu;
  std::uint32_t out;
  if (em >= 0x7c00u) {
    out = sign | 0x7f800000u | ((em & 0x3ffu) << 13);  // inf / nan
  } else if (em < 0x400u) {
    // zero or subnormal: value = em * 2^-24, exact in fp32.
    const float mag = static_cast<float>(em) * 5.9604644775390625e-8f;
    out = sign | std::bit_cast<std::uint32_t>(mag);
  } else {
    out = sign | ((em << 13) + 0x38000000u);  // rebias exponent 15 -> 127
  }
  return std::bit_cast<float>(out);
}

inline f16_t f32_to_f16(float f) {
  std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {  // inf or nan (nan keeps a quiet payload bit)
    return f16_t{static_cast<std::uint16_t>(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u))};
  }
  if (x >= 0x477ff000u) return f16_t{static_cast<std::uint16_t>(sign | 0x7c00u)};  // >= 65520: inf
  if (x < 0x38800000u) {
    // Result is subnormal (or zero). Adding 0.5 puts the half's unit (2^-24) in the last place of the
    // fp32 mantissa, so the hardware addition performs the round-to-nearest-even for us.
    const float t = std::bit_cast<float>(x) + 0.5f;
    return f16_t{static_cast<std::uint16_t>(sign | (std::bit_cast<std::uint32_t>(t) - 0x3f000000u))};
  }
  const std::uint32_t odd = (x >> 13) & 1u;
  x += 0xc8000fffu + odd;  // rebias exponent 127 -> 15 and round to nearest even
  return f16_t{static_cast<std::uint16_t>(sign | (x >> 13))};
}

}  // namespace shardkit
