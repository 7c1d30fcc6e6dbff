// Embedding lookup with gradient.
#pragma once

#include "common/tensor/tensor.h"

namespace shardkit::autograd {

// weight [V, C] (f32), indices (i64, any shape, values in [0, V)) -> [indices..., C]. The gradient
// w.r.t. weight is dense [V, C], with the rows of repeated indices summed. An index outside [0, V)
// throws InternalError naming the position.
Tensor embedding(const Tensor& weight, const Tensor& indices);

}  // namespace shardkit::autograd
