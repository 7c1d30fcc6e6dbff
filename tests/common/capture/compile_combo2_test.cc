// The second compile() combination audit (after compile_combo_test.cc, compile_state_combo_test.cc): each compiled run
// against the eager one, bit for bit where compile.h / replicate_mode.h / fully_shard_mode.h promise it, or a clear
// error naming the cause where the docs refuse:
//   * clip_grad_norm (norm 2 and inf) inside the compiled step with an lr schedule: one rank and replicate equal
//     eager DDP; the fully-shard mode refuses it;
//   * loss scaling: by hand with optim::scale_grads (reported unsupported), and sddp::ShardedGradScaler inside the
//     compiled step;
//   * CompileOptions (coalesce_bytes, arena = false, a transform) and FullyShardModeOptions (bucket_bytes,
//     prefetch, reshard_last_bucket_after_forward) with dropout, checkpointed blocks and a frozen block;
//   * the batch: its number of tensors changing between calls, a view of a larger tensor, one tensor object
//     rewritten in place between calls;
//   * a model with BatchNorm1d buffers (refused, nothing updated);
//   * the step function throwing in a recapture, then the next call;
//   * CompileOptions::guard flipping back and forth, invalidate() before every call;
//   * hyper-parameters (lr, weight decay, betas, eps; SGD momentum turned on after the capture) changed between
//     calls.
#include <limits>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/autograd/ops.h"
#include "common/nn/layers.h"
#include "common/optim/clip_grad.h"
#include "common/optim/sgd.h"
#include "gmock/gmock.h"
#include "sddp/grad_scaler.h"
#include "tests/common/capture/compile_combo_harness.h"
#include "tests/testing/checkpoint_gpt.h"

