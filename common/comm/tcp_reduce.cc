#include "common/comm/tcp_reduce.h"

#include <algorithm>
#include <cstdint>

#include "common/base/check.h"

namespace shardkit::comm::tcp_reduce {
namespace {

template <typename T>
inline T apply(T a, T b, ReduceKind kind) {
  switch (kind) {
    case ReduceKind::min: return std::min(a, b);
    case ReduceKind::max: return std::max(a, b);
    default: return a + b;
  }
}

// Plain typed loops (vectorised by the compiler for f32 / i64).
template <typename T>
void combine_restrict(T* __restrict d, const T* __restrict a, const T* __restrict s, std::size_t n, ReduceKind kind) {
  switch (kind) {
    case ReduceKind::min:
      for (std::size_t i = 0; i < n; ++i) d[i] = std::min(a[i], s[i]);
      break;
    case ReduceKind::max:
      for (std::size_t i = 0; i < n; ++i) d[i] = std::max(a[i], s[i]);
      break;
    default:
      for (std::size_t i = 0; i < n; ++i) d[i] = a[i] + s[i];
      break;
  }
}

template <typename T>
void combine_inplace(T* __restrict d, const T* __restrict s, std::size_t n, ReduceKind kind) {
  switch (kind) {
    case ReduceKind::min:
      for (std::size_t i = 0; i < n; ++i) d[i] = std::min(d[i], s[i]);
      break;
    case ReduceKind::max:
      for (std::size_t i = 0; i < n; ++i) d[i] = std::max(d[i], s[i]);
      break;
    default:
      for (std::size_t i = 0; i < n; ++i) d[i] = d[i] + s[i];
      break;
  }
}

// `d` is either exactly `a` or disjoint from it (separate restrict-qualified loops so both vectorise).
template <typename T>
void combine_native(T* d, const T* a, const T* s, std::size_t n, ReduceKind kind, int divide_by) {
  if (d == a) {
    combine_inplace(d, s, n, kind);
  } else {
    combine_restrict(d, a, s, n, kind);
  }
  if (divide_by > 0) {
    const T div = static_cast<T>(divide_by);
    for (std::size_t i = 0; i < n; ++i) d[i] = d[i] / div;
  }
}

template <typename H, typename ToF, typename FromF>
void combine_half(H* d, const H* a, const H* s, std::size_t n, ReduceKind kind, int divide_by, ToF to_f, FromF from_f) {
  const float div = divide_by > 0 ? static_cast<float>(divide_by) : 1.0f;
  for (std::size_t i = 0; i < n; ++i) {
    float v = apply(to_f(a[i]), to_f(s[i]), kind);
    if (divide_by > 0) v = v / div;
    d[i] = from_f(v);
  }
}

}  // namespace

void combine(void* out, const void* a, const void* b, std::size_t count, DType dtype, ReduceKind kind,
             int divide_by) {
  switch (dtype) {
    case DType::f32:
      combine_native(static_cast<float*>(out), static_cast<const float*>(a), static_cast<const float*>(b), count, kind,
                     divide_by);
      return;
    case DType::i64:
      combine_native(static_cast<std::int64_t*>(out), static_cast<const std::int64_t*>(a),
                     static_cast<const std::int64_t*>(b), count, kind, divide_by);
      return;
    case DType::bf16:
      combine_half(static_cast<bf16_t*>(out), static_cast<const bf16_t*>(a), static_cast<const bf16_t*>(b), count,
                   kind, divide_by, bf16_to_f32, f32_to_bf16);
      return;
    case DType::f16:
      combine_half(static_cast<f16_t*>(out), static_cast<const f16_t*>(a), static_cast<const f16_t*>(b), count, kind,
                   divide_by, f16_to_f32, f32_to_f16);
      return;
  }
  SK_CHECK(false) << "unknown dtype " << static_cast<int>(dtype);
}

void scale(void* data, std::size_t count, DType dtype, double factor) {
  switch (dtype) {
    case DType::f32: {
      auto* d = static_cast<float*>(data);
      const float f = static_cast<float>(factor);
      for (std::size_t i = 0; i < count; ++i) d[i] *= f;
      return;
    }
    case DType::i64: {
      auto* d = static_cast<std::int64_t*>(data);
      const auto f = static_cast<std::int64_t>(factor);
      for (std::size_t i = 0; i < count; ++i) d[i] *= f;
      return;
    }
    case DType::bf16: {
      auto* d = static_cast<bf16_t*>(data);
      const float f = static_cast<float>(factor);
      for (std::size_t i = 0; i < count; ++i) d[i] = f32_to_bf16(bf16_to_f32(d[i]) * f);
      return;
    }
    case DType::f16: {
      auto* d = static_cast<f16_t*>(data);
      const float f = static_cast<float>(factor);
      for (std::size_t i = 0; i < count; ++i) d[i] = f32_to_f16(f16_to_f32(d[i]) * f);
      return;
    }
  }
  SK_CHECK(false) << "unknown dtype " << static_cast<int>(dtype);
}

}  // namespace shardkit::comm::tcp_reduce
