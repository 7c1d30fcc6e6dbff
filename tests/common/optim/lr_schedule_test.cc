#include "common/optim/lr_schedule.h"

#include <cmath>
#include <numbers>

#include "common/optim/adam.h"
#include "gtest/gtest.h"

namespace shardkit::optim {
namespace {

TEST(LrScheduleTest, FactorValues) {
  EXPECT_EQ(constant_lr_factor(0), 1.0);
  EXPECT_EQ(constant_lr_factor(1000), 1.0);
  const double warm[] = {0.25, 0.5, 0.75, 1.0, 1.0, 1.0};
  for (int s = 0; s < 6; ++s) EXPECT_DOUBLE_EQ(linear_warmup_factor(s, 4), warm[s]) << s;
  EXPECT_EQ(linear_warmup_factor(0, 0), 1.0);

  EXPECT_DOUBLE_EQ(warmup_cosine_factor(0, 2, 10, 0.1), 0.5);
  EXPECT_DOUBLE_EQ(warmup_cosine_factor(1, 2, 10, 0.1), 1.0);
  EXPECT_DOUBLE_EQ(warmup_cosine_factor(2, 2, 10, 0.1), 1.0);  // cosine starts at its top
  EXPECT_NEAR(warmup_cosine_factor(6, 2, 10, 0.1), 0.55, 1e-15);  // half way: (1 + 0.1) / 2
  EXPECT_NEAR(warmup_cosine_factor(4, 2, 10, 0.1), 0.1 + 0.9 * 0.5 * (1 + std::cos(std::numbers::pi / 4)), 1e-15);
  EXPECT_DOUBLE_EQ(warmup_cosine_factor(10, 2, 10, 0.1), 0.1);
  EXPECT_DOUBLE_EQ(warmup_cosine_factor(50, 2, 10, 0.1), 0.1);
  EXPECT_DOUBLE_EQ(warmup_cosine_factor(5, 0, 10), 0.5);  // no warm-up, default min 0
  // Monotone non-increasing after the warm-up.
  for (int s = 2; s < 12; ++s) EXPECT_LE(warmup_cosine_factor(s + 1, 2, 10, 0.1), warmup_cosine_factor(s, 2, 10, 0.1));
}

TEST(LrScheduleTest, SchedulerScalesEachGroupsBaseLr) {
  AdamW opt(std::vector<Tensor>{Tensor::zeros({2})}, HyperParams{.lr = 0.1});
  LrScheduler sched(opt, linear_warmup(4));
  sched.apply(0);
  EXPECT_DOUBLE_EQ(opt.param_group(0).hyper.lr, 0.025);
  ASSERT_TRUE(opt.add_param_group(ParamGroup{{Tensor::zeros({3})}, HyperParams{.lr = 0.01}}).ok());
  sched.apply(1);  // the new group's base lr is its lr when first seen
  EXPECT_DOUBLE_EQ(opt.param_group(0).hyper.lr, 0.05);
  EXPECT_DOUBLE_EQ(opt.param_group(1).hyper.lr, 0.005);
  sched.apply(7);
  EXPECT_DOUBLE_EQ(opt.param_group(0).hyper.lr, 0.1);
  EXPECT_DOUBLE_EQ(opt.param_group(1).hyper.lr, 0.01);

  std::vector<ParamGroup> groups = {ParamGroup{{}, HyperParams{.lr = 2.0}}};
  LrScheduler free_sched(warmup_cosine(0, 4));
  free_sched.apply(2, absl::MakeSpan(groups));
  EXPECT_DOUBLE_EQ(groups[0].hyper.lr, 1.0);
}

}  // namespace
}  // namespace shardkit::optim
