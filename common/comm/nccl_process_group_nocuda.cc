// create_nccl_group() in builds without CUDA / NCCL.
#include "common/comm/nccl_process_group.h"

namespace shardkit::comm {

bool nccl_backend_built() { return false; }

absl::StatusOr<std::shared_ptr<ProcessGroup>> create_nccl_group(std::shared_ptr<Store>, int, int, int,
                                                                const NcclOptions&) {
  return absl::UnimplementedError(
      "create_nccl_group: expected a build with CUDA and NCCL (SHARDKIT_CUDA=ON), found a CPU-only build");
}

}  // namespace shardkit::comm
