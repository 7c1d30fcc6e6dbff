// model_bench_cuda: one GPT training step on a CUDA device (issue 14's model_bench on a GPU): forward (logits +
// cross-entropy), backward, fused AdamW step, gradients dropped, the loss read back to the host (so each timed step
// is complete). fp32 tensors throughout; the GEMMs run at the case's matmul precision (Note [matmul precision]):
// highest = full fp32 cuBLAS, medium = operands rounded to bf16 on tensor cores with fp32 accumulation (the GEMMs
// of PyTorch's bf16 autocast; the elementwise ops, LayerNorm, softmax and the activations stay fp32).
//
// Counters:
//   tokens_per_s   B * T tokens per step (median step time)
//   step_tflops    model flops per step (model_bench.cc's count: 6 N + the tied projection + attention) / time
//   gemm_tflops    a 4096^3 fp32 cuBLAS GEMM at the same precision measured in the same run (the limit)
//   frac_of_gemm   step_tflops / gemm_tflops (MFU against what this GPU's GEMM reaches at that precision)
//   forward_ms, backward_ms, optimizer_ms   one extra step, the device synchronised after each phase
//   loss           that step's loss (the third step on one batch)
// bench/gpt2_vs_torch.py runs this binary and PyTorch eager on the same model, batch and dtype and prints the ratio.
// Without a usable CUDA device every case is skipped with the reason.
//
// Run: build/bench/model_bench_cuda    (SHARDKIT_BENCH_BATCH=<B> overrides the batch of 4)
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/thread_timing.h"
#include "bench/timed_steps.h"
#include "benchmark/benchmark.h"
#include "common/autograd/engine.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/rank_context.h"

namespace shardkit::nn {
namespace {

using Clock = std::chrono::steady_clock;
const Device kGpu = Device::cuda(0);

// The first element, copied to the host: synchronous, so every kernel queued before it has finished.
float ReadFirst(const Tensor& t) { return t.view(0, {1}).to(Device::cpu()).data<float>()[0]; }

// fp32 GEMM TFLOP/s of cuBLAS on this device at `precision`: best of 5 products of 4096^3.
double GemmTflops(MatmulPrecision precision) {
  constexpr std::int64_t n = 4096;
  TensorOptions o;
  o.device = kGpu;
  const Tensor a = Tensor::zeros({n, n}, o), b = Tensor::zeros({n, n}, o), c = Tensor::zeros({n, n}, o);
  double best = 0;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = Clock::now();
    kernels::cuda::gemm(kGpu, false, false, n, n, n, 1.f, a.data<float>(), n, b.data<float>(), n, 0.f,
                        c.data<float>(), n, precision);
    ReadFirst(c);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i > 0) best = std::max(best, 2.0 * n * n * n / s);
  }
  return best * 1e-12;
}

std::int64_t Batch() {
  const char* b = std::getenv("SHARDKIT_BENCH_BATCH");
  return b != nullptr ? std::atoll(b) : 4;
}

