#include "common/autograd/engine.h"

#include "common/autograd/autograd_meta.h"
#include "common/autograd/function.h"
#include "common/autograd/grad_mode.h"
#include "common/autograd/hooks.h"
#include "common/autograd/ops.h"
#include "common/tensor/rank_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/autograd/test_util.h"

namespace shardkit::autograd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::Leaf;

TEST(EngineTest, ChainRuleThroughSeveralOps) {
  Tensor a = Leaf({1, 2, 3}, {3});
  Tensor b = Leaf({4, 5, 6}, {3});
  Tensor loss = sum(add(mul(a, b), scale(a, 2.f)));  // sum(a*b + 2a)
  EXPECT_FLOAT_EQ(loss.item(), 4 + 10 + 18 + 12);
  backward(loss);
  EXPECT_THAT(a.grad().to_vector(), ElementsAre(6, 7, 8));  // b + 2
  EXPECT_THAT(b.grad().to_vector(), ElementsAre(1, 2, 3));  // a
}

TEST(EngineTest, GradientsAccumulateAcrossBackwardsUntilCleared) {
  Tensor a = Leaf({1, 2}, {2});
  backward(sum(scale(a, 3.f)));
  backward(sum(scale(a, 3.f)));
  EXPECT_THAT(a.grad().to_vector(), ElementsAre(6, 6));
  a.set_grad(Tensor());
  backward(sum(a));
  EXPECT_THAT(a.grad().to_vector(), ElementsAre(1, 1));
}

TEST(EngineTest, LeafGradIsChargedAsGradient) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tensor w = Leaf({1, 2, 3, 4}, {4});
  backward(sum(mul(w, w)));
  EXPECT_THAT(w.grad().to_vector(), ElementsAre(2, 4, 6, 8));
  EXPECT_EQ(ctx.memory->current(MemoryCategory::gradient), 16);
  EXPECT_EQ(w.grad().storage()->category(), MemoryCategory::gradient);
}

TEST(EngineTest, BackwardTwiceThroughFreedGraphIsAClearError) {
  Tensor a = Leaf({1, 2}, {2});
  Tensor loss = sum(mul(a, a));
  backward(loss);
  try {
    backward(loss);
    FAIL() << "expected AutogradError";
  } catch (const AutogradError& e) {
    EXPECT_THAT(e.what(), HasSubstr("already freed by an earlier backward"));
    EXPECT_THAT(e.what(), HasSubstr("SumBackward"));
    EXPECT_THAT(e.what(), HasSubstr("retain_graph"));
  }
  const absl::Status st = try_backward(loss);
  EXPECT_EQ(st.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(st.message()), HasSubstr("already freed"));
}

TEST(EngineTest, RetainGraphAllowsASecondBackward) {
  Tensor a = Leaf({1, 2}, {2});
  Tensor loss = sum(mul(a, a));
  backward(loss, Tensor(), {.retain_graph = true});
  backward(loss);
  EXPECT_THAT(a.grad().to_vector(), ElementsAre(4, 8));
}

TEST(EngineTest, RootErrors) {
  Tensor a = Leaf({1, 2}, {2});
  Tensor y = scale(a, 2.f);
  try {
    backward(y);
    FAIL();
  } catch (const AutogradError& e) {
    EXPECT_THAT(e.what(), HasSubstr("expected a one-element root when no gradient is given, found f32[2]"));
  }
  backward(y, Tensor::from_vector({1, 10}, {2}));
  EXPECT_THAT(a.grad().to_vector(), ElementsAre(2, 20));
  Tensor c = Tensor::from_vector({1}, {1});
  try {
    backward(c);
    FAIL();
  } catch (const AutogradError& e) {
    EXPECT_THAT(e.what(), HasSubstr("expected a root that requires grad"));
  }
}

