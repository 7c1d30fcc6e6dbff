// cuBLAS sgemm for row-major matrices.
//
// Note [row-major through column-major cuBLAS]: a row-major matrix with leading dimension ld is the
// column-major matrix of its transpose with the same ld. Row-major C = op(A) op(B) is therefore
// column-major C^T = op(B)^T op(A)^T: call cublasSgemm with the operands swapped (B first), the same
// transpose flags, and the dimensions (n, m, k). Handles use cuBLAS's default math mode: full fp32
// (no TF32 tensor-core rounding), so results agree with the CPU GEMM to fp32 rounding. Below
// MatmulPrecision::highest the same products go through cublasGemmEx / cublasGemmStridedBatchedEx with fp32
// operands and results and a FAST_TF32 / FAST_16BF compute type: tensor cores on rounded operands, fp32
// accumulation (Note [matmul precision] in common/tensor/matmul_precision.h).
//
// Note [cuBLAS loaded on first use]: linking libcublas (and the 540 MB libcublasLt it pulls in) costs
// every process that links the CUDA kernels (shardkit::cuda) 0.1-0.15 s at start-up (their static
// initialisers), measured here. Every test case is its own process under ctest, so that start-up cost
// multiplies. cuBLAS is therefore opened with dlopen the first time a CUDA GEMM runs,
// and its entry points are looked up once (an immutable table after that: no mutable global state).
#include <cublas_v2.h>
#include <dlfcn.h>

#include <limits>
#include <map>
#include <string>

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

struct CublasApi {
  std::string error;  // empty when every entry point was found
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSgemm_v2) sgemm = nullptr;
  decltype(&cublasSgemmStridedBatched) sgemm_strided_batched = nullptr;
  // Spelled out: C++ sees a second overload of each (a wrapper taking a cudaDataType compute type).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const void*,
                            const void*, cudaDataType, int, const void*, cudaDataType, int, const void*, void*,
                            cudaDataType, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
  cublasStatus_t (*gemm_strided_batched_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                                            const void*, const void*, cudaDataType, int, long long, const void*,
                                            cudaDataType, int, long long, const void*, void*, cudaDataType, int,
                                            long long, int, cublasComputeType_t, cublasGemmAlgo_t) = nullptr;
};

CublasApi LoadCublas() {
  CublasApi api;
  // The soname first (found through the loader's paths), then the library the build linked against, then the
  // neighbouring majors: the entry points below have kept their signatures since CUDA 11, and a machine's
  // cuBLAS (PyTorch's pip package, say) need not match the toolkit this was built with.
  void* lib = nullptr;
  for (const char* name : {SHARDKIT_CUBLAS_SONAME, SHARDKIT_CUBLAS_PATH, "libcublas.so.13", "libcublas.so.12"}) {
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
  }
  if (lib == nullptr) {
    const char* why = dlerror();
    api.error = std::string("cannot load cuBLAS (" SHARDKIT_CUBLAS_SONAME ", " SHARDKIT_CUBLAS_PATH
                            ", libcublas.so.13 or libcublas.so.12): ") +
                (why != nullptr ? why : "unknown dlopen error");
    return api;
  }
  // Never dlclose'd: handles may be destroyed at thread exit until the process ends.
  auto find = [&](auto& fn, const char* name) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, name));
    if (fn == nullptr && api.error.empty()) api.error = std::string("cuBLAS has no symbol ") + name;
  };
  find(api.create, "cublasCreate_v2");
  find(api.destroy, "cublasDestroy_v2");
  find(api.set_stream, "cublasSetStream_v2");
  find(api.sgemm, "cublasSgemm_v2");
  find(api.sgemm_strided_batched, "cublasSgemmStridedBatched");
  find(api.gemm_ex, "cublasGemmEx");
  find(api.gemm_strided_batched_ex, "cublasGemmStridedBatchedEx");
  return api;
}

const CublasApi& Cublas() {
  static const CublasApi api = LoadCublas();  // thread-safe one-time initialisation
  return api;
}

const CublasApi& CheckedCublas() {
  const CublasApi& api = Cublas();
  SK_CHECK(api.error.empty()) << api.error;
  return api;
}

