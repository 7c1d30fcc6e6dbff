// Sharded checkpoints (common/io/checkpoint.h): written at one world size, read back at another with other
// ranges; coverage, corruption, symlinks planted at the names a writer uses, the directory lock, refusing to
// overwrite, and a writer killed mid-write leaving the previous checkpoint intact.
#include "common/io/checkpoint.h"

#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "common/io/checksum.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "io_test_util.h"

namespace shardkit::io {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;
using testing::Bytes;
using testing::PatternTensor;
using testing::ReadAll;
using testing::ScratchDir;
using testing::WriteAll;

// The global tensors of the tests: several dtypes, a scalar, an empty one, odd sizes. Different seeds give
// different bytes in every element (PatternTensor drops the low 17 bits of its seed's contribution).
std::vector<std::pair<std::string, Tensor>> Globals(std::uint64_t s) {
  const std::uint64_t seed = s << 24;
  return {{"a.weight", PatternTensor(DType::f32, {10, 3}, seed + (1ull << 20))},
          {"b.bias", PatternTensor(DType::bf16, {7}, seed + (2ull << 20))},
          {"c.step", PatternTensor(DType::i64, {}, seed + (3ull << 20))},
          {"d.empty", PatternTensor(DType::f16, {0, 3}, seed + (4ull << 20))},
          {"e.replica", PatternTensor(DType::f32, {2, 2}, seed + (5ull << 20))}};
}

// Rank r of `world`'s pieces: an even split of each tensor's elements (uneven when it does not divide), except
// "e.replica", which every rank writes whole.
std::vector<TensorPiece> PiecesOf(const std::vector<std::pair<std::string, Tensor>>& globals, int r, int world) {
  std::vector<TensorPiece> out;
  for (const auto& [name, t] : globals) {
    if (name == "e.replica") {
      out.push_back({name, t.shape(), 0, t});
      continue;
    }
    const std::int64_t n = t.numel(), per = (n + world - 1) / world;
    const std::int64_t begin = std::min(n, per * r), end = std::min(n, per * (r + 1));
    out.push_back({name, t.shape(), begin, t.reshape({n}).view(begin, {end - begin})});
  }
  return out;
}

absl::Status WriteCheckpoint(const std::string& dir, const std::string& id, int world, std::uint64_t seed,
                             const CheckpointWriteOptions& options = {}) {
  const auto globals = Globals(seed);
  for (int r = 0; r < world; ++r) {
    if (absl::Status s = write_shard(dir, id, r, world, PiecesOf(globals, r, world), options); !s.ok()) return s;
  }
  return commit_checkpoint(dir, id, world, {{"step", std::to_string(seed)}}, options);
}

void ExpectCheckpointOf(const std::string& dir, std::uint64_t seed) {
  auto m = read_manifest(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->meta.at("step"), std::to_string(seed));
  for (const auto& [name, want] : Globals(seed)) {
    auto got = read_tensor(dir, *m, name);
    ASSERT_TRUE(got.ok()) << name << ": " << got.status();
    EXPECT_EQ(got->dtype(), want.dtype()) << name;
    EXPECT_EQ(got->shape(), want.shape()) << name;
    EXPECT_TRUE(Bytes(*got) == Bytes(want)) << name;
  }
}

TEST(Checkpoint, WrittenAtFourRanksReadsBitwiseAtThreeRanksWithOtherRanges) {
  ScratchDir dir;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), "step5-a", 4, 5).ok());
  const auto globals = Globals(5);
  auto m = read_manifest(dir.path());
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->world, 4);
  ASSERT_NE(m->find("a.weight"), nullptr);
  EXPECT_EQ(m->find("a.weight")->pieces.size(), 4u);   // 30 elements: 8 + 8 + 8 + 6
  EXPECT_EQ(m->find("e.replica")->pieces.size(), 4u);  // four replicas, one read
  // Three readers, each asking for its own third (rows of a.weight on dim 0, elements of the others).
  for (int r = 0; r < 3; ++r) {
    std::vector<ReadRequest> requests;
    std::vector<std::pair<std::string, Tensor>> want;
    for (const auto& [name, t] : globals) {
      const std::int64_t n = t.numel(), per = (n + 2) / 3;
      const std::int64_t begin = std::min(n, per * r), end = std::min(n, per * (r + 1));
      Tensor dest = Tensor::empty({end - begin}, TensorOptions{}.with_dtype(t.dtype()));
      requests.push_back({name, begin, dest});
      want.emplace_back(name, t.reshape({n}).view(begin, {end - begin}));
    }
    ASSERT_TRUE(read_pieces(dir.path(), *m, requests).ok());
    for (std::size_t i = 0; i < requests.size(); ++i) {
      EXPECT_TRUE(Bytes(requests[i].dest) == Bytes(want[i].second)) << "rank " << r << " " << want[i].first;
    }
  }
  ExpectCheckpointOf(dir.path(), 5);
}