TEST(EngineTest, SeveralRootsInOneTraversal) {
  Tensor a = Leaf({1, 2}, {2});
  Tensor h = scale(a, 2.f);
  Tensor y1 = mul(h, h);       // shares h with y2
  Tensor y2 = scale(h, 3.f);
  int h_hook_calls = 0;
  auto hh = register_hook(h, [&](const Tensor& g) -> std::optional<Tensor> {
    ++h_hook_calls;
    return std::nullopt;
  });
  backward({y1, y2}, {Tensor::from_vector({1, 1}, {2}), Tensor::from_vector({10, 10}, {2})});
  EXPECT_EQ(h_hook_calls, 1);  // both roots' contributions summed before h's node ran
  // d/da [sum(4a^2) + 10 * sum(6a)] = 8a + 60
  EXPECT_THAT(a.grad().to_vector(), ElementsAre(68, 76));
}

TEST(EngineTest, NoGradScopeRecordsNothing) {
  Tensor a = Leaf({1, 2}, {2});
  {
    NoGradGuard g;
    EXPECT_FALSE(is_grad_enabled());
    Tensor y = scale(a, 2.f);
    EXPECT_FALSE(y.requires_grad());
    EXPECT_EQ(grad_fn(y), nullptr);
    {
      GradModeGuard on(true);
      EXPECT_TRUE(scale(a, 2.f).requires_grad());
    }
  }
  EXPECT_TRUE(is_grad_enabled());
  EXPECT_TRUE(scale(a, 2.f).requires_grad());
}

TEST(EngineTest, NodesRunInReverseCreationOrder) {
  // Two independent branches: the one created later must run first.
  Tensor a = Leaf({1}, {1});
  Tensor b = Leaf({2}, {1});
  Tensor ya = scale(a, 2.f);  // created first
  Tensor yb = scale(b, 3.f);  // created second
  std::vector<std::string> order;
  auto ha = register_hook(ya, [&](const Tensor&) -> std::optional<Tensor> {
    order.push_back("a");
    return std::nullopt;
  });
  auto hb = register_hook(yb, [&](const Tensor&) -> std::optional<Tensor> {
    order.push_back("b");
    return std::nullopt;
  });
  backward(sum(add(ya, yb)));
  EXPECT_THAT(order, ElementsAre("b", "a"));
}

TEST(EngineTest, ActivationsChargedAndReleasedWithTheGraph) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tensor w = Leaf(std::vector<float>(256, 0.5f), {256});
  Tensor x = Tensor::full({256}, 2.0);  // charged to "other"
  const std::int64_t base = ctx.memory->current(MemoryCategory::activation);
  EXPECT_EQ(base, 0);
  Tensor loss;
  {
    Tensor h = mul(w, x);     // 1 KiB, saved? no: mul saves its inputs, h is an activation
    Tensor h2 = mul(h, h);    // saves h
    loss = sum(h2);
  }
  // h (saved by the second mul) and h2 (kept alive by nothing but... the graph does not keep outputs)
  // plus the loss scalar.
  EXPECT_EQ(ctx.memory->current(MemoryCategory::activation), 1024 + 4);
  backward(loss);
  // The graph released h; only the loss scalar remains.
  EXPECT_EQ(ctx.memory->current(MemoryCategory::activation), 4);
  EXPECT_EQ(ctx.memory->current(MemoryCategory::gradient), 1024);
  loss = Tensor();
  EXPECT_EQ(ctx.memory->current(MemoryCategory::activation), 0);
  EXPECT_GE(ctx.memory->peak(MemoryCategory::activation), 2048);
}

TEST(EngineTest, DroppingTheOutputFreesTheGraph) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Tensor w = Leaf(std::vector<float>(64, 1.f), {64});
  {
    Tensor loss = sum(mul(scale(w, 2.f), w));
    EXPECT_GT(ctx.memory->current(MemoryCategory::activation), 0);
  }
  EXPECT_EQ(ctx.memory->current(MemoryCategory::activation), 0);
}

class TimesTwoGrad : public Function {
 public:
  std::string name() const override { return "TimesTwoGrad"; }
  TensorList forward(const TensorList& in) override { return {in[0]}; }  // identity, returns the input itself
  TensorList backward(const TensorList& g) override { return {scale(g[0], 2.f)}; }
};

