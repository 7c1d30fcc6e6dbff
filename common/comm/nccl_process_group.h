// The NCCL backend (CUDA builds): a ProcessGroup whose ranks are processes (or threads), one CUDA device
// each, talking through NCCL (DESIGN.md section 2).
//
// Bootstrap: group rank 0 creates the NCCL unique id and publishes it in the Store under
// "<store_prefix>/<group key>/id"; the other ranks read it (waiting up to the creation timeout). The
// communicator is created non-blocking and polled, so creation never waits past its deadline.
//
// Execution (Note [nccl streams]): each group has its own CUDA stream. A call first makes that stream
// wait for the work already queued on the caller's stream (cudaStreamPerThread, which common/kernels
// uses), enqueues the NCCL operation, and records a CUDA event; the Work is that event.
// Work::wait() polls the event (and NCCL's async error) until it completes, the wait timeout passes, or the
// call's deadline passes; then it makes the caller's stream wait for the event, so later kernels see the
// result. is_completed() queries the event.
//
// Failure: when a call's deadline passes, NCCL reports an async error, or abort() is called, the
// communicator is aborted (ncclCommAbort), a failure record naming the rank and operation is written to
// the Store ("<store_prefix>/<group key>/failed") and every pending and later call fails; waiting ranks
// poll that record (every 100 ms) so they fail with the origin's message rather than at their own deadline.
//
// Tensors must be CUDA tensors on the group's device; dtypes f32, bf16, f16, i64; every ReduceOp (premul_sum
// through ncclRedOpCreatePreMulSum). Sub-groups are bootstrapped through the same Store.
//
// The backend (nccl_process_group.cc) is part of shardkit::cuda, which registers it at start-up (Note [cuda
// component] in common/cuda/cuda_component.h); the CPU library only dispatches (nccl_process_group_dispatch.cc).
// In a program that does not link shardkit::cuda, or a build without CUDA, create_nccl_group() returns
// Unimplemented saying which.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"
#include "common/comm/store.h"

namespace shardkit::comm {

struct NcclOptions {
  absl::Duration default_timeout = absl::Minutes(5);
  // Deadline for creating the communicator (waiting for the unique id and for every rank to join).
  absl::Duration init_timeout = absl::Minutes(2);
  std::string name = "world";
  // Prefix of this group's keys in the Store (different groups of one job need different prefixes).
  std::string store_prefix = "nccl";
};

// True when this program has the NCCL backend: shardkit was built with CUDA and NCCL, and the program links
// shardkit::cuda.
bool nccl_backend_built();

// Rank `rank` of `size` joins an NCCL group on CUDA device `device`. Every rank calls it with the same
// size, options.store_prefix and a Store shared by all ranks (e.g. TcpStore).
absl::StatusOr<std::shared_ptr<ProcessGroup>> create_nccl_group(std::shared_ptr<Store> store, int rank, int size,
                                                                int device, const NcclOptions& options = {});

// ---- the seam (Note [cuda component]) -----------------------------------------------------------------
struct NcclBackendOps {
  decltype(&comm::create_nccl_group) create_group;
};

// Called once by shardkit::cuda's static initialiser; `ops` must outlive the program (a constant).
void register_nccl_backend(const NcclBackendOps* ops);

// The backend, defined in nccl_process_group.cc (part of shardkit::cuda only).
namespace cuda_impl {
decltype(comm::create_nccl_group) create_nccl_group;
}  // namespace cuda_impl

}  // namespace shardkit::comm
