// Shape ops with gradients: reshape, transpose/permute, split, concat, narrow, cast.
//
// reshape returns a tensor over the same bytes (no copy); the others copy. Dimensions may be negative
// (counted from the end). As elsewhere, ops compute on f32 CPU tensors, except cast (any float dtype).
#pragma once

#include <vector>

#include "common/tensor/tensor.h"

namespace shardkit::autograd {

// Same elements, new shape (one -1 allowed); shares x's bytes.
Tensor reshape(const Tensor& x, const Shape& shape);
// out.shape[i] = x.shape[dims[i]].
Tensor permute(const Tensor& x, const std::vector<std::int64_t>& dims);
// Swaps two dimensions.
Tensor transpose(const Tensor& x, std::int64_t dim0, std::int64_t dim1);
// Splits along `dim` into pieces of the given sizes (which must add up to x.size(dim)).
std::vector<Tensor> split(const Tensor& x, const std::vector<std::int64_t>& sizes, std::int64_t dim);
// Joins along `dim`; all other dimensions must agree.
Tensor concat(const std::vector<Tensor>& xs, std::int64_t dim);
// Elements [start, start + length) along `dim`.
Tensor narrow(const Tensor& x, std::int64_t dim, std::int64_t start, std::int64_t length);
// The values in another float dtype; the gradient is cast back to x's dtype.
Tensor cast(const Tensor& x, DType dtype);

}  // namespace shardkit::autograd
