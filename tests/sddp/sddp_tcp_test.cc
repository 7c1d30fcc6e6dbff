// The reducer over the TCP backend, whose collectives run on a communication thread and complete
// asynchronously: buckets really are in flight while backward continues (the in-process backend completes
// every call at issue). Ranks are threads of this process connected over loopback.
#include <cstdio>
#include <thread>

#include "absl/strings/str_cat.h"

#include "common/comm/hash_store.h"
#include "common/comm/tcp_process_group.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"
#include "tests/sddp/sddp_test_util.h"

namespace shardkit::sddp {
namespace {

TEST(SddpTcp, GreedyFlatAndDdpOverTcpEqualSingleRankTraining) {
  constexpr int kWorld = 2, kSteps = 5;
  const auto want = test_util::Reference(kSteps);
  int variant = 0;
  for (const int mode : {0, 1, 2, 3}) {  // ddp, greedy, flat columns, flat reduce-to-owner
    auto store = std::make_shared<comm::HashStore>();
    std::vector<std::vector<std::vector<float>>> got(kWorld);
    std::vector<absl::Status> status(kWorld);
    std::vector<double> overlap(kWorld);
    std::vector<std::thread> threads;
    for (int r = 0; r < kWorld; ++r) {
      threads.emplace_back([&, r] {
        RankContext ctx;
        ctx.rank = r;
        ctx.world_size = kWorld;
        RankContextScope scope(ctx);
        status[static_cast<std::size_t>(r)] = [&]() -> absl::Status {
          auto pg = comm::TcpProcessGroup::create(
              store, r, kWorld,
              {.store_prefix = absl::StrCat("sddp", variant), .default_timeout = absl::Seconds(60), .chunk_bytes = 512});
          if (!pg.ok()) return pg.status();
          std::shared_ptr<comm::ProcessGroup> group = *pg;
          nn::GPT model(test_util::TinyConfig(), 1);
          std::vector<optim::ParamGroup> groups{{model.parameters(), optim::AdamW::default_hyper()}};
          std::unique_ptr<optim::Optimizer> plain;
          std::unique_ptr<oss::Oss> oss;
          std::unique_ptr<DataParallel> dp;
          const DataParallelOptions o{.reduce_buffer_size = 500, .flat_reduce_scatter = mode == 2};
          if (mode == 0) {
            plain = std::move(*optim::AdamW::factory()(groups));
            auto d = DistributedDataParallel::create(model, group, o);
            if (!d.ok()) return d.status();
            dp = std::move(*d);
          } else {
            auto created = oss::Oss::create(groups, optim::AdamW::factory(), group,
                                            {.policy = mode == 1 ? oss::PartitionPolicy::greedy : oss::PartitionPolicy::flat,
                                             .flat_chunk_numel = o.reduce_buffer_size});
            if (!created.ok()) return created.status();
            oss = std::move(*created);
            auto d = ShardedDataParallel::create(model, {oss.get()}, group, o);
            if (!d.ok()) return d.status();
            dp = std::move(*d);
          }
          const int rows = test_util::kBatch / kWorld;
          for (int step = 0; step < kSteps; ++step) {
            auto [x, y] = test_util::Batch(step, r * rows, rows);
            if (plain) plain->zero_grad();
            if (oss) oss->zero_grad();
            if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
            if (absl::Status s = plain ? plain->step() : oss->step(); !s.ok()) return s;
          }
          overlap[static_cast<std::size_t>(r)] = dp->last_backward_stats().overlap_frac();
          got[static_cast<std::size_t>(r)] = test_util::Values(model);
          return absl::OkStatus();
        }();
      });
    }
    for (auto& t : threads) t.join();
    ++variant;
    for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(status[static_cast<std::size_t>(r)].ok()) << status[static_cast<std::size_t>(r)];
    std::printf("tcp mode %d: overlap_frac %.2f\n", mode, overlap[0]);
    test_util::ExpectMatches(got, want, 2e-5);
  }
}

}  // namespace
}  // namespace shardkit::sddp
