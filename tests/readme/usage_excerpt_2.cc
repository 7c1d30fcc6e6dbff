// README usage excerpt 2 (fsdp::fully_shard) as a function: see usage_harness.h. In the README it follows
// excerpt 1, whose includes and using-directive it relies on: both preambles come first.
#include "usage_1_preamble.inc"
#include "usage_2_preamble.inc"

#include "common/autograd/grad_mode.h"
#include "tests/readme/usage_harness.h"

namespace shardkit::readme_test {

absl::Status RunFsdpExcerpt(const nn::GPTConfig& config, const std::shared_ptr<comm::ProcessGroup>& pg,
                            const Tensor& x, const Tensor& y, int steps, Trained& out) {
#include "usage_2_body.inc"
  // At rest the module's parameters are shards: summon the full ones to read them (and to evaluate the loss).
  if (absl::Status s = root->summon_full_params(); !s.ok()) return s;
  {
    autograd::NoGradGuard no_grad;
    out.last_loss = model.loss(x, y).item();
  }
  for (const Tensor& p : model.parameters()) out.values.push_back(p.to_vector());
  return root->reshard(/*recurse=*/true);
}

}  // namespace shardkit::readme_test