namespace shardkit::compile_combo {
namespace {

using ::testing::HasSubstr;

// ---- a runner with a free step body --------------------------------------------------------------------------------

using Body = std::function<Tensor(nn::GPT&, optim::Optimizer&, const std::vector<Tensor>&, int step)>;

Tensor PlainBody(nn::GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& b, int) {
  Tensor loss = model.loss(b[0], b[1]);
  autograd::backward(loss);
  EXPECT_TRUE(opt.step().ok());
  opt.zero_grad();
  return loss;
}

struct Plan {
  nn::GPTConfig config = gpt_tiny::TinyConfig();
  int steps = 4;
  std::function<std::unique_ptr<optim::Optimizer>(nn::GPT&)> make_opt = [](nn::GPT& m) {
    return std::make_unique<optim::AdamW>(m.parameters());
  };
  std::function<absl::Status(nn::GPT&, optim::Optimizer&)> prepare = nullptr;
  // Before step `step`, on both copies (the compiled one is given its CompiledStep, else nullptr).
  std::function<void(int step, nn::GPT&, optim::Optimizer&, capture::CompiledStep*)> before = nullptr;
  Body body = PlainBody;
  // When set: each copy on each rank gets its own body, made with the rank's group (a scaler per copy).
  std::function<Body(const std::shared_ptr<comm::ProcessGroup>&)> make_body = nullptr;
  // The batch of rank `rank` of step `step` (default: its rows of gpt_tiny::Batch).
  std::function<std::vector<Tensor>(int step, int rank, int world)> batch = [](int step, int rank, int world) {
    const int rows = gpt_tiny::kBatch / world;
    auto [x, y] = gpt_tiny::Batch(step, rank * rows, rows);
    return std::vector<Tensor>{x, y};
  };
  capture::CompileOptions options = {};
  fsdp::FullyShardModeOptions shard_options = {};
  bool run_eager = true;
  // When set, the compiled copy's batches (else `batch`'s).
  std::function<std::vector<Tensor>(int step, int rank, int world)> compiled_batch = nullptr;
  // This step is skipped by the eager copy; the compiled copy calls it expecting the step function to throw.
  int throw_step = -1;
};

// Per rank thread (the ranks run concurrently, a rank's copies one after the other): the step function throws while
// set; the step function's own choice for the guard test.
thread_local bool tl_throw_now = false;
thread_local bool tl_flag = false;

struct Out {
  std::vector<RankRun> eager, compiled;
  std::vector<int> captures;
  std::vector<std::string> reasons;  // rank 0's
  absl::Status status;
};

Out RunPlan(const Plan& su, const Where& where) {
  const int world = where.world;
  Out out;
  out.eager.resize(static_cast<std::size_t>(world));
  out.compiled.resize(static_cast<std::size_t>(world));
  out.captures.resize(static_cast<std::size_t>(world));
  out.status = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    const auto r = static_cast<std::size_t>(env.rank);
    const Generator g0 = env.context.generator;
    if (su.run_eager) {
      nn::GPT model(su.config, 1);
      std::unique_ptr<optim::Optimizer> opt = su.make_opt(model);
      if (su.prepare) {
        if (absl::Status s = su.prepare(model, *opt); !s.ok()) return s;
      }
      std::unique_ptr<sddp::DistributedDataParallel> ddp;
      if (world > 1) {
        auto made = sddp::DistributedDataParallel::create(model, env.group_ptr, {.reduce_buffer_size = 0});
        if (!made.ok()) return made.status();
        ddp = *std::move(made);
      }
      const Body body = su.make_body ? su.make_body(env.group_ptr) : su.body;
      for (int s = 0; s < su.steps; ++s) {
        if (s == su.throw_step) continue;
        if (su.before) su.before(s, model, *opt, nullptr);
        Tensor loss = body(model, *opt, su.batch(s, env.rank, world), s);
        out.eager[r].losses.push_back(static_cast<float>(loss.item()));
      }
      out.eager[r].values = gpt_tiny::Values(model);
    }
    env.context.generator = g0;
    nn::GPT model(su.config, 1);
    std::unique_ptr<optim::Optimizer> opt = su.make_opt(model);
    if (su.prepare) {
      if (absl::Status s = su.prepare(model, *opt); !s.ok()) return s;
    }
    std::shared_ptr<fsdp::FullyShardMode> shard_mode;
    capture::CompileOptions options = su.options;
    if (where.kind == Kind::replicate) options.parallel_mode = std::make_shared<sddp::ReplicateMode>(env.group_ptr);
    if (where.kind == Kind::fully_shard) {
      shard_mode = std::make_shared<fsdp::FullyShardMode>(env.group_ptr, su.shard_options);
      options.parallel_mode = shard_mode;
    }
    int current = 0;
    const Body body = su.make_body ? su.make_body(env.group_ptr) : su.body;
    capture::CompiledStep compiled = capture::compile(
        [&](const std::vector<Tensor>& b) { return body(model, *opt, b, current); }, model, *opt, options);
    for (int s = 0; s < su.steps; ++s) {
      current = s;
      if (su.before) su.before(s, model, *opt, &compiled);
      const std::vector<Tensor> batch = su.compiled_batch ? su.compiled_batch(s, env.rank, world) : su.batch(s, env.rank, world);
      if (s == su.throw_step) {
        compiled.invalidate();
        tl_throw_now = true;
        absl::StatusOr<Tensor> failed = compiled(batch);  // compile() turns the exception into a status
        tl_throw_now = false;
        if (failed.ok() || !absl::StrContains(failed.status().message(), "the step function failed")) {
          return absl::InternalError(absl::StrCat("the throwing call gave ", failed.status().ToString()));
        }
        continue;
      }
      absl::StatusOr<Tensor> loss = compiled(batch);
      if (!loss.ok()) return loss.status();
      out.compiled[r].losses.push_back(static_cast<float>(loss->item()));
      if (env.rank == 0) out.reasons.push_back(compiled.last_capture_reason());
    }
    out.captures[r] = compiled.captures();
    if (shard_mode) {
      if (absl::Status s = shard_mode->unshard_parameters(); !s.ok()) return s;
    }
    out.compiled[r].values = gpt_tiny::Values(model);
    return absl::OkStatus();
  });
  return out;
}

