// How the combination tests checkpoint a GPT (tests/sddp/sddp_combo5_test.cc, tests/fsdp/fsdp_combo5_test.cc).
#pragma once

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/nn/checkpoint.h"
#include "common/nn/gpt.h"

namespace shardkit::checkpoint_gpt {

enum class Ckpt { blocks, inside_blocks };

// Checkpoints the final LayerNorm, and the blocks or the attention and MLP modules inside each block.
inline absl::Status Checkpoint(nn::GPT& model, Ckpt what) {
  if (absl::Status s = nn::checkpoint(*model.ln_f); !s.ok()) return s;
  if (what == Ckpt::blocks) return nn::checkpoint_blocks(model);
  int n = 0;
  for (auto& [name, m] : model.named_modules()) {
    if (m->type_name() == "CausalSelfAttention" || m->type_name() == "MLP") {
      if (absl::Status s = nn::checkpoint(*m); !s.ok()) return s;
      ++n;
    }
  }
  if (n != 2 * static_cast<int>(model.blocks->named_children().size())) {
    return absl::InternalError(absl::StrCat("checkpointed ", n, " modules inside the blocks"));
  }
  return absl::OkStatus();
}

}  // namespace shardkit::checkpoint_gpt
