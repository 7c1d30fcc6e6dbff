// compile() on one rank: replay equals eager training bit for bit, the recorded graph, the errors for what cannot be
// captured, recapture, and the memory plan against the eager ledger.
#include "common/capture/compile.h"

#include <functional>
#include <string>
#include <vector>

#include "common/autograd/engine.h"
#include "common/autograd/function.h"
#include "common/autograd/hooks.h"
#include "common/autograd/ops.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/optim/clip_grad.h"
#include "common/tensor/rank_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::capture {
namespace {

using ::testing::HasSubstr;

struct Trainer {
  nn::GPT model{gpt_tiny::TinyConfig(), 1};
  std::unique_ptr<optim::Optimizer> opt = std::make_unique<optim::AdamW>(model.parameters());

  Tensor eager(const std::vector<Tensor>& batch) {
    Tensor loss = model.loss(batch[0], batch[1]);
    autograd::backward(loss);
    EXPECT_TRUE(opt->step().ok());
    opt->zero_grad();
    return loss;
  }
  StepFn step_fn() {
    return [this](const std::vector<Tensor>& batch) { return eager(batch); };
  }
};

std::vector<Tensor> Batch(int step, int rows = gpt_tiny::kBatch) {
  auto [x, y] = gpt_tiny::Batch(step, 0, rows);
  return {x, y};
}

// Two identical models trained for `steps` steps with the step `make` builds, one eagerly, one compiled: the losses
// and the final parameters must be equal bit for bit. Returns the replayed graph as text ("" on a failure).
std::string ReplayEqualsEager(const std::function<StepFn(Trainer&)>& make, int steps) {
  Trainer eager, c;
  const StepFn eager_step = make(eager);
  CompiledStep compiled = compile(make(c), c.model, *c.opt);
  for (int s = 0; s < steps; ++s) {
    const std::vector<Tensor> batch = Batch(s);
    const float want = static_cast<float>(eager_step(batch).item());
    absl::StatusOr<Tensor> got = compiled(batch);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) return "";
    EXPECT_EQ(static_cast<float>(got->item()), want) << "step " << s;
  }
  EXPECT_EQ(gpt_tiny::Values(c.model), gpt_tiny::Values(eager.model));
  return compiled.graph()->to_text();
}

TEST(Compile, ReplayEqualsEagerTrainingBitwiseOver20Steps) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Trainer eager, compiled_trainer;
  CompiledStep compiled = compile(compiled_trainer.step_fn(), compiled_trainer.model, *compiled_trainer.opt);
  for (int step = 0; step < 20; ++step) {
    const std::vector<Tensor> batch = Batch(step);
    const float want = static_cast<float>(eager.eager(batch).item());
    absl::StatusOr<Tensor> got = compiled(batch);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(static_cast<float>(got->item()), want) << "step " << step;
  }
  EXPECT_EQ(gpt_tiny::Values(compiled_trainer.model), gpt_tiny::Values(eager.model));
  EXPECT_EQ(compiled.captures(), 1);
  EXPECT_EQ(compiled.last_capture_reason(), "first call");
}

TEST(Compile, TheGraphHasForwardBackwardAndUpdateNodes) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Trainer t;
  CompiledStep compiled = compile(t.step_fn(), t.model, *t.opt);
  ASSERT_TRUE(compiled(Batch(0)).ok());
  const StepGraph& g = *compiled.graph();
  int linear = 0, linear_backward = 0, accumulate = 0, update = 0;
  for (const Node& n : g.nodes()) {
    linear += n.name == "linear";
    linear_backward += n.name == "LinearBackward";
    accumulate += n.name == "accumulate_grad";
    update += n.name == "AdamW.update";
  }
  const auto params = static_cast<int>(t.model.parameters().size());
  EXPECT_GT(linear, 0);
  EXPECT_EQ(linear_backward, linear);
  EXPECT_EQ(accumulate, params);
  EXPECT_EQ(update, params);
  EXPECT_EQ(g.counts().at("output"), 1);
  EXPECT_THAT(g.to_text(), HasSubstr("op AdamW.update reads [param."));
  EXPECT_THAT(g.to_dot(), HasSubstr("digraph step"));
  EXPECT_EQ(g.counts().count("collective"), 0u);  // one rank: no collectives
}

