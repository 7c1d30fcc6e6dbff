// A minimal OSS + ShardedDataParallel (ZeRO-2) training loop: 4 ranks as threads. ShardedDataParallel
// reduces each gradient to the rank that owns it during backward (others are released), so each rank
// keeps 1/4 of the gradients and 1/4 of the AdamW state. Run: build/examples/oss_sddp_train
#include <cstdio>
#include <string>
#include <vector>

#include "common/autograd/engine.h"
#include "common/comm/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"

using namespace shardkit;

int main() {
  constexpr int kRanks = 4, kSteps = 30, kRows = 2;
  const nn::GPTConfig config = *nn::GPTConfig::named("gpt-10k");  // vocab 64, context 16
  // Every rank runs this on a thread of its own, with its own memory ledger and RNG stream (env.context) and its
  // handle on the world group (env.group); run_ranks returns the first failure, naming its rank.
  const absl::Status status = comm::run_ranks(kRanks, [&](comm::ThreadRankEnv& env) -> absl::Status {
    const int rank = env.rank;
    const RankContext& ctx = env.context;
    const std::shared_ptr<comm::ProcessGroup>& pg = env.group;

    nn::GPT model(config, /*seed=*/1);
    auto opt = oss::Oss::create({{model.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(), pg,
                                {.policy = oss::PartitionPolicy::flat});
    if (!opt.ok()) return opt.status();
    auto ddp = sddp::ShardedDataParallel::create(model, {opt->get()}, pg);  // broadcasts rank 0's parameters
    if (!ddp.ok()) return ddp.status();

    for (int step = 0; step < kSteps; ++step) {
      std::vector<std::int64_t> x, y;
      for (int r = 0; r < kRows; ++r) {
        for (std::int64_t t = 0; t < config.context; ++t) {
          const std::int64_t start = (step * kRanks + rank) * kRows + r;
          x.push_back((start + t) % 7), y.push_back((start + t + 1) % 7);
        }
      }
      (*opt)->zero_grad();  // the Oss drops every gradient, the slices ShardedDataParallel delivered included
      Tensor loss = model.loss(Tensor::from_int64(x, {kRows, config.context}), Tensor::from_int64(y, {kRows, config.context}));
      if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;  // gradients reduced to their owners
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
      if (rank == 0 && step % 10 == 9) std::printf("step %2d  loss %.4f\n", step + 1, loss.item());
    }
    std::printf("rank %d: peak gradient %lld bytes, optimizer state %lld bytes (unsharded: %lld and %lld)\n", rank,
                static_cast<long long>(ctx.memory->peak(MemoryCategory::gradient)),
                static_cast<long long>(ctx.memory->current(MemoryCategory::optimizer_state)),
                static_cast<long long>(4 * model.num_parameters()), static_cast<long long>(8 * model.num_parameters()));
    return absl::OkStatus();
  });
  if (!status.ok()) return std::fprintf(stderr, "error: %s\n", std::string(status.message()).c_str()), 1;
  return 0;
}