// One cuBLAS handle per (thread, device): a handle is bound to a stream and is not safe to share
// between threads that set streams. Destroyed when the thread exits.
class ThreadHandles {
 public:
  ~ThreadHandles() {
    for (auto& [device, handle] : handles_) Cublas().destroy(handle);
  }
  cublasHandle_t get(int device) {
    auto it = handles_.find(device);
    if (it != handles_.end()) return it->second;
    cublasHandle_t h = nullptr;
    const cublasStatus_t s = CheckedCublas().create(&h);
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

// The compute type of an fp32 GEMM below MatmulPrecision::highest.
cublasComputeType_t ReducedComputeType(MatmulPrecision p) {
  return p == MatmulPrecision::medium ? CUBLAS_COMPUTE_32F_FAST_16BF : CUBLAS_COMPUTE_32F_FAST_TF32;
}

}  // namespace

namespace cuda_impl {

void gemm(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c,
          std::int64_t ldc, MatmulPrecision precision) {
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
  const CublasApi& api = CheckedCublas();
  cublasHandle_t h = HandleFor(device.index);
  cublasStatus_t s = api.set_stream(h, cudaStreamPerThread);
  SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cublasSetStream: " << CublasStatusName(s);
  // See Note [row-major through column-major cuBLAS].
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (precision == MatmulPrecision::highest) {
    s = api.sgemm(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
                  static_cast<int>(ldb), a, static_cast<int>(lda), &beta, c, static_cast<int>(ldc));
  } else {
    s = api.gemm_ex(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
                    CUDA_R_32F, static_cast<int>(ldb), a, CUDA_R_32F, static_cast<int>(lda), &beta, c, CUDA_R_32F,
                    static_cast<int>(ldc), ReducedComputeType(precision), CUBLAS_GEMM_DEFAULT);
  }
  SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cuBLAS GEMM (m=" << m << ", n=" << n << ", k=" << k << ", precision "
                                       << matmul_precision_name(precision) << "): " << CublasStatusName(s);
}

void gemm_strided_batched(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                          std::int64_t k, float alpha, const float* a, std::int64_t lda, std::int64_t stride_a,
                          const float* b, std::int64_t ldb, std::int64_t stride_b, float beta, float* c,
                          std::int64_t ldc, std::int64_t stride_c, std::int64_t batches, MatmulPrecision precision) {
  SK_CHECK(m >= 0 && n >= 0 && k >= 0 && batches >= 0)
      << "cuda::gemm_strided_batched: negative size m=" << m << " n=" << n << " k=" << k << " batches=" << batches;
  constexpr std::int64_t kMax = std::numeric_limits<int>::max();
  SK_CHECK(m <= kMax && n <= kMax && k <= kMax && lda <= kMax && ldb <= kMax && ldc <= kMax && batches <= kMax)
      << "cuda::gemm_strided_batched: sizes exceed cuBLAS's int range";
  if (m == 0 || n == 0 || batches == 0) return;
  if (k == 0 || alpha == 0.f) {
    for (std::int64_t i = 0; i < batches; ++i) {
      gemm(device, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c + i * stride_c, ldc, precision);
    }
    return;
  }
  DeviceGuard guard(device);
  const CublasApi& api = CheckedCublas();
  cublasHandle_t h = HandleFor(device.index);
  cublasStatus_t s = api.set_stream(h, cudaStreamPerThread);
  SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cublasSetStream: " << CublasStatusName(s);
  // Operands swapped as in Note [row-major through column-major cuBLAS].
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (precision == MatmulPrecision::highest) {
    s = api.sgemm_strided_batched(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                                  &alpha, b, static_cast<int>(ldb), stride_b, a, static_cast<int>(lda), stride_a,
                                  &beta, c, static_cast<int>(ldc), stride_c, static_cast<int>(batches));
  } else {
    s = api.gemm_strided_batched_ex(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                                    &alpha, b, CUDA_R_32F, static_cast<int>(ldb), stride_b, a, CUDA_R_32F,
                                    static_cast<int>(lda), stride_a, &beta, c, CUDA_R_32F, static_cast<int>(ldc),
                                    stride_c, static_cast<int>(batches), ReducedComputeType(precision),
                                    CUBLAS_GEMM_DEFAULT);
  }
  SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cuBLAS strided batched GEMM (m=" << m << ", n=" << n << ", k=" << k
                                       << ", batches=" << batches << ", precision "
                                       << matmul_precision_name(precision) << "): " << CublasStatusName(s);
}

std::string cublas_load_error() { return Cublas().error; }

}  // namespace cuda_impl
}  // namespace shardkit::kernels::cuda
