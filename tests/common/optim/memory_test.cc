// Ledger: optimizer state is charged to optimizer_state, exactly.
#include "common/optim/adam.h"
#include "common/optim/sgd.h"
#include "common/tensor/rank_context.h"
#include "gtest/gtest.h"

namespace shardkit::optim {
namespace {

std::int64_t StateBytes(RankContext& ctx) { return ctx.memory->current(MemoryCategory::optimizer_state); }

struct Params {
  std::vector<Tensor> p;
  std::int64_t elements = 0;
  Params(DType dtype) {
    for (std::int64_t n : {33, 1080, 1}) {
      p.push_back(Tensor::zeros({n}, TensorOptions{}.with_dtype(dtype).with_category(MemoryCategory::parameter)));
      p.back().set_grad(Tensor::full({n}, 0.5, TensorOptions{}.with_category(MemoryCategory::gradient)));
      elements += n;
    }
  }
};

TEST(OptimizerMemoryTest, AdamWFp32IsEightBytesPerElement) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Params params(DType::f32);
  AdamW opt(params.p);
  EXPECT_EQ(StateBytes(ctx), 0);  // lazily created at the first step
  ASSERT_TRUE(opt.step().ok());
  EXPECT_EQ(StateBytes(ctx), 8 * params.elements);
  ASSERT_TRUE(opt.step().ok());
  EXPECT_EQ(StateBytes(ctx), 8 * params.elements);
  EXPECT_EQ(ctx.memory->current(MemoryCategory::other), 0);
  // state_dict copies go to the caller's category; loading replaces (never adds to) the state.
  OptimizerStateDict d = opt.state_dict();
  EXPECT_EQ(ctx.memory->current(MemoryCategory::other), 8 * params.elements);
  ASSERT_TRUE(opt.load_state_dict(d).ok());
  EXPECT_EQ(StateBytes(ctx), 8 * params.elements);
}

TEST(OptimizerMemoryTest, Bf16MasterAddsFourBytes) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Params params(DType::bf16);
  Adam opt(params.p);
  ASSERT_TRUE(opt.step().ok());
  EXPECT_EQ(StateBytes(ctx), 12 * params.elements);
}

TEST(OptimizerMemoryTest, Sgd) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Params plain(DType::f32);
  Sgd a(plain.p, HyperParams{.lr = 0.1});
  ASSERT_TRUE(a.step().ok());
  EXPECT_EQ(StateBytes(ctx), 0);
  Params mom(DType::f32);
  Sgd b(mom.p, HyperParams{.lr = 0.1, .momentum = 0.9});
  ASSERT_TRUE(b.step().ok());
  EXPECT_EQ(StateBytes(ctx), 4 * mom.elements);
}

TEST(OptimizerMemoryTest, SkippedParamsHoldNoState) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Params params(DType::f32);
  params.p[1].set_grad(Tensor());
  AdamW opt(params.p);
  ASSERT_TRUE(opt.step().ok());
  EXPECT_EQ(StateBytes(ctx), 8 * (33 + 1));
}

}  // namespace
}  // namespace shardkit::optim
