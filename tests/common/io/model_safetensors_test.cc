// Whole models to and from safetensors (common/io/model_safetensors.h): every naming (shardkit's, GPT-2's, a
// user's map) round-trips a GPT bitwise, a sharded export from replicated ranks reads back as the single file,
// and files that do not fit the model are refused with the model unchanged.
#include "common/io/model_safetensors.h"

#include <filesystem>
#include <map>

#include "common/nn/gpt.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io_test_util.h"

namespace shardkit::io {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::Bytes;
using testing::ScratchDir;

nn::GPTConfig Config() { return *nn::GPTConfig::named("gpt-10k"); }  // V 64, ctx 16, C 16, 3 layers, 2 heads

// name -> bytes of every state_dict() tensor.
std::map<std::string, std::string> StateBytes(const nn::Module& m) {
  std::map<std::string, std::string> out;
  for (const auto& [name, t] : m.state_dict()) out[name] = Bytes(t);
  return out;
}

std::map<std::string, std::string> FileBytes(const NamedTensors& tensors) {
  std::map<std::string, std::string> out;
  for (const auto& [name, t] : tensors) out[name] = Bytes(t);
  return out;
}

TEST(ModelSafetensorsTest, ShardkitNamesRoundTripBitwise) {
  ScratchDir dir;
  nn::GPT a(Config(), 1), b(Config(), 2);
  ASSERT_NE(StateBytes(a), StateBytes(b));
  ASSERT_TRUE(export_safetensors(a, dir.file("m.safetensors")).ok());
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::open(dir.file("m.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status();
  EXPECT_EQ(f->metadata(), (SafetensorsMetadata{{"format", "pt"}}));
  EXPECT_NE(f->find("blocks.2.attn.qkv.weight"), nullptr);
  EXPECT_NE(f->find("lm_head.weight"), nullptr);  // shardkit names: every state_dict() name
  ASSERT_TRUE(load_safetensors(b, dir.file("m.safetensors")).ok());
  EXPECT_EQ(StateBytes(b), StateBytes(a));
}

TEST(ModelSafetensorsTest, Gpt2NamesRoundTripBitwiseWithEitherPrefix) {
  ScratchDir dir;
  const nn::GPTConfig c = Config();
  nn::GPT a(c, 1);
  for (const std::string prefix : {"transformer.", ""}) {
    SCOPED_TRACE(prefix);
    const std::string path = dir.file("gpt2" + prefix + "safetensors");
    ASSERT_TRUE(export_safetensors(a, path, {.names = TensorNames::gpt2(c, {.prefix = prefix})}).ok());
    absl::StatusOr<NamedTensors> file = read_safetensors_tensors(path);
    ASSERT_TRUE(file.ok()) << file.status();
    // The file is exactly gpt2_from_shardkit's tensors: GPT-2's names, transposed Conv1D weights, no lm_head.
    absl::StatusOr<NamedTensors> want = gpt2_from_shardkit(a.state_dict(), c, {.prefix = prefix});
    ASSERT_TRUE(want.ok());
    EXPECT_EQ(FileBytes(*file), FileBytes(*want));
    EXPECT_EQ(FileBytes(*file).count(prefix + "h.0.attn.c_attn.weight"), 1u);
    nn::GPT b(c, 2);
    ASSERT_TRUE(load_safetensors(b, path, TensorNames::gpt2(c)).ok());  // reading detects the prefix
    EXPECT_EQ(StateBytes(b), StateBytes(a));
  }
}

TEST(ModelSafetensorsTest, CustomNameMapRoundTrips) {
  ScratchDir dir;
  const nn::GPTConfig c = Config();
  NameMap map = gpt2_name_map(c, {.prefix = "backbone."});
  map.entries.back().external = "head.weight";  // lm_head (tied): not written, accepted when equal
  nn::GPT a(c, 1), b(c, 2);
  ASSERT_TRUE(export_safetensors(a, dir.file("m.safetensors"), {.names = TensorNames::custom(map)}).ok());
  absl::StatusOr<SafetensorsFile> f = SafetensorsFile::open(dir.file("m.safetensors"));
  ASSERT_TRUE(f.ok());
  EXPECT_NE(f->find("backbone.h.1.mlp.c_fc.weight"), nullptr);
  EXPECT_EQ(f->find("head.weight"), nullptr);
  ASSERT_TRUE(load_safetensors(b, dir.file("m.safetensors"), TensorNames::custom(map)).ok());
  EXPECT_EQ(StateBytes(b), StateBytes(a));
}

// Ranks that each hold the whole model write one part each (no communication); the index and parts read back
// as the single file does, and the directory opens as the model.
TEST(ModelSafetensorsTest, ShardedExportFromReplicasReadsBackAsOneFile) {
  ScratchDir dir;
  const nn::GPTConfig c = Config();
  nn::GPT a(c, 1);
  const ModelExportOptions gpt2{.names = TensorNames::gpt2(c)};
  constexpr int kWorld = 3;
  for (int rank = 0; rank < kWorld; ++rank) {
    ASSERT_TRUE(export_sharded_safetensors(a.state_dict(), dir.path(), rank, kWorld, gpt2).ok()) << rank;
  }
  EXPECT_THAT(dir.listing(), ElementsAre("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                         "model-00003-of-00003.safetensors", "model.safetensors.index.json"));
  absl::StatusOr<NamedTensors> sharded = read_safetensors_tensors(dir.file("model.safetensors.index.json"));
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  absl::StatusOr<NamedTensors> want = gpt2_from_shardkit(a.state_dict(), c);
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(FileBytes(*sharded), FileBytes(*want));
  // Each part holds the tensors the plan gives its rank (balanced by bytes), and only those.
  absl::StatusOr<ShardedSafetensorsPlan> plan = plan_model_export(tensor_infos(a.state_dict()), kWorld, gpt2);
  ASSERT_TRUE(plan.ok());
  for (int p = 0; p < kWorld; ++p) {
    absl::StatusOr<SafetensorsFile> part = SafetensorsFile::open(dir.file(plan->part_file(p)));
    ASSERT_TRUE(part.ok());
    EXPECT_EQ(part->entries().size(), plan->tensors_of(p).size());
  }
  absl::StatusOr<SafetensorsModel> m = SafetensorsModel::open(dir.path());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->path(), dir.file("model.safetensors.index.json"));
  nn::GPT b(c, 2);
  ASSERT_TRUE(load_safetensors(b, dir.path(), TensorNames::gpt2(c)).ok());
  EXPECT_EQ(StateBytes(b), StateBytes(a));
}

TEST(ModelSafetensorsTest, DirectoryWithoutIndexOpensItsModelSafetensors) {
  ScratchDir dir;
  nn::GPT a(Config(), 1);
  ASSERT_TRUE(export_safetensors(a, dir.file("model.safetensors")).ok());
  absl::StatusOr<SafetensorsModel> m = SafetensorsModel::open(dir.path());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->path(), dir.file("model.safetensors"));
  EXPECT_EQ(m->entries().size(), a.state_dict().size());
}

TEST(ModelSafetensorsTest, FilesThatDoNotFitAreRefusedAndTheModelIsUnchanged) {
  ScratchDir dir;
  const nn::GPTConfig c = Config();
  nn::GPTConfig wide = c;
  wide.width = 32;
  nn::GPT other(wide, 1);
  ASSERT_TRUE(export_safetensors(other, dir.file("wide.safetensors"), {.names = TensorNames::gpt2(wide)}).ok());
  nn::GPT m(c, 2);
  const auto before = StateBytes(m);
  absl::Status s = load_safetensors(m, dir.file("wide.safetensors"), TensorNames::gpt2(c));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr(dir.file("wide.safetensors")));
  EXPECT_THAT(s.message(), HasSubstr("wte.weight: expected [64, 16], found [64, 32]"));
  EXPECT_EQ(StateBytes(m), before);

  // Fewer layers in the file than in the model: the missing tensor is named.
  nn::GPTConfig shallow = c;
  shallow.num_layers = 2;
  nn::GPT two(shallow, 1);
  ASSERT_TRUE(export_safetensors(two, dir.file("two.safetensors"), {.names = TensorNames::gpt2(shallow)}).ok());
  s = load_safetensors(m, dir.file("two.safetensors"), TensorNames::gpt2(c));
  EXPECT_THAT(s.message(), HasSubstr("expected tensor 'transformer.h.2.ln_1.weight' (for 'blocks.2.ln1.weight'), "
                                     "found it missing from the file"));
  EXPECT_EQ(StateBytes(m), before);

  // shardkit's names read as GPT-2's (wte.weight looks like GPT-2 without a prefix; the blocks do not).
  ASSERT_TRUE(export_safetensors(two, dir.file("sk.safetensors")).ok());
  s = load_safetensors(m, dir.file("sk.safetensors"), TensorNames::gpt2(c));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("': expected every tensor of the file to have an entry in the name "
                                                  "map (or to be ignored), found none for it"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("importing tensor 'blocks."));
  // A file that is no GPT-2 at all, and no file.
  ASSERT_TRUE(write_safetensors(dir.file("x.safetensors"), {{"x", testing::PatternTensor(DType::f32, {2}, 1)}}).ok());
  s = load_safetensors(m, dir.file("x.safetensors"), TensorNames::gpt2(c));
  EXPECT_EQ(s.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(s.message(), HasSubstr("expected GPT-2 tensors (\"transformer.wte.weight\" or \"wte.weight\"), found neither"));
  EXPECT_EQ(load_safetensors(m, dir.file("none.safetensors")).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(StateBytes(m), before);
}

TEST(ModelSafetensorsTest, ExportRefusesAStateTheMapDoesNotName) {
  ScratchDir dir;
  const nn::GPTConfig c = Config();
  nn::GPTConfig deeper = c;
  deeper.num_layers = 4;
  nn::GPT m(deeper, 1);  // blocks.3.* has no entry in a 3-layer map
  absl::Status s = export_safetensors(m, dir.file("m.safetensors"), {.names = TensorNames::gpt2(c)});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("exporting tensor 'blocks.3.ln1.weight': expected an entry for it in the name map"));
  EXPECT_FALSE(std::filesystem::exists(dir.file("m.safetensors")));
}

}  // namespace
}  // namespace shardkit::io
