// shardkit-train's checkpoints (Note [checkpoint format] in tools/shardkit_train/checkpoint.h), run as a user
// runs it: a checkpoint written sharded by FSDP at N = 4 and resumed by ShardedDDP at N = 3 (and by every
// strategy at other world sizes); resume after a kill between steps or in the middle of writing a checkpoint;
// symlinks planted at the names a writer uses; a directory holding another run's checkpoint; two runs on one
// directory; damaged, non-finite and old-format checkpoints. Runs are tiny (model tiny, a few steps).
// gcc 12 reports a false -Wrestrict inside std::string operator+ at -O3 (GCC bug 105329).
#pragma GCC diagnostic ignored "-Wrestrict"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <string>
#include <vector>

#include "common/io/checkpoint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"

namespace shardkit {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;
namespace fs = std::filesystem;

constexpr double kDeadline = 120;

testing::RunResult Train(std::vector<std::string> args) {
  args.insert(args.begin(), SHARDKIT_TRAIN_PATH);
  return testing::run_command(args, kDeadline);
}

std::string TempDir(const std::string& name) {
  const fs::path p = fs::temp_directory_path() / ("shardkit_train_ckpt_test_" + std::to_string(::getpid()) + "_" + name);
  fs::remove_all(p);
  return p.string();
}

// The value after `key` on the last line that has it, e.g. Field(out, "parameter digest: ").
std::string Field(const std::string& out, const std::string& key) {
  const std::size_t pos = out.rfind(key);
  if (pos == std::string::npos) return "";
  const std::size_t end = out.find('\n', pos);
  return out.substr(pos + key.size(), end == std::string::npos ? std::string::npos : end - pos - key.size());
}

std::string ReadBytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

void WriteBytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

void ExpectOneLineError(const testing::RunResult& r, const std::string& needle) {
  EXPECT_FALSE(r.timed_out);
  EXPECT_EQ(r.exit_code, 1) << r.err;
  EXPECT_THAT(r.err, StartsWith("shardkit-train: error: "));
  EXPECT_THAT(r.err, HasSubstr(needle));
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

std::vector<std::string> Names(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out.push_back(e.path().filename().string());
  std::sort(out.begin(), out.end());
  return out;
}

// Every tensor of dir's checkpoint, whole, by name.
std::map<std::string, Tensor> ReadAllTensors(const std::string& dir) {
  std::map<std::string, Tensor> out;
  auto m = io::read_manifest(dir);
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return out;
  for (const io::TensorInfo& t : m->tensors) {
    auto v = io::read_tensor(dir, *m, t.name);
    EXPECT_TRUE(v.ok()) << v.status();
    if (v.ok()) out.emplace(t.name, *v);
  }
  return out;
}

// Rewrites dir's checkpoint (a crafted one: what shardkit-train never writes) as one rank file with the same
// meta, after `edit` changed its tensors.
void Rewrite(const std::string& dir, const std::function<void(std::map<std::string, Tensor>&)>& edit) {
  auto m = io::read_manifest(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  std::map<std::string, Tensor> tensors = ReadAllTensors(dir);
  edit(tensors);
  std::vector<io::TensorPiece> pieces;
  for (const auto& [name, t] : tensors) pieces.push_back({name, t.shape(), 0, t});
  ASSERT_TRUE(io::write_shard(dir, "crafted", 0, 1, pieces).ok());
  ASSERT_TRUE(io::commit_checkpoint(dir, "crafted", 1, m->meta).ok());
}

void FillF32(const Tensor& t, float value) {
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = value;
}

// A good 2-step checkpoint of model tiny (2 ranks, oss) in a fresh directory `name`; returns the directory.
std::string TinyCheckpoint(const std::string& name) {
  const std::string dir = TempDir(name);
  const auto r = Train({"--model", "tiny", "--steps", "2", "--ranks", "2", "--sample", "0", "--checkpoint-dir", dir});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  return dir;
}

// The acceptance test of issue 17 item 4: FSDP at N = 4 writes its checkpoint of step 4 sharded (every rank
// its rows, nothing gathered); ShardedDDP at N = 3 resumes it. The strongest comparison available across world
// sizes: the same run's state written consolidated (rank 0 gathers and writes everything, the path the sharded
// layout replaces) holds bitwise the same tensors, and ShardedDDP at N = 3 resumed from either continues to the
// same parameters bit for bit; so do DDP at 3, OSS at 1 and FSDP at 2. Across the same N, FSDP at 4 resumed from
// its own sharded checkpoint ends bitwise equal to its uninterrupted run. (An uninterrupted run at N = 3 is not
// the reference: another N trains on other batches.)
TEST(ShardkitTrainCheckpoint, FsdpAtFourRanksResumedByShardedDdpAtThreeRanks) {
  const std::vector<std::string> fsdp4 = {"--model", "tiny", "--steps", "8", "--ranks", "4", "--sample", "0",
                                          "--strategy", "fsdp", "--checkpoint-every", "4"};
  auto with = [](std::vector<std::string> a, const std::vector<std::string>& extra) {
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const std::string sharded = TempDir("fsdp4_sharded"), consolidated = TempDir("fsdp4_consolidated"),
                    full_dir = TempDir("fsdp4_full");
  const auto full = Train(with(fsdp4, {"--checkpoint-dir", full_dir}));
  ASSERT_EQ(full.exit_code, 0) << full.err;
  for (const auto& [dir, extra] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {sharded, {}}, {consolidated, {"--test-checkpoint-consolidated"}}}) {
    auto args = with(fsdp4, {"--checkpoint-dir", dir, "--stop-after-step", "5"});
    args.insert(args.end(), extra.begin(), extra.end());
    const auto killed = Train(args);
    ASSERT_EQ(killed.exit_code, 128 + SIGKILL) << killed.err;
  }
  // Sharded: every rank wrote rows of the transformer blocks' weights; consolidated: rank 0 wrote everything.
  auto m = io::read_manifest(sharded);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->world, 4);
  EXPECT_EQ(m->meta.at("step"), "4");
  const io::TensorInfo* fc = m->find("model/blocks.0.mlp.fc.weight");
  ASSERT_NE(fc, nullptr);
  ASSERT_EQ(fc->pieces.size(), 4u);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(fc->pieces[static_cast<std::size_t>(r)].rank, r);
  const io::TensorInfo* m1 = m->find("optim/blocks.1.attn.proj.weight/exp_avg_sq");
  ASSERT_NE(m1, nullptr);
  EXPECT_EQ(m1->pieces.size(), 4u);
  auto mc = io::read_manifest(consolidated);
  ASSERT_TRUE(mc.ok()) << mc.status();
  for (const io::TensorInfo& t : mc->tensors) {
    for (const io::PieceLocation& p : t.pieces) EXPECT_EQ(p.rank, 0) << t.name;
  }
  const auto a = ReadAllTensors(sharded), b = ReadAllTensors(consolidated);
  ASSERT_EQ(a.size(), b.size());
  ASSERT_GT(a.size(), 20u);
  for (const auto& [name, t] : a) {
    ASSERT_TRUE(b.count(name)) << name;
    const Tensor& u = b.at(name);
    ASSERT_EQ(t.shape(), u.shape()) << name;
    EXPECT_EQ(std::memcmp(t.raw_data(), u.raw_data(), t.nbytes()), 0) << name;
  }

  // A resumed run writes its own checkpoints: each reader gets a fresh copy of the one under test.
  const std::string scratch = TempDir("fsdp4_reader");
  auto copy_of = [&](const std::string& dir) {
    fs::remove_all(scratch);
    fs::copy(dir, scratch, fs::copy_options::recursive);
    return scratch;
  };
  // The writer's own N: resumed equals uninterrupted.
  const auto resumed4 = Train(with(fsdp4, {"--checkpoint-dir", copy_of(sharded), "--resume"}));
  ASSERT_EQ(resumed4.exit_code, 0) << resumed4.err;
  EXPECT_THAT(resumed4.out, HasSubstr("resuming from " + scratch + "/manifest.json at step 4"));
  const std::string want4 = Field(full.out, "parameter digest: ");
  ASSERT_EQ(want4.size(), 16u) << full.out;
  EXPECT_EQ(Field(resumed4.out, "parameter digest: "), want4);
  // Other strategies and world sizes: the sharded checkpoint continues exactly as the consolidated one.
  for (const auto& [strategy, ranks] : std::vector<std::pair<std::string, std::string>>{
           {"sddp", "3"}, {"ddp", "3"}, {"oss", "1"}, {"fsdp", "2"}}) {
    SCOPED_TRACE(strategy + " at " + ranks);
    std::string digest[2];
    for (int k = 0; k < 2; ++k) {
      // --steps 8 again: the learning-rate schedule of the run that wrote it.
      const auto r = Train({"--model", "tiny", "--steps", "8", "--ranks", ranks, "--sample", "0", "--strategy", strategy,
                            "--checkpoint-dir", copy_of(k == 0 ? sharded : consolidated), "--resume"});
      ASSERT_EQ(r.exit_code, 0) << r.err;
      EXPECT_THAT(r.out, HasSubstr("at step 4"));
      digest[k] = Field(r.out, "parameter digest: ");
    }
    ASSERT_EQ(digest[0].size(), 16u);
    EXPECT_EQ(digest[0], digest[1]);
    EXPECT_NE(digest[0], want4);  // it did train on (other batches than FSDP at 4)
  }
  fs::remove_all(sharded);
  fs::remove_all(consolidated);
  fs::remove_all(full_dir);
  fs::remove_all(scratch);
}

// The process SIGKILLs itself right after step 7 (the last checkpoint is step 6's); --resume continues from step
// 6 and ends bit-identical to the uninterrupted run (same world, same reduction order), for every strategy as
// writer; the final checkpoint, resumed by every strategy at another world size, loads the same state.
TEST(ShardkitTrainCheckpoint, ResumeAfterKillBetweenStepsEqualsUninterruptedRun) {
  for (const std::string writer : {"oss", "fsdp", "ddp", "sddp"}) {
    SCOPED_TRACE(writer);
    const std::vector<std::string> common = {"--model", "tiny", "--steps", "10", "--ranks", "2", "--sample", "0",
                                             "--checkpoint-every", "3", "--strategy", writer};
    auto with = [&](std::vector<std::string> extra) {
      std::vector<std::string> a = common;
      a.insert(a.end(), extra.begin(), extra.end());
      return a;
    };
    const std::string full_dir = TempDir(writer + "_full"), kill_dir = TempDir(writer + "_killed");
    const auto full = Train(with({"--checkpoint-dir", full_dir}));
    ASSERT_EQ(full.exit_code, 0) << full.err;
    const std::string want = Field(full.out, "parameter digest: ");
    ASSERT_EQ(want.size(), 16u) << full.out;

    const auto killed = Train(with({"--checkpoint-dir", kill_dir, "--stop-after-step", "7"}));
    EXPECT_EQ(killed.exit_code, 128 + SIGKILL) << killed.err;
    EXPECT_THAT(killed.out, Not(HasSubstr("parameter digest")));
    EXPECT_TRUE(fs::exists(kill_dir + "/manifest.json"));

    const auto resumed = Train(with({"--checkpoint-dir", kill_dir, "--resume"}));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
    EXPECT_THAT(resumed.out, HasSubstr("resuming from " + kill_dir + "/manifest.json at step 6"));
    EXPECT_EQ(Field(resumed.out, "parameter digest: "), want);

    for (const auto& [strategy, ranks] : std::vector<std::pair<std::string, std::string>>{
             {"ddp", "3"}, {"sddp", "4"}, {"fsdp", "4"}}) {
      const auto other = Train({"--model", "tiny", "--steps", "10", "--ranks", ranks, "--sample", "0", "--strategy",
                                strategy, "--checkpoint-dir", full_dir, "--resume"});
      ASSERT_EQ(other.exit_code, 0) << strategy << ": " << other.err;
      EXPECT_EQ(Field(other.out, "parameter digest: "), want) << strategy;
    }
    fs::remove_all(full_dir);
    fs::remove_all(kill_dir);
  }
}

// A run SIGKILLed while it writes a checkpoint -- after N bytes of a rank file, or of the manifest (the test
// flag --test-kill-checkpoint-write, a deterministic point) -- leaves the last complete checkpoint as it was:
// --resume continues from it and ends equal to the uninterrupted run; the next commit removes the leftovers.
TEST(ShardkitTrainCheckpoint, AWriterKilledMidCheckpointLeavesTheLastGoodOne) {
  const std::vector<std::string> common = {"--model", "tiny", "--steps", "6", "--ranks", "2", "--sample", "0",
                                           "--checkpoint-every", "2"};
  auto with = [&](std::vector<std::string> extra) {
    std::vector<std::string> a = common;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const auto full = Train(common);
  ASSERT_EQ(full.exit_code, 0) << full.err;
  const std::string want = Field(full.out, "parameter digest: ");
  for (const std::string where : {"shard:0", "shard:1000", "shard:20000", "manifest:100", "manifest:3000"}) {
    SCOPED_TRACE(where);
    const std::string dir = TempDir("killed_writer");
    const auto first = Train(with({"--checkpoint-dir", dir, "--stop-after-step", "3"}));  // checkpoint of step 2
    ASSERT_EQ(first.exit_code, 128 + SIGKILL) << first.err;
    const std::string manifest = ReadBytes(dir + "/manifest.json");
    const auto good = ReadAllTensors(dir);
    const auto killed = Train(with({"--checkpoint-dir", dir, "--resume", "--test-kill-checkpoint-write", where}));
    ASSERT_EQ(killed.exit_code, 128 + SIGKILL) << killed.err;
    EXPECT_TRUE(ReadBytes(dir + "/manifest.json") == manifest) << "the manifest was replaced";
    const auto after = ReadAllTensors(dir);  // every piece read back and checksum-checked
    ASSERT_EQ(after.size(), good.size());
    for (const auto& [name, t] : good) {
      EXPECT_EQ(std::memcmp(t.raw_data(), after.at(name).raw_data(), t.nbytes()), 0) << name;
    }
    const auto resumed = Train(with({"--checkpoint-dir", dir, "--resume"}));
    ASSERT_EQ(resumed.exit_code, 0) << resumed.err;
    EXPECT_THAT(resumed.out, HasSubstr("at step 2"));
    EXPECT_EQ(Field(resumed.out, "parameter digest: "), want);
    for (const std::string& name : Names(dir)) EXPECT_THAT(name, Not(HasSubstr(".tmp-"))) << "a leftover";
    fs::remove_all(dir);
  }
}

// Symlinks planted at the names the writer used to open with O_TRUNC (the directory probe, the fixed temporary
// file) and at the final names (manifest, rank file): the victim they point at stays as it was. A symlink at the
// lock file is refused with a clear error. Before: the probe truncated the victim to 0 bytes and the temporary
// file was written through the link.
TEST(ShardkitTrainCheckpoint, SymlinksPlantedInTheDirectoryNeverTouchTheirTarget) {
  const std::string dir = TempDir("symlinks"), elsewhere = TempDir("symlinks_victim");
  fs::create_directories(dir);
  fs::create_directories(elsewhere);
  const std::string victim = elsewhere + "/victim";
  WriteBytes(victim, "precious");
  for (const std::string name : {".shardkit-train-probe", "checkpoint.skck.tmp", "manifest.json.tmp"}) {
    ASSERT_EQ(::symlink(victim.c_str(), (dir + "/" + name).c_str()), 0) << name;
  }
  const auto r = Train({"--model", "tiny", "--steps", "2", "--ranks", "2", "--sample", "0", "--checkpoint-dir", dir});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(ReadBytes(victim), "precious");
  // At the final names: the new files replace the links.
  ASSERT_EQ(::symlink(victim.c_str(), (dir + "/manifest.json.new").c_str()), 0);
  fs::rename(dir + "/manifest.json.new", dir + "/manifest.json");
  const auto again = Train({"--model", "tiny", "--steps", "2", "--ranks", "2", "--sample", "0", "--checkpoint-dir", dir,
                            "--overwrite"});
  EXPECT_EQ(again.exit_code, 0) << again.err;
  EXPECT_EQ(ReadBytes(victim), "precious");
  EXPECT_FALSE(fs::is_symlink(dir + "/manifest.json"));
  // The lock file.
  fs::remove(dir + "/.lock");
  ASSERT_EQ(::symlink(victim.c_str(), (dir + "/.lock").c_str()), 0);
  ExpectOneLineError(Train({"--model", "tiny", "--steps", "2", "--sample", "0", "--checkpoint-dir", dir, "--resume"}),
                     "cannot open the lock file '" + dir + "/.lock' of checkpoint directory '" + dir +
                         "': Too many levels of symbolic links");
  EXPECT_EQ(ReadBytes(victim), "precious");
  fs::remove_all(dir);
  fs::remove_all(elsewhere);
}

// A directory that holds a checkpoint (of another run) is refused without --resume or --overwrite, and left as
// it was. Before: the run wrote over it.
TEST(ShardkitTrainCheckpoint, AnotherRunsCheckpointIsNotOverwrittenUnlessAsked) {
  const std::string dir = TinyCheckpoint("overwrite");
  const std::string manifest = ReadBytes(dir + "/manifest.json");
  ExpectOneLineError(Train({"--model", "tiny", "--steps", "3", "--sample", "0", "--checkpoint-dir", dir}),
                     "checkpoint directory '" + dir + "' already holds a checkpoint ('" + dir +
                         "/manifest.json'); pass --resume to continue it or --overwrite to replace it");
  EXPECT_TRUE(ReadBytes(dir + "/manifest.json") == manifest);
  ExpectOneLineError(Train({"--model", "tiny", "--checkpoint-dir", dir, "--resume", "--overwrite"}),
                     "expected --resume or --overwrite, found both");
  const auto replaced = Train({"--model", "tiny", "--steps", "3", "--sample", "0", "--checkpoint-dir", dir, "--overwrite"});
  ASSERT_EQ(replaced.exit_code, 0) << replaced.err;
  auto m = io::read_manifest(dir);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->meta.at("step"), "3");
  fs::remove_all(dir);
}

// Two runs on one directory: the second is refused at once, naming the directory and the holder's pid (here the
// test process holds the lock, as a running shardkit-train's rank 0 does). Before: both wrote into it.
TEST(ShardkitTrainCheckpoint, ASecondRunOnTheSameDirectoryIsRefused) {
  const std::string dir = TempDir("locked");
  absl::StatusOr<io::DirectoryLock> held = io::open_checkpoint_dir(dir, io::ExistingCheckpoint::resume);
  ASSERT_TRUE(held.ok()) << held.status();
  const auto r = Train({"--model", "tiny", "--steps", "2", "--sample", "0", "--checkpoint-dir", dir});
  ExpectOneLineError(r, "checkpoint directory '" + dir + "' is in use by another run (pid " + std::to_string(::getpid()) +
                            " holds '" + dir + "/.lock')");
  EXPECT_FALSE(fs::exists(dir + "/manifest.json"));
  held = absl::UnknownError("released");
  const auto free = Train({"--model", "tiny", "--steps", "2", "--sample", "0", "--checkpoint-dir", dir});
  EXPECT_EQ(free.exit_code, 0) << free.err;
  fs::remove_all(dir);
}

TEST(ShardkitTrainCheckpoint, ResumeFromAnotherModelSizeOrDamagedCheckpoint) {
  const std::string dir = TinyCheckpoint("other_model");
  const std::vector<std::string> resume = {"--model", "tiny", "--steps", "4", "--checkpoint-dir", dir, "--resume"};
  ExpectOneLineError(Train({"--model", "small", "--steps", "4", "--checkpoint-dir", dir, "--resume"}),
                     "expected a checkpoint of model 'small' (120576 parameters), found model 'tiny' (34688 parameters)");
  ExpectOneLineError(Train({"--model", "tiny", "--steps", "4", "--seed", "9", "--checkpoint-dir", dir, "--resume"}),
                     "expected --seed 1 as the checkpoint was trained with, found --seed 9");
  // A truncated rank file, then a truncated manifest: refused (checksums, sizes), never half-loaded.
  auto m = io::read_manifest(dir);
  ASSERT_TRUE(m.ok());
  const std::string rank1 = dir + "/" + m->files[1].file, saved = ReadBytes(rank1);
  fs::resize_file(rank1, fs::file_size(rank1) - 100);
  ExpectOneLineError(Train(resume), "'" + rank1 + "' is corrupt");
  WriteBytes(rank1, saved);
  const std::string manifest = dir + "/manifest.json";
  fs::resize_file(manifest, fs::file_size(manifest) - 100);
  ExpectOneLineError(Train(resume), "'" + manifest + "' is corrupt");
  ExpectOneLineError(Train({"--model", "tiny", "--steps", "4", "--checkpoint-dir", TempDir("none"), "--resume"}),
                     "cannot read checkpoint: no checkpoint in '");
  fs::remove_all(dir);
  fs::remove_all(TempDir("none"));
}

// The single-file format of earlier versions is refused with a message that says what it is and what to do.
TEST(ShardkitTrainCheckpoint, OldSingleFileFormatIsRefusedClearly) {
  const std::string dir = TempDir("old_format");
  fs::create_directories(dir);
  WriteBytes(dir + "/checkpoint.skck", std::string("SKCKPT01") + std::string(40, '\0'));
  ExpectOneLineError(Train({"--model", "tiny", "--steps", "4", "--checkpoint-dir", dir, "--resume"}),
                     "cannot resume from '" + dir + "/checkpoint.skck': it is a checkpoint in the single-file format of "
                     "earlier shardkit-train versions (SKCKPT01), which this version does not read; resume it with the "
                     "shardkit-train that wrote it, or start a new run (--overwrite replaces it)");
  ExpectOneLineError(Train({"--model", "tiny", "--steps", "4", "--checkpoint-dir", dir}),
                     "already holds a checkpoint ('" + dir + "/checkpoint.skck')");
  const auto replaced = Train({"--model", "tiny", "--steps", "2", "--sample", "0", "--checkpoint-dir", dir, "--overwrite"});
  ASSERT_EQ(replaced.exit_code, 0) << replaced.err;
  EXPECT_FALSE(fs::exists(dir + "/checkpoint.skck"));
  fs::remove_all(dir);
}

// shardkit-train never writes inf or NaN into a checkpoint, so a checkpoint holding one is refused when it is
// read, naming the tensor.
TEST(ShardkitTrainCheckpoint, ResumeFromCheckpointWithNonFiniteValues) {
  const std::string dir = TinyCheckpoint("non_finite");
  const std::vector<std::string> resume = {"--model", "tiny", "--steps", "4", "--checkpoint-dir", dir, "--resume"};
  Rewrite(dir, [](auto& t) { FillF32(t.at("model/ln_f.bias"), std::numeric_limits<float>::quiet_NaN()); });
  ExpectOneLineError(Train(resume), "checkpoint '" + dir + "/manifest.json' is corrupt: expected finite values, found nan "
                                    "in model/ln_f.bias (element 0)");
  Rewrite(dir, [](auto& t) {
    FillF32(t.at("model/ln_f.bias"), 0.f);
    t.at("optim/ln_f.weight/exp_avg_sq").template data<float>()[5] = std::numeric_limits<float>::infinity();
  });
  ExpectOneLineError(Train(resume), "expected finite values, found inf in optim/ln_f.weight/exp_avg_sq (element 5)");
  fs::remove_all(dir);
}

// Note [non-finite loss] in trainer.cc: a run stops at the first non-finite loss, on every rank, before that step
// updates anything, with a non-zero exit code; the checkpoint it resumed from stays as it was. The weights here
// are finite (so the checkpoint is accepted) but ln_f.weight = 3e38 overflows the logits: the loss is nan.
TEST(ShardkitTrainCheckpoint, NonFiniteLossStopsEveryRankAndKeepsTheLastCheckpoint) {
  const std::string dir = TinyCheckpoint("diverged");
  Rewrite(dir, [](auto& t) { FillF32(t.at("model/ln_f.weight"), 3e38f); });
  const std::string path = dir + "/manifest.json";
  const std::string crafted = ReadBytes(path);
  const std::string want = "training diverged: the loss at step 3 is nan (non-finite on 2 of 2 ranks); stopped before "
                           "step 3 updated the parameters; the last checkpoint is step 2 in '" + dir + "'";
  for (const std::string strategy : {"oss", "ddp", "fsdp"}) {
    SCOPED_TRACE(strategy);
    ExpectOneLineError(Train({"--model", "tiny", "--steps", "5", "--ranks", "2", "--sample", "0", "--strategy",
                              strategy, "--checkpoint-every", "1", "--checkpoint-dir", dir, "--resume"}),
                       want);
    EXPECT_TRUE(ReadBytes(path) == crafted) << "the checkpoint was replaced";
  }
  // Two processes over TCP: both ranks stop at the same step, neither hangs, shardrun reports the failure.
  const auto tcp = testing::run_command({SHARDRUN_PATH, "--nproc", "2", "--", SHARDKIT_TRAIN_PATH, "--model", "tiny",
                                         "--steps", "5", "--sample", "0", "--checkpoint-dir", dir, "--resume"},
                                        kDeadline);
  EXPECT_FALSE(tcp.timed_out);
  EXPECT_NE(tcp.exit_code, 0);
  EXPECT_THAT(tcp.err, HasSubstr(want));
  EXPECT_TRUE(ReadBytes(path) == crafted) << "the checkpoint was replaced";
  fs::remove_all(dir);
}

// The update of a step can make parameters non-finite while that step's loss was finite (a crafted, finite Adam
// first moment of 3e38 overflows in the bias correction): the checkpoint of that step is refused, naming the
// tensor, and the previous one stays.
TEST(ShardkitTrainCheckpoint, CheckpointWithNonFiniteParametersIsNeverWritten) {
  const std::string dir = TinyCheckpoint("non_finite_update");
  Rewrite(dir, [](auto& t) { FillF32(t.at("optim/ln_f.weight/exp_avg"), 3e38f); });
  const std::string path = dir + "/manifest.json";
  const std::string crafted = ReadBytes(path);
  const auto r = Train({"--model", "tiny", "--steps", "5", "--ranks", "2", "--sample", "0", "--checkpoint-every", "1",
                        "--checkpoint-dir", dir, "--resume"});
  ExpectOneLineError(r, "refusing to write the checkpoint of step 3: expected finite values, found -inf in "
                        "model/ln_f.weight (element 0); the last checkpoint is step 2 in '" + dir + "'");
  EXPECT_TRUE(ReadBytes(path) == crafted) << "the checkpoint was replaced";
  fs::remove_all(dir);
}

}  // namespace
}  // namespace shardkit
