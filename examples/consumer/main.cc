// Uses an installed shardkit: allocates a parameter on this rank's ledger and prints the figure. CPU-only: it
// links no CUDA library, so no CUDA implementation is registered (Note [cuda component]).
#include <cstdio>

#include "common/comm/nccl_process_group.h"
#include "common/tensor/rank_context.h"
#include "common/tensor/tensor.h"

int main() {
  if (shardkit::comm::nccl_backend_built()) {
    std::printf("shardkit consumer: a CPU-only program has the CUDA component registered\n");
    return 1;
  }
  shardkit::RankContext ctx;
  shardkit::RankContextScope scope(ctx);
  shardkit::Tensor w = shardkit::Tensor::zeros(
      {256, 256}, shardkit::TensorOptions{}.with_category(shardkit::MemoryCategory::parameter));
  const auto bytes = ctx.memory->current(shardkit::MemoryCategory::parameter);
  std::printf("shardkit consumer: parameter bytes on this rank = %lld\n", static_cast<long long>(bytes));
  return bytes == 256 * 256 * 4 ? 0 : 1;
}
