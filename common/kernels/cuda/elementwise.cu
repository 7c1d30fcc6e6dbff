// fp32 elementwise kernels, dtype casts and byte copies on CUDA devices (grid-stride loops).
#include <cstring>

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/cuda/cuda_util.cuh"
#include "common/kernels/cuda/widen.cuh"

namespace shardkit::kernels::cuda {
namespace {

#define SK_GRID_STRIDE(i, n)                                                                  \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(blockDim.x) * gridDim.x)

__global__ void AddKernel(const float* a, const float* b, float* out, std::int64_t n) {
  SK_GRID_STRIDE(i, n) out[i] = a[i] + b[i];
}
__global__ void SubKernel(const float* a, const float* b, float* out, std::int64_t n) {
  SK_GRID_STRIDE(i, n) out[i] = a[i] - b[i];
}
__global__ void MulKernel(const float* a, const float* b, float* out, std::int64_t n) {
  SK_GRID_STRIDE(i, n) out[i] = a[i] * b[i];
}
__global__ void ScaleKernel(float s, const float* a, float* out, std::int64_t n) {
  SK_GRID_STRIDE(i, n) out[i] = s * a[i];
}
__global__ void AxpyKernel(float alpha, const float* x, float* y, std::int64_t n) {
  SK_GRID_STRIDE(i, n) y[i] += alpha * x[i];
}
__global__ void AxpbyKernel(float alpha, const float* x, float beta, float* y, std::int64_t n) {
  SK_GRID_STRIDE(i, n) y[i] = alpha * x[i] + beta * y[i];
}
__global__ void FillKernel(float* x, std::int64_t n, float value) {
  SK_GRID_STRIDE(i, n) x[i] = value;
}

// Casts go through fp32 exactly as convert_elements does on the CPU (see widen.cuh).
template <typename Src, typename Dst>
__global__ void CastKernel(const Src* src, Dst* dst, std::int64_t n) {
  SK_GRID_STRIDE(i, n) store_f32(dst, i, load_f32(src, i));
}

template <typename Src>
void CastFrom(const Src* src, void* dst, DType dst_dtype, std::int64_t n) {
  const unsigned grid = GridFor(n);
  switch (dst_dtype) {
    case DType::f32:
      CastKernel<<<grid, kThreads, 0, cudaStreamPerThread>>>(src, static_cast<float*>(dst), n);
      break;
    case DType::bf16:
      CastKernel<<<grid, kThreads, 0, cudaStreamPerThread>>>(src, static_cast<bf16_t*>(dst), n);
      break;
    case DType::f16:
      CastKernel<<<grid, kThreads, 0, cudaStreamPerThread>>>(src, static_cast<f16_t*>(dst), n);
      break;
    case DType::i64:
      CastKernel<<<grid, kThreads, 0, cudaStreamPerThread>>>(src, static_cast<std::int64_t*>(dst), n);
      break;
  }
}

}  // namespace

namespace cuda_impl {

#define SK_LAUNCH(name, kernel, ...)                                           \
  do {                                                                         \
    if (n == 0) return;                                                        \
    DeviceGuard guard(device);                                                 \
    kernel<<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(__VA_ARGS__);     \
    CheckLaunch(name);                                                         \
  } while (0)

void add(Device device, const float* a, const float* b, float* out, std::int64_t n) {
  SK_LAUNCH("cuda::add", AddKernel, a, b, out, n);
}
void sub(Device device, const float* a, const float* b, float* out, std::int64_t n) {
  SK_LAUNCH("cuda::sub", SubKernel, a, b, out, n);
}
void mul(Device device, const float* a, const float* b, float* out, std::int64_t n) {
  SK_LAUNCH("cuda::mul", MulKernel, a, b, out, n);
}
void scale(Device device, float s, const float* a, float* out, std::int64_t n) {
  SK_LAUNCH("cuda::scale", ScaleKernel, s, a, out, n);
}
void axpy(Device device, float alpha, const float* x, float* y, std::int64_t n) {
  SK_LAUNCH("cuda::axpy", AxpyKernel, alpha, x, y, n);
}
void axpby(Device device, float alpha, const float* x, float beta, float* y, std::int64_t n) {
  SK_LAUNCH("cuda::axpby", AxpbyKernel, alpha, x, beta, y, n);
}
void fill(Device device, float* x, std::int64_t n, float value) { SK_LAUNCH("cuda::fill", FillKernel, x, n, value); }

void cast(Device device, const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  if (src_dtype == dst_dtype) {
    if (src != dst) {
      SK_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<std::size_t>(n) * dtype_size(src_dtype),
                                    cudaMemcpyDeviceToDevice, cudaStreamPerThread));
    }
    return;
  }
  switch (src_dtype) {
    case DType::f32: CastFrom(static_cast<const float*>(src), dst, dst_dtype, n); break;
    case DType::bf16: CastFrom(static_cast<const bf16_t*>(src), dst, dst_dtype, n); break;
    case DType::f16: CastFrom(static_cast<const f16_t*>(src), dst, dst_dtype, n); break;
    case DType::i64: CastFrom(static_cast<const std::int64_t*>(src), dst, dst_dtype, n); break;
  }
  CheckLaunch("cuda::cast");
}

void copy_bytes(const void* src, Device src_device, void* dst, Device dst_device, std::size_t nbytes) {
  if (nbytes == 0) return;
  if (src_device.is_cpu() && dst_device.is_cpu()) {
    std::memmove(dst, src, nbytes);
    return;
  }
  // Unified addressing: cudaMemcpyDefault works out the direction (host, device, or peer device). The
  // copy runs on the source device's per-thread stream, so it is ordered after the kernels that the
  // calling thread launched to produce the source (cast() relies on this for its staging buffer).
  DeviceGuard guard(src_device.is_cuda() ? src_device : dst_device);
  SK_CUDA_CHECK(cudaMemcpyAsync(dst, src, nbytes, cudaMemcpyDefault, cudaStreamPerThread));
  SK_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
}

}  // namespace cuda_impl
}  // namespace shardkit::kernels::cuda
