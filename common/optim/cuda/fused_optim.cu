// Fused multi-tensor Adam / AdamW and SGD on CUDA devices (part of shardkit::cuda; contract in
// cuda_optim_kernels.h). Each launch covers up to kMaxTensorsPerLaunch tensors, a thread block per chunk of
// kChunkNumel elements (Note [multi-tensor launches] in common/optim/multi_tensor_plan.h). Per element the
// arithmetic is fused::adam_step's / fused::sgd_step's, in the same order, in fp32 (one read of w, g and the state
// and one write of w, the state and a bf16/f16 parameter), so results equal the CPU's bit for bit (Note [no
// contraction]); a thread takes four consecutive elements where the arrays allow (Note [four elements a thread]).
//
// Note [no contraction]: nvcc contracts a * b + c into one FMA by default; gcc under -std=c++20 does not. The
// first H200 run (stop 32) showed why that matters here: where g + weight_decay * w nearly cancels, the FMA's
// single rounding changes the gradient's low bits, and Adam's m / (sqrt(v) + eps) turns that into a visible
// difference in the step. Every product and sum below is therefore written with the round-to-nearest intrinsics
// (__fmul_rn / __fadd_rn / __fsub_rn), which nvcc never contracts; sqrtf and '/' are IEEE-rounded unless
// --use_fast_math, which this build does not use. The kernels are memory-bound: the FMAs saved nothing.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "common/kernels/cuda/cuda_util.cuh"
#include "common/kernels/cuda/widen.cuh"
#include "common/optim/cuda/cuda_optim_kernels.h"
#include "common/optim/multi_tensor_plan.h"

