// An audit of capture::compile in combination (one rank; sddp::ReplicateMode and fsdp::FullyShardMode at N = 2, 3):
// each compiled run against the eager one (bit for bit where compile.h / replicate_mode.h promise it) and against
// single-rank training (compile_combo_harness.h), for what the other capture tests leave out:
//   * dropout in the model, with and without checkpointed blocks, under the parallel modes;
//   * a block frozen from the start; frozen, then unfrozen between calls (recaptures), with zero_grad set_to_none
//     true or false;
//   * SGD with momentum (and Nesterov, weight decay), Adam, AdamW with weight decay, compiled from the first step;
//   * param groups with their own lr and weight decay, an lr schedule and a weight decay changed between calls;
//     add_param_group between calls;
//   * zero_grad(set_to_none = false) at the end or the start of the step, across a recapture; two micro-batches
//     accumulated in one compiled step;
//   * the batch shape changing between calls and back;
//   * train() / eval() toggled between calls with dropout;
//   * a head used in some calls only (tests/testing/two_head_net.h).
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/optim/lr_schedule.h"
#include "common/optim/sgd.h"
#include "gmock/gmock.h"
#include "tests/common/capture/compile_combo_harness.h"
#include "tests/testing/checkpoint_gpt.h"
#include "tests/testing/two_head_net.h"

