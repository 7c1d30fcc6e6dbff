// README usage excerpt 1 (OSS + ShardedDataParallel) as a function: see usage_harness.h. The excerpt's own
// includes (generated from README.md by extract_usage.cmake) come first.
#include "usage_1_preamble.inc"

#include "common/autograd/grad_mode.h"
#include "tests/readme/usage_harness.h"

namespace shardkit::readme_test {

absl::Status RunOssShardedDdpExcerpt(const nn::GPTConfig& config, const std::shared_ptr<comm::ProcessGroup>& pg,
                                     const Tensor& x, const Tensor& y, int steps, Trained& out) {
#include "usage_1_body.inc"
  autograd::NoGradGuard no_grad;
  out.last_loss = model.loss(x, y).item();
  for (const Tensor& p : model.parameters()) out.values.push_back(p.to_vector());
  return absl::OkStatus();
}

}  // namespace shardkit::readme_test
