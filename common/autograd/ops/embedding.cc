#include "common/autograd/ops/embedding.h"

#include <cstring>

#include "common/autograd/ops/op_utils.h"

namespace shardkit::autograd {

Tensor embedding_compute(const Tensor& weight, const Tensor& indices) {
  detail::check_f32_cpu("embedding", weight);
  SK_CHECK(weight.dim() == 2) << "embedding: expected weight [V, C], found " << weight.describe();
  SK_CHECK(indices.defined() && indices.dtype() == DType::i64 && indices.device().is_cpu())
      << "embedding: expected i64 CPU indices, found " << (indices.defined() ? indices.describe() : "undefined");
  const std::int64_t vocab = weight.size(0), c = weight.size(1);
  const std::int64_t n = indices.numel();
  Shape out_shape = indices.shape();
  out_shape.push_back(c);
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