TEST(Checkpoint, ReadConvertsToTheDestinationDtype) {
  ScratchDir dir;
  const Tensor w = Tensor::from_vector({1.5f, -2.25f, 3.f, 1e-3f}, {4});
  ASSERT_TRUE(write_shard(dir.path(), "c", 0, 1, {{"w", {4}, 0, w}}).ok());
  ASSERT_TRUE(commit_checkpoint(dir.path(), "c", 1, {}).ok());
  auto m = read_manifest(dir.path());
  ASSERT_TRUE(m.ok());
  Tensor bf = Tensor::empty({3}, TensorOptions{}.with_dtype(DType::bf16));
  ASSERT_TRUE(read_pieces(dir.path(), *m, std::vector<ReadRequest>{{"w", 1, bf}}).ok());
  EXPECT_EQ(bf.to_vector(), Tensor::from_vector({-2.25f, 3.f, 1e-3f}, {3}).to(DType::bf16).to_vector());
}

TEST(Checkpoint, PlanReadsOnlyTheOverlappingPiecesOnce) {
  Manifest m;
  m.id = "p";
  m.world = 3;
  TensorInfo t{"x", DType::f32, {12}, 12, {}};
  t.pieces = {{0, 0, 4, 0, 0}, {1, 4, 4, 0, 0}, {2, 4, 4, 0, 0}, {2, 8, 4, 0, 0}};  // rank 2 also holds [4, 8)
  m.tensors.push_back(t);
  auto plan = plan_read(m, std::vector<ReadRequest>{{"x", 3, Tensor::empty({6})}});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->size(), 3u);
  EXPECT_EQ((*plan)[0].piece, 0u);
  EXPECT_EQ((*plan)[0].piece_begin, 3);
  EXPECT_EQ((*plan)[0].count, 1);
  EXPECT_EQ((*plan)[1].piece, 1u);  // the first of the two replicas
  EXPECT_EQ((*plan)[1].dest_begin, 1);
  EXPECT_EQ((*plan)[1].count, 4);
  EXPECT_EQ((*plan)[2].piece, 3u);
  EXPECT_EQ((*plan)[2].count, 1);
  EXPECT_THAT(plan_read(m, std::vector<ReadRequest>{{"x", 8, Tensor::empty({5})}}).status().message(),
              HasSubstr("request for 'x': expected a range inside [0, 12), found [8, 13)"));
  EXPECT_EQ(plan_read(m, std::vector<ReadRequest>{{"y", 0, Tensor::empty({1})}}).status().code(),
            absl::StatusCode::kNotFound);
}

