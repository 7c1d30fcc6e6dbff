// The six ways the sddp tests build a rank's data-parallel training (DDP, OSS greedy / flat + DDP, OSS +
// ShardedDataParallel greedy / flat reduce-scatter / flat reduce-to-owner), and one rank's Trainer for a mode.
#pragma once

#include <memory>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/comm/process_group.h"
#include "common/nn/module.h"
#include "common/optim/adam.h"
#include "common/optim/clip_grad.h"
#include "gtest/gtest.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"

namespace shardkit::sddp::test_util {

enum class Mode { ddp, oss_ddp, oss_flat_ddp, sddp_greedy, sddp_flat, sddp_flat_owner };
inline constexpr Mode kModes[] = {Mode::ddp,         Mode::oss_ddp,   Mode::oss_flat_ddp,
                                  Mode::sddp_greedy, Mode::sddp_flat, Mode::sddp_flat_owner};

inline std::string ModeName(Mode m) {
  switch (m) {
    case Mode::ddp: return "ddp";
    case Mode::oss_ddp: return "oss_ddp";
    case Mode::oss_flat_ddp: return "oss_flat_ddp";
    case Mode::sddp_greedy: return "sddp_greedy";
    case Mode::sddp_flat: return "sddp_flat";
    case Mode::sddp_flat_owner: return "sddp_flat_owner";
  }
  return "?";
}

// Test names for parameters (world size, mode): "<mode>_n<world>".
inline std::string CaseName(const ::testing::TestParamInfo<std::tuple<int, Mode>>& info) {
  return ModeName(std::get<1>(info.param)) + "_n" + std::to_string(std::get<0>(info.param));
}

// One rank's wrapper and optimizer for `mode` over `groups` (any module, any param groups): OSS with buckets of
// 4 KiB and flat chunks of options.reduce_buffer_size elements.
struct Trainer {
  std::unique_ptr<optim::Optimizer> plain;
  std::unique_ptr<oss::Oss> oss;
  std::unique_ptr<DataParallel> dp;
  std::vector<Tensor> params;

  static absl::StatusOr<Trainer> make(Mode mode, nn::Module& model, std::vector<optim::ParamGroup> groups,
                                      const optim::OptimizerFactory& factory, std::shared_ptr<comm::ProcessGroup> pg,
                                      DataParallelOptions options) {
    Trainer t;
    t.params = model.parameters();
    if (mode == Mode::ddp) {
      auto o = factory(groups);
      if (!o.ok()) return o.status();
      t.plain = std::move(*o);
    } else {
      const bool flat = mode == Mode::oss_flat_ddp || mode == Mode::sddp_flat || mode == Mode::sddp_flat_owner;
      auto o = oss::Oss::create(groups, factory, pg,
                                {.policy = flat ? oss::PartitionPolicy::flat : oss::PartitionPolicy::greedy,
                                 .bucket_bytes = 4096,
                                 .flat_chunk_numel = options.reduce_buffer_size});
      if (!o.ok()) return o.status();
      t.oss = std::move(*o);
    }
    if (mode == Mode::ddp || mode == Mode::oss_ddp || mode == Mode::oss_flat_ddp) {
      auto d = DistributedDataParallel::create(model, pg, options);
      if (!d.ok()) return d.status();
      t.dp = std::move(*d);
    } else {
      options.flat_reduce_scatter = mode != Mode::sddp_flat_owner;
      auto d = ShardedDataParallel::create(model, {t.oss.get()}, pg, options);
      if (!d.ok()) return d.status();
      t.dp = std::move(*d);
    }
    return t;
  }
  // One group of every parameter with AdamW's default hyper-parameters (which replace the factory's defaults).
  static absl::StatusOr<Trainer> make(Mode mode, nn::Module& model, std::shared_ptr<comm::ProcessGroup> pg,
                                      DataParallelOptions options,
                                      const optim::OptimizerFactory& factory = optim::AdamW::factory()) {
    return make(mode, model, {{model.parameters(), optim::AdamW::default_hyper()}}, factory, std::move(pg),
                std::move(options));
  }

  void zero_grad(bool set_to_none = true) {
    if (plain) plain->zero_grad(set_to_none);
    if (oss) oss->zero_grad(set_to_none);
  }
  absl::Status step() { return plain ? plain->step() : oss->step(); }
  optim::HyperParams& hyper(std::size_t g) { return plain ? plain->mutable_hyper(g) : oss->mutable_hyper(g); }
  // Clips the gradients the next step() uses; returns the total norm before clipping.
  absl::StatusOr<double> clip_grad_norm(double max_norm) {
    if (plain) return optim::clip_grad_norm(params, max_norm);
    return oss->clip_grad_norm(max_norm);
  }
};

}  // namespace shardkit::sddp::test_util
