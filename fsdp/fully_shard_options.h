// Options of fsdp::fully_shard (fully_shard.h).
#pragma once

#include <cstdint>
#include <optional>
#include <variant>
#include <vector>

#include "absl/time/time.h"
#include "common/tensor/tensor.h"
#include "fsdp/mixed_precision.h"

namespace shardkit::fsdp {

// FSDP2's OffloadPolicy / CPUOffloadPolicy (Note [cpu offload] in fsdp/param_group.cc).
struct OffloadPolicy {
  // The unit's shards (the module's parameters at rest), their gradients and so the optimizer's state live in host
  // memory, and an optimizer over model.parameters() steps them on the CPU; the parameters' device (a CUDA device)
  // computes forward and backward on the unsharded parameters.
  bool cpu = false;
};

struct FullyShardOptions {
  // After the unit's forward: true releases its unsharded parameters (all-gathered again, over the whole group,
  // before its backward); false keeps them from forward to the end of backward (less communication, more
  // memory); an int k (a divisor of the group size, 1 < k < N) keeps them sharded over groups of k consecutive
  // ranks, so backward all-gathers within its k-group only (Note [reshard to a k-group] in param_group.h).
  // Empty: FSDP2's heuristic, true for every unit but the root (whose parameters backward needs first).
  std::optional<std::variant<bool, int>> reshard_after_forward = std::nullopt;
  // Parameters this call leaves alone (FSDP's ignored_params): they stay replicated, whole on every rank, and
  // FSDP neither shards nor reduces their gradients (the training loop must, if it wants them averaged).
  std::vector<Tensor> ignored_params = {};
  // Parameters this call leaves for a later fully_shard call on an ancestor module: a parameter this module
  // shares with modules outside it belongs to their common ancestor's unit (fsdp::auto_shard fills this from its
  // plan, fsdp/wrap_policy.h). Untouched until the ancestor's call takes them; if no such call comes, they stay
  // whole and unreduced like ignored_params.
  std::vector<Tensor> leave_to_ancestor = {};
  // Deadline of each collective; empty: the group's default.
  std::optional<absl::Duration> timeout = std::nullopt;
  // Implicit prefetch (Note [prefetch] in state.cc): when this unit's forward starts, start the all-gather of the
  // unit whose forward came next in the first forward; when its backward starts, of the unit next in reverse
  // post-forward order; so the gather overlaps this unit's compute. An explicit list
  // (FSDPModule::set_modules_to_forward_prefetch / set_modules_to_backward_prefetch) replaces it.
  bool implicit_prefetch = true;
  // Read on the root only: at most this many units are unsharding (or unsharded) ahead of their forward or
  // backward because of a prefetch; a prefetch beyond it is not issued (the unit gathers when it runs). Each costs
  // that unit's gather buffer and unsharded parameters.
  int max_prefetched_units = 1;
  // Note [own collectives] in param_group.cc: a parameter with at least this many elements whose rows split evenly
  // over the group (no padding) gets an all-gather of its own, straight into its unsharded tensor, and a
  // reduce-scatter of its own, straight from its gradient, when both move f32; the unit's other parameters share
  // one all-gather and one reduce-scatter through a buffer (copy-in / copy-out). Fewer bytes copied, more
  // collectives. INT64_MAX: one collective per unit per pass for every unit. Tests set it to 1.
  std::int64_t own_collective_min_numel = std::int64_t{1} << 16;
  // Mixed precision (fsdp/mixed_precision.h): the dtypes of the all-gather, the forward values, the reduce-scatter
  // and the root's outputs. Default: f32 throughout.
  MixedPrecisionPolicy mp_policy = {};
  // Where the shards live between steps (Note [cpu offload] in param_group.cc). Default: on the parameters' device.
  OffloadPolicy offload_policy = {};
};

}  // namespace shardkit::fsdp
