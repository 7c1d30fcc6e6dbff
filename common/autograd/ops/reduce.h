// Reductions with gradients: sum and mean of all elements (a 0-d result, shape {}).
// Accumulated in double, so the result does not depend on the summation order of a long row.
#pragma once

#include "common/tensor/tensor.h"

namespace shardkit::autograd {

Tensor sum(const Tensor& x);
Tensor mean(const Tensor& x);

}  // namespace shardkit::autograd
