// API misuse of fully_shard and FSDPModule (error-policy audit, DESIGN.md section 7): every misuse ends in a
// clear Status / FsdpError naming its cause on every rank, in bounded time, and where the documentation says the
// module recovers it trains afterwards exactly as a run without the misuse. Where a rank might wait, the unit's
// FullyShardOptions::timeout (or the world's default) is a second or two.
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "common/autograd/grad_mode.h"
#include "common/autograd/hooks.h"
#include "common/autograd/ops/reduce.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/layers.h"
#include "fsdp/fully_shard.h"
#include "gmock/gmock.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;
using ::testing::HasSubstr;

using Values3 = std::vector<std::vector<std::vector<float>>>;

// The status of `fn`, an FsdpError / StatusError thrown by it included.
absl::Status Caught(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const autograd::StatusError& e) {
    return e.status();
  }
  return absl::OkStatus();
}

// Trains GPT-tiny (every block a unit) for `steps` steps on 2 ranks; `misuse(model, env, step)` runs before each
// step (and may install hooks). Returns every rank's final parameters.
Values3 Train(int steps, const std::function<void(nn::GPT&, comm::RankEnv&, int)>& misuse = nullptr) {
  Values3 got(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    const int rows = kBatch / 2;
    for (int step = 0; step < steps; ++step) {
      if (misuse) misuse(model, env, step);
      auto [x, y] = Batch(step, env.rank * rows, rows);
      (*opt)->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

const Values3& Clean() {
  static const Values3 clean = Train(3);
  return clean;
}

FSDPModule Unit(nn::Module& m) { return *state_of(m); }
nn::Module& Block(nn::GPT& model, int i) { return *(*model.blocks)[static_cast<std::size_t>(i)]; }

// ---- FSDPModule methods in the wrong state or twice ----------------------------------------------------------

// An async unshard waited twice, one never waited, a synchronous unshard repeated, and a default handle: all fine,
// and training goes on as without them.
TEST(FsdpMisuse, UnshardHandlesWaitedTwiceOrNeverThenTrainsAsClean) {
  const Values3 got = Train(3, [](nn::GPT& model, comm::RankEnv&, int step) {
    if (step != 1) return;
    EXPECT_TRUE(UnshardHandle().wait().ok());
    auto h = Unit(Block(model, 1)).unshard(/*async_op=*/true);
    ASSERT_TRUE(h.ok()) << h.status();
    EXPECT_TRUE(h->wait().ok());
    EXPECT_TRUE(h->wait().ok());  // twice: a no-op
    auto never = Unit(Block(model, 2)).unshard(/*async_op=*/true);  // the forward finishes it
    ASSERT_TRUE(never.ok()) << never.status();
    EXPECT_TRUE(Unit(Block(model, 0)).unshard().ok());
    EXPECT_TRUE(Unit(Block(model, 0)).unshard().ok());  // already unsharded: nothing to do
  });
  EXPECT_EQ(got, Clean());
}

// summon_full_params twice, on a block and then on the root (nesting), reshard of one block, then of all, and
// again: fine, and training goes on as without them.
TEST(FsdpMisuse, SummonNestedAndReshardRepeatedThenTrainsAsClean) {
  const Values3 got = Train(3, [](nn::GPT& model, comm::RankEnv&, int step) {
    if (step != 1) return;
    FSDPModule root = Unit(model), b1 = Unit(Block(model, 1));
    EXPECT_TRUE(b1.summon_full_params().ok());
    EXPECT_TRUE(root.summon_full_params().ok());
    EXPECT_TRUE(root.summon_full_params().ok());
    EXPECT_EQ(b1.training_state(), TrainingState::summoned);
    EXPECT_TRUE(b1.reshard().ok());
    EXPECT_EQ(b1.training_state(), TrainingState::idle);
    EXPECT_TRUE(root.reshard(/*recurse=*/true).ok());
    EXPECT_TRUE(root.reshard(/*recurse=*/true).ok());
    EXPECT_EQ(root.training_state(), TrainingState::idle);
  });
  EXPECT_EQ(got, Clean());
}

// summon / reshard / unshard inside a forward or a backward: FailedPrecondition naming the state, the same on
// every rank (nothing is communicated), and the step that saw them ends as a clean one.
TEST(FsdpMisuse, SummonReshardAndUnshardInsideAPassAreRefused) {
  std::vector<std::vector<autograd::HookHandle>> hooks_of(2);  // per rank: the ranks are threads
  std::vector<std::vector<absl::Status>> seen(2);
  const Values3 got = Train(3, [&](nn::GPT& model, comm::RankEnv& env, int step) {
    auto& hooks = hooks_of[static_cast<std::size_t>(env.rank)];
    if (step == 1) {
      hooks.clear();
      return;
    }
    if (step != 0) return;
    auto& mine = seen[static_cast<std::size_t>(env.rank)];
    hooks.push_back(Block(model, 0).register_forward_pre_hook([&model, &mine, &hooks](nn::Module&, const nn::TensorList&)
                                                                 -> std::optional<nn::TensorList> {
      mine.push_back(Unit(model).summon_full_params());
      mine.push_back(Unit(Block(model, 0)).unshard().status());
      return std::nullopt;
    }));
    hooks.push_back(Block(model, 1).register_forward_hook(
        [&model, &mine, &hooks](nn::Module&, const nn::TensorList&, const nn::TensorList& out) -> std::optional<nn::TensorList> {
          if (!out[0].requires_grad()) return std::nullopt;
          hooks.push_back(autograd::register_hook(out[0], [&model, &mine](const Tensor&) -> std::optional<Tensor> {
            mine.push_back(Unit(model).summon_full_params());
            mine.push_back(Unit(model).reshard(/*recurse=*/true));
            return std::nullopt;
          }));
          return std::nullopt;
        }));
  });
  EXPECT_EQ(got, Clean());
  for (int r = 0; r < 2; ++r) {
    const auto& mine = seen[static_cast<std::size_t>(r)];
    ASSERT_EQ(mine.size(), 4u) << "rank " << r;
    for (const absl::Status& s : mine) {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << "rank " << r << ": " << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("in training state")) << "rank " << r;
    }
    EXPECT_THAT(std::string(mine[0].message()), HasSubstr("in training state forward")) << "rank " << r;
    EXPECT_THAT(std::string(mine[1].message()), HasSubstr("TransformerBlock in training state forward")) << "rank " << r;
    EXPECT_EQ(mine, seen[0]) << "rank " << r << " refused differently from rank 0";
  }
}

// set_requires_all_reduce is HSDP only: on a 1-D group it changes nothing (no gradient is kept back unreduced).
TEST(FsdpMisuse, RequiresAllReduceOnAOneDimensionalGroupChangesNothing) {
  const Values3 got = Train(3, [](nn::GPT& model, comm::RankEnv&, int) { Unit(model).set_requires_all_reduce(false); });
  EXPECT_EQ(got, Clean());
}

// set_reduce_scatter_divide_factor(0, negative, NaN): a gradient divided by zero or NaN is a silently wrong number;
// the error policy wants a clear error, on every rank, at the latest from the backward that would use it.
TEST(FsdpMisuse, DivideFactorZeroNegativeOrNanIsRefused) {
  for (const double factor : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN()}) {
    SCOPED_TRACE(::testing::Message() << "factor " << factor);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
      Unit(model).set_reduce_scatter_divide_factor(factor);
      auto [x, y] = Batch(0, env.rank * 12, 12);
      const absl::Status s = autograd::try_backward(model.loss(x, y));
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << env.rank << ": " << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("divide")) << "rank " << env.rank;
      if (s.ok()) {
        for (const Tensor& p : model.parameters()) {
          if (!p.grad().defined()) continue;
          for (float g : p.grad().to_vector()) {
            if (!std::isfinite(g)) return absl::InternalError("a non-finite gradient from a bad divide factor");
          }
        }
      }
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

// A backward that fails (here: a refused divide factor at a block's reduce) after the next block's all-gather was
// prefetched: that all-gather must not outlive the backward. It was left queued until the next forward, so a rank
// that stopped after the error destroyed its group with the call still queued ("the group handle was destroyed
// with 1 call queued and not started", in about one run of twenty of the test above), and the gathered
// parameters stayed unsharded. Every rank must end the failed backward with nothing in flight: no communication
// buffer held, parameters at rest (Note [a backward that threw] in fsdp/state.cc).
TEST(FsdpMisuse, AFailedBackwardLeavesNoPrefetchInFlight) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    MemoryTracker& mem = *current_rank_context().memory;
    const std::int64_t at_rest = mem.current(MemoryCategory::parameter);
    auto [x, y] = Batch(0, env.rank * 12, 12);
    if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;  // records the order
    Unit(model).set_reduce_scatter_divide_factor(0.0);
    const absl::Status s = autograd::try_backward(model.loss(x, y));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << env.rank << ": " << s;
    EXPECT_EQ(mem.current(MemoryCategory::communication_buffer), 0) << "rank " << env.rank << ": a gather in flight";
    EXPECT_EQ(mem.current(MemoryCategory::parameter), at_rest) << "rank " << env.rank << ": parameters not at rest";
    return absl::OkStatus();
  }, {.timeout = absl::Seconds(5)});
  EXPECT_TRUE(st.ok()) << st;
}

