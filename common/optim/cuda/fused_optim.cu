// Fused multi-tensor Adam / AdamW and SGD on CUDA devices (part of shardkit::cuda; contract in
// cuda_optim_kernels.h). Each launch covers up to kMaxTensorsPerLaunch tensors, a thread block per chunk of
// kChunkNumel elements (Note [multi-tensor launches] in common/optim/multi_tensor_plan.h). Per element the
// arithmetic is fused::adam_step's / fused::sgd_step's, in the same order, in fp32 (one read of w, g and the state
// and one write of w, the state and a bf16/f16 parameter), so results equal the CPU's bit for bit (Note [no
// contraction]).
//
// Note [no contraction]: nvcc contracts a * b + c into one FMA by default; gcc under -std=c++20 does not. The
// first H200 run (stop 32) showed why that matters here: where g + weight_decay * w nearly cancels, the FMA's
// single rounding changes the gradient's low bits, and Adam's m / (sqrt(v) + eps) turns that into a visible
// difference in the step. Every product and sum below is therefore written with the round-to-nearest intrinsics
// (__fmul_rn / __fadd_rn / __fsub_rn), which nvcc never contracts; sqrtf and '/' are IEEE-rounded unless
// --use_fast_math, which this build does not use. The kernels are memory-bound: the FMAs saved nothing.
#include <cuda_runtime.h>

#include <algorithm>
#include <vector>

#include "common/kernels/cuda/cuda_util.cuh"
#include "common/kernels/cuda/widen.cuh"
#include "common/optim/cuda/cuda_optim_kernels.h"
#include "common/optim/multi_tensor_plan.h"

namespace shardkit::optim::cuda {
namespace {

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

template <typename P, typename G>
__global__ void AdamKernel(const LaunchTable<AdamTensor, fused::AdamCoeffs> table) {
  const std::int64_t block = blockIdx.x;
  SK_TENSOR_OF_BLOCK(table, block, t);
  const AdamTensor x = table.tensors[t];  // copies, for the same reason as SK_TENSOR_OF_BLOCK
  const fused::AdamCoeffs c = table.c;
  const std::int64_t begin = (block - table.first_block[t]) * kChunkNumel;
  const std::int64_t end = x.n < begin + kChunkNumel ? x.n : begin + kChunkNumel;
  const G* g = static_cast<const G*>(x.grad);
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float wi = x.w[i];
    const float gi = Add(Mul(c.sign, load_f32(g, i)), Mul(c.l2, wi));
    wi = Mul(wi, c.decay);
    const float mi = Add(Mul(c.beta1, x.m[i]), Mul(c.one_minus_beta1, gi));
    const float vi = Add(Mul(c.beta2, x.v[i]), Mul(c.one_minus_beta2, Mul(gi, gi)));
    const float denom = Add(Mul(sqrtf(vi), x.inv_sqrt_bc2), c.eps);
    wi = __fsub_rn(wi, Mul(x.step_size, mi / denom));
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
  for (std::int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
    float wi = x.w[i];
    float gi = Add(Mul(c.sign, load_f32(g, i)), Mul(c.weight_decay, wi));
    if (c.has_momentum) {
      const float bi = Add(Mul(x.keep, x.buf[i]), Mul(x.take, gi));
      x.buf[i] = bi;
      gi = c.nesterov ? Add(gi, Mul(c.momentum, bi)) : bi;
    }
    wi = __fsub_rn(wi, Mul(c.lr, gi));
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

// Plans the launches over `tensors` (Note [multi-tensor launches]) and starts each through `launch`.
template <typename Entry, typename Coeffs, typename Launch>
void LaunchAll(Device device, absl::Span<const Entry> tensors, const Coeffs& c, const char* what, Launch launch) {
  std::vector<std::int64_t> numels(tensors.size());
  for (std::size_t i = 0; i < tensors.size(); ++i) numels[i] = tensors[i].n;
  const std::vector<MultiTensorLaunch> plan = plan_multi_tensor_launches(numels, kChunkNumel, kMaxTensorsPerLaunch);
  if (plan.empty()) return;
  DeviceGuard guard(device);
  for (const MultiTensorLaunch& l : plan) {
    LaunchTable<Entry, Coeffs> table;
    table.count = static_cast<int>(l.tensors.size());
    table.c = c;
    for (int k = 0; k < table.count; ++k) {
      table.tensors[k] = tensors[static_cast<std::size_t>(l.tensors[static_cast<std::size_t>(k)])];
      table.first_block[k] = l.first_block[static_cast<std::size_t>(k)];
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
    LaunchAll(device, tensors, c, "optim::cuda::adam_step", [](const auto& table, unsigned blocks) {
      AdamKernel<P, G><<<blocks, kThreads, 0, cudaStreamPerThread>>>(table);
    });
  });
}

void sgd_step(Device device, DType param_dtype, DType grad_dtype, absl::Span<const SgdTensor> tensors,
              const fused::SgdCoeffs& c) {
  DispatchTypes(param_dtype, grad_dtype, [&](auto* p, auto* g) {
    using P = std::remove_pointer_t<decltype(p)>;
    using G = std::remove_const_t<std::remove_pointer_t<decltype(g)>>;
    LaunchAll(device, tensors, c, "optim::cuda::sgd_step", [](const auto& table, unsigned blocks) {
      SgdKernel<P, G><<<blocks, kThreads, 0, cudaStreamPerThread>>>(table);
    });
  });
}

}  // namespace cuda_impl
}  // namespace shardkit::optim::cuda
