#include "common/autograd/ops/elementwise.h"

#include "common/autograd/ops/op_utils.h"

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

template <typename F>
Tensor Binary(const char* op, const Tensor& a, const Tensor& b, F f) {
  detail::check_f32_cpu(op, a);
  detail::check_f32_cpu(op, b);
  const std::int64_t rows = BroadcastRows(op, a, b);
  const std::int64_t n = b.numel();
  Tensor out = detail::new_activation(a.shape());
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

Tensor Scaled(const Tensor& g, float s) {
  Tensor out = detail::new_activation(g.shape());
  const float* __restrict gp = g.data<float>();
  float* __restrict o = out.data<float>();
  const std::int64_t n = g.numel();
  for (std::int64_t i = 0; i < n; ++i) o[i] = gp[i] * s;
  return out;
}

}  // namespace

Tensor add(const Tensor& a, const Tensor& b) {
  Tensor out = Binary("add", a, b, [](float x, float y) { return x + y; });
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

Tensor sub(const Tensor& a, const Tensor& b) {
  Tensor out = Binary("sub", a, b, [](float x, float y) { return x - y; });
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

Tensor mul(const Tensor& a, const Tensor& b) {
  Tensor out = Binary("mul", a, b, [](float x, float y) { return x * y; });
  if (should_record({&a, &b})) {
    const std::int64_t rows = a.numel() / std::max<std::int64_t>(1, b.numel());
    const bool broadcast = a.shape() != b.shape();
    detail::record("MulBackward", {&a, &b}, {&out},
                   [a, b, rows, broadcast, need_a = detail::needs_grad(a),
                    need_b = detail::needs_grad(b)](TensorList&& g) -> TensorList {
                     Tensor ga, gb;
                     if (need_a) ga = Binary("mul", g[0], b, [](float x, float y) { return x * y; });
                     if (need_b) {
                       Tensor ag = Binary("mul", g[0], a, [](float x, float y) { return x * y; });
                       gb = broadcast ? SumRows(ag, rows, b.shape()) : ag;
                     }
                     return {ga, gb};
                   });
  }
  return out;
}

Tensor scale(const Tensor& a, float s) {
  detail::check_f32_cpu("scale", a);
  Tensor out = Scaled(a, s);
  if (should_record({&a})) {
    detail::record("ScaleBackward", {&a}, {&out}, [s](TensorList&& g) -> TensorList { return {Scaled(g[0], s)}; });
  }
  return out;
}

}  // namespace shardkit::autograd
