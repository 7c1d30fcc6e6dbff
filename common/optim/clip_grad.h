// Local gradient clipping by total norm (torch.nn.utils.clip_grad_norm_), and the pieces a sharded
// version needs (OSS: local partial norms, one all_reduce (sum for the 2-norm, max for the inf-norm),
// then the same coefficient and scaling on every rank).
//
// Norms are accumulated in double from the gradients read in fp32, so bf16/f16 gradients whose squares
// overflow f16 (|g| > 256) still give the exact total. Parameters without a gradient are skipped.
// norm_type must be 2 or infinity (std::numeric_limits<double>::infinity()); anything else is a broken
// precondition (InternalError). CPU tensors only. Thread-safety: pure functions of their arguments,
// which must not be modified concurrently.
#pragma once

#include "absl/types/span.h"
#include "common/tensor/tensor.h"

namespace shardkit::optim {

// Sum of squares (norm_type 2) or maximum absolute value (norm_type inf) over every gradient.
double grad_norm_partial(absl::Span<const Tensor> params, double norm_type);
// Combines partials (already summed / maxed over shards) into the norm: sqrt for 2, identity for inf.
double grad_norm_from_partial(double partial, double norm_type);
// min(1, max_norm / (total_norm + 1e-6)), as PyTorch (NaN when total_norm is NaN).
double clip_coefficient(double total_norm, double max_norm);
// Multiplies every gradient by `factor` (in fp32, rounded back to the gradient's dtype).
void scale_grads(absl::Span<const Tensor> params, double factor);

// Scales the gradients so that their total norm is at most max_norm (unchanged when it already is) and
// returns the total norm before clipping. Like PyTorch, a non-finite total norm scales by NaN or 0.
double clip_grad_norm(absl::Span<const Tensor> params, double max_norm, double norm_type = 2.0);

}  // namespace shardkit::optim
