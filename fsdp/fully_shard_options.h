// Options of fsdp::fully_shard (fully_shard.h).
#pragma once

#include <optional>
#include <vector>

#include "absl/time/time.h"
#include "common/tensor/tensor.h"

namespace shardkit::fsdp {

struct FullyShardOptions {
  // Release the unit's unsharded parameters after its forward (all-gathered again before its backward).
  // Empty: FSDP2's heuristic, true for every unit but the root (whose parameters backward needs first).
  // false keeps them from forward to the end of backward: less communication, more memory.
  std::optional<bool> reshard_after_forward = std::nullopt;
  // Parameters this call leaves alone (FSDP's ignored_params): they stay replicated, whole on every rank, and
  // FSDP neither shards nor reduces their gradients (the training loop must, if it wants them averaged).
  std::vector<Tensor> ignored_params = {};
  // Deadline of each collective; empty: the group's default.
  std::optional<absl::Duration> timeout = std::nullopt;
};

}  // namespace shardkit::fsdp
