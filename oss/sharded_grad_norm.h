// The total gradient norm of a model whose gradients are sharded over a process group (ZeRO: each rank
// holds, or steps, a disjoint part of every gradient), and clipping by it. Used by Oss::clip_grad_norm and by
// fsdp's clip_grad_norm, so every strategy computes the norm the same way: each rank's partial over its
// part (sum of squares, or max |g|, accumulated in double from values read in fp32: common/optim/clip_grad.h),
// one all_reduce (sum; max for the inf-norm), the same result and coefficient on every rank.
//
// Collective: every rank of `group` calls it at the same point. Thread-safety: one rank's thread.
#pragma once

#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/comm/process_group.h"
#include "common/tensor/tensor.h"

namespace shardkit::oss {

struct ShardedNormOptions {
  // Deadline of the all_reduce; empty: the group's default.
  std::optional<absl::Duration> timeout = std::nullopt;
  // Tag of the all_reduce (error messages).
  std::string tag = "clip_grad_norm";
};

// Total norm (norm_type 2 or inf) of the gradients of `owned`, the tensors whose gradients this rank holds
// for the whole group (every gradient element on exactly one rank; tensors without a gradient are skipped).
// InvalidArgument for another norm_type; the all_reduce's Status when it fails.
absl::StatusOr<double> sharded_grad_norm(absl::Span<const Tensor> owned, comm::ProcessGroup& group,
                                         double norm_type, const ShardedNormOptions& options = {});

}  // namespace shardkit::oss
