// DataParallelOptions::mixed_precision (Note [mixed precision on f32 ops], Note [rounded parameters in forward] in
// common/nn/mixed_precision.h): bf16 DDP, OSS + DDP and ShardedDDP (greedy, flat, flat to owner) equal bitwise to
// single-rank training with the same casts at N = 1, 2, 3, 4, 8; the reductions move half the bytes; the parameters
// stay f32 masters; activation checkpointing changes nothing; a dtype that is not floating is refused.
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/comm/testing/run_ranks.h"
#include "common/autograd/grad_mode.h"
#include "common/nn/checkpoint.h"
#include "common/nn/mixed_precision.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"
#include "tests/sddp/sddp_test_util.h"

namespace shardkit::sddp {
namespace {

using ::testing::HasSubstr;
using test_util::Batch;
using test_util::kBatch;
using test_util::TinyConfig;
using test_util::Values;

const nn::MixedPrecisionPolicy kBf16{.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};

enum class Mode { ddp, oss_ddp, sddp_greedy, sddp_flat, sddp_flat_owner };
constexpr Mode kModes[] = {Mode::ddp, Mode::oss_ddp, Mode::sddp_greedy, Mode::sddp_flat, Mode::sddp_flat_owner};

const char* ModeName(Mode m) {
  switch (m) {
    case Mode::ddp: return "ddp";
    case Mode::oss_ddp: return "oss_ddp";
    case Mode::sddp_greedy: return "sddp_greedy";
    case Mode::sddp_flat: return "sddp_flat";
    case Mode::sddp_flat_owner: return "sddp_flat_owner";
  }
  return "?";
}

// One rank's wrapper and optimizer for `mode` (tiny buckets: many reductions per backward).
struct Trainer {
  std::unique_ptr<optim::Optimizer> plain;
  std::unique_ptr<oss::Oss> oss;
  std::unique_ptr<DataParallel> dp;

