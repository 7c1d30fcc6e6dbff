#include "common/kernels/gemm.h"

#include <cblas.h>

#include <algorithm>
#include <cctype>
#include <cstring>
#include <limits>
#include <mutex>

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/tensor/rank_context.h"

namespace shardkit::kernels {

void set_blas_single_threaded() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

std::string blas_core_name() {
  const char* name = openblas_get_corename();
  return name != nullptr ? std::string(name) : std::string();
}

bool cpu_runs_avx512_blas() {
#if defined(__x86_64__)
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
         __builtin_cpu_supports("avx512cd");
#else
  return false;
#endif
}

std::string blas_kernel_advice(std::string_view core_name, bool cpu_has_avx512) {
  // OpenBLAS's x86-64 kernel sets that use AVX-512 (its names, as openblas_get_corename() reports them).
  constexpr std::string_view kAvx512Cores[] = {"skylakex", "cooperlake", "sapphirerapids", "zen4", "zen5"};
  if (!cpu_has_avx512 || core_name.empty()) return "";
  std::string lower(core_name);
  for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  for (std::string_view c : kAvx512Cores) {
    if (lower == c) return "";
  }
  return "OpenBLAS runs its " + std::string(core_name) +
         " kernels, which do not use this CPU's AVX-512: OPENBLAS_CORETYPE=SkylakeX in the environment before the "
         "process starts selects its AVX-512 kernels (GEMM 1.8x faster on Zen 5, not measured on other CPUs; Note "
         "[BLAS kernel choice] in common/kernels/gemm.h)";
}

namespace {

void CheckGemmArgs(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, std::int64_t lda,
                   std::int64_t ldb, std::int64_t ldc) {
  SK_CHECK(m >= 0 && n >= 0 && k >= 0) << "gemm: negative size m=" << m << " n=" << n << " k=" << k;
  constexpr std::int64_t kMax = std::numeric_limits<blasint>::max();
  SK_CHECK(m <= kMax && n <= kMax && k <= kMax && lda <= kMax && ldb <= kMax && ldc <= kMax)
      << "gemm: sizes exceed the BLAS integer range";
  // Row-major: a stored matrix's leading dimension is at least its column count (and at least 1).
  const std::int64_t a_cols = trans_a ? m : k;
  const std::int64_t b_cols = trans_b ? k : n;
  SK_CHECK_GE(lda, std::max<std::int64_t>(1, a_cols)) << "gemm: lda for " << (trans_a ? "A^T" : "A");
  SK_CHECK_GE(ldb, std::max<std::int64_t>(1, b_cols)) << "gemm: ldb for " << (trans_b ? "B^T" : "B");
  SK_CHECK_GE(ldc, std::max<std::int64_t>(1, n)) << "gemm: ldc";
}

// C = beta * C over m x n (the k == 0 case); beta == 0 writes zeros whatever C held (BLAS semantics).
void ScaleC(std::int64_t m, std::int64_t n, float beta, float* c, std::int64_t ldc) {
  for (std::int64_t i = 0; i < m; ++i) {
    float* row = c + i * ldc;
    if (beta == 0.f) {
      std::fill(row, row + n, 0.f);
    } else {
      for (std::int64_t j = 0; j < n; ++j) row[j] *= beta;
    }
  }
}

}  // namespace

void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc) {
  CheckGemmArgs(trans_a, trans_b, m, n, k, lda, ldb, ldc);
  if (m == 0 || n == 0) return;
  if (k == 0 || alpha == 0.f) {
    ScaleC(m, n, beta, c, ldc);
    return;
  }
  set_blas_single_threaded();
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
              static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k), alpha, a,
              static_cast<blasint>(lda), b, static_cast<blasint>(ldb), beta, c, static_cast<blasint>(ldc));
}

void matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_a, bool trans_b, float beta) {
  SK_CHECK(a.dim() == 2 && b.dim() == 2 && out.dim() == 2)
      << "matmul needs 2-D tensors, got a " << a.describe() << ", b " << b.describe() << ", out " << out.describe();
  SK_CHECK(a.dtype() == DType::f32 && b.dtype() == DType::f32 && out.dtype() == DType::f32)
      << "matmul needs f32 tensors, got a " << a.describe() << ", b " << b.describe() << ", out " << out.describe();
  SK_CHECK(a.device() == out.device() && b.device() == out.device())
      << "matmul needs one device, got a " << a.describe() << ", b " << b.describe() << ", out " << out.describe();
  const std::int64_t m = trans_a ? a.size(1) : a.size(0);
  const std::int64_t k = trans_a ? a.size(0) : a.size(1);
  const std::int64_t kb = trans_b ? b.size(1) : b.size(0);
  const std::int64_t n = trans_b ? b.size(0) : b.size(1);
  SK_CHECK(k == kb) << "matmul: inner dimensions differ: op(a) is [" << m << ", " << k << "] (a " << a.describe()
                    << (trans_a ? ", transposed" : "") << "), op(b) is [" << kb << ", " << n << "] (b "
                    << b.describe() << (trans_b ? ", transposed" : "") << ")";
  SK_CHECK(out.size(0) == m && out.size(1) == n)
      << "matmul: out is " << out.describe() << ", expected [" << m << ", " << n << "]";
  for (const Tensor* in : {&a, &b}) {
    const bool overlap = in->storage() == out.storage() && in->nbytes() > 0 && out.nbytes() > 0 &&
                         in->offset_bytes() < out.offset_bytes() + out.nbytes() &&
                         out.offset_bytes() < in->offset_bytes() + in->nbytes();
    SK_CHECK(!overlap) << "matmul: out " << out.describe() << " overlaps an input " << in->describe();
  }
  const std::int64_t lda = std::max<std::int64_t>(1, a.size(1));
  const std::int64_t ldb = std::max<std::int64_t>(1, b.size(1));
  const std::int64_t ldc = std::max<std::int64_t>(1, n);
  if (out.numel() == 0) return;
  // k == 0 leaves a and b without data; gemm does not read them then.
  const float* pa = a.numel() > 0 ? a.data<float>() : nullptr;
  const float* pb = b.numel() > 0 ? b.data<float>() : nullptr;
  if (out.device().is_cpu()) {
    gemm(trans_a, trans_b, m, n, k, 1.f, pa, lda, pb, ldb, beta, out.data<float>(), ldc);
  } else {
    cuda::gemm(out.device(), trans_a, trans_b, m, n, k, 1.f, pa, lda, pb, ldb, beta, out.data<float>(), ldc,
               current_rank_context().matmul_precision);
  }
}

}  // namespace shardkit::kernels
