// optim_bench_cuda: the fused multi-tensor AdamW on a CUDA device (common/optim/cuda/fused_optim.cu) against the
// device's copy bandwidth measured in the same run (issue 14: GB/s >= 0.8 of the device's copy bandwidth).
//
// Cases (parameters on cuda:0, one optimizer step per iteration, the thread's stream drained before the clock
// stops, so each time is the whole step, launch latency included):
//   AdamW_fp32/one_tensor        one fp32 tensor of 64 Mi elements
//   AdamW_fp32/gpt2_small        GPT-2 small's 148 tensors (124 M elements: biases and norms next to
//                                38.6 M-element embeddings), fp32
//   AdamW_bf16_master/gpt2_small the same with bf16 parameters and gradients, fp32 master weights
// Counters: GBps = the bytes the algorithm must move (AdamW fp32: read w, g, m, v and write w, m, v, 28 B/elem;
// bf16 + master: 2 B less read and 2 B more written, still 28 B/elem) / step time; copy_GBps = a device-to-device
// copy of 256 MiB (read + written bytes / time, the best of 5); frac_of_limit = GBps / copy_GBps.
// Without a usable CUDA device every case is skipped with the reason.
//
// Run: build/bench/optim_bench_cuda
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench/thread_timing.h"
#include "bench/timed_steps.h"
#include "benchmark/benchmark.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/elementwise.h"
#include "common/optim/adam.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/tensor.h"

namespace shardkit::optim {
namespace {

using Clock = std::chrono::steady_clock;
const Device kGpu = Device::cuda(0);

TensorOptions OnGpu(DType dtype) {
  TensorOptions o = TensorOptions{}.with_dtype(dtype);
  o.device = kGpu;
  return o;
}

Tensor Filled(std::int64_t n, DType dtype, float value) {
  Tensor f32 = Tensor::empty({n}, OnGpu(DType::f32));
  kernels::fill(f32, value);
  if (dtype == DType::f32) return f32;
  Tensor t = Tensor::empty({n}, OnGpu(dtype));
  kernels::cast(f32, t);
  return t;
}

// Waits for everything queued on this thread's stream: a one-element copy to the host is synchronous and ordered
// after it (common/kernels/cuda/cuda_kernels.h).
void Drain(const Tensor& on_device) {
  Tensor one = Tensor::empty({1}, TensorOptions{}.with_dtype(on_device.dtype()));
  kernels::cast(on_device.view(0, {1}), one);
}

std::vector<std::int64_t> Gpt2SmallNumels() {
  const std::int64_t d = 768, layers = 12;
  std::vector<std::int64_t> n = {50257 * d, 1024 * d};  // wte, wpe
  for (std::int64_t l = 0; l < layers; ++l) {
    for (std::int64_t x : {d, d, d * 3 * d, 3 * d, d * d, d, d, d, d * 4 * d, 4 * d, 4 * d * d, d}) n.push_back(x);
  }
  n.push_back(d);  // ln_f
  n.push_back(d);
  return n;
}

// Device copy bandwidth (read + written bytes per second), best of 5 copies of 256 MiB.
double CopyBandwidth() {
  const std::size_t bytes = std::size_t{256} << 20;
  const std::int64_t n = static_cast<std::int64_t>(bytes / 4);
  const Tensor a = Filled(n, DType::f32, 1.0f), b = Filled(n, DType::f32, 2.0f);
  double best = 0;
  for (int i = 0; i < 6; ++i) {
    const auto t0 = Clock::now();
    kernels::cuda::copy_bytes(a.raw_data(), kGpu, b.raw_data(), kGpu, bytes);  // waits for the copy
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (i > 0) best = std::max(best, 2.0 * static_cast<double>(bytes) / s);
  }
  return best;
}

void BM_CudaAdamW(benchmark::State& state, std::vector<std::int64_t> numels, DType param_dtype) {
  if (detail::cuda_device_count() == 0) {
    state.SkipWithError("no usable CUDA device (build without CUDA, no GPU, or CUDA driver too old)");
    return;
  }
  const DType grad_dtype = param_dtype;
  std::vector<Tensor> params;
  std::int64_t total = 0;
  for (std::int64_t n : numels) {
    params.push_back(Filled(n, param_dtype, 0.5f));
    params.back().set_grad(Filled(n, grad_dtype, 0.01f));
    total += n;
  }
  AdamW opt(params, AdamW::default_hyper());
  if (absl::Status s = opt.step(); !s.ok()) {  // allocates the state outside the timed steps
    state.SkipWithError(std::string(s.message()).c_str());
    return;
  }
  Drain(params[0]);
  const std::optional<std::vector<double>> step_s = bench::TimedSteps(state, [&] {
    const absl::Status s = opt.step();
    Drain(params[0]);
    return s;
  });
  if (!step_s) return;
  const double gbps = 28.0 * static_cast<double>(total) / bench::Median(*step_s) * 1e-9;
  const double copy = CopyBandwidth() * 1e-9;
  state.counters["elements"] = static_cast<double>(total);
  state.counters["tensors"] = static_cast<double>(numels.size());
  state.counters["GBps"] = gbps;
  state.counters["copy_GBps"] = copy;
  state.counters["frac_of_limit"] = gbps / copy;
}

BENCHMARK_CAPTURE(BM_CudaAdamW, AdamW_fp32/one_tensor, std::vector<std::int64_t>{std::int64_t{64} << 20}, DType::f32)
    ->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(20);
BENCHMARK_CAPTURE(BM_CudaAdamW, AdamW_fp32/gpt2_small, Gpt2SmallNumels(), DType::f32)
    ->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(20);
BENCHMARK_CAPTURE(BM_CudaAdamW, AdamW_bf16_master/gpt2_small, Gpt2SmallNumels(), DType::bf16)
    ->UseManualTime()->Unit(benchmark::kMillisecond)->Iterations(20);

}  // namespace
}  // namespace shardkit::optim

BENCHMARK_MAIN();
