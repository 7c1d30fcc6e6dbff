// Activations with gradients: relu, gelu (exact or tanh form), softmax, log_softmax (last dimension), dropout.
#pragma once

#include "common/tensor/tensor.h"

namespace shardkit::autograd {

Tensor relu(const Tensor& x);

// Which GELU gelu() computes, as PyTorch's approximate='none' | 'tanh'.
enum class GeluApproximation {
  // GELU(x) = x Phi(x) = 0.5 x (1 + erf(x / sqrt 2)), Phi the standard normal CDF, computed to within
  // 6.6e-8 (fast_math.h); the gradient is Phi(x) + x phi(x), phi the normal density.
  none,
  // GPT-2's approximation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), within 4.8e-4 of the exact
  // form (the largest difference is near |x| = 2.7); the gradient is that expression's derivative.
  tanh,
};

// The default is the exact form, as torch.nn.functional.gelu's; GPT-2-style models pass tanh.
Tensor gelu(const Tensor& x, GeluApproximation approximate = GeluApproximation::none);

// Over the last dimension, max-subtracted.
Tensor softmax(const Tensor& x);
Tensor log_softmax(const Tensor& x);

// Training: zeroes each element with probability p and scales the rest by 1 / (1 - p), drawing the mask
// from the calling thread's rank generator (current_rank_context().generator), so each simulated rank
// has its own stream and a rank's results do not depend on the others. Not training, or p == 0: x.
Tensor dropout(const Tensor& x, float p, bool training);

}  // namespace shardkit::autograd