TEST(Checkpoint, CommitRefusesPiecesThatDoNotCoverATensorAndKeepsThePreviousManifest) {
  ScratchDir dir;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), "good", 2, 1).ok());
  const std::string before = ReadAll(dir.file(kManifestFile));
  const Tensor x = PatternTensor(DType::f32, {12}, 9);
  // Rank 1 leaves [8, 12) out.
  ASSERT_TRUE(write_shard(dir.path(), "gap", 0, 2, {{"x", {12}, 0, x.view(0, {4})}}).ok());
  ASSERT_TRUE(write_shard(dir.path(), "gap", 1, 2, {{"x", {12}, 4, x.view(4, {4})}}).ok());
  EXPECT_THAT(commit_checkpoint(dir.path(), "gap", 2, {}).message(), HasSubstr("tensor 'x': elements [8, 12) are in no piece"));
  // Ranges that overlap without being replicas.
  ASSERT_TRUE(write_shard(dir.path(), "overlap", 0, 2, {{"x", {12}, 0, x.view(0, {8})}}).ok());
  ASSERT_TRUE(write_shard(dir.path(), "overlap", 1, 2, {{"x", {12}, 4, x.view(4, {8})}}).ok());
  EXPECT_THAT(commit_checkpoint(dir.path(), "overlap", 2, {}).message(), HasSubstr("pieces [0, 8) and [4, 12) overlap"));
  // A rank that did not write.
  ASSERT_TRUE(write_shard(dir.path(), "missing", 0, 2, {{"x", {12}, 0, x}}).ok());
  const absl::Status missing = commit_checkpoint(dir.path(), "missing", 2, {});
  EXPECT_EQ(missing.code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(missing.message(), HasSubstr("rank 1's file"));
  EXPECT_TRUE(ReadAll(dir.file(kManifestFile)) == before);
  ExpectCheckpointOf(dir.path(), 1);
}

TEST(Checkpoint, WriteShardRefusesBadInput) {
  ScratchDir dir;
  const Tensor x = Tensor::zeros({4});
  EXPECT_THAT(write_shard(dir.path(), "a/b", 0, 1, {}).message(), HasSubstr("expected a checkpoint id of 1 to 64"));
  EXPECT_THAT(write_shard(dir.path(), "a", 2, 2, {}).message(), HasSubstr("found rank 2 of 2"));
  EXPECT_THAT(write_shard(dir.path(), "a", 0, 1, {{"x", {6}, 3, x}}).message(),
              HasSubstr("piece of 'x': expected a named range inside [0, 6) of [6], found [3, 7)"));
  EXPECT_THAT(write_shard(dir.path(), "a", 0, 1, {{"x", {8}, 0, x}, {"x", {9}, 4, x}}).message(),
              HasSubstr("pieces of 'x' disagree on dtype or global shape"));
  EXPECT_TRUE(dir.listing().empty());
}

TEST(Checkpoint, DamagedFilesAreDataLossNamingWhat) {
  ScratchDir dir;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), "d1", 2, 3).ok());
  auto m = read_manifest(dir.path());
  ASSERT_TRUE(m.ok());
  // A flipped byte in a piece: its checksum.
  const std::string rank1 = dir.file(shard_file_name("d1", 1, 2));
  const PieceLocation& p = m->find("a.weight")->pieces[1];
  ASSERT_EQ(p.rank, 1);
  std::string bytes = ReadAll(rank1);
  bytes[static_cast<std::size_t>(p.file_offset) + 2] ^= 0x10;
  WriteAll(rank1, bytes);
  absl::StatusOr<Tensor> t = read_tensor(dir.path(), *m, "a.weight");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(t.status().message(), HasSubstr("tensor 'a.weight' elements [15, 30): expected checksum"));
  EXPECT_TRUE(read_tensor(dir.path(), *m, "b.bias").ok()) << "pieces of rank 0 only";
  // A truncated manifest.
  const std::string manifest = ReadAll(dir.file(kManifestFile));
  WriteAll(dir.file(kManifestFile), manifest.substr(0, manifest.size() - 40));
  EXPECT_THAT(read_manifest(dir.path()).status().message(), HasSubstr("expected a last line 'xxh3 <16 hex digits>'"));
  // A modified manifest (a piece moved) with a stale checksum line.
  std::string moved = manifest;
  moved.replace(moved.find("\"file_offset\": "), 15, "\"file_offset\":1");
  WriteAll(dir.file(kManifestFile), moved);
  EXPECT_THAT(read_manifest(dir.path()).status().message(), HasSubstr("(truncated or modified file)"));
  // The rank file of another checkpoint under the name the manifest expects.
  WriteAll(dir.file(kManifestFile), manifest);
  ScratchDir other;
  ASSERT_TRUE(WriteCheckpoint(other.path(), "d1", 2, 4).ok());
  fs::copy_file(other.file(shard_file_name("d1", 0, 2)), dir.file(shard_file_name("d1", 0, 2)),
                fs::copy_options::overwrite_existing);
  EXPECT_THAT(read_tensor(dir.path(), *m, "b.bias").status().message(),
              HasSubstr("expected the rank file of checkpoint 'd1'"));
  EXPECT_EQ(read_manifest(other.path() + "/none").status().code(), absl::StatusCode::kNotFound);
}