// A prefetch list naming a unit of another root: accepted when set (documented: checked when the forward runs),
// then the forward (or the backward, for a backward list) refuses it with InvalidArgument on every rank.
TEST(FsdpMisuse, PrefetchOfAnotherRootsUnitIsRefusedWhenItRuns) {
  for (const bool backward : {false, true}) {
    SCOPED_TRACE(backward ? "backward list" : "forward list");
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1), other(TinyConfig(), 1);
      if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
      if (absl::Status s = test_util::ShardGpt(other, env); !s.ok()) return s;
      FSDPModule b0 = Unit(Block(model, 0));
      const std::vector<FSDPModule> list = {Unit(Block(other, 1))};
      EXPECT_TRUE((backward ? b0.set_modules_to_backward_prefetch(list) : b0.set_modules_to_forward_prefetch(list)).ok());
      auto [x, y] = Batch(0, env.rank * 12, 12);
      const absl::Status s = Caught([&] {
        absl::Status b = autograd::try_backward(model.loss(x, y));
        if (!b.ok()) throw autograd::StatusError(b);
      });
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << env.rank << ": " << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("that is not under the same root (GPT)")) << "rank " << env.rank;
      return absl::OkStatus();
    }, {.timeout = absl::Seconds(2)});
    // The reduce-scatters the failed backward dropped are still queued when the ranks leave (both ranks queued the
    // same ones, so a later step would match them): the harness reports that on teardown.
    EXPECT_TRUE(st.ok() || absl::StrContains(st.message(), "destroyed with")) << st;
  }
}

