#include "common/kernels/elementwise.h"

#include <initializer_list>
#include <type_traits>

#include "common/kernels/cuda/cuda_kernels.h"

namespace shardkit::kernels {

// Note [elementwise aliasing]: the loops below use plain (non-restrict) pointers so that in-place calls
// (out == a) are legal. gcc then versions each loop with a run-time dependence-distance check; the check
// passes for distance 0 (the same array) and for disjoint arrays, so both run the vector loop.

void add(const float* a, const float* b, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
}

void sub(const float* a, const float* b, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = a[i] - b[i];
}

void mul(const float* a, const float* b, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = a[i] * b[i];
}

void scale(float s, const float* a, float* out, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) out[i] = s * a[i];
}

void axpy(float alpha, const float* x, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

void axpby(float alpha, const float* x, float beta, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = alpha * x[i] + beta * y[i];
}

void fill(float* x, std::int64_t n, float value) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = value;
}

namespace {

// True when x and y view some common bytes of one storage without being the very same elements.
bool PartlyOverlap(const Tensor& x, const Tensor& y) {
  if (x.storage() != y.storage() || x.nbytes() == 0 || y.nbytes() == 0) return false;
  if (x.offset_bytes() == y.offset_bytes() && x.nbytes() == y.nbytes()) return false;
  return x.offset_bytes() < y.offset_bytes() + y.nbytes() && y.offset_bytes() < x.offset_bytes() + x.nbytes();
}

// Checks that every tensor is f32, on out's device, of out's numel, and either out itself or disjoint
// from it (see Note [elementwise aliasing]).
void CheckF32(const char* op, std::initializer_list<const Tensor*> inputs, const Tensor& out) {
  SK_CHECK(out.dtype() == DType::f32) << op << ": needs f32 tensors, got " << out.describe();
  for (const Tensor* t : inputs) {
    SK_CHECK(t->dtype() == DType::f32) << op << ": needs f32 tensors, got " << t->describe();
    SK_CHECK(t->device() == out.device())
        << op << ": tensors on different devices: " << t->describe() << " and " << out.describe();
    SK_CHECK(t->numel() == out.numel())
        << op << ": sizes differ: " << t->describe() << " and " << out.describe();
    SK_CHECK(!PartlyOverlap(*t, out)) << op << ": input " << t->describe() << " partly overlaps the output "
                                      << out.describe() << " (allowed: the very same elements, or disjoint)";
  }
}

const float* In(const Tensor& t) { return t.numel() > 0 ? t.data<float>() : nullptr; }
float* Out(const Tensor& t) { return t.numel() > 0 ? t.data<float>() : nullptr; }

}  // namespace

void add(const Tensor& a, const Tensor& b, const Tensor& out) {
  CheckF32("add", {&a, &b}, out);
  if (out.numel() == 0) return;
  if (out.device().is_cuda()) return cuda::add(out.device(), In(a), In(b), Out(out), out.numel());
  add(In(a), In(b), Out(out), out.numel());
}

void sub(const Tensor& a, const Tensor& b, const Tensor& out) {
  CheckF32("sub", {&a, &b}, out);
  if (out.numel() == 0) return;
  if (out.device().is_cuda()) return cuda::sub(out.device(), In(a), In(b), Out(out), out.numel());
  sub(In(a), In(b), Out(out), out.numel());
}

void mul(const Tensor& a, const Tensor& b, const Tensor& out) {
  CheckF32("mul", {&a, &b}, out);
  if (out.numel() == 0) return;
  if (out.device().is_cuda()) return cuda::mul(out.device(), In(a), In(b), Out(out), out.numel());
  mul(In(a), In(b), Out(out), out.numel());
}

void scale(float s, const Tensor& a, const Tensor& out) {
  CheckF32("scale", {&a}, out);
  if (out.numel() == 0) return;
  if (out.device().is_cuda()) return cuda::scale(out.device(), s, In(a), Out(out), out.numel());
  scale(s, In(a), Out(out), out.numel());
}

void axpy(float alpha, const Tensor& x, const Tensor& y) {
  CheckF32("axpy", {&x}, y);
  if (y.numel() == 0) return;
  if (y.device().is_cuda()) return cuda::axpy(y.device(), alpha, In(x), Out(y), y.numel());
  axpy(alpha, In(x), Out(y), y.numel());
}

void axpby(float alpha, const Tensor& x, float beta, const Tensor& y) {
  CheckF32("axpby", {&x}, y);
  if (y.numel() == 0) return;
  if (y.device().is_cuda()) return cuda::axpby(y.device(), alpha, In(x), beta, Out(y), y.numel());
  axpby(alpha, In(x), beta, Out(y), y.numel());
}

void fill(const Tensor& x, float value) {
  CheckF32("fill", {}, x);
  if (x.numel() == 0) return;
  if (x.device().is_cuda()) return cuda::fill(x.device(), Out(x), x.numel(), value);
  fill(Out(x), x.numel(), value);
}

namespace {

template <typename T>
void ScaleInPlace(T* __restrict x, std::int64_t n, float s) {
  for (std::int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, float>) x[i] *= s;
    else if constexpr (std::is_same_v<T, bf16_t>) x[i] = f32_to_bf16(bf16_to_f32(x[i]) * s);
    else x[i] = f32_to_f16(f16_to_f32(x[i]) * s);
  }
}

}  // namespace

void scale_(float s, const Tensor& x) {
  SK_CHECK(is_floating(x.dtype())) << "scale_: expected a floating tensor, found " << x.describe();
  if (x.numel() == 0) return;
  if (x.device().is_cuda()) {
    if (x.dtype() == DType::f32) return scale(s, x, x);
    const Tensor tmp = Tensor::empty(x.shape(), TensorOptions{}.with_device(x.device()));
    cast(x, tmp);
    scale(s, tmp, tmp);
    return cast(tmp, x);
  }
  switch (x.dtype()) {
    case DType::f32: return ScaleInPlace(x.data<float>(), x.numel(), s);
    case DType::bf16: return ScaleInPlace(x.data<bf16_t>(), x.numel(), s);
    case DType::f16: return ScaleInPlace(x.data<f16_t>(), x.numel(), s);
    case DType::i64: break;
  }
}

void cast(const Tensor& src, const Tensor& dst) {
  SK_CHECK(src.numel() == dst.numel()) << "cast: sizes differ: " << src.describe() << " to " << dst.describe();
  const std::int64_t n = dst.numel();
  if (n == 0) return;
  const Device sd = src.device(), dd = dst.device();
  if (sd.is_cpu() && dd.is_cpu()) {
    convert_elements(src.raw_data(), src.dtype(), dst.raw_data(), dst.dtype(), n);
  } else if (sd == dd) {
    cuda::cast(dd, src.raw_data(), src.dtype(), dst.raw_data(), dst.dtype(), n);
  } else if (src.dtype() == dst.dtype()) {
    cuda::copy_bytes(src.raw_data(), sd, dst.raw_data(), dd, dst.nbytes());
  } else {
    // Crossing devices and changing dtype: convert where the source lives into a staging buffer of dst's
    // dtype, then move the bytes. copy_bytes waits for the calling thread's stream, which also orders
    // the conversion kernel (same stream) before the staging buffer is freed.
    Tensor staging = Tensor::empty(src.shape(), TensorOptions{dst.dtype(), sd, MemoryCategory::other});
    cast(src, staging);
    cuda::copy_bytes(staging.raw_data(), sd, dst.raw_data(), dd, dst.nbytes());
  }
}

}  // namespace shardkit::kernels
