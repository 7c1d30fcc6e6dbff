// Seventh round of feature combinations of fully_shard on a CUDA device (Note [unit on a device] in
// fsdp/param_group.cc): simulated ranks whose models all live on cuda:0, each combination against the same sharded
// run on CPU ranks. The device path differs where bytes cross between host and device (cpu offload: the host shards
// copied to the device at every gather, the reduced rows back), where dtypes are converted on the device (bf16
// gathers and reductions), and where frozen parameters, checkpoint recomputes, k-group shards, own collectives and
// HSDP's kept rows live. Every case skips without a CUDA device; the emulator build (-DSHARDKIT_CUDA_EMULATOR=ON)
// runs them against the CPU emulation of the CUDA seams (whose device kernels round a little differently from the CPU
// ones: differences of 1e-9..1e-6 after four steps), so the tolerance is tighter there than on a real GPU.
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/autograd/ops/elementwise.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/checkpoint.h"
#include "common/nn/deferred_init.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "fsdp/clip_grad.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "tests/common/tensor/cuda_test_util.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::fsdp {
namespace {

using Params = std::vector<std::vector<float>>;

constexpr int kSteps = 4;

struct DeviceCase {
  int replicas = 1;  // > 1: HSDP on a replicas x shards mesh
  int shards = 2;
  bool bf16 = false;
  bool offload = false;
  bool own = false;         // own_collective_min_numel = 1
  bool defer = false;       // two half-batches, the replicas' all-reduce (HSDP) or the gradient sync (1-D) deferred
  bool ckpt = false;        // blocks and ln_f checkpointed (after fully_shard)
  bool freeze = false;      // blocks.0.attn and the tied embedding frozen before fully_shard
  double clip = 0;          // > 0: fsdp::clip_grad_norm before each step
  std::optional<std::variant<bool, int>> block_reshard = std::nullopt;
  int world() const { return replicas * shards; }
};

std::string Describe(const DeviceCase& c) {
  return absl::StrCat(c.replicas > 1 ? absl::StrCat("hsdp ", c.replicas, "x") : "1-D ", c.shards,
                      c.bf16 ? " bf16" : "", c.offload ? " offload" : "", c.own ? " own-collectives" : "",
                      c.defer ? " deferred" : "", c.ckpt ? " checkpointed" : "", c.freeze ? " frozen-parts" : "",
                      c.clip > 0 ? " clipped" : "",
                      c.block_reshard && std::holds_alternative<int>(*c.block_reshard)
                          ? absl::StrCat(" k=", std::get<int>(*c.block_reshard))
                          : "");
}

void Freeze(nn::GPT& model) {
  for (const auto& [name, m] : model.named_modules()) {
    if (name == "blocks.0.attn" || name == "wte") m->set_requires_grad(false);
  }
}

// What one rank reports: its full values at the end, and facts about where things lived.
struct RankOut {
  Params values;
  std::vector<double> norms;
};

// One rank of `c` with the model on `device`: GPT-tiny seed 1, kSteps AdamW steps on its rows.
absl::Status RunRank(comm::RankEnv& env, const DeviceCase& c, Device device, RankOut& out) {
  nn::GPT model(gpt_tiny::TinyConfig(), 1);
  model.to(device);
  if (c.freeze) Freeze(model);
  std::optional<comm::DeviceMesh> mesh;
  if (c.replicas > 1) {
    auto m = comm::DeviceMesh::create(env.group_ptr, {c.replicas, c.shards}, {"replicate", "shard"});
    if (!m.ok()) return m.status();
    mesh.emplace(std::move(*m));
  }
  FullyShardOptions o;
  o.reshard_after_forward = c.block_reshard;
  if (c.own) o.own_collective_min_numel = 1;
  if (c.bf16) o.mp_policy = {.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};
  o.offload_policy.cpu = c.offload;
  for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
    if (auto s = mesh ? fully_shard(*b, *mesh, o) : fully_shard(*b, env.group_ptr, o); !s.ok()) return s.status();
  }
  FullyShardOptions ro = o;
  ro.reshard_after_forward = std::nullopt;
  auto root = mesh ? fully_shard(model, *mesh, ro) : fully_shard(model, env.group_ptr, ro);
  if (!root.ok()) return root.status();
  if (c.ckpt) {
    if (absl::Status s = nn::checkpoint_blocks(model); !s.ok()) return s;
    if (absl::Status s = nn::checkpoint(*model.ln_f); !s.ok()) return s;
  }
  // Where the shards live: the host under offload, else the model's device; frozen shards stay frozen.
  for (const NamedParameter& p : named_parameters(model)) {
    if (!p.shard.has_value()) return absl::InternalError(absl::StrCat(p.names.front(), " not sharded"));
    EXPECT_EQ(p.shard->local.device(), c.offload ? Device::cpu() : device) << p.names.front();
    const bool frozen = p.names.front().rfind("blocks.0.attn.", 0) == 0 || p.names.front() == "wte.weight";
    EXPECT_EQ(p.shard->local.requires_grad(), !(c.freeze && frozen)) << p.names.front();
  }
  auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
  if (!opt.ok()) return opt.status();
  const int rows = gpt_tiny::kBatch / c.world();
  const int parts = c.defer ? 2 : 1;
  for (int step = 0; step < kSteps; ++step) {
    (*opt)->zero_grad();
    for (int part = 0; part < parts; ++part) {
      const bool last = part == parts - 1;
      if (c.defer && c.replicas > 1) root->set_requires_all_reduce(last);
      if (c.defer && c.replicas == 1) root->set_requires_gradient_sync(last);
      auto [x, y] = gpt_tiny::Batch(step, env.rank * rows + part * rows / parts, rows / parts);
      Tensor loss = model.loss(x.to(device), y.to(device));
      if (parts > 1) loss = autograd::scale(loss, 0.5f);
      if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
    }
    if (c.clip > 0) {
      auto n = clip_grad_norm(model, c.clip);
      if (!n.ok()) return n.status();
      out.norms.push_back(*n);
    }
    if (c.freeze) {
      for (const NamedParameter& p : named_parameters(model)) {
        if (!p.param.requires_grad()) {
          EXPECT_FALSE(p.param.grad().defined()) << p.names.front();
        }
      }
    }
    if (absl::Status s = (*opt)->step(); !s.ok()) return s;
  }
  auto v = test_util::FullValues(model);
  if (!v.ok()) return v.status();
  out.values = std::move(*v);
  return absl::OkStatus();
}