// ---- fully_shard misuse ---------------------------------------------------------------------------------------

TEST(FsdpMisuse, FullyShardRefusals) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    // No group.
    nn::GPT model(TinyConfig(), 1);
    auto none = fully_shard(Block(model, 0), nullptr);
    EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(none.status().message()), HasSubstr("expected a process group, found none"));
    // bf16 parameters.
    Generator gen(1);
    nn::Linear lin(4, 4, gen);
    nn::Linear half(lin.parameter("weight").to(DType::bf16), lin.parameter("bias").to(DType::bf16));
    for (const Tensor& p : half.parameters()) p.set_requires_grad(true);
    auto bf = fully_shard(half, env.group_ptr);
    EXPECT_EQ(bf.status().code(), absl::StatusCode::kInvalidArgument) << bf.status();
    EXPECT_THAT(std::string(bf.status().message()), HasSubstr("expected f32 parameters, found bf16"));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// fully_shard on a block after its parent (the rule: bottom-up): refused, and the root alone still trains. Found by
// this audit: it was accepted, sharded the parent's shards again, and the next forward died in a shape check.
TEST(FsdpMisuse, ShardingAChildAfterItsParentIsRefused) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (auto s = fully_shard(model, env.group_ptr); !s.ok()) return s.status();
    auto child = fully_shard(Block(model, 0), env.group_ptr);
    EXPECT_FALSE(child.ok()) << "rank " << env.rank;
    EXPECT_THAT(std::string(child.status().message()), HasSubstr("expected the calls bottom-up")) << child.status();
    auto [x, y] = Batch(0, env.rank * 12, 12);
    const absl::Status s = Caught([&] {
      absl::Status b = autograd::try_backward(model.loss(x, y));
      if (!b.ok()) throw autograd::StatusError(b);
    });
    EXPECT_TRUE(s.ok()) << "rank " << env.rank << ": " << s;
    return absl::OkStatus();
  }, {.timeout = absl::Seconds(2)});
  EXPECT_TRUE(st.ok()) << st;
}

