// cuBLAS sgemm for row-major matrices.
//
// Note [row-major through column-major cuBLAS]: a row-major matrix with leading dimension ld is the
// column-major matrix of its transpose with the same ld. Row-major C = op(A) op(B) is therefore
// column-major C^T = op(B)^T op(A)^T: call cublasSgemm with the operands swapped (B first), the same
// transpose flags, and the dimensions (n, m, k). Handles use cuBLAS's default math mode: full fp32
// (no TF32 tensor-core rounding), so results agree with the CPU GEMM to fp32 rounding. Below
// MatmulPrecision::highest the same products go through cublasGemmEx / cublasGemmStridedBatchedEx with fp32
// results and fp32 accumulation on tensor cores (Note [matmul precision] in common/tensor/matmul_precision.h):
// "high" hands cuBLAS the fp32 operands with the FAST_TF32 compute type; "medium" hands it bf16 copies of them
// (Note [bf16 operand copies]) where medium_gemm_uses_bf16 says the copies pay, else runs as "high".
//
// Note [bf16 operand copies]: cuBLAS's FAST_16BF compute type on fp32 operands only *allows* bf16; on an H200
// (stop 32) it ran TF32 kernels for every GPT-2 GEMM (the kernel names said tf32, the results were TF32's), at
// TF32's speed. So "medium" rounds each operand to bf16 itself (round to nearest even, the CPU's f32_to_bf16) into
// a stream-ordered scratch buffer from the device's memory pool, and multiplies bf16 x bf16 -> fp32 with the
// CUBLAS_COMPUTE_32F compute type. The copy is packed: each matrix's rows get a leading dimension rounded up to 8
// elements (16 bytes) and the matrices of a batch are stored one after another, so an operand with an odd
// leading dimension (the vocabulary's 50257 columns) or strided heads (attention's Q, K, V inside the qkv rows)
// still meets the alignment that cuBLAS's fastest tensor-core kernels need. The copies cost one read of each fp32
// operand and one bf16 write; they are freed on the stream when the GEMM is queued. They are scratch, like
// cuBLAS's own workspace: not in the memory ledger.
//
// Note [cuBLAS loaded on first use]: linking libcublas (and the 540 MB libcublasLt it pulls in) costs
// every process that links the CUDA kernels (shardkit::cuda) 0.1-0.15 s at start-up (their static
// initialisers), measured here. Every test case is its own process under ctest, so that start-up cost
// multiplies. cuBLAS is therefore opened with dlopen the first time a CUDA GEMM runs,
// and its entry points are looked up once (an immutable table after that: no mutable global state).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <dlfcn.h>

#include <algorithm>
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

// One operand of a GEMM: `batches` matrices of rows x cols, row i of matrix b at p + b * stride + i * ld.
struct Operand {
  const float* p;
  std::int64_t rows, cols, ld, stride, batches;
};

// dst[b][i][j] = bf16(src[b * stride + i * ld + j]) for j < cols, rows of dst `dld` apart, matrices rows * dld apart.
// A block is tx x ty threads: tx along a row, ty rows at a time.
__global__ void PackBf16Kernel(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, std::int64_t rows,
                               std::int64_t cols, std::int64_t ld, std::int64_t stride, std::int64_t total_rows,
                               std::int64_t dld) {
  for (std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * blockDim.y + threadIdx.y; r < total_rows;
       r += static_cast<std::int64_t>(gridDim.x) * blockDim.y) {
    const std::int64_t b = r / rows, i = r - b * rows;
    const float* in = src + b * stride + i * ld;
    __nv_bfloat16* out = dst + r * dld;
    for (std::int64_t j = threadIdx.x; j < cols; j += blockDim.x) out[j] = __float2bfloat16_rn(in[j]);
  }
}

// A packed bf16 copy of an operand (Note [bf16 operand copies]), freed on the calling thread's stream.
class Bf16Copy {
 public:
  explicit Bf16Copy(const Operand& x) : ld_((x.cols + 7) / 8 * 8), stride_(x.rows * ld_) {
    const std::int64_t total_rows = x.rows * x.batches;
    SK_CUDA_CHECK(cudaMallocAsync(&p_, static_cast<std::size_t>(total_rows * ld_) * sizeof(__nv_bfloat16),
                                  cudaStreamPerThread));
    const unsigned tx = x.cols >= 256 ? 256u : static_cast<unsigned>((x.cols + 31) / 32 * 32);
    const unsigned ty = 256u / tx;
    const std::int64_t blocks = std::min<std::int64_t>((total_rows + ty - 1) / ty, 65536);
    PackBf16Kernel<<<static_cast<unsigned>(blocks), dim3(tx, ty), 0, cudaStreamPerThread>>>(
        x.p, p_, x.rows, x.cols, x.ld, x.stride, total_rows, ld_);
    CheckLaunch("cuda::gemm bf16 operand copy");
  }
  ~Bf16Copy() { cudaFreeAsync(p_, cudaStreamPerThread); }
  Bf16Copy(const Bf16Copy&) = delete;
  Bf16Copy& operator=(const Bf16Copy&) = delete;

