// Small non-transformer models for tests and examples.
#pragma once

#include <vector>

#include "common/nn/layers.h"

namespace shardkit::nn {

enum class Activation { relu, gelu };

// sizes = {in, h1, ..., out}: Linear(sizes[i], sizes[i+1]) with the activation between layers (not
// after the last). Children: "0" Linear, "1" activation, "2" Linear, ... (PyTorch Sequential names).
std::shared_ptr<Sequential> make_mlp(const std::vector<std::int64_t>& sizes, Generator& gen,
                                     Activation activation = Activation::relu);

// Like make_mlp with BatchNorm1d after each hidden Linear: Linear, BatchNorm1d, ReLU, ..., Linear.
// Buffers: "{i}.running_mean", "{i}.running_var".
std::shared_ptr<Sequential> make_batchnorm_mlp(const std::vector<std::int64_t>& sizes, Generator& gen);

}  // namespace shardkit::nn