// The first forward through a block instead of the root: the root's forward then refuses, naming both, on every
// rank.
TEST(FsdpMisuse, FirstForwardThroughANonRootUnitIsRefused) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    {
      autograd::NoGradGuard no_grad;
      (void)Block(model, 0)(Tensor::zeros({1, 4, TinyConfig().width}));
    }
    auto [x, y] = Batch(0, env.rank * 12, 12);
    const absl::Status s = Caught([&] { (void)model.loss(x, y); });
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << "rank " << env.rank << ": " << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("the TransformerBlock under root GPT already ran as a root of its own"));
    return absl::OkStatus();
  }, {.timeout = absl::Seconds(2)});
  EXPECT_TRUE(st.ok()) << st;
}

// ---- a unit's forward that throws ---------------------------------------------------------------------------

// An exception inside block 1's forward on every rank (say a shape error in user code): the forward fails with it,
// and, as for a failed backward (FsdpErrors.AFailedBackwardDoesNotDisturbLaterSteps), the later steps equal a run
// that skipped the failed step.
TEST(FsdpMisuse, AForwardThatThrowsOnEveryRankDoesNotDisturbLaterSteps) {
  auto run = [](bool fail_first) {
    Values3 got(2);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      bool armed = fail_first;
      autograd::HookHandle h = Block(model, 1).register_forward_pre_hook(
          [&](nn::Module&, const nn::TensorList&) -> std::optional<nn::TensorList> {
            if (armed) throw autograd::StatusError(absl::InvalidArgumentError("injected shape error"));
            return std::nullopt;
          });
      for (int step = 0; step < 3; ++step) {
        auto [x, y] = Batch(step, env.rank * 12, 12);
        (*opt)->zero_grad();
        absl::Status s = Caught([&] {
          absl::Status b = autograd::try_backward(model.loss(x, y));
          if (!b.ok()) throw autograd::StatusError(b);
        });
        if (step == 0 && fail_first) {
          EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
          EXPECT_THAT(std::string(s.message()), HasSubstr("injected shape error"));
          armed = false;
          continue;
        }
        if (!s.ok()) return s;
        if (absl::Status s2 = step > 0 ? (*opt)->step() : absl::OkStatus(); !s2.ok()) return s2;
      }
      return test_util::StoreFullValues(model, got, env.rank);
    }, {.timeout = absl::Seconds(2)});
    EXPECT_TRUE(st.ok()) << st;
    return got;
  };
  EXPECT_EQ(run(true), run(false));
}

// An exception inside block 1's forward on rank 1 only: rank 1 sees its exception, rank 0 a deadline error from the
// next gather (the unit's timeout, 1 s) naming the FSDP collective; neither waits for ever.
TEST(FsdpMisuse, AForwardThatThrowsOnOneRankEndsOnEveryRankInBoundedTime) {
  std::vector<absl::Status> seen(2);
  absl::Notification rank0_done;
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env, {.timeout = absl::Seconds(1)}); !s.ok()) return s;
    autograd::HookHandle h = Block(model, 1).register_forward_pre_hook(
        [&](nn::Module&, const nn::TensorList&) -> std::optional<nn::TensorList> {
          if (env.rank == 1) throw autograd::StatusError(absl::InvalidArgumentError("injected on rank 1"));
          return std::nullopt;
        });
    auto [x, y] = Batch(0, env.rank * 12, 12);
    seen[static_cast<std::size_t>(env.rank)] = Caught([&] {
      absl::Status b = autograd::try_backward(model.loss(x, y));
      if (!b.ok()) throw autograd::StatusError(b);
    });
    if (env.rank == 0) {
      rank0_done.Notify();
    } else {
      rank0_done.WaitForNotification();  // stays in the world (no departure) until rank 0 has its error
    }
    return absl::OkStatus();
  }, {.timeout = absl::Seconds(2)});
  EXPECT_TRUE(st.ok() || st.code() == absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_THAT(std::string(seen[1].message()), HasSubstr("injected on rank 1"));
  EXPECT_EQ(seen[0].code(), absl::StatusCode::kDeadlineExceeded) << seen[0];
  EXPECT_THAT(std::string(seen[0].message()), HasSubstr("fsdp")) << seen[0];
}

