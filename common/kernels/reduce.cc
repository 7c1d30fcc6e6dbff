#include "common/kernels/reduce.h"

#include <algorithm>
#include <bit>
#include <limits>

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/widen.h"

namespace shardkit::kernels {
namespace {

constexpr int kLanes = 16;
static_assert(kReduceBlock % kLanes == 0);

// One block (len <= kReduceBlock) summed in kLanes fp32 lanes, lanes added in double.
// See Note [reduction accuracy] in reduce.h.
template <bool kSquare, typename T>
double BlockSum(const T* __restrict x, std::int64_t len) {
  float acc[kLanes] = {};
  const std::int64_t full = len - len % kLanes;
  for (std::int64_t i = 0; i < full; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const float v = widen(x[i + j]);
      acc[j] += kSquare ? v * v : v;
    }
  }
  for (std::int64_t i = full; i < len; ++i) {
    const float v = widen(x[i]);
    acc[i - full] += kSquare ? v * v : v;
  }
  double s = 0;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  return s;
}

template <bool kSquare, typename T>
double SumImpl(const T* x, std::int64_t n) {
  double total = 0;
  for (std::int64_t start = 0; start < n; start += kReduceBlock) {
    total += BlockSum<kSquare>(x + start, std::min(kReduceBlock, n - start));
  }
  return total;
}

// Note [max_abs on bits]: for IEEE values with the sign bit cleared, unsigned-integer order is magnitude
// order, and every NaN pattern is above +inf. So max |x| is a max over integers (vectorises to one
// instruction per vector, no NaN special case in the loop), and the result is NaN iff it is above inf.
template <typename Bits>
Bits MaxAbsBits(const Bits* __restrict x, std::int64_t n, Bits abs_mask) {
  Bits m[kLanes] = {};
  const std::int64_t full = n - n % kLanes;
  for (std::int64_t i = 0; i < full; i += kLanes) {
    for (int j = 0; j < kLanes; ++j) {
      const Bits v = static_cast<Bits>(x[i + j] & abs_mask);
      m[j] = v > m[j] ? v : m[j];
    }
  }
  for (std::int64_t i = full; i < n; ++i) {
    const Bits v = static_cast<Bits>(x[i] & abs_mask);
    m[i - full] = v > m[i - full] ? v : m[i - full];
  }
  Bits r = 0;
  for (int j = 0; j < kLanes; ++j) r = std::max(r, m[j]);
  return r;
}

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

enum class Op { sum, sum_squares, max_abs };

double Reduce(const Tensor& x, Op op) {
  SK_CHECK(is_floating(x.dtype())) << "reduction of a non-floating tensor " << x.describe();
  if (x.numel() == 0) return 0.0;
  if (x.device().is_cuda()) {
    switch (op) {
      case Op::sum: return cuda::sum(x.device(), x.raw_data(), x.dtype(), x.numel());
      case Op::sum_squares: return cuda::sum_squares(x.device(), x.raw_data(), x.dtype(), x.numel());
      case Op::max_abs: return cuda::max_abs(x.device(), x.raw_data(), x.dtype(), x.numel());
    }
  }
  const void* p = x.raw_data();
  const std::int64_t n = x.numel();
  switch (x.dtype()) {
    case DType::f32: {
      const auto* t = static_cast<const float*>(p);
      return op == Op::sum ? sum(t, n) : op == Op::sum_squares ? sum_squares(t, n) : max_abs(t, n);
    }
    case DType::bf16: {
      const auto* t = static_cast<const bf16_t*>(p);
      return op == Op::sum ? sum(t, n) : op == Op::sum_squares ? sum_squares(t, n) : max_abs(t, n);
    }
    case DType::f16: {
      const auto* t = static_cast<const f16_t*>(p);
      return op == Op::sum ? sum(t, n) : op == Op::sum_squares ? sum_squares(t, n) : max_abs(t, n);
    }
    case DType::i64: break;
  }
  SK_CHECK(false) << "unreachable dtype in reduction of " << x.describe();
  return 0.0;
}

}  // namespace

double sum(const Tensor& x) { return Reduce(x, Op::sum); }
double sum_squares(const Tensor& x) { return Reduce(x, Op::sum_squares); }
double max_abs(const Tensor& x) { return Reduce(x, Op::max_abs); }

double sum(const float* x, std::int64_t n) { return SumImpl<false>(x, n); }
double sum_squares(const float* x, std::int64_t n) { return SumImpl<true>(x, n); }
double sum(const bf16_t* x, std::int64_t n) { return SumImpl<false>(x, n); }
double sum_squares(const bf16_t* x, std::int64_t n) { return SumImpl<true>(x, n); }
double sum(const f16_t* x, std::int64_t n) { return SumImpl<false>(x, n); }
double sum_squares(const f16_t* x, std::int64_t n) { return SumImpl<true>(x, n); }

double max_abs(const float* x, std::int64_t n) {
  static_assert(sizeof(float) == sizeof(std::uint32_t));
  const std::uint32_t m = MaxAbsBits(reinterpret_cast<const std::uint32_t*>(x), n, 0x7fffffffu);
  return m > 0x7f800000u ? kNaN : static_cast<double>(std::bit_cast<float>(m));
}

double max_abs(const bf16_t* x, std::int64_t n) {
  static_assert(sizeof(bf16_t) == sizeof(std::uint16_t));
  const auto m = MaxAbsBits(reinterpret_cast<const std::uint16_t*>(x), n, std::uint16_t{0x7fff});
  return m > 0x7f80u ? kNaN : static_cast<double>(bf16_to_f32(bf16_t{m}));
}

double max_abs(const f16_t* x, std::int64_t n) {
  static_assert(sizeof(f16_t) == sizeof(std::uint16_t));
  const auto m = MaxAbsBits(reinterpret_cast<const std::uint16_t*>(x), n, std::uint16_t{0x7fff});
  return m > 0x7c00u ? kNaN : static_cast<double>(f16_to_f32(f16_t{m}));
}

}  // namespace shardkit::kernels
