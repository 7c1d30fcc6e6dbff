#include "common/optim/finite.h"

#include <algorithm>
#include <bit>

#include "common/kernels/elementwise.h"
#include "common/kernels/reduce.h"

namespace shardkit::optim {
namespace {

constexpr std::int64_t kChunk = 1024;

// Note [finite checks]: the stored bits of each element type and its exponent mask.
inline std::uint32_t bits(float v) { return std::bit_cast<std::uint32_t>(v); }
inline std::uint16_t bits(bf16_t v) { return v.bits; }
inline std::uint16_t bits(f16_t v) { return v.bits; }
template <typename T> constexpr auto kExp = 0;
template <> constexpr std::uint32_t kExp<float> = 0x7f800000u;
template <> constexpr std::uint16_t kExp<bf16_t> = 0x7f80u;
template <> constexpr std::uint16_t kExp<f16_t> = 0x7c00u;

template <typename T>
bool chunk_has_non_finite(const T* p, std::int64_t n) {
  unsigned any = 0;
  for (std::int64_t i = 0; i < n; ++i) any |= static_cast<unsigned>((bits(p[i]) & kExp<T>) == kExp<T>);
  return any != 0;
}

template <typename T>
std::int64_t find_in(const void* data, std::int64_t n) {
  const auto* p = static_cast<const T*>(data);
  for (std::int64_t i = 0; i < n; i += kChunk) {
    const std::int64_t m = std::min(kChunk, n - i);
    if (!chunk_has_non_finite(p + i, m)) continue;
    for (std::int64_t k = 0; k < m; ++k) {
      if ((bits(p[i + k]) & kExp<T>) == kExp<T>) return i + k;
    }
  }
  return -1;
}

// On a device (Note [finite checks]): the largest magnitude, which a NaN or an inf anywhere makes non-finite (the
// device reduction propagates NaN), tested on its bits.
bool device_has_non_finite(const Tensor& t) {
  const double m = kernels::max_abs(t);
  return (std::bit_cast<std::uint64_t>(m) & 0x7ff0000000000000ull) == 0x7ff0000000000000ull;
}

bool has_non_finite(const Tensor& t) {
  return t.device().is_cuda() ? t.dtype() != DType::i64 && device_has_non_finite(t) : find_non_finite(t) >= 0;
}

}  // namespace

std::int64_t find_non_finite(const Tensor& t) {
  SK_CHECK(t.device().is_cpu()) << "find_non_finite on " << t.describe();
  switch (t.dtype()) {
    case DType::f32: return find_in<float>(t.raw_data(), t.numel());
    case DType::bf16: return find_in<bf16_t>(t.raw_data(), t.numel());
    case DType::f16: return find_in<f16_t>(t.raw_data(), t.numel());
    case DType::i64: return -1;
  }
  return -1;
}

bool all_finite(absl::Span<const Tensor> tensors) {
  for (const Tensor& t : tensors) {
    if (t.defined() && has_non_finite(t)) return false;
  }
  return true;
}

bool found_non_finite_grads(absl::Span<const Tensor> params) {
  for (const Tensor& p : params) {
    const Tensor g = p.grad();
    if (g.defined() && has_non_finite(g)) return true;
  }
  return false;
}

bool scale_and_find_non_finite(const Tensor& t, float factor) {
  SK_CHECK(is_floating(t.dtype())) << "scale_and_find_non_finite on " << t.describe();
  if (t.device().is_cuda()) {  // two passes on the device: the check, then the scale
    const bool bad = device_has_non_finite(t);
    kernels::scale_(factor, t);
    return bad;
  }
  const std::int64_t n = t.numel();
  if (t.dtype() == DType::f32) {
    float* p = t.data<float>();
    unsigned bad = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      bad |= static_cast<unsigned>((bits(p[i]) & kExp<float>) == kExp<float>);
      p[i] *= factor;
    }
    return bad != 0;
  }
  // bf16 / f16: check the stored bits, then scale through fp32 a chunk at a time.
  bool bad = false;
  float tmp[kChunk];
  auto* bytes = static_cast<char*>(t.raw_data());
  const auto es = static_cast<std::int64_t>(t.element_size());
  for (std::int64_t i = 0; i < n; i += kChunk) {
    const std::int64_t m = std::min(kChunk, n - i);
    char* chunk = bytes + i * es;
    bad |= t.dtype() == DType::bf16 ? chunk_has_non_finite(reinterpret_cast<const bf16_t*>(chunk), m)
                                    : chunk_has_non_finite(reinterpret_cast<const f16_t*>(chunk), m);
    convert_elements(chunk, t.dtype(), tmp, DType::f32, m);
    for (std::int64_t k = 0; k < m; ++k) tmp[k] *= factor;
    convert_elements(tmp, DType::f32, chunk, t.dtype(), m);
  }
  return bad;
}

}  // namespace shardkit::optim