// A backward on rank 0 only (rank 1 forgot it): rank 0's backward ends with a deadline error naming the FSDP
// collective (timeout 1 s), no hang.
TEST(FsdpMisuse, ABackwardOnOneRankOnlyEndsInBoundedTime) {
  absl::Status rank0;
  absl::Notification rank0_done;
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env, {.timeout = absl::Seconds(1)}); !s.ok()) return s;
    auto [x, y] = Batch(0, env.rank * 12, 12);
    Tensor loss = model.loss(x, y);
    if (env.rank == 0) {
      rank0 = autograd::try_backward(loss);
      rank0_done.Notify();
    } else {
      rank0_done.WaitForNotification();
    }
    return absl::OkStatus();
  }, {.timeout = absl::Seconds(2)});
  EXPECT_TRUE(st.ok() || st.code() == absl::StatusCode::kDeadlineExceeded) << st;  // the harness reports the timeout too
  EXPECT_EQ(rank0.code(), absl::StatusCode::kDeadlineExceeded) << rank0;
  EXPECT_THAT(std::string(rank0.message()), HasSubstr("fsdp")) << rank0;
}

// ---- ranks that disagree --------------------------------------------------------------------------------------

// Ranks that build models of different widths or depths: every rank's step (or, for depths, fully_shard: each call
// compares its unit's values, Note [same values on every rank] in fsdp/same_values.cc) fails with the backend's
// "ranks disagree on collective" (or an error caused by it), none hangs.
TEST(FsdpMisuse, RanksThatBuildDifferentModelsFailOnEveryRank) {
  for (const bool depth : {false, true}) {
    SCOPED_TRACE(depth ? "depth" : "width");
    std::vector<absl::Status> seen(2);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPTConfig c = TinyConfig();
      if (env.rank == 1) {
        if (depth) {
          c.num_layers = 2;
        } else {
          c.width = 32;
        }
      }
      nn::GPT model(c, 1);
      if (absl::Status s = test_util::ShardGpt(model, env, {.timeout = absl::Seconds(1)}); !s.ok()) {
        seen[static_cast<std::size_t>(env.rank)] = s;
        return absl::OkStatus();
      }
      auto [x, y] = Batch(0, env.rank * 12, 12);
      seen[static_cast<std::size_t>(env.rank)] = Caught([&] {
        absl::Status b = autograd::try_backward(model.loss(x, y));
        if (!b.ok()) throw autograd::StatusError(b);
      });
      return absl::OkStatus();
    }, {.timeout = absl::Seconds(2)});
    (void)st;  // a rank that departs first makes the others' error; both must fail
    for (int r = 0; r < 2; ++r) {
      EXPECT_FALSE(seen[static_cast<std::size_t>(r)].ok()) << "rank " << r << " trained a model the other rank lacks";
    }
    EXPECT_THAT(std::string(seen[0].message()) + std::string(seen[1].message()), HasSubstr("ranks disagree on collective"));
  }
}

