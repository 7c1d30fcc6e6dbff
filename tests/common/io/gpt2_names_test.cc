// shardkit GPT <-> Hugging Face GPT-2 names: the map is complete, the shapes are GPT-2's, round trips are exact.
#include "common/io/gpt2_names.h"

#include <set>

#include "common/autograd/grad_mode.h"
#include "common/io/safetensors_sharded.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io_test_util.h"

namespace shardkit::io {
namespace {

using ::testing::HasSubstr;
using testing::Bytes;
using testing::ScratchDir;

nn::GPTConfig Config() { return *nn::GPTConfig::named("gpt-10k"); }  // V 64, ctx 16, C 16, 3 layers, 2 heads

std::map<std::string, Tensor> AsMap(const NamedTensors& t) { return {t.begin(), t.end()}; }

TEST(Gpt2NamesTest, ExportHasGpt2NamesAndShapes) {
  const nn::GPTConfig c = Config();
  nn::GPT gpt(c, 1);
  absl::StatusOr<NamedTensors> hf = gpt2_from_shardkit(gpt.state_dict(), c);
  ASSERT_TRUE(hf.ok()) << hf.status();
  const std::int64_t C = c.width;
  std::map<std::string, Shape> want = {
      {"transformer.wte.weight", {c.vocab_size, C}},
      {"transformer.wpe.weight", {c.context, C}},
      {"transformer.ln_f.weight", {C}},
      {"transformer.ln_f.bias", {C}},
  };
  for (int i = 0; i < c.num_layers; ++i) {
    const std::string h = "transformer.h." + std::to_string(i) + ".";
    want[h + "ln_1.weight"] = {C};
    want[h + "ln_1.bias"] = {C};
    want[h + "attn.c_attn.weight"] = {C, 3 * C};
    want[h + "attn.c_attn.bias"] = {3 * C};
    want[h + "attn.c_proj.weight"] = {C, C};
    want[h + "attn.c_proj.bias"] = {C};
    want[h + "ln_2.weight"] = {C};
    want[h + "ln_2.bias"] = {C};
    want[h + "mlp.c_fc.weight"] = {C, 4 * C};
    want[h + "mlp.c_fc.bias"] = {4 * C};
    want[h + "mlp.c_proj.weight"] = {4 * C, C};
    want[h + "mlp.c_proj.bias"] = {C};
  }
  std::map<std::string, Shape> got;
  for (const auto& [name, t] : *hf) got[name] = t.shape();
  EXPECT_EQ(got, want);  // lm_head.weight is tied to wte: not written, as save_pretrained does
  // The transposes are real: c_attn.weight[i][j] == qkv.weight[j][i].
  const std::map<std::string, Tensor> m = AsMap(*hf);
  const Tensor qkv = AsMap(gpt.state_dict()).at("blocks.1.attn.qkv.weight");
  const Tensor c_attn = m.at("transformer.h.1.attn.c_attn.weight");
  for (std::int64_t i = 0; i < C; ++i) {
    for (std::int64_t j = 0; j < 3 * C; ++j) {
      ASSERT_EQ(c_attn.data<float>()[i * 3 * C + j], qkv.data<float>()[j * C + i]) << i << ", " << j;
    }
  }
  // Untransposed tensors are the model's own handles (no copy).
  EXPECT_TRUE(m.at("transformer.wte.weight").storage() == gpt.wte->weight().storage());
}

TEST(Gpt2NamesTest, RoundTripThroughGpt2NamesIsTheIdentity) {
  const nn::GPTConfig c = Config();
  nn::GPT a(c, 1), b(c, 2);
  for (const std::string prefix : {"transformer.", ""}) {
    SCOPED_TRACE(prefix);
    absl::StatusOr<NamedTensors> hf = gpt2_from_shardkit(a.state_dict(), c, {.prefix = prefix});
    ASSERT_TRUE(hf.ok()) << hf.status();
    absl::StatusOr<NamedTensors> back = shardkit_from_gpt2(*hf, c);
    ASSERT_TRUE(back.ok()) << back.status();
    const NamedTensors original = a.state_dict();
    ASSERT_EQ(back->size(), original.size());
    for (std::size_t i = 0; i < original.size(); ++i) {
      EXPECT_EQ((*back)[i].first, original[i].first);
      EXPECT_EQ((*back)[i].second.shape(), original[i].second.shape()) << original[i].first;
      EXPECT_EQ(Bytes((*back)[i].second), Bytes(original[i].second)) << original[i].first;
    }
    // Loaded into a differently initialised model, it computes the same logits.
    ASSERT_TRUE(b.load_state_dict(*back).ok());
    autograd::NoGradGuard no_grad;
    const Tensor idx = Tensor::from_int64({1, 5, 9, 63, 0, 2}, {2, 3});
    EXPECT_EQ(a(idx).to_vector(), b(idx).to_vector());
    EXPECT_TRUE(b.lm_head->weight().is_same(b.wte->weight()));
  }
}

TEST(Gpt2NamesTest, SafetensorsFileRoundTripInBf16) {
  const nn::GPTConfig c = Config();
  nn::GPT a(c, 1), b(c, 2);
  a.to(DType::bf16);
  b.to(DType::bf16);
  ScratchDir dir;
  absl::StatusOr<NamedTensors> hf = gpt2_from_shardkit(a.state_dict(), c);
  ASSERT_TRUE(hf.ok());
  ASSERT_TRUE(write_safetensors(dir.file("model.safetensors"), *hf, {{"format", "pt"}}).ok());
  absl::StatusOr<NamedTensors> read = read_safetensors_tensors(dir.file("model.safetensors"));
  ASSERT_TRUE(read.ok()) << read.status();
  for (const auto& [name, t] : *read) EXPECT_EQ(t.dtype(), DType::bf16) << name;
  absl::StatusOr<NamedTensors> state = shardkit_from_gpt2(*read, c);
  ASSERT_TRUE(state.ok()) << state.status();
  ASSERT_TRUE(b.load_state_dict(*state).ok());
  const std::map<std::string, Tensor> want = AsMap(a.state_dict());
  for (const auto& [name, t] : b.state_dict()) EXPECT_EQ(Bytes(t), Bytes(want.at(name))) << name;
}

TEST(Gpt2NamesTest, ImportIgnoresMaskBuffersAndChecksATiedHead) {
  const nn::GPTConfig c = Config();
  nn::GPT gpt(c, 1);
  absl::StatusOr<NamedTensors> hf = gpt2_from_shardkit(gpt.state_dict(), c, {.prefix = ""});
  ASSERT_TRUE(hf.ok());
  NamedTensors with_buffers = *hf;
  for (int i = 0; i < c.num_layers; ++i) {
    with_buffers.emplace_back("h." + std::to_string(i) + ".attn.bias", Tensor::zeros({1, 1, c.context, c.context}));
    with_buffers.emplace_back("h." + std::to_string(i) + ".attn.masked_bias", Tensor::full({}, -1e4));
  }
  with_buffers.emplace_back("lm_head.weight", gpt.wte->weight().clone());
  EXPECT_TRUE(shardkit_from_gpt2(with_buffers, c).ok());

  NamedTensors untied = *hf;
  untied.emplace_back("lm_head.weight", Tensor::zeros({c.vocab_size, c.width}));
  absl::Status s = shardkit_from_gpt2(untied, c).status();
  EXPECT_THAT(s.message(), HasSubstr("importing tensor 'lm_head.weight': expected the same values as 'wte.weight' "
                                     "(shardkit ties 'lm_head.weight' to 'wte.weight'), found f32[64, 16] cpu with "
                                     "different values"));

  NamedTensors extra = *hf;
  extra.emplace_back("h.0.attn.rotary", Tensor::zeros({2}));
  EXPECT_THAT(shardkit_from_gpt2(extra, c).status().message(),
              HasSubstr("importing tensor 'h.0.attn.rotary': expected every tensor of the file to have an entry"));

  NamedTensors missing;
  for (const auto& [name, t] : *hf) {
    if (name != "h.2.mlp.c_fc.bias") missing.emplace_back(name, t);
  }
  EXPECT_THAT(shardkit_from_gpt2(missing, c).status().message(),
              HasSubstr("expected tensor 'h.2.mlp.c_fc.bias' (for 'blocks.2.mlp.fc.bias'), found it missing"));

  NamedTensors flat = *hf;
  for (auto& [name, t] : flat) {
    if (name == "h.0.attn.c_attn.weight") t = t.flatten();
  }
  EXPECT_THAT(shardkit_from_gpt2(flat, c).status().message(),
              HasSubstr("importing tensor 'h.0.attn.c_attn.weight': expected a 2-D tensor to transpose"));

  EXPECT_THAT(shardkit_from_gpt2({{"foo", Tensor::zeros({1})}}, c).status().message(),
              HasSubstr("expected GPT-2 tensors (\"transformer.wte.weight\" or \"wte.weight\"), found neither"));
}

TEST(Gpt2NamesTest, WrongShapesAreCaughtByLoadStateDict) {
  const nn::GPTConfig c = Config();
  nn::GPT gpt(c, 1);
  nn::GPTConfig wider = c;
  wider.width = 32;
  nn::GPT other(wider, 1);
  absl::StatusOr<NamedTensors> state = shardkit_from_gpt2(*gpt2_from_shardkit(other.state_dict(), wider), c);
  ASSERT_TRUE(state.ok());
  absl::Status s = gpt.load_state_dict(*state);
  EXPECT_THAT(s.message(), HasSubstr("expected [64, 16], found [64, 32]"));
}

TEST(Gpt2NamesTest, InferConfigFromTensors) {
  const nn::GPTConfig c = *nn::GPTConfig::named("gpt-100k");
  nn::GPT gpt(c, 1);
  absl::StatusOr<NamedTensors> hf = gpt2_from_shardkit(gpt.state_dict(), c);
  ASSERT_TRUE(hf.ok());
  absl::StatusOr<nn::GPTConfig> got = infer_gpt2_config(tensor_infos(*hf), c.num_heads);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->vocab_size, c.vocab_size);
  EXPECT_EQ(got->context, c.context);
  EXPECT_EQ(got->width, c.width);
  EXPECT_EQ(got->num_layers, c.num_layers);
  EXPECT_EQ(got->num_heads, c.num_heads);
  EXPECT_THAT(infer_gpt2_config(tensor_infos(*hf), 5).status().message(),
              HasSubstr("expected a number of heads dividing the width 48, found 5"));
  std::vector<SafetensorsTensorInfo> no_layer1;
  for (const auto& t : tensor_infos(*hf)) {
    if (t.name.rfind("transformer.h.1.", 0) != 0) no_layer1.push_back(t);
  }
  EXPECT_THAT(infer_gpt2_config(no_layer1, 4).status().message(), HasSubstr("expected layers h.0 .. h.1, found h.2"));
}

TEST(Gpt2NamesTest, ShardedExportPlansWithExternalNamesAndShapes) {
  const nn::GPTConfig c = Config();
  nn::GPT gpt(c, 1);
  const NameMap map = gpt2_name_map(c);
  absl::StatusOr<std::vector<SafetensorsTensorInfo>> infos = to_external_infos(tensor_infos(gpt.state_dict()), map);
  ASSERT_TRUE(infos.ok()) << infos.status();
  absl::StatusOr<NamedTensors> hf = to_external(gpt.state_dict(), map);
  ASSERT_TRUE(hf.ok());
  ASSERT_EQ(infos->size(), hf->size());
  for (std::size_t i = 0; i < hf->size(); ++i) {
    EXPECT_EQ((*infos)[i].name, (*hf)[i].first);
    EXPECT_EQ((*infos)[i].shape, (*hf)[i].second.shape());
  }
  // Two ranks write their parts (converting only their own tensors); the model reads back as one.
  ScratchDir dir;
  absl::StatusOr<ShardedSafetensorsPlan> plan = plan_sharded_safetensors(*infos, 2);
  ASSERT_TRUE(plan.ok());
  const NamedTensors state = gpt.state_dict();
  for (int rank = 0; rank < 2; ++rank) {
    NamedTensors mine;
    for (const auto& [name, t] : state) {
      const NameMapEntry* e = map.find_internal(name);
      ASSERT_NE(e, nullptr);
      for (std::size_t i = 0; i < plan->tensors.size(); ++i) {
        if (plan->tensors[i].name == e->external && plan->part[i] == rank) mine.emplace_back(name, t);
      }
    }
    absl::StatusOr<NamedTensors> external = to_external(mine, map);
    ASSERT_TRUE(external.ok());
    ASSERT_TRUE(write_sharded_safetensors(dir.path(), *plan, rank, *external).ok());
  }
  absl::StatusOr<NamedTensors> read = read_safetensors_tensors(dir.file("model.safetensors.index.json"));
  ASSERT_TRUE(read.ok()) << read.status();
  absl::StatusOr<NamedTensors> back = shardkit_from_gpt2(*read, c);
  ASSERT_TRUE(back.ok()) << back.status();
  nn::GPT other(c, 7);
  ASSERT_TRUE(other.load_state_dict(*back).ok());
  const std::map<std::string, Tensor> want = AsMap(state);
  for (const auto& [name, t] : other.state_dict()) EXPECT_EQ(Bytes(t), Bytes(want.at(name))) << name;
}

}  // namespace
}  // namespace shardkit::io
