#include "common/autograd/ops/elementwise.h"

#include <cmath>

#include "common/autograd/ops/op_utils.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/elementwise.h"

namespace shardkit::autograd {
namespace {

// Number of times b repeats inside a (b's shape must equal a's trailing dimensions).
std::int64_t BroadcastRows(const char* op, const Tensor& a, const Tensor& b) {
  const Shape& as = a.shape();
  const Shape& bs = b.shape();
  bool ok = bs.size() <= as.size();
  for (std::size_t i = 0; ok && i < bs.size(); ++i) ok = bs[bs.size() - 1 - i] == as[as.size() - 1 - i];
  SK_CHECK(ok) << op << ": expected b's shape to equal a's or a suffix of it, found a " << a.describe() << ", b "
               << b.describe();
  return b.numel() == 0 ? 0 : a.numel() / b.numel();
}

// Sum of g viewed as [rows, n] over its rows -> [n] with `shape`.
Tensor SumRows(const Tensor& g, std::int64_t rows, const Shape& shape) {
  if (g.device().is_cuda()) {
    Tensor out = detail::new_activation(shape, DType::f32, g.device());
    kernels::cuda::sum_rows(g.device(), detail::ptr_or_null<float>(g), detail::ptr_or_null<float>(out), rows,
                            out.numel(), /*accumulate=*/false);
    return out;
  }
  Tensor out = detail::zeros_activation(shape);
  const std::int64_t n = out.numel();
  float* __restrict o = out.data<float>();
  const float* gp = g.data<float>();
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* __restrict row = gp + r * n;
    for (std::int64_t j = 0; j < n; ++j) o[j] += row[j];
  }
  return out;
}

// out = f(a, b) with b broadcast over a's rows; `row_op` is f's kernel on a CUDA device.
template <typename F>
Tensor Binary(const char* op, kernels::cuda::RowOp row_op, const Tensor& a, const Tensor& b, F f) {
  detail::check_f32(op, a);
  detail::check_f32(op, b);
  detail::check_on(op, b, a.device());
  const std::int64_t rows = BroadcastRows(op, a, b);
  const std::int64_t n = b.numel();
  Tensor out = detail::new_activation(a.shape(), DType::f32, a.device());
  if (a.device().is_cuda()) {
    kernels::cuda::broadcast_rows(a.device(), row_op, detail::ptr_or_null<float>(a), detail::ptr_or_null<float>(b),
                                  detail::ptr_or_null<float>(out), rows, n);
    return out;
  }
  const float* ap = a.data<float>();
  const float* bp = b.data<float>();
  float* op_ = out.data<float>();
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* __restrict ar = ap + r * n;
    float* __restrict orow = op_ + r * n;
    for (std::int64_t j = 0; j < n; ++j) orow[j] = f(ar[j], bp[j]);
  }
  return out;
}

Tensor Multiply(const Tensor& a, const Tensor& b) {
  return Binary("mul", kernels::cuda::RowOp::mul, a, b, [](float x, float y) { return x * y; });
}

Tensor Scaled(const Tensor& g, float s) {
  Tensor out = detail::new_activation(g.shape(), DType::f32, g.device());
  if (g.device().is_cuda()) {
    kernels::scale(s, g, out);
    return out;
  }
  const float* __restrict gp = g.data<float>();
  float* __restrict o = out.data<float>();
  const std::int64_t n = g.numel();
  for (std::int64_t i = 0; i < n; ++i) o[i] = gp[i] * s;
  return out;
}

// y[i] = f(x[i]) over n elements; f inlines, so the loop vectorises when f is plain arithmetic.
template <typename F>
void Map(const float* __restrict x, float* __restrict y, std::int64_t n, F f) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = f(x[i]);
}

// Note [pow exponents]: std::pow is a libm call the vectoriser cannot inline, so a loop over it runs
// scalar. The exponents models use (squares, cubes, square roots, reciprocals, and p - 1 of those in the
// backward) get their own loops of plain arithmetic, as PyTorch's CPU pow kernel does. They agree with
// std::pow to within an ulp (x * x and 1 / x exactly; x * x * x and 1 / sqrt(x) round twice), except
// where sqrt and pow define edge cases differently (0.5 and -0.5 at x = -0 and -inf: sqrt(-0) = -0 and
// sqrt(-inf) = NaN) and for -2 where x * x under- or overflows (|x| < 1e-19 or > 1.8e19). Other exponents
// call std::pow per element.
void PowValues(const float* x, float* y, std::int64_t n, float p) {
  if (p == 0.f) {
    Map(x, y, n, [](float) { return 1.f; });
  } else if (p == 1.f) {
    Map(x, y, n, [](float v) { return v; });
  } else if (p == 2.f) {
    Map(x, y, n, [](float v) { return v * v; });
  } else if (p == 3.f) {
    Map(x, y, n, [](float v) { return v * v * v; });
  } else if (p == 0.5f) {
    Map(x, y, n, [](float v) { return std::sqrt(v); });
  } else if (p == -0.5f) {
    Map(x, y, n, [](float v) { return 1.f / std::sqrt(v); });
  } else if (p == -1.f) {
    Map(x, y, n, [](float v) { return 1.f / v; });
  } else if (p == -2.f) {
    Map(x, y, n, [](float v) { return 1.f / (v * v); });
  } else {
    Map(x, y, n, [p](float v) { return std::pow(v, p); });
  }
}

}  // namespace

