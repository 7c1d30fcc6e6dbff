// Elementwise ops with gradients: add, sub, mul, scale, square, pow (DESIGN.md section 2; issue 3).
//
// Broadcasting: `b` has either a's shape or a suffix of it (b = [C] against a = [N, C], b = [T, C]
// against a = [B, T, C]); b is then repeated over a's leading dimensions, and its gradient is summed
// over them. This covers biases and position embeddings; general numpy broadcasting is not supported.
//
// All ops compute in fp32 on the CPU, return new tensors charged as activations (grad_accumulation.h),
// and record a backward node when grad mode is on and an input requires grad.
#pragma once

#include "common/tensor/tensor.h"

namespace shardkit::autograd {

Tensor add(const Tensor& a, const Tensor& b);
Tensor sub(const Tensor& a, const Tensor& b);
Tensor mul(const Tensor& a, const Tensor& b);
// a * s
Tensor scale(const Tensor& a, float s);

// x * x; gradient 2 x.
Tensor square(const Tensor& x);

// x^exponent elementwise, as std::pow: x < 0 with a non-integer exponent gives NaN, 0 to a negative
// exponent inf, x^0 = 1 for every x (NaN included). Exponents 0, 1, 2, 3, 0.5, -0.5, -1 and -2 run as
// vectorised loops, any other calls std::pow per element (Note [pow exponents] in elementwise.cc).
//
// Gradient, as PyTorch's: d/dx x^p = p x^(p-1), and 0 everywhere when p == 0 (x^0 is constant, even at
// x = 0 where p x^(p-1) would be 0 * inf). Where x^(p-1) is not finite the gradient is not either:
//   x = 0: 0 for p > 1, 1 for p == 1, infinite for p < 1 (p != 0): the slope is unbounded there (NaN
//          where the incoming gradient is 0);
//   x < 0: p x^(p-1) for an integer p (3 x^2 for p = 3), NaN for a non-integer p (as the value).
Tensor pow(const Tensor& x, float exponent);

}  // namespace shardkit::autograd
