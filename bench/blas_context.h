// Records which kernels the CPU BLAS runs in a benchmark binary's context lines (Note [BLAS kernel choice] in
// common/kernels/gemm.h): GEMM speed, and with it every step time, depends on it. Include it in the benchmarks
// whose time is mostly GEMM; the context prints before the results ("blas_core: Haswell", and "blas_note: ..."
// when OpenBLAS leaves this CPU's AVX-512 unused).
#pragma once

#include <benchmark/benchmark.h>

#include <string>

#include "common/kernels/gemm.h"

namespace shardkit::bench {

inline const int kBlasContext = [] {
  benchmark::AddCustomContext("blas_core", kernels::blas_core_name());
  const std::string note = kernels::blas_kernel_advice(kernels::blas_core_name(), kernels::cpu_runs_avx512_blas());
  if (!note.empty()) benchmark::AddCustomContext("blas_note", note);
  return 0;
}();

}  // namespace shardkit::bench
