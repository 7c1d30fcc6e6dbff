#include "common/autograd/ops/embedding.h"

#include <cstring>

#include "common/autograd/ops/op_utils.h"
#include "common/kernels/cuda/cuda_kernels.h"

namespace shardkit::autograd {
namespace {

// embedding on a CUDA device (Note [ops on devices]); the forward waits for the device to check the indices.
Tensor EmbeddingOnDevice(const Tensor& weight, const Tensor& indices, const Shape& out_shape) {
  const Device device = weight.device();
  const std::int64_t vocab = weight.size(0), c = weight.size(1), n = indices.numel();
  Tensor out = detail::new_activation(out_shape, DType::f32, device);
  const std::int64_t bad = kernels::cuda::embedding(device, detail::ptr_or_null<float>(weight),
                                                    detail::ptr_or_null<std::int64_t>(indices),
                                                    detail::ptr_or_null<float>(out), n, c, vocab);
  SK_CHECK(bad < 0) << "embedding: index " << detail::i64_at(indices, bad) << " at position " << bad
                    << " is outside [0, " << vocab << ")";
  if (should_record({&weight})) {
    detail::record("EmbeddingBackward", {&weight}, {&out}, [indices, vocab, c, n](TensorList&& g) -> TensorList {
      Tensor gw = detail::zeros_activation({vocab, c}, DType::f32, indices.device());
      kernels::cuda::embedding_backward(indices.device(), detail::ptr_or_null<std::int64_t>(indices),
                                        detail::ptr_or_null<float>(g[0]), detail::ptr_or_null<float>(gw), n, c);
      return {gw};
    });
  }
  return out;
}

}  // namespace

Tensor embedding_compute(const Tensor& weight, const Tensor& indices) {
  detail::check_f32("embedding", weight);
  SK_CHECK(weight.dim() == 2) << "embedding: expected weight [V, C], found " << weight.describe();
  SK_CHECK(indices.defined() && indices.dtype() == DType::i64 && indices.device() == weight.device())
      << "embedding: expected i64 indices on " << weight.device().str() << ", found "
      << (indices.defined() ? indices.describe() : "undefined");
  const std::int64_t vocab = weight.size(0), c = weight.size(1);
  const std::int64_t n = indices.numel();
  Shape out_shape = indices.shape();
  out_shape.push_back(c);
  if (weight.device().is_cuda()) return EmbeddingOnDevice(weight, indices, out_shape);
  Tensor out = detail::new_activation(out_shape);
  const std::int64_t* idx = indices.data<std::int64_t>();
  const float* w = weight.data<float>();
  float* y = out.data<float>();
  for (std::int64_t i = 0; i < n; ++i) {
    SK_CHECK(idx[i] >= 0 && idx[i] < vocab) << "embedding: index " << idx[i] << " at position " << i
                                            << " is outside [0, " << vocab << ")";
    std::memcpy(y + i * c, w + idx[i] * c, static_cast<std::size_t>(c) * sizeof(float));
  }
  if (should_record({&weight})) {
    detail::record("EmbeddingBackward", {&weight}, {&out},
                   [indices, vocab, c, n](TensorList&& g) -> TensorList {
                     Tensor gw = detail::zeros_activation({vocab, c});
                     const std::int64_t* idx = indices.data<std::int64_t>();
                     const float* gp = g[0].data<float>();
                     float* o = gw.data<float>();
                     for (std::int64_t i = 0; i < n; ++i) {
                       float* __restrict row = o + idx[i] * c;
                       const float* __restrict gr = gp + i * c;
                       for (std::int64_t j = 0; j < c; ++j) row[j] += gr[j];
                     }
                     return {gw};
                   });
  }
  return out;
}

Tensor embedding(const Tensor& weight, const Tensor& indices) {
  return detail::traced("embedding", {weight, indices}, [](const TensorList& t) { return embedding_compute(t[0], t[1]); });
}

}  // namespace shardkit::autograd