// Ranks that build the same shapes from different seeds break the rule "every rank builds the same model"; the
// rules say each breach is a Status or an FsdpError, DESIGN.md section 7 "mismatched models across ranks ... a
// clear error on every rank". Told at the first forward (Note [same values on every rank] in fsdp/same_values.cc),
// on every rank, naming the first differing parameter and the ranks; the next step is refused the same way.
TEST(FsdpMisuse, RanksThatBuildFromDifferentSeedsAreTold) {
  std::vector<std::vector<absl::Status>> seen(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), env.rank == 0 ? 1 : 2);
    std::vector<absl::Status>& mine = seen[static_cast<std::size_t>(env.rank)];
    if (absl::Status s = test_util::ShardGpt(model, env, {.timeout = absl::Seconds(1)}); !s.ok()) {
      mine.push_back(s);  // told at fully_shard
      return absl::OkStatus();
    }
    for (int step = 0; step < 2; ++step) {
      auto [x, y] = Batch(step, env.rank * 12, 12);
      mine.push_back(Caught([&] {
        absl::Status b = autograd::try_backward(model.loss(x, y));
        if (!b.ok()) throw autograd::StatusError(b);
      }));
    }
    return absl::OkStatus();
  }, {.timeout = absl::Seconds(2)});
  EXPECT_TRUE(st.ok()) << st;
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(seen[static_cast<std::size_t>(r)].empty()) << "rank " << r;
    for (const absl::Status& s : seen[static_cast<std::size_t>(r)]) {
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "rank " << r << ": " << s;
      EXPECT_THAT(std::string(s.message()), HasSubstr("parameter 'wte.weight' on rank 1 differs from rank 0's"))
          << "rank " << r;
      EXPECT_THAT(std::string(s.message()), HasSubstr("every rank must build the same model (same seed)"))
          << "rank " << r;
    }
  }
}

// Two units under one root; the root's forward runs `a` then `b`, or (on some ranks) `c` instead of `a`.
class Branches : public nn::Module {
 public:
  Branches(Generator& gen, bool skip_a, bool c_bias) : Module("Branches"), skip_a_(skip_a) {
    a = std::make_shared<nn::Linear>(4, 4, gen);
    b = std::make_shared<nn::Linear>(4, 4, gen);
    c = std::make_shared<nn::Linear>(4, 4, gen, c_bias);
    register_module("a", a);
    register_module("b", b);
    register_module("c", c);
  }
  std::shared_ptr<nn::Linear> a, b, c;

 protected:
  Tensor forward(const Tensor& x) override { return (*b)(skip_a_ ? (*c)(x) : (*a)(x)); }

 private:
  bool skip_a_;
};

// Ranks that run different units in one forward (rank 1 runs `c` where rank 0 runs `a`): documented as a breach
// found by the forward ("ranks disagree on collective #1"). `same_size`: `c` the same size as `a`.
void ExpectDifferentUnitsFailOnEveryRank(bool same_size) {
  std::vector<absl::Status> seen(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    Generator gen(1);
    Branches model(gen, /*skip_a=*/env.rank == 1, /*c_bias=*/same_size);
    for (nn::Module* m : {static_cast<nn::Module*>(model.a.get()), static_cast<nn::Module*>(model.b.get()),
                          static_cast<nn::Module*>(model.c.get())}) {
      if (auto s = fully_shard(*m, env.group_ptr, {.timeout = absl::Seconds(1)}); !s.ok()) return s.status();
    }
    if (auto s = fully_shard(model, env.group_ptr, {.timeout = absl::Seconds(1)}); !s.ok()) return s.status();
    seen[static_cast<std::size_t>(env.rank)] = Caught([&] {
      Tensor x = Tensor::full({2, 4}, 1.0f);
      absl::Status b = autograd::try_backward(autograd::sum(model(x)));
      if (!b.ok()) throw autograd::StatusError(b);
    });
    return absl::OkStatus();
  }, {.timeout = absl::Seconds(2)});
  (void)st;  // a rank that departs first makes the other's error; both must fail
  for (int r = 0; r < 2; ++r) EXPECT_FALSE(seen[static_cast<std::size_t>(r)].ok()) << "rank " << r << " was not told";
  EXPECT_THAT(std::string(seen[0].message()) + std::string(seen[1].message()), HasSubstr("ranks disagree on collective"));
}

TEST(FsdpMisuse, RanksThatRunDifferentUnitsOfAnotherSizeFailOnEveryRank) { ExpectDifferentUnitsFailOnEveryRank(false); }

// The same with `c` the same size as `a`: nothing may pair rank 0's gather of `a` with rank 1's of `c` silently
// (Note [unit fingerprints] in param_group.cc: the all_gathers carry different fingerprints).
TEST(FsdpMisuse, RanksThatRunDifferentUnitsOfTheSameSizeFailOnEveryRank) {
  ExpectDifferentUnitsFailOnEveryRank(true);
}

}  // namespace
}  // namespace shardkit::fsdp