// Compiled equals eager: bitwise for one rank and replicate, within tol for fully shard (against eager DDP).
void ExpectEager(const Out& out, const Where& where, double tol = 2e-5) {
  ASSERT_TRUE(out.status.ok()) << out.status;
  const bool bitwise = where.kind != Kind::fully_shard;
  for (std::size_t r = 0; r < out.compiled.size(); ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    std::string at;
    if (bitwise) {
      EXPECT_EQ(out.compiled[r].losses, out.eager[r].losses);
      EXPECT_TRUE(Near(out.compiled[r].values, out.eager[r].values, 0.0, &at)) << "compiled vs eager, bitwise: " << at;
    } else {
      EXPECT_TRUE(Near({out.compiled[r].losses}, {out.eager[r].losses}, tol, &at)) << "losses: " << at;
      EXPECT_TRUE(Near(out.compiled[r].values, out.eager[r].values, tol, &at)) << "compiled vs eager: " << at;
    }
    if (r > 0) {
      EXPECT_TRUE(out.compiled[r].values == out.compiled[0].values) << "rank " << r << " differs";
    }
  }
}

std::vector<Where> OneAndReplicate() { return {{Kind::one_rank, 1}, {Kind::replicate, 2}, {Kind::replicate, 3}}; }

void LrSchedule(int step, nn::GPT&, optim::Optimizer& opt, capture::CompiledStep*) {
  opt.mutable_hyper(0).lr = 1e-3 * (1.0 + 0.5 * step);
}

// ---- clip_grad_norm ------------------------------------------------------------------------------------------------

Body ClipBody(double max_norm, double norm_type) {
  return [max_norm, norm_type](nn::GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& b, int) {
    Tensor loss = model.loss(b[0], b[1]);
    autograd::backward(loss);
    optim::clip_grad_norm(model.parameters(), max_norm, norm_type);
    EXPECT_TRUE(opt.step().ok());
    opt.zero_grad();
    return loss;
  };
}

TEST(CompileCombo2, ClipGradNormInsideTheStepEqualsEager) {
  for (const double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    for (const Where& w : OneAndReplicate()) {
      SCOPED_TRACE(absl::StrCat(Name(w), " norm ", norm_type));
      Plan su;
      su.make_opt = [](nn::GPT& m) { return std::make_unique<optim::Sgd>(m.parameters(), optim::Sgd::default_hyper()); };
      su.before = LrSchedule;
      su.body = ClipBody(norm_type == 2.0 ? 0.05 : 0.002, norm_type);
      const Out out = RunPlan(su, w);
      ExpectEager(out, w);
      EXPECT_EQ(out.captures[0], 1);
      // The clipping acted: without it the run ends elsewhere.
      Plan plain = su;
      plain.body = PlainBody;
      plain.run_eager = false;
      const Out unclipped = RunPlan(plain, w);
      ASSERT_TRUE(unclipped.status.ok());
      EXPECT_NE(unclipped.compiled[0].values, out.compiled[0].values) << "clipping had no effect: max_norm too big";
    }
  }
}

TEST(CompileCombo2, ClipGradNormUnderFullyShardIsAClearError) {
  Plan su;
  su.run_eager = false;
  su.body = ClipBody(0.05, 2.0);
  const Out out = RunPlan(su, {Kind::fully_shard, 2});
  ASSERT_FALSE(out.status.ok());
  EXPECT_THAT(out.status.message(), HasSubstr("clip_grad_norm"));
}

// ---- loss scaling ---------------------------------------------------------------------------------------------------

// optim::scale_grads writes the gradients in place untraced: the capture refuses it, naming it.
TEST(CompileCombo2, UnscalingByHandWithScaleGradsIsAClearError) {
  Plan su;
  su.run_eager = false;
  su.body = [](nn::GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& b, int) {
    Tensor loss = model.loss(b[0], b[1]);
    autograd::backward(autograd::scale(loss, 1024.f));
    optim::scale_grads(model.parameters(), 1.0 / 1024.0);
    EXPECT_TRUE(opt.step().ok());
    opt.zero_grad();
    return loss;
  };
  const Out out = RunPlan(su, {Kind::one_rank, 1});
  ASSERT_FALSE(out.status.ok());
  EXPECT_THAT(out.status.message(), HasSubstr("scale_grads"));
}

