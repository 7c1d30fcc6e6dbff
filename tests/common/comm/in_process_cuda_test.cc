// The in-process backend on CUDA tensors (Note [in-process CUDA tensors] in common/comm/in_process_group.cc):
// simulated ranks on one GPU get the same results as on CPU tensors, for every collective, in place and not,
// and for send / recv. Skipped, with the reason, when no CUDA device is usable.
#include <vector>

#include "common/comm/process_group.h"
#include "common/comm/testing/run_ranks.h"
#include "common/kernels/elementwise.h"
#include "gtest/gtest.h"
#include "tests/common/tensor/cuda_test_util.h"

namespace shardkit::comm {
namespace {

const Device kGpu = Device::cuda(0);

Tensor OnGpu(const Tensor& t) { return t.to(kGpu); }
std::vector<float> Host(const Tensor& t) { return t.to_vector(); }
std::vector<float> HostOf(const Tensor& device_tensor) { return device_tensor.to(Device::cpu()).to_vector(); }

// Rank r's input: 12 values that differ per rank and position.
Tensor Input(int r, std::int64_t n = 12) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(r * 100) + static_cast<float>(i) * 0.5f;
  return Tensor::from_vector(v, {n});
}

TEST(InProcessCudaTest, EveryCollectiveEqualsTheSameOnCpuTensors) {
  SK_REQUIRE_CUDA_DEVICE("the in-process backend on CUDA tensors");
  for (int n : {2, 3}) {
    absl::Status st = RunRanks(n, [n](RankEnv& env) -> absl::Status {
      const int r = env.rank;
      // all_reduce in place, of a tensor a kernel still queued on this thread's stream writes (the backend must
      // wait for it)
      Tensor cpu = Input(r), gpu = OnGpu(Input(r));
      kernels::scale(3.f, cpu, cpu);
      kernels::scale(3.f, gpu, gpu);
      if (absl::Status s = env.group.all_reduce(cpu)->wait(); !s.ok()) return s;
      if (absl::Status s = env.group.all_reduce(gpu)->wait(); !s.ok()) return s;
      EXPECT_EQ(HostOf(gpu), Host(cpu)) << "all_reduce n=" << n;
      // all_gather into a separate output, and in place (the input a slice of the output)
      Tensor out_cpu = Tensor::zeros({12 * n}), out_gpu = OnGpu(Tensor::zeros({12 * n}));
      if (absl::Status s = env.group.all_gather(out_cpu, Input(r))->wait(); !s.ok()) return s;
      if (absl::Status s = env.group.all_gather(out_gpu, OnGpu(Input(r)))->wait(); !s.ok()) return s;
      EXPECT_EQ(HostOf(out_gpu), Host(out_cpu)) << "all_gather n=" << n;
      Tensor inplace = OnGpu(Tensor::zeros({12 * n}));
      inplace.view(12 * r, {12}).copy_(Input(r));
      if (absl::Status s = env.group.all_gather(inplace, inplace.view(12 * r, {12}))->wait(); !s.ok()) return s;
      EXPECT_EQ(HostOf(inplace), Host(out_cpu)) << "in-place all_gather n=" << n;
      // reduce_scatter
      Tensor rs_cpu = Tensor::zeros({4}), rs_gpu = OnGpu(Tensor::zeros({4}));
      if (absl::Status s = env.group.reduce_scatter(rs_cpu, Input(r, 4 * n))->wait(); !s.ok()) return s;
      if (absl::Status s = env.group.reduce_scatter(rs_gpu, OnGpu(Input(r, 4 * n)))->wait(); !s.ok()) return s;
      EXPECT_EQ(HostOf(rs_gpu), Host(rs_cpu)) << "reduce_scatter n=" << n;
      // broadcast from the last rank
      Tensor b = OnGpu(Input(r));
      if (absl::Status s = env.group.broadcast(b, {.root = n - 1})->wait(); !s.ok()) return s;
      EXPECT_EQ(HostOf(b), Host(Input(n - 1))) << "broadcast n=" << n;
      // a ring of send / recv
      Tensor in = OnGpu(Tensor::zeros({12}));
      auto rw = env.group.recv(in, (r + n - 1) % n);
      auto sw = env.group.send(OnGpu(Input(r)), (r + 1) % n);
      if (absl::Status s = rw->wait(); !s.ok()) return s;
      if (absl::Status s = sw->wait(); !s.ok()) return s;
      EXPECT_EQ(HostOf(in), Host(Input((r + n - 1) % n))) << "recv n=" << n;
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

}  // namespace
}  // namespace shardkit::comm
