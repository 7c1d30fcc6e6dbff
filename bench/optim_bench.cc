// optim_bench: one fused optimizer step over >= 64 Mi elements, single-threaded, against a trivial kernel
// with the same read/write streams measured in the same binary (DESIGN.md sections 8 and 9).
//
// Cases: AdamW and SGD (momentum 0.9), fp32 parameters and bf16 parameters with fp32 master weights
// (bf16 gradients). The limit kernel reads and writes exactly the arrays, dtypes and directions the
// optimizer does, but does one add per stream:
//   AdamW fp32:        reads p, g, m, v       writes p, m, v      (28 B/elem)
//   AdamW bf16+master: reads w, g16, m, v     writes w, m, v, p16 (28 B/elem)
//   SGD fp32:          reads p, g, b          writes p, b         (20 B/elem)
//   SGD bf16+master:   reads w, g16, b        writes w, b, p16    (20 B/elem)
// The limit kernels write p16 as the truncated top half of w: they stand for the memory traffic, the bound
// the optimizer should reach. Its round-to-nearest-even costs integer instructions (several per vector
// without AVX-512 BF16) that the kernel schedules to overlap that traffic (Note [rounding lag] in
// common/optim/fused_kernels.cc); they are the optimizer's cost, not the limit's.
// Each iteration times one optimizer step and then one limit-kernel pass (on separate arrays of the same
// sizes), so both see the same machine conditions; the reported time is the optimizer's (manual time).
// Counters: ns_per_elem (median optimizer step / elements), limit_ns_per_elem, frac_of_limit = median
// limit time / median optimizer time (1.0 = the optimizer moves its bytes as fast as a kernel doing
// nothing else), GBps (bytes the algorithm must move / optimizer time); cpu_ns_per_elem and
// cpu_frac_of_limit are the same from the thread's CPU time (they do not count time the thread was
// descheduled, so they stay meaningful when other processes share the cores).
//
// Run: build-*/bench/optim_bench --benchmark_min_time=1
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/thread_timing.h"
#include "benchmark/benchmark.h"
#include "common/optim/adam.h"
#include "common/optim/sgd.h"
#include "common/tensor/tensor.h"

namespace shardkit::optim {
namespace {

constexpr std::int64_t kElements = std::int64_t{64} << 20;  // 64 Mi

using Clock = std::chrono::steady_clock;
using bench::Median;
using bench::ThreadCpuSeconds;

// Deterministic, cheap fills written straight into the tensors (64 Mi normal draws would dominate start-up).
Tensor Filled(DType dtype, std::int64_t n, MemoryCategory category, float (*value)(std::int64_t)) {
  Tensor f32 = Tensor::empty({n}, TensorOptions{}.with_category(category));
  float* d = f32.data<float>();
  for (std::int64_t i = 0; i < n; ++i) d[i] = value(i);
  if (dtype == DType::f32) return f32;
  return f32.to(dtype, category);
}
float WeightValue(std::int64_t i) { return static_cast<float>(static_cast<std::int64_t>((i * 2654435761u) % 2001) - 1000) * 5e-4f; }
float GradValue(std::int64_t i) { return static_cast<float>(static_cast<std::int64_t>((i * 40503u) % 1001) - 500) * 1e-5f; }
Tensor Grad(DType dtype, std::int64_t n) { return Filled(dtype, n, MemoryCategory::gradient, GradValue); }
Tensor Param(DType dtype, std::int64_t n) { return Filled(dtype, n, MemoryCategory::parameter, WeightValue); }

// ---- limit kernels: same streams, one add each ------------------------------------------------------
__attribute__((noinline)) void LimitAdamF32(float* __restrict p, const float* __restrict g, float* __restrict m,
                                            float* __restrict v, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    p[i] += gi;
    m[i] += gi;
    v[i] += gi;
  }
}
__attribute__((noinline)) void LimitAdamBf16(float* __restrict w, const bf16_t* __restrict g, float* __restrict m,
                                             float* __restrict v, bf16_t* __restrict p, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float gi = bf16_to_f32(g[i]);
    const float wi = w[i] + gi;
    w[i] = wi;
    m[i] += gi;
    v[i] += gi;
    p[i] = bf16_t{static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(wi) >> 16)};
  }
}
__attribute__((noinline)) void LimitSgdF32(float* __restrict p, const float* __restrict g, float* __restrict b,
                                           std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    p[i] += gi;
    b[i] += gi;
  }
}
__attribute__((noinline)) void LimitSgdBf16(float* __restrict w, const bf16_t* __restrict g, float* __restrict b,
                                            bf16_t* __restrict p, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float gi = bf16_to_f32(g[i]);
    const float wi = w[i] + gi;
    w[i] = wi;
    b[i] += gi;
    p[i] = bf16_t{static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(wi) >> 16)};
  }
}

