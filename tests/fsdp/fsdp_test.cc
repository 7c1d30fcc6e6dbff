// fully_shard (ZeRO-3, FSDP2's shape): equivalence with single-rank training on GPT-tiny, the per-rank ledger
// against the ZeRO-3 formula, and errors.
#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "common/autograd/grad_mode.h"
#include "common/autograd/hooks.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/reduce.h"
#include "common/nn/layers.h"
#include "common/comm/testing/run_ranks.h"
#include "common/optim/sgd.h"
#include "fsdp/fully_shard.h"
#include "gmock/gmock.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;

// How each rank computes its gradient for a step: one forward and backward on its rows; or its rows in two
// halves, both forwards before one backward of their mean; or two backwards of half losses (gradient
// accumulation into the shards); or both forwards first, then one backward each (Note [pending pre-backward
// hooks]). All give the gradient of the rows' mean loss.
enum class Passes { one, two_forwards, two_backwards, forwards_then_backwards };

struct Case {
  int world;
  std::optional<std::variant<bool, int>> reshard_after_forward;
  Passes passes = Passes::one;
  bool nested = false;  // every block's MLP a unit of its own inside the block's unit
  std::int64_t own_collective_min_numel = FullyShardOptions{}.own_collective_min_numel;
};

// Trains GPT-tiny for `steps` steps on `world` ranks (each on its rows) with every TransformerBlock a unit;
// returns every rank's final parameters (unsharded).
std::vector<std::vector<std::vector<float>>> TrainSharded(Case c, int steps) {
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(c.world));
  absl::Status st = comm::RunRanks(c.world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    const FullyShardOptions options{.reshard_after_forward = c.reshard_after_forward,
                                    .own_collective_min_numel = c.own_collective_min_numel};
    if (absl::Status s = test_util::ShardGpt(model, env, options, c.nested); !s.ok()) {
      return s;
    }
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});  // the shards
    if (!opt.ok()) return opt.status();
    const int rows = kBatch / c.world;
    for (int step = 0; step < steps; ++step) {
      (*opt)->zero_grad();
      if (c.passes == Passes::one) {
        auto [x, y] = Batch(step, env.rank * rows, rows);
        if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      } else {
        auto [x0, y0] = Batch(step, env.rank * rows, rows / 2);
        auto [x1, y1] = Batch(step, env.rank * rows + rows / 2, rows / 2);
        Tensor l0 = autograd::scale(model.loss(x0, y0), 0.5f);
        if (c.passes == Passes::two_backwards) {
          if (absl::Status s = autograd::try_backward(l0); !s.ok()) return s;
        }
        Tensor l1 = autograd::scale(model.loss(x1, y1), 0.5f);
        if (c.passes == Passes::forwards_then_backwards) {
          if (absl::Status s = autograd::try_backward(l0); !s.ok()) return s;
        }
        Tensor loss = c.passes == Passes::two_forwards ? autograd::add(l0, l1) : l1;
        if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
      }
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

class FsdpGpt : public ::testing::TestWithParam<std::tuple<int, bool, bool>> {};

// 20 steps of AdamW over model.parameters() (the shards): every rank ends equal to one rank trained on the whole
// batch (fp32 reduction order tolerance, as the OSS and ShardedDDP equivalence tests), and all ranks bit-identical;
// units per block, or per block and per MLP (nested).
TEST_P(FsdpGpt, EqualsSingleRankOnTheWholeBatch) {
  const auto [world, reshard, nested] = GetParam();
  static const auto want = gpt_tiny::Reference(20);
  gpt_tiny::ExpectMatches(TrainSharded({world, reshard, Passes::one, nested}, 20), want, 2e-5);
}

// Note [own collectives]: every parameter without padding gathered and reduced by a collective of its own (min
// numel 1) trains to the same bits as one collective per unit (min numel INT64_MAX), at every N (N = 3 mixes both
// kinds in a unit: some dim-0 sizes split evenly, some do not), with the forward's own gathers followed by a
// k-group gather (reshard_after_forward = 2), and with two forwards before one backward.
TEST(FsdpOwnCollectives, SameBitsAsOneCollectivePerUnit) {
  std::vector<Case> cases;
  for (const int world : {1, 2, 3, 4, 8}) {
    for (const bool nested : {false, true}) cases.push_back({.world = world, .reshard_after_forward = true, .nested = nested});
  }
  cases.push_back({.world = 4, .reshard_after_forward = 2, .nested = true});
  cases.push_back({.world = 2, .reshard_after_forward = false, .passes = Passes::two_forwards, .nested = true});
  for (Case c : cases) {
    SCOPED_TRACE(::testing::Message() << "n=" << c.world << " nested " << c.nested);
    c.own_collective_min_numel = 1;
    const auto own = TrainSharded(c, 6);
    c.own_collective_min_numel = INT64_MAX;
    const auto shared = TrainSharded(c, 6);
    ASSERT_EQ(own.size(), shared.size());
    for (std::size_t r = 0; r < own.size(); ++r) EXPECT_EQ(own[r], shared[r]) << "rank " << r;
  }
}

// reshard_after_forward = k (Note [reshard to a k-group]): k = 2 at N = 4 and 8, k = 4 at N = 8, units per block or
// nested; equal to single-rank training.
TEST(FsdpGptGroupReshard, EqualsSingleRankAtFourAndEight) {
  static const auto want = gpt_tiny::Reference(20);
  for (const auto& [world, k] : {std::pair{4, 2}, std::pair{8, 2}, std::pair{8, 4}}) {
    for (const bool nested : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "n=" << world << " k=" << k << " nested " << nested);
      gpt_tiny::ExpectMatches(TrainSharded({world, k, Passes::one, nested}, 20), want, 2e-5);
    }
  }
}