namespace shardkit::optim::cuda {
namespace {

using kernels::cuda::Aligned;
using kernels::cuda::CheckLaunch;
using kernels::cuda::DeviceGuard;
using kernels::cuda::load_f32;
using kernels::cuda::store_f32;

constexpr int kThreads = 256;

// A launch's table (Note [multi-tensor launches]): passed by value as the kernel's argument.
template <typename Entry, typename Coeffs>
struct LaunchTable {
  int count = 0;
  std::int64_t first_block[kMaxTensorsPerLaunch + 1] = {};
  Entry tensors[kMaxTensorsPerLaunch];
  Coeffs c;
  bool vector_access = false;  // Note [four elements a thread]: every tensor's arrays allow it
};
static_assert(sizeof(LaunchTable<AdamTensor, fused::AdamCoeffs>) <= 4000, "kernel arguments are limited to 4 KiB");
static_assert(sizeof(LaunchTable<SgdTensor, fused::SgdCoeffs>) <= 4000, "kernel arguments are limited to 4 KiB");

// The tensor of block `block`: the last t with first_block[t] <= block (binary search over the table). A macro,
// not a function taking the table by reference: taking a kernel parameter's address makes every thread copy it
// to local memory; indexing it in place reads it from the parameter bank.
#define SK_TENSOR_OF_BLOCK(table, block, t)      \
  int t = 0;                                     \
  {                                              \
    int hi_ = (table).count - 1;                 \
    while (t < hi_) {                            \
      const int mid_ = (t + hi_ + 1) / 2;        \
      if ((table).first_block[mid_] <= (block)) { \
        t = mid_;                                \
      } else {                                   \
        hi_ = mid_ - 1;                          \
      }                                          \
    }                                            \
  }

// Rounded once each and never contracted into an FMA (Note [no contraction]).
__device__ __forceinline__ float Mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float Add(float a, float b) { return __fadd_rn(a, b); }

// P: the bf16/f16 parameter that receives round(w), or float when the parameter is w itself (nothing written).
template <typename P>
__device__ __forceinline__ void StoreParam(void* param_out, std::int64_t i, float w) {
  if constexpr (!std::is_same_v<P, float>) store_f32(static_cast<P*>(param_out), i, w);
}

// Note [four elements a thread]: where every array of a launch is aligned for it (16 bytes for fp32 arrays, 8 for
// bf16 / f16 ones; checked on the host), a thread updates four consecutive elements with one vector load and
// store per array, fewer and wider memory instructions than one element at a time (the bf16-parameter AdamW ran
// at 0.76 of the H200's copy bandwidth with scalar ones, stop 32). The last, partial group of a tensor goes
// element by element. Each element's arithmetic is the scalar one's (AdamElement / SgdElement), so the results
// stay the CPU's bit for bit.
__device__ __forceinline__ void Load4(const float* p, std::int64_t i, float (&out)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p + i);
  out[0] = x.x, out[1] = x.y, out[2] = x.z, out[3] = x.w;
}
__device__ __forceinline__ void Load4(const bf16_t* p, std::int64_t i, float (&out)[4]) {
  const uint2 x = *reinterpret_cast<const uint2*>(p + i);  // element 0 in the low half of x.x
  out[0] = __uint_as_float(x.x << 16), out[1] = __uint_as_float(x.x & 0xffff0000u);
  out[2] = __uint_as_float(x.y << 16), out[3] = __uint_as_float(x.y & 0xffff0000u);
}
__device__ __forceinline__ void Load4(const f16_t* p, std::int64_t i, float (&out)[4]) {
  const uint2 x = *reinterpret_cast<const uint2*>(p + i);
  out[0] = __half2float(__ushort_as_half(static_cast<unsigned short>(x.x & 0xffffu)));
  out[1] = __half2float(__ushort_as_half(static_cast<unsigned short>(x.x >> 16)));
  out[2] = __half2float(__ushort_as_half(static_cast<unsigned short>(x.y & 0xffffu)));
  out[3] = __half2float(__ushort_as_half(static_cast<unsigned short>(x.y >> 16)));
}
__device__ __forceinline__ void Store4(float* p, std::int64_t i, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p + i) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ unsigned Bits(bf16_t, float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
__device__ __forceinline__ unsigned Bits(f16_t, float v) { return __half_as_ushort(__float2half_rn(v)); }
template <typename P>
__device__ __forceinline__ void StoreParam4(void* param_out, std::int64_t i, const float (&w)[4]) {
  if constexpr (!std::is_same_v<P, float>) {
    const uint2 x = {Bits(P{}, w[0]) | (Bits(P{}, w[1]) << 16), Bits(P{}, w[2]) | (Bits(P{}, w[3]) << 16)};
    *reinterpret_cast<uint2*>(static_cast<P*>(param_out) + i) = x;
  }
}

// One element of Adam / AdamW: fused::adam_step's formula, in its order.
__device__ __forceinline__ void AdamElement(float& w, float g, float& m, float& v, const fused::AdamCoeffs& c,
                                            float step_size, float inv_sqrt_bc2) {
  const float gi = Add(Mul(c.sign, g), Mul(c.l2, w));
  w = Mul(w, c.decay);
  m = Add(Mul(c.beta1, m), Mul(c.one_minus_beta1, gi));
  v = Add(Mul(c.beta2, v), Mul(c.one_minus_beta2, Mul(gi, gi)));
  const float denom = Add(Mul(sqrtf(v), inv_sqrt_bc2), c.eps);
  w = __fsub_rn(w, Mul(step_size, m / denom));
}

// One element of SGD: fused::sgd_step's formula, in its order (b unused without momentum).
__device__ __forceinline__ void SgdElement(float& w, float g, float& b, const fused::SgdCoeffs& c, float keep,
                                           float take) {
  float gi = Add(Mul(c.sign, g), Mul(c.weight_decay, w));
  if (c.has_momentum) {
    b = Add(Mul(keep, b), Mul(take, gi));
    gi = c.nesterov ? Add(gi, Mul(c.momentum, b)) : b;
  }
  w = __fsub_rn(w, Mul(c.lr, gi));
}

template <typename P, typename G>
__global__ void AdamKernel(const LaunchTable<AdamTensor, fused::AdamCoeffs> table) {
  const std::int64_t block = blockIdx.x;
  SK_TENSOR_OF_BLOCK(table, block, t);
  const AdamTensor x = table.tensors[t];  // copies, for the same reason as SK_TENSOR_OF_BLOCK
  const fused::AdamCoeffs c = table.c;
  const std::int64_t begin = (block - table.first_block[t]) * kChunkNumel;
  const std::int64_t end = x.n < begin + kChunkNumel ? x.n : begin + kChunkNumel;
  const G* g = static_cast<const G*>(x.grad);
  std::int64_t i = begin + threadIdx.x;
  std::int64_t stride = blockDim.x;
  if (table.vector_access) {  // Note [four elements a thread]
    for (i = begin + 4 * threadIdx.x; i + 4 <= end; i += 4 * blockDim.x) {
      float w[4], gv[4], m[4], v[4];
      Load4(x.w, i, w), Load4(g, i, gv), Load4(x.m, i, m), Load4(x.v, i, v);
#pragma unroll
      for (int k = 0; k < 4; ++k) AdamElement(w[k], gv[k], m[k], v[k], c, x.step_size, x.inv_sqrt_bc2);
      Store4(x.m, i, m), Store4(x.v, i, v), Store4(x.w, i, w);
      StoreParam4<P>(x.param_out, i, w);
    }
    stride = 1;  // this thread's partial last group, if it has one, element by element
  }
  for (; i < end; i += stride) {
    float wi = x.w[i], mi = x.m[i], vi = x.v[i];
    AdamElement(wi, load_f32(g, i), mi, vi, c, x.step_size, x.inv_sqrt_bc2);
    x.m[i] = mi;
    x.v[i] = vi;
    x.w[i] = wi;
    StoreParam<P>(x.param_out, i, wi);
  }
}

template <typename P, typename G>
__global__ void SgdKernel(const LaunchTable<SgdTensor, fused::SgdCoeffs> table) {
  const std::int64_t block = blockIdx.x;
  SK_TENSOR_OF_BLOCK(table, block, t);
  const SgdTensor x = table.tensors[t];
  const fused::SgdCoeffs c = table.c;
  const std::int64_t begin = (block - table.first_block[t]) * kChunkNumel;
  const std::int64_t end = x.n < begin + kChunkNumel ? x.n : begin + kChunkNumel;
  const G* g = static_cast<const G*>(x.grad);
  std::int64_t i = begin + threadIdx.x;
  std::int64_t stride = blockDim.x;
  if (table.vector_access) {  // Note [four elements a thread]
    for (i = begin + 4 * threadIdx.x; i + 4 <= end; i += 4 * blockDim.x) {
      float w[4], gv[4], b[4] = {0.f, 0.f, 0.f, 0.f};
      Load4(x.w, i, w), Load4(g, i, gv);
      if (c.has_momentum) Load4(x.buf, i, b);
#pragma unroll
      for (int k = 0; k < 4; ++k) SgdElement(w[k], gv[k], b[k], c, x.keep, x.take);
      if (c.has_momentum) Store4(x.buf, i, b);
      Store4(x.w, i, w);
      StoreParam4<P>(x.param_out, i, w);
    }
    stride = 1;
  }
  for (; i < end; i += stride) {
    float wi = x.w[i], bi = c.has_momentum ? x.buf[i] : 0.f;
    SgdElement(wi, load_f32(g, i), bi, c, x.keep, x.take);
    if (c.has_momentum) x.buf[i] = bi;
    x.w[i] = wi;
    StoreParam<P>(x.param_out, i, wi);
  }
}

// Calls f(P*, G*) with null pointers of the storage types of the parameter (float: none written) and gradient.
template <typename F>
void DispatchTypes(DType param_dtype, DType grad_dtype, F&& f) {
  auto with_grad = [&](auto* p) {
    switch (grad_dtype) {
      case DType::f32: return f(p, static_cast<const float*>(nullptr));
      case DType::bf16: return f(p, static_cast<const bf16_t*>(nullptr));
      case DType::f16: return f(p, static_cast<const f16_t*>(nullptr));
      case DType::i64: break;
    }
    SK_CHECK(false) << "optimizer gradient of dtype " << dtype_name(grad_dtype);
  };
  switch (param_dtype) {
    case DType::f32: return with_grad(static_cast<float*>(nullptr));
    case DType::bf16: return with_grad(static_cast<bf16_t*>(nullptr));
    case DType::f16: return with_grad(static_cast<f16_t*>(nullptr));
    case DType::i64: break;
  }
  SK_CHECK(false) << "optimizer parameter of dtype " << dtype_name(param_dtype);
}

// Whether a tensor's arrays allow four elements a thread (Note [four elements a thread]): fp32 arrays 16-byte
// aligned, the gradient's four elements (grad_bytes each) and a bf16 / f16 parameter's 8-byte aligned.
bool VectorAccess(const AdamTensor& x, std::size_t grad_bytes) {
  return Aligned(x.w, 16) && Aligned(x.m, 16) && Aligned(x.v, 16) && Aligned(x.grad, 4 * grad_bytes) &&
         (x.param_out == nullptr || Aligned(x.param_out, 8));
}
bool VectorAccess(const SgdTensor& x, std::size_t grad_bytes) {
  return Aligned(x.w, 16) && (x.buf == nullptr || Aligned(x.buf, 16)) && Aligned(x.grad, 4 * grad_bytes) &&
         (x.param_out == nullptr || Aligned(x.param_out, 8));
}

// Plans the launches over `tensors` (Note [multi-tensor launches]) and starts each through `launch`.
template <typename Entry, typename Coeffs, typename Launch>
void LaunchAll(Device device, absl::Span<const Entry> tensors, const Coeffs& c, std::size_t grad_bytes,
               const char* what, Launch launch) {
  std::vector<std::int64_t> numels(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) numels[i] = tensors[i].n;
  const std::vector<MultiTensorLaunch> plan = plan_multi_tensor_launches(numels, kChunkNumel, kMaxTensorsPerLaunch);
  if (plan.empty()) return;
  DeviceGuard guard(device);
  for (const MultiTensorLaunch& l : plan) {
    LaunchTable<Entry, Coeffs> table;
    table.count = static_cast<int>(l.tensors.size());
    table.c = c;
    table.vector_access = true;
    for (int k = 0; k < table.count; ++k) {
      table.tensors[k] = tensors[static_cast<std::size_t>(l.tensors[static_cast<std::size_t>(k)])];
      table.first_block[k] = l.first_block[static_cast<std::size_t>(k)];
      table.vector_access = table.vector_access && VectorAccess(table.tensors[k], grad_bytes);
    }
    table.first_block[table.count] = l.blocks();
    launch(table, static_cast<unsigned>(l.blocks()));
    CheckLaunch(what);
  }
}

}  // namespace

namespace cuda_impl {

void adam_step(Device device, DType param_dtype, DType grad_dtype, absl::Span<const AdamTensor> tensors,
               const fused::AdamCoeffs& c) {
  DispatchTypes(param_dtype, grad_dtype, [&](auto* p, auto* g) {
    using P = std::remove_pointer_t<decltype(p)>;
    using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
    LaunchAll(device, tensors, c, sizeof(G), "optim::cuda::adam_step", [](const auto& table, unsigned blocks) {
      AdamKernel<P, G><<<blocks, kThreads, 0, cudaStreamPerThread>>>(table);
    });
  });
}

void sgd_step(Device device, DType param_dtype, DType grad_dtype, absl::Span<const SgdTensor> tensors,
              const fused::SgdCoeffs& c) {
  DispatchTypes(param_dtype, grad_dtype, [&](auto* p, auto* g) {
    using P = std::remove_pointer_t<decltype(p)>;
    using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
    LaunchAll(device, tensors, c, sizeof(G), "optim::cuda::sgd_step", [](const auto& table, unsigned blocks) {
      SgdKernel<P, G><<<blocks, kThreads, 0, cudaStreamPerThread>>>(table);
    });
  });
}

}  // namespace cuda_impl
}  // namespace shardkit::optim::cuda
