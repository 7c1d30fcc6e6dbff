// Dense matrix multiply (DESIGN.md section 2): CPU through CBLAS (OpenBLAS), CUDA through cuBLAS.
//
// Everything here is row-major: a matrix with leading dimension ld stores element (i, j) at [i * ld + j].
//
// Threads: one BLAS thread per rank (Note [one BLAS thread]). The functions are thread-safe: simulated
// ranks (threads of one process) may call them concurrently on their own buffers.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "common/tensor/tensor.h"

namespace shardkit::kernels {

// Note [one BLAS thread]: every rank is one thread (simulated ranks) or one process per core, so a
// multi-threaded BLAS would oversubscribe the cores and fight the communication threads. OpenBLAS's
// thread count is process-wide; set_blas_single_threaded() sets it to 1 once per process (idempotent,
// std::call_once) and gemm() calls it on first use, so callers never need to.
void set_blas_single_threaded();

// Note [BLAS kernel choice]
// OpenBLAS picks its GEMM kernels for the CPU when it is loaded, and a release older than the CPU does not know
// it: Debian 12's OpenBLAS 0.3.21 runs its AVX2 "Haswell" kernels on AMD Zen 5 (family 26), which has AVX-512.
// Forced to its AVX-512 kernels (OPENBLAS_CORETYPE=SkylakeX in the environment before the process starts; it
// cannot be changed once the library is loaded), GEMM went from 122 to 222 GFLOP/s there and model_bench's
// gpt-10m step from 1.69k to 2.91k tokens/s (quiet VM, two runs each, alternated: `OPENBLAS_CORETYPE=SkylakeX
// build/bench/model_bench --benchmark_filter=gpt-10m` against the same without it; 78 -> 140 GFLOP/s with a
// build running beside it). The library does not set it (environment variables are the user's), but says it:
// blas_kernel_advice() returns the sentence shardkit-train prints at start and the benchmarks record. Only Zen 5
// was measured; on other CPUs with AVX-512 that OpenBLAS does not know (Zen 4 with 0.3.21) the sentence is advice.
// The name of the kernel set the CPU BLAS chose ("Haswell", "SkylakeX", ...; openblas_get_corename()).
std::string blas_core_name();
// Whether this CPU has the AVX-512 subsets OpenBLAS's SkylakeX kernels use (F, BW, DQ, VL, CD).
bool cpu_runs_avx512_blas();
// What to tell the user, "" when nothing: a kernel set without AVX-512 on a CPU that has it. A pure function.
std::string blas_kernel_advice(std::string_view core_name, bool cpu_has_avx512);

// C[m x n] = alpha * op(A)[m x k] * op(B)[k x n] + beta * C, row-major, fp32, on the CPU (cblas_sgemm).
// op(A) = A (A stored m x k, lda >= k) or A^T (A stored k x m, lda >= m); likewise B (k x n or n x k).
// ldc >= n. m, n or k may be 0: m == 0 or n == 0 touches nothing; k == 0 gives C = beta * C (C set to 0
// when beta == 0, whatever it held, as BLAS does). Bad dimensions throw InternalError (SK_CHECK).
void gemm(bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
          std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc);

// out = op(a) * op(b) + beta * out for contiguous 2-D f32 tensors on one device: a is [m, k] ([k, m] when
// trans_a), b is [k, n] ([n, k] when trans_b), out is [m, n]. CPU tensors go through gemm(); CUDA
// tensors through cuBLAS (on the calling thread's per-thread default stream, asynchronously).
// out must not overlap a or b. Wrong ranks, dtypes, devices or shapes throw InternalError naming the shapes.
void matmul(const Tensor& a, const Tensor& b, const Tensor& out, bool trans_a = false, bool trans_b = false,
            float beta = 0.f);

}  // namespace shardkit::kernels