class MulFn : public Function {
 public:
  TensorList forward(const TensorList& in) override {
    save_for_backward({in[0], in[1]});
    return {mul(in[0], in[1])};
  }
  TensorList backward(const TensorList& g) override {
    const TensorList& s = saved_tensors();
    return {mul(g[0], s[1]), mul(g[0], s[0])};
  }
};

TEST(FunctionTest, CustomForwardAndBackward) {
  Tensor a = Leaf({1, 2}, {2});
  Tensor b = Leaf({3, 4}, {2});
  TensorList y = apply_function(std::make_shared<MulFn>(), {a, b});
  ASSERT_EQ(y.size(), 1u);
  EXPECT_TRUE(y[0].requires_grad());
  EXPECT_EQ(grad_fn(y[0])->name(), "CustomFunctionBackward");
  backward(sum(y[0]));
  EXPECT_THAT(a.grad().to_vector(), ElementsAre(3, 4));
  EXPECT_THAT(b.grad().to_vector(), ElementsAre(1, 2));
}

TEST(FunctionTest, IdentityFunctionAliasesItsInput) {
  Tensor a = Leaf({1, 2}, {2});
  Tensor h = scale(a, 1.f);
  auto before = grad_fn(h);
  TensorList y = apply_function(std::make_shared<TimesTwoGrad>(), {h});
  EXPECT_FALSE(y[0].is_same(h));
  EXPECT_EQ(y[0].storage(), h.storage());
  EXPECT_EQ(grad_fn(h), before);  // the input's history is untouched
  EXPECT_EQ(grad_fn(y[0])->name(), "TimesTwoGradBackward");
  backward(sum(y[0]));
  EXPECT_THAT(a.grad().to_vector(), ElementsAre(2, 2));
}

TEST(FunctionTest, NoNodeWithoutGradMode) {
  Tensor a = Leaf({1, 2}, {2});
  NoGradGuard g;
  TensorList y = apply_function(std::make_shared<TimesTwoGrad>(), {a});
  EXPECT_TRUE(y[0].is_same(a));
}

TEST(ShapeOpsTest, SplitConcatNarrowPermuteValues) {
  Tensor x = Tensor::from_vector({0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11}, {2, 3, 2});
  auto parts = split(x, {1, 2}, 1);
  EXPECT_THAT(parts[0].to_vector(), ElementsAre(0, 1, 6, 7));
  EXPECT_THAT(parts[1].to_vector(), ElementsAre(2, 3, 4, 5, 8, 9, 10, 11));
  EXPECT_THAT(concat({parts[1], parts[0]}, 1).to_vector(), ElementsAre(2, 3, 4, 5, 0, 1, 8, 9, 10, 11, 6, 7));
  EXPECT_THAT(narrow(x, -1, 1, 1).to_vector(), ElementsAre(1, 3, 5, 7, 9, 11));
  Tensor t = transpose(x, 0, 2);  // [2, 3, 2] -> [2, 3, 2] with dims 0 and 2 swapped
  EXPECT_EQ(t.shape(), (Shape{2, 3, 2}));
  EXPECT_THAT(t.to_vector(), ElementsAre(0, 6, 2, 8, 4, 10, 1, 7, 3, 9, 5, 11));
  Tensor p = permute(x, {1, 0, 2});
  EXPECT_EQ(p.shape(), (Shape{3, 2, 2}));
  EXPECT_THAT(p.to_vector(), ElementsAre(0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11));
}

TEST(ShapeOpsTest, SplitWithOnlySomeOutputsUsed) {
  Tensor x = Leaf({1, 2, 3, 4}, {4});
  auto parts = split(x, {1, 3}, 0);
  backward(sum(scale(parts[1], 5.f)));
  EXPECT_THAT(x.grad().to_vector(), ElementsAre(0, 5, 5, 5));
}

}  // namespace
}  // namespace shardkit::autograd
