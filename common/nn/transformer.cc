#include "common/nn/transformer.h"

namespace shardkit::nn {
namespace {
float ResidualStd(const TransformerOptions& o) { return o.init_std / std::sqrt(2.f * static_cast<float>(o.num_layers)); }
}  // namespace

CausalSelfAttention::CausalSelfAttention(const TransformerOptions& o, Generator& gen)
    : Module("CausalSelfAttention"), num_heads_(o.num_heads) {
  SK_CHECK(o.num_heads > 0 && o.width % o.num_heads == 0)
      << "CausalSelfAttention: width " << o.width << " not divisible by " << o.num_heads << " heads";
  qkv_ = register_module("qkv", std::make_shared<Linear>(o.width, 3 * o.width, gen, true, o.init_std));
  proj_ = register_module("proj", std::make_shared<Linear>(o.width, o.width, gen, true, ResidualStd(o)));
  drop_ = register_module("drop", std::make_shared<Dropout>(o.dropout));
}

Tensor CausalSelfAttention::forward(const Tensor& x) {
  Tensor qkv = (*qkv_)(x);
  Tensor y = autograd::causal_attention(qkv, num_heads_);
  return (*drop_)((*proj_)(y));
}

MLP::MLP(const TransformerOptions& o, Generator& gen) : Module("MLP") {
  fc_ = register_module("fc", std::make_shared<Linear>(o.width, 4 * o.width, gen, true, o.init_std));
  act_ = register_module("act", std::make_shared<GELU>(GeluApproximation::tanh));  // GPT-2's form
  proj_ = register_module("proj", std::make_shared<Linear>(4 * o.width, o.width, gen, true, ResidualStd(o)));
  drop_ = register_module("drop", std::make_shared<Dropout>(o.dropout));
}

Tensor MLP::forward(const Tensor& x) { return (*drop_)((*proj_)((*act_)((*fc_)(x)))); }

TransformerBlock::TransformerBlock(const TransformerOptions& o, Generator& gen) : Module("TransformerBlock") {
  ln1_ = register_module("ln1", std::make_shared<LayerNorm>(o.width));
  attn_ = register_module("attn", std::make_shared<CausalSelfAttention>(o, gen));
  ln2_ = register_module("ln2", std::make_shared<LayerNorm>(o.width));
  mlp_ = register_module("mlp", std::make_shared<MLP>(o, gen));
}

Tensor TransformerBlock::forward(const Tensor& x) {
  Tensor h = autograd::add(x, (*attn_)((*ln1_)(x)));
  return autograd::add(h, (*mlp_)((*ln2_)(h)));
}

}  // namespace shardkit::nn
