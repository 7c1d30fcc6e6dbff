// Malformed and hostile safetensors files: each is refused with a message that names what was expected and
// what was found; none crashes or reads outside the bytes (this suite also runs under ASan + UBSan).
#include <sys/types.h>
#include <unistd.h>

#include <random>

#include "common/io/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io_test_util.h"

namespace shardkit::io {
namespace {

using ::testing::HasSubstr;
using testing::PatternTensor;
using testing::ScratchDir;

// u64 length + header + data.
std::string FileBytes(const std::string& header, const std::string& data) {
  const std::uint64_t n = header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out + header + data;
}

absl::Status Parse(const std::string& bytes, const SafetensorsReadOptions& options = {}) {
  return SafetensorsFile::parse(
             absl::Span<const std::byte>(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()), "evil",
             options)
      .status();
}

struct Case {
  std::string what;
  std::string bytes;
  std::string message;
  absl::StatusCode code = absl::StatusCode::kDataLoss;
};

std::string LengthOnly(std::uint64_t n) {
  std::string out(8, '\0');
  std::memcpy(out.data(), &n, 8);
  return out;
}

const std::string kF32x2 = R"("dtype":"F32","shape":[2])";  // 8 bytes of data

std::vector<Case> Cases() {
  const std::string data8(8, 'x');
  return {
      {"empty file", "", "'evil': expected at least 8 bytes (the header length), found 0"},
      {"truncated length", std::string("\x10\0\0", 3), "expected at least 8 bytes (the header length), found 3"},
      {"header longer than the file", LengthOnly(100) + "{}",
       "header length 100 does not fit in the file: expected at most 2 (a file of 10 bytes)"},
      {"huge header length", LengthOnly(~std::uint64_t{0}) + "{}",
       "header length 18446744073709551615 exceeds the limit of 100000000 bytes"},
      {"header length 2^63", LengthOnly(std::uint64_t{1} << 63), "exceeds the limit of 100000000 bytes"},
      {"empty header", FileBytes("", ""), "'evil': header: not valid JSON"},
      {"not JSON", FileBytes("{\"a\": ", ""), "'evil': header: not valid JSON"},
      {"trailing garbage", FileBytes("{} x", ""), "not valid JSON"},
      {"invalid UTF-8", FileBytes("{\"\xff\":{}}", ""), "not valid JSON"},
      {"array header", FileBytes("[1, 2]", ""), "expected the header to be a JSON object, found [1,2]"},
      {"string header", FileBytes("\"x\"", ""), "expected the header to be a JSON object, found \"x\""},
      {"duplicate tensor names",
       FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[0,8]},"a":{)" + kF32x2 + R"(,"data_offsets":[0,8]}})", data8),
       "header: duplicate key \"a\" at the top level"},
      {"duplicate field", FileBytes(R"({"a":{"dtype":"F32","dtype":"I64","shape":[],"data_offsets":[0,4]}})", "xxxx"),
       "duplicate key \"dtype\" in \"a\""},
      {"nested too deep", FileBytes(R"({"a":{"dtype":"F32","shape":[[2]],"data_offsets":[0,8]}})", data8),
       "expected nesting at most 2 deep, found deeper in \"a\".\"shape\"[0]"},
      {"very deep nesting", FileBytes(std::string(100000, '[') + std::string(100000, ']'), ""),
       "expected nesting at most 2 deep"},
      {"entry not an object", FileBytes(R"({"a":[1]})", ""),
       "tensor 'a': expected an object with \"dtype\", \"shape\" and \"data_offsets\", found [1]"},
      {"empty name", FileBytes(R"({"":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})", ""),
       "expected tensor names to be non-empty"},
      {"missing dtype", FileBytes(R"({"a":{"shape":[2],"data_offsets":[0,8]}})", data8),
       "tensor 'a': expected a \"dtype\", found none"},
      {"dtype not a string", FileBytes(R"({"a":{"dtype":7,"shape":[2],"data_offsets":[0,8]}})", data8),
       "tensor 'a': expected \"dtype\" to be a string, found 7"},
      {"unknown dtype", FileBytes(R"({"a":{"dtype":"F99","shape":[2],"data_offsets":[0,8]}})", data8),
       "tensor 'a': expected dtype F32, BF16, F16 or I64, found \"F99\" (no safetensors type)"},
      {"lower-case dtype", FileBytes(R"({"a":{"dtype":"f32","shape":[2],"data_offsets":[0,8]}})", data8),
       "found \"f32\" (no safetensors type)"},
      {"unsupported dtype", FileBytes(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", data8),
       "tensor 'a': expected dtype F32, BF16, F16 or I64 (the types shardkit has), found \"F64\"",
       absl::StatusCode::kUnimplemented},
      {"missing shape", FileBytes(R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", data8),
       "tensor 'a': expected a \"shape\", found none"},
      {"shape not an array", FileBytes(R"({"a":{"dtype":"F32","shape":2,"data_offsets":[0,8]}})", data8),
       "expected \"shape\" to be an array of integers, found 2"},
      {"negative dimension", FileBytes(R"({"a":{"dtype":"F32","shape":[-1,2],"data_offsets":[0,8]}})", data8),
       "tensor 'a': expected dimensions >= 0, found -1 in \"shape\" [-1,2]"},
      {"fractional dimension", FileBytes(R"({"a":{"dtype":"F32","shape":[1.5],"data_offsets":[0,8]}})", data8),
       "expected \"shape\" to be an array of integers, found [1.5]"},
      {"dimension past int64", FileBytes(R"({"a":{"dtype":"F32","shape":[9223372036854775808],"data_offsets":[0,8]}})", data8),
       "expected dimensions at most 9223372036854775807, found 9223372036854775808"},
      {"dimension past uint64", FileBytes(R"({"a":{"dtype":"F32","shape":[99999999999999999999],"data_offsets":[0,8]}})", data8),
       "expected \"shape\" to be an array of integers"},
      {"element count overflows",
       FileBytes(R"({"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}})", data8),
       "tensor 'a': expected at most 9223372036854775807 elements, found shape [4611686018427387904, 4]"},
      {"byte count overflows",
       FileBytes(R"({"a":{"dtype":"I64","shape":[2305843009213693952],"data_offsets":[0,8]}})", data8),
       "expected at most 9223372036854775807 bytes, found shape [2305843009213693952] of i64"},
      {"missing data_offsets", FileBytes(R"({"a":{)" + kF32x2 + "}}", data8),
       "tensor 'a': expected \"data_offsets\", found none"},
      {"one offset", FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[0]}})", data8),
       "expected \"data_offsets\" to be [begin, end] with integers >= 0, found [0]"},
      {"negative offset", FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[-8,0]}})", data8),
       "expected \"data_offsets\" to be [begin, end] with integers >= 0, found [-8,0]"},
      {"begin after end", FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[8,0]}})", data8),
       "tensor 'a': expected data_offsets [begin, end] with begin <= end, found [8, 0]"},
      {"end past the data", FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[0,1000]}})", data8),
       "tensor 'a': expected data_offsets within the data region of 8 bytes, found [0, 1000]"},
      {"huge offsets", FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[18446744073709551608,18446744073709551615]}})", data8),
       "expected data_offsets within the data region of 8 bytes"},
      {"span does not match the shape", FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[0,4]}})", "xxxx"),
       "tensor 'a': expected data_offsets spanning 8 bytes (F32[2]), found [0, 4] (4 bytes)"},
      {"overlapping tensors",
       FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[0,8]},"b":{)" + kF32x2 + R"(,"data_offsets":[4,12]}})",
                 std::string(12, 'x')),
       "tensor 'b': data_offsets [4, 12] overlap tensor 'a' [0, 8]: expected tensors not to overlap"},
      {"the same bytes twice",
       FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[0,8]},"b":{)" + kF32x2 + R"(,"data_offsets":[0,8]}})", data8),
       "tensor 'b': data_offsets [0, 8] overlap tensor 'a' [0, 8]"},
      {"gap between tensors",
       FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[0,8]},"b":{)" + kF32x2 + R"(,"data_offsets":[12,20]}})",
                 std::string(20, 'x')),
       "tensor 'b': data_offsets [12, 20] leave bytes [8, 12) of the data region unused after tensor 'a': expected "
       "the tensors to cover it without gaps"},
      {"gap at the start", FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[4,12]}})", std::string(12, 'x')),
       "leave bytes [0, 4) of the data region unused at its start"},
      {"trailing bytes", FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[0,8]}})", std::string(12, 'x')),
       "expected the tensors to cover the data region of 12 bytes, found them ending at byte 8 (4 bytes unaccounted "
       "for)"},
      {"metadata not an object", FileBytes(R"({"__metadata__":["a"]})", ""),
       "expected \"__metadata__\" to be an object of strings, found [\"a\"]"},
      {"metadata value not a string", FileBytes(R"({"__metadata__":{"step":3}})", ""),
       "expected \"__metadata__\" values to be strings, found \"step\": 3"},
  };
}

