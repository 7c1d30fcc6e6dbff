#include "common/io/gpt2_names.h"

#include <map>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace shardkit::io {
namespace {

// (shardkit suffix, GPT-2 suffix, transpose) for the tensors of one block, in registration order.
struct BlockName {
  const char* internal;
  const char* external;
  bool transpose;
};
constexpr BlockName kBlockNames[] = {
    {"ln1.weight", "ln_1.weight", false},           {"ln1.bias", "ln_1.bias", false},
    {"attn.qkv.weight", "attn.c_attn.weight", true}, {"attn.qkv.bias", "attn.c_attn.bias", false},
    {"attn.proj.weight", "attn.c_proj.weight", true}, {"attn.proj.bias", "attn.c_proj.bias", false},
    {"ln2.weight", "ln_2.weight", false},           {"ln2.bias", "ln_2.bias", false},
    {"mlp.fc.weight", "mlp.c_fc.weight", true},     {"mlp.fc.bias", "mlp.c_fc.bias", false},
    {"mlp.proj.weight", "mlp.c_proj.weight", true}, {"mlp.proj.bias", "mlp.c_proj.bias", false},
};

}  // namespace

NameMap gpt2_name_map(const nn::GPTConfig& config, const Gpt2NameOptions& options) {
  const std::string& p = options.prefix;
  NameMap map;
  map.entries.push_back({"wte.weight", p + "wte.weight", false, ""});
  map.entries.push_back({"wpe.weight", p + "wpe.weight", false, ""});
  for (std::int64_t i = 0; i < config.num_layers; ++i) {
    for (const BlockName& b : kBlockNames) {
      map.entries.push_back({absl::StrCat("blocks.", i, ".", b.internal), absl::StrCat(p, "h.", i, ".", b.external),
                             b.transpose, ""});
    }
    map.ignored_external.push_back(absl::StrCat(p, "h.", i, ".attn.bias"));
    map.ignored_external.push_back(absl::StrCat(p, "h.", i, ".attn.masked_bias"));
  }
  map.entries.push_back({"ln_f.weight", p + "ln_f.weight", false, ""});
  map.entries.push_back({"ln_f.bias", p + "ln_f.bias", false, ""});
  map.entries.push_back({"lm_head.weight", "lm_head.weight", false, "wte.weight"});
  return map;
}

absl::StatusOr<std::string> detect_gpt2_prefix(const std::vector<std::string>& names) {
  const std::set<std::string> all(names.begin(), names.end());
  if (all.contains("transformer.wte.weight")) return std::string("transformer.");
  if (all.contains("wte.weight")) return std::string();
  return absl::NotFoundError(
      "expected GPT-2 tensors (\"transformer.wte.weight\" or \"wte.weight\"), found neither");
}

absl::StatusOr<nn::GPTConfig> infer_gpt2_config(const std::vector<SafetensorsTensorInfo>& tensors,
                                                std::int64_t num_heads) {
  std::vector<std::string> names;
  for (const auto& t : tensors) names.push_back(t.name);
  absl::StatusOr<std::string> prefix = detect_gpt2_prefix(names);
  if (!prefix.ok()) return prefix.status();
  std::map<std::string, const SafetensorsTensorInfo*> by_name;
  std::set<std::int64_t> layers;
  for (const auto& t : tensors) {
    by_name.emplace(t.name, &t);
    absl::string_view rest = t.name;
    if (!absl::ConsumePrefix(&rest, *prefix) || !absl::ConsumePrefix(&rest, "h.")) continue;
    const std::vector<absl::string_view> parts = absl::StrSplit(rest, '.');
    std::int64_t layer = 0;
    if (parts.empty() || !absl::SimpleAtoi(parts[0], &layer) || layer < 0) {
      return absl::InvalidArgumentError(absl::StrCat("tensor '", t.name, "': expected h.<layer>.<name>"));
    }
    layers.insert(layer);
  }
  const auto shape_of = [&](const std::string& name) -> const Shape* {
    const auto it = by_name.find(name);
    return it == by_name.end() ? nullptr : &it->second->shape;
  };
  const Shape* wte = shape_of(*prefix + "wte.weight");
  const Shape* wpe = shape_of(*prefix + "wpe.weight");
  if (wpe == nullptr) return absl::NotFoundError(absl::StrCat("expected tensor '", *prefix, "wpe.weight', found none"));
  if (wte->size() != 2 || wpe->size() != 2 || (*wte)[1] != (*wpe)[1]) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected wte.weight [vocab, width] and wpe.weight [context, width], found ", shape_str(*wte),
                     " and ", shape_str(*wpe)));
  }
  nn::GPTConfig config;
  config.vocab_size = (*wte)[0];
  config.context = (*wpe)[0];
  config.width = (*wte)[1];
  config.num_layers = static_cast<std::int64_t>(layers.size());
  config.num_heads = num_heads;
  if (!layers.empty() && *layers.rbegin() != config.num_layers - 1) {
    return absl::InvalidArgumentError(absl::StrCat("expected layers h.0 .. h.", config.num_layers - 1,
                                                   ", found h.", *layers.rbegin(), " among ", layers.size(), " layers"));
  }
  if (num_heads <= 0 || config.width % num_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("expected a number of heads dividing the width ", config.width, ", found ", num_heads));
  }
  for (std::int64_t i = 0; i < config.num_layers; ++i) {
    for (const BlockName& b : kBlockNames) {
      const std::string name = absl::StrCat(*prefix, "h.", i, ".", b.external);
      if (shape_of(name) == nullptr) return absl::NotFoundError(absl::StrCat("expected tensor '", name, "', found none"));
    }
  }
  return config;
}

absl::StatusOr<NamedTensors> gpt2_from_shardkit(const NamedTensors& state, const nn::GPTConfig& config,
                                                const Gpt2NameOptions& options) {
  return to_external(state, gpt2_name_map(config, options));
}

absl::StatusOr<NamedTensors> shardkit_from_gpt2(const NamedTensors& tensors, const nn::GPTConfig& config) {
  std::vector<std::string> names;
  for (const auto& [name, t] : tensors) names.push_back(name);
  absl::StatusOr<std::string> prefix = detect_gpt2_prefix(names);
  if (!prefix.ok()) return prefix.status();
  return to_internal(tensors, gpt2_name_map(config, Gpt2NameOptions{.prefix = *prefix}));
}

}  // namespace shardkit::io