Tensor add_compute(const Tensor& a, const Tensor& b) {
  Tensor out = Binary("add", kernels::cuda::RowOp::add, a, b, [](float x, float y) { return x + y; });
  if (should_record({&a, &b})) {
    const std::int64_t rows = a.numel() / std::max<std::int64_t>(1, b.numel());
    const bool broadcast = a.shape() != b.shape();
    detail::record("AddBackward", {&a, &b}, {&out},
                   [rows, broadcast, bshape = b.shape(), need_b = detail::needs_grad(b)](TensorList&& g) -> TensorList {
                     Tensor gb;
                     if (need_b) gb = broadcast ? SumRows(g[0], rows, bshape) : g[0];
                     return {g[0], gb};
                   });
  }
  return out;
}

Tensor sub_compute(const Tensor& a, const Tensor& b) {
  Tensor out = Binary("sub", kernels::cuda::RowOp::sub, a, b, [](float x, float y) { return x - y; });
  if (should_record({&a, &b})) {
    const std::int64_t rows = a.numel() / std::max<std::int64_t>(1, b.numel());
    const bool broadcast = a.shape() != b.shape();
    detail::record("SubBackward", {&a, &b}, {&out},
                   [rows, broadcast, bshape = b.shape(), need_b = detail::needs_grad(b)](TensorList&& g) -> TensorList {
                     Tensor gb;
                     if (need_b) gb = Scaled(broadcast ? SumRows(g[0], rows, bshape) : g[0], -1.f);
                     return {g[0], gb};
                   });
  }
  return out;
}

Tensor mul_compute(const Tensor& a, const Tensor& b) {
  Tensor out = Multiply(a, b);
  if (should_record({&a, &b})) {
    const std::int64_t rows = a.numel() / std::max<std::int64_t>(1, b.numel());
    const bool broadcast = a.shape() != b.shape();
    detail::record("MulBackward", {&a, &b}, {&out},
                   [a, b, rows, broadcast, need_a = detail::needs_grad(a),
                    need_b = detail::needs_grad(b)](TensorList&& g) -> TensorList {
                     Tensor ga, gb;
                     if (need_a) ga = Multiply(g[0], b);
                     if (need_b) {
                       Tensor ag = Multiply(g[0], a);
                       gb = broadcast ? SumRows(ag, rows, b.shape()) : ag;
                     }
                     return {ga, gb};
                   });
  }
  return out;
}

Tensor scale_compute(const Tensor& a, float s) {
  detail::check_f32("scale", a);
  Tensor out = Scaled(a, s);
  if (should_record({&a})) {
    detail::record("ScaleBackward", {&a}, {&out}, [s](TensorList&& g) -> TensorList { return {Scaled(g[0], s)}; });
  }
  return out;
}

Tensor square_compute(const Tensor& x) {
  detail::check_f32_cpu("square", x);
  Tensor out = detail::new_activation(x.shape());
  Map(x.data<float>(), out.data<float>(), x.numel(), [](float v) { return v * v; });
  if (should_record({&x})) {
    detail::record("SquareBackward", {&x}, {&out}, [x](TensorList&& g) -> TensorList {
      Tensor gx = detail::new_activation(x.shape());
      const std::int64_t n = gx.numel();
      const float* __restrict xp = x.data<float>();
      const float* __restrict gp = g[0].data<float>();
      float* __restrict o = gx.data<float>();
      for (std::int64_t i = 0; i < n; ++i) o[i] = gp[i] * (2.f * xp[i]);
      return {gx};
    });
  }
  return out;
}

Tensor pow_compute(const Tensor& x, float exponent) {
  detail::check_f32_cpu("pow", x);
  Tensor out = detail::new_activation(x.shape());
  PowValues(x.data<float>(), out.data<float>(), x.numel(), exponent);
  if (should_record({&x})) {
    detail::record("PowBackward", {&x}, {&out}, [x, p = exponent](TensorList&& g) -> TensorList {
      const std::int64_t n = x.numel();
      if (p == 0.f) return {detail::zeros_activation(x.shape())};
      // g * (p * x^(p-1)), in PyTorch's order.
      Tensor gx = detail::new_activation(x.shape());
      float* __restrict o = gx.data<float>();
      PowValues(x.data<float>(), o, n, p - 1.f);
      const float* __restrict gp = g[0].data<float>();
      for (std::int64_t i = 0; i < n; ++i) o[i] = gp[i] * (p * o[i]);
      return {gx};
    });
  }
  return out;
}

Tensor add(const Tensor& a, const Tensor& b) {
  return detail::traced("add", {a, b}, [](const TensorList& t) { return add_compute(t[0], t[1]); });
}

Tensor sub(const Tensor& a, const Tensor& b) {
  return detail::traced("sub", {a, b}, [](const TensorList& t) { return sub_compute(t[0], t[1]); });
}

Tensor mul(const Tensor& a, const Tensor& b) {
  return detail::traced("mul", {a, b}, [](const TensorList& t) { return mul_compute(t[0], t[1]); });
}

Tensor scale(const Tensor& a, float s) {
  return detail::traced("scale", {a}, [s](const TensorList& t) { return scale_compute(t[0], s); });
}

Tensor square(const Tensor& x) {
  return detail::traced("square", {x}, [](const TensorList& t) { return square_compute(t[0]); });
}

Tensor pow(const Tensor& x, float exponent) {
  return detail::traced("pow", {x}, [exponent](const TensorList& t) { return pow_compute(t[0], exponent); });
}

}  // namespace shardkit::autograd
