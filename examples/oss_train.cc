// A minimal OSS (ZeRO-1) training loop: 4 ranks as threads, each trains the same GPT on its own slice of
// every batch; gradients are averaged with one all_reduce each, and Oss keeps 1/4 of the AdamW state per
// rank. Run: build/examples/oss_train
#include <cstdio>
#include <string>
#include <vector>

#include "common/autograd/engine.h"
#include "common/comm/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "oss/oss.h"

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

    nn::GPT model(config, /*seed=*/1);  // same seed: every rank starts with the same model
    auto opt = oss::Oss::create({{model.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::factory(), pg);
    if (!opt.ok()) return opt.status();

    for (int step = 0; step < kSteps; ++step) {
      // This rank's rows of the step's batch: a repeating pattern the model can learn.
      std::vector<std::int64_t> x, y;
      for (int r = 0; r < kRows; ++r) {
        for (std::int64_t t = 0; t < config.context; ++t) {
          const std::int64_t start = (step * kRanks + rank) * kRows + r;
          x.push_back((start + t) % 7), y.push_back((start + t + 1) % 7);
        }
      }
      (*opt)->zero_grad();
      Tensor loss = model.loss(Tensor::from_int64(x, {kRows, config.context}), Tensor::from_int64(y, {kRows, config.context}));
      autograd::backward(loss);
      for (const Tensor& p : model.parameters()) {  // average gradients over the ranks (what DDP does)
        if (absl::Status s = pg->all_reduce(p.grad(), {.op = comm::ReduceOp::avg()})->wait(); !s.ok()) return s;
      }
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;  // step my shard, all-gather the parameters
      if (rank == 0 && step % 10 == 9) std::printf("step %2d  loss %.4f\n", step + 1, loss.item());
    }
    std::printf("rank %d: optimizer state %lld bytes (the full AdamW state would be %lld)\n", rank,
                static_cast<long long>(ctx.memory->current(MemoryCategory::optimizer_state)),
                static_cast<long long>(8 * model.num_parameters()));
    return absl::OkStatus();
  });
  if (!status.ok()) return std::fprintf(stderr, "error: %s\n", std::string(status.message()).c_str()), 1;
  return 0;
}
