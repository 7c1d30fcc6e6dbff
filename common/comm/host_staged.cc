#include "common/comm/host_staged.h"

namespace shardkit::comm {
namespace {

// `t` where `group` moves tensors: itself when already there, else a copy (Note [host tensors over device-only
// groups]).
Tensor staged(const ProcessGroup& group, const Tensor& t) {
  const Device d = group.scratch_device();
  return t.device() == d ? t : t.to(d, MemoryCategory::communication_buffer);
}

// Waits for `work`, then copies the staged result back into `host` (nothing to do when it was not staged).
absl::Status finish(const std::shared_ptr<Work>& work, absl::Duration wait_timeout, const Tensor& host,
                    const Tensor& used) {
  absl::Status s = work->wait(wait_timeout);
  if (s.ok() && used.raw_data() != host.raw_data()) host.copy_(used);
  return s;
}

}  // namespace

absl::Status all_gather_host(ProcessGroup& group, const Tensor& output, const Tensor& input,
                             const AllGatherOptions& options, absl::Duration wait_timeout) {
  const Tensor out = staged(group, output);
  return finish(group.all_gather(out, staged(group, input), options), wait_timeout, output, out);
}

absl::Status all_reduce_host(ProcessGroup& group, const Tensor& tensor, const AllReduceOptions& options,
                             absl::Duration wait_timeout) {
  const Tensor t = staged(group, tensor);
  return finish(group.all_reduce(t, options), wait_timeout, tensor, t);
}

absl::Status broadcast_host(ProcessGroup& group, const Tensor& tensor, const BroadcastOptions& options,
                            absl::Duration wait_timeout) {
  const Tensor t = staged(group, tensor);
  return finish(group.broadcast(t, options), wait_timeout, tensor, t);
}

absl::Status send_host(ProcessGroup& group, const Tensor& tensor, int dst, const P2POptions& options,
                       absl::Duration wait_timeout) {
  return group.send(staged(group, tensor), dst, options)->wait(wait_timeout);
}

absl::Status recv_host(ProcessGroup& group, const Tensor& tensor, int src, const P2POptions& options,
                       absl::Duration wait_timeout) {
  const Tensor t = staged(group, tensor);
  return finish(group.recv(t, src, options), wait_timeout, tensor, t);
}

}  // namespace shardkit::comm
