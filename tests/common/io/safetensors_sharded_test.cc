// Sharded safetensors exports: the balancing policy, part names, index round trips and hostile indexes.
#include "common/io/safetensors_sharded.h"

#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io_test_util.h"

namespace shardkit::io {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using ::testing::Pair;
using testing::Bytes;
using testing::PatternTensor;
using testing::ScratchDir;

TEST(ShardedSafetensorsTest, AssignPartsByBytesIsGreedyLargestFirst) {
  // 10 -> p0; 7 -> p1; 3 (index 3) -> p1 (7 < 10); 3 (index 4) -> p0 (10 = 10: lowest part); 1 -> p1 (10 < 13).
  EXPECT_THAT(assign_parts_by_bytes(std::vector<std::uint64_t>{10, 1, 7, 3, 3}, 2), ElementsAre(0, 1, 1, 1, 0));
  EXPECT_THAT(assign_parts_by_bytes(std::vector<std::uint64_t>{5, 5, 5}, 1), ElementsAre(0, 0, 0));
  // More parts than tensors: the last parts stay empty.
  EXPECT_THAT(assign_parts_by_bytes(std::vector<std::uint64_t>{4, 8}, 4), ElementsAre(1, 0));
  EXPECT_TRUE(assign_parts_by_bytes({}, 3).empty());
}

TEST(ShardedSafetensorsTest, FileNamesFollowHuggingFace) {
  ShardedSafetensorsPlan plan;
  plan.num_parts = 4;
  EXPECT_EQ(plan.part_file(0), "model-00001-of-00004.safetensors");
  EXPECT_EQ(plan.part_file(3), "model-00004-of-00004.safetensors");
  EXPECT_EQ(plan.index_file(), "model.safetensors.index.json");
}

TEST(ShardedSafetensorsTest, PlanRefusesBadInput) {
  EXPECT_THAT(plan_sharded_safetensors({}, 0).status().message(), HasSubstr("expected at least 1 part, found 0"));
  EXPECT_THAT(plan_sharded_safetensors({}, 1, "a/b").status().message(),
              HasSubstr("expected a file name stem without '/', found \"a/b\""));
  EXPECT_THAT(plan_sharded_safetensors({{"w", DType::f32, {2}}, {"w", DType::f32, {3}}}, 2).status().message(),
              HasSubstr("expected unique tensor names, found 'w' twice"));
  EXPECT_THAT(plan_sharded_safetensors({{"w", DType::f32, {-2}}}, 2).status().message(),
              HasSubstr("tensor 'w': expected dimensions >= 0, found -2"));
}

NamedTensors Model() {
  return {
      {"wte.weight", PatternTensor(DType::f32, {16, 8}, 1)},   // 512 bytes
      {"wpe.weight", PatternTensor(DType::f32, {4, 8}, 2)},    // 128
      {"h.0.ln_1.weight", PatternTensor(DType::bf16, {8}, 3)}, // 16
      {"h.0.attn.c_attn.weight", PatternTensor(DType::f16, {8, 24}, 4)},  // 384
      {"h.0.attn.c_attn.bias", PatternTensor(DType::f16, {24}, 5)},       // 48
      {"steps", PatternTensor(DType::i64, {3}, 6)},                       // 24
      {"nothing", PatternTensor(DType::f32, {0}, 7)},                     // 0
  };
}

TEST(ShardedSafetensorsTest, EachRankWritesItsPartAndRankZeroTheIndex) {
  ScratchDir dir;
  const NamedTensors model = Model();
  const int world = 3;
  absl::StatusOr<ShardedSafetensorsPlan> plan = plan_sharded_safetensors(tensor_infos(model), world);
  ASSERT_TRUE(plan.ok()) << plan.status();
  // wte 512 -> p0, c_attn.w 384 -> p1, wpe 128 -> p2, c_attn.b 48 -> p2, steps 24 -> p2, ln_1 16 -> p2, nothing -> p2.
  EXPECT_THAT(plan->part, ElementsAre(0, 2, 2, 1, 2, 2, 2));
  // Ranks as threads, each writing only its own tensors.
  std::vector<absl::Status> status(world);
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.emplace_back([&, r] {
      NamedTensors mine;
      for (std::size_t i = 0; i < model.size(); ++i) {
        if (plan->part[i] == r) mine.push_back(model[i]);
      }
      status[r] = write_sharded_safetensors(dir.path(), *plan, r, mine, {{"format", "pt"}});
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < world; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r];
  EXPECT_THAT(dir.listing(), ElementsAre("model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                                         "model-00003-of-00003.safetensors", "model.safetensors.index.json"));

  // The index is Hugging Face's: metadata.total_size and a sorted weight_map, pretty-printed.
  const std::string index_text = testing::ReadAll(dir.file("model.safetensors.index.json"));
  EXPECT_THAT(index_text, HasSubstr("{\n  \"metadata\": {\n    \"total_size\": 1112\n  },\n  \"weight_map\": {\n"
                                    "    \"h.0.attn.c_attn.bias\": \"model-00003-of-00003.safetensors\",\n"));
  absl::StatusOr<SafetensorsIndex> index = parse_safetensors_index(index_text, "index");
  ASSERT_TRUE(index.ok()) << index.status();
  EXPECT_EQ(index->total_size, 1112u);
  EXPECT_EQ(index->weight_map.size(), model.size());
  EXPECT_THAT(index->weight_map[0], Pair("h.0.attn.c_attn.bias", "model-00003-of-00003.safetensors"));

  absl::StatusOr<ShardedSafetensors> read = ShardedSafetensors::open(dir.file("model.safetensors.index.json"));
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->parts().size(), 3u);
  EXPECT_EQ(read->parts()[0].metadata().at("format"), "pt");
  for (const auto& [name, t] : model) {
    SCOPED_TRACE(name);
    absl::StatusOr<Tensor> back = read->tensor(name);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->dtype(), t.dtype());
    EXPECT_EQ(back->shape(), t.shape());
    EXPECT_EQ(Bytes(*back), Bytes(t));
  }
  absl::StatusOr<NamedTensors> all = read_safetensors_tensors(dir.file("model.safetensors.index.json"));
  ASSERT_TRUE(all.ok()) << all.status();
  ASSERT_EQ(all->size(), model.size());
  EXPECT_EQ((*all)[0].first, "h.0.attn.c_attn.bias");  // name order
}

TEST(ShardedSafetensorsTest, APartMustHoldExactlyThePlansTensors) {
  ScratchDir dir;
  const NamedTensors model = Model();
  absl::StatusOr<ShardedSafetensorsPlan> plan = plan_sharded_safetensors(tensor_infos(model), 2);
  ASSERT_TRUE(plan.ok());
  NamedTensors part0;
  for (std::size_t i = 0; i < model.size(); ++i) {
    if (plan->part[i] == 0) part0.push_back(model[i]);
  }
  const std::string file = dir.file("model-00001-of-00002.safetensors");
  NamedTensors extra = part0;
  extra.push_back(model[1]);  // wpe.weight is in part 1
  EXPECT_THAT(write_safetensors_part(dir.path(), *plan, 0, extra).message(),
              HasSubstr("writing '" + file + "': tensor 'wpe.weight' is not in part 0 of the plan"));
  NamedTensors missing(part0.begin() + 1, part0.end());
  EXPECT_THAT(write_safetensors_part(dir.path(), *plan, 0, missing).message(),
              HasSubstr("expected tensor '" + part0[0].first + "' (part 0 of the plan), found it missing"));
  NamedTensors reshaped = part0;
  reshaped[0].second = PatternTensor(DType::f32, {8, 16}, 1);
  EXPECT_THAT(write_safetensors_part(dir.path(), *plan, 0, reshaped).message(),
              HasSubstr("tensor 'wte.weight': expected F32[16, 8] (the plan), found F32[8, 16]"));
  EXPECT_THAT(write_safetensors_part(dir.path(), *plan, 2, {}).message(), HasSubstr("expected a part in [0, 2), found 2"));
  EXPECT_TRUE(dir.listing().empty());
}

// Writes a one-tensor part "p1.safetensors" ({"a"}) and "p2.safetensors" ({"b"}) and the given index.
std::string HostileDir(const ScratchDir& dir, const std::string& index) {
  EXPECT_TRUE(write_safetensors(dir.file("p1.safetensors"), {{"a", PatternTensor(DType::f32, {2}, 1)}}).ok());
  EXPECT_TRUE(write_safetensors(dir.file("p2.safetensors"), {{"b", PatternTensor(DType::f32, {2}, 2)}}).ok());
  testing::WriteAll(dir.file("index.json"), index);
  return dir.file("index.json");
}

TEST(ShardedSafetensorsTest, HostileIndexesAreRefused) {
  struct Case {
    std::string index;
    std::string message;
  };
  const std::vector<Case> cases = {
      {R"({"weight_map": {"a": "p1.safetensors", "b": "p2.safetensors"}})", ""},
      {R"([1])", "expected a JSON object with \"weight_map\", found array"},
      {R"({"metadata": {}})", "expected a \"weight_map\", found none"},
      {R"({"weight_map": ["a"]})", "expected \"weight_map\" to be an object, found array"},
      {R"({"weight_map": {"a": 3}})", "tensor 'a': expected a part file name, found 3"},
      {R"({"weight_map": {"a": "../p1.safetensors"}})",
       "tensor 'a': expected a plain file name in the index's directory, found \"../p1.safetensors\""},
      {R"({"weight_map": {"a": "/etc/passwd"}})", "expected a plain file name in the index's directory"},
      {R"({"weight_map": {"a": ".."}})", "expected a plain file name"},
      {R"({"weight_map": {"a": "p1.safetensors", "a": "p2.safetensors"}})", "duplicate key \"a\" in \"weight_map\""},
      {R"({"metadata": {"total_size": -1}, "weight_map": {}})", "expected \"total_size\" to be an integer >= 0, found -1"},
      {R"({"weight_map": {"a": "p1.safetensors", "b": "p1.safetensors"}})",
       "tensor 'b': expected it in part 'p1.safetensors', found no such tensor there"},
      {R"({"weight_map": {"a": "p1.safetensors"}, "x": 1})", ""},  // unknown top-level keys are ignored
      {R"({"weight_map": {"a": "p1.safetensors", "b": "p3.safetensors"}})",
       "names part 'p3.safetensors': cannot open"},
      {R"({"weight_map": {"b": "p2.safetensors", "c": "p1.safetensors"}})",
       "tensor 'c': expected it in part 'p1.safetensors'"},
      {R"({"weight_map": {"a": "p2.safetensors", "b": "p2.safetensors"}})",
       "tensor 'a': expected it in part 'p2.safetensors', found no such tensor there"},
      {"{\"weight_map\": {\"a\": \"p1.safetensors\"", "not valid JSON"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.index);
    ScratchDir dir;
    const std::string path = HostileDir(dir, c.index);
    absl::StatusOr<ShardedSafetensors> read = ShardedSafetensors::open(path);
    if (c.message.empty()) {
      EXPECT_TRUE(read.ok()) << read.status();
    } else {
      EXPECT_FALSE(read.ok());
      EXPECT_THAT(read.status().message(), HasSubstr(c.message));
    }
  }
}

TEST(ShardedSafetensorsTest, APartHoldingATensorTheIndexDoesNotMapIsRefused) {
  ScratchDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("p1.safetensors"), {{"a", PatternTensor(DType::f32, {2}, 1)},
                                                             {"z", PatternTensor(DType::f32, {2}, 2)}})
                  .ok());
  ASSERT_TRUE(write_safetensors(dir.file("p2.safetensors"), {{"b", PatternTensor(DType::f32, {2}, 2)}}).ok());
  testing::WriteAll(dir.file("i.json"), R"({"weight_map": {"a": "p1.safetensors", "b": "p2.safetensors"}})");
  EXPECT_THAT(ShardedSafetensors::open(dir.file("i.json")).status().message(),
              HasSubstr("part 'p1.safetensors' holds tensor 'z', which the index does not list"));
}

}  // namespace
}  // namespace shardkit::io
