// NameMap: user-supplied maps (structs and JSON), transposes in every dtype, validation messages.
#include "common/io/name_map.h"

#include "common/nn/layers.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io_test_util.h"

namespace shardkit::io {
namespace {

using ::testing::HasSubstr;
using testing::Bytes;
using testing::PatternTensor;

NameMapEntry E(std::string internal, std::string external, bool transpose = false, std::string tied_to = "") {
  return NameMapEntry{std::move(internal), std::move(external), transpose, std::move(tied_to)};
}

TEST(NameMapTest, Transpose2dInEveryDtype) {
  for (DType d : {DType::f32, DType::bf16, DType::f16, DType::i64}) {
    SCOPED_TRACE(dtype_name(d));
    const Tensor t = PatternTensor(d, {3, 5}, 9);
    const Tensor tt = transpose_2d(t);
    ASSERT_EQ(tt.shape(), (Shape{5, 3}));
    EXPECT_EQ(tt.dtype(), d);
    const std::size_t es = dtype_size(d);
    const auto* a = static_cast<const char*>(t.raw_data());
    const auto* b = static_cast<const char*>(tt.raw_data());
    for (int i = 0; i < 3; ++i) {
      for (int j = 0; j < 5; ++j) {
        EXPECT_EQ(std::string(a + (i * 5 + j) * es, es), std::string(b + (j * 3 + i) * es, es));
      }
    }
    EXPECT_EQ(Bytes(transpose_2d(tt)), Bytes(t));
  }
  EXPECT_EQ(transpose_2d(Tensor::zeros({0, 4})).shape(), (Shape{4, 0}));
}

// A user's map for a model that is not a GPT: a Linear stored as TensorFlow-style "dense.kernel" [in, out].
TEST(NameMapTest, UserMapFromJsonRoundTripsALinear) {
  absl::StatusOr<NameMap> map = parse_name_map_json(R"({
      "entries": [{"internal": "weight", "external": "dense.kernel", "transpose": true},
                  {"internal": "bias", "external": "dense.bias"}],
      "ignored_external": ["dense.step"]})",
                                                    "map.json");
  ASSERT_TRUE(map.ok()) << map.status();
  Generator gen(3);
  nn::Linear a(4, 6, gen), b(4, 6, gen);
  absl::StatusOr<NamedTensors> ext = to_external(a.state_dict(), *map);
  ASSERT_TRUE(ext.ok()) << ext.status();
  ASSERT_EQ(ext->size(), 2u);
  EXPECT_EQ((*ext)[0].first, "dense.kernel");
  EXPECT_EQ((*ext)[0].second.shape(), (Shape{4, 6}));
  ext->emplace_back("dense.step", Tensor::zeros({1}));
  absl::StatusOr<NamedTensors> back = to_internal(*ext, *map);
  ASSERT_TRUE(back.ok()) << back.status();
  ASSERT_TRUE(b.load_state_dict(*back).ok());
  EXPECT_EQ(Bytes(b.weight()), Bytes(a.weight()));
  EXPECT_EQ(Bytes(b.parameter("bias")), Bytes(a.parameter("bias")));
}

TEST(NameMapTest, ExportRefusesATensorWithoutAnEntry) {
  NameMap map{{E("a", "x")}, {}};
  EXPECT_THAT(to_external({{"b", Tensor::zeros({1})}}, map).status().message(),
              HasSubstr("exporting tensor 'b': expected an entry for it in the name map, found none"));
  NameMap transposing{{E("a", "x", true)}, {}};
  EXPECT_THAT(to_external({{"a", Tensor::zeros({2, 2, 2})}}, transposing).status().message(),
              HasSubstr("exporting tensor 'a': expected a 2-D tensor to transpose (map entry 'a' <-> 'x'), found "
                        "f32[2, 2, 2] cpu"));
}

TEST(NameMapTest, InvalidMapsAreRefused) {
  struct Case {
    NameMap map;
    std::string message;
  };
  const std::vector<Case> cases = {
      {{{E("a", "x"), E("a", "y")}, {}}, "internal name 'a' appears twice"},
      {{{E("a", "x"), E("b", "x")}, {}}, "external name 'x' appears twice"},
      {{{E("", "x")}, {}}, "expected non-empty names"},
      {{{E("a", "x"), E("b", "y", false, "c")}, {}}, "expected tied_to 'c' to name an entry that is not tied itself"},
      {{{E("a", "x", false, "b"), E("b", "y", false, "a")}, {}}, "to name an entry that is not tied itself"},
      {{{E("a", "x"), E("b", "y", true, "a")}, {}}, "a tied entry cannot transpose"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    EXPECT_THAT(validate_name_map(c.map).message(), HasSubstr(c.message));
    EXPECT_THAT(to_external({}, c.map).status().message(), HasSubstr(c.message));
  }
}

TEST(NameMapTest, MalformedJsonMapsAreRefused) {
  struct Case {
    std::string json;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"[]", "'m.json': expected an object with \"entries\", found array"},
      {R"({"entries": {}})", "expected \"entries\" to be an array, found object"},
      {R"({"entries": [1]})", "entries[0]: expected an object, found number"},
      {R"({"entries": [{"internal": "a"}]})", "entries[0]: expected non-empty \"internal\" and \"external\""},
      {R"({"entries": [{"internal": "a", "external": 3}]})", "entries[0]: expected \"external\" to be a string"},
      {R"({"entries": [{"internal": "a", "external": "b", "transpose": "yes"}]})",
       "expected \"transpose\" to be true or false, found \"yes\""},
      {R"({"entries": [{"internal": "a", "external": "b", "transposed": true}]})",
       "expected keys internal, external, transpose, tied_to, found \"transposed\""},
      {R"({"entries": [], "extra": 1})", "expected keys \"entries\" and \"ignored_external\", found \"extra\""},
      {R"({"entries": [], "ignored_external": [1]})", "expected \"ignored_external\" to hold strings, found 1"},
      {R"({"entries": [], "entries": []})", "duplicate key \"entries\" at the top level"},
      {R"({"entries": [{"internal": "a", "external": "b"}, {"internal": "a", "external": "c"}]})",
       "'m.json': name map: internal name 'a' appears twice"},
      {R"({"entries": [)", "not valid JSON"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.json);
    EXPECT_THAT(parse_name_map_json(c.json, "m.json").status().message(), HasSubstr(c.message));
  }
}

}  // namespace
}  // namespace shardkit::io
