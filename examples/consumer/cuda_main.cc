// Uses an installed shardkit with its cuda component (shardkit::cuda): linking it is all it takes for the
// CUDA implementations to be registered (Note [cuda component]). Moves a tensor to cuda:0 and back when a
// GPU is visible; without one, only checks that the NCCL backend and CUDA kernels are present.
#include <cstdio>

#include "common/comm/nccl_process_group.h"
#include "common/kernels/elementwise.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/rank_context.h"
#include "common/tensor/tensor.h"

int main() {
  if (!shardkit::comm::nccl_backend_built()) {
    std::printf("shardkit consumer (cuda): the CUDA component is not registered\n");
    return 1;
  }
  const int devices = shardkit::detail::cuda_device_count();
  std::printf("shardkit consumer (cuda): CUDA component registered, %d CUDA device(s)\n", devices);
  if (devices == 0) return 0;
  shardkit::RankContext ctx;
  shardkit::RankContextScope scope(ctx);
  shardkit::TensorOptions on_gpu;
  on_gpu.device = shardkit::Device::cuda(0);
  shardkit::Tensor host = shardkit::Tensor::full({1024}, 3.f);
  shardkit::Tensor dev = shardkit::Tensor::empty({1024}, on_gpu);
  shardkit::kernels::cast(host, dev);
  shardkit::kernels::scale(2.f, dev, dev);
  shardkit::Tensor back = shardkit::Tensor::empty({1024});
  shardkit::kernels::cast(dev, back);
  for (float v : back.to_vector()) {
    if (v != 6.f) {
      std::printf("shardkit consumer (cuda): expected 6 after the round trip through cuda:0, found %g\n", v);
      return 1;
    }
  }
  std::printf("shardkit consumer (cuda): round trip through cuda:0 ok\n");
  return 0;
}
