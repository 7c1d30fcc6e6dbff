// fsdp::clip_grad_norm: gradient clipping by the global norm of a fully sharded model.
#pragma once

#include "absl/status/statusor.h"
#include "common/nn/module.h"

namespace shardkit::fsdp {

// Clips the gradients the optimizer will step (model.parameters(): the shards of every unit under `root`, and
// the parameters FSDP leaves whole) by the norm of the whole model's gradient (norm_type 2 or inf): each shard's
// gradient counts once across the ranks (its rows are disjoint), a whole parameter's once (it is the same on every
// rank). Scales them by min(1, max_norm / (norm + 1e-6)) and returns the norm before clipping, the same on every
// rank. Call it after backward, before the optimizer's step. Collective over the root unit's group.
// InvalidArgument for another norm_type, max_norm <= 0 or NaN, or when `root` is not a module fully_shard sharded.
absl::StatusOr<double> clip_grad_norm(nn::Module& root, double max_norm, double norm_type = 2.0);

}  // namespace shardkit::fsdp
