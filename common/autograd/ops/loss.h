// Cross-entropy loss with gradient (fused log-softmax + negative log-likelihood).
#pragma once

#include <cstdint>

#include "common/tensor/tensor.h"

namespace shardkit::autograd {

// logits [..., V] (f32), targets [...] (i64, values in [0, V) or ignore_index). Returns the mean over
// the non-ignored positions of -log softmax(logits)[target], as a 0-d tensor (0 when all are ignored).
// A target outside [0, V) that is not ignore_index throws InternalError naming the position.
Tensor cross_entropy(const Tensor& logits, const Tensor& targets, std::int64_t ignore_index = -100);

}  // namespace shardkit::autograd
