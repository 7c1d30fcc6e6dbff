#include "common/nn/layers.h"

namespace shardkit::nn {

Linear::Linear(std::int64_t in_features, std::int64_t out_features, Generator& gen, bool bias, float init_std)
    : Module("Linear"), in_(in_features), out_(out_features) {
  if (init_std > 0.f) {
    register_parameter("weight", init::normal({out_features, in_features}, gen, 0.f, init_std));
    if (bias) register_parameter("bias", init::zeros({out_features}));
    return;
  }
  const float bound = in_features > 0 ? 1.f / std::sqrt(static_cast<float>(in_features)) : 0.f;
  register_parameter("weight", init::uniform({out_features, in_features}, gen, -bound, bound));
  if (bias) register_parameter("bias", init::uniform({out_features}, gen, -bound, bound));
}

Linear::Linear(Tensor weight, Tensor bias) : Module("Linear") {
  SK_CHECK(weight.defined() && weight.dim() == 2) << "Linear: expected a 2-d weight";
  out_ = weight.size(0);
  in_ = weight.size(1);
  register_parameter("weight", std::move(weight));
  if (bias.defined()) register_parameter("bias", std::move(bias));
}

Tensor Linear::forward(const Tensor& x) {
  return autograd::linear(x, as_f32(weight()), has_bias() ? as_f32(parameter("bias")) : Tensor());
}

Embedding::Embedding(std::int64_t num_embeddings, std::int64_t dim, Generator& gen, float init_std)
    : Module("Embedding") {
  register_parameter("weight", init::normal({num_embeddings, dim}, gen, 0.f, init_std));
}

Tensor Embedding::forward(const Tensor& indices) { return autograd::embedding(as_f32(weight()), indices); }

LayerNorm::LayerNorm(std::int64_t dim, float eps) : Module("LayerNorm"), eps_(eps) {
  register_parameter("weight", init::ones({dim}));
  register_parameter("bias", init::zeros({dim}));
}

Tensor LayerNorm::forward(const Tensor& x) {
  return autograd::layer_norm(x, as_f32(parameter("weight")), as_f32(parameter("bias")), eps_);
}

BatchNorm1d::BatchNorm1d(std::int64_t features, float momentum, float eps)
    : Module("BatchNorm1d"), momentum_(momentum), eps_(eps) {
  register_parameter("weight", init::ones({features}));
  register_parameter("bias", init::zeros({features}));
  register_buffer("running_mean", Tensor::zeros({features}));
  register_buffer("running_var", Tensor::full({features}, 1.0));
}

Tensor BatchNorm1d::forward(const Tensor& x) {
  return autograd::batch_norm(x, as_f32(parameter("weight")), as_f32(parameter("bias")), buffer("running_mean"),
                              buffer("running_var"), is_training(), momentum_, eps_);
}

Tensor Sequential::forward(const Tensor& x) {
  Tensor h = x;
  for (const auto& [name, m] : named_children()) h = (*m)(h);
  return h;
}

}  // namespace shardkit::nn