enum class Algo { kAdamW, kSgd };

void BM_OptimizerStep(benchmark::State& state, Algo algo, DType param_dtype) {
  const std::int64_t n = kElements;
  const bool master = param_dtype != DType::f32;
  const DType grad_dtype = master ? DType::bf16 : DType::f32;

  // The optimizer's arrays.
  Tensor p = Param(param_dtype, n);
  p.set_grad(Grad(grad_dtype, n));
  std::unique_ptr<Optimizer> opt;
  if (algo == Algo::kAdamW) opt = std::make_unique<AdamW>(std::vector<Tensor>{p}, AdamW::default_hyper());
  else opt = std::make_unique<Sgd>(std::vector<Tensor>{p}, HyperParams{.lr = 1e-3, .momentum = 0.9});
  // Allocates (and first-touches) the state outside the timed region.
  if (absl::Status s = opt->step(); !s.ok()) {
    state.SkipWithError(std::string(s.message()).c_str());
    return;
  }

  // The limit kernel's arrays: same sizes and dtypes, separate memory.
  Tensor lw = Param(DType::f32, n), lg = Grad(grad_dtype, n);
  Tensor lm = Tensor::zeros({n}), lv = Tensor::zeros({n});
  Tensor lp = Tensor::zeros({n}, TensorOptions{}.with_dtype(DType::bf16));
  auto limit = [&] {
    if (algo == Algo::kAdamW) {
      if (master) LimitAdamBf16(lw.data<float>(), lg.data<bf16_t>(), lm.data<float>(), lv.data<float>(), lp.data<bf16_t>(), n);
      else LimitAdamF32(lw.data<float>(), lg.data<float>(), lm.data<float>(), lv.data<float>(), n);
    } else {
      if (master) LimitSgdBf16(lw.data<float>(), lg.data<bf16_t>(), lm.data<float>(), lp.data<bf16_t>(), n);
      else LimitSgdF32(lw.data<float>(), lg.data<float>(), lm.data<float>(), n);
    }
  };
  limit();  // first touch

  std::vector<double> opt_s, limit_s, opt_cpu, limit_cpu;
  for (auto _ : state) {
    const double c0 = ThreadCpuSeconds();
    const auto t0 = Clock::now();
    const absl::Status stepped = opt->step();
    const auto t1 = Clock::now();
    if (!stepped.ok()) {
      state.SkipWithError(std::string(stepped.message()).c_str());
      break;
    }
    const double c1 = ThreadCpuSeconds();
    limit();
    const auto t2 = Clock::now();
    const double c2 = ThreadCpuSeconds();
    const double a = std::chrono::duration<double>(t1 - t0).count();
    const double b = std::chrono::duration<double>(t2 - t1).count();
    state.SetIterationTime(a);
    opt_s.push_back(a);
    limit_s.push_back(b);
    opt_cpu.push_back(c1 - c0);
    limit_cpu.push_back(c2 - c1);
  }
  benchmark::DoNotOptimize(lw.data<float>());
  const double t_opt = Median(opt_s), t_lim = Median(limit_s);
  const double bytes_per_elem = algo == Algo::kAdamW ? 28.0 : 20.0;
  state.counters["elements"] = static_cast<double>(n);
  state.counters["ns_per_elem"] = t_opt * 1e9 / static_cast<double>(n);
  state.counters["limit_ns_per_elem"] = t_lim * 1e9 / static_cast<double>(n);
  state.counters["frac_of_limit"] = t_lim / t_opt;
  state.counters["GBps"] = bytes_per_elem * static_cast<double>(n) / t_opt * 1e-9;
  // The same from thread CPU time (robust to descheduling on a shared machine).
  const double c_opt = Median(opt_cpu), c_lim = Median(limit_cpu);
  state.counters["cpu_ns_per_elem"] = c_opt * 1e9 / static_cast<double>(n);
  state.counters["cpu_frac_of_limit"] = c_lim / c_opt;
}

BENCHMARK_CAPTURE(BM_OptimizerStep, AdamW_fp32, Algo::kAdamW, DType::f32)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_OptimizerStep, AdamW_bf16_master, Algo::kAdamW, DType::bf16)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_OptimizerStep, SGD_momentum_fp32, Algo::kSgd, DType::f32)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_OptimizerStep, SGD_momentum_bf16_master, Algo::kSgd, DType::bf16)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace shardkit::optim

BENCHMARK_MAIN();
