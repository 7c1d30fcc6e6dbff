// Shared helpers of the sixth round of fsdp combination tests (fsdp_combo6_test.cc, fsdp_mpi_combo6_test.cc,
// fsdp_scaler_combo6_test.cc, fsdp_state_combo6_test.cc): GPT-tiny sharded over any ProcessGroup, on a 1-D group or
// an HSDP mesh, with bf16 mixed precision, cpu offload, gradient accumulation, prefetch lists and reshard choices
// picked by a GptCase; trained on each rank's rows of the shared batches (tests/testing/gpt_tiny_data.h).
#pragma once

#include <algorithm>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/autograd/ops/elementwise.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/optim/optimizer.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp::combo6 {

using Params = std::vector<std::vector<float>>;

// How a step's gradient is formed: one backward of the rank's rows, or two half-batches (each loss scaled by 1/2)
// with the HSDP all-reduce across replicas deferred to the second (set_requires_all_reduce), or with no gradient
// sync at all in the first (set_requires_gradient_sync).
enum class Accumulate { none, defer_all_reduce, no_sync };
// Implicit prefetch (the default), none, or explicit lists with two units ahead (tests/fsdp/fsdp_prefetch_test.cc's).
enum class Prefetch { implicit, off, explicit_two };

struct GptCase {
  int replicas = 1;  // > 1: HSDP on a replicas x shards mesh; 1: a 1-D group of `shards`
  int shards = 2;
  bool bf16 = false;  // bf16 all-gathers, compute and reduce-scatters
  bool offload = false;
  Accumulate accumulate = Accumulate::none;
  Prefetch prefetch = Prefetch::implicit;
  std::optional<std::variant<bool, int>> block_reshard = std::nullopt;  // the blocks' reshard_after_forward
  bool mesh_even_if_one_replica = false;  // a 1 x shards mesh instead of a 1-D group
  int world() const { return replicas * shards; }
};

inline std::string Describe(const GptCase& c) {
  std::string reshard = "default";
  if (c.block_reshard) {
    reshard = std::holds_alternative<bool>(*c.block_reshard) ? (std::get<bool>(*c.block_reshard) ? "true" : "false")
                                                              : absl::StrCat(std::get<int>(*c.block_reshard));
  }
  return absl::StrCat(c.replicas > 1 || c.mesh_even_if_one_replica ? absl::StrCat("hsdp ", c.replicas, "x") : "1-D ",
                      c.shards, c.bf16 ? " bf16" : "", c.offload ? " offload" : "",
                      c.accumulate == Accumulate::defer_all_reduce ? " deferred-all-reduce"
                      : c.accumulate == Accumulate::no_sync        ? " no-sync"
                                                                   : "",
                      c.prefetch == Prefetch::off ? " no-prefetch" : c.prefetch == Prefetch::explicit_two ? " explicit-prefetch" : "",
                      " reshard ", reshard);
}

inline FullyShardOptions BlockOptions(const GptCase& c) {
  FullyShardOptions o;
  o.reshard_after_forward = c.block_reshard;
  o.implicit_prefetch = c.prefetch == Prefetch::implicit;
  o.max_prefetched_units = c.prefetch == Prefetch::explicit_two ? 2 : 1;
  if (c.bf16) o.mp_policy = {.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};
  o.offload_policy.cpu = c.offload;
  return o;
}

inline std::vector<FSDPModule> BlockUnits(nn::GPT& model) {
  std::vector<FSDPModule> out;
  for (nn::Module* m : modules_of_type(model, "TransformerBlock")) out.push_back(*state_of(*m));
  return out;
}

