// Optimizer::step() reports user mistakes as a Status and then updates nothing (Note [training step
// contract] in common/optim/optimizer.h).
#include <vector>

#include "common/optim/adam.h"
#include "common/optim/sgd.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::optim {
namespace {

using ::testing::HasSubstr;

// A parameter whose storage is released (what an optimizer built from model.parameters() before fsdp::fully_shard
// sees) is a FailedPrecondition naming it, and the live parameter before it is not
// stepped either.
TEST(OptimizerStepTest, ReleasedParameterIsFailedPreconditionAndStepsNothing) {
  Tensor a = Tensor::full({3}, 1.0);
  Tensor b = Tensor::full({2}, 1.0);
  a.set_grad(Tensor::full({3}, 1.0));
  b.set_grad(Tensor::full({2}, 1.0));
  b.release_storage();
  AdamW opt({a, b});
  absl::Status s = opt.step();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("AdamW step: param group 0, parameter 1: expected a parameter with live "
                                     "storage, found f32[2] cpu (released)"));
  EXPECT_THAT(s.message(), HasSubstr("build the optimizer from model.parameters() after fully_shard"));
  EXPECT_EQ(a.to_vector(), std::vector<float>(3, 1.0f));
  EXPECT_EQ(opt.state(0), nullptr);
}

// Hyper-parameters set out of range between steps (mutable_hyper) are an InvalidArgument naming the group;
// nothing is updated, and the step goes through once they are fixed.
TEST(OptimizerStepTest, InvalidHyperIsInvalidArgumentAndStepsNothing) {
  Tensor a = Tensor::full({3}, 1.0);
  Tensor b = Tensor::full({2}, 1.0);
  a.set_grad(Tensor::full({3}, 1.0));
  b.set_grad(Tensor::full({2}, 1.0));
  Sgd opt({a}, HyperParams{.lr = 0.5});
  ASSERT_TRUE(opt.add_param_group(ParamGroup{{b}, HyperParams{.lr = 0.5}}).ok());
  opt.mutable_hyper(1).lr = -1;
  absl::Status s = opt.step();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("SGD step: param group 1: expected lr >= 0, found -1"));
  EXPECT_EQ(a.to_vector(), std::vector<float>(3, 1.0f));
  opt.mutable_hyper(1).lr = 0.5;
  ASSERT_TRUE(opt.step().ok());
  EXPECT_EQ(a.to_vector(), std::vector<float>(3, 0.5f));
  EXPECT_EQ(b.to_vector(), std::vector<float>(2, 0.5f));
}

}  // namespace
}  // namespace shardkit::optim