  const void* data() const { return p_; }
  int ld() const { return static_cast<int>(ld_); }
  long long stride() const { return stride_; }

 private:
  __nv_bfloat16* p_ = nullptr;
  std::int64_t ld_, stride_;
};

// Row-major C_b = alpha op(A_b) op(B_b) + beta C_b for b < batches on bf16 copies of A and B, fp32 accumulation
// and C (Note [bf16 operand copies]); the operands swapped as in Note [row-major through column-major cuBLAS].
cublasStatus_t GemmOnBf16Copies(cublasHandle_t h, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                                std::int64_t k, float alpha, const Operand& a, const Operand& b, float beta, float* c,
                                std::int64_t ldc, std::int64_t stride_c, std::int64_t batches) {
  const Bf16Copy a16(a), b16(b);
  const CublasApi& api = CheckedCublas();
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (batches == 1) {
    return api.gemm_ex(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha,
                       b16.data(), CUDA_R_16BF, b16.ld(), a16.data(), CUDA_R_16BF, a16.ld(), &beta, c, CUDA_R_32F,
                       static_cast<int>(ldc), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }
  return api.gemm_strided_batched_ex(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                                     &alpha, b16.data(), CUDA_R_16BF, b16.ld(), b16.stride(), a16.data(),
                                     CUDA_R_16BF, a16.ld(), a16.stride(), &beta, c, CUDA_R_32F, static_cast<int>(ldc),
                                     stride_c, static_cast<int>(batches), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

// op(A) of a row-major GEMM is [m, k]: A is stored m x k, or k x m when transposed; likewise B.
Operand OperandA(bool trans_a, std::int64_t m, std::int64_t k, const float* a, std::int64_t lda,
                 std::int64_t stride, std::int64_t batches) {
  return {a, trans_a ? k : m, trans_a ? m : k, lda, stride, batches};
}
Operand OperandB(bool trans_b, std::int64_t k, std::int64_t n, const float* b, std::int64_t ldb,
                 std::int64_t stride, std::int64_t batches) {
  return {b, trans_b ? n : k, trans_b ? k : n, ldb, stride, batches};
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
  } else if (precision == MatmulPrecision::high || !medium_gemm_uses_bf16(m, n)) {
    s = api.gemm_ex(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
                    CUDA_R_32F, static_cast<int>(ldb), a, CUDA_R_32F, static_cast<int>(lda), &beta, c, CUDA_R_32F,
                    static_cast<int>(ldc), CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT);
  } else {
    s = GemmOnBf16Copies(h, trans_a, trans_b, m, n, k, alpha, OperandA(trans_a, m, k, a, lda, 0, 1),
                         OperandB(trans_b, k, n, b, ldb, 0, 1), beta, c, ldc, 0, 1);
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
  } else if (precision == MatmulPrecision::high || !medium_gemm_uses_bf16(m, n)) {
    s = api.gemm_strided_batched_ex(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                                    &alpha, b, CUDA_R_32F, static_cast<int>(ldb), stride_b, a, CUDA_R_32F,
                                    static_cast<int>(lda), stride_a, &beta, c, CUDA_R_32F, static_cast<int>(ldc),
                                    stride_c, static_cast<int>(batches), CUBLAS_COMPUTE_32F_FAST_TF32,
                                    CUBLAS_GEMM_DEFAULT);
  } else {
    s = GemmOnBf16Copies(h, trans_a, trans_b, m, n, k, alpha, OperandA(trans_a, m, k, a, lda, stride_a, batches),
                         OperandB(trans_b, k, n, b, ldb, stride_b, batches), beta, c, ldc, stride_c, batches);
  }
  SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cuBLAS strided batched GEMM (m=" << m << ", n=" << n << ", k=" << k
                                       << ", batches=" << batches << ", precision "
                                       << matmul_precision_name(precision) << "): " << CublasStatusName(s);
}

std::string cublas_load_error() { return Cublas().error; }

}  // namespace cuda_impl
}  // namespace shardkit::kernels::cuda
