// The kernels::cuda functions in the CPU library: each forwards to the implementation that shardkit::cuda
// registers (Note [cuda component] in common/cuda/cuda_component.h), or throws InternalError saying why CUDA
// is absent from this program.
#include <string>

#include "common/base/check.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/startup_registry.h"

namespace shardkit::kernels::cuda {
namespace {

constinit detail::StartupRegistry<CudaKernelOps> g_cuda_kernels;  // written once, at static-init time

const CudaKernelOps& Ops(const char* what) {
  const CudaKernelOps* ops = g_cuda_kernels.get();
  if (ops == nullptr) throw InternalError(std::string(what) + ": " + detail::cuda_unavailable_reason());
  return *ops;
}

}  // namespace

void register_cuda_kernels(const CudaKernelOps* ops) { g_cuda_kernels.set(ops, "CUDA kernels"); }

void gemm(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc) {
  Ops("cuda::gemm").gemm(device, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
std::string cublas_load_error() {
  const CudaKernelOps* ops = g_cuda_kernels.get();
  return ops != nullptr ? ops->cublas_load_error() : detail::cuda_unavailable_reason();
}
double sum(Device device, const void* x, DType dtype, std::int64_t n) {
  return Ops("cuda::sum").sum(device, x, dtype, n);
}
double sum_squares(Device device, const void* x, DType dtype, std::int64_t n) {
  return Ops("cuda::sum_squares").sum_squares(device, x, dtype, n);
}
double max_abs(Device device, const void* x, DType dtype, std::int64_t n) {
  return Ops("cuda::max_abs").max_abs(device, x, dtype, n);
}
void add(Device device, const float* a, const float* b, float* out, std::int64_t n) {
  Ops("cuda::add").add(device, a, b, out, n);
}
void sub(Device device, const float* a, const float* b, float* out, std::int64_t n) {
  Ops("cuda::sub").sub(device, a, b, out, n);
}
void mul(Device device, const float* a, const float* b, float* out, std::int64_t n) {
  Ops("cuda::mul").mul(device, a, b, out, n);
}
void scale(Device device, float s, const float* a, float* out, std::int64_t n) {
  Ops("cuda::scale").scale(device, s, a, out, n);
}
void axpy(Device device, float alpha, const float* x, float* y, std::int64_t n) {
  Ops("cuda::axpy").axpy(device, alpha, x, y, n);
}
void axpby(Device device, float alpha, const float* x, float beta, float* y, std::int64_t n) {
  Ops("cuda::axpby").axpby(device, alpha, x, beta, y, n);
}
void fill(Device device, float* x, std::int64_t n, float value) { Ops("cuda::fill").fill(device, x, n, value); }
void cast(Device device, const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n) {
  Ops("cuda::cast").cast(device, src, src_dtype, dst, dst_dtype, n);
}
void copy_bytes(const void* src, Device src_device, void* dst, Device dst_device, std::size_t nbytes) {
  Ops("cuda::copy_bytes").copy_bytes(src, src_device, dst, dst_device, nbytes);
}

}  // namespace shardkit::kernels::cuda