// A loss scaled by a power of two (no unscale: the lr is divided by the scale instead), its gradients' norm checked
// finite through the traced clip op (max_norm too big to clip): equals eager.
TEST(CompileCombo2, APowerOfTwoLossScaleWithAnLrCompensationEqualsEager) {
  for (const Where& w : OneAndReplicate()) {
    SCOPED_TRACE(Name(w));
    Plan su;
    su.make_opt = [](nn::GPT& m) { return std::make_unique<optim::Sgd>(m.parameters(), optim::Sgd::default_hyper()); };
    su.before = [](int step, nn::GPT&, optim::Optimizer& opt, capture::CompiledStep*) {
      opt.mutable_hyper(0).lr = 1e-2 / 1024.0 * (1 + step);
    };
    su.body = [](nn::GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& b, int) {
      Tensor loss = model.loss(b[0], b[1]);
      autograd::backward(autograd::scale(loss, 1024.f));
      const double norm = optim::clip_grad_norm(model.parameters(), 1e30, 2.0);
      EXPECT_TRUE(std::isfinite(norm));
      EXPECT_TRUE(opt.step().ok());
      opt.zero_grad();
      return loss;
    };
    ExpectEager(RunPlan(su, w), w);
  }
}

// sddp::ShardedGradScaler inside the compiled step: unscale() writes the gradients through raw pointers and agrees
// on found_inf with a host all_reduce, neither traced, so the capture is refused naming the scaler. Found by this
// audit: it ran and the replay stepped the scaled gradients (other parameters from the first call).
TEST(CompileCombo2, ShardedGradScalerInsideTheStepIsRefused) {
  for (const Where& w : std::vector<Where>{{Kind::one_rank, 1}, {Kind::replicate, 2}}) {
    SCOPED_TRACE(Name(w));
    Plan su;
    su.make_opt = [](nn::GPT& m) { return std::make_unique<optim::Sgd>(m.parameters(), optim::Sgd::default_hyper()); };
    su.make_body = [](const std::shared_ptr<comm::ProcessGroup>& group) -> Body {
      auto scaler = std::make_shared<sddp::ShardedGradScaler>(group, sddp::GradScalerOptions{.init_scale = 1024.0});
      return [scaler](nn::GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& b, int) {
        Tensor loss = model.loss(b[0], b[1]);
        autograd::backward(scaler->scale(loss));
        std::vector<Tensor> grads;
        for (const Tensor& p : model.parameters()) grads.push_back(p.grad());
        auto stepped = scaler->step(grads, [&] { return opt.step(); });
        EXPECT_TRUE(stepped.ok());
        scaler->update();
        opt.zero_grad();
        return loss;
      };
    };
    const Out out = RunPlan(su, w);
    EXPECT_EQ(out.status.code(), absl::StatusCode::kFailedPrecondition) << out.status;
    EXPECT_THAT(out.status.message(), HasSubstr("sddp::ShardedGradScaler")) << out.status;
  }
}

// ---- CompileOptions and FullyShardModeOptions x dropout x checkpointing x frozen ---------------------------------

Plan Harder() {
  Plan su;
  su.config.dropout = 0.1f;
  su.prepare = [](nn::GPT& m, optim::Optimizer&) {
    gpt_tiny::FreezeBlock0(m);
    return checkpoint_gpt::Checkpoint(m, checkpoint_gpt::Ckpt::blocks);
  };
  su.before = LrSchedule;
  return su;
}

TEST(CompileCombo2, CompileOptionsWithDropoutCheckpointingAndAFrozenBlockEqualEager) {
  for (const Where& w : OneAndReplicate()) {
    for (int variant = 0; variant < 3; ++variant) {
      SCOPED_TRACE(absl::StrCat(Name(w), " variant ", variant));
      Plan su = Harder();
      auto transforms = std::make_shared<int>(0);
      if (variant == 0) su.options.coalesce_bytes = 1 << 20;
      if (variant == 1) su.options.arena = false;
      if (variant == 2) {
        su.options.coalesce_bytes = 256;
        su.options.transform = [transforms](capture::StepGraph&) {
          ++*transforms;
          return absl::OkStatus();
        };
      }
      const Out out = RunPlan(su, w);
      ExpectEager(out, w);
      if (variant == 2) {
        EXPECT_EQ(*transforms, w.world);  // once per rank: one capture each
      }
    }
  }
}

