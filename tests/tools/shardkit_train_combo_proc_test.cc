// shardkit-train's combinations as processes (shardrun, --backend tcp / shm) against ranks as threads (an audit of
// the built binaries). README: over TCP "same loss as --ranks 2 with threads, bit-identical in the tests"; trainer.h:
// the same losses "up to the backends' fp32 summation order". At N = 2 there is no order to choose (a + b), so every
// strategy, precision, --checkpoint-activations and --compile ends with the threads' digest; at N = 3 a ring sums in
// another order than the in-process group: the loss within a tolerance, the parameters within fp32 rounding.
// Checkpoints and exports move between processes and threads. A launcher's RANK is read as a number by the process
// group and as a string by main.cc (the BUG test below). Runs are tiny (model tiny, 3 to 6 steps, no sample).
// gcc 12 reports a false -Wrestrict inside std::string operator+ at -O3 (GCC bug 105329).
#pragma GCC diagnostic ignored "-Wrestrict"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>

#include <algorithm>
#include <string>
#include <vector>

#include "tests/tools/shardkit_train_combo_common.h"

namespace shardkit::combo {
namespace {

using ::testing::HasSubstr;

std::vector<std::string> Tiny(int steps = 3) {
  return {"--model", "tiny", "--sample", "0", "--steps", std::to_string(steps)};
}

// `nproc` processes of shardkit-train under shardrun with `backend`.
Outcome Procs(int nproc, const std::string& backend, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {SHARDRUN_PATH, "--nproc", std::to_string(nproc), "--", SHARDKIT_TRAIN_PATH,
                                   "--backend", backend};
  argv.insert(argv.end(), args.begin(), args.end());
  const auto r = testing::run_command(argv, kDeadline);
  Outcome o = FromResult(r, Join(argv));
  EXPECT_THAT(r.out, HasSubstr("on " + std::to_string(nproc) + " ranks (processes, " +
                               (backend == "tcp" ? "TCP" : "shared memory") + ")"));
  return o;
}

testing::RunResult ProcsKilled(int nproc, const std::string& backend, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {SHARDRUN_PATH, "--nproc", std::to_string(nproc), "--", SHARDKIT_TRAIN_PATH,
                                   "--backend", backend};
  argv.insert(argv.end(), args.begin(), args.end());
  return testing::run_command(argv, kDeadline);
}

TEST(ShardkitTrainComboProcesses, TwoProcessesEndWithTheThreadsDigestInEveryCombination) {
  const std::vector<std::vector<std::string>> combos = {
      {"--strategy", "oss"},
      {"--strategy", "sddp", "--precision", "bf16", "--checkpoint-activations"},
      {"--strategy", "fsdp", "--precision", "bf16"},
      {"--strategy", "ddp", "--compile"},
      {"--strategy", "fsdp", "--compile", "--checkpoint-activations"},
  };
  for (const auto& combo : combos) {
    const auto args = Cat(Tiny(), combo);
    const Outcome threads = Go(Cat(args, {"--ranks", "2"}));
    for (const std::string backend : {"tcp", "shm"}) {
      SCOPED_TRACE(backend + " " + Join(combo));
      const Outcome procs = Procs(2, backend, args);
      EXPECT_EQ(procs.digest, threads.digest);
      EXPECT_EQ(procs.loss, threads.loss);
    }
  }
}

TEST(ShardkitTrainComboProcesses, ThreeProcessesTrainLikeThreadsWithinRounding) {
  const std::string dir = TempDir("three");
  fs::create_directories(dir);
  const std::vector<std::vector<std::string>> combos = {
      {"--strategy", "ddp"},
      {"--strategy", "fsdp", "--compile"},
      {"--strategy", "sddp", "--precision", "bf16"},
  };
  for (const auto& combo : combos) {
    const bool bf16 = std::find(combo.begin(), combo.end(), "bf16") != combo.end();
    const bool exports = !bf16 && combo[1] != "fsdp";  // (--compile fsdp takes no --export)
    const std::string backend = combo[1] == "ddp" ? "shm" : "tcp";
    SCOPED_TRACE(backend + " " + Join(combo));
    const auto args = Cat(Tiny(), combo);
    const Outcome threads =
        Go(Cat(args, exports ? std::vector<std::string>{"--ranks", "3", "--export", dir + "/threads.safetensors"}
                             : std::vector<std::string>{"--ranks", "3"}));
    const Outcome procs = Procs(3, backend, exports ? Cat(args, {"--export", dir + "/procs.safetensors"}) : args);
    EXPECT_NEAR(procs.loss_value(), threads.loss_value(), (bf16 ? 1e-4 : 1e-6) * threads.loss_value());
    if (exports) {
      EXPECT_LT(MaxAbsDiff(ReadExport(dir + "/procs.safetensors"), ReadExport(dir + "/threads.safetensors")), 2e-5);
    }
  }
  fs::remove_all(dir);
}

// A checkpoint written by two TCP processes (killed after step 3; its last checkpoint is step 2) resumes in
// threads under another strategy, and one written by threads resumes in shared-memory processes: both end with
// the uninterrupted run's digest (N = 2: every strategy trains alike). A directory export of processes holds the
// bytes of the threads' export.
TEST(ShardkitTrainComboProcesses, CheckpointsAndExportsMoveBetweenProcessesAndThreads) {
  const std::string dir = TempDir("moves");
  fs::create_directories(dir);
  const auto run = Cat(Tiny(6), {"--checkpoint-every", "2"});
  const Outcome full = Go(Cat(run, {"--ranks", "2", "--strategy", "ddp", "--export", dir + "/threads_parts"}));

  const auto killed = ProcsKilled(2, "tcp", Cat(run, {"--strategy", "sddp", "--checkpoint-dir", dir + "/by_procs",
                                                      "--stop-after-step", "3"}));
  EXPECT_NE(killed.exit_code, 0);
  EXPECT_FALSE(killed.timed_out);
  const Outcome in_threads = Go(Cat(run, {"--ranks", "2", "--strategy", "fsdp", "--checkpoint-dir", dir + "/by_procs",
                                          "--resume"}));
  EXPECT_THAT(in_threads.out, HasSubstr("at step 2"));
  EXPECT_EQ(in_threads.digest, full.digest);

  const auto killed_threads = Train(Cat(run, {"--ranks", "2", "--strategy", "fsdp", "--checkpoint-dir",
                                              dir + "/by_threads", "--stop-after-step", "3"}));
  EXPECT_EQ(killed_threads.exit_code, 128 + SIGKILL);
  const Outcome in_procs = Procs(2, "shm", Cat(run, {"--strategy", "oss", "--checkpoint-dir", dir + "/by_threads",
                                                     "--resume", "--export", dir + "/procs_parts"}));
  EXPECT_EQ(in_procs.digest, full.digest);
  for (const std::string f : {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                              "model.safetensors.index.json"}) {
    EXPECT_TRUE(ReadBytes(dir + "/procs_parts/" + f) == ReadBytes(dir + "/threads_parts/" + f)) << f;
  }
  fs::remove_all(dir);
}

int FreePort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof a;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    ::close(fd);
    return 29517;
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// A launcher's RANK=00 (or +0) is rank 0 to main.cc as to the process group (init_from_env parses a number), so that
// process keeps rank 0's duties: open_dir (the lock and the refusal of a directory holding another run's
// checkpoint), the --log file and the run header. Found by this audit: main.cc compared the string with "0", and
// another run's checkpoint was overwritten without --overwrite while --log stayed empty.
TEST(ShardkitTrainComboProcesses, ALaunchersRankZeroWrittenWithALeadingZeroIsRankZero) {
  const std::string dir = TempDir("rank00"), log = TempDir("rank00.jsonl");
  Go({"--model", "tiny", "--steps", "3", "--sample", "0", "--ranks", "1", "--checkpoint-dir", dir});
  const std::string manifest = ReadBytes(dir + "/manifest.json");
  for (const std::string rank : {"00", "+0"}) {
    SCOPED_TRACE("RANK=" + rank);
    const auto r = testing::run_command(
        {SHARDKIT_TRAIN_PATH, "--model", "tiny", "--steps", "2", "--sample", "0", "--timeout", "30", "--checkpoint-dir",
         dir, "--log", log},
        kDeadline,
        {{"RANK", rank}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(FreePort())}});
    ExpectOneLineError(r, "already holds a checkpoint");
    EXPECT_TRUE(ReadBytes(dir + "/manifest.json") == manifest) << "another run's checkpoint was replaced";
  }
  // Where the directory is fresh, the run is rank 0's: its --log has every step.
  fs::remove_all(dir);
  const auto r = testing::run_command(
      {SHARDKIT_TRAIN_PATH, "--model", "tiny", "--steps", "2", "--sample", "0", "--timeout", "30", "--log", log},
      kDeadline, {{"RANK", "00"}, {"WORLD_SIZE", "1"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(FreePort())}});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(ReadLog(log).size(), 2u);
  fs::remove_all(dir);
  fs::remove(log);
}

}  // namespace
}  // namespace shardkit::combo
