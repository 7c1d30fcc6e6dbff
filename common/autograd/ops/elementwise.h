// Elementwise ops with gradients: add, sub, mul, scale (DESIGN.md section 2; issue 3).
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

}  // namespace shardkit::autograd
