// Activations with gradients: relu, gelu, softmax, log_softmax (last dimension), dropout.
#pragma once

#include "common/tensor/tensor.h"

namespace shardkit::autograd {

Tensor relu(const Tensor& x);
// GPT-2's tanh approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
Tensor gelu(const Tensor& x);
// Over the last dimension, max-subtracted.
Tensor softmax(const Tensor& x);
Tensor log_softmax(const Tensor& x);

// Training: zeroes each element with probability p and scales the rest by 1 / (1 - p), drawing the mask
// from the calling thread's rank generator (current_rank_context().generator), so each simulated rank
// has its own stream and a rank's results do not depend on the others. Not training, or p == 0: x.
Tensor dropout(const Tensor& x, float p, bool training);

}  // namespace shardkit::autograd
