// Registers shardkit::cuda's implementations with the CPU libraries' seams at static-init time
// (Note [cuda component] in cuda_component.h).
#include "common/cuda/cuda_component.h"

#include "common/comm/nccl_process_group.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/optim/cuda/cuda_optim_kernels.h"
#include "common/tensor/device_memory.h"

namespace shardkit {
namespace {

constexpr detail::CudaMemoryOps kMemory{
    .allocate = &detail::cuda_impl::cuda_allocate,
    .free = &detail::cuda_impl::cuda_free,
    .zero = &detail::cuda_impl::cuda_zero,
    .device_count = &detail::cuda_impl::cuda_device_count,
    .copy = &detail::cuda_impl::cuda_copy,
    .synchronize = &detail::cuda_impl::cuda_synchronize,
    .host_alloc = &detail::cuda_impl::cuda_host_alloc,
    .host_free = &detail::cuda_impl::cuda_host_free,
};

namespace kc = kernels::cuda::cuda_impl;
constexpr kernels::cuda::CudaKernelOps kKernels{
    .gemm = &kc::gemm,
    .pack_bf16 = &kc::pack_bf16,
    .gemm_on_bf16_copies = &kc::gemm_on_bf16_copies,
    .gemm_strided_batched_on_bf16_a = &kc::gemm_strided_batched_on_bf16_a,
    .cublas_load_error = &kc::cublas_load_error,
    .sum = &kc::sum,
    .sum_squares = &kc::sum_squares,
    .max_abs = &kc::max_abs,
    .add = &kc::add,
    .sub = &kc::sub,
    .mul = &kc::mul,
    .scale = &kc::scale,
    .axpy = &kc::axpy,
    .axpby = &kc::axpby,
    .fill = &kc::fill,
    .cast = &kc::cast,
    .copy_bytes = &kc::copy_bytes,
    .broadcast_rows = &kc::broadcast_rows,
    .sum_rows = &kc::sum_rows,
    .gelu = &kc::gelu,
    .gelu_backward = &kc::gelu_backward,
    .layer_norm = &kc::layer_norm,
    .layer_norm_backward = &kc::layer_norm_backward,
    .causal_softmax = &kc::causal_softmax,
    .causal_softmax_backward = &kc::causal_softmax_backward,
    .gemm_strided_batched = &kc::gemm_strided_batched,
    .flash_attention_supported = &kc::flash_attention_supported,
    .flash_attention = &kc::flash_attention,
    .flash_attention_backward = &kc::flash_attention_backward,
    .cross_entropy = &kc::cross_entropy,
    .cross_entropy_backward = &kc::cross_entropy_backward,
    .embedding = &kc::embedding,
    .embedding_backward = &kc::embedding_backward,
    .copy_2d = &kc::copy_2d,
};

namespace oc = optim::cuda::cuda_impl;
constexpr optim::cuda::CudaOptimOps kOptim{.adam_step = &oc::adam_step, .sgd_step = &oc::sgd_step};

constexpr comm::NcclBackendOps kNccl{.create_group = &comm::cuda_impl::create_nccl_group};

// The one write of each registry (Note [cuda component]): this object's constructor runs during static
// initialisation of every program that links shardkit::cuda.
struct Registration {
  Registration() {
    detail::register_cuda_memory(&kMemory);
    kernels::cuda::register_cuda_kernels(&kKernels);
    optim::cuda::register_cuda_optim_kernels(&kOptim);
    comm::register_nccl_backend(&kNccl);
  }
};
const Registration kRegistration;

}  // namespace
}  // namespace shardkit

extern "C" void shardkit_cuda_component_anchor() {}
