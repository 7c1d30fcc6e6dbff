// fully_shard's cpu offload (FullyShardOptions::offload_policy, Note [cpu offload] in fsdp/param_group.cc) on CPU
// ranks, where host and compute device are the same memory: the staging copies (shard to the device before each
// all-gather, reduced rows back to the host) still run, so training must give the very bits of the run without
// offload in every combination, and the copies must be gone after each pass. The GPU cases (shards really on the
// host) are in fsdp_cuda_test.cc.
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "common/comm/testing/run_ranks.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;

struct OffloadCase {
  int world = 2;
  std::optional<std::variant<bool, int>> reshard_after_forward = std::nullopt;
  bool nested = false;
  MixedPrecisionPolicy mp = {};
  bool two_backwards = false;  // each step's gradient accumulated over two half batches
  std::int64_t own_collective_min_numel = FullyShardOptions{}.own_collective_min_numel;
};

// Every rank's full parameters after `steps` steps.
std::vector<std::vector<std::vector<float>>> Train(const OffloadCase& c, bool offload, int steps) {
  std::vector<std::vector<std::vector<float>>> out(static_cast<std::size_t>(c.world));
  absl::Status st = comm::RunRanks(c.world, [&](comm::RankEnv& env) -> absl::Status {
    MemoryTracker& mem = *env.context.memory;
    nn::GPT model(TinyConfig(), 1);
    const FullyShardOptions options{.reshard_after_forward = c.reshard_after_forward,
                                    .own_collective_min_numel = c.own_collective_min_numel,
                                    .mp_policy = c.mp,
                                    .offload_policy = {.cpu = offload}};
    if (absl::Status s = test_util::ShardGpt(model, env, options, c.nested); !s.ok()) return s;
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    const int rows = kBatch / c.world;
    for (int step = 0; step < steps; ++step) {
      (*opt)->zero_grad();
      for (int part = 0, parts = c.two_backwards ? 2 : 1; part < parts; ++part) {
        auto [x, y] = Batch(step, env.rank * rows + part * rows / parts, rows / parts);
        if (absl::Status s = autograd::try_backward(autograd::scale(model.loss(x, y), 1.0f / static_cast<float>(parts)));
            !s.ok()) {
          return s;
        }
      }
      EXPECT_EQ(mem.current(MemoryCategory::communication_buffer), 0) << "staging copies released after backward";
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    return test_util::StoreFullValues(model, out, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

// Every combination a user can build with offload (reshard true / false / a k-group, nested units, bf16
// all-gathers and reduce-scatters, own collectives or one per unit, gradient accumulation) trains to the same bits
// as without offload: the copies move bytes, never change them; and no staging copy outlives its pass.
TEST(FsdpOffload, SameBitsAsWithoutOffloadInEveryCombination) {
  const OffloadCase cases[] = {
      {.world = 2, .reshard_after_forward = true},
      {.world = 3, .reshard_after_forward = false, .nested = true},
      {.world = 4, .reshard_after_forward = 2},
      {.world = 2, .mp = {.param_dtype = DType::bf16, .reduce_dtype = DType::bf16}},
      {.world = 4, .two_backwards = true, .own_collective_min_numel = 1},
      {.world = 2, .reshard_after_forward = true, .own_collective_min_numel = INT64_MAX},
  };
  for (const OffloadCase& c : cases) {
    SCOPED_TRACE(::testing::Message() << "world " << c.world << ", nested " << c.nested << ", bf16 "
                                      << c.mp.param_dtype.has_value() << ", two backwards " << c.two_backwards
                                      << ", own min " << c.own_collective_min_numel);
    gpt_tiny::ExpectMatches(Train(c, true, 6), Train(c, false, 6)[0], 0);
  }
}

// A CPU parameter under offload is still the shard the optimizer steps: the module's parameters at rest are the
// host shards (same shapes and rows as without offload, not pinned in a program without CUDA), and they hold
// gradients after backward.
TEST(FsdpOffload, ParametersAtRestAreTheHostShardsWithGradients) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), 1);
    if (absl::Status s = test_util::ShardGpt(model, env, {.offload_policy = {.cpu = true}}); !s.ok()) return s;
    const std::vector<ShardedTensor> shards = sharded_parameters(model);
    EXPECT_EQ(shards.size(), model.parameters().size());
    auto [x, y] = Batch(0, env.rank * kBatch / 2, kBatch / 2);
    if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
    for (const ShardedTensor& t : shards) {
      EXPECT_TRUE(t.local.device().is_cpu());
      EXPECT_FALSE(t.local.storage()->pinned()) << "no CUDA in this program: the heap's bytes";
      EXPECT_EQ(t.local.shape()[0], split_rows(t.global_shape, env.rank, 2).local_rows);
      EXPECT_TRUE(t.local.numel() == 0 || t.local.grad().defined()) << t.local.describe();
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::fsdp
