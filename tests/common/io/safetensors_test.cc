// safetensors write and read: bitwise round trips, the writer's layout, atomic replacement.
#include "common/io/safetensors.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "common/tensor/rank_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io_test_util.h"

namespace shardkit::io {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::Bytes;
using testing::PatternTensor;
using testing::ReadAll;
using testing::ScratchDir;

NamedTensors EveryDtype() {
  return {
      {"f32.matrix", PatternTensor(DType::f32, {3, 5}, 1)},
      {"bf16.odd", PatternTensor(DType::bf16, {7}, 2)},  // 14 bytes: the tensor after it would be misaligned
      {"f16.cube", PatternTensor(DType::f16, {2, 3, 2}, 3)},
      {"i64.tokens", PatternTensor(DType::i64, {4, 2}, 4)},
      {"f32.scalar", PatternTensor(DType::f32, {}, 5)},
      {"bf16.empty", PatternTensor(DType::bf16, {0, 3}, 6)},
      {"f16.one", PatternTensor(DType::f16, {1}, 7)},
  };
}

void ExpectSameTensors(const NamedTensors& want, const SafetensorsFile& file) {
  ASSERT_EQ(file.entries().size(), want.size());
  for (const auto& [name, t] : want) {
    SCOPED_TRACE(name);
    const SafetensorsEntry* e = file.find(name);
    ASSERT_NE(e, nullptr);
    EXPECT_EQ(e->info.dtype, t.dtype());
    EXPECT_EQ(e->info.shape, t.shape());
    EXPECT_EQ(Bytes(e->bytes), Bytes(t));
    absl::StatusOr<Tensor> copy = file.tensor(name);
    ASSERT_TRUE(copy.ok()) << copy.status();
    EXPECT_EQ(copy->dtype(), t.dtype());
    EXPECT_EQ(copy->shape(), t.shape());
    EXPECT_EQ(Bytes(*copy), Bytes(t));
  }
}

TEST(SafetensorsTest, RoundTripIsBitwiseForEveryDtypeAndKeepsMetadata) {
  ScratchDir dir;
  const NamedTensors tensors = EveryDtype();
  const SafetensorsMetadata metadata = {{"format", "pt"}, {"note", "trained by shardkit \xc3\xbc"}, {"empty", ""}};
  const std::string path = dir.file("m.safetensors");
  ASSERT_TRUE(write_safetensors(path, tensors, metadata).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ(file->metadata(), metadata);
  EXPECT_EQ(file->source(), path);
  ExpectSameTensors(tensors, *file);
  // tensors() copies everything, in data order.
  const NamedTensors all = file->tensors();
  ASSERT_EQ(all.size(), tensors.size());
  for (std::size_t i = 0; i < all.size(); ++i) EXPECT_EQ(all[i].first, file->entries()[i].info.name);
  // Written twice, the file is the same bytes (deterministic order).
  const std::string again = dir.file("again.safetensors");
  NamedTensors reversed(tensors.rbegin(), tensors.rend());
  ASSERT_TRUE(write_safetensors(again, reversed, metadata).ok());
  EXPECT_EQ(ReadAll(again), ReadAll(path));
}

TEST(SafetensorsTest, WriterLayoutIsTheReferenceOne) {
  // Same tensors and metadata as Python's safetensors.serialize_file({"a": BF16[2], "b": F32[]}, ..., {"k": "v"}):
  // F32 before BF16 (element size, largest first), "__metadata__" first, header padded with spaces to 8.
  Tensor a = Tensor::from_vector({1.f, 2.f}, {2}, TensorOptions{}.with_dtype(DType::bf16));
  Tensor b = Tensor::from_vector({1.f}, {}, TensorOptions{});
  absl::StatusOr<std::string> bytes = serialize_safetensors({{"a", a}, {"b", b}}, {{"k", "v"}});
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  const std::string header =
      R"({"__metadata__":{"k":"v"},"b":{"dtype":"F32","shape":[],"data_offsets":[0,4]},)"
      R"("a":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}}    )";
  const std::string expected = std::string("\x88\0\0\0\0\0\0\0", 8) + header + std::string("\0\0\x80\x3f\x80\x3f\0\x40", 8);
  EXPECT_EQ(header.size(), 0x88u);
  EXPECT_EQ(*bytes, expected);
}

TEST(SafetensorsTest, EveryTensorStartsAtAMultipleOfItsElementSize) {
  absl::StatusOr<std::string> bytes = serialize_safetensors(EveryDtype());
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  absl::StatusOr<SafetensorsFile> file =
      SafetensorsFile::parse(absl::Span<const std::byte>(reinterpret_cast<const std::byte*>(bytes->data()), bytes->size()),
                             "memory");
  ASSERT_TRUE(file.ok()) << file.status();
  std::uint64_t header = 0;
  std::memcpy(&header, bytes->data(), 8);
  EXPECT_EQ(header % 8, 0u);
  std::vector<std::string> order;
  for (const SafetensorsEntry& e : file->entries()) {
    EXPECT_EQ(e.begin % dtype_size(e.info.dtype), 0u) << e.info.name;
    order.push_back(e.info.name);
  }
  EXPECT_THAT(order, ElementsAre("i64.tokens", "f32.matrix", "f32.scalar", "bf16.empty", "bf16.odd", "f16.cube",
                                 "f16.one"));
}

TEST(SafetensorsTest, EmptyModelRoundTrips) {
  ScratchDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("e.safetensors"), {}).ok());
  EXPECT_EQ(ReadAll(dir.file("e.safetensors")), std::string("\x08\0\0\0\0\0\0\0{}      ", 16));
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::open(dir.file("e.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_TRUE(file->entries().empty());
  EXPECT_TRUE(file->metadata().empty());
}

TEST(SafetensorsTest, CopiesAreChargedToTheRequestedCategory) {
  ScratchDir dir;
  ASSERT_TRUE(write_safetensors(dir.file("m.safetensors"), {{"w", PatternTensor(DType::f32, {8, 8}, 1)}}).ok());
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::open(dir.file("m.safetensors"));
  ASSERT_TRUE(file.ok()) << file.status();
  RankContext ctx;
  RankContextScope scope(ctx);
  absl::StatusOr<Tensor> w = file->tensor("w", MemoryCategory::parameter);
  ASSERT_TRUE(w.ok());
  EXPECT_EQ(ctx.memory->current(MemoryCategory::parameter), 256);
  absl::StatusOr<Tensor> missing = file->tensor("nope");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("has no tensor 'nope'"));
}

TEST(SafetensorsTest, WriterRefusesBadNamesAndTensorsAndLeavesNoFile) {
  ScratchDir dir;
  const std::string path = dir.file("bad.safetensors");
  const Tensor t = PatternTensor(DType::f32, {2}, 1);
  struct Case {
    NamedTensors tensors;
    SafetensorsMetadata metadata;
    std::string message;
  };
  Tensor released = PatternTensor(DType::f32, {2}, 1);
  released.release_storage();
  const std::vector<Case> cases = {
      {{{"a", t}, {"a", t}}, {}, "tensor 'a': expected unique names, found it at positions 0 and 1"},
      {{{"__metadata__", t}}, {}, "expected tensor names other than \"__metadata__\""},
      {{{"", t}}, {}, "expected non-empty tensor names"},
      {{{"a", Tensor()}}, {}, "tensor 'a': expected a defined tensor"},
      {{{"a", released}}, {}, "tensor 'a': expected its storage to be allocated, found it released"},
      {{{"bad\xff", t}}, {}, "tensor 'bad\\xff': expected a UTF-8 name"},
      {{{"a", t}}, {{"k", "\xc3"}}, "metadata 'k': expected UTF-8 keys and values"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.message);
    absl::Status s = write_safetensors(path, c.tensors, c.metadata);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr(c.message));
    EXPECT_THAT(s.message(), HasSubstr(path));
  }
  EXPECT_TRUE(dir.listing().empty());
}

