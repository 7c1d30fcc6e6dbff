// Hugging Face GPT-2 parameter names for shardkit's GPT (common/nn/gpt.h), so a GPT trained here loads into a
// PyTorch / transformers GPT-2 of the same configuration and the other way round.
//
// Note [GPT-2 names]
//   shardkit (state_dict)             GPT-2 (prefix + ...)              file shape
//   wte.weight        [V, C]          wte.weight                        [V, C]
//   wpe.weight        [ctx, C]        wpe.weight                        [ctx, C]   (n_positions = ctx)
//   blocks.i.ln1.{weight,bias}        h.i.ln_1.{weight,bias}            [C]
//   blocks.i.attn.qkv.weight [3C, C]  h.i.attn.c_attn.weight            [C, 3C]    transposed (Conv1D)
//   blocks.i.attn.qkv.bias   [3C]     h.i.attn.c_attn.bias              [3C]
//   blocks.i.attn.proj.weight [C, C]  h.i.attn.c_proj.weight            [C, C]     transposed
//   blocks.i.attn.proj.bias           h.i.attn.c_proj.bias              [C]
//   blocks.i.ln2.{weight,bias}        h.i.ln_2.{weight,bias}            [C]
//   blocks.i.mlp.fc.weight  [4C, C]   h.i.mlp.c_fc.weight               [C, 4C]    transposed
//   blocks.i.mlp.fc.bias              h.i.mlp.c_fc.bias                 [4C]
//   blocks.i.mlp.proj.weight [C, 4C]  h.i.mlp.c_proj.weight             [4C, C]    transposed
//   blocks.i.mlp.proj.bias            h.i.mlp.c_proj.bias               [C]
//   ln_f.{weight,bias}                ln_f.{weight,bias}                [C]
//   lm_head.weight (tied to wte)      lm_head.weight (no prefix)        not written; checked equal if present
// GPT-2's Conv1D computes x @ W + b with W [in, out]; a shardkit Linear computes x @ W^T + b with W [out, in],
// hence the transposes. shardkit's attention takes one fused projection whose output holds q, k and v side
// by side, heads contiguous within each (common/autograd/ops/attention.h): exactly GPT-2's c_attn, which it
// splits into q, k, v along the last dimension and each into heads the same way; so c_attn is qkv^T with no
// reordering. Both use LayerNorm eps 1e-5 and the tanh GELU.
// The prefix is "transformer." for GPT2LMHeadModel's state dict (what save_pretrained writes today) or ""
// for GPT2Model's (the original "gpt2" checkpoint); importing accepts either. GPT-2 checkpoints may carry the
// attention mask buffers h.i.attn.bias / h.i.attn.masked_bias: they are ignored on import.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/io/name_map.h"
#include "common/nn/gpt.h"

namespace shardkit::io {

struct Gpt2NameOptions {
  std::string prefix = "transformer.";  // or "" (see the Note)
};

// Every state_dict() name of nn::GPT(config) <-> GPT-2's names, in state_dict order.
NameMap gpt2_name_map(const nn::GPTConfig& config, const Gpt2NameOptions& options = {});

// The prefix a GPT-2 file uses: "transformer." when `names` has "transformer.wte.weight", "" when it has
// "wte.weight"; NotFound otherwise.
absl::StatusOr<std::string> detect_gpt2_prefix(const std::vector<std::string>& names);

// The GPTConfig a set of GPT-2 tensors implies: vocab and width from wte.weight, context from wpe.weight,
// layers from the h.i.* names (0..L-1, each complete). The number of heads is not in the tensors (config.json
// has it as n_head); `num_heads` must divide the width. InvalidArgument / NotFound otherwise.
absl::StatusOr<nn::GPTConfig> infer_gpt2_config(const std::vector<SafetensorsTensorInfo>& tensors,
                                                std::int64_t num_heads);

// shardkit GPT state -> GPT-2 tensors (the file's names and layout), via gpt2_name_map.
absl::StatusOr<NamedTensors> gpt2_from_shardkit(const NamedTensors& state, const nn::GPTConfig& config,
                                                const Gpt2NameOptions& options = {});
// GPT-2 tensors (either prefix) -> a state dict for nn::GPT(config).load_state_dict.
absl::StatusOr<NamedTensors> shardkit_from_gpt2(const NamedTensors& tensors, const nn::GPTConfig& config);

}  // namespace shardkit::io
