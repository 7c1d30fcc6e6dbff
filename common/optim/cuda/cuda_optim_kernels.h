// Fused multi-tensor optimizer kernels on CUDA devices (issue 14 item 2): the device counterparts of
// fused::adam_step and fused::sgd_step (common/optim/fused_kernels.h), same formulas, fp32 arithmetic, one launch
// for up to kMaxTensorsPerLaunch tensors (Note [multi-tensor launches] in common/optim/multi_tensor_plan.h).
// Internal to common/optim: Optimizer::step calls them for parameters on a CUDA device.
//
// Pointers are device pointers on `device`. The functions make `device` current for the call (restoring the
// caller's), launch on cudaStreamPerThread (the calling thread's stream, as common/kernels/cuda does) and return
// without waiting: work queued on that stream afterwards sees the update. Every tensor of one call has the same
// parameter and gradient dtypes. These functions dispatch (cuda_optim_dispatch.cc) to the implementation that
// shardkit::cuda registers (Note [cuda component] in common/cuda/cuda_component.h); in a program without it
// they throw InternalError naming detail::cuda_unavailable_reason().
#pragma once

#include <cstdint>

#include "absl/types/span.h"
#include "common/optim/fused_kernels.h"
#include "common/tensor/device.h"
#include "common/tensor/dtype.h"

namespace shardkit::optim::cuda {

// One launch's tensor table is a kernel argument (Note [multi-tensor launches]), kept under the 4 KiB that every
// CUDA version accepts.
inline constexpr int kMaxTensorsPerLaunch = 36;
// Elements per thread block.
inline constexpr std::int64_t kChunkNumel = 16 * 1024;

// One tensor of an Adam / AdamW update. w, m, v: fp32. param_out: nullptr when the parameter is w itself, else
// the bf16/f16 parameter that receives round(w). grad: the call's grad dtype. step_size and inv_sqrt_bc2 are this
// tensor's (its step count may differ from the others'); the call's AdamCoeffs give everything else.
struct AdamTensor {
  float* w = nullptr;
  void* param_out = nullptr;
  const void* grad = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  std::int64_t n = 0;
  float step_size = 0.0f;
  float inv_sqrt_bc2 = 1.0f;
};
void adam_step(Device device, DType param_dtype, DType grad_dtype, absl::Span<const AdamTensor> tensors,
               const fused::AdamCoeffs& c);

// One tensor of an SGD update. buf: the momentum buffer, or nullptr without momentum. keep / take: this tensor's
// (a new buffer takes the gradient as is); the call's SgdCoeffs give everything else.
struct SgdTensor {
  float* w = nullptr;
  void* param_out = nullptr;
  const void* grad = nullptr;
  float* buf = nullptr;
  std::int64_t n = 0;
  float keep = 0.0f;
  float take = 1.0f;
};
void sgd_step(Device device, DType param_dtype, DType grad_dtype, absl::Span<const SgdTensor> tensors,
              const fused::SgdCoeffs& c);

// ---- the seam (Note [cuda component]) -----------------------------------------------------------------
struct CudaOptimOps {
  decltype(&cuda::adam_step) adam_step;
  decltype(&cuda::sgd_step) sgd_step;
};

// Called once by shardkit::cuda's static initialiser; `ops` must outlive the program (a constant).
void register_cuda_optim_kernels(const CudaOptimOps* ops);

// The CUDA implementation, defined in fused_optim.cu (part of shardkit::cuda only).
namespace cuda_impl {
decltype(cuda::adam_step) adam_step;
decltype(cuda::sgd_step) sgd_step;
}  // namespace cuda_impl

}  // namespace shardkit::optim::cuda