// Bucketing, prefetch and keeping the last bucket move calls, never values: bitwise the default mode's result (and
// that within float rounding of eager DDP).
TEST(CompileCombo2, FullyShardModeOptionsWithDropoutCheckpointingAndAFrozenBlockAreBitwiseTheDefault) {
  for (const int world : {2, 3}) {
    const Where w{Kind::fully_shard, world};
    const Out base = RunPlan(Harder(), w);
    ExpectEager(base, w);
    struct V {
      std::int64_t bucket;
      int prefetch;
      bool reshard_last;
      std::int64_t coalesce;
      bool arena;
    };
    for (const V& v : std::vector<V>{{4096, 1, true, 0, true},
                                     {4096, 2, false, 1 << 20, true},
                                     {1 << 20, 1, false, 128, false},
                                     {0, 0, false, 0, false},
                                     {1 << 20, 0, true, 1 << 20, true}}) {
      SCOPED_TRACE(absl::StrCat("n", world, " bucket ", v.bucket, " prefetch ", v.prefetch, " reshard_last ",
                                v.reshard_last, " coalesce ", v.coalesce, " arena ", v.arena));
      Plan su = Harder();
      su.run_eager = false;
      su.shard_options = {.bucket_bytes = v.bucket, .prefetch = v.prefetch, .reshard_last_bucket_after_forward = v.reshard_last};
      su.options.coalesce_bytes = v.coalesce;
      su.options.arena = v.arena;
      const Out out = RunPlan(su, w);
      ASSERT_TRUE(out.status.ok()) << out.status;
      for (std::size_t r = 0; r < out.compiled.size(); ++r) {
        EXPECT_EQ(out.compiled[r].losses, base.compiled[r].losses) << "rank " << r;
        EXPECT_TRUE(out.compiled[r].values == base.compiled[r].values) << "rank " << r;
      }
    }
  }
}

// ---- the batch --------------------------------------------------------------------------------------------------

std::vector<Where> Three() { return {{Kind::one_rank, 1}, {Kind::replicate, 2}, {Kind::fully_shard, 2}}; }

// Odd steps pass two (x, y) pairs (half the rows each), even steps one: the number of batch tensors changes.
TEST(CompileCombo2, TheNumberOfBatchTensorsChangesBetweenCalls) {
  for (const Where& w : Three()) {
    SCOPED_TRACE(Name(w));
    Plan su;
    su.steps = 5;
    su.batch = [](int step, int rank, int world) {
      const int rows = gpt_tiny::kBatch / world;
      if (step % 2 == 0) {
        auto [x, y] = gpt_tiny::Batch(step, rank * rows, rows);
        return std::vector<Tensor>{x, y};
      }
      auto [x1, y1] = gpt_tiny::Batch(step, rank * rows, rows / 2);
      auto [x2, y2] = gpt_tiny::Batch(step, rank * rows + rows / 2, rows / 2);
      return std::vector<Tensor>{x1, y1, x2, y2};
    };
    su.body = [](nn::GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& b, int) {
      Tensor loss;
      for (std::size_t i = 0; i + 1 < b.size(); i += 2) {
        Tensor l = autograd::scale(model.loss(b[i], b[i + 1]), 2.f / static_cast<float>(b.size()));
        loss = loss.defined() ? autograd::add(loss, l) : l;
      }
      autograd::backward(loss);
      EXPECT_TRUE(opt.step().ok());
      opt.zero_grad();
      return loss;
    };
    const Out out = RunPlan(su, w);
    ExpectEager(out, w);
    EXPECT_EQ(out.captures[0], 5);
  }
}