// A manifest whose shape's element count overflows int64 is refused (with a valid checksum: crafted).
TEST(Checkpoint, ManifestWithOverflowingShapeIsRefused) {
  ScratchDir dir;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), "o", 1, 1).ok());
  std::string text = ReadAll(dir.file(kManifestFile));
  text.resize(text.size() - 22);  // the checksum line
  const std::size_t shape = text.find("\"shape\"", text.find("\"name\": \"a.weight\""));
  ASSERT_NE(shape, std::string::npos) << text;
  const std::size_t close = text.find(']', shape);
  text.replace(shape, close + 1 - shape, "\"shape\": [4294967296, 4294967296]");
  text += "xxh3 " + checksum_hex(checksum64(text)) + "\n";
  WriteAll(dir.file(kManifestFile), text);
  EXPECT_THAT(read_manifest(dir.path()).status().message(),
              HasSubstr("shape of 'a.weight': expected at most 9223372036854775807 elements"));
}

// Numbers that are not integers in range (Note [checked JSON numbers]) are refused, not cast: before, an offset of
// 1e300 went through nlohmann's get<int64_t>(), an out-of-range float-to-integer conversion (undefined; UBSan aborts).
TEST(Checkpoint, ManifestNumbersMustBeIntegersInRange) {
  ScratchDir dir;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), "n", 1, 1).ok());
  const std::string good = ReadAll(dir.file(kManifestFile));
  struct Case {
    std::string from, to, want;
  };
  for (const Case& c : std::vector<Case>{{"\"offset\": 0", "\"offset\": 1e300", "expected \"offset\" an integer, found number"},
                                         {"\"offset\": 0", "\"offset\": -1", "expected \"offset\" in [0, 9223372036854775807], found -1"},
                                         {"\"world\": 1", "\"world\": 18446744073709551615", "expected \"world\" at most 16777216"},
                                         {"\"rank\": 0", "\"rank\": \"0\"", "expected \"rank\" an integer, found string"}}) {
    SCOPED_TRACE(c.to);
    std::string text = good.substr(0, good.size() - 22);
    ASSERT_NE(text.find(c.from), std::string::npos);
    text.replace(text.find(c.from), c.from.size(), c.to);
    text += "xxh3 " + checksum_hex(checksum64(text)) + "\n";
    WriteAll(dir.file(kManifestFile), text);
    const absl::Status s = read_manifest(dir.path()).status();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss);
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.want));
  }
}