// With k = 2 at N = 4, backward gathers every block within its pair of ranks: no all_gather on the world group
// during backward (true: one per block), and each rank holds a block's k-shard (about half a block) between
// forward and backward instead of nothing (exact ledger figures).
TEST(FsdpGptGroupReshard, BackwardGathersWithinTheGroup) {
  for (const std::variant<bool, int> reshard : {std::variant<bool, int>(true), std::variant<bool, int>(2)}) {
    absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
      MemoryTracker& mem = *env.context.memory;
      nn::GPT model(TinyConfig(), 1);
      // Between forward and backward: the root (kept, FSDP2's default) and, with k = 2, each block's k-shard.
      const std::int64_t block_numel = (*model.blocks)[0]->num_parameters();
      const std::int64_t root_numel = model.num_parameters() - 3 * block_numel;
      std::int64_t kshard = 0;
      for (const Tensor& p : (*model.blocks)[0]->parameters()) {
        const RowSplit rs = split_rows(p.shape(), 0, 2);
        kshard += rs.rows_per_rank * rs.row_numel;
      }
      if (absl::Status s = test_util::ShardGpt(model, env, {.reshard_after_forward = reshard}); !s.ok()) return s;
      const std::int64_t at_rest = mem.current(MemoryCategory::parameter);
      auto [x, y] = Batch(0, env.rank * 6, 6);
      Tensor loss = model.loss(x, y);
      const std::int64_t after_forward = mem.current(MemoryCategory::parameter) - at_rest;
      const auto before = env.group.counters();
      if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
      const auto gathers = env.group.counters().since(before).of(comm::CollectiveKind::all_gather).calls;
      if (std::holds_alternative<int>(reshard)) {
        EXPECT_EQ(gathers, 0) << "backward gathers within the k-group";
        EXPECT_EQ(after_forward, 4 * (root_numel + 3 * kshard)) << "the root and each block's k-shard";
        EXPECT_LT(kshard, block_numel) << "a k-shard is a part of a block";
      } else {
        EXPECT_EQ(gathers, 3) << "one all_gather per block";
        EXPECT_EQ(after_forward, 4 * root_numel) << "the root only";
      }
      EXPECT_EQ(mem.current(MemoryCategory::parameter), at_rest) << "after backward: shards only";
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

TEST(FsdpErrors, ReshardToAGroupThatDoesNotDivideTheWorld) {
  absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    for (const int k : {3, 4, 1}) {
      auto s = fully_shard(*(*model.blocks)[0], env.group_ptr, {.reshard_after_forward = k});
      EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
      EXPECT_THAT(std::string(s.status().message()),
                  ::testing::HasSubstr("expected reshard_after_forward = k with 1 < k < 4 and k dividing the group "
                                       "size 4, found " + std::to_string(k)));
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// The parameters of one fully_shard call share a device (Note [unit on a device] in fsdp/param_group.cc): a weight
// on cuda:0 with a bias on the CPU is refused, naming both, before anything is sharded (the weight is a tensor
// labelled cuda:0 over host bytes: no device is touched). The CPU bias alone is still sharded after the refusal.
TEST(FsdpErrors, ParametersOfOneCallOnTwoDevicesAreInvalid) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    std::vector<float> bytes(12);
    Tensor w = Tensor::over(Storage::borrow(bytes.data(), bytes.size() * sizeof(float), Device::cuda(0)), 0, {4, 3},
                            DType::f32);
    w.set_requires_grad(true);
    Tensor b = Tensor::zeros({4});
    b.set_requires_grad(true);
    nn::Linear lin(w, b);
    auto s = fully_shard(lin, env.group_ptr);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.status().message()),
                ::testing::HasSubstr("fully_shard: expected the parameters of one call on one device, found 'weight' on "
                                     "cuda:0 and 'bias' on cpu"));
    EXPECT_FALSE(b.storage_released());  // nothing was sharded
    EXPECT_EQ(lin.parameter("weight").id(), w.id());
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// Several forwards before one backward, and gradients accumulated over two backwards, at n = 2 and 4 (rows
// per rank stay even).
TEST(FsdpGptPasses, TwoForwardsOneBackwardAndTwoBackwardsAccumulate) {
  static const auto want = gpt_tiny::Reference(10);
  for (const int world : {2, 4}) {
    for (const bool reshard : {true, false}) {
      for (const Passes passes : {Passes::two_forwards, Passes::two_backwards, Passes::forwards_then_backwards}) {
        SCOPED_TRACE(::testing::Message() << "n=" << world << " reshard " << reshard << " passes "
                                          << static_cast<int>(passes));
        gpt_tiny::ExpectMatches(TrainSharded({world, reshard, passes}, 10), want, 2e-5);
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, FsdpGpt,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8), ::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<1>(info.param) ? "reshard" : "keep") +
                                  (std::get<2>(info.param) ? "_nested" : "") + "_n" + std::to_string(std::get<0>(info.param));
                         });

// DESIGN.md section 6, ZeRO-3 (fp32 + Adam): 16Ψ/N bytes of model state per rank plus padding, exactly. Each
// parameter of dim-0 size d0 and row size w occupies ceil(d0/N)·w elements of the shard buffer and of the sharded
// gradient (Note [per-parameter dim-0 shards]); the Adam moments are sized by the rows the rank owns. During
// forward and backward, at most the root unit and one block are unsharded at a time.
TEST(FsdpMemory, LedgerAtRestIsTheZero3FormulaPlusPadding) {
  for (const int world : {1, 2, 3, 4, 8}) {
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      MemoryTracker& mem = *env.context.memory;
      std::unique_ptr<nn::GPT> model;
      {
        MemoryCategoryScope params(MemoryCategory::parameter);
        model = std::make_unique<nn::GPT>(TinyConfig(), 1);
      }
      const double psi = static_cast<double>(model->num_parameters());
      std::int64_t padded = 0, owned = 0;
      for (const Tensor& p : model->parameters()) {
        const RowSplit rs = split_rows(p.shape(), env.rank, world);
        padded += rs.rows_per_rank * rs.row_numel;
        owned += rs.local_rows * rs.row_numel;
      }
      const std::int64_t root_numel = model->num_parameters() - 3 * (*model->blocks)[0]->num_parameters();
      const std::int64_t block_numel = (*model->blocks)[0]->num_parameters();
      if (absl::Status s = test_util::ShardGpt(*model, env); !s.ok()) return s;
      EXPECT_EQ(mem.current(MemoryCategory::parameter), padded * 4) << "at rest: the shards only";
      std::unique_ptr<optim::Optimizer> opt;
      {
        MemoryCategoryScope cat(MemoryCategory::optimizer_state);
        opt = std::move(*optim::AdamW::factory()({{model->parameters(), optim::AdamW::default_hyper()}}));
      }
      const int rows = kBatch / world;
      for (int step = 0; step < 2; ++step) {
        auto [x, y] = Batch(step, env.rank * rows, rows);
        opt->zero_grad();
        mem.reset_peaks();
        Tensor loss = model->loss(x, y);
        const std::int64_t param_peak_forward = mem.peak(MemoryCategory::parameter);
        mem.reset_peaks();
        if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
        const std::int64_t param_peak_backward = mem.peak(MemoryCategory::parameter);
        const std::int64_t one_block_at_a_time = (padded + root_numel + block_numel) * 4;
        EXPECT_LE(param_peak_forward, one_block_at_a_time) << "forward peak";
        // A block is reduced and resharded before the previous one is unsharded (Note [post-backward on a
        // unit's inputs]).
        EXPECT_LE(param_peak_backward, one_block_at_a_time) << "backward peak";
        EXPECT_GT(param_peak_backward, (padded + block_numel) * 4) << "a block was unsharded";
        EXPECT_EQ(mem.current(MemoryCategory::parameter), padded * 4) << "after backward: resharded";
        EXPECT_EQ(mem.current(MemoryCategory::gradient), padded * 4) << "after backward: sharded gradients only";
        EXPECT_EQ(mem.current(MemoryCategory::communication_buffer), 0);
        {
          MemoryCategoryScope cat(MemoryCategory::optimizer_state);
          if (absl::Status s = opt->step(); !s.ok()) return s;
        }
      }
      EXPECT_EQ(mem.current(MemoryCategory::optimizer_state), 2 * owned * 4) << "Adam moments of the owned rows";
      const std::int64_t model_state = mem.current(MemoryCategory::parameter) + mem.current(MemoryCategory::gradient) +
                                       mem.current(MemoryCategory::optimizer_state);
      EXPECT_EQ(model_state, 8 * padded + 8 * owned);
      if (env.rank == 0) {
        std::printf("fsdp n=%d: model state %lld B per rank vs 16Ψ/N = %.0f B (%.4f)\n", world,
                    static_cast<long long>(model_state), 16.0 * psi / world, static_cast<double>(model_state) / (16.0 * psi / world));
      }
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

// Evaluation without gradients leaves every unit resharded.
TEST(FsdpEval, NoGradForwardReshardsEveryUnit) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    MemoryTracker& mem = *env.context.memory;
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    const std::int64_t at_rest = mem.current(MemoryCategory::parameter);
    auto [x, y] = Batch(0, 0, 2);
    {
      autograd::NoGradGuard no_grad;
      Tensor loss = model.loss(x, y);
      EXPECT_TRUE(std::isfinite(loss.item()));
    }
    EXPECT_EQ(mem.current(MemoryCategory::parameter), at_rest);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// Four micro-batches per step, the first three with gradient sync off: equal to one rank on the whole batch,
// and no gradient communication in the unsynchronised backwards.
TEST(FsdpNoSync, FourMicroBatchesEqualOneLargeBatch) {
  static const auto want = gpt_tiny::Reference(6);
  std::vector<std::vector<std::vector<float>>> got(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    FSDPModule root = *state_of(model);
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    constexpr int kMicro = 4, kRows = kBatch / 2 / kMicro;
    for (int step = 0; step < 6; ++step) {
      (*opt)->zero_grad();
      for (int m = 0; m < kMicro; ++m) {
        root.set_requires_gradient_sync(m == kMicro - 1);
        auto [x, y] = Batch(step, env.rank * kBatch / 2 + m * kRows, kRows);
        const auto before = env.group.counters();
        if (absl::Status s = autograd::try_backward(autograd::scale(model.loss(x, y), 1.0f / kMicro)); !s.ok()) return s;
        const auto sent = env.group.counters().since(before);
        if (m < kMicro - 1) {
          EXPECT_EQ(sent.of(comm::CollectiveKind::reduce_scatter).calls, 0) << "no sync";
        }
      }
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 2e-5);
}

// A forward with grad on whose loss is dropped (no backward), then a step, an unshard and a state dict: the
// stale forward's hooks do not fire later, nothing stays unsharded, and training continues equal to the reference.
TEST(FsdpStaleForward, ForwardWithoutBackwardThenStepUnshardAndCheckpoint) {
  static const auto want = gpt_tiny::Reference(4);
  std::vector<std::vector<std::vector<float>>> got(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    MemoryTracker& mem = *env.context.memory;
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    const std::int64_t at_rest = mem.current(MemoryCategory::parameter);
    for (int step = 0; step < 4; ++step) {
      auto [x, y] = Batch(step, env.rank * 12, 12);
      (*opt)->zero_grad();
      { Tensor dropped = model.loss(x, y); }  // grad on, never backpropagated
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;  // no gradients: nothing moves
      auto sd = full_state_dict(model);
      if (!sd.ok()) return sd.status();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
      EXPECT_LE(mem.current(MemoryCategory::parameter), at_rest + model.num_parameters() * 4);
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 2e-5);
}
// A unit whose forward takes a data-dependent branch: `gate` is used on some ranks only. Its reduce_scatter
// still comes at the same point of every rank's backward (Note [post-backward on a unit's inputs]), and
// training equals one rank computing both ranks' losses.
class Gated : public nn::Module {
 public:
  explicit Gated(Generator& gen) : Module("Gated") {
    a = register_module("a", std::make_shared<nn::Linear>(4, 4, gen));
    gate = register_module("gate", std::make_shared<nn::Linear>(4, 4, gen));
  }
  bool use_gate = false;
  std::shared_ptr<nn::Linear> a, gate;

 protected:
  Tensor forward(const Tensor& x) override {
    Tensor h = (*a)(x);
    return use_gate ? (*gate)(h) : h;
  }
};

class GatedNet : public nn::Module {
 public:
  explicit GatedNet(std::uint64_t seed) : Module("GatedNet") {
    Generator gen(seed, 0);
    in = register_module("in", std::make_shared<nn::Linear>(3, 4, gen));
    body = register_module("body", std::make_shared<Gated>(gen));
    out = register_module("out", std::make_shared<nn::Linear>(4, 2, gen));
  }
  Tensor loss(const Tensor& x) { return autograd::mean((*this)(x)); }  // through the root hooks
  std::shared_ptr<nn::Linear> in, out;
  std::shared_ptr<Gated> body;

 protected:
  Tensor forward(const Tensor& x) override { return (*out)((*body)((*in)(x))); }
};

Tensor GatedInput(int rank, int step) {
  std::vector<float> v(6);
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.1f * static_cast<float>((rank + 1) * (step + 2)) - 0.05f * static_cast<float>(i);
  return Tensor::from_vector(v, {2, 3});
}

TEST(FsdpDataDependent, AParameterUsedOnSomeRanksOnly) {
  constexpr int kSteps = 5;
  // Reference: one rank, both ranks' losses (rank 0 through the gate, rank 1 not), averaged.
  std::vector<std::vector<float>> want;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    GatedNet net(3);
    auto opt = optim::Sgd::factory({.lr = 0.1})({{net.parameters(), {}}});
    for (int step = 0; step < kSteps; ++step) {
      (*opt)->zero_grad();
      net.body->use_gate = true;
      Tensor l0 = net.loss(GatedInput(0, step));
      net.body->use_gate = false;
      Tensor l1 = net.loss(GatedInput(1, step));
      autograd::backward(autograd::scale(autograd::add(l0, l1), 0.5f));
      ASSERT_TRUE((*opt)->step().ok());
    }
    want = gpt_tiny::Values(net);
  }
  std::vector<std::vector<std::vector<float>>> got(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    GatedNet net(3);
    if (auto s = fully_shard(*net.body, env.group_ptr); !s.ok()) return s.status();
    if (auto s = fully_shard(net, env.group_ptr); !s.ok()) return s.status();
    auto opt = optim::Sgd::factory({.lr = 0.1})({{net.parameters(), {}}});
    net.body->use_gate = env.rank == 0;
    for (int step = 0; step < kSteps; ++step) {
      (*opt)->zero_grad();
      if (absl::Status s = autograd::try_backward(net.loss(GatedInput(env.rank, step))); !s.ok()) return s;
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(net, got, env.rank);
  });
  ASSERT_TRUE(st.ok()) << st;
  gpt_tiny::ExpectMatches(got, want, 1e-6);
}

// A backward that throws half-way (here a user's hook on block 0's output, after the later blocks were
// reduced) leaves nothing behind: the following steps equal those of a run that skipped the failed step.
TEST(FsdpErrors, AFailedBackwardDoesNotDisturbLaterSteps) {
  std::int64_t own_min = FullyShardOptions{}.own_collective_min_numel;
  auto run = [&](bool fail_first) {
    std::vector<std::vector<std::vector<float>>> got(2);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      if (absl::Status s = test_util::ShardGpt(model, env, {.own_collective_min_numel = own_min}); !s.ok()) return s;
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      bool armed = fail_first;
      std::vector<autograd::HookHandle> throwing;
      autograd::HookHandle arm = (*model.blocks)[0]->register_forward_hook(
          [&](nn::Module&, const nn::TensorList&, const nn::TensorList& out) -> std::optional<nn::TensorList> {
            if (armed && out[0].requires_grad()) {
              throwing.push_back(autograd::register_hook(out[0], [](const Tensor&) -> std::optional<Tensor> {
                throw autograd::StatusError(absl::UnavailableError("injected"));
              }));
            }
            return std::nullopt;
          });
      for (int step = 0; step < 4; ++step) {
        auto [x, y] = Batch(step, env.rank * 12, 12);
        (*opt)->zero_grad();
        absl::Status s = autograd::try_backward(model.loss(x, y));
        if (step == 0 && fail_first) {
          EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
          armed = false;
          throwing.clear();
          continue;
        }
        if (!s.ok()) return s;
        if (absl::Status s = step > 0 ? (*opt)->step() : absl::OkStatus(); !s.ok()) return s;
      }
      return test_util::StoreFullValues(model, got, env.rank);
    });
    EXPECT_TRUE(st.ok()) << st;
    return got;
  };
  const auto clean = run(false);
  const auto failed = run(true);
  EXPECT_EQ(failed, clean);
  // The same with own collectives (Note [own collectives]): reduce-scatters of gradients dropped in flight.
  own_min = 1;
  const auto own_clean = run(false);
  EXPECT_EQ(own_clean, clean);
  EXPECT_EQ(run(true), own_clean);
}

// Between summon_full_params() and reshard(), forwards communicate nothing: rank 0 alone can sample from the model.
TEST(FsdpLifecycle, ForwardsOnOneRankWhileSummoned) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    FSDPModule root = *state_of(model);
    if (absl::Status s = root.summon_full_params(); !s.ok()) return s;
    EXPECT_EQ(root.training_state(), TrainingState::summoned);
    const auto before = env.group.counters();
    if (env.rank == 0) {
      autograd::NoGradGuard no_grad;
      auto [x, y] = Batch(0, 0, 1);
      for (int i = 0; i < 3; ++i) EXPECT_TRUE(std::isfinite(model.loss(x, y).item()));
    }
    EXPECT_EQ(env.group.counters().since(before).total_sent(), 0);
    return root.reshard(/*recurse=*/true);
  });
  EXPECT_TRUE(st.ok()) << st;
}

