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
// (Note [bf16 operand copies]) where medium_gemm_runs_on_bf16_copies (bf16_gemm_plan.h) says the copies pay, else
// runs as "high".
//
// Note [bf16 operand copies]: cuBLAS's FAST_16BF compute type on fp32 operands only *allows* bf16; on an H200
// (stop 32) it ran TF32 kernels for every GPT-2 GEMM (the kernel names said tf32, the results were TF32's), at
// TF32's speed. So "medium" rounds each operand to bf16 itself (round to nearest even, the CPU's f32_to_bf16) into
// a stream-ordered scratch buffer from the device's memory pool, and multiplies bf16 x bf16 -> fp32 with the
// CUBLAS_COMPUTE_32F compute type. The copies are packed and padded (Note [padded bf16 copies] in
// bf16_gemm_plan.h): the matrices of a batch one after another, every dimension a multiple of 8 elements, so an
// operand with an odd leading dimension or k (the vocabulary's 50257) or strided heads (attention's Q, K, V inside
// the qkv rows) still meets the alignment that cuBLAS's fastest tensor-core kernels need. The copies cost one read
// of each fp32 operand and one bf16 write (the copy kernel stores 16 bytes at a time, and loads 16 when the source
// allows); they are freed on the stream when the GEMM is queued. They are scratch, like cuBLAS's own workspace:
// not in the memory ledger.
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
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <string>

#include "common/kernels/cuda/bf16_gemm_plan.h"
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

// Two fp32 values as one word of two bf16 (round to nearest even), the first in the low half (the lower address).
__device__ __forceinline__ unsigned PackTwo(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  unsigned u;
  memcpy(&u, &h, sizeof(u));
  return u;
}

// Writes the packed bf16 copy `s` of src (Note [padded bf16 copies] in bf16_gemm_plan.h), one group of 8
// elements (a 16-byte store) per thread and step; `vector_loads`: every full group's source is 16-byte aligned.
__global__ void PackBf16Kernel(const float* __restrict__ src, __nv_bfloat16* __restrict__ dst, const PackShape s,
                               bool vector_loads) {
  const std::int64_t groups = s.groups();
  for (std::int64_t g = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const PackGroup pg = pack_group(s, g);
    float v[kBf16PadTo];
    if (pg.valid == kBf16PadTo && vector_loads) {
      const float4 x0 = *reinterpret_cast<const float4*>(src + pg.src);
      const float4 x1 = *reinterpret_cast<const float4*>(src + pg.src + 4);
      v[0] = x0.x, v[1] = x0.y, v[2] = x0.z, v[3] = x0.w, v[4] = x1.x, v[5] = x1.y, v[6] = x1.z, v[7] = x1.w;
    } else {
#pragma unroll
      for (int e = 0; e < kBf16PadTo; ++e) v[e] = e < pg.valid ? src[pg.src + e] : 0.f;
    }
    const uint4 out = {PackTwo(v[0], v[1]), PackTwo(v[2], v[3]), PackTwo(v[4], v[5]), PackTwo(v[6], v[7])};
    *reinterpret_cast<uint4*>(dst + pg.dst) = out;
  }
}

// Writes the packed bf16 copy `s` of src into dst (s.numel() elements) on the calling thread's stream.
void LaunchPack(const float* src, const PackShape& s, __nv_bfloat16* dst) {
  if (s.numel() == 0) return;
  const bool vector_loads = Aligned(src, 16) && s.ld % 4 == 0 && (s.batches == 1 || s.stride % 4 == 0);
  const std::int64_t blocks = std::min<std::int64_t>((s.groups() + kThreads - 1) / kThreads, 4096);
  PackBf16Kernel<<<static_cast<unsigned>(blocks), kThreads, 0, cudaStreamPerThread>>>(src, dst, s, vector_loads);
  CheckLaunch("cuda::gemm bf16 operand copy");
}

// The packed bf16 copy `s` of src (Note [bf16 operand copies]), in scratch of its own.
class PackedCopy : public StreamScratch<__nv_bfloat16> {
 public:
  PackedCopy(const float* src, const PackShape& s) : StreamScratch(s.numel()) { LaunchPack(src, s, get()); }
};

// Copies `batches` matrices of m rows of n floats between C (leading dimension ldc, stride_c apart) and the
// staging buffer (plan.ldc, plan.stride_c), in the direction `to_staging`.
void CopyStaged(float* c, std::int64_t ldc, std::int64_t stride_c, float* staging, const Bf16GemmPlan& plan,
                std::int64_t m, std::int64_t n, std::int64_t batches, bool to_staging) {
  for (std::int64_t i = 0; i < batches; ++i) {
    float* cb = c + i * stride_c;
    float* sb = staging + i * plan.stride_c;
    const std::size_t c_pitch = static_cast<std::size_t>(ldc) * sizeof(float);
    const std::size_t s_pitch = static_cast<std::size_t>(plan.ldc) * sizeof(float);
    SK_CUDA_CHECK(cudaMemcpy2DAsync(to_staging ? sb : cb, to_staging ? s_pitch : c_pitch, to_staging ? cb : sb,
                                    to_staging ? c_pitch : s_pitch, static_cast<std::size_t>(n) * sizeof(float),
                                    static_cast<std::size_t>(m), cudaMemcpyDeviceToDevice, cudaStreamPerThread));
  }
}

