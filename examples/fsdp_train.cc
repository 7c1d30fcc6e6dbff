// A minimal fully sharded (ZeRO-3) training loop, FSDP2's shape: 4 ranks as threads. fully_shard makes every
// TransformerBlock a unit (bottom-up), then the whole model (the root: embeddings, final norm). A unit's
// parameters are all-gathered just before its forward and its backward and released after; gradients are
// reduce-scattered so each rank keeps 1/4 of the parameters, gradients and AdamW state at rest.
// Run: build/examples/fsdp_train
#include <cstdio>
#include <string>
#include <vector>

#include "common/autograd/engine.h"
#include "common/comm/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"

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
    const std::int64_t psi = model.num_parameters();
    for (nn::Module* block : fsdp::modules_of_type(model, "TransformerBlock")) {
      if (auto unit = fsdp::fully_shard(*block, pg); !unit.ok()) return unit.status();
    }
    if (auto root = fsdp::fully_shard(model, pg); !root.ok()) return root.status();
    // At rest model.parameters() are this rank's shards: the optimizer steps them like any parameters.
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();

    for (int step = 0; step < kSteps; ++step) {
      std::vector<std::int64_t> x, y;
      for (int r = 0; r < kRows; ++r) {
        for (std::int64_t t = 0; t < config.context; ++t) {
          const std::int64_t start = (step * kRanks + rank) * kRows + r;
          x.push_back((start + t) % 7), y.push_back((start + t + 1) % 7);
        }
      }
      (*opt)->zero_grad();
      Tensor loss = model.loss(Tensor::from_int64(x, {kRows, config.context}), Tensor::from_int64(y, {kRows, config.context}));
      if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;  // reduce-scattered per unit
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
      if (rank == 0 && step % 10 == 9) std::printf("step %2d  loss %.4f\n", step + 1, loss.item());
    }
    std::printf("rank %d: parameters %lld bytes at rest, gradients %lld, optimizer state %lld (unsharded: %lld, %lld, %lld)\n",
                rank, static_cast<long long>(ctx.memory->current(MemoryCategory::parameter)),
                static_cast<long long>(ctx.memory->current(MemoryCategory::gradient)),
                static_cast<long long>(ctx.memory->current(MemoryCategory::optimizer_state)),
                static_cast<long long>(4 * psi), static_cast<long long>(4 * psi), static_cast<long long>(8 * psi));
    return absl::OkStatus();
  });
  if (!status.ok()) return std::fprintf(stderr, "error: %s\n", std::string(status.message()).c_str()), 1;
  return 0;
}
