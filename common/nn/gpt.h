// GPT: a GPT-2-style decoder-only transformer (DESIGN.md section 2, nn/).
//
// Parameters, in registration order (so in named_parameters()):
//   wte.weight [V, C]   token embedding, N(0, 0.02)
//   wpe.weight [ctx, C] position embedding, N(0, 0.01)
//   blocks.{i}.ln1.{weight,bias}, blocks.{i}.attn.qkv.{weight,bias}, blocks.{i}.attn.proj.{weight,bias},
//   blocks.{i}.ln2.{weight,bias}, blocks.{i}.mlp.fc.{weight,bias}, blocks.{i}.mlp.proj.{weight,bias}
//   ln_f.{weight,bias}
//   lm_head.weight      the SAME tensor as wte.weight (tied input/output embedding, a shared parameter
//                       on purpose): named_parameters() lists it once as "wte.weight"; with
//                       remove_duplicate = false and in state_dict() it also appears as "lm_head.weight".
// Parameter count: V*C + ctx*C + L*(12 C^2 + 13 C) + 2C.
//
// forward(idx [B, T] i64, T <= context) -> logits [B, T, V]. loss(idx, targets) = mean cross-entropy.
#pragma once

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/nn/transformer.h"

namespace shardkit::nn {

struct GPTConfig {
  std::int64_t vocab_size = 64;
  std::int64_t context = 16;
  std::int64_t width = 16;
  std::int64_t num_layers = 2;
  std::int64_t num_heads = 2;
  float dropout = 0.f;

  // Exact parameter count of a GPT with this config.
  std::int64_t num_parameters() const;

  // Named configs:            vocab  context  width  layers  heads  parameters
  //   "gpt-10k"                   64       16     16       3      2      11,152
  //   "gpt-100k"                 128       32     48       3      4      92,592
  //   "gpt-1m"                   512       64    128       4      4     867,072
  //   "gpt-10m"                 4096      128    256      12      8  10,558,976
  //   "gpt-100m"               16384      512    768      12     12  98,032,128
  //   "gpt2-small"             50257     1024    768      12     12 124,439,808  (GPT-2 small's shape)
  // NotFound (listing the names) for anything else.
  static absl::StatusOr<GPTConfig> named(const std::string& name);
  static std::vector<std::string> names();
};

class GPT : public Module {
 public:
  // Parameters drawn from `gen` in a fixed order: equal generators give bit-identical models.
  GPT(const GPTConfig& config, Generator& gen);
  // Same with Generator(seed).
  GPT(const GPTConfig& config, std::uint64_t seed);

  const GPTConfig& config() const { return config_; }
  // Mean cross-entropy of forward(idx) against targets [B, T] (i64).
  Tensor loss(const Tensor& idx, const Tensor& targets);

  std::shared_ptr<Embedding> wte, wpe;
  std::shared_ptr<ModuleList> blocks;
  std::shared_ptr<LayerNorm> ln_f;
  std::shared_ptr<Linear> lm_head;

 protected:
  Tensor forward(const Tensor& idx) override;

 private:
  void build(Generator& gen);
  GPTConfig config_;
};

}  // namespace shardkit::nn
