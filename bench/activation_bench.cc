// activation_bench: the elementwise and row-wise ops around the GEMMs (GELU, softmax, cross-entropy), forward and
// backward through autograd, single-threaded, against a kernel that moves the same bytes measured in the same
// binary (DESIGN.md sections 8 and 9). They are the part of a GPT step that is not GEMM; written to vectorise
// (Note [fast exp] in common/autograd/ops/fast_math.h), they should run near the speed of their memory traffic.
//
// Cases, each over 16 Mi elements in 128 blocks of 512 KiB (the size of gpt-10m's activations; the op's own
// allocations then come back from the heap, where tensors of 64 MiB would be fresh pages every pass):
//   gelu_tanh      GPT-2's GELU: forward reads x, writes y; backward reads x and dy, writes dx (20 B/elem)
//   softmax        rows of 1024 (an attention row): forward reads x, writes y; backward reads y and dy, writes dx
//                  (20 B/elem)
//   cross_entropy  rows of 256 (a byte-level vocabulary), one target per row: forward reads the logits, backward
//                  reads them and writes their gradient (12 B/elem)
// The limit kernel reads and writes the same arrays in the same passes with one add per element.
// Counters: ns_per_elem (median op time / elements), limit_ns_per_elem, frac_of_limit = median limit time / median
// op time (1.0: the op moves its bytes as fast as a kernel doing nothing else), and cpu_frac_of_limit, the same from
// the thread's CPU time (it does not count time the thread was descheduled on a shared machine). A loop the compiler
// left scalar shows as a frac_of_limit far below 1 (gelu_tanh was about 0.1 while fast_exp's clamp kept gcc 12 from
// vectorising, Note [no-trapping-math] in cmake/ShardkitHelpers.cmake).
//
// Run: build-*/bench/activation_bench
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "bench/thread_timing.h"
#include "benchmark/benchmark.h"
#include "common/autograd/engine.h"
#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/loss.h"
#include "common/tensor/tensor.h"

