// Normalisation ops with gradients: layer_norm and batch_norm.
#pragma once

#include "common/tensor/tensor.h"

namespace shardkit::autograd {

// Normalises over the last dimension (size C): (x - mean) / sqrt(var + eps) * weight + bias, with the
// biased variance. weight and bias are [C] (either may be undefined).
Tensor layer_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, float eps = 1e-5f);

// x [N, C]: per feature c. Training: normalises with the batch mean and biased variance, and
// updates the running buffers in place (no gradient): running = (1 - momentum) running + momentum * stat,
// with the unbiased variance for running_var (PyTorch's convention). Not training: normalises with the
// running buffers. weight / bias [C] may be undefined; running buffers may be undefined when training.
Tensor batch_norm(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& running_mean,
                  const Tensor& running_var, bool training, float momentum = 0.1f, float eps = 1e-5f);

}  // namespace shardkit::autograd
