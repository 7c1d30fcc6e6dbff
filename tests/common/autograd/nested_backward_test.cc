// A backward run from inside another backward (activation checkpointing's recompute, common/nn/checkpoint.h):
// with BackwardOptions::callbacks_to_enclosing, final callbacks queued inside it run after the enclosing backward.
#include <string>
#include <vector>

#include "common/autograd/engine.h"
#include "common/autograd/function.h"
#include "common/autograd/grad_mode.h"
#include "common/autograd/hooks.h"
#include "common/autograd/ops.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/autograd/test_util.h"

namespace shardkit::autograd {
namespace {

using ::testing::ElementsAre;
using testing_util::Leaf;

// Identity in forward; its backward runs a nested backward through sum(w * w) first.
class RunsANestedBackward : public Function {
 public:
  RunsANestedBackward(Tensor w, bool to_enclosing, std::vector<std::string>* log)
      : w_(std::move(w)), to_enclosing_(to_enclosing), log_(log) {}
  TensorList forward(const TensorList& in) override { return {in[0]}; }
  TensorList backward(const TensorList& grads) override {
    Tensor inner;
    {
      GradModeGuard grad(true);
      inner = sum(mul(w_, w_));
    }
    autograd::backward(inner, Tensor(), {.callbacks_to_enclosing = to_enclosing_});
    log_->push_back("nested backward returned");
    return {grads[0]};
  }

 private:
  Tensor w_;
  bool to_enclosing_;
  std::vector<std::string>* log_;
};

std::vector<std::string> Events(bool to_enclosing) {
  std::vector<std::string> log;
  Tensor x = Leaf({1, 2}, {2}), w = Leaf({3}, {1});
  HookHandle hw = register_post_accumulate_grad_hook(w, [&](const Tensor&) {
    log.push_back("w ready");
    queue_callback([&] { log.push_back("callback"); });
  });
  HookHandle hx = register_post_accumulate_grad_hook(x, [&](const Tensor&) { log.push_back("x ready"); });
  TensorList out = apply_function(std::make_shared<RunsANestedBackward>(w, to_enclosing, &log), {x});
  backward(sum(out[0]));
  EXPECT_THAT(w.grad().to_vector(), ElementsAre(6));
  EXPECT_THAT(x.grad().to_vector(), ElementsAre(1, 1));
  return log;
}

TEST(NestedBackwardTest, CallbacksToEnclosingRunAfterTheEnclosingBackward) {
  EXPECT_THAT(Events(true), ElementsAre("w ready", "nested backward returned", "x ready", "callback"));
}

TEST(NestedBackwardTest, ByDefaultANestedBackwardRunsItsOwnCallbacksWhenItEnds) {
  EXPECT_THAT(Events(false), ElementsAre("w ready", "callback", "nested backward returned", "x ready"));
}

TEST(NestedBackwardTest, CallbacksToEnclosingWithoutAnEnclosingBackwardRunsThemAtItsEnd) {
  std::vector<std::string> log;
  Tensor w = Leaf({2}, {1});
  HookHandle h = register_post_accumulate_grad_hook(w, [&](const Tensor&) {
    queue_callback([&] { log.push_back("callback"); });
  });
  backward(sum(mul(w, w)), Tensor(), {.callbacks_to_enclosing = true});
  log.push_back("returned");
  EXPECT_THAT(log, ElementsAre("callback", "returned"));
  EXPECT_FALSE(is_backward_running());
}

}  // namespace
}  // namespace shardkit::autograd
