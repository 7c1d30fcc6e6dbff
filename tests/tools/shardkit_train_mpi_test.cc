// shardkit-train under mpirun with --backend mpi: every strategy at 4 processes ends with the final loss and
// the parameter digest of --ranks 4 threads (the MPI backend reduces with the in-process arithmetic, Note [mpi
// reductions]); --backend mpi without mpirun is a clear error. Label mpi.
#include <cstdlib>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"
#include "tests/tools/train_output.h"

namespace shardkit {
namespace {

using shardkit::testing::Field;

using ::testing::HasSubstr;

constexpr double kDeadline = 240;

// mpirun as root (CI containers), and no LeakSanitizer in sanitizer builds: Open MPI leaves allocations behind and
// unloads its plugins in MPI_Finalize, so they cannot be suppressed (as in tests/common/comm/mpi_worker.cc). The
// other checks of ASAN_OPTIONS stay as the run set them.
std::vector<std::pair<std::string, std::string>> mpirun_env() {
  const char* asan = std::getenv("ASAN_OPTIONS");
  return {{"OMPI_ALLOW_RUN_AS_ROOT", "1"},
          {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
          {"ASAN_OPTIONS", std::string(asan == nullptr ? "" : asan) + (asan != nullptr && *asan ? ":" : "") +
                               "detect_leaks=0"}};
}

TEST(ShardkitTrainMpi, FourMpiProcessesEqualFourThreadsBitwise) {
  for (const std::string strategy : {"ddp", "oss", "sddp", "fsdp"}) {
    SCOPED_TRACE(strategy);
    const std::vector<std::string> args = {"--strategy", strategy, "--steps", "12", "--model", "tiny", "--sample", "0"};
    std::vector<std::string> mpi = {MPIEXEC_PATH, "-np", "4", "--oversubscribe", "--bind-to", "none",
                                    SHARDKIT_TRAIN_PATH, "--backend", "mpi"};
    mpi.insert(mpi.end(), args.begin(), args.end());
    const auto over_mpi = testing::run_command(mpi, kDeadline, mpirun_env());
    ASSERT_EQ(over_mpi.exit_code, 0) << over_mpi.out << over_mpi.err;
    std::vector<std::string> threads = {SHARDKIT_TRAIN_PATH, "--ranks", "4"};
    threads.insert(threads.end(), args.begin(), args.end());
    const auto in_process = testing::run_command(threads, kDeadline);
    ASSERT_EQ(in_process.exit_code, 0) << in_process.err;
    EXPECT_THAT(over_mpi.out, HasSubstr("on 4 ranks (processes, MPI)"));
    EXPECT_EQ(Field(over_mpi.out, "final loss: "), Field(in_process.out, "final loss: "));
    const std::string digest = Field(in_process.out, "parameter digest: ");
    EXPECT_FALSE(digest.empty()) << in_process.out;
    EXPECT_EQ(Field(over_mpi.out, "parameter digest: "), digest);
  }
}

TEST(ShardkitTrainMpi, BackendMpiWithoutMpirunIsAnError) {
  const auto r = testing::run_command({SHARDKIT_TRAIN_PATH, "--backend", "mpi", "--steps", "1"}, kDeadline);
  EXPECT_NE(r.exit_code, 0);
  EXPECT_THAT(r.err, HasSubstr("--backend mpi: expected to be started by mpirun"));
  const auto bad = testing::run_command({SHARDKIT_TRAIN_PATH, "--backend", "gloo"}, kDeadline);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_THAT(bad.err, HasSubstr("tcp, shm or mpi"));
}

}  // namespace
}  // namespace shardkit
