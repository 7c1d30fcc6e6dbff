// README.md's "Using shardkit in your training loop" excerpts, compiled and run exactly as the README shows
// them (the build extracts them: extract_usage.cmake; usage_harness.h says which names the harness
// provides). Each runs on 2 simulated ranks, every rank on its half of a fixed batch, and must equal
// single-rank AdamW training on the whole batch, parameter by parameter, with each rank's loss going down.
#include <memory>
#include <vector>

#include "common/autograd/engine.h"
#include "common/autograd/grad_mode.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "tests/readme/usage_harness.h"
#include "tests/testing/gpt_tiny_data.h"
#include "gtest/gtest.h"

namespace shardkit::readme_test {
namespace {

constexpr int kWorld = 2;
constexpr int kSteps = 5;

using Excerpt = absl::Status (*)(const nn::GPTConfig&, const std::shared_ptr<comm::ProcessGroup>&, const Tensor&,
                                 const Tensor&, int, Trained&);

// One rank, AdamW with the excerpts' hyper-parameters, the whole batch, kSteps steps.
std::vector<std::vector<float>> Reference() {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(gpt_tiny::TinyConfig(), 1);
  auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
  EXPECT_TRUE(opt.ok()) << opt.status();
  auto [x, y] = gpt_tiny::Batch(0, 0, gpt_tiny::kBatch);
  for (int step = 0; step < kSteps; ++step) {
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return gpt_tiny::Values(model);
}

void ExpectTrainsLikeOneRank(Excerpt excerpt) {
  const auto want = Reference();
  std::vector<Trained> trained(kWorld);
  std::vector<double> first_loss(kWorld);
  absl::Status st = comm::RunRanks(kWorld, [&](comm::RankEnv& env) -> absl::Status {
    const nn::GPTConfig config = gpt_tiny::TinyConfig();
    const int rows = gpt_tiny::kBatch / kWorld;
    auto [x, y] = gpt_tiny::Batch(0, env.rank * rows, rows);
    {
      autograd::NoGradGuard no_grad;
      first_loss[static_cast<std::size_t>(env.rank)] = nn::GPT(config, 1).loss(x, y).item();  // the start model
    }
    return excerpt(config, env.group_ptr, x, y, kSteps, trained[static_cast<std::size_t>(env.rank)]);
  });
  ASSERT_TRUE(st.ok()) << st;
  std::vector<std::vector<std::vector<float>>> got;
  for (int r = 0; r < kWorld; ++r) {
    const Trained& t = trained[static_cast<std::size_t>(r)];
    EXPECT_LT(t.last_loss, first_loss[static_cast<std::size_t>(r)]) << "rank " << r;
    got.push_back(t.values);
  }
  gpt_tiny::ExpectMatches(got, want, 2e-5);
}

TEST(ReadmeUsage, OssShardedDdpExcerptEqualsSingleRankTraining) { ExpectTrainsLikeOneRank(&RunOssShardedDdpExcerpt); }

TEST(ReadmeUsage, FsdpExcerptEqualsSingleRankTraining) { ExpectTrainsLikeOneRank(&RunFsdpExcerpt); }

}  // namespace
}  // namespace shardkit::readme_test
