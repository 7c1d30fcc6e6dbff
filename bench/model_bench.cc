// model_bench: GPT forward + backward throughput on one CPU thread (one BLAS thread), and how much of
// the step is GEMM (issue 3's engine-overhead goal: gemm_frac >= 0.8 for the larger size).
//
// One iteration = forward (logits + cross-entropy), backward (all parameter gradients), gradients
// dropped (zero_grad(set_to_none)). No optimizer step: this measures the model and the engine.
// Counters:
//   tokens_per_s  B * T tokens per forward+backward (rate over the timed iterations)
//   gemm_frac     time inside kernels::gemm (autograd::gemm_stats, per thread) / step wall time
//   gemm_gflops   GEMM flops / time inside GEMM (how well the BLAS itself runs)
//   step_gflops   6 * (non-embedding params) * tokens + attention flops, per second of the whole step
//   params        parameter count
//
// Sizes: gpt-1m (B=8, T=64), gpt-10m (B=4, T=128), gpt-100m (B=1, T=256, 2 iterations).
// Run: build-*/bench/model_bench            (add --benchmark_filter=gpt-10m to pick one size)
#include <chrono>
#include <string>

#include "bench/blas_context.h"
#include "benchmark/benchmark.h"
#include "common/autograd/engine.h"
#include "common/autograd/ops/gemm_timing.h"
#include "common/nn/gpt.h"

namespace shardkit::nn {
namespace {

void BM_GptForwardBackward(benchmark::State& state, const std::string& config_name, std::int64_t batch,
                           std::int64_t seq) {
  const GPTConfig config = *GPTConfig::named(config_name);
  GPT gpt(config, 1);
  Generator data(7);
  std::vector<std::int64_t> in(static_cast<std::size_t>(batch * seq)), target(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    in[i] = static_cast<std::int64_t>(data.next_below(static_cast<std::uint64_t>(config.vocab_size)));
    target[i] = static_cast<std::int64_t>(data.next_below(static_cast<std::uint64_t>(config.vocab_size)));
  }
  const Tensor idx = Tensor::from_int64(in, {batch, seq});
  const Tensor targets = Tensor::from_int64(target, {batch, seq});
  // Warm-up step (first-touch page faults, BLAS buffers).
  autograd::backward(gpt.loss(idx, targets));
  gpt.zero_grad();

  autograd::reset_gemm_stats();
  double seconds = 0;
  for (auto _ : state) {
    const auto t0 = std::chrono::steady_clock::now();
    Tensor loss = gpt.loss(idx, targets);
    autograd::backward(loss);
    gpt.zero_grad();
    benchmark::DoNotOptimize(loss.item());
    seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
  const autograd::GemmStats g = autograd::gemm_stats();
  const double tokens = static_cast<double>(batch * seq) * static_cast<double>(state.iterations());
  const double c = static_cast<double>(config.width);
  const double non_embedding = static_cast<double>(config.num_layers) * 12 * c * c;
  // Model flops per token: 6 N for the weights + the tied output projection (6 V C) + attention
  // (forward 2 * 2 * T * C per layer for QK^T and PV, times 3 with backward; full T x T as computed).
  const double flops_per_token = 6 * non_embedding + 6 * static_cast<double>(config.vocab_size) * c +
                                 12 * static_cast<double>(config.num_layers) * static_cast<double>(seq) * c;
  state.counters["tokens_per_s"] = benchmark::Counter(tokens / seconds);
  state.counters["gemm_frac"] = g.seconds / seconds;
  state.counters["gemm_gflops"] = g.flops / g.seconds * 1e-9;
  state.counters["step_gflops"] = flops_per_token * tokens / seconds * 1e-9;
  state.counters["params"] = static_cast<double>(gpt.num_parameters());
  state.SetLabel(config_name + " B=" + std::to_string(batch) + " T=" + std::to_string(seq));
}

// Wall-clock ratios: on a shared machine preemption lands in GEMM and non-GEMM time in proportion to
// their durations, so gemm_frac stays unbiased; the minimum times average over several steps.
BENCHMARK_CAPTURE(BM_GptForwardBackward, gpt-1m, std::string("gpt-1m"), 8, 64)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(1.0);
BENCHMARK_CAPTURE(BM_GptForwardBackward, gpt-10m, std::string("gpt-10m"), 4, 128)
    ->Unit(benchmark::kMillisecond)
    ->MinTime(4.0);
// ~100M parameters (1.2 GB of parameters + gradients; a few seconds per step on one core).
BENCHMARK_CAPTURE(BM_GptForwardBackward, gpt-100m, std::string("gpt-100m"), 1, 256)
    ->Unit(benchmark::kMillisecond)
    ->Iterations(2);

}  // namespace
}  // namespace shardkit::nn
