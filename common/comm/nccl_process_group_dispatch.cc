// create_nccl_group() in the CPU library: forwards to the backend that shardkit::cuda registers (Note [cuda
// component] in common/cuda/cuda_component.h), or says why this program has none.
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/comm/nccl_process_group.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/startup_registry.h"

namespace shardkit::comm {
namespace {

constinit detail::StartupRegistry<NcclBackendOps> g_nccl_backend;  // written once, at static-init time

}  // namespace

void register_nccl_backend(const NcclBackendOps* ops) { g_nccl_backend.set(ops, "NCCL backend"); }

bool nccl_backend_built() { return g_nccl_backend.get() != nullptr; }

absl::StatusOr<std::shared_ptr<ProcessGroup>> create_nccl_group(std::shared_ptr<Store> store, int rank, int size,
                                                                int device, const NcclOptions& options) {
  if (const NcclBackendOps* ops = g_nccl_backend.get()) {
    return ops->create_group(std::move(store), rank, size, device, options);
  }
  return absl::UnimplementedError(
      absl::StrCat("create_nccl_group: expected the NCCL backend (a build with CUDA and NCCL, and a program that "
                   "links shardkit::cuda), found none: ",
                   detail::cuda_unavailable_reason()));
}

}  // namespace shardkit::comm
