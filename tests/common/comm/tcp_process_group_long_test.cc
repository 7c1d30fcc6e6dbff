// Opt-in (label long): the TCP collective matrix at 1,000,003 elements for every collective x op x dtype,
// ranks as threads, n = 2, 3, 4 (the default suite runs 1,000,003 for f32 sum only).
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/comm/tcp_test_ranks.h"
#include "tests/common/comm/tcp_test_util.h"

namespace shardkit::comm {
namespace {

using tcp_testing::run_collective_matrix;
using tcp_testing::run_tcp_ranks;

// The full matrix at 1,000,003 elements (every collective x op x dtype); opt-in (label long).
class TcpCollectivesLarge : public ::testing::TestWithParam<int> {};

TEST_P(TcpCollectivesLarge, EveryCollectiveOpAndDtypeAtOneMillionAndThree) {
  const int n = GetParam();
  TcpProcessGroupOptions o;
  o.default_timeout = absl::Seconds(120);
  run_tcp_ranks(n, o, [&](int, std::shared_ptr<TcpProcessGroup>& pg) {
    auto errors = run_collective_matrix(*pg, {1000003}, {DType::f32, DType::bf16, DType::f16, DType::i64});
    EXPECT_THAT(errors, ::testing::IsEmpty());
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, TcpCollectivesLarge, ::testing::Values(2, 3, 4));

}  // namespace
}  // namespace shardkit::comm