  static absl::StatusOr<Trainer> make(Mode mode, nn::GPT& model, std::shared_ptr<comm::ProcessGroup> pg,
                                      DataParallelOptions options,
                                      std::optional<DType> broadcast_dtype = std::nullopt) {
    Trainer t;
    std::vector<optim::ParamGroup> groups{{model.parameters(), optim::AdamW::default_hyper()}};
    if (mode == Mode::ddp) {
      auto o = optim::AdamW::factory()(groups);
      if (!o.ok()) return o.status();
      t.plain = std::move(*o);
    } else {
      const bool flat = mode == Mode::sddp_flat || mode == Mode::sddp_flat_owner;
      auto o = oss::Oss::create(groups, optim::AdamW::factory(), pg,
                                {.policy = flat ? oss::PartitionPolicy::flat : oss::PartitionPolicy::greedy,
                                 .bucket_bytes = 4096,
                                 .broadcast_dtype = broadcast_dtype,
                                 .flat_chunk_numel = options.reduce_buffer_size});
      if (!o.ok()) return o.status();
      t.oss = std::move(*o);
    }
    if (mode == Mode::ddp || mode == Mode::oss_ddp) {
      auto d = DistributedDataParallel::create(model, pg, options);
      if (!d.ok()) return d.status();
      t.dp = std::move(*d);
    } else {
      options.flat_reduce_scatter = mode != Mode::sddp_flat_owner;
      auto d = ShardedDataParallel::create(model, {t.oss.get()}, pg, options);
      if (!d.ok()) return d.status();
      t.dp = std::move(*d);
    }
    return t;
  }
  void zero_grad() {
    if (plain) plain->zero_grad();
    if (oss) oss->zero_grad();
  }
  absl::Status step() { return plain ? plain->step() : oss->step(); }
};

absl::Status RunSteps(Mode mode, comm::RankEnv& env, nn::GPT& model, int steps, const DataParallelOptions& options,
                      std::optional<DType> broadcast_dtype = std::nullopt) {
  auto t = Trainer::make(mode, model, env.group_ptr, options, broadcast_dtype);
  if (!t.ok()) return t.status();
  const int rows = kBatch / env.world_size;
  for (int step = 0; step < steps; ++step) {
    auto [x, y] = Batch(step, env.rank * rows, rows);
    t->zero_grad();
    if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
    if (absl::Status s = t->step(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

std::vector<std::vector<std::vector<float>>> Train(Mode mode, int world, int steps, const DataParallelOptions& options,
                                                   bool checkpoint = false,
                                                   std::optional<DType> broadcast_dtype = std::nullopt) {
  std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (checkpoint) {
      if (absl::Status s = nn::checkpoint_blocks(model); !s.ok()) return s;
    }
    if (absl::Status s = RunSteps(mode, env, model, steps, options, broadcast_dtype); !s.ok()) return s;
    got[static_cast<std::size_t>(env.rank)] = Values(model);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

// Single-rank training with the wrapper's casts done by hand, for `world` ranks' rows: an f32 master model stepped
// by AdamW; each step a compute model gets the master's values rounded to bf16 (the inputs are tokens: nothing to
// round), each rank's rows give an f32 gradient, which the reducer scales by 1/world in f32 and rounds to bf16 on
// its way into the bucket; the backends sum the ranks' bf16 values in f32 in rank order and round once
// (process_group.h); the master's gradient is that, f32. `round_after_step`: the parameters are rounded to bf16
// after each step (what OssOptions::broadcast_dtype bf16 does on every rank, the owner included).
std::vector<std::vector<float>> Bf16Reference(int steps, int world, bool round_after_step = false) {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT master(TinyConfig(), 1), compute(TinyConfig(), 1);
  auto opt = optim::AdamW::factory()({{master.parameters(), optim::AdamW::default_hyper()}});
  const std::vector<Tensor> mp = master.parameters(), cp = compute.parameters();
  const int rows = kBatch / world;
  const float scale = 1.0f / static_cast<float>(world);
  for (int step = 0; step < steps; ++step) {
    for (std::size_t i = 0; i < mp.size(); ++i) cp[i].copy_(mp[i].to(DType::bf16));
    std::vector<std::vector<float>> sum(mp.size());
    for (int r = 0; r < world; ++r) {
      for (const Tensor& p : cp) p.set_grad(Tensor());
      auto [x, y] = Batch(step, r * rows, rows);
      autograd::backward(compute.loss(x, y));
      for (std::size_t i = 0; i < mp.size(); ++i) {
        std::vector<float> g = cp[i].grad().to_vector();
        for (float& v : g) v *= scale;
        g = Tensor::from_vector(g, {static_cast<std::int64_t>(g.size())}, TensorOptions{}.with_dtype(DType::bf16)).to_vector();
        if (r == 0) {
          sum[i] = g;
        } else {
          for (std::size_t k = 0; k < g.size(); ++k) sum[i][k] += g[k];
        }
      }
    }
    (*opt)->zero_grad();
    for (std::size_t i = 0; i < mp.size(); ++i) {
      mp[i].set_grad(Tensor::from_vector(sum[i], mp[i].shape()).to(DType::bf16).to(DType::f32));
    }
    EXPECT_TRUE((*opt)->step().ok());
    if (round_after_step) {
      for (const Tensor& p : mp) p.copy_(p.to(DType::bf16));
    }
  }
  return Values(master);
}

// The same casts at the same points give the same parameters, bitwise, for every wrapper at every world size.
TEST(SddpMixedPrecision, Bf16EqualsSingleRankTrainingWithTheSameCasts) {
  for (const int world : {1, 2, 3, 4, 8}) {
    const auto want = Bf16Reference(20, world);
    for (const Mode mode : kModes) {
      SCOPED_TRACE(::testing::Message() << ModeName(mode) << " n=" << world);
      test_util::ExpectMatches(Train(mode, world, 20, {.reduce_buffer_size = 300, .mixed_precision = kBf16}), want, 0.0);
    }
  }
}

// With OSS sending parameters in bf16 (OssOptions::broadcast_dtype; every rank, the owner included, then holds them
// rounded, so there is no f32 master left): equal to the reference that rounds the parameters after each step.
TEST(SddpMixedPrecision, WithOssBroadcastDtypeBf16EqualsTheReferenceThatRoundsAfterEachStep) {
  ASSERT_NE(Bf16Reference(10, 2, /*round_after_step=*/true), Bf16Reference(10, 2));  // the rounding shows
  for (const int world : {2, 3, 4}) {
    const auto want = Bf16Reference(10, world, /*round_after_step=*/true);
    for (const Mode mode : {Mode::oss_ddp, Mode::sddp_greedy, Mode::sddp_flat}) {
      SCOPED_TRACE(::testing::Message() << ModeName(mode) << " n=" << world);
      test_util::ExpectMatches(Train(mode, world, 10, {.reduce_buffer_size = 300, .mixed_precision = kBf16},
                                     /*checkpoint=*/false, DType::bf16),
                               want, 0.0);
    }
  }
}

// And the casts matter: bf16 training ends away from f32 training, and away from bf16 reduction alone (so the test
// above could fail on either cast).
TEST(SddpMixedPrecision, Bf16TrainingDiffersFromF32AndFromBf16ReductionAlone) {
  const auto bf16 = Train(Mode::ddp, 2, 5, {.mixed_precision = kBf16});
  EXPECT_NE(bf16[0], test_util::Reference(5));
  EXPECT_NE(bf16[0], Train(Mode::ddp, 2, 5, {.mixed_precision = {.reduce_dtype = DType::bf16}})[0]);
}

// The parameters stay f32 masters: after bf16 training some values are off the bf16 grid; the module's parameters
// are the same tensors after a forward as before (the rounded copies were swapped out again), also after a
// forward without grad.
TEST(SddpMixedPrecision, ParametersStayF32Masters) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto t = Trainer::make(Mode::ddp, model, env.group_ptr, {.mixed_precision = kBf16});
    if (!t.ok()) return t.status();
    const std::vector<Tensor> before = model.parameters();
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = Batch(step, env.rank * kBatch / 2, kBatch / 2);
      t->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    {
      autograd::NoGradGuard no_grad;
      auto [x, y] = Batch(0, 0, 2);
      (void)model(x);
    }
    const std::vector<Tensor> after = model.parameters();
    EXPECT_EQ(after.size(), before.size());
    for (std::size_t i = 0; i < after.size() && i < before.size(); ++i) EXPECT_TRUE(after[i].is_same(before[i])) << i;
    std::int64_t off_grid = 0;
    for (const Tensor& p : after) {
      const std::vector<float> v = p.to_vector(), r = p.to(DType::bf16).to_vector();
      for (std::size_t k = 0; k < v.size(); ++k) off_grid += v[k] != r[k];
    }
    EXPECT_GT(off_grid, 0) << "every parameter is a bf16 value: the f32 master was overwritten";
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// The reductions (all_reduce, reduce, reduce_scatter) move exactly half of f32's bytes with reduce_dtype bf16.
TEST(SddpMixedPrecision, ReductionBytesAreHalvedUnderBf16) {
  for (const Mode mode : kModes) {
    SCOPED_TRACE(ModeName(mode));
    std::int64_t sent[2] = {0, 0};
    for (const bool bf16 : {false, true}) {
      absl::Status st = comm::RunRanks(4, [&](comm::RankEnv& env) -> absl::Status {
        nn::GPT model(TinyConfig(), 1);
        DataParallelOptions options{.reduce_buffer_size = 300};
        if (bf16) options.mixed_precision = kBf16;
        const comm::CommCounters start = env.group.counters();
        if (absl::Status s = RunSteps(mode, env, model, 2, options); !s.ok()) return s;
        if (env.rank == 0) {
          const comm::CommCounters c = env.group.counters().since(start);
          sent[bf16] = c.of(comm::CollectiveKind::all_reduce).bytes_sent + c.of(comm::CollectiveKind::reduce).bytes_sent +
                       c.of(comm::CollectiveKind::reduce_scatter).bytes_sent;
        }
        return absl::OkStatus();
      });
      ASSERT_TRUE(st.ok()) << st;
    }
    EXPECT_GT(sent[0], 0);
    EXPECT_EQ(2 * sent[1], sent[0]);
  }
}

// An activation checkpoint's recompute runs on the rounded parameters too: checkpointing every block changes
// nothing, bitwise.
TEST(SddpMixedPrecision, ActivationCheckpointingChangesNothing) {
  for (const Mode mode : {Mode::ddp, Mode::sddp_flat}) {
    SCOPED_TRACE(ModeName(mode));
    const DataParallelOptions options{.reduce_buffer_size = 300, .mixed_precision = kBf16};
    const auto with = Train(mode, 2, 5, options, /*checkpoint=*/true);
    const auto without = Train(mode, 2, 5, options);
    EXPECT_EQ(with, without);
  }
}

// A dtype that is not floating is refused at create(), naming the wrapper, the field and the dtype.
TEST(SddpMixedPrecision, NonFloatingDtypeIsInvalidArgument) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    auto ddp = DistributedDataParallel::create(model, env.group_ptr, {.mixed_precision = {.param_dtype = DType::i64}});
    EXPECT_EQ(ddp.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(ddp.status().message()),
                HasSubstr("DistributedDataParallel: expected mixed_precision.param_dtype a floating dtype (f32, bf16 or "
                          "f16), found i64"));
    auto oss = oss::Oss::create({{model.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(),
                                env.group_ptr);
    if (!oss.ok()) return oss.status();
    auto sddp = ShardedDataParallel::create(model, {oss->get()}, env.group_ptr,
                                            {.mixed_precision = {.param_dtype = DType::bf16, .reduce_dtype = DType::i64}});
    EXPECT_EQ(sddp.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(sddp.status().message()),
                HasSubstr("ShardedDataParallel: expected mixed_precision.reduce_dtype a floating dtype (f32, bf16 or "
                          "f16), found i64"));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::sddp
