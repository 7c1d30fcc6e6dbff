// Elementwise fp32 kernels and dtype casts (DESIGN.md section 2).
//
// Raw-pointer forms: CPU fp32 arrays of n elements, plain loops that gcc vectorises (checked with
// -fopt-info-vec-optimized: every loop here vectorises, see Note [elementwise aliasing] in the .cc). Aliasing: `out` (or `y`) may be the
// very same array as an input (in place: add(a, b, a, n)); partially overlapping arrays are not allowed.
//
// Tensor forms: contiguous f32 tensors (any shape, equal numel) on one device; CPU tensors run the
// raw-pointer loops on the calling thread, CUDA tensors run on the device on the calling thread's
// default stream (asynchronously; see cuda/cuda_kernels.h). Mismatched dtypes, devices or sizes
// throw InternalError naming the tensors.
//
// Thread-safety: none needed; the functions keep no state.
#pragma once

#include <cstdint>

#include "common/tensor/tensor.h"

namespace shardkit::kernels {

// ---- CPU fp32, raw pointers ----------------------------------------------------------------------
void add(const float* a, const float* b, float* out, std::int64_t n);            // out = a + b
void sub(const float* a, const float* b, float* out, std::int64_t n);            // out = a - b
void mul(const float* a, const float* b, float* out, std::int64_t n);            // out = a * b
void scale(float s, const float* a, float* out, std::int64_t n);                 // out = s * a
void axpy(float alpha, const float* x, float* y, std::int64_t n);                // y += alpha * x
void axpby(float alpha, const float* x, float beta, float* y, std::int64_t n);   // y = alpha * x + beta * y
void fill(float* x, std::int64_t n, float value);                                // x = value

// ---- f32 tensors, CPU or CUDA --------------------------------------------------------------------
void add(const Tensor& a, const Tensor& b, const Tensor& out);
void sub(const Tensor& a, const Tensor& b, const Tensor& out);
void mul(const Tensor& a, const Tensor& b, const Tensor& out);
void scale(float s, const Tensor& a, const Tensor& out);
void axpy(float alpha, const Tensor& x, const Tensor& y);
void axpby(float alpha, const Tensor& x, float beta, const Tensor& y);
void fill(const Tensor& x, float value);
// x *= s in place for a floating tensor of any dtype (f32, bf16, f16) on any device: fp32 arithmetic, bf16 / f16
// rounded back to nearest even (on a device through an fp32 temporary).
void scale_(float s, const Tensor& x);

// dst = src converted to dst's dtype, for any dtype pair (f32, bf16, f16, i64) and any pair of devices
// (CPU<->CUDA, CUDA<->CUDA), same numel. bf16/f16 results round to nearest even; float -> i64 truncates
// toward zero (values out of i64 range are undefined). A copy that crosses devices and changes dtype
// converts on src's device into a temporary of dst's dtype (charged to the ledger as "other" while it
// lives) and then copies. Copies that cross devices are synchronous; a CUDA-only cast is asynchronous
// on the calling thread's default stream.
void cast(const Tensor& src, const Tensor& dst);

}  // namespace shardkit::kernels
