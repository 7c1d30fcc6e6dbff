#include "common/autograd/hooks.h"

#include "common/autograd/engine.h"
#include "common/autograd/ops.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/autograd/test_util.h"

namespace shardkit::autograd {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing_util::Leaf;

TEST(TensorHookTest, SeesSummedGradientAndRunsInRegistrationOrder) {
  Tensor a = Leaf({1, 2}, {2});
  Tensor h = scale(a, 1.f);
  std::vector<std::string> log;
  std::vector<float> seen;
  auto h1 = register_hook(h, [&](const Tensor& g) -> std::optional<Tensor> {
    log.push_back("first");
    seen = g.to_vector();
    return std::nullopt;
  });
  auto h2 = register_hook(h, [&](const Tensor&) -> std::optional<Tensor> {
    log.push_back("second");
    return std::nullopt;
  });
  // h used twice: the hook sees 2 + 3 = 5 per element, once.
  backward(sum(add(scale(h, 2.f), scale(h, 3.f))));
  EXPECT_THAT(log, ElementsAre("first", "second"));
  EXPECT_THAT(seen, ElementsAre(5, 5));
}

TEST(TensorHookTest, ReplacesTheGradientOnNonLeafAndLeaf) {
  Tensor a = Leaf({1, 2}, {2});
  Tensor h = scale(a, 3.f);
  auto hh = register_hook(h, [](const Tensor& g) -> std::optional<Tensor> { return scale(g, 10.f); });
  auto ha = register_hook(a, [](const Tensor& g) -> std::optional<Tensor> {
    Tensor r = g.clone();
    r.data<float>()[0] += 1.f;
    return r;
  });
  backward(sum(h));
  EXPECT_THAT(a.grad().to_vector(), ElementsAre(31, 30));
}

TEST(TensorHookTest, RemovedHooksDoNotRun) {
  Tensor a = Leaf({1}, {1});
  int calls = 0;
  HookHandle handle = register_hook(a, [&](const Tensor&) -> std::optional<Tensor> {
    ++calls;
    return std::nullopt;
  });
  backward(sum(a));
  EXPECT_EQ(calls, 1);
  handle.remove();
  EXPECT_FALSE(handle.active());
  backward(sum(a));
  EXPECT_EQ(calls, 1);
  {
    HookHandle scoped = register_hook(a, [&](const Tensor&) -> std::optional<Tensor> {
      ++calls;
      return std::nullopt;
    });
  }  // destroyed: removed
  backward(sum(a));
  EXPECT_EQ(calls, 1);
  register_hook(a, [&](const Tensor&) -> std::optional<Tensor> {
    ++calls;
    return std::nullopt;
  }).keep();
  backward(sum(a));
  EXPECT_EQ(calls, 2);
}

TEST(TensorHookTest, RegisteringOnATensorWithoutGradIsAnError) {
  Tensor c = Tensor::zeros({2});
  EXPECT_THROW(register_hook(c, [](const Tensor&) -> std::optional<Tensor> { return std::nullopt; }), AutogradError);
  Tensor a = Leaf({1}, {1});
  try {
    register_post_accumulate_grad_hook(scale(a, 2.f), [](const Tensor&) {}).keep();
    FAIL();
  } catch (const AutogradError& e) {
    EXPECT_THAT(e.what(), HasSubstr("expected a leaf tensor that requires grad"));
  }
}

TEST(PostAccumulateGradHookTest, OncePerBackwardAfterGradIsFinalForSharedParameter) {
  Tensor w = Leaf({1, 2}, {2});
  std::vector<std::vector<float>> grads_seen;
  auto h = register_post_accumulate_grad_hook(w, [&](const Tensor& p) {
    EXPECT_TRUE(p.is_same(w));
    grads_seen.push_back(p.grad().to_vector());
  });
  // w used three times in one forward (like a tied embedding).
  Tensor loss = sum(add(add(scale(w, 1.f), scale(w, 2.f)), mul(w, w)));
  backward(loss);
  ASSERT_EQ(grads_seen.size(), 1u);
  EXPECT_THAT(grads_seen[0], ElementsAre(1 + 2 + 2, 1 + 2 + 4));
  // Second backward: accumulated, hook fires once more with the sum of both backwards.
  backward(sum(scale(w, 1.f)));
  ASSERT_EQ(grads_seen.size(), 2u);
  EXPECT_THAT(grads_seen[1], ElementsAre(6, 8));
}

TEST(PostAccumulateGradHookTest, FinalCallbacksRunAfterEveryHookAndMayQueueMore) {
  Tensor a = Leaf({1}, {1});
  Tensor b = Leaf({2}, {1});
  std::vector<std::string> log;
  auto ha = register_post_accumulate_grad_hook(a, [&](const Tensor&) {
    log.push_back("hook a");
    queue_callback([&] {
      log.push_back("callback 1");
      queue_callback([&] { log.push_back("callback 3 (queued by callback 1)"); });
    });
  });
  auto hb = register_post_accumulate_grad_hook(b, [&](const Tensor&) {
    log.push_back("hook b");
    queue_callback([&] { log.push_back("callback 2"); });
  });
  Tensor ya = scale(a, 2.f);  // a's branch created first: its hook runs last
  Tensor yb = scale(b, 2.f);
  backward(sum(add(ya, yb)));
  EXPECT_THAT(log, ElementsAre("hook b", "hook a", "callback 2", "callback 1", "callback 3 (queued by callback 1)"));
  // Callbacks belong to one backward: the next backward starts with an empty queue.
  log.clear();
  backward(sum(scale(b, 1.f)));
  EXPECT_THAT(log, ElementsAre("hook b", "callback 2"));
}

TEST(PostAccumulateGradHookTest, QueueCallbackOutsideBackwardIsAnError) {
  EXPECT_FALSE(is_backward_running());
  try {
    queue_callback([] {});
    FAIL();
  } catch (const AutogradError& e) {
    EXPECT_THAT(e.what(), HasSubstr("expected to be called while a backward runs"));
  }
}

TEST(PostAccumulateGradHookTest, GradientReadyOrderIsReverseForwardOrder) {
  // A 12-step chain x -> x * w_i: parameter i is ready in reverse order.
  constexpr int kLayers = 12;
  std::vector<Tensor> ws;
  std::vector<int> order;
  std::vector<HookHandle> handles;
  for (int i = 0; i < kLayers; ++i) {
    ws.push_back(Leaf({1.0f + 0.01f * static_cast<float>(i), 1.f}, {2}));
    handles.push_back(register_post_accumulate_grad_hook(ws.back(), [&order, i](const Tensor&) { order.push_back(i); }));
  }
  Tensor x = Tensor::from_vector({1, 2}, {2});
  for (int i = 0; i < kLayers; ++i) x = mul(x, ws[static_cast<std::size_t>(i)]);
  backward(sum(x));
  std::vector<int> expected;
  for (int i = kLayers - 1; i >= 0; --i) expected.push_back(i);
  EXPECT_EQ(order, expected);
}

TEST(PostAccumulateGradHookTest, AHookExceptionPropagatesAndTheEngineRecovers) {
  Tensor a = Leaf({1}, {1});
  auto h = register_post_accumulate_grad_hook(a, [](const Tensor&) { throw std::runtime_error("boom"); });
  const absl::Status st = try_backward(sum(a));
  EXPECT_EQ(st.code(), absl::StatusCode::kInternal);
  EXPECT_THAT(std::string(st.message()), HasSubstr("boom"));
  EXPECT_FALSE(is_backward_running());
  h.remove();
  backward(sum(a));
  EXPECT_THAT(a.grad().to_vector(), ElementsAre(2));
}

TEST(PostAccumulateGradHookTest, AStatusErrorFromACallbackKeepsItsCode) {
  Tensor a = Leaf({1}, {1});
  auto h = register_post_accumulate_grad_hook(a, [](const Tensor&) {
    queue_callback([] { throw StatusError(absl::DeadlineExceededError("all_reduce on rank 1: deadline passed")); });
  });
  const absl::Status st = try_backward(sum(a));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(st.message(), "all_reduce on rank 1: deadline passed");
  EXPECT_FALSE(is_backward_running());
}

}  // namespace
}  // namespace shardkit::autograd
