// NCCL backend: runs on machines with CUDA devices (one rank thread per device); skips cleanly otherwise.
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "common/comm/hash_store.h"
#include "common/comm/nccl_process_group.h"
#include "common/kernels/elementwise.h"
#include "common/tensor/device_memory.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

TEST(NcclTest, CpuOnlyBuildSaysSo) {
  if (nccl_backend_built()) GTEST_SKIP() << "this build has the NCCL backend";
  auto g = create_nccl_group(std::make_shared<HashStore>(), 0, 1, 0);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnimplemented);
}

TEST(NcclTest, CollectivesAcrossDevices) {
  if (!nccl_backend_built()) GTEST_SKIP() << "built without CUDA / NCCL";
  const int devices = detail::cuda_device_count();
  if (devices == 0) GTEST_SKIP() << "no CUDA device visible (cuda_device_count() == 0): NCCL test skipped";
  const int n = std::min(devices, 4);
  auto store = std::make_shared<HashStore>();
  std::vector<absl::Status> status(static_cast<std::size_t>(n));
  std::vector<std::vector<float>> reduced(static_cast<std::size_t>(n)), gathered(static_cast<std::size_t>(n));
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto g = create_nccl_group(store, r, n, r, {.default_timeout = absl::Seconds(60), .init_timeout = absl::Seconds(60)});
      if (!g.ok()) {
        status[r] = g.status();
        return;
      }
      ProcessGroup& pg = **g;
      TensorOptions on_gpu;
      on_gpu.device = Device::cuda(r);
      Tensor host = Tensor::full({1000}, r + 1);
      Tensor dev = Tensor::empty({1000}, on_gpu);
      kernels::cast(host, dev);
      status[r] = pg.all_reduce(dev, {.op = ReduceOp::avg()})->wait(absl::Seconds(60));
      if (!status[r].ok()) return;
      Tensor back = Tensor::empty({1000});
      kernels::cast(dev, back);
      reduced[r] = back.to_vector();
      Tensor shard = Tensor::empty({2}, on_gpu), full = Tensor::empty({2 * static_cast<std::int64_t>(n)}, on_gpu);
      kernels::cast(Tensor::full({2}, 10 * r), shard);
      status[r] = pg.all_gather(full, shard)->wait(absl::Seconds(60));
      if (!status[r].ok()) return;
      Tensor full_host = Tensor::empty({2 * static_cast<std::int64_t>(n)});
      kernels::cast(full, full_host);
      gathered[r] = full_host.to_vector();
      status[r] = pg.barrier()->wait(absl::Seconds(60));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < n; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
    EXPECT_EQ(reduced[r], std::vector<float>(1000, (n + 1) / 2.0f));
    std::vector<float> want;
    for (int s = 0; s < n; ++s) want.insert(want.end(), 2, 10.f * s);
    EXPECT_EQ(gathered[r], want);
  }
}

}  // namespace
}  // namespace shardkit::comm