std::vector<RankOut> Train(const DeviceCase& c, Device device) {
  std::vector<RankOut> out(static_cast<std::size_t>(c.world()));
  absl::Status st = comm::RunRanks(c.world(), [&](comm::RankEnv& env) -> absl::Status {
    return RunRank(env, c, device, out[static_cast<std::size_t>(env.rank)]);
  });
  EXPECT_TRUE(st.ok()) << Describe(c) << " on " << device.str() << ": " << st;
  return out;
}

std::vector<Params> ValuesOf(const std::vector<RankOut>& outs) {
  std::vector<Params> v;
  for (const RankOut& o : outs) v.push_back(o.values);
  return v;
}

#ifdef SHARDKIT_CUDA_EMULATOR
constexpr bool kEmulated = true;
#else
constexpr bool kEmulated = false;
#endif

Params Initial() {
  RankContext ctx;
  RankContextScope scope(ctx);
  return gpt_tiny::Values(nn::GPT(gpt_tiny::TinyConfig(), 1));
}

// Each combination on cuda:0 ends where the same combination on CPU ranks ends (within kernel rounding), every rank
// alike (bitwise); frozen parts never move (bitwise); clipping norms agree.
TEST(FsdpCudaCombo7, OffloadBf16FrozenCheckpointedAndHsdpCombinationsEqualTheCpuRun) {
  SK_REQUIRE_CUDA_DEVICE("fully_shard combinations on one GPU");
  const DeviceCase cases[] = {
      {.shards = 2, .bf16 = true, .offload = true},
      {.shards = 4, .offload = true, .own = true, .block_reshard = 2},
      {.shards = 4, .bf16 = true, .offload = true, .block_reshard = 2},
      {.replicas = 2, .shards = 2, .bf16 = true, .offload = true, .defer = true},
      {.replicas = 2, .shards = 2, .offload = true, .own = true, .defer = true, .ckpt = true, .freeze = true},
      {.shards = 3, .offload = true, .own = true, .defer = true, .freeze = true},
      {.shards = 2, .bf16 = true, .offload = true, .ckpt = true, .freeze = true, .block_reshard = false},
      {.shards = 2, .offload = true, .own = true, .freeze = true, .clip = 0.05},
  };
  static const Params initial = Initial();
  for (const DeviceCase& c : cases) {
    SCOPED_TRACE(Describe(c));
    const std::vector<RankOut> cpu = Train(c, Device::cpu());
    const std::vector<RankOut> gpu = Train(c, Device::cuda(0));
    ASSERT_EQ(gpu.size(), cpu.size());
    ASSERT_FALSE(cpu[0].values.empty());
    const double tol = c.bf16 ? 2e-3 : kEmulated ? 2e-5 : 1e-4;
    gpt_tiny::ExpectMatches(ValuesOf(gpu), cpu[0].values, tol);
    if (c.freeze) {  // blocks.0.attn (parameters 4..7) and wte (parameter 0)
      for (const RankOut& o : gpu) {
        for (const std::size_t i : {0u, 4u, 5u, 6u, 7u}) EXPECT_EQ(o.values[i], initial[i]) << "frozen parameter " << i;
      }
    }
    for (std::size_t r = 0; r < gpu.size(); ++r) {
      ASSERT_EQ(gpu[r].norms.size(), cpu[r].norms.size());
      for (std::size_t s = 0; s < gpu[r].norms.size(); ++s) {
        EXPECT_NEAR(gpu[r].norms[s], cpu[r].norms[s], 1e-5 * cpu[r].norms[s]) << "rank " << r;
        EXPECT_GT(cpu[r].norms[s], 2 * c.clip) << "the test needs clipping to act";
      }
    }
  }
}

