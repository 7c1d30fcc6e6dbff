#include "common/nn/gpt.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace shardkit::nn {
namespace {

struct NamedConfig {
  const char* name;
  GPTConfig config;
};

const std::vector<NamedConfig>& Configs() {
  static const std::vector<NamedConfig> kConfigs = {
      {"gpt-10k", {.vocab_size = 64, .context = 16, .width = 16, .num_layers = 3, .num_heads = 2}},
      {"gpt-100k", {.vocab_size = 128, .context = 32, .width = 48, .num_layers = 3, .num_heads = 4}},
      {"gpt-1m", {.vocab_size = 512, .context = 64, .width = 128, .num_layers = 4, .num_heads = 4}},
      {"gpt-10m", {.vocab_size = 4096, .context = 128, .width = 256, .num_layers = 12, .num_heads = 8}},
      {"gpt-100m", {.vocab_size = 16384, .context = 512, .width = 768, .num_layers = 12, .num_heads = 12}},
      {"gpt2-small", {.vocab_size = 50257, .context = 1024, .width = 768, .num_layers = 12, .num_heads = 12}},
  };
  return kConfigs;
}

}  // namespace

std::int64_t GPTConfig::num_parameters() const {
  const std::int64_t c = width;
  return vocab_size * c + context * c + num_layers * (12 * c * c + 13 * c) + 2 * c;
}

absl::StatusOr<GPTConfig> GPTConfig::named(const std::string& name) {
  for (const auto& nc : Configs()) {
    if (name == nc.name) return nc.config;
  }
  return absl::NotFoundError(
      absl::StrCat("expected a GPT config name (", absl::StrJoin(names(), ", "), "), found \"", name, "\""));
}

std::vector<std::string> GPTConfig::names() {
  std::vector<std::string> out;
  for (const auto& nc : Configs()) out.emplace_back(nc.name);
  return out;
}

GPT::GPT(const GPTConfig& config, Generator& gen) : Module("GPT"), config_(config) { build(gen); }

GPT::GPT(const GPTConfig& config, std::uint64_t seed) : Module("GPT"), config_(config) {
  Generator gen(seed);
  build(gen);
}

void GPT::build(Generator& gen) {
  const GPTConfig& c = config_;
  SK_CHECK(c.vocab_size > 0 && c.context > 0 && c.width > 0 && c.num_layers >= 0 && c.num_heads > 0 &&
           c.width % c.num_heads == 0)
      << "GPT: invalid config vocab=" << c.vocab_size << " context=" << c.context << " width=" << c.width
      << " layers=" << c.num_layers << " heads=" << c.num_heads;
  wte = register_module("wte", std::make_shared<Embedding>(c.vocab_size, c.width, gen, 0.02f));
  wpe = register_module("wpe", std::make_shared<Embedding>(c.context, c.width, gen, 0.01f));
  blocks = register_module("blocks", std::make_shared<ModuleList>());
  TransformerOptions o{.width = c.width, .num_heads = c.num_heads, .num_layers = std::max<std::int64_t>(1, c.num_layers),
                       .dropout = c.dropout};
  for (std::int64_t i = 0; i < c.num_layers; ++i) blocks->push_back(std::make_shared<TransformerBlock>(o, gen));
  ln_f = register_module("ln_f", std::make_shared<LayerNorm>(c.width));
  // The output projection shares the token embedding (weight tying): drop the Linear's own weight.
  lm_head = register_module("lm_head", std::make_shared<Linear>(wte->weight()));
}

Tensor GPT::forward(const Tensor& idx) {
  SK_CHECK(idx.dim() == 2 && idx.dtype() == DType::i64) << "GPT: expected idx [B, T] i64, found " << idx.describe();
  const std::int64_t t = idx.size(1);
  SK_CHECK_LE(t, config_.context) << "GPT: sequence longer than the context";
  Tensor x = (*wte)(idx);
  x = autograd::add(x, autograd::narrow(as_f32(wpe->weight()), 0, 0, t));
  for (std::size_t i = 0; i < blocks->size(); ++i) x = (*(*blocks)[i])(x);
  x = (*ln_f)(x);
  return (*lm_head)(x);
}

Tensor GPT::loss(const Tensor& idx, const Tensor& targets) {
  Tensor logits = (*this)(idx);
  return autograd::cross_entropy(logits, targets);
}

}  // namespace shardkit::nn