// fully_shard GPT-tiny bottom-up (every block, then the root) over `pg`, on a replicas x shards mesh for HSDP;
// explicit prefetch lists when the case asks for them.
inline absl::Status ShardGptCase(nn::GPT& model, const std::shared_ptr<comm::ProcessGroup>& pg, const GptCase& c) {
  std::optional<comm::DeviceMesh> mesh;
  if (c.replicas > 1 || c.mesh_even_if_one_replica) {
    auto m = comm::DeviceMesh::create(pg, {c.replicas, c.shards}, {"replicate", "shard"});
    if (!m.ok()) return m.status();
    mesh.emplace(std::move(*m));
  }
  auto shard = [&](nn::Module& m, const FullyShardOptions& o) -> absl::Status {
    return (mesh ? fully_shard(m, *mesh, o) : fully_shard(m, pg, o)).status();
  };
  const FullyShardOptions blocks = BlockOptions(c);
  for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
    if (absl::Status s = shard(*b, blocks); !s.ok()) return s;
  }
  FullyShardOptions root = blocks;
  root.reshard_after_forward = std::nullopt;  // FSDP2's default for the root
  if (absl::Status s = shard(model, root); !s.ok()) return s;
  if (c.prefetch == Prefetch::explicit_two) {
    std::vector<FSDPModule> units = BlockUnits(model);
    const int n = static_cast<int>(units.size());
    for (int i = 0; i < n; ++i) {
      std::vector<FSDPModule> fwd, bwd;
      for (int j = i + 1; j < std::min(n, i + 3); ++j) fwd.push_back(units[static_cast<std::size_t>(j)]);
      for (int j = i - 1; j >= std::max(0, i - 2); --j) bwd.push_back(units[static_cast<std::size_t>(j)]);
      if (absl::Status s = units[static_cast<std::size_t>(i)].set_modules_to_forward_prefetch(fwd); !s.ok()) return s;
      if (absl::Status s = units[static_cast<std::size_t>(i)].set_modules_to_backward_prefetch(bwd); !s.ok()) return s;
    }
    FSDPModule r = *state_of(model);
    if (absl::Status s = r.set_modules_to_forward_prefetch({units[0], units[1]}); !s.ok()) return s;
    if (absl::Status s = r.set_modules_to_backward_prefetch({units.back(), units[units.size() - 2]}); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// Hooks a test may set to tamper with one rank's training (the planted mistakes that prove a check can fail).
struct Plant {
  std::function<void(int step, int rank, Tensor& loss)> on_loss;                         // before backward
  std::function<void(int step, int rank, optim::Optimizer& opt, nn::GPT& model)> before_step;  // before opt.step()
};

// Steps [first, last) of world rank `rank`: its rows of each batch (kBatch / world), accumulated as the case says,
// one optimizer step each.
inline absl::Status TrainSteps(nn::GPT& model, optim::Optimizer& opt, int rank, const GptCase& c, int first, int last,
                               const Plant* plant = nullptr) {
  FSDPModule root = *state_of(model);
  const int rows = gpt_tiny::kBatch / c.world();
  const int parts = c.accumulate == Accumulate::none ? 1 : 2;
  if (rows % parts != 0 || rows * c.world() != gpt_tiny::kBatch) {
    return absl::InvalidArgumentError(absl::StrCat("test case ", Describe(c), ": ", gpt_tiny::kBatch,
                                                   " rows do not split evenly into ", c.world(), " x ", parts));
  }
  for (int step = first; step < last; ++step) {
    opt.zero_grad();
    for (int part = 0; part < parts; ++part) {
      const bool last_part = part == parts - 1;
      if (c.accumulate == Accumulate::defer_all_reduce) root.set_requires_all_reduce(last_part);
      if (c.accumulate == Accumulate::no_sync) root.set_requires_gradient_sync(last_part);
      auto [x, y] = gpt_tiny::Batch(step, rank * rows + part * rows / parts, rows / parts);
      Tensor loss = model.loss(x, y);
      if (parts > 1) loss = autograd::scale(loss, 1.0f / static_cast<float>(parts));
      if (plant != nullptr && plant->on_loss) plant->on_loss(step, rank, loss);
      if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
    }
    if (plant != nullptr && plant->before_step) plant->before_step(step, rank, opt, model);
    if (absl::Status s = opt.step(); !s.ok()) return s;
  }
  return absl::OkStatus();
}

// One rank's run over `pg` (its world group): GPT-tiny seed 1, `steps` steps of `factory`'s optimizer (AdamW's
// default hyper-parameters); the full values at the end.
inline absl::StatusOr<Params> RunGpt(const std::shared_ptr<comm::ProcessGroup>& pg, const GptCase& c, int steps,
                                     const Plant* plant = nullptr,
                                     const optim::OptimizerFactory& factory = optim::AdamW::factory()) {
  nn::GPT model(gpt_tiny::TinyConfig(), 1);
  if (absl::Status s = ShardGptCase(model, pg, c); !s.ok()) return s;
  auto opt = factory({{model.parameters(), optim::AdamW::default_hyper()}});
  if (!opt.ok()) return opt.status();
  if (absl::Status s = TrainSteps(model, **opt, pg->rank(), c, 0, steps, plant); !s.ok()) return s;
  return test_util::FullValues(model);
}

// Every rank's full values after `steps` steps over the in-process backend.
inline std::vector<Params> InProcess(const GptCase& c, int steps, const Plant* plant = nullptr,
                                     const optim::OptimizerFactory& factory = optim::AdamW::factory()) {
  std::vector<Params> got(static_cast<std::size_t>(c.world()));
  absl::Status st = comm::RunRanks(c.world(), [&](comm::RankEnv& env) -> absl::Status {
    auto v = RunGpt(env.group_ptr, c, steps, plant, factory);
    if (!v.ok()) return v.status();
    got[static_cast<std::size_t>(env.rank)] = std::move(*v);
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << Describe(c) << ": " << st;
  return got;
}

// Flattened values (what the process-backend tests send around).
inline std::vector<float> Flat(const Params& p) {
  std::vector<float> out;
  for (const auto& v : p) out.insert(out.end(), v.begin(), v.end());
  return out;
}

}  // namespace shardkit::fsdp::combo6