// A model built inside a DeferredInitScope, moved to the device (Module::to) and sharded inside the scope (the way to
// build a large model for a GPU without holding it whole): the deferred parameters move without bytes
// (DeferredInit::transfer) and each rank's shards hold the eager model's rows. An audit found the move dying on an
// internal check.
TEST(FsdpCudaCombo7, DeferredInitMovedToTheDeviceIsMaterialisedThere) {
  SK_REQUIRE_CUDA_DEVICE("deferred init of a model on one GPU");
  static const Params eager = Initial();
  for (const bool offload : {false, true}) {
    SCOPED_TRACE(offload ? "offload" : "no offload");
    absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
      nn::DeferredInit init;
      nn::DeferredInitScope scope(init);
      nn::GPT model(gpt_tiny::TinyConfig(), 1);
      model.to(Device::cuda(0));
      FullyShardOptions o;
      o.offload_policy.cpu = offload;
      for (nn::Module* b : modules_of_type(model, "TransformerBlock")) {
        if (auto s = fully_shard(*b, env.group_ptr, o); !s.ok()) return s.status();
      }
      if (auto s = fully_shard(model, env.group_ptr, o); !s.ok()) return s.status();
      EXPECT_EQ(init.pending(), 0u);
      auto values = test_util::FullValues(model);
      if (!values.ok()) return values.status();
      EXPECT_EQ(*values, eager) << "rank " << env.rank;
      return absl::OkStatus();
    });
    EXPECT_TRUE(st.ok()) << st;
  }
}

}  // namespace
}  // namespace shardkit::fsdp
