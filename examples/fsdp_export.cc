// Exporting a fully sharded (ZeRO-3) model for PyTorch / Hugging Face without ever gathering it on one rank.
// 3 ranks as threads train a small GPT with fsdp::fully_shard, then each rank writes its part of a Hugging Face
// sharded checkpoint with GPT-2's names (model-0000r-of-00003.safetensors) and rank 0 the index
// (model.safetensors.index.json): a tensor is sent, row blocks by row blocks, only to the rank that writes it.
// transformers' GPT2LMHeadModel.from_pretrained(DIR) reads such a directory (with a config.json of the same shape).
// Run: build/examples/fsdp_export [DIR]     (default: a temporary directory, removed at the end)
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "common/autograd/engine.h"
#include "common/comm/run_ranks.h"
#include "common/io/model_safetensors.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "fsdp/fully_shard.h"
#include "fsdp/safetensors_export.h"

using namespace shardkit;
namespace fs = std::filesystem;

int main(int argc, char** argv) {
  constexpr int kRanks = 3, kSteps = 10, kRows = 2;
  const nn::GPTConfig config = *nn::GPTConfig::named("gpt-10k");  // vocab 64, context 16, width 16, 3 layers
  const bool temporary = argc < 2;
  const fs::path dir = temporary ? fs::temp_directory_path() / ("shardkit_fsdp_export_" + std::to_string(::getpid()))
                                 : fs::path(argv[1]);
  fs::create_directories(dir);

  const absl::Status status = comm::run_ranks(kRanks, [&](comm::ThreadRankEnv& env) -> absl::Status {
    nn::GPT model(config, /*seed=*/1);
    const std::int64_t model_bytes = 4 * model.num_parameters();
    for (nn::Module* block : fsdp::modules_of_type(model, "TransformerBlock")) {
      if (auto unit = fsdp::fully_shard(*block, env.group); !unit.ok()) return unit.status();
    }
    if (auto root = fsdp::fully_shard(model, env.group); !root.ok()) return root.status();
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    for (int step = 0; step < kSteps; ++step) {  // count modulo 7 on this rank's rows
      std::vector<std::int64_t> x, y;
      for (std::int64_t i = 0; i < kRows * config.context; ++i) {
        const std::int64_t t = (step * kRanks + env.rank) * kRows * config.context + i;
        x.push_back(t % 7), y.push_back((t + 1) % 7);
      }
      (*opt)->zero_grad();
      Tensor loss = model.loss(Tensor::from_int64(x, {kRows, config.context}), Tensor::from_int64(y, {kRows, config.context}));
      if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }

    // The export: GPT-2's names; every rank writes its part, rank 0 also the index; a barrier ends it.
    MemoryTracker& ledger = *env.context.memory;
    const std::int64_t before = ledger.current(MemoryCategory::other);
    ledger.reset_peaks();
    const io::ModelExportOptions gpt2{.names = io::TensorNames::gpt2(config)};
    if (absl::Status s = fsdp::export_sharded_safetensors(model, dir.string(), gpt2); !s.ok()) return s;
    const std::int64_t held = ledger.peak(MemoryCategory::other) - before;
    std::printf("rank %d: held at most %lld bytes of the model while writing its part (the whole model: %lld)\n",
                env.rank, static_cast<long long>(held), static_cast<long long>(model_bytes));
    if (held >= model_bytes) return absl::InternalError("a rank held the whole model");
    return absl::OkStatus();
  });
  if (!status.ok()) return std::fprintf(stderr, "error: %s\n", std::string(status.message()).c_str()), 1;

  // What was written, read back as Hugging Face would: the index names each tensor's part.
  auto model = io::ShardedSafetensors::open((dir / "model.safetensors.index.json").string());
  if (!model.ok()) return std::fprintf(stderr, "error: %s\n", std::string(model.status().message()).c_str()), 1;
  std::vector<fs::path> files(fs::directory_iterator(dir), fs::directory_iterator{});
  std::sort(files.begin(), files.end());
  for (const fs::path& f : files) {
    std::printf("%-36s %7llu bytes\n", f.filename().c_str(), static_cast<unsigned long long>(fs::file_size(f)));
  }
  std::printf("%zu tensors in %zu parts, e.g. transformer.h.0.attn.c_attn.weight %s\n", model->entries().size(),
              model->parts().size(), shape_str(model->find("transformer.h.0.attn.c_attn.weight")->info.shape).c_str());
  if (temporary) fs::remove_all(dir);
  return 0;
}
