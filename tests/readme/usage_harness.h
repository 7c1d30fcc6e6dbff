// What readme_usage_test.cc runs: the README's usage excerpts, each compiled inside a function
// (usage_excerpt_<k>.cc) that provides the names the excerpt uses:
//   config  the GPT config                  pg     this rank's process group
//   x, y    this rank's rows of the batch   steps  how many training steps to run
// and reads back what it trained. The excerpts' own #include lines come first in their translation unit and
// this header declares only what the signatures need, so an include missing from the README fails the build.
#pragma once

#include <memory>
#include <vector>

#include "absl/status/status.h"

namespace shardkit {
class Tensor;
namespace comm {
class ProcessGroup;
}
namespace nn {
struct GPTConfig;
}

namespace readme_test {

// Every parameter's values after the last step (in parameters() order), and this rank's loss on its rows
// after it.
struct Trained {
  std::vector<std::vector<float>> values;
  double last_loss = 0;
};

// README usage excerpt 1 (OSS + ShardedDataParallel) and 2 (fsdp::fully_shard), run on this rank. Collective.
absl::Status RunOssShardedDdpExcerpt(const nn::GPTConfig& config, const std::shared_ptr<comm::ProcessGroup>& pg,
                                     const Tensor& x, const Tensor& y, int steps, Trained& out);
absl::Status RunFsdpExcerpt(const nn::GPTConfig& config, const std::shared_ptr<comm::ProcessGroup>& pg,
                            const Tensor& x, const Tensor& y, int steps, Trained& out);

}  // namespace readme_test
}  // namespace shardkit