namespace shardkit::compile_combo {
namespace {

using ::testing::HasSubstr;

class CompileCombo : public ::testing::TestWithParam<Where> {};

std::vector<Tensor> ParamsNamed(nn::Module& m, const std::function<bool(const std::string&)>& pick) {
  std::vector<Tensor> out;
  for (const auto& [n, p] : m.named_parameters()) {
    if (pick(n)) out.push_back(p);
  }
  return out;
}

// ---- dropout, with and without checkpointing -------------------------------------------------------------------

// Dropout 0.1 draws each rank's masks from its own Generator: the compiled step draws what the eager one does, in
// the capture's own call and in every replay, with checkpointed blocks (the recompute draws the forward's masks) or
// without.
TEST_P(CompileCombo, DropoutWithAndWithoutCheckpointedBlocks) {
  for (bool ckpt : {false, true}) {
    SCOPED_TRACE(ckpt ? "checkpointed blocks" : "no checkpointing");
    Scenario sc;
    sc.config.dropout = 0.1f;
    if (ckpt) {
      sc.prepare = [](nn::GPT& m, optim::Optimizer&) { return checkpoint_gpt::Checkpoint(m, checkpoint_gpt::Ckpt::blocks); };
    }
    const Result res = RunScenario(sc, GetParam());
    ExpectAgrees(res, GetParam());
    // Dropout acted: the loss differs from the same run without it.
    Scenario plain;
    const Result without = RunScenario(plain, GetParam());
    ASSERT_TRUE(without.status.ok());
    EXPECT_NE(res.compiled[0].losses[1], without.compiled[0].losses[1]);
    EXPECT_EQ(res.captures[0], 1);
  }
}

// ---- frozen parameters ------------------------------------------------------------------------------------------

TEST_P(CompileCombo, ABlockFrozenFromTheStartIsNeverStepped) {
  Scenario sc;
  sc.prepare = [](nn::GPT& m, optim::Optimizer&) {
    gpt_tiny::FreezeBlock0(m);
    return absl::OkStatus();
  };
  const Result res = RunScenario(sc, GetParam());
  ExpectAgrees(res, GetParam());
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT initial(sc.config, 1);
  const auto before = gpt_tiny::Values(initial);
  const std::size_t q = IndexOf(initial, "blocks.0.attn.qkv.weight");
  const std::size_t h = IndexOf(initial, "ln_f.weight");
  for (const RankRun& c : res.compiled) {
    EXPECT_EQ(c.values[q], before[q]) << "a frozen parameter moved";
    EXPECT_NE(c.values[h], before[h]) << "a trainable parameter did not move";
  }
  EXPECT_EQ(res.captures[0], 1);
}

// The tied embedding (GPT's wte, which lm_head shares) frozen from the start: neither use steps it, the rest trains.
TEST_P(CompileCombo, TheTiedEmbeddingFrozenFromTheStart) {
  Scenario sc;
  sc.prepare = [](nn::GPT& m, optim::Optimizer&) {
    if (!m.lm_head->weight().is_same(m.wte->weight())) return absl::InternalError("GPT's lm_head is not tied to wte");
    m.wte->set_requires_grad(false);
    return absl::OkStatus();
  };
  const Result res = RunScenario(sc, GetParam());
  ExpectAgrees(res, GetParam());
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT initial(sc.config, 1);
  const auto before = gpt_tiny::Values(initial);
  const std::size_t wte = IndexOf(initial, "wte.weight");
  const std::size_t wpe = IndexOf(initial, "wpe.weight");
  for (const RankRun& c : res.compiled) {
    EXPECT_EQ(c.values[wte], before[wte]) << "the frozen tied embedding moved";
    EXPECT_NE(c.values[wpe], before[wpe]);
  }
}

// Block 0 frozen before call 2, unfrozen before call 4: each change recaptures. With set_to_none false the frozen
// block keeps a zeroed gradient, which AdamW steps eagerly (weight decay, the moments): the compiled step must too.
Scenario FreezeThenUnfreeze(bool set_to_none) {
  Scenario sc;
  sc.steps = 6;
  sc.set_to_none = set_to_none;
  sc.before = [](int s, nn::GPT& m, optim::Optimizer&, Copy, fsdp::FullyShardMode*) {
    if (s == 2) gpt_tiny::FreezeBlock0(m);
    if (s == 4) (*m.blocks)[0]->set_requires_grad(true);
    return absl::OkStatus();
  };
  return sc;
}

TEST_P(CompileCombo, FrozenThenUnfrozenBetweenCallsRecapturesAndTrainsAsEager) {
  const Result res = RunScenario(FreezeThenUnfreeze(/*set_to_none=*/true), GetParam());
  ExpectAgrees(res, GetParam());
  ASSERT_TRUE(res.status.ok());
  EXPECT_EQ(res.captures[0], 3);
  EXPECT_EQ(res.reasons[2], "the set of parameters that require grad changed");
  EXPECT_EQ(res.reasons[4], "the set of parameters that require grad changed");
}

// The same with zero_grad(set_to_none = false) ending the step: the recapture at call 2 starts from the zeroed
// gradients the previous step left (Note [gradients kept between steps] in common/capture/compile.cc). On one rank
// the frozen block's zero gradients are stepped as eagerly; the parallel modes reduce only gradients the backward
// made, so they refuse the frozen block's kept zero gradient, naming the cause (an audit found the recapture failing
// with a message that named no gradient).
TEST_P(CompileCombo, FrozenThenUnfrozenWithZeroedGradients) {
  const Result res = RunScenario(FreezeThenUnfreeze(/*set_to_none=*/false), GetParam());
  if (GetParam().kind != Kind::one_rank) {
    EXPECT_EQ(res.status.code(), absl::StatusCode::kInvalidArgument) << res.status;
    EXPECT_THAT(std::string(res.status.message()), ::testing::HasSubstr("zero_grad(set_to_none = false) kept"));
    return;
  }
  ExpectAgrees(res, GetParam());
  ASSERT_TRUE(res.status.ok());
  EXPECT_EQ(res.captures[0], 3);
}

// ---- optimizers -------------------------------------------------------------------------------------------------

struct OptCase {
  std::string name;
  std::function<std::unique_ptr<optim::Optimizer>(nn::GPT&)> make;
};

// Each optimizer compiled from the very first step (its state created during the capture's dry run): plain SGD,
// Adam (L2 weight decay), AdamW (decoupled weight decay). SGD with momentum: SgdMomentumCompiledFromTheFirstStep.
TEST_P(CompileCombo, EachOptimizerCompiledFromTheFirstStep) {
  const std::vector<OptCase> cases = {
      {"sgd_plain", [](nn::GPT& m) { return std::make_unique<optim::Sgd>(m.parameters(), optim::HyperParams{.lr = 0.05}); }},
      {"adam", [](nn::GPT& m) {
         // eps 1e-6: with the default 1e-8, elements whose gradient is near 0 step by about +-lr whatever its sign's
         // rounding, too sensitive for the comparison with single-rank training.
         return std::make_unique<optim::Adam>(m.parameters(),
                                              optim::HyperParams{.lr = 1e-3, .eps = 1e-6, .weight_decay = 0.01});
       }},
      {"adamw_decay", [](nn::GPT& m) {
         optim::HyperParams h = optim::AdamW::default_hyper();
         h.lr = 3e-3;
         h.weight_decay = 0.1;
         return std::make_unique<optim::AdamW>(m.parameters(), h);
       }},
  };
  for (const OptCase& c : cases) {
    SCOPED_TRACE(c.name);
    Scenario sc;
    sc.make_opt = c.make;
    const Result res = RunScenario(sc, GetParam());
    ExpectAgrees(res, GetParam());
  }
}

// SGD's momentum buffer is created lazily by its first update (sgd.h), which the capture's dry run does not apply.
TEST_P(CompileCombo, SgdMomentumCompiledFromTheFirstStep) {
  for (bool nesterov : {false, true}) {
    SCOPED_TRACE(nesterov ? "nesterov, weight decay" : "momentum");
    Scenario sc;
    sc.make_opt = [nesterov](nn::GPT& m) {
      return std::make_unique<optim::Sgd>(m.parameters(),
                                          optim::HyperParams{.lr = 0.05, .weight_decay = nesterov ? 0.01 : 0.0,
                                                             .momentum = 0.9, .nesterov = nesterov});
    };
    const Result res = RunScenario(sc, GetParam());
    ExpectAgrees(res, GetParam());
  }
}

// Momentum created by an eager step before compiling (the buffer then is an input of the step): trains as eager.
TEST_P(CompileCombo, SgdMomentumAfterAnEagerFirstStep) {
  Scenario sc;
  sc.make_opt = [](nn::GPT& m) {
    return std::make_unique<optim::Sgd>(m.parameters(), optim::HyperParams{.lr = 0.05, .momentum = 0.9});
  };
  // One eager step on every copy before anything else (every rank's whole rows: only rank-equal values matter).
  sc.prepare = [](nn::GPT& m, optim::Optimizer& opt) {
    auto [x, y] = gpt_tiny::Batch(100, 0, 6);
    autograd::backward(m.loss(x, y));
    if (absl::Status s = opt.step(); !s.ok()) return s;
    opt.zero_grad();
    return absl::OkStatus();
  };
  const Where w = GetParam();
  const Result res = RunScenario(sc, w);
  ExpectAgrees(res, w);
}

// ---- param groups, lr schedules, add_param_group -----------------------------------------------------------------

// Two groups (the blocks: lr 2e-3, weight decay 0.1; the rest: lr 5e-4, no decay); before every call a warm-up
// cosine schedule sets each group's lr, and call 2 changes the blocks' weight decay: the replay reads the group's
// hyper-parameters as they are when it runs.
TEST_P(CompileCombo, ParamGroupsAndAScheduleChangedBetweenCalls) {
  Scenario sc;
  sc.steps = 5;
  sc.make_opt = [](nn::GPT& m) {
    auto opt = std::make_unique<optim::AdamW>();
    optim::HyperParams blocks = optim::AdamW::default_hyper(), rest = optim::AdamW::default_hyper();
    blocks.lr = 2e-3;
    blocks.weight_decay = 0.1;
    rest.lr = 5e-4;
    rest.weight_decay = 0.0;
    EXPECT_TRUE(opt->add_param_group({ParamsNamed(m, [](const std::string& n) { return absl::StartsWith(n, "blocks."); }),
                                      blocks})
                    .ok());
    EXPECT_TRUE(opt->add_param_group({ParamsNamed(m, [](const std::string& n) { return !absl::StartsWith(n, "blocks."); }),
                                      rest})
                    .ok());
    return opt;
  };
  sc.before = [](int s, nn::GPT&, optim::Optimizer& opt, Copy, fsdp::FullyShardMode*) {
    const double base[2] = {2e-3, 5e-4};
    for (std::size_t g = 0; g < 2; ++g) opt.mutable_hyper(g).lr = base[g] * optim::warmup_cosine_factor(s, 2, 5, 0.1);
    if (s == 2) opt.mutable_hyper(0).weight_decay = 0.5;
    return absl::OkStatus();
  };
  const Result res = RunScenario(sc, GetParam());
  ExpectAgrees(res, GetParam());
  EXPECT_EQ(res.captures[0], 1);
}

// The optimizer starts without the final LayerNorm (whose parameters still require grad: they get gradients but
// no update); before call 2 add_param_group hands them over with lr 1e-2. Eagerly the gradients the optimizer never
// zeroed have added up over calls 0 to 2 and the next step() updates them with that sum, which a replay (whose
// gradients are values of one call) cannot reproduce: the recapture the new group causes refuses the step, naming
// the kept gradient (Note [gradients kept between steps] in common/capture/compile.cc). An audit found the new group
// silently never stepped (no recapture).
TEST_P(CompileCombo, AddParamGroupBetweenCalls) {
  Scenario sc;
  auto is_ln_f = [](const std::string& n) { return absl::StartsWith(n, "ln_f."); };
  sc.make_opt = [is_ln_f](nn::GPT& m) {
    return std::make_unique<optim::AdamW>(ParamsNamed(m, [&](const std::string& n) { return !is_ln_f(n); }));
  };
  sc.before = [is_ln_f](int s, nn::GPT& m, optim::Optimizer& opt, Copy, fsdp::FullyShardMode*) {
    if (s != 2) return absl::OkStatus();
    optim::HyperParams h = optim::AdamW::default_hyper();
    h.lr = 1e-2;
    return opt.add_param_group({ParamsNamed(m, is_ln_f), h});
  };
  const Result res = RunScenario(sc, GetParam());
  EXPECT_EQ(res.status.code(), absl::StatusCode::kFailedPrecondition) << res.status;
  EXPECT_THAT(std::string(res.status.message()), ::testing::HasSubstr("the gradient of parameter 'ln_f."));
  EXPECT_THAT(std::string(res.status.message()), ::testing::HasSubstr("kept from before the step with values"));
}

// Progressive unfreezing, the usual reason to add a group: block 0 frozen and left out of the optimizer; before
// call 2 it is unfrozen and added as a group of its own (the trainable set changed: a recapture).
TEST_P(CompileCombo, UnfreezeAndAddParamGroupBetweenCalls) {
  Scenario sc;
  auto in_block0 = [](const std::string& n) { return absl::StartsWith(n, "blocks.0."); };
  sc.make_opt = [in_block0](nn::GPT& m) {
    return std::make_unique<optim::AdamW>(ParamsNamed(m, [&](const std::string& n) { return !in_block0(n); }));
  };
  sc.prepare = [](nn::GPT& m, optim::Optimizer&) {
    gpt_tiny::FreezeBlock0(m);
    return absl::OkStatus();
  };
  sc.before = [in_block0](int s, nn::GPT& m, optim::Optimizer& opt, Copy, fsdp::FullyShardMode*) {
    if (s != 2) return absl::OkStatus();
    (*m.blocks)[0]->set_requires_grad(true);
    optim::HyperParams h = optim::AdamW::default_hyper();
    h.lr = 1e-2;
    return opt.add_param_group({ParamsNamed(m, in_block0), h});
  };
  const Result res = RunScenario(sc, GetParam());
  ExpectAgrees(res, GetParam());
  if (res.status.ok()) {
      EXPECT_EQ(res.captures[0], 2);
    }
}

// ---- zeroing, accumulation -------------------------------------------------------------------------------------

// zero_grad(set_to_none = false) at the end of the step (the gradients outlive it, zeroed) or at its start (the
// zeroing reads the last step's gradients), with the batch shape changing at call 2 and back at call 4: each
// recapture runs the step eagerly again over gradients left by the previous capture or replay.
Scenario ZeroedAcrossRecaptures(bool zero_first) {
  Scenario sc;
  sc.steps = 5;
  sc.set_to_none = false;
  sc.zero_first = zero_first;
  sc.total_rows = [](int s) { return s == 2 || s == 3 ? gpt_tiny::kBatch / 2 : gpt_tiny::kBatch; };
  return sc;
}

TEST_P(CompileCombo, ZeroGradFirstKeepingGradientsAcrossRecaptures) {
  const Result res = RunScenario(ZeroedAcrossRecaptures(/*zero_first=*/true), GetParam());
  ExpectAgrees(res, GetParam());
  ASSERT_TRUE(res.status.ok());
  EXPECT_EQ(res.captures[0], 3);
}

// A smaller batch at call 2 (the last batch of an epoch, say) recaptures; the step ends in zero_grad(false).
TEST_P(CompileCombo, ZeroGradLastKeepingGradientsAcrossRecaptures) {
  const Result res = RunScenario(ZeroedAcrossRecaptures(/*zero_first=*/false), GetParam());
  ExpectAgrees(res, GetParam());
  ASSERT_TRUE(res.status.ok());
  EXPECT_EQ(res.captures[0], 3);
}

// Two micro-batches, each with its backward, accumulated into one update inside the compiled step: the mode
// reduces after the last accumulation (eager DDP: no_sync around the first); also with zero_grad first and
// set_to_none false.
TEST_P(CompileCombo, TwoMicroBatchesAccumulatedInOneStep) {
  for (bool zero_first : {false, true}) {
    SCOPED_TRACE(zero_first ? "zero_grad(false) first" : "zero_grad() last");
    Scenario sc;
    sc.micro = 2;
    sc.zero_first = zero_first;
    sc.set_to_none = !zero_first;
    const Result res = RunScenario(sc, GetParam());
    ExpectAgrees(res, GetParam());
    if (!res.status.ok()) continue;
    EXPECT_EQ(res.captures[0], 1);
    // The gradients are reduced once per step, not once per micro-batch: as many bytes as with one micro-batch.
    if (GetParam().kind != Kind::one_rank) {
      Scenario one;
      const Result single = RunScenario(one, GetParam());
      ASSERT_TRUE(single.status.ok()) << single.status;
      for (comm::CollectiveKind k : {comm::CollectiveKind::all_reduce, comm::CollectiveKind::reduce_scatter}) {
        EXPECT_EQ(res.last_call.of(k).bytes_sent, single.last_call.of(k).bytes_sent);
        EXPECT_EQ(res.last_call.of(k).calls, single.last_call.of(k).calls);
      }
      EXPECT_GT(res.last_call.total_sent(), 0);
    }
  }
}

// ---- batch shape -------------------------------------------------------------------------------------------------

// 24 rows, then 12 (a recapture), then 24 again (another: no graph is kept per shape) and 12: every call equals
// eager.
TEST_P(CompileCombo, TheBatchShapeChangesAndBack) {
  Scenario sc;
  sc.steps = 6;
  sc.total_rows = [](int s) { return s == 2 || s == 3 || s == 5 ? gpt_tiny::kBatch / 2 : gpt_tiny::kBatch; };
  const Result res = RunScenario(sc, GetParam());
  ExpectAgrees(res, GetParam());
  if (!res.status.ok()) return;
  EXPECT_EQ(res.captures[0], 4);
  EXPECT_THAT(res.reasons[2], HasSubstr("batch tensor 0 is i64["));
  EXPECT_THAT(res.reasons[4], HasSubstr("batch tensor 0 is i64["));
  EXPECT_EQ(res.reasons[3], res.reasons[2]);  // call 3 replayed call 2's capture
}

// ---- train / eval ------------------------------------------------------------------------------------------------

// Dropout 0.1; eval() before call 2, train() again before call 4: in eval the eager step draws no masks (dropout is
// the identity) and the compiled one must not either.
TEST_P(CompileCombo, TrainAndEvalToggledBetweenCalls) {
  Scenario sc;
  sc.steps = 6;
  sc.config.dropout = 0.1f;
  sc.before = [](int s, nn::GPT& m, optim::Optimizer&, Copy, fsdp::FullyShardMode*) {
    if (s == 2) m.eval();
    if (s == 4) m.train();
    return absl::OkStatus();
  };
  const Result res = RunScenario(sc, GetParam());
  ExpectAgrees(res, GetParam());
}

// ---- a head used in some calls only --------------------------------------------------------------------------------

using two_head::HeadInput;
using two_head::TwoHeadNet;

// Head b in the loss in calls 0, 1 and 4 only (use_b set the same on every rank). Eagerly, a step without b leaves b
// without gradient, and AdamW does not move it.
bool UseB(int step) { return step < 2 || step == 4; }

// One rank on every rank's inputs (the mean of their losses).

std::vector<std::vector<float>> HeadReference(int world, int steps) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  optim::AdamW opt(net.parameters());
  for (int s = 0; s < steps; ++s) {
    net.use_b = UseB(s);
    opt.zero_grad();
    Tensor loss = net(HeadInput(s, 0));
    for (int r = 1; r < world; ++r) loss = autograd::add(loss, net(HeadInput(s, r)));
    autograd::backward(autograd::scale(loss, 1.f / static_cast<float>(world)));
    EXPECT_TRUE(opt.step().ok());
  }
  return gpt_tiny::Values(net);
}

// Compiled (captured in call 0, with b) on `world` ranks, the step's own branch (use_b) named in
// CompileOptions::guard (Note [recapture]: the compiled step cannot see it otherwise): every rank ends where the
// reference does. Found by an audit: without a guard the replay kept training b, and nothing said so.
TEST_P(CompileCombo, AHeadUsedInSomeCallsOnly) {
  constexpr int kSteps = 5;
  const Where w = GetParam();
  const auto want = HeadReference(w.world, kSteps);
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(w.world));
  absl::Status st = comm::RunRanks(w.world, [&](comm::RankEnv& env) -> absl::Status {
    TwoHeadNet net(3);
    optim::AdamW opt(net.parameters());
    std::shared_ptr<capture::ParallelMode> mode;
    std::shared_ptr<fsdp::FullyShardMode> shard_mode;
    if (w.kind == Kind::replicate) mode = std::make_shared<sddp::ReplicateMode>(env.group_ptr);
    if (w.kind == Kind::fully_shard) mode = shard_mode = std::make_shared<fsdp::FullyShardMode>(env.group_ptr);
    capture::CompiledStep compiled = capture::compile(
        [&](const std::vector<Tensor>& b) {
          Tensor loss = net(b[0]);
          autograd::backward(loss);
          EXPECT_TRUE(opt.step().ok());
          opt.zero_grad();
          return loss;
        },
        net, opt, {.parallel_mode = mode, .guard = [&] { return std::string(net.use_b ? "b" : "no b"); }});
    for (int s = 0; s < kSteps; ++s) {
      net.use_b = UseB(s);
      absl::StatusOr<Tensor> loss = compiled({HeadInput(s, env.rank)});
      if (!loss.ok()) return loss.status();
    }
    if (shard_mode) {
      if (absl::Status s = shard_mode->unshard_parameters(); !s.ok()) return s;
    }
    got[static_cast<std::size_t>(env.rank)] = gpt_tiny::Values(net);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Modes, CompileCombo, ::testing::ValuesIn(AllWheres()),
                         [](const auto& info) { return Name(info.param); });

}  // namespace
}  // namespace shardkit::compile_combo