// Row-major C_b = alpha op(A_b) op(B_b) + beta C_b for b < batches on the padded bf16 copies a16, b16 laid out as
// plan.a, plan.b (Note [padded bf16 copies]), fp32 accumulation and C; the operands swapped as in Note [row-major
// through column-major cuBLAS].
cublasStatus_t GemmOnPackedCopies(cublasHandle_t h, const Bf16GemmPlan& plan, bool trans_a, bool trans_b,
                                  std::int64_t m, std::int64_t n, float alpha, const __nv_bfloat16* a16,
                                  const __nv_bfloat16* b16, float beta, float* c, std::int64_t ldc,
                                  std::int64_t stride_c, std::int64_t batches) {
  const StreamScratch<float> staging(plan.staged ? batches * plan.stride_c : 0);
  float* const out = plan.staged ? staging.get() : c;
  if (plan.staged && beta != 0.f) CopyStaged(c, ldc, stride_c, out, plan, m, n, batches, true);
  const CublasApi& api = CheckedCublas();
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cublasStatus_t s;
  if (batches == 1) {
    s = api.gemm_ex(h, op_b, op_a, static_cast<int>(plan.n), static_cast<int>(m), static_cast<int>(plan.k), &alpha,
                    b16, CUDA_R_16BF, static_cast<int>(plan.b.pad_cols), a16, CUDA_R_16BF,
                    static_cast<int>(plan.a.pad_cols), &beta, out, CUDA_R_32F, static_cast<int>(plan.ldc),
                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  } else {
    s = api.gemm_strided_batched_ex(h, op_b, op_a, static_cast<int>(plan.n), static_cast<int>(m),
                                    static_cast<int>(plan.k), &alpha, b16, CUDA_R_16BF,
                                    static_cast<int>(plan.b.pad_cols),
                                    plan.b.copy_stride(), a16, CUDA_R_16BF,
                                    static_cast<int>(plan.a.pad_cols), plan.a.copy_stride(), &beta, out, CUDA_R_32F,
                                    static_cast<int>(plan.ldc), plan.stride_c, static_cast<int>(batches),
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  }
  if (s == CUBLAS_STATUS_SUCCESS && plan.staged) CopyStaged(c, ldc, stride_c, out, plan, m, n, batches, false);
  return s;
}

// The same on fp32 A and B, copied to bf16 first (Note [bf16 operand copies]).
cublasStatus_t GemmOnBf16Copies(cublasHandle_t h, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                                std::int64_t k, float alpha, const float* a, std::int64_t lda, std::int64_t stride_a,
                                const float* b, std::int64_t ldb, std::int64_t stride_b, float beta, float* c,
                                std::int64_t ldc, std::int64_t stride_c, std::int64_t batches) {
  const Bf16GemmPlan plan =
      plan_bf16_gemm(trans_a, trans_b, m, n, k, lda, stride_a, ldb, stride_b, ldc, stride_c, batches, Aligned(c, 16));
  const PackedCopy a16(a, plan.a), b16(b, plan.b);
  return GemmOnPackedCopies(h, plan, trans_a, trans_b, m, n, alpha, a16.get(), b16.get(), beta, c, ldc, stride_c,
                            batches);
}

// cuBLAS's handle for `device` on the calling thread's stream.
cublasHandle_t HandleOnStream(int device) {
  cublasHandle_t h = HandleFor(device);
  const cublasStatus_t s = CheckedCublas().set_stream(h, cudaStreamPerThread);
  SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cublasSetStream: " << CublasStatusName(s);
  return h;
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
  cublasHandle_t h = HandleOnStream(device.index);
  cublasStatus_t s;
  // See Note [row-major through column-major cuBLAS].
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (precision == MatmulPrecision::highest) {
    s = api.sgemm(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
                  static_cast<int>(ldb), a, static_cast<int>(lda), &beta, c, static_cast<int>(ldc));
  } else if (precision == MatmulPrecision::high || !medium_gemm_runs_on_bf16_copies(m, n, k)) {
    s = api.gemm_ex(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k), &alpha, b,
                    CUDA_R_32F, static_cast<int>(ldb), a, CUDA_R_32F, static_cast<int>(lda), &beta, c, CUDA_R_32F,
                    static_cast<int>(ldc), CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT);
  } else {
    s = GemmOnBf16Copies(h, trans_a, trans_b, m, n, k, alpha, a, lda, 0, b, ldb, 0, beta, c, ldc, 0, 1);
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
  cublasHandle_t h = HandleOnStream(device.index);
  cublasStatus_t s;
  // Operands swapped as in Note [row-major through column-major cuBLAS].
  const cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  if (precision == MatmulPrecision::highest) {
    s = api.sgemm_strided_batched(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                                  &alpha, b, static_cast<int>(ldb), stride_b, a, static_cast<int>(lda), stride_a,
                                  &beta, c, static_cast<int>(ldc), stride_c, static_cast<int>(batches));
  } else if (precision == MatmulPrecision::high || !medium_gemm_runs_on_bf16_copies(m, n, k)) {
    s = api.gemm_strided_batched_ex(h, op_b, op_a, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                                    &alpha, b, CUDA_R_32F, static_cast<int>(ldb), stride_b, a, CUDA_R_32F,
                                    static_cast<int>(lda), stride_a, &beta, c, CUDA_R_32F, static_cast<int>(ldc),
                                    stride_c, static_cast<int>(batches), CUBLAS_COMPUTE_32F_FAST_TF32,
                                    CUBLAS_GEMM_DEFAULT);
  } else {
    s = GemmOnBf16Copies(h, trans_a, trans_b, m, n, k, alpha, a, lda, stride_a, b, ldb, stride_b, beta, c, ldc,
                         stride_c, batches);
  }
  SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cuBLAS strided batched GEMM (m=" << m << ", n=" << n << ", k=" << k
                                       << ", batches=" << batches << ", precision "
                                       << matmul_precision_name(precision) << "): " << CublasStatusName(s);
}

// pack_bf16, gemm_on_bf16_copies and gemm_strided_batched_on_bf16_a: their arguments are checked by the dispatch
// (cuda_kernels_dispatch.cc).
void pack_bf16(Device device, const float* src, std::int64_t rows, std::int64_t cols, std::int64_t ld, void* dst) {
  if (rows == 0 || cols == 0) return;
  DeviceGuard guard(device);
  LaunchPack(src, pack_shape(rows, cols, ld, 0, 1), static_cast<__nv_bfloat16*>(dst));
}

void gemm_on_bf16_copies(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                         float alpha, const void* a16, const void* b16, float beta, float* c, std::int64_t ldc) {
  DeviceGuard guard(device);
  if (alpha == 0.f) {  // as gemm: C = beta C without reading the operands
    ScaleMatrixKernel<<<GridFor(m * n), kThreads, 0, cudaStreamPerThread>>>(c, m, n, ldc, beta);
    CheckLaunch("cuda::gemm_on_bf16_copies scale");
    return;
  }
  // The copies' layout depends only on each operand's stored shape, so any leading dimension plans them.
  const Bf16GemmPlan plan = plan_bf16_gemm(trans_a, trans_b, m, n, k, trans_a ? m : k, 0, trans_b ? k : n, 0, ldc, 0,
                                           1, Aligned(c, 16));
  const cublasStatus_t s =
      GemmOnPackedCopies(HandleOnStream(device.index), plan, trans_a, trans_b, m, n, alpha,
                         static_cast<const __nv_bfloat16*>(a16), static_cast<const __nv_bfloat16*>(b16), beta, c, ldc,
                         0, 1);
  SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cuBLAS GEMM on bf16 copies (m=" << m << ", n=" << n << ", k=" << k
                                       << "): " << CublasStatusName(s);
}

void gemm_strided_batched_on_bf16_a(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                                    std::int64_t k, float alpha, const void* a16, const float* b, std::int64_t ldb,
                                    std::int64_t stride_b, float beta, float* c, std::int64_t ldc,
                                    std::int64_t stride_c, std::int64_t batches) {
  DeviceGuard guard(device);
  if (alpha == 0.f) {  // as gemm: C = beta C without reading the operands
    for (std::int64_t i = 0; i < batches; ++i) {
      ScaleMatrixKernel<<<GridFor(m * n), kThreads, 0, cudaStreamPerThread>>>(c + i * stride_c, m, n, ldc, beta);
    }
    CheckLaunch("cuda::gemm_strided_batched_on_bf16_a scale");
    return;
  }
  // A's copy is laid out by A's stored shape alone (its packed matrices one after another), so any lda plans it;
  // B is copied here, as GemmOnBf16Copies copies it.
  const Bf16GemmPlan plan = plan_bf16_gemm(trans_a, trans_b, m, n, k, trans_a ? m : k, 0, ldb, stride_b, ldc,
                                           stride_c, batches, Aligned(c, 16));
  const PackedCopy b16(b, plan.b);
  const cublasStatus_t s =
      GemmOnPackedCopies(HandleOnStream(device.index), plan, trans_a, trans_b, m, n, alpha,
                         static_cast<const __nv_bfloat16*>(a16), b16.get(), beta, c, ldc, stride_c, batches);
  SK_CHECK(s == CUBLAS_STATUS_SUCCESS) << "cuBLAS strided batched GEMM on a bf16 A (m=" << m << ", n=" << n
                                       << ", k=" << k << ", batches=" << batches << "): " << CublasStatusName(s);
}

std::string cublas_load_error() { return Cublas().error; }

}  // namespace cuda_impl
}  // namespace shardkit::kernels::cuda