// unshard(async) starts one unit's all_gather; the unit's forward finishes it and gathers nothing more.
TEST(FsdpLifecycle, AsyncUnshardIsFinishedByTheForward) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto [x, y] = Batch(0, env.rank * 2, 2);
    Tensor want;
    {
      autograd::NoGradGuard no_grad;
      want = model.loss(x, y);
    }
    auto h = state_of(*(*model.blocks)[1])->unshard(/*async_op=*/true);
    if (!h.ok()) return h.status();
    const auto before = env.group.counters();
    autograd::NoGradGuard no_grad;
    EXPECT_EQ(model.loss(x, y).item(), want.item());
    // The root and blocks 0 and 2 gather in the forward; block 1 was gathered by the unshard.
    EXPECT_EQ(env.group.counters().since(before).of(comm::CollectiveKind::all_gather).calls, 3);
    return h->wait();  // already finished: a no-op
  });
  EXPECT_TRUE(st.ok()) << st;
}

// Freezing a block after fully_shard: its shards get no gradient and stay as they are; the rest trains.
TEST(FsdpFreeze, FreezingAShardedBlockLaterStopsItsUpdates) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    gpt_tiny::FreezeBlock0(model);
    const auto block0_before = gpt_tiny::Values(*(*model.blocks)[0]);
    const auto block1_before = gpt_tiny::Values(*(*model.blocks)[1]);
    if (absl::Status s = test_util::TrainRows(model, **opt, env.rank, 2, 0, 2); !s.ok()) return s;
    EXPECT_EQ(gpt_tiny::Values(*(*model.blocks)[0]), block0_before);
    EXPECT_NE(gpt_tiny::Values(*(*model.blocks)[1]), block1_before);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(FsdpErrors, ContainerTwiceAndSharedWithASibling) {
  absl::Status st = comm::RunRanks(1, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto list = fully_shard(*model.blocks, env.group_ptr);
    EXPECT_EQ(list.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(list.status().message()), ::testing::HasSubstr("ModuleList has no forward of its own"));
    if (auto s = fully_shard(*(*model.blocks)[0], env.group_ptr); !s.ok()) return s.status();
    auto twice = fully_shard(*(*model.blocks)[0], env.group_ptr);
    EXPECT_EQ(twice.status().code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(twice.status().message()), ::testing::HasSubstr("already sharded"));
    // The tied embedding: sharding lm_head alone takes wte's weight from the root's other use.
    if (auto s = fully_shard(*model.lm_head, env.group_ptr); !s.ok()) return s.status();
    auto shared = fully_shard(*model.wte, env.group_ptr);
    EXPECT_EQ(shared.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(shared.status().message()),
                ::testing::HasSubstr("parameter 'weight' of this Embedding has no bytes: another fully_shard call"));
    EXPECT_EQ(state_of(*model.wpe).status().code(), absl::StatusCode::kNotFound);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// A sharded module of another model run inside the root's forward: refused, naming both.
class TwoModels : public nn::Module {
 public:
  TwoModels(nn::Module& inner, nn::Module& outside) : Module("TwoModels"), inner_(inner), outside_(outside) {}
  nn::Module& inner_;
  nn::Module& outside_;

 protected:
  Tensor forward(const Tensor& x) override { return outside_(inner_(x)); }
};

TEST(FsdpErrors, UnitOutsideTheRootIsRefused) {
  absl::Status st = comm::RunRanks(1, [&](comm::RankEnv& env) -> absl::Status {
    Generator gen(1);
    auto inner = std::make_shared<nn::Linear>(3, 3, gen);
    nn::Linear outside(3, 3, gen);
    TwoModels root(*inner, outside);
    root.register_module("inner", inner);
    if (auto s = fully_shard(outside, env.group_ptr); !s.ok()) return s.status();
    if (auto s = fully_shard(root, env.group_ptr); !s.ok()) return s.status();
    try {
      (void)root(Tensor::zeros({2, 3}));
      ADD_FAILURE() << "expected FsdpError";
    } catch (const FsdpError& e) {
      EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
      EXPECT_THAT(e.what(), ::testing::HasSubstr("a Linear sharded by fully_shard runs inside the forward of the root "
                                                 "TwoModels but is not one of its submodules"));
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// Calls in the wrong training state name both states.
TEST(FsdpErrors, ReshardInsideAForwardNamesBothStates) {
  absl::Status st = comm::RunRanks(1, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env); !s.ok()) return s;
    nn::Module& block = *(*model.blocks)[0];
    absl::Status inside;
    autograd::HookHandle h = block.register_forward_pre_hook([&](nn::Module&, const nn::TensorList&) -> std::optional<nn::TensorList> {
      inside = state_of(block)->reshard();
      return std::nullopt;
    });
    auto [x, y] = Batch(0, 0, 2);
    (void)model.loss(x, y);
    EXPECT_EQ(inside.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(inside.message()), ::testing::HasSubstr("reshard() on a TransformerBlock in training state "
                                                                   "forward; expected idle or summoned"));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// Bytes sent per rank per step, exactly (Note [ring-equivalent volume]): every unit all-gathered before its forward
// ((N-1)·4S), the blocks again before their backward (reshard_after_forward true; the root keeps its parameters),
// every unit's gradients reduce-scattered ((N-1)·4S): the 3Ψ class, and 2Ψ with reshard_after_forward false; plus
// one small all_reduce per unit of a flag per parameter.
// Own collectives (Note [own collectives], every parameter without padding: min numel 1) move the same bytes in
// more calls; with INT64_MAX every unit makes one all_gather per pass.
TEST(FsdpComm, BytesPerStepAreTheThreePsiClass) {
  for (const bool reshard : {true, false}) {
   for (const std::int64_t own_min : {std::int64_t{1}, std::int64_t{INT64_MAX}}) {
    SCOPED_TRACE(::testing::Message() << "own_collective_min_numel " << own_min);
    absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      const FullyShardOptions options{.reshard_after_forward = reshard, .own_collective_min_numel = own_min};
      if (absl::Status s = test_util::ShardGpt(model, env, options); !s.ok()) return s;
      const std::int64_t units = static_cast<std::int64_t>(modules_of_type(model, "TransformerBlock").size()) + 1;
      std::int64_t all = 0, blocks = 0;  // S summed over units (padding included)
      std::int64_t flags = 0;  // per unit, the all_reduce of a 4-byte "used" flag per parameter: 2 (N - 1) / N each
      for (nn::Module* m : modules_of_type(model, "TransformerBlock")) {
        blocks += state_of(*m)->state().param_group()->shard_numel();
        flags += 2 * 3 * 4 * static_cast<std::int64_t>(state_of(*m)->state().param_group()->params().size()) / 4;
      }
      all = blocks + state_of(model)->state().param_group()->shard_numel();
      flags += 2 * 3 * 4 * static_cast<std::int64_t>(state_of(model)->state().param_group()->params().size()) / 4;
      auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
      auto [x, y] = Batch(0, env.rank * 6, 6);
      const auto before = env.group.counters();
      (*opt)->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
      const comm::CommCounters step = env.group.counters().since(before);
      // (N - 1) = 3 ranks' worth of 4-byte elements: forward gathers, backward regathers, reduce-scatters; and
      // each unit's flags (Note [parameters no rank used] in fsdp/param_group.cc).
      EXPECT_EQ(step.total_sent(), 3 * 4 * (all + (reshard ? blocks : 0) + all) + flags) << "reshard " << reshard;
      const std::int64_t gathers = step.of(comm::CollectiveKind::all_gather).calls;
      const std::int64_t unit_gathers = units + (reshard ? units - 1 : 0);
      if (own_min == INT64_MAX) {
        EXPECT_EQ(gathers, unit_gathers) << "reshard " << reshard;
      } else {
        EXPECT_GT(gathers, unit_gathers) << "reshard " << reshard;
      }
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
   }
  }
}

// Parameter <-> name maps: clean names (no wrapper prefixes), the tied embedding listed under both of its names,
// each sharded parameter with its global shape and row offset.
TEST(FsdpNames, CleanNamesAndEveryNameOfASharedParameter) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    std::vector<std::string> want_first;
    std::vector<Shape> want_shapes;
    for (const auto& [name, t] : model.named_parameters()) want_first.push_back(name), want_shapes.push_back(t.shape());
    if (absl::Status s = test_util::ShardGpt(model, env, {}, /*nested=*/true); !s.ok()) return s;
    const std::vector<NamedParameter> named = named_parameters(model);
    EXPECT_EQ(named.size(), want_first.size());
    for (std::size_t i = 0; i < named.size() && i < want_first.size(); ++i) {
      EXPECT_EQ(named[i].names.front(), want_first[i]);
      if (!named[i].shard) {
        ADD_FAILURE() << want_first[i] << " is not sharded";
        continue;
      }
      EXPECT_EQ(named[i].shard->global_shape, want_shapes[i]) << want_first[i];
      EXPECT_TRUE(named[i].param.is_same(named[i].shard->local));
      EXPECT_EQ(named[i].shard->row_offset, env.rank == 0 ? 0 : (want_shapes[i][0] + 1) / 2) << want_first[i];
    }
    EXPECT_EQ(named.front().names, (std::vector<std::string>{"wte.weight", "lm_head.weight"}));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// A method other than forward that reads the parameters itself: without register_forward_method it would see
// the shard; registered, it runs FSDP's hooks (gather before, release after) and equals the unsharded result.
class Scaler : public nn::Module {
 public:
  explicit Scaler(Generator& gen) : Module("Scaler") { register_parameter("weight", Tensor::normal({6, 3}, gen, 0, 1)); }
  // sum over rows of weight, times x (elementwise): [3]
  Tensor column_sums() {
    return run_method("column_sums", {}, [this](const nn::TensorList&) -> nn::TensorList {
      const Tensor& w = parameter("weight");
      Tensor out = Tensor::zeros({w.size(1)});
      for (std::int64_t r = 0; r < w.size(0); ++r) {
        for (std::int64_t c = 0; c < w.size(1); ++c) out.data<float>()[c] += w.data<float>()[r * w.size(1) + c];
      }
      return {out};
    })[0];
  }

 protected:
  Tensor forward(const Tensor& x) override { return x; }
};

TEST(FsdpForwardMethod, RegisteredMethodSeesTheUnshardedParameters) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    Generator gen(5);
    Scaler m(gen);
    const std::vector<float> want = m.column_sums().to_vector();
    EXPECT_EQ(register_forward_method(m, "column_sums").code(), absl::StatusCode::kNotFound);
    auto unit = fully_shard(m, env.group_ptr);
    if (!unit.ok()) return unit.status();
    EXPECT_EQ(m.parameter("weight").shape(), (Shape{3, 3})) << "at rest: the shard";
    if (absl::Status s = register_forward_method(m, "column_sums"); !s.ok()) return s;
    EXPECT_EQ(m.column_sums().to_vector(), want);
    EXPECT_EQ(m.parameter("weight").shape(), (Shape{3, 3})) << "released after the method";
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::fsdp
