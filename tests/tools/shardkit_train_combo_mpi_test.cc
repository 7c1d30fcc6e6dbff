// shardkit-train's combinations under mpirun (--backend mpi) against ranks as threads (an audit; label mpi).
// README: over MPI "bit-identical to --ranks 4 with threads (final loss and parameter digest)": the MPI backend
// reduces with the in-process arithmetic in rank order, so the digests are equal at N = 3 too, under bf16,
// --checkpoint-activations and --compile; a checkpoint written by MPI ranks resumes in threads and back, and an
// export of MPI ranks holds the threads' bytes. Runs are tiny (model tiny, 3 to 6 steps, no sample).
// gcc 12 reports a false -Wrestrict inside std::string operator+ at -O3 (GCC bug 105329).
#pragma GCC diagnostic ignored "-Wrestrict"

#include <signal.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "tests/tools/shardkit_train_combo_common.h"

namespace shardkit::combo {
namespace {

using ::testing::HasSubstr;

// As tests/tools/shardkit_train_mpi_test.cc: mpirun as root, and no LeakSanitizer (Open MPI's allocations).
std::vector<std::pair<std::string, std::string>> MpirunEnv() {
  const char* asan = std::getenv("ASAN_OPTIONS");
  return {{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
          {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
          {"ASAN_OPTIONS", std::string(asan == nullptr ? "" : asan) + (asan != nullptr && *asan ? ":" : "") +
                               "detect_leaks=0"}};
}

testing::RunResult Mpi(int np, const std::vector<std::string>& args) {
  std::vector<std::string> argv = {MPIEXEC_PATH, "-np", std::to_string(np), "--oversubscribe", "--bind-to", "none",
                                   SHARDKIT_TRAIN_PATH, "--backend", "mpi"};
  argv.insert(argv.end(), args.begin(), args.end());
  return testing::run_command(argv, kDeadline, MpirunEnv());
}

std::vector<std::string> Tiny(int steps = 3) {
  return {"--model", "tiny", "--sample", "0", "--steps", std::to_string(steps)};
}

TEST(ShardkitTrainComboMpi, ThreeMpiRanksEqualThreeThreadsBitwiseInEveryCombination) {
  for (const std::vector<std::string>& combo :
       {std::vector<std::string>{"--strategy", "oss", "--precision", "bf16"},
        {"--strategy", "fsdp", "--precision", "bf16", "--checkpoint-activations"},
        {"--strategy", "sddp", "--checkpoint-activations"},
        {"--strategy", "ddp", "--compile"},
        {"--strategy", "fsdp", "--compile", "--checkpoint-activations"}}) {
    SCOPED_TRACE(Join(combo));
    const auto args = Cat(Tiny(), combo);
    const Outcome threads = Go(Cat(args, {"--ranks", "3"}));
    const auto r = Mpi(3, args);
    const Outcome mpi = FromResult(r, "mpirun " + Join(args));
    EXPECT_THAT(r.out, HasSubstr("on 3 ranks (processes, MPI)"));
    EXPECT_EQ(mpi.digest, threads.digest);
    EXPECT_EQ(mpi.loss, threads.loss);
  }
}

// fsdp at N = 3 killed after step 3 (last checkpoint: step 2) under mpirun, resumed by threads; and killed as
// threads, resumed under mpirun with an export: the uninterrupted run's digest, and the threads' export bytes.
TEST(ShardkitTrainComboMpi, CheckpointsAndExportsMoveBetweenMpiAndThreads) {
  const std::string dir = TempDir("mpi_moves");
  fs::create_directories(dir);
  const auto run = Cat(Tiny(6), {"--strategy", "fsdp", "--checkpoint-every", "2"});
  const Outcome full = Go(Cat(run, {"--ranks", "3", "--export", dir + "/threads_parts"}));

  const auto killed = Mpi(3, Cat(run, {"--checkpoint-dir", dir + "/by_mpi", "--stop-after-step", "3"}));
  EXPECT_NE(killed.exit_code, 0);
  EXPECT_FALSE(killed.timed_out);
  const Outcome in_threads = Go(Cat(run, {"--ranks", "3", "--checkpoint-dir", dir + "/by_mpi", "--resume"}));
  EXPECT_THAT(in_threads.out, HasSubstr("at step 2"));
  EXPECT_EQ(in_threads.digest, full.digest);

  const auto killed_threads =
      Train(Cat(run, {"--ranks", "3", "--checkpoint-dir", dir + "/by_threads", "--stop-after-step", "3"}));
  EXPECT_EQ(killed_threads.exit_code, 128 + SIGKILL);
  const auto r = Mpi(3, Cat(run, {"--checkpoint-dir", dir + "/by_threads", "--resume", "--export", dir + "/mpi_parts"}));
  const Outcome in_mpi = FromResult(r, "mpirun resume");
  EXPECT_EQ(in_mpi.digest, full.digest);
  for (const std::string f : {"model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                              "model-00003-of-00003.safetensors", "model.safetensors.index.json"}) {
    EXPECT_TRUE(ReadBytes(dir + "/mpi_parts/" + f) == ReadBytes(dir + "/threads_parts/" + f)) << f;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace shardkit::combo