TEST(SafetensorsHostileTest, EachMalformedFileIsRefusedWithAClearMessage) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.what);
    absl::Status s = Parse(c.bytes);
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_THAT(s.message(), HasSubstr(c.message));
  }
}

TEST(SafetensorsHostileTest, HeaderLimitIsAnOption) {
  const std::string bytes = FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[0,8]}})", std::string(8, 'x'));
  EXPECT_TRUE(Parse(bytes).ok());
  SafetensorsReadOptions options;
  options.max_header_bytes = 16;
  EXPECT_THAT(Parse(bytes, options).message(), HasSubstr("exceeds the limit of 16 bytes"));
}

TEST(SafetensorsHostileTest, ExtraKeysInAnEntryAreIgnoredAsTheReferenceDoes) {
  const std::string bytes =
      FileBytes(R"({"a":{)" + kF32x2 + R"(,"data_offsets":[0,8],"comment":"hi"}})", std::string(8, 'x'));
  EXPECT_TRUE(Parse(bytes).ok());
}

TEST(SafetensorsHostileTest, TruncatedFilesOnDiskAreRefused) {
  ScratchDir dir;
  const std::string path = dir.file("m.safetensors");
  ASSERT_TRUE(write_safetensors(path, {{"a", PatternTensor(DType::f32, {16}, 1)},
                                       {"b", PatternTensor(DType::bf16, {5}, 2)}})
                  .ok());
  const std::string whole = testing::ReadAll(path);
  for (std::size_t keep : {std::size_t{0}, std::size_t{5}, std::size_t{8}, std::size_t{40}, whole.size() - 1}) {
    SCOPED_TRACE(keep);
    ASSERT_EQ(::truncate(path.c_str(), static_cast<off_t>(keep)), 0);
    absl::Status s = SafetensorsFile::open(path).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_THAT(s.message(), HasSubstr("'" + path + "': "));
    testing::WriteAll(path, whole);
  }
  absl::Status s = ::truncate(path.c_str(), static_cast<off_t>(whole.size() - 2)) == 0
                       ? SafetensorsFile::open(path).status()
                       : absl::InternalError("truncate");
  EXPECT_THAT(s.message(), HasSubstr("tensor 'b': expected data_offsets within the data region of 72 bytes, found [64, 74]"));
}