namespace shardkit::autograd {
namespace {

// 128 blocks of 128 Ki elements: a block is a GPT-sized activation (512 KiB, what gpt-10m's MLP makes per rank), the
// whole pass 64 MiB per tensor, past the last-level cache.
constexpr int kBlocks = 128;
constexpr std::int64_t kBlockElements = std::int64_t{128} << 10;

using Clock = std::chrono::steady_clock;
using bench::Median;
using bench::ThreadCpuSeconds;

// Values in [-4, 4): the range where GELU's tanh and the softmax's exp do real work.
Tensor Filled(std::int64_t rows, std::int64_t cols, std::uint32_t salt) {
  Tensor t = Tensor::empty({rows, cols});
  float* d = t.data<float>();
  for (std::int64_t i = 0; i < rows * cols; ++i) {
    d[i] = static_cast<float>((static_cast<std::uint32_t>(i) * 2654435761u + salt) % 8001) * 1e-3f - 4.f;
  }
  return t;
}

// ---- limit kernels: the op's passes, one add per element ---------------------------------------------
// Forward x -> y, backward (a, dy) -> dx: gelu_tanh (a = x) and softmax (a = y).
__attribute__((noinline)) void LimitUnary(const float* __restrict x, float* __restrict y, const float* __restrict a,
                                          const float* __restrict dy, float* __restrict dx, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = x[i] + 1.f;
  for (std::int64_t i = 0; i < n; ++i) dx[i] = a[i] + dy[i];
}
// Forward reads the logits, backward reads them again and writes their gradient.
__attribute__((noinline)) float LimitCrossEntropy(const float* __restrict x, float* __restrict dx, std::int64_t n) {
  float s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += x[i];
  for (std::int64_t i = 0; i < n; ++i) dx[i] = x[i] + 1.f;
  return s;
}

enum class Op { gelu_tanh, softmax, cross_entropy };

void BM_Activation(benchmark::State& state, Op op) {
  const std::int64_t cols = op == Op::softmax ? 1024 : op == Op::cross_entropy ? 256 : 4096;
  const std::int64_t rows = kBlockElements / cols;
  const std::int64_t n = kBlocks * rows * cols;
  std::vector<Tensor> xs, dys;
  for (int b = 0; b < kBlocks; ++b) {
    xs.push_back(Filled(rows, cols, 1 + static_cast<std::uint32_t>(b)));
    xs.back().set_requires_grad(true);
    dys.push_back(Filled(rows, cols, 7 + static_cast<std::uint32_t>(b)));
  }
  std::vector<std::int64_t> target_values(static_cast<std::size_t>(rows));
  for (std::int64_t r = 0; r < rows; ++r) target_values[static_cast<std::size_t>(r)] = (r * 37) % cols;
  const Tensor targets = Tensor::from_int64(target_values, {rows});
  // One forward and backward of the op per block; the block's gradient is dropped after each, so every pass
  // allocates the same.
  auto run_op = [&] {
    for (int b = 0; b < kBlocks; ++b) {
      Tensor& x = xs[static_cast<std::size_t>(b)];
      switch (op) {
        case Op::gelu_tanh:
          backward(gelu(x, GeluApproximation::tanh), dys[static_cast<std::size_t>(b)]);
          break;
        case Op::softmax:
          backward(softmax(x), dys[static_cast<std::size_t>(b)]);
          break;
        case Op::cross_entropy:
          backward(cross_entropy(x, targets));
          break;
      }
      x.set_grad(Tensor());
    }
  };
  std::vector<Tensor> ly, la, ldx;
  for (int b = 0; b < kBlocks; ++b) {
    ly.push_back(Tensor::empty({rows * cols}));
    la.push_back(Filled(rows, cols, 3 + static_cast<std::uint32_t>(b)));
    ldx.push_back(Tensor::empty({rows * cols}));
  }
  auto limit = [&] {
    for (std::size_t b = 0; b < ly.size(); ++b) {
      if (op == Op::cross_entropy) {
        benchmark::DoNotOptimize(LimitCrossEntropy(la[b].data<float>(), ldx[b].data<float>(), rows * cols));
      } else {
        LimitUnary(la[b].data<float>(), ly[b].data<float>(), la[b].data<float>(), dys[b].data<float>(),
                   ldx[b].data<float>(), rows * cols);
      }
    }
  };
  run_op();  // first touch
  limit();

  std::vector<double> op_s, limit_s, op_cpu, limit_cpu;
  for (auto _ : state) {
    const double c0 = ThreadCpuSeconds();
    const auto t0 = Clock::now();
    run_op();
    const auto t1 = Clock::now();
    const double c1 = ThreadCpuSeconds();
    limit();
    const auto t2 = Clock::now();
    const double c2 = ThreadCpuSeconds();
    const double a = std::chrono::duration<double>(t1 - t0).count();
    state.SetIterationTime(a);
    op_s.push_back(a);
    limit_s.push_back(std::chrono::duration<double>(t2 - t1).count());
    op_cpu.push_back(c1 - c0);
    limit_cpu.push_back(c2 - c1);
  }
  const double t_op = Median(op_s), t_lim = Median(limit_s);
  state.counters["elements"] = static_cast<double>(n);
  state.counters["ns_per_elem"] = t_op * 1e9 / static_cast<double>(n);
  state.counters["limit_ns_per_elem"] = t_lim * 1e9 / static_cast<double>(n);
  state.counters["frac_of_limit"] = t_lim / t_op;
  state.counters["cpu_frac_of_limit"] = Median(limit_cpu) / Median(op_cpu);
}

BENCHMARK_CAPTURE(BM_Activation, gelu_tanh, Op::gelu_tanh)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Activation, softmax, Op::softmax)->UseManualTime()->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_Activation, cross_entropy, Op::cross_entropy)->UseManualTime()->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace shardkit::autograd

BENCHMARK_MAIN();
