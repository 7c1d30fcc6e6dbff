// Transformer pieces (GPT-2 layout): CausalSelfAttention, MLP, TransformerBlock.
//
// Names (as the sharding layers see them): attn.qkv, attn.proj, mlp.fc, mlp.proj, ln1, ln2.
// Init as GPT-2: Linear weights N(0, 0.02), the residual projections (attn.proj, mlp.proj)
// N(0, 0.02 / sqrt(2 * num_layers)), biases 0.
#pragma once

#include "common/nn/layers.h"

namespace shardkit::nn {

struct TransformerOptions {
  std::int64_t width = 64;     // C
  std::int64_t num_heads = 4;  // C % num_heads == 0
  std::int64_t num_layers = 1; // for the residual-projection init scale
  float dropout = 0.f;         // after attention probabilities' output projection and the MLP
  float init_std = 0.02f;
};

// x [B, T, C] -> [B, T, C]: qkv = Linear(C, 3C), fused causal attention, proj = Linear(C, C).
class CausalSelfAttention : public Module {
 public:
  CausalSelfAttention(const TransformerOptions& options, Generator& gen);

 protected:
  Tensor forward(const Tensor& x) override;

 private:
  std::int64_t num_heads_;
  std::shared_ptr<Linear> qkv_, proj_;
  std::shared_ptr<Dropout> drop_;
};

// x [..., C] -> fc = Linear(C, 4C), GELU (tanh form, as GPT-2), proj = Linear(4C, C).
class MLP : public Module {
 public:
  MLP(const TransformerOptions& options, Generator& gen);

 protected:
  Tensor forward(const Tensor& x) override;

 private:
  std::shared_ptr<Linear> fc_, proj_;
  std::shared_ptr<GELU> act_;
  std::shared_ptr<Dropout> drop_;
};

// Pre-norm block: x + attn(ln1(x)), then + mlp(ln2(.)).
class TransformerBlock : public Module {
 public:
  TransformerBlock(const TransformerOptions& options, Generator& gen);

 protected:
  Tensor forward(const Tensor& x) override;

 private:
  std::shared_ptr<LayerNorm> ln1_, ln2_;
  std::shared_ptr<CausalSelfAttention> attn_;
  std::shared_ptr<MLP> mlp_;
};

}  // namespace shardkit::nn
