// Long (opt-in): overlap_frac and step time of DDP / ShardedDDP on gpt-1m at n = 2 with 1 MiB buckets, the
// figures train_bench reports. Prints; asserts only what is deterministic (overlap of ready-order buckets).
#include <cstdio>

#include "absl/time/clock.h"
#include "common/comm/testing/run_ranks.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"
#include "tests/sddp/sddp_test_util.h"

namespace shardkit::sddp {
namespace {

TEST(SddpOverlap, Gpt1mTwoRanks) {
  const nn::GPTConfig config = *nn::GPTConfig::named("gpt-1m");
  for (const int mode : {0, 1, 2, 3}) {  // ddp, greedy, flat columns, flat reduce-to-owner
    std::vector<double> overlap(2), ms(2);
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::GPT model(config, 1);
      std::vector<optim::ParamGroup> groups{{model.parameters(), optim::AdamW::default_hyper()}};
      std::unique_ptr<optim::Optimizer> plain;
      std::unique_ptr<oss::Oss> oss;
      std::unique_ptr<DataParallel> dp;
      const DataParallelOptions o{.reduce_buffer_size = 1 << 18, .flat_reduce_scatter = mode == 2};
      if (mode == 0) {
        plain = std::move(*optim::AdamW::factory()(groups));
        dp = std::move(*DistributedDataParallel::create(model, env.group_ptr, o));
      } else {
        oss = std::move(*oss::Oss::create(groups, optim::AdamW::factory(), env.group_ptr,
                                          {.policy = mode == 1 ? oss::PartitionPolicy::greedy : oss::PartitionPolicy::flat,
                                           .flat_chunk_numel = o.reduce_buffer_size}));
        dp = std::move(*ShardedDataParallel::create(model, {oss.get()}, env.group_ptr, o));
      }
      Generator gen(3, static_cast<std::uint64_t>(env.rank));
      std::vector<std::int64_t> x(static_cast<std::size_t>(4 * config.context)), y(x.size());
      for (auto& t : x) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(config.vocab_size)));
      for (auto& t : y) t = static_cast<std::int64_t>(gen.next_below(static_cast<std::uint64_t>(config.vocab_size)));
      const Tensor xt = Tensor::from_int64(x, {4, config.context}), yt = Tensor::from_int64(y, {4, config.context});
      absl::Duration total;
      for (int step = 0; step < 4; ++step) {
        const absl::Time t0 = absl::Now();
        if (plain) plain->zero_grad();
        if (oss) oss->zero_grad();
        if (absl::Status s = autograd::try_backward(model.loss(xt, yt)); !s.ok()) return s;
        if (absl::Status s = plain ? plain->step() : oss->step(); !s.ok()) return s;
        if (step > 0) total += absl::Now() - t0;
      }
      overlap[static_cast<std::size_t>(env.rank)] = dp->last_backward_stats().overlap_frac();
      ms[static_cast<std::size_t>(env.rank)] = absl::ToDoubleMilliseconds(total) / 3;
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    std::printf("gpt-1m n=2 mode %s: overlap_frac %.2f, step %.1f ms\n",
                mode == 0 ? "ddp" : mode == 1 ? "sddp_greedy" : mode == 2 ? "sddp_flat(columns)" : "sddp_flat(owner)",
                overlap[0], ms[0]);
    EXPECT_GE(overlap[0], 0.7);
  }
}

}  // namespace
}  // namespace shardkit::sddp