// The compiled copy's batch tensors are views into a larger tensor (rows of the whole step's batch, at an offset):
// the same values as the eager copy's own tensors, so the same result bit for bit.
TEST(CompileCombo2, BatchTensorsThatAreViewsOfALargerTensor) {
  for (const Where& w : Three()) {
    SCOPED_TRACE(Name(w));
    Plan su;
    su.compiled_batch = [](int step, int rank, int world) {
      const int rows = gpt_tiny::kBatch / world;
      auto [x, y] = gpt_tiny::Batch(step, 0, gpt_tiny::kBatch);
      return std::vector<Tensor>{x.narrow0(rank * rows, rows), y.narrow0(rank * rows, rows)};
    };
    ExpectEager(RunPlan(su, w), w);
  }
}

// One pair of tensor objects per rank, rewritten in place (copy_) with each step's rows before the call: the replay
// reads the new values.
TEST(CompileCombo2, OneBatchTensorObjectRewrittenInPlaceBetweenCalls) {
  for (const Where& w : Three()) {
    SCOPED_TRACE(Name(w));
    Plan su;
    auto held = std::make_shared<std::vector<std::vector<Tensor>>>(static_cast<std::size_t>(w.world));
    su.compiled_batch = [held](int step, int rank, int world) {
      const int rows = gpt_tiny::kBatch / world;
      auto [x, y] = gpt_tiny::Batch(step, rank * rows, rows);
      std::vector<Tensor>& mine = (*held)[static_cast<std::size_t>(rank)];
      if (mine.empty()) {
        mine = {x, y};
      } else {
        mine[0].copy_(x);
        mine[1].copy_(y);
      }
      return mine;
    };
    const Out out = RunPlan(su, w);
    ExpectEager(out, w);
    EXPECT_EQ(out.captures[0], 1);
  }
}

// ---- a model with buffers -------------------------------------------------------------------------------------------

TEST(CompileCombo2, BatchNormRunningStatisticsAreRefusedAndNothingIsUpdated) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Generator gen(3);
  nn::Sequential net;
  net.push_back(std::make_shared<nn::Linear>(4, 5, gen));
  net.push_back(std::make_shared<nn::BatchNorm1d>(5));
  optim::Sgd opt(net.parameters(), {.lr = 0.1});
  const Tensor x = Tensor::uniform({6, 4}, gen, -1.f, 1.f);
  const Tensor y = Tensor::from_int64({0, 1, 2, 3, 4, 0}, {6});
  capture::CompiledStep compiled = capture::compile(
      [&](const std::vector<Tensor>& b) {
        Tensor loss = autograd::cross_entropy(net(b[0]), b[1]);
        autograd::backward(loss);
        EXPECT_TRUE(opt.step().ok());
        opt.zero_grad();
        return loss;
      },
      net, opt);
  std::vector<std::vector<float>> before;
  for (const auto& [n, b] : net.named_buffers()) before.push_back(b.to_vector());
  const std::vector<std::vector<float>> params_before = gpt_tiny::Values(net);
  ASSERT_EQ(before.size(), 2u);
  for (int call = 0; call < 2; ++call) {
    absl::StatusOr<Tensor> loss = compiled({x, y});
    ASSERT_FALSE(loss.ok());
    EXPECT_THAT(loss.status().message(), HasSubstr("batch_norm"));
  }
  std::vector<std::vector<float>> after;
  for (const auto& [n, b] : net.named_buffers()) after.push_back(b.to_vector());
  EXPECT_EQ(after, before) << "a refused capture updated the running statistics";
  EXPECT_EQ(gpt_tiny::Values(net), params_before) << "a refused capture changed the parameters";
  for (const Tensor& p : net.parameters()) EXPECT_FALSE(p.grad().defined()) << "a refused capture left gradients";
}

// ---- the step function throwing ------------------------------------------------------------------------------------

// Step 2's call recaptures (invalidate()) and the step function throws after the forward: the call changes nothing
// (the eager copy skips that step) and the next calls train as eager.
TEST(CompileCombo2, TheStepFunctionThrowingInARecaptureThenTheNextCall) {
  for (const Where& w : Three()) {
    SCOPED_TRACE(Name(w));
    Plan su;
    su.steps = 5;
    su.throw_step = 2;
    su.body = [](nn::GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& b, int) {
      Tensor loss = model.loss(b[0], b[1]);
      if (tl_throw_now) throw std::runtime_error("the step function failed");
      autograd::backward(loss);
      EXPECT_TRUE(opt.step().ok());
      opt.zero_grad();
      return loss;
    };
    const Out out = RunPlan(su, w);
    ExpectEager(out, w);
  }
}