void BM_GptTrainStepCuda(benchmark::State& state, const std::string& config_name, std::int64_t seq,
                         MatmulPrecision precision, bool fused_attention = false) {
  if (detail::cuda_device_count() == 0) {
    state.SkipWithError("no usable CUDA device (build without CUDA, no GPU, or CUDA driver too old)");
    return;
  }
  const std::int64_t batch = Batch();
  RankContext ctx;
  ctx.matmul_precision = precision;
  ctx.fused_attention = fused_attention;
  RankContextScope scope(ctx);
  const GPTConfig config = *GPTConfig::named(config_name);
  GPT gpt(config, 1);
  gpt.to(kGpu);
  auto opt = optim::AdamW::make({{gpt.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::default_hyper());
  if (!opt.ok()) {
    state.SkipWithError(std::string(opt.status().message()).c_str());
    return;
  }
  Generator data(7);
  std::vector<std::int64_t> in(static_cast<std::size_t>(batch * seq)), target(in.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    in[i] = static_cast<std::int64_t>(data.next_below(static_cast<std::uint64_t>(config.vocab_size)));
    target[i] = static_cast<std::int64_t>(data.next_below(static_cast<std::uint64_t>(config.vocab_size)));
  }
  const Tensor idx = Tensor::from_int64(in, {batch, seq}).to(kGpu);
  const Tensor targets = Tensor::from_int64(target, {batch, seq}).to(kGpu);
  // One step, the loss read back at its end (so a timed step is complete). With `phases`, the device is also
  // synchronised after the forward and the backward, and the times and the loss are recorded.
  struct Phases {
    Clock::time_point at[4];
    float loss = 0;
  };
  auto run_step = [&](Phases* phases) {
    if (phases != nullptr) phases->at[0] = Clock::now();
    (*opt)->zero_grad();
    Tensor loss = gpt.loss(idx, targets);
    if (phases != nullptr) {
      phases->loss = ReadFirst(loss);
      phases->at[1] = Clock::now();
    }
    autograd::backward(loss);
    if (phases != nullptr) {
      ReadFirst(gpt.parameters().front());
      phases->at[2] = Clock::now();
    }
    const absl::Status s = (*opt)->step();
    benchmark::DoNotOptimize(ReadFirst(loss));
    if (phases != nullptr) phases->at[3] = Clock::now();
    return s;
  };
  auto step = [&] { return run_step(nullptr); };
  for (int i = 0; i < 2; ++i) {  // warm-up: cuBLAS handles, the optimizer's state, the allocator
    if (absl::Status s = step(); !s.ok()) {
      state.SkipWithError(std::string(s.message()).c_str());
      return;
    }
  }
  Phases phases;  // where a step's time goes: one more step
  if (absl::Status s = run_step(&phases); !s.ok()) {
    state.SkipWithError(std::string(s.message()).c_str());
    return;
  }
  auto ms = [&](int k) { return std::chrono::duration<double, std::milli>(phases.at[k + 1] - phases.at[k]).count(); };
  state.counters["forward_ms"] = ms(0);
  state.counters["backward_ms"] = ms(1);
  state.counters["optimizer_ms"] = ms(2);
  state.counters["loss"] = phases.loss;  // after 2 steps on this one batch: a sanity check (ln 50257 = 10.8)
  const std::optional<std::vector<double>> step_s = bench::TimedSteps(state, step);
  if (!step_s) return;
  const double median = bench::Median(*step_s);
  const double tokens = static_cast<double>(batch * seq);
  const double c = static_cast<double>(config.width);
  const double non_embedding = static_cast<double>(config.num_layers) * 12 * c * c;
  const double flops_per_token = 6 * non_embedding + 6 * static_cast<double>(config.vocab_size) * c +
                                 12 * static_cast<double>(config.num_layers) * static_cast<double>(seq) * c;
  const double tflops = flops_per_token * tokens / median * 1e-12;
  const double limit = GemmTflops(precision);
  state.counters["tokens_per_s"] = tokens / median;
  state.counters["step_tflops"] = tflops;
  state.counters["gemm_tflops"] = limit;
  state.counters["frac_of_gemm"] = tflops / limit;
  state.counters["params"] = static_cast<double>(gpt.num_parameters());
  state.SetLabel(config_name + " B=" + std::to_string(batch) + " T=" + std::to_string(seq) + " fp32, matmul " +
                 std::string(matmul_precision_name(precision)) + (fused_attention ? ", attention fused" : ""));
}

BENCHMARK_CAPTURE(BM_GptTrainStepCuda, gpt2-small/highest, std::string("gpt2-small"), 1024, MatmulPrecision::highest)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(10);
BENCHMARK_CAPTURE(BM_GptTrainStepCuda, gpt2-small/medium, std::string("gpt2-small"), 1024, MatmulPrecision::medium)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(10);
// medium with the fused attention (RankContext::fused_attention on): what the fused kernels save or cost.
BENCHMARK_CAPTURE(BM_GptTrainStepCuda, gpt2-small/medium-fused, std::string("gpt2-small"), 1024,
                  MatmulPrecision::medium, true)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond)
    ->Iterations(10);

}  // namespace
}  // namespace shardkit::nn

BENCHMARK_MAIN();