TEST(Checkpoint, AFifoPlantedAsTheManifestOrTheLockIsRefusedNotWaitedOn) {
  ScratchDir dir;
  ASSERT_EQ(::mkfifo(dir.file(kManifestFile).c_str(), 0644), 0);
  EXPECT_THAT(read_manifest(dir.path()).status().message(), HasSubstr("expected a regular file"));
  ASSERT_EQ(::mkfifo(dir.file(".lock").c_str(), 0644), 0);
  EXPECT_THAT(open_checkpoint_dir(dir.path(), ExistingCheckpoint::resume).status().message(),
              HasSubstr("cannot use the lock file '" + dir.file(".lock") + "' of checkpoint directory '" + dir.path() +
                        "': expected a regular file"));
}

// Symlinks planted at every name a writer opens (the lock file, the manifest, a rank file) and at a reader's
// rank file: the victim they point at is never written, truncated or read.
TEST(Checkpoint, SymlinksPlantedAtTheWritersNamesNeverTouchTheirTarget) {
  ScratchDir dir, elsewhere;
  const std::string victim = elsewhere.file("victim");
  WriteAll(victim, "precious");
  // The lock file: refused clearly.
  ASSERT_EQ(::symlink(victim.c_str(), dir.file(".lock").c_str()), 0);
  absl::StatusOr<DirectoryLock> lock = open_checkpoint_dir(dir.path(), ExistingCheckpoint::refuse);
  EXPECT_THAT(lock.status().message(), HasSubstr("cannot open the lock file '" + dir.file(".lock") + "'"));
  EXPECT_THAT(lock.status().message(), HasSubstr("Too many levels of symbolic links"));
  ::unlink(dir.file(".lock").c_str());
  // The manifest and a rank file: replaced (rename), never written through.
  ASSERT_EQ(::symlink(victim.c_str(), dir.file(kManifestFile).c_str()), 0);
  ASSERT_EQ(::symlink(victim.c_str(), dir.file(shard_file_name("s", 0, 1)).c_str()), 0);
  ASSERT_TRUE(WriteCheckpoint(dir.path(), "s", 1, 2).ok());
  struct stat st {};
  ASSERT_EQ(::lstat(dir.file(kManifestFile).c_str(), &st), 0);
  EXPECT_TRUE(S_ISREG(st.st_mode));
  ExpectCheckpointOf(dir.path(), 2);
  // A reader does not follow a symlink planted as a rank file.
  auto m = read_manifest(dir.path());
  ASSERT_TRUE(m.ok());
  ::unlink(dir.file(shard_file_name("s", 0, 1)).c_str());
  ASSERT_EQ(::symlink(victim.c_str(), dir.file(shard_file_name("s", 0, 1)).c_str()), 0);
  EXPECT_THAT(read_tensor(dir.path(), *m, "a.weight").status().message(), HasSubstr("Too many levels of symbolic links"));
  EXPECT_EQ(ReadAll(victim), "precious");
}

TEST(Checkpoint, ASecondWriterOfOneDirectoryIsRefusedNamingTheHolder) {
  ScratchDir dir;
  absl::StatusOr<DirectoryLock> first = open_checkpoint_dir(dir.path(), ExistingCheckpoint::refuse);
  ASSERT_TRUE(first.ok()) << first.status();
  absl::StatusOr<DirectoryLock> second = open_checkpoint_dir(dir.path(), ExistingCheckpoint::resume);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(second.status().message(),
              HasSubstr("checkpoint directory '" + dir.path() + "' is in use by another run (pid " +
                        std::to_string(::getpid()) + " holds '" + dir.file(".lock") + "')"));
  first = absl::UnknownError("released");  // the lock goes with its holder
  EXPECT_TRUE(open_checkpoint_dir(dir.path(), ExistingCheckpoint::resume).ok());
}