// ---- guard and invalidate() ----------------------------------------------------------------------------------------

TEST(CompileCombo2, AGuardFlippingBackAndForthAndInvalidateBeforeEveryCall) {
  for (const Where& w : Three()) {
    for (const bool use_invalidate : {false, true}) {
      SCOPED_TRACE(absl::StrCat(Name(w), use_invalidate ? " invalidate" : " guard"));
      Plan su;
      su.steps = 6;
      su.config.dropout = 0.1f;
      su.body = [](nn::GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& b, int) {
        Tensor loss = model.loss(b[0], b[1]);
        if (tl_flag) loss = autograd::scale(loss, 0.25f);  // a choice of the step function's own
        autograd::backward(loss);
        EXPECT_TRUE(opt.step().ok());
        opt.zero_grad();
        return loss;
      };
      su.before = [use_invalidate](int step, nn::GPT&, optim::Optimizer&, capture::CompiledStep* c) {
        tl_flag = (step % 2 == 1);
        if (c != nullptr && use_invalidate) c->invalidate();
      };
      if (!use_invalidate) su.options.guard = [] { return absl::StrCat(tl_flag); };
      const Out out = RunPlan(su, w);
      ExpectEager(out, w);
      EXPECT_EQ(out.captures[0], 6);
    }
  }
}

// ---- hyper-parameters changed between calls ------------------------------------------------------------------------

TEST(CompileCombo2, AdamBetasEpsWeightDecayAndLrChangedEveryCall) {
  for (const Where& w : Three()) {
    SCOPED_TRACE(Name(w));
    Plan su;
    su.steps = 5;
    su.make_opt = [](nn::GPT& m) { return std::make_unique<optim::Adam>(m.parameters()); };
    su.before = [](int step, nn::GPT&, optim::Optimizer& opt, capture::CompiledStep*) {
      optim::HyperParams& h = opt.mutable_hyper(0);
      h.lr = 1e-3 * (1 + step);
      h.beta1 = step % 2 == 0 ? 0.9 : 0.5;
      h.beta2 = step % 2 == 0 ? 0.999 : 0.9;
      h.eps = step % 2 == 0 ? 1e-8 : 1e-3;
      h.weight_decay = step % 2 == 0 ? 0.0 : 0.1;
    };
    const Out out = RunPlan(su, w);
    ExpectEager(out, w);
    EXPECT_EQ(out.captures[0], 1);
    // The changes acted: the same run with fixed hyper-parameters ends elsewhere.
    Plan fixed = su;
    fixed.before = nullptr;
    fixed.run_eager = false;
    const Out other = RunPlan(fixed, w);
    ASSERT_TRUE(other.status.ok());
    EXPECT_NE(other.compiled[0].values, out.compiled[0].values);
  }
}

// SGD without momentum captured; momentum (then Nesterov, dampening) turned on between calls: one rank and replicate
// equal eager; the fully-shard mode either equals eager or fails saying the state was made for a shard.
TEST(CompileCombo2, SgdMomentumTurnedOnAfterTheCapture) {
  for (const Where& w : Three()) {
    SCOPED_TRACE(Name(w));
    Plan su;
    su.steps = 6;
    su.make_opt = [](nn::GPT& m) { return std::make_unique<optim::Sgd>(m.parameters(), optim::HyperParams{.lr = 0.05}); };
    su.before = [](int step, nn::GPT&, optim::Optimizer& opt, capture::CompiledStep*) {
      optim::HyperParams& h = opt.mutable_hyper(0);
      if (step == 2) h.momentum = 0.9;
      if (step == 4) {
        h.nesterov = true;
        h.weight_decay = 0.01;
      }
    };
    const Out out = RunPlan(su, w);
    if (w.kind == Kind::fully_shard && !out.status.ok()) {
      EXPECT_THAT(out.status.message(), HasSubstr("shard")) << out.status;
      continue;
    }
    ExpectEager(out, w);
  }
}

}  // namespace
}  // namespace shardkit::compile_combo
