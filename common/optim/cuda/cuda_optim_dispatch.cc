// The optim::cuda functions in the CPU library: each forwards to the implementation that shardkit::cuda
// registers (Note [cuda component] in common/cuda/cuda_component.h), or throws InternalError saying why CUDA is
// absent from this program.
#include <string>

#include "common/base/check.h"
#include "common/optim/cuda/cuda_optim_kernels.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/startup_registry.h"

namespace shardkit::optim::cuda {
namespace {

constinit detail::StartupRegistry<CudaOptimOps> g_cuda_optim;  // written once, at static-init time

const CudaOptimOps& Ops(const char* what) {
  const CudaOptimOps* ops = g_cuda_optim.get();
  if (ops == nullptr) throw InternalError(std::string(what) + ": " + detail::cuda_unavailable_reason());
  return *ops;
}

}  // namespace

void register_cuda_optim_kernels(const CudaOptimOps* ops) { g_cuda_optim.set(ops, "CUDA optimizer kernels"); }

void adam_step(Device device, DType param_dtype, DType grad_dtype, absl::Span<const AdamTensor> tensors,
               const fused::AdamCoeffs& c) {
  Ops("optim::cuda::adam_step").adam_step(device, param_dtype, grad_dtype, tensors, c);
}

void sgd_step(Device device, DType param_dtype, DType grad_dtype, absl::Span<const SgdTensor> tensors,
              const fused::SgdCoeffs& c) {
  Ops("optim::cuda::sgd_step").sgd_step(device, param_dtype, grad_dtype, tensors, c);
}

}  // namespace shardkit::optim::cuda
