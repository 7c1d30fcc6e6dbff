// Fused causal multi-head self-attention with gradient (the GPT block's core).
//
// qkv [B, T, 3C] holds, per position, the query, key and value projections side by side (C = H * hs,
// head h at columns [h*hs, (h+1)*hs) of each third). The result [B, T, C] is, per head, softmax(q k^T /
// sqrt(hs) with future positions masked) v, heads concatenated. Implemented as 2 GEMMs per (batch,
// head) in forward and 4 in backward, reading q, k and v in place through leading dimensions (no
// transposes, no copies); saves the attention probabilities [B, H, T, T] for backward. On a CUDA device
// at MatmulPrecision::medium (sm_80 or newer) it is one fused kernel each way instead, bf16 products
// with fp32 softmax, saving the result and each row's log-sum-exp (Note [flash attention] in
// common/kernels/cuda/flash_attention.cu).
#pragma once

#include <cstdint>

#include "common/tensor/tensor.h"

namespace shardkit::autograd {

Tensor causal_attention(const Tensor& qkv, std::int64_t num_heads);

}  // namespace shardkit::autograd