// Random mutations of a valid file's header bytes (the length prefix included): whatever they make, parsing
// returns a status or a file whose every tensor lies inside the bytes. Fixed seed: the same mutations each run.
TEST(SafetensorsHostileTest, RandomHeaderMutationsNeverCrash) {
  absl::StatusOr<std::string> valid = serialize_safetensors(
      {{"wte.weight", PatternTensor(DType::f32, {4, 3}, 1)},
       {"h.0.attn.c_attn.bias", PatternTensor(DType::bf16, {9}, 2)},
       {"idx", PatternTensor(DType::i64, {2}, 3)},
       {"half", PatternTensor(DType::f16, {3}, 4)},
       {"empty", PatternTensor(DType::f32, {0}, 5)}},
      {{"format", "pt"}});
  ASSERT_TRUE(valid.ok());
  std::uint64_t header_len = 0;
  std::memcpy(&header_len, valid->data(), 8);
  const std::size_t header_end = 8 + static_cast<std::size_t>(header_len);
  const std::string significant = "{}[]\":,0123456789-.eE \\";
  std::mt19937_64 rng(20240518);
  int accepted = 0;
  int refused = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    std::string bytes = *valid;
    std::size_t hend = header_end;  // where the (mutated) header text ends
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < edits; ++k) {
      const std::size_t limit = std::min(bytes.size(), hend);
      if (limit == 0) break;
      const std::size_t pos = rng() % limit;
      switch (rng() % 6) {
        case 0: bytes[pos] = static_cast<char>(bytes[pos] ^ (1 << (rng() % 8))); break;        // flip a bit
        case 1: bytes[pos] = significant[rng() % significant.size()]; break;                   // JSON punctuation
        case 2: bytes[pos] = static_cast<char>(rng() % 256); break;                            // any byte
        case 3: bytes.erase(pos, 1); --hend; break;                                            // delete
        case 4: bytes.insert(pos, 1, significant[rng() % significant.size()]); ++hend; break;  // insert
        case 5: bytes.resize(pos + (rng() % (bytes.size() - pos + 1))); break;                 // truncate
      }
    }
    // Half the time the length prefix is made to match the edited header, so the mutations reach the
    // checks behind the JSON parse (entries, offsets, coverage) instead of stopping at the length.
    if (rng() % 2 == 0 && bytes.size() >= 8 && hend >= 8 && hend <= bytes.size()) {
      const std::uint64_t n = hend - 8;
      std::memcpy(bytes.data(), &n, 8);
    }
    absl::StatusOr<SafetensorsFile> file = SafetensorsFile::parse(
        absl::Span<const std::byte>(reinterpret_cast<const std::byte*>(bytes.data()), bytes.size()), "mutant");
    if (!file.ok()) {
      ++refused;
      EXPECT_FALSE(file.status().message().empty());
      EXPECT_TRUE(file.status().code() == absl::StatusCode::kDataLoss ||
                  file.status().code() == absl::StatusCode::kUnimplemented)
          << file.status();
      continue;
    }
    ++accepted;
    const auto* lo = reinterpret_cast<const std::byte*>(bytes.data());
    for (const SafetensorsEntry& e : file->entries()) {
      ASSERT_GE(e.bytes.data(), lo);
      ASSERT_LE(e.bytes.data() + e.bytes.size(), lo + bytes.size());
      EXPECT_EQ(tensor_from_entry(e).nbytes(), e.bytes.size());
    }
  }
  std::printf("random header mutations: %d refused, %d still valid\n", refused, accepted);
  EXPECT_GT(refused, 3000);  // most mutations break something; the test exercised the refusal paths
}

}  // namespace
}  // namespace shardkit::io