TEST(Compile, AComputationTheTracerDoesNotSeeFailsTheCaptureNamingIt) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Trainer t;
  CompiledStep compiled = compile(
      [&](const std::vector<Tensor>& batch) {
        Tensor loss = t.model.loss(batch[0], batch[1]);
        Tensor offset = Tensor::full({}, 0.5);  // made by a Tensor factory, not an op: not recorded
        Tensor total = autograd::add(loss, offset);
        autograd::backward(total);
        EXPECT_TRUE(t.opt->step().ok());
        t.opt->zero_grad();
        return total;
      },
      t.model, *t.opt);
  absl::StatusOr<Tensor> got = compiled(Batch(0));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(got.status().message(), HasSubstr("op 'add' reads f32[]"));
  EXPECT_THAT(got.status().message(), HasSubstr("Override"));
  // Nothing was stepped: the dry-run capture applied no update.
  Trainer fresh;
  EXPECT_EQ(gpt_tiny::Values(t.model), gpt_tiny::Values(fresh.model));
}

// A part of the step the recorder cannot see (here: a value computed with Tensor methods) is captured as a
// placeholder, and an Override gives the graph that replaces it.
Tensor ScaledReport(const Tensor& loss) {
  Tensor out = Tensor::full({}, loss.item() * 100.0);  // untraced on purpose
  record_placeholder("report", {loss}, {out});
  return out;
}

TEST(Compile, AnOverrideReplacesAnUntracedPartAtItsPlaceholder) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Trainer eager, t;
  auto step = [&](const std::vector<Tensor>& batch) { return ScaledReport(t.eager(batch)); };
  Override report{.name = "report", .expand = [](StepGraph&, const Node& placeholder) -> absl::StatusOr<std::vector<Node>> {
                    Node n{.kind = NodeKind::op, .name = "scaled_report", .reads = placeholder.reads,
                           .writes = placeholder.writes};
                    n.kernel = [](trace::KernelArgs& a) { a.writes[0] = Tensor::full({}, a.reads[0].item() * 100.0); };
                    return std::vector<Node>{n};
                  }};
  CompiledStep compiled = compile(step, t.model, *t.opt, {.overrides = {report}});
  for (int s = 0; s < 3; ++s) {
    const std::vector<Tensor> batch = Batch(s);
    const double want = eager.eager(batch).item() * 100.0;
    absl::StatusOr<Tensor> got = compiled(batch);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(static_cast<float>(got->item()), static_cast<float>(want)) << "step " << s;
  }
  EXPECT_THAT(compiled.graph()->to_text(), HasSubstr("op scaled_report reads [cross_entropy."));
  // Without the override the placeholder is left, and the executor refuses it.
  Trainer u;
  CompiledStep without = compile([&](const std::vector<Tensor>& b) { return ScaledReport(u.eager(b)); }, u.model, *u.opt);
  absl::StatusOr<Tensor> refused = without(Batch(0));
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("placeholder report"));
  EXPECT_THAT(refused.status().message(), HasSubstr("a placeholder is left"));
}

TEST(Compile, TheUsersTransformSeesTheFinalGraphAndItsErrorStopsTheCapture) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Trainer t;
  int seen_updates = 0;
  CompiledStep compiled = compile(t.step_fn(), t.model, *t.opt,
                                  {.transform = [&](StepGraph& g) {
                                     for (const Node& n : g.nodes()) seen_updates += n.name == "AdamW.update";
                                     return absl::OkStatus();
                                   }});
  ASSERT_TRUE(compiled(Batch(0)).ok());
  EXPECT_EQ(seen_updates, static_cast<int>(t.model.parameters().size()));
  Trainer u;
  CompiledStep refused = compile(u.step_fn(), u.model, *u.opt,
                                 {.transform = [](StepGraph&) { return absl::AbortedError("transform says no"); }});
  EXPECT_EQ(refused(Batch(0)).status(), absl::AbortedError("transform says no"));
}

