// shardkit-train on its defaults (issue 7 acceptance): the loss at the last step is below 60% of the first,
// and the run takes under a minute on 2 cores. Long: the default run itself takes 10-30 s.
#include <string>

#include "gtest/gtest.h"
#include "tests/tools/subprocess.h"

namespace shardkit {
namespace {

double After(const std::string& out, const std::string& key) {
  const auto pos = out.find(key);
  return pos == std::string::npos ? -1 : std::stod(out.substr(pos + key.size()));
}

TEST(ShardkitTrainDefaults, LossFallsBelow60PercentWithinAMinute) {
  const auto r = testing::run_command({SHARDKIT_TRAIN_PATH}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.out << r.err;
  const double first = After(r.out, "loss: first "), last = After(r.out, "final loss: ");
  ASSERT_GT(first, 0) << r.out;
  EXPECT_LT(last, 0.6 * first) << r.out;
  EXPECT_LT(r.seconds, 60.0) << "the default run must take under a minute on 2 cores";
  RecordProperty("seconds", std::to_string(r.seconds));
  RecordProperty("loss_first", std::to_string(first));
  RecordProperty("loss_last", std::to_string(last));
}

}  // namespace
}  // namespace shardkit