TEST(SafetensorsTest, ReplacesAtomicallyAndLeavesNoTemporaryFile) {
  ScratchDir dir;
  const std::string path = dir.file("m.safetensors");
  ASSERT_TRUE(write_safetensors(path, {{"old", PatternTensor(DType::f32, {4}, 1)}}).ok());
  const std::string old_bytes = ReadAll(path);
  // A refused write leaves the previous file as it was.
  ASSERT_FALSE(write_safetensors(path, {{"x", Tensor()}}).ok());
  EXPECT_EQ(ReadAll(path), old_bytes);
  // A successful one replaces it; no temporary file is left beside it.
  ASSERT_TRUE(write_safetensors(path, {{"new", PatternTensor(DType::f16, {4}, 2)}}).ok());
  EXPECT_THAT(dir.listing(), ElementsAre("m.safetensors"));
  absl::StatusOr<SafetensorsFile> file = SafetensorsFile::open(path);
  ASSERT_TRUE(file.ok());
  EXPECT_NE(file->find("new"), nullptr);
  EXPECT_EQ(file->find("old"), nullptr);
}

TEST(SafetensorsTest, ASymlinkAtTheDestinationIsReplacedNotWrittenThrough) {
  ScratchDir dir;
  const std::string victim = dir.file("victim.txt");
  testing::WriteAll(victim, "precious");
  ASSERT_EQ(::symlink(victim.c_str(), dir.file("m.safetensors").c_str()), 0);
  ASSERT_TRUE(write_safetensors(dir.file("m.safetensors"), {{"w", PatternTensor(DType::f32, {2}, 1)}}).ok());
  EXPECT_EQ(ReadAll(victim), "precious");
  EXPECT_TRUE(std::filesystem::is_regular_file(std::filesystem::symlink_status(dir.file("m.safetensors"))));
}

TEST(SafetensorsTest, WriteIntoAMissingDirectoryNamesThePath) {
  ScratchDir dir;
  const std::string path = dir.file("no/such/dir/m.safetensors");
  absl::Status s = write_safetensors(path, {{"w", PatternTensor(DType::f32, {2}, 1)}});
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("to write '" + path + "': No such file or directory"));
}

TEST(SafetensorsTest, OpenRefusesWhatIsNotARegularFile) {
  ScratchDir dir;
  absl::StatusOr<SafetensorsFile> missing = SafetensorsFile::open(dir.file("missing.safetensors"));
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("No such file or directory"));
  absl::StatusOr<SafetensorsFile> directory = SafetensorsFile::open(dir.path());
  EXPECT_THAT(directory.status().message(), HasSubstr("to be a regular file, found a directory"));
  absl::StatusOr<SafetensorsFile> zero = SafetensorsFile::open("/dev/zero");
  EXPECT_THAT(zero.status().message(), HasSubstr("'/dev/zero' to be a regular file, found a character device"));
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  absl::StatusOr<SafetensorsFile> fifo = SafetensorsFile::open(dir.file("fifo"));  // must not block
  EXPECT_THAT(fifo.status().message(), HasSubstr("to be a regular file, found a FIFO"));
}

TEST(SafetensorsTest, DtypeNames) {
  for (DType d : {DType::f32, DType::bf16, DType::f16, DType::i64}) {
    absl::StatusOr<DType> back = dtype_from_safetensors(safetensors_dtype_name(d));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, d);
  }
  EXPECT_EQ(dtype_from_safetensors("F64").status().code(), absl::StatusCode::kUnimplemented);
  EXPECT_EQ(dtype_from_safetensors("f32").status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace shardkit::io