// A custom Function (its own forward and backward) is one op: replay runs its forward again, and the backward of
// the node that made.
class Cube : public autograd::Function {
 public:
  std::string name() const override { return "Cube"; }
  autograd::TensorList forward(const autograd::TensorList& in) override {
    save_for_backward({in[0]});
    return {autograd::mul(in[0], autograd::square(in[0]))};
  }
  autograd::TensorList backward(const autograd::TensorList& g) override {
    const Tensor& x = saved_tensors()[0];
    return {autograd::mul(g[0], autograd::scale(autograd::square(x), 3.f))};
  }
};

TEST(Compile, ACustomFunctionIsReplayedWithItsOwnBackward) {
  RankContext ctx;
  RankContextScope scope(ctx);
  auto cubed = [](Trainer& t) {
    return [&t](const std::vector<Tensor>& b) {
      Tensor loss = autograd::apply_function(std::make_shared<Cube>(), {t.model.loss(b[0], b[1])})[0];
      autograd::backward(loss);
      EXPECT_TRUE(t.opt->step().ok());
      t.opt->zero_grad();
      return loss;
    };
  };
  EXPECT_THAT(ReplayEqualsEager(cubed, 5), HasSubstr("op CubeBackward"));
}

// clip_grad_norm scales the gradients in place with plain kernels; it reports itself (Note [tracing clipping]), so
// replay clips too.
TEST(Compile, ClippingInTheStepIsReplayed) {
  RankContext ctx;
  RankContextScope scope(ctx);
  auto clipped = [](Trainer& t) {
    return [&t](const std::vector<Tensor>& b) {
      Tensor loss = t.model.loss(b[0], b[1]);
      autograd::backward(loss);
      EXPECT_GT(optim::clip_grad_norm(t.model.parameters(), 0.05), 0.05);  // every step clips
      EXPECT_TRUE(t.opt->step().ok());
      t.opt->zero_grad();
      return loss;
    };
  };
  ReplayEqualsEager(clipped, 5);
}

// A buffer the step reads (not written) is an input of the graph like a parameter: the replay reads its live bytes,
// so a value written into it between calls is seen (as eagerly).
TEST(Compile, ABufferTheStepReadsIsAnInputAndItsNewValuesAreSeen) {
  RankContext ctx;
  RankContextScope scope(ctx);
  auto weighted = [](Trainer& t) {
    t.model.register_buffer("loss_weight", Tensor::full({}, 0.75));
    return [&t](const std::vector<Tensor>& b) {
      Tensor loss = autograd::mul(t.model.loss(b[0], b[1]), t.model.buffer("loss_weight"));
      autograd::backward(loss);
      EXPECT_TRUE(t.opt->step().ok());
      t.opt->zero_grad();
      return loss;
    };
  };
  Trainer eager, c;
  const StepFn eager_step = weighted(eager);
  CompiledStep compiled = compile(weighted(c), c.model, *c.opt);
  for (int s = 0; s < 4; ++s) {
    if (s == 2) {  // written in place between calls, on both
      eager.model.buffer("loss_weight").fill_(0.25);
      c.model.buffer("loss_weight").fill_(0.25);
    }
    const std::vector<Tensor> batch = Batch(s);
    const float want = static_cast<float>(eager_step(batch).item());
    absl::StatusOr<Tensor> got = compiled(batch);
    ASSERT_TRUE(got.ok()) << got.status();
    EXPECT_EQ(static_cast<float>(got->item()), want) << "step " << s;
  }
  EXPECT_EQ(gpt_tiny::Values(c.model), gpt_tiny::Values(eager.model));
  EXPECT_EQ(compiled.captures(), 1);
}

TEST(Compile, AnInPlaceWriteOutsideAnyOpFailsTheCaptureNamingIt) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Trainer t;
  CompiledStep compiled = compile(
      [&](const std::vector<Tensor>& batch) {
        Tensor loss = t.model.loss(batch[0], batch[1]);
        autograd::backward(loss);
        t.model.parameters()[0].grad().fill_(0.0);  // a write replay would not repeat
        EXPECT_TRUE(t.opt->step().ok());
        t.opt->zero_grad();
        return loss;
      },
      t.model, *t.opt);
  absl::StatusOr<Tensor> got = compiled(Batch(0));
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(got.status().message(), HasSubstr("Tensor::fill_ on f32["));
  EXPECT_THAT(got.status().message(), HasSubstr("a tensor of the step, outside any op"));
}

