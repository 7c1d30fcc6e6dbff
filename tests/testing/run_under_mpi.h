// Runs the current gtest as MPI ranks: under ctest it starts `mpirun -np n` on this binary filtered to the test,
// with `rank_env` set in the environment; in each such rank process it calls fn(world), the MPI world group (made
// once per process). The launching test passes when mpirun exits 0 and each of the n ranks printed gtest's OK line
// for the test (Note [collectives over mpi] in tests/common/comm/collectives_test.cc). The test target must define
// MPIEXEC_PATH (tests/*/CMakeLists.txt) and give each binary its own `rank_env`.
#pragma once

#include <unistd.h>

#include <cstdlib>
#include <functional>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/comm/mpi_process_group.h"
#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"

namespace shardkit::testing {

inline void RunUnderMpi(const char* rank_env, int n, const std::function<void(std::shared_ptr<comm::ProcessGroup>)>& fn) {
  if (std::getenv(rank_env) != nullptr) {  // a rank process
    static auto world = comm::create_mpi_world({.default_timeout = absl::Seconds(60)});  // MPI: once per process
    ASSERT_TRUE(world.ok()) << world.status();
    ASSERT_EQ((*world)->size(), n);
    fn(*world);
    return;
  }
  const ::testing::TestInfo* info = ::testing::UnitTest::GetInstance()->current_test_info();
  const std::string test = absl::StrCat(info->test_suite_name(), ".", info->name());
  char self[4096];
  const ssize_t len = ::readlink("/proc/self/exe", self, sizeof(self) - 1);
  ASSERT_GT(len, 0);
  const char* asan = std::getenv("ASAN_OPTIONS");
  const std::string asan_options = absl::StrCat(asan != nullptr ? asan : "", asan != nullptr ? ":" : "", "detect_leaks=0");
  const auto r = shardkit::testing::run_command(
      {MPIEXEC_PATH, "-np", std::to_string(n), "--oversubscribe", "--bind-to", "none", std::string(self, len),
       "--gtest_filter=" + test, "--gtest_color=no"},
      120,
      {{rank_env, "1"}, {"OMPI_ALLOW_RUN_AS_ROOT", "1"}, {"OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"},
       {"ASAN_OPTIONS", asan_options}});
  int passed = 0;
  const std::string ok_line = absl::StrCat("[       OK ] ", test, " (");
  for (auto at = r.out.find(ok_line); at != std::string::npos; at = r.out.find(ok_line, at + 1)) ++passed;
  EXPECT_TRUE(!r.timed_out && r.exit_code == 0 && passed == n)
      << "mpirun -np " << n << " " << test << ": " << (r.timed_out ? "timed out" : absl::StrCat("exit code ", r.exit_code))
      << ", " << passed << " of " << n << " ranks passed; their output:\n"
      << r.out << r.err;
}

}  // namespace shardkit::testing