TEST(Checkpoint, AnExistingCheckpointIsRefusedUnlessResumedOrReplaced) {
  ScratchDir dir;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), "e", 1, 1).ok());
  EXPECT_THAT(open_checkpoint_dir(dir.path(), ExistingCheckpoint::refuse).status().message(),
              HasSubstr("checkpoint directory '" + dir.path() + "' already holds a checkpoint ('" +
                        dir.file(kManifestFile) + "')"));
  EXPECT_TRUE(open_checkpoint_dir(dir.path(), ExistingCheckpoint::resume).ok());
  EXPECT_TRUE(open_checkpoint_dir(dir.path(), ExistingCheckpoint::replace).ok());
  ScratchDir old;
  WriteAll(old.file("checkpoint.skck"), "SKCKPT01");
  EXPECT_THAT(open_checkpoint_dir(old.path(), ExistingCheckpoint::refuse, {"checkpoint.skck"}).status().message(),
              HasSubstr("already holds a checkpoint ('" + old.file("checkpoint.skck") + "')"));
  const std::string file = old.file("checkpoint.skck");
  EXPECT_THAT(open_checkpoint_dir(file + "/sub", ExistingCheckpoint::refuse).status().message(),
              HasSubstr("cannot write checkpoint directory '" + file + "/sub': Not a directory"));
}

TEST(Checkpoint, CommitRemovesOlderCheckpointsAndStaleTemporaries) {
  ScratchDir dir;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), "one", 2, 1).ok());
  WriteAll(dir.file(shard_file_name("two", 0, 2) + ".tmp-1-00000000000000ff"), "left by a killed writer");
  WriteAll(dir.file("notes.txt"), "the user's");
  ASSERT_TRUE(WriteCheckpoint(dir.path(), "two", 2, 2).ok());
  EXPECT_EQ(dir.listing(), (std::vector<std::string>{kManifestFile, "notes.txt", shard_file_name("two", 0, 2),
                                                      shard_file_name("two", 1, 2)}));
  ExpectCheckpointOf(dir.path(), 2);
}

// A writer SIGKILLed after N bytes of a rank file or of the manifest (a deterministic point: the test fault
// of CheckpointWriteOptions) leaves the previous checkpoint readable and bitwise intact.
TEST(Checkpoint, AWriterKilledMidCheckpointLeavesTheLastGoodOne) {
  ScratchDir dir;
  ASSERT_TRUE(WriteCheckpoint(dir.path(), "good", 2, 7).ok());
  const std::uint64_t manifest_bytes = ReadAll(dir.file(kManifestFile)).size();
  for (const std::int64_t n : {std::int64_t{0}, std::int64_t{12}, std::int64_t{300}, std::int64_t{700}}) {
    for (const bool in_manifest : {false, true}) {
      SCOPED_TRACE(::testing::Message() << n << " bytes into the " << (in_manifest ? "manifest" : "rank files"));
      if (in_manifest) {
        ASSERT_LT(static_cast<std::uint64_t>(n), manifest_bytes);
      }
      const pid_t child = ::fork();
      ASSERT_GE(child, 0);
      if (child == 0) {
        CheckpointWriteOptions kill{.fault_after_bytes = n, .fault = [] { ::raise(SIGKILL); }};
        const auto globals = Globals(8);
        for (int r = 0; r < 2; ++r) {
          if (!write_shard(dir.path(), "next", r, 2, PiecesOf(globals, r, 2), in_manifest ? CheckpointWriteOptions{} : kill).ok()) ::_exit(3);
        }
        (void)commit_checkpoint(dir.path(), "next", 2, {{"step", "8"}}, kill);
        ::_exit(4);  // not killed: the test's point was never reached
      }
      int status = 0;
      ASSERT_EQ(::waitpid(child, &status, 0), child);
      ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
      ExpectCheckpointOf(dir.path(), 7);
    }
  }
  // The next writer finds the leftovers and removes them when it commits.
  ASSERT_TRUE(WriteCheckpoint(dir.path(), "after", 2, 9).ok());
  ExpectCheckpointOf(dir.path(), 9);
  EXPECT_EQ(dir.listing(), (std::vector<std::string>{shard_file_name("after", 0, 2), shard_file_name("after", 1, 2),
                                                      kManifestFile}));
}

}  // namespace
}  // namespace shardkit::io
