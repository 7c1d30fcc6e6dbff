// shardkit-train at GPT-2 small's size (issue 19): --compare runs every strategy on 124 M parameters and its
// memory table holds the ZeRO formulas exactly there too. Long (about a minute and 5 GB on 2 cores: four
// strategies x two ranks of a 124 M model); the short context and batch keep the steps themselves cheap.
// gcc 12 reports a false -Wrestrict inside std::string operator+ at -O3 (GCC bug 105329).
#pragma GCC diagnostic ignored "-Wrestrict"

#include <regex>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"

namespace shardkit {
namespace {

using ::testing::HasSubstr;

TEST(ShardkitTrainSizes, CompareAtGpt2Small) {
  const auto r = testing::run_command({SHARDKIT_TRAIN_PATH, "--compare", "--model", "gpt2-small", "--context", "16", "--batch",
                                       "1", "--ranks", "2", "--steps", "2", "--sample", "0", "--svg", "/dev/null"},
                                      900);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  // 124,439,808 at context 1024; 16 positions instead of 1024 leave 1008 x 768 fewer.
  EXPECT_THAT(r.out, HasSubstr("model gpt2-small --context 16 (byte-level GPT, 123,665,664 parameters"));
  // ddp: parameter 4Psi = 471.7 MiB, gradient 4Psi, optimizer 8Psi; each strategy's row is in the table.
  EXPECT_TRUE(std::regex_search(r.out, std::regex("\nddp +[0-9.]+ +471\\.7 MiB +471\\.7 MiB +943\\.5 MiB +1887\\.0 MiB"))) << r.out;
  for (const char* s : {"oss", "sddp", "fsdp"}) {
    EXPECT_TRUE(std::regex_search(r.out, std::regex(std::string("\n") + s + " +[0-9.]+ +[0-9.]+ MiB"))) << s << "\n" << r.out;
  }
}

}  // namespace
}  // namespace shardkit
