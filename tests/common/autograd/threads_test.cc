// Two simulated ranks (threads) running forward and backward at the same time must not see each
// other's grad mode, running backward, callbacks, hooks, random streams or memory ledger.
#include <thread>

#include "common/autograd/engine.h"
#include "common/autograd/grad_mode.h"
#include "common/autograd/hooks.h"
#include "common/autograd/ops.h"
#include "common/tensor/rank_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/autograd/test_util.h"

namespace shardkit::autograd {
namespace {

using testing_util::Leaf;
using testing_util::Meeting;

struct RankResult {
  std::vector<std::string> log;
  std::vector<float> grad;
  std::int64_t activation_peak = 0;
  std::int64_t gradient_bytes = 0;
  float random_value = 0;
  std::string error;
};

TEST(ThreadsTest, ConcurrentBackwardsAreIsolated) {
  Meeting meeting(2);
  RankResult results[2];
  auto rank_main = [&](int rank) {
    RankResult& r = results[rank];
    try {
      RankContext ctx;
      ctx.rank = rank;
      ctx.world_size = 2;
      ctx.generator = Generator(7, static_cast<std::uint64_t>(rank));
      RankContextScope scope(ctx);
      // Rank 1 turns grad mode off for a while; rank 0 must still record.
      meeting.arrive_and_wait();
      if (rank == 1) set_grad_enabled(false);
      meeting.arrive_and_wait();
      const std::size_t n = rank == 0 ? 100 : 300;  // different activation sizes per rank
      Tensor w = Leaf(std::vector<float>(n, 1.f + static_cast<float>(rank)), {static_cast<std::int64_t>(n)});
      Tensor y = scale(w, 2.f);
      if (rank == 1) {
        EXPECT_FALSE(y.requires_grad());
        set_grad_enabled(true);
        y = scale(w, 2.f);
      }
      EXPECT_TRUE(y.requires_grad());
      auto h = register_post_accumulate_grad_hook(w, [&](const Tensor&) {
        EXPECT_TRUE(is_backward_running());
        r.log.push_back("hook rank " + std::to_string(rank));
        // Both ranks are inside their backward here at the same time.
        meeting.arrive_and_wait();
        queue_callback([&] { r.log.push_back("callback rank " + std::to_string(rank)); });
        meeting.arrive_and_wait();
      });
      backward(sum(mul(y, y)));
      EXPECT_FALSE(is_backward_running());
      float u = 0;
      current_rank_context().generator.fill_uniform(&u, 1);
      r.random_value = u;
      r.grad = w.grad().to_vector();
      r.activation_peak = ctx.memory->peak(MemoryCategory::activation);
      r.gradient_bytes = ctx.memory->current(MemoryCategory::gradient);
    } catch (const std::exception& e) {
      r.error = e.what();
    }
  };
  std::thread t0(rank_main, 0), t1(rank_main, 1);
  t0.join();
  t1.join();
  for (int rank = 0; rank < 2; ++rank) {
    SCOPED_TRACE(rank);
    const RankResult& r = results[rank];
    ASSERT_EQ(r.error, "");
    EXPECT_THAT(r.log, ::testing::ElementsAre("hook rank " + std::to_string(rank),
                                              "callback rank " + std::to_string(rank)));
    // d/dw sum((2w)^2) = 8w.
    EXPECT_EQ(r.grad.front(), 8.f * (1.f + static_cast<float>(rank)));
    const std::int64_t n = rank == 0 ? 100 : 300;
    EXPECT_EQ(r.gradient_bytes, 4 * n);
    // Exactly this rank's own figure (y, y*y, then y's two gradient halves and their sum, plus the
    // loss scalar): the other rank's concurrent activations are not in this ledger.
    EXPECT_EQ(r.activation_peak, 5 * 4 * n + 4);
  }
  Generator g0(7, 0), g1(7, 1);
  float u0 = 0, u1 = 0;
  g0.fill_uniform(&u0, 1);
  g1.fill_uniform(&u1, 1);
  EXPECT_EQ(results[0].random_value, u0);
  EXPECT_EQ(results[1].random_value, u1);
}

}  // namespace
}  // namespace shardkit::autograd
