// ShardedDataParallel / DistributedDataParallel: bucket policies, construction checks, buffers, errors,
// the per-rank gradient ledger and the bytes sent per step.
#include <algorithm>
#include <cstdio>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/autograd/hooks.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/models.h"
#include "common/optim/sgd.h"
#include "oss/oss.h"
#include "sddp/bucketing.h"
#include "sddp/data_parallel.h"
#include "sddp/grad_scaler.h"
#include "sddp/model_sync.h"
#include "tests/sddp/sddp_test_util.h"

namespace shardkit::sddp {
namespace {

using ::testing::HasSubstr;
using test_util::Batch;
using test_util::kBatch;
using test_util::TinyConfig;

// ---- bucket policies (pure functions) ----

TEST(AssignBuckets, FollowsReadyOrderNotSizeAndKeepsKeysApart) {
  // ready order 3, 2, 1, 0; sizes 5, 100, 5, 5; cap 12; params 0 and 2 owned by key 1, others key 0.
  const std::vector<int> order{3, 2, 1, 0};
  const std::vector<std::int64_t> numel{5, 100, 5, 5};
  const std::vector<int> key{1, 0, 1, 0};
  const auto b = assign_buckets(order, numel, key, 12);
  // Launch order is by last member's ready position: {3} (the only small key-0 parameter), then the large param 1 alone, then {2, 0} of key 1.
  ASSERT_EQ(b.size(), 3u);
  EXPECT_EQ(b[0], std::vector<int>({3}));
  EXPECT_EQ(b[1], std::vector<int>({1}));
  EXPECT_EQ(b[2], std::vector<int>({2, 0}));
  // cap 0: one bucket per parameter, in ready order.
  const auto none = assign_buckets(order, numel, key, 0);
  ASSERT_EQ(none.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_EQ(none[static_cast<std::size_t>(i)], std::vector<int>({3 - i}));
  // cap 10, one key: buckets close when the next parameter does not fit.
  const auto full = assign_buckets(std::vector<int>{0, 1, 2}, std::vector<std::int64_t>{4, 4, 4},
                                   std::vector<int>{0, 0, 0}, 10);
  ASSERT_EQ(full.size(), 2u);
  EXPECT_EQ(full[0], std::vector<int>({0, 1}));
  EXPECT_EQ(full[1], std::vector<int>({2}));
}

TEST(AssignColumns, EqualSegmentsCoverEveryRankRange) {
  // 3 params of 5, 7, 4 elements (total 16) over 3 ranks: shard 6, ranges [0,6) [6,12) [12,16).
  const oss::FlatChunk g{.group = 0, .base = 0, .total = 16, .shard_size = 6};
  const std::vector<FlatMember> members{{0, 0, 5}, {1, 5, 7}, {2, 12, 4}};
  const auto cols = assign_columns(0, g, members, 3, 4);
  ASSERT_EQ(cols.size(), 2u);  // widths 4 and 2
  EXPECT_EQ(cols[0].width, 4);
  EXPECT_EQ(cols[1].width, 2);
  std::int64_t covered = 0;
  for (const auto& c : cols) {
    for (const auto& p : c.pieces) {
      covered += p.length;
      EXPECT_LE(p.segment_offset + p.length, c.width);
    }
  }
  EXPECT_EQ(covered, 16);
  // rank 1's range starts inside param 1 at element 1 (flat 6).
  EXPECT_EQ(cols[0].pieces[1], (ColumnPiece{1, 1, 1, 0, 4}));
  // A gap (param 1 frozen, not a member) is skipped.
  const std::vector<FlatMember> gap{{0, 0, 5}, {2, 12, 4}};
  std::int64_t n = 0;
  for (const auto& c : assign_columns(0, g, gap, 3, 0)) {
    for (const auto& p : c.pieces) n += p.length;
  }
  EXPECT_EQ(n, 9);
  // The same chunk starting at flat element 100 of its group (Note [flat chunks]) gives the same pieces.
  const oss::FlatChunk later{.group = 0, .base = 100, .total = 16, .shard_size = 6};
  const std::vector<FlatMember> moved{{0, 100, 5}, {1, 105, 7}, {2, 112, 4}};
  const auto moved_cols = assign_columns(0, later, moved, 3, 4);
  ASSERT_EQ(moved_cols.size(), cols.size());
  for (std::size_t k = 0; k < cols.size(); ++k) EXPECT_EQ(moved_cols[k].pieces, cols[k].pieces);
}

// ---- construction ----

TEST(Construction, ARankWhoseModelDiffersIsRefusedNamingTheParameter) {
  absl::Status st = comm::RunRanks(3, [](comm::RankEnv& env) {
    Generator gen(5);
    auto model = nn::make_mlp({4, env.rank == 2 ? 9 : 8, 2}, gen);
    auto dp = DistributedDataParallel::create(*model, env.group_ptr);
    ASSERT_FALSE(dp.ok());
    EXPECT_EQ(dp.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(dp.status().message()),
                HasSubstr("model on rank 2 differs from rank 0 at entry 0: expected 'param 0.weight f32[8, 4]', "
                          "found 'param 0.weight f32[9, 4]'"));
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(Construction, BroadcastsRankZerosParametersAndBuffers) {
  absl::Status st = comm::RunRanks(2, [](comm::RankEnv& env) {
    Generator gen(static_cast<std::uint64_t>(10 + env.rank));  // different values per rank
    auto model = nn::make_batchnorm_mlp({4, 8, 2}, gen);
    model->named_buffers()[0].second.fill_(env.rank + 1.0);
    auto dp = DistributedDataParallel::create(*model, env.group_ptr);
    ASSERT_TRUE(dp.ok()) << dp.status();
    Generator ref_gen(10);
    auto ref = nn::make_batchnorm_mlp({4, 8, 2}, ref_gen);
    for (std::size_t i = 0; i < model->parameters().size(); ++i) {
      EXPECT_EQ(model->parameters()[i].to_vector(), ref->parameters()[i].to_vector());
    }
    EXPECT_EQ(model->named_buffers()[0].second.to_vector()[0], 1.0f);
  });
  EXPECT_TRUE(st.ok()) << st;
}

TEST(Construction, ShardedNeedsEveryTrainableParameterInAnOptimizer) {
  absl::Status st = comm::RunRanks(2, [](comm::RankEnv& env) {
    Generator gen(5);
    auto model = nn::make_mlp({4, 8, 2}, gen);
    auto params = model->parameters();
    params.pop_back();
    auto oss = oss::Oss::create({{params, {}}}, optim::Sgd::factory({.lr = 0.1}), env.group_ptr);
    ASSERT_TRUE(oss.ok());
    auto dp = ShardedDataParallel::create(*model, {oss->get()}, env.group_ptr);
    ASSERT_FALSE(dp.ok());
    EXPECT_THAT(std::string(dp.status().message()), HasSubstr("found '2.bias' in none"));
  });
  EXPECT_TRUE(st.ok()) << st;
}

// A parameter frozen and left out of the Oss when ShardedDataParallel was built, then unfrozen: the next
// forward refuses with a FailedPrecondition that says what to do (a user mistake, not an internal check),
// and once the parameter is in an Oss param group the same wrapper trains it.
TEST(Construction, UnfreezingAParameterNoOssHoldsIsAFailedPrecondition) {
  for (const oss::PartitionPolicy policy : {oss::PartitionPolicy::greedy, oss::PartitionPolicy::flat}) {
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) {
      Generator gen(5);
      auto model = nn::make_mlp({4, 8, 2}, gen);
      auto params = model->parameters();
      const Tensor bias = params.back();
      bias.set_requires_grad(false);
      params.pop_back();
      auto oss = oss::Oss::create({{params, {}}}, optim::Sgd::factory({.lr = 0.1}), env.group_ptr, {.policy = policy});
      ASSERT_TRUE(oss.ok()) << oss.status();
      auto dp = ShardedDataParallel::create(*model, {oss->get()}, env.group_ptr);
      ASSERT_TRUE(dp.ok()) << dp.status();
      bias.set_requires_grad(true);
      const Tensor x = Tensor::uniform({3, 4}, gen, -1, 1);
      try {
        (void)(**dp)(x);
        ADD_FAILURE() << "expected a ReducerError from the forward";
      } catch (const ReducerError& e) {
        EXPECT_EQ(e.status().code(), absl::StatusCode::kFailedPrecondition);
        EXPECT_THAT(std::string(e.status().message()),
                    HasSubstr("parameter '2.bias' is trainable but no Oss holds it"));
        EXPECT_THAT(std::string(e.status().message()), HasSubstr("Oss::add_param_group"));
      }
      // Asked directly, refresh_trainable() returns the same Status.
      const absl::Status refreshed = (*dp)->refresh_trainable();
      EXPECT_EQ(refreshed.code(), absl::StatusCode::kFailedPrecondition) << refreshed;
      // Nothing was changed: with the parameter in an Oss group, the next forward rebuilds the reducer and
      // the parameter trains (its gradient is reduced to its owner, which steps it).
      ASSERT_TRUE((*oss)->add_param_group({{bias}, {.lr = 0.1}}).ok());
      const std::vector<float> before = bias.to_vector();
      (*oss)->zero_grad();
      const absl::Status backward = autograd::try_backward(autograd::sum((**dp)(x)));
      ASSERT_TRUE(backward.ok()) << backward;
      ASSERT_TRUE((*oss)->step().ok());
      EXPECT_NE(bias.to_vector(), before);
      EXPECT_EQ((*dp)->trainable_numel(), 4 * 8 + 8 + 8 * 2 + 2);
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

// ---- errors during backward ----

TEST(Reducer, AGradientMarkedReadyTwiceInOneBackwardIsAClearError) {
  absl::Status st = comm::RunRanks(1, [](comm::RankEnv& env) {
    Generator gen(5);
    auto model = nn::make_mlp({4, 8, 2}, gen);
    auto dp = DistributedDataParallel::create(*model, env.group_ptr);
    ASSERT_TRUE(dp.ok());
    const Tensor w = model->parameters()[0];
    auto again = autograd::register_post_accumulate_grad_hook(w, [&](const Tensor&) { (*dp)->mutable_reducer().mark_ready(0); });
    Tensor x = Tensor::uniform({3, 4}, gen, -1, 1);
    absl::Status s = autograd::try_backward(autograd::sum((*model)(x)));
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()), HasSubstr("gradient of parameter '0.weight' marked ready twice in one backward"));
    // The next backward starts clean.
    again.remove();
    model->zero_grad();
    EXPECT_TRUE(autograd::try_backward(autograd::sum((*model)(x))).ok());
  });
  EXPECT_TRUE(st.ok()) << st;
}

// ---- buffers ----

// BatchNorm running statistics differ per rank (each rank sees its own batch). With broadcast_buffers
// every forward starts from rank 0's buffers; without, ranks drift apart.
TEST(Buffers, BroadcastBuffersKeepsBatchNormStatisticsOnRankZeros) {
  for (const bool broadcast : {true, false}) {
    std::vector<std::vector<std::vector<float>>> seen(2);  // [rank][forward]
    std::vector<std::vector<float>> after(2);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) {
      Generator gen(5);
      auto model = nn::make_batchnorm_mlp({4, 8, 2}, gen);
      auto oss = oss::Oss::create({{model->parameters(), {}}}, optim::Sgd::factory({.lr = 0.1}), env.group_ptr);
      ASSERT_TRUE(oss.ok());
      auto dp = ShardedDataParallel::create(*model, {oss->get()}, env.group_ptr,
                                            {.broadcast_buffers = broadcast, .reduce_buffer_size = 16});
      ASSERT_TRUE(dp.ok()) << dp.status();
      const Tensor mean = model->named_buffers()[0].second;
      // Registered after the wrapper's hook, so it sees the buffers the forward will use.
      auto probe = model->register_forward_pre_hook([&](nn::Module&, const nn::TensorList&) -> std::optional<nn::TensorList> {
        seen[static_cast<std::size_t>(env.rank)].push_back(mean.to_vector());
        return std::nullopt;
      });
      Generator data(77, static_cast<std::uint64_t>(env.rank));
      for (int step = 0; step < 3; ++step) {
        (*oss)->zero_grad();
        Tensor x = Tensor::uniform({6, 4}, data, -1, 2);
        autograd::backward(autograd::sum((*model)(x)));
        ASSERT_TRUE((*oss)->step().ok());
      }
      after[static_cast<std::size_t>(env.rank)] = mean.to_vector();
      // Parameters stay identical either way (gradients are reduced).
    });
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(seen[0].size(), 3u);
    ASSERT_EQ(seen[1].size(), 3u);
    for (int step = 1; step < 3; ++step) {
      if (broadcast) {
        EXPECT_EQ(seen[0][static_cast<std::size_t>(step)], seen[1][static_cast<std::size_t>(step)]) << "step " << step;
      } else {
        EXPECT_NE(seen[0][static_cast<std::size_t>(step)], seen[1][static_cast<std::size_t>(step)]) << "step " << step;
      }
    }
    // Either way the last forward updated each rank's own copy from its own batch.
    EXPECT_NE(after[0], after[1]);
  }
}

TEST(Buffers, SyncBuffersByHand) {
  absl::Status st = comm::RunRanks(3, [](comm::RankEnv& env) {
    Generator gen(5);
    auto model = nn::make_batchnorm_mlp({4, 8, 2}, gen);
    auto dp = DistributedDataParallel::create(*model, env.group_ptr);
    ASSERT_TRUE(dp.ok());
    const Tensor mean = model->named_buffers()[0].second;
    mean.fill_(env.rank);
    ASSERT_TRUE((*dp)->sync_buffers(/*blocking=*/false).ok());
    ASSERT_TRUE((*dp)->wait_for_buffers().ok());
    EXPECT_EQ(mean.to_vector(), std::vector<float>(8, 0.0f));
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::sddp

namespace shardkit::sddp {
namespace {

using test_util::Batch;
using test_util::kBatch;
using test_util::TinyConfig;
using test_util::Values;

// ---- sharded grad scaler ----

// Only rank 1 holds an inf: every rank learns it from the one all_reduce and skips the step (fairscale #179);
// the scale backs off. Clean steps unscale exactly and step everywhere; the scale grows after the interval.
TEST(ShardedGradScaler, FoundInfIsAgreedByEveryRankBeforeAnyoneSteps) {
  absl::Status st = comm::RunRanks(3, [](comm::RankEnv& env) {
    ShardedGradScaler scaler(env.group_ptr, {.init_scale = 8.0, .growth_interval = 2});
    Tensor g32 = Tensor::full({5}, 4.0);
    Tensor g16 = Tensor::full({3}, 2.0, TensorOptions{}.with_dtype(DType::f16));
    if (env.rank == 1) g16.data<f16_t>()[2] = f32_to_f16(INFINITY);
    int steps = 0;
    auto stepped = scaler.step({g32, g16}, [&] { ++steps; return absl::OkStatus(); });
    ASSERT_TRUE(stepped.ok());
    EXPECT_FALSE(*stepped);
    EXPECT_EQ(steps, 0);
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 4.0);
    for (int i = 0; i < 2; ++i) {
      Tensor g = Tensor::full({4}, 8.0);
      auto ok = scaler.step({g}, [&] { ++steps; return absl::OkStatus(); });
      ASSERT_TRUE(ok.ok());
      EXPECT_TRUE(*ok);
      EXPECT_EQ(g.to_vector(), std::vector<float>(4, 2.0f));
      scaler.update();
    }
    EXPECT_EQ(steps, 2);
    EXPECT_EQ(scaler.get_scale(), 8.0);  // grew after 2 clean steps
  });
  EXPECT_TRUE(st.ok()) << st;
}

// With a power-of-two scale the loss scaling is exact: GPT-tiny trained through ShardedDDP + scaler equals
// single-rank training without it. SGD (not Adam, which is nearly scale-invariant) so that a gradient left
// scaled would show.
TEST(ShardedGradScaler, ScaledShardedTrainingEqualsUnscaledReference) {
  const auto sgd = optim::Sgd::factory();  // the groups carry lr 1e-3 (AdamW::default_hyper, as the reference)
  const auto want = test_util::Reference(5, -1, sgd);
  for (const auto policy : {oss::PartitionPolicy::greedy, oss::PartitionPolicy::flat}) {
    std::vector<std::vector<std::vector<float>>> got(2);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      auto oss = oss::Oss::create({{model.parameters(), optim::AdamW::default_hyper()}}, sgd, env.group_ptr,
                                  {.policy = policy});
      if (!oss.ok()) return oss.status();
      auto dp = ShardedDataParallel::create(model, {oss->get()}, env.group_ptr, {.reduce_buffer_size = 500});
      if (!dp.ok()) return dp.status();
      ShardedGradScaler scaler(env.group_ptr, {.init_scale = 1024.0});
      for (int step = 0; step < 5; ++step) {
        auto [x, y] = Batch(step, env.rank * kBatch / 2, kBatch / 2);
        (*oss)->zero_grad();
        if (absl::Status s = autograd::try_backward(scaler.scale(model.loss(x, y))); !s.ok()) return s;
        auto stepped = scaler.step((*dp)->held_gradients(), [&] { return (*oss)->step(); });
        if (!stepped.ok()) return stepped.status();
        if (!*stepped) return absl::InternalError("unexpected overflow");
        scaler.update();
      }
      got[static_cast<std::size_t>(env.rank)] = Values(model);
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    test_util::ExpectMatches(got, want, 2e-5);
  }
}

// mixed_precision.reduce_dtype f16 alone: gradients travel in f16 (half the bytes), the forward stays f32;
// training stays close to the f32 reference.
TEST(ReduceDtype, F16HalvesGradientBytesAndStaysClose) {
  const auto want = test_util::Reference(5);
  for (const bool flat : {false, true}) {
    std::vector<std::vector<std::vector<float>>> got(2);
    std::vector<std::int64_t> grad_sent(2);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(TinyConfig(), 1);
      auto oss = oss::Oss::create({{model.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(),
                                  env.group_ptr, {.policy = flat ? oss::PartitionPolicy::flat : oss::PartitionPolicy::greedy});
      if (!oss.ok()) return oss.status();
      auto dp = ShardedDataParallel::create(model, {oss->get()}, env.group_ptr,
                                            {.reduce_buffer_size = 500, .mixed_precision = {.reduce_dtype = DType::f16}});
      if (!dp.ok()) return dp.status();
      for (int step = 0; step < 5; ++step) {
        auto [x, y] = Batch(step, env.rank * kBatch / 2, kBatch / 2);
        (*oss)->zero_grad();
        Tensor loss = model.loss(x, y);
        const auto before = env.group.counters();
        if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
        grad_sent[static_cast<std::size_t>(env.rank)] = env.group.counters().since(before).total_sent();
        if (absl::Status s = (*oss)->step(); !s.ok()) return s;
      }
      got[static_cast<std::size_t>(env.rank)] = Values(model);
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    const nn::GPT reference(TinyConfig(), 1);
    const std::int64_t psi = reference.num_parameters();
    // Plus each rank's all_reduce of one f16 "used" flag per parameter (Note [parameters no rank used] in
    // sddp/reducer.cc): 2 (n-1) / n · 2 bytes each.
    const auto flags = static_cast<std::int64_t>(reference.parameters().size()) * 2;
    EXPECT_EQ(grad_sent[0] + grad_sent[1], psi * 2 + 2 * flags) << "f16: (n-1)·Ψ·2 bytes over both ranks";
    test_util::ExpectMatches(got, want, 2e-3);
  }
}

}  // namespace
}  // namespace shardkit::sddp

namespace shardkit::sddp {
namespace {

// Note [ready-order buckets]: after the first backward the buckets follow the observed ready order, so with
// one parameter per bucket every reduction except the last-ready parameter's (GPT: the tied embedding, whose
// gradient completes with the embedding lookup, the backward's last node) is issued from an earlier hook.
TEST(ReadyOrder, BucketsAreRebuiltInObservedOrderAndOverlapEverythingButTheLastGradient) {
  absl::Status st = comm::RunRanks(2, [](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(test_util::TinyConfig(), 1);
    auto dp = DistributedDataParallel::create(model, env.group_ptr, {.reduce_buffer_size = 0});
    if (!dp.ok()) return dp.status();
    EXPECT_FALSE((*dp)->reducer().buckets_rebuilt());
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = test_util::Batch(step, env.rank * 12, 12);
      model.zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      const ReductionStats& s = (*dp)->last_backward_stats();
      EXPECT_TRUE((*dp)->reducer().buckets_rebuilt());
      EXPECT_EQ(s.buckets, static_cast<std::int64_t>(model.parameters().size()));
      EXPECT_EQ(s.grad_bytes, model.num_parameters() * 4);
      if (step > 0) {
        const std::int64_t wte = model.named_parameters()[0].second.numel() * 4;
        EXPECT_EQ(model.named_parameters()[0].first, "wte.weight");
        EXPECT_EQ(s.overlapped_bytes, s.grad_bytes - wte) << "step " << step;
        // The last bucket launched is the tied embedding's.
        EXPECT_EQ((*dp)->reducer().bucket_params((*dp)->num_buckets() - 1), std::vector<int>({0}));
      }
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// Two Oss objects (two optimizers, each over half the model) behind one ShardedDataParallel.
TEST(MultipleOptimizers, TwoOssEqualSingleRankTraining) {
  const auto want = test_util::Reference(5);
  for (const auto policy : {oss::PartitionPolicy::greedy, oss::PartitionPolicy::flat}) {
    std::vector<std::vector<std::vector<float>>> got(3);
    absl::Status st = comm::RunRanks(3, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(test_util::TinyConfig(), 1);
      auto params = model.parameters();
      const auto half = static_cast<std::ptrdiff_t>(params.size() / 2);
      std::vector<Tensor> a(params.begin(), params.begin() + half), b(params.begin() + half, params.end());
      auto oa = oss::Oss::create({{a, optim::AdamW::default_hyper()}}, optim::AdamW::factory(), env.group_ptr, {.policy = policy});
      auto ob = oss::Oss::create({{b, optim::AdamW::default_hyper()}}, optim::AdamW::factory(), env.group_ptr, {.policy = policy});
      if (!oa.ok() || !ob.ok()) return absl::InternalError("oss");
      auto dp = ShardedDataParallel::create(model, {oa->get(), ob->get()}, env.group_ptr, {.reduce_buffer_size = 400});
      if (!dp.ok()) return dp.status();
      for (int step = 0; step < 5; ++step) {
        auto [x, y] = test_util::Batch(step, env.rank * 8, 8);
        (*oa)->zero_grad();  // two optimizers: each zeroes and steps its half
        (*ob)->zero_grad();
        if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
        if (absl::Status s = (*oa)->step(); !s.ok()) return s;
        if (absl::Status s = (*ob)->step(); !s.ok()) return s;
      }
      got[static_cast<std::size_t>(env.rank)] = test_util::Values(model);
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    test_util::ExpectMatches(got, want, 2e-5);
  }
}

}  // namespace
}  // namespace shardkit::sddp

namespace shardkit::sddp {
namespace {

// A rank that leaves before backward: the other ranks' gradient reductions fail (not hang), and backward
// reports it as a Status naming the departed rank.
TEST(Failure, ARankThatLeavesFailsTheOthersBackwardWithAStatus) {
  absl::Status origin = comm::RunRanks(3, [](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(test_util::TinyConfig(), 1);
    auto oss = oss::Oss::create({{model.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(),
                                env.group_ptr);
    if (!oss.ok()) return oss.status();
    auto dp = ShardedDataParallel::create(model, {oss->get()}, env.group_ptr, {.reduce_buffer_size = 500});
    if (!dp.ok()) return dp.status();
    if (env.rank == 1) return absl::OkStatus();  // leaves
    auto [x, y] = test_util::Batch(0, env.rank * 8, 8);
    absl::Status s = autograd::try_backward(model.loss(x, y));
    EXPECT_FALSE(s.ok());
    EXPECT_THAT(std::string(s.message()), ::testing::HasSubstr("rank 1"));
    return s;
  });
  EXPECT_FALSE(origin.ok());
}

}  // namespace
}  // namespace shardkit::sddp

namespace shardkit::sddp {
namespace {

// Two heads whose backward order depends on the order the forward runs them.
class TwoHeads : public nn::Module {
 public:
  explicit TwoHeads(Generator& gen) : Module("TwoHeads") {
    a = register_module("a", std::make_shared<nn::Linear>(4, 3, gen));
    b = register_module("b", std::make_shared<nn::Linear>(4, 5, gen));
  }
  std::shared_ptr<nn::Linear> a, b;
};

// Rank 1 runs the heads in the other order, so its gradients become ready in another order than rank
// 0's. The buckets are rebuilt from rank 0's order on every rank (broadcast), so the collectives still
// match (mismatched ones would fail the group) and the ranks train identically.
TEST(ReadyOrder, RanksFollowRankZerosOrderWhenTheirOwnDiffers) {
  std::vector<std::vector<int>> first_bucket(2);
  std::vector<std::vector<std::vector<float>>> got(2);
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    Generator gen(5);
    TwoHeads model(gen);
    auto dp = DistributedDataParallel::create(model, env.group_ptr, {.reduce_buffer_size = 0});
    if (!dp.ok()) return dp.status();
    auto opt = optim::Sgd::factory({.lr = 0.1})({{model.parameters(), {.lr = 0.1}}});
    Generator data(9, static_cast<std::uint64_t>(env.rank));
    for (int step = 0; step < 3; ++step) {
      (*opt)->zero_grad();
      Tensor x = Tensor::uniform({2, 4}, data, -1, 1);
      Tensor la, lb;
      if (env.rank == 0) {  // backward runs the later-created head first
        la = autograd::sum((*model.a)(x));
        lb = autograd::sum((*model.b)(x));
      } else {
        lb = autograd::sum((*model.b)(x));
        la = autograd::sum((*model.a)(x));
      }
      Tensor loss = autograd::add(la, lb);
      if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    first_bucket[static_cast<std::size_t>(env.rank)] = (*dp)->reducer().bucket_params(0);
    got[static_cast<std::size_t>(env.rank)] = test_util::Values(model);
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
  EXPECT_EQ(first_bucket[0], first_bucket[1]);
  EXPECT_EQ(got[0], got[1]);
}

// Note [delivered gradient slices]: the owned slices ShardedDataParallel delivers serve one step, and a
// parameter that gets no gradient in a step contributes zeros to that step's slices, never an earlier
// step's. Head b is used in step 0 only; with SGD (no momentum, no weight decay) it must not move after step
// 0, under every reduce strategy, and training must equal one rank where b has no gradient after step 0.
TEST(DeliveredSlices, AParameterWithoutGradientIsNotSteppedWithAnEarlierStepsSlice) {
  constexpr int kSteps = 3;
  auto input = [](int step, int rank) {
    Generator data(9, static_cast<std::uint64_t>(step * 2 + rank));
    return Tensor::uniform({2, 4}, data, -1, 1);
  };
  auto loss = [](TwoHeads& m, const Tensor& x, bool use_b) {
    Tensor l = autograd::sum((*m.a)(x));
    return use_b ? autograd::add(l, autograd::sum((*m.b)(x))) : l;
  };
  std::vector<std::vector<float>> want;
  {
    RankContext ctx;
    RankContextScope scope(ctx);
    Generator gen(5);
    TwoHeads model(gen);
    auto opt = optim::Sgd::factory({.lr = 0.1})({{model.parameters(), {.lr = 0.1}}});
    for (int step = 0; step < kSteps; ++step) {
      (*opt)->zero_grad();
      const bool use_b = step == 0;
      autograd::backward(autograd::scale(autograd::add(loss(model, input(step, 0), use_b), loss(model, input(step, 1), use_b)), 0.5f));
      ASSERT_TRUE((*opt)->step().ok());
    }
    want = test_util::Values(model);
  }
  struct Case {
    oss::PartitionPolicy policy;
    bool flat_reduce_scatter;
  };
  for (const Case c : {Case{oss::PartitionPolicy::greedy, false}, Case{oss::PartitionPolicy::flat, true},
                       Case{oss::PartitionPolicy::flat, false}}) {
    SCOPED_TRACE(absl::StrCat(oss::partition_policy_name(c.policy), c.flat_reduce_scatter ? " reduce_scatter" : ""));
    std::vector<std::vector<std::vector<float>>> got(2);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      Generator gen(5);
      TwoHeads model(gen);
      auto opt = oss::Oss::create({{model.parameters(), {.lr = 0.1}}}, optim::Sgd::factory(), env.group_ptr,
                                  {.policy = c.policy});
      if (!opt.ok()) return opt.status();
      auto dp = ShardedDataParallel::create(model, {opt->get()}, env.group_ptr,
                                            {.flat_reduce_scatter = c.flat_reduce_scatter});
      if (!dp.ok()) return dp.status();
      std::vector<float> b_after_first;
      for (int step = 0; step < kSteps; ++step) {
        (*opt)->zero_grad();
        if (absl::Status s = autograd::try_backward(loss(model, input(step, env.rank), step == 0)); !s.ok()) return s;
        if (absl::Status s = (*opt)->step(); !s.ok()) return s;
        if (step == 0) b_after_first = model.b->parameters()[0].to_vector();
      }
      EXPECT_EQ(model.b->parameters()[0].to_vector(), b_after_first) << "rank " << env.rank;
      got[static_cast<std::size_t>(env.rank)] = test_util::Values(model);
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    test_util::ExpectMatches(got, want, 1e-6);
  }
}

}  // namespace
}  // namespace shardkit::sddp
