// cuBLAS sgemm for row-major matrices.
//
// Note [row-major through column-major cuBLAS]: a row-major matrix with leading dimension ld is the
// column-major matrix of its transpose with the same ld. Row-major C = op(A) op(B) is therefore
// column-major C^T = op(B)^T op(A)^T: call cublasSgemm with the operands swapped (B first), the same
// transpose flags, and the dimensions (n, m, k). Handles use cuBLAS's default math mode: full fp32
// (no TF32 tensor-core rounding), so results agree with the CPU GEMM to fp32 rounding.
#include <cublas_v2.h>

#include <limits>
#include <map>

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/cuda/cuda_util.cuh"

namespace shardkit::kernels::cuda {
namespace {

const char* CublasStatusName(cublasStatus_t s) {
  switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
    default: return "cuBLAS error";
  }
}

// One cuBLAS handle per (thread, device): a handle is bound to a stream and is not safe to share
// between threads that set streams. Destroyed when the thread exits.
class ThreadHandles {
 public:
  ~ThreadHandles() {
    for (auto& [device, handle] : handles_) cublasDestroy(handle);
  }
  cublasHandle_t get(int device) {
    auto it = handles_.find(device);
    if (it != handles_.end()) return it->second;
    cublasHandle_t h = nullptr;
    const cublasStatus_t s = cublasCreate(&h);
    SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cublasCreate on cuda:" << device << ": " << CublasStatusName(s);
    handles_.emplace(device, h);
    return h;
  }

 private:
  std::map<int, cublasHandle_t> handles_;
};

cublasHandle_t HandleFor(int device) {
  thread_local ThreadHandles handles;
  return handles.get(device);
}

__global__ void ScaleMatrixKernel(float* c, std::int64_t m, std::int64_t n, std::int64_t ldc, float beta) {
  const std::int64_t total = m * n;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<std::int64_t>(blockDim.x) * gridDim.x) {
    float* p = c + (i / n) * ldc + (i % n);
    *p = beta == 0.f ? 0.f : beta * *p;
  }
}

}  // namespace

void gemm(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc) {
  SK_CHECK(m >= 0 && n >= 0 && k >= 0) << "cuda::gemm: negative size m=" << m << " n=" << n << " k=" << k;
  constexpr std::int64_t kMax = std::numeric_limits<int>::max();
  SK_CHECK(m <= kMax && n <= kMax && k <= kMax && lda <= kMax && ldb <= kMax && ldc <= kMax)
      << "cuda::gemm: sizes exceed cuBLAS's int range";
  if (m == 0 || n == 0) return;
  DeviceGuard guard(device);
  if (k == 0 || alpha == 0.f) {
    ScaleMatrixKernel<<<GridFor(m * n), kThreads, 0, cudaStreamPerThread>>>(c, m, n, ldc, beta);
    CheckLaunch("cuda::gemm scale");
    return;
  }
  cublasHandle_t h = HandleFor(device.index);
  cublasStatus_t s = cublasSetStream(h, cudaStreamPerThread);
  SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cublasSetStream: " << CublasStatusName(s);
  // See Note [row-major through column-major cuBLAS].
  s = cublasSgemm(h, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, static_cast<int>(n),
                  static_cast<int>(m), static_cast<int>(k), &alpha, b, static_cast<int>(ldb), a, static_cast<int>(lda),
                  &beta, c, static_cast<int>(ldc));
  SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cublasSgemm(m=" << m << ", n=" << n << ", k=" << k
                                       << "): " << CublasStatusName(s);
}

}  // namespace shardkit::kernels::cuda