TEST(Compile, AHookFailsTheCaptureNamingIt) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Trainer t;
  autograd::HookHandle h = autograd::register_post_accumulate_grad_hook(t.model.parameters()[0], [](const Tensor&) {});
  CompiledStep compiled = compile(t.step_fn(), t.model, *t.opt);
  absl::StatusOr<Tensor> got = compiled(Batch(0));
  ASSERT_FALSE(got.ok());
  EXPECT_THAT(got.status().message(), HasSubstr("cannot replay a hook on leaf"));
}

TEST(Compile, ANewBatchShapeOrANewSetOfTrainableParametersRecapturesAndStaysEqualToEager) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Trainer eager, c;
  CompiledStep compiled = compile(c.step_fn(), c.model, *c.opt);
  for (int step = 0; step < 6; ++step) {
    const int rows = step < 2 ? gpt_tiny::kBatch : 8;
    if (step == 4) {
      gpt_tiny::FreezeBlock0(eager.model);
      gpt_tiny::FreezeBlock0(c.model);
    }
    const std::vector<Tensor> batch = Batch(step, rows);
    const float want = static_cast<float>(eager.eager(batch).item());
    absl::StatusOr<Tensor> got = compiled(batch);
    ASSERT_TRUE(got.ok()) << got.status();
    ASSERT_EQ(static_cast<float>(got->item()), want) << "step " << step;
    if (step == 2) {
      EXPECT_THAT(compiled.last_capture_reason(), HasSubstr("batch tensor 0 is i64[8, "));
    }
  }
  EXPECT_EQ(compiled.captures(), 3);
  EXPECT_EQ(compiled.last_capture_reason(), "the set of parameters that require grad changed");
  EXPECT_EQ(gpt_tiny::Values(c.model), gpt_tiny::Values(eager.model));
}

// The replay's ledger peak is at most eager's; and the step arena (Note [step arena]) holds the replay's values in
// no more than eager's peak of step temporaries plus each block's rounding to 64 bytes, and no less than what the
// replay has live at once. The first replay is the recording; from the second on every allocation but the loss
// (held past the step) comes from the arena.
TEST(Compile, TheMemoryPlanPeakIsAtMostTheEagerPeakAndTheArenaHoldsTheStepsValues) {
  std::int64_t eager_peak = 0, eager_temporaries = 0, replay_peak = 0, replay_temporaries = 0, planned_peak = 0;
  StepArena::Stats arena;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    Trainer t;
    t.eager(Batch(0));  // optimizer state exists from here on, as in the replayed steps
    ctx.memory->reset_peaks();
    const std::int64_t before = ctx.memory->total_current();
    t.eager(Batch(1));
    eager_peak = ctx.memory->total_peak();
    eager_temporaries = eager_peak - before;
  }
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    Trainer t;
    t.eager(Batch(0));
    CompiledStep compiled = compile(t.step_fn(), t.model, *t.opt);
    ASSERT_TRUE(compiled(Batch(1)).ok());
    EXPECT_EQ(compiled.arena_stats().from_arena, 0);  // recorded
    ctx.memory->reset_peaks();
    const std::int64_t before = ctx.memory->total_current();
    ASSERT_TRUE(compiled(Batch(2)).ok());
    replay_peak = ctx.memory->total_peak();
    replay_temporaries = replay_peak - before;
    planned_peak = compiled.memory_plan()->peak_bytes;
    arena = compiled.arena_stats();
  }
  EXPECT_GT(planned_peak, 0);
  EXPECT_LE(replay_peak, eager_peak);
  EXPECT_EQ(arena.recordings, 1);
  EXPECT_EQ(arena.from_heap, 1);
  EXPECT_GT(arena.from_arena, 100);
  EXPECT_GE(arena.arena_bytes, replay_temporaries);
  EXPECT_LE(arena.arena_bytes, eager_temporaries + 64 * arena.from_arena)
      << "eager temporaries " << eager_temporaries << ", arena blocks " << arena.from_arena;
}

}  // namespace
}  // namespace shardkit::capture
