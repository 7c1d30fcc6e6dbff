// Collectives on tensors of any device over any group, NCCL included: a layer's own small exchanges.
//
// Note [host tensors over device-only groups]
// Besides the model's tensors, the sharding layers exchange small tensors of their own, built and read on the
// host: a model's hash (sddp model_sync), the gradients' ready order (the reducer), a norm's partial
// (sharded_grad_norm), a load_state_dict verdict (OSS), a found-inf flag (GradScaler), OSS's consolidation
// messages (point to point). The host backends move CPU
// tensors; NCCL moves only tensors on its CUDA device (ProcessGroup::scratch_device()). These functions run such
// a call on copies on the group's scratch device when that is not where the tensors are, wait for it, and copy
// the results back, so the caller writes and reads host tensors whatever the backend. They wait: meant for a few
// bytes on paths that need the answer before going on, not for the model's tensors.
//
// Thread-safety: as the group's calls (one rank's thread).
#pragma once

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"

namespace shardkit::comm {

// group.all_gather(output, input, options), waited for with `wait_timeout`; output holds the result on return.
absl::Status all_gather_host(ProcessGroup& group, const Tensor& output, const Tensor& input,
                             const AllGatherOptions& options, absl::Duration wait_timeout = absl::InfiniteDuration());
// group.all_reduce(tensor, options) in place, waited for.
absl::Status all_reduce_host(ProcessGroup& group, const Tensor& tensor, const AllReduceOptions& options,
                             absl::Duration wait_timeout = absl::InfiniteDuration());
// group.broadcast(tensor, options) in place, waited for.
absl::Status broadcast_host(ProcessGroup& group, const Tensor& tensor, const BroadcastOptions& options,
                            absl::Duration wait_timeout = absl::InfiniteDuration());
// group.send(tensor, dst, options), waited for.
absl::Status send_host(ProcessGroup& group, const Tensor& tensor, int dst, const P2POptions& options,
                       absl::Duration wait_timeout = absl::InfiniteDuration());
// group.recv(tensor, src, options) into tensor, waited for.
absl::Status recv_host(ProcessGroup& group, const Tensor& tensor, int src, const P2POptions& options,
                       absl::Duration wait_timeout = absl::InfiniteDuration());

}  // namespace shardkit::comm
