// Third round of feature combinations of fully_shard, each against single-rank training (DESIGN.md section 8):
//   * fsdp::clip_grad_norm with norm_type 2 and inf, with a head that only rank 0 uses (the other ranks compute no
//     gradient for it), on a 1-D group (the head in the root's unit, or a unit of its own) and on an HSDP mesh;
//   * a checkpoint in the middle of training (full_state_dict + full_optimizer_state) with two interleaved param
//     groups and an lr schedule, written under one configuration (HSDP, cpu offload, plain) and loaded under another
//     at another world size, then continued: equal to uninterrupted single-rank training (AdamW's per-parameter step
//     count, so its bias correction, and the groups must come back).
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/ops/elementwise.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/optim/adam.h"
#include "common/optim/clip_grad.h"
#include "common/optim/lr_schedule.h"
#include "common/optim/sgd.h"
#include "fsdp/clip_grad.h"
#include "fsdp/fully_shard.h"
#include "fsdp/state_dict.h"
#include "gtest/gtest.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"
#include "tests/testing/two_head_net.h"

namespace shardkit::fsdp {
namespace {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;
using gpt_tiny::Values;
using two_head::HeadInput;
using two_head::TwoHeadNet;
using Params = std::vector<std::vector<float>>;

// How the ranks shard: a 1-D group of `shards`, or an HSDP mesh `replicas` x `shards`; cpu offload or not.
struct Layout {
  int replicas = 1;
  int shards = 2;
  bool b_unit = false;  // TwoHeadNet's head b a unit of its own (else in the root's)
  bool offload = false;
  int world() const { return replicas * shards; }
};

std::string Describe(const Layout& c) {
  return absl::StrCat(c.replicas, "x", c.shards, c.b_unit ? " b_unit" : "", c.offload ? " offload" : "");
}

// fully_shard on the layout: `children` first (bottom-up), then the root.
absl::Status Shard(nn::Module& root, const std::vector<nn::Module*>& children, comm::RankEnv& env, const Layout& c) {
  std::optional<comm::DeviceMesh> mesh;
  if (c.replicas > 1) {
    auto m = comm::DeviceMesh::create(env.group_ptr, {c.replicas, c.shards}, {"replicate", "shard"});
    if (!m.ok()) return m.status();
    mesh.emplace(std::move(*m));
  }
  FullyShardOptions options{.offload_policy = {.cpu = c.offload}};
  auto shard = [&](nn::Module& m, FullyShardOptions o) -> absl::Status {
    return (mesh ? fully_shard(m, *mesh, o) : fully_shard(m, env.group_ptr, o)).status();
  };
  for (nn::Module* m : children) {
    if (absl::Status s = shard(*m, options); !s.ok()) return s;
  }
  FullyShardOptions root_options = options;
  root_options.reshard_after_forward = std::nullopt;
  return shard(root, root_options);
}

// ---- clip_grad_norm (2, inf) with a head only rank 0 uses ---------------------------------------------------------

constexpr int kClipSteps = 4;
const optim::HyperParams kSgd{.lr = 0.05, .momentum = 0.9};

double MaxNorm(double norm_type) { return std::isinf(norm_type) ? 0.02 : 0.05; }

// One rank on every rank's input, b in rank 0's loss term only, clipped before each step; `norms`: the norms before
// clipping.
Params ClipReference(int world, double norm_type, std::vector<double>* norms) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TwoHeadNet net(3);
  auto opt = optim::Sgd::factory()({{net.parameters(), kSgd}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kClipSteps; ++step) {
    (*opt)->zero_grad();
    Tensor loss;
    for (int r = 0; r < world; ++r) {
      net.use_b = r == 0;
      const Tensor l = net(HeadInput(step, r));
      loss = loss.defined() ? autograd::add(loss, l) : l;
    }
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    norms->push_back(optim::clip_grad_norm(net.parameters(), MaxNorm(norm_type), norm_type));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(net);
}

// Head b is used on rank 0 only. fsdp::clip_grad_norm must return the one-rank norm (2 or inf) on every rank,
// clipping must act, and training must end where the clipped one-rank run ends.
TEST(FsdpClipNormCombo, NormAndClippingWithAHeadOneRankUsesAsOnOneRank) {
  // b stays in the root's unit: as a unit of its own, the ranks that skip it would skip its all-gather, which FSDP
  // (as PyTorch's) refuses as mismatched collectives (a clear InvalidArgument here, not a hang).
  const Layout layouts[] = {{.shards = 2}, {.shards = 3}, {.replicas = 2, .shards = 2}, {.replicas = 3, .shards = 1}};
  for (const double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    for (const Layout& c : layouts) {
      SCOPED_TRACE(absl::StrCat(Describe(c), " norm ", norm_type));
      std::vector<double> want_norms;
      const Params want = ClipReference(c.world(), norm_type, &want_norms);
      std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(c.world()));
      absl::Status st = comm::RunRanks(c.world(), [&](comm::RankEnv& env) -> absl::Status {
        TwoHeadNet net(3);
        net.use_b = env.rank == 0;
        std::vector<nn::Module*> children;
        if (c.b_unit) children.push_back(net.b.get());
        if (absl::Status s = Shard(net, children, env, c); !s.ok()) return s;
        auto opt = optim::Sgd::factory()({{net.parameters(), kSgd}});
        if (!opt.ok()) return opt.status();
        for (int step = 0; step < kClipSteps; ++step) {
          (*opt)->zero_grad();
          if (absl::Status s = autograd::try_backward(net(HeadInput(step, env.rank))); !s.ok()) return s;
          absl::StatusOr<double> norm = clip_grad_norm(net, MaxNorm(norm_type), norm_type);
          if (!norm.ok()) return norm.status();
          const double w = want_norms[static_cast<std::size_t>(step)];
          EXPECT_NEAR(*norm, w, 1e-6 * w) << "rank " << env.rank << " step " << step;
          EXPECT_GT(*norm, 2 * MaxNorm(norm_type)) << "step " << step << ": the test needs clipping to act";
          if (absl::Status s = (*opt)->step(); !s.ok()) return s;
        }
        return test_util::StoreFullValues(net, got, env.rank);
      });
      ASSERT_TRUE(st.ok()) << st;
      gpt_tiny::ExpectMatches(got, want, 1e-6);
    }
  }
}

// ---- a checkpoint mid-run with param groups and a schedule, loaded under another layout --------------------------

constexpr int kCkptSteps = 8;
constexpr int kCkptAt = 4;
constexpr double kBaseLr[] = {2e-3, 4e-3};

// Two interleaved groups over model.parameters() (the shards under FSDP): matrices (lr 2e-3, weight decay 0.1) and
// the rest (lr 4e-3, no weight decay).
std::vector<optim::ParamGroup> GptGroups(const nn::Module& model) {
  optim::HyperParams decay = optim::AdamW::default_hyper(), no_decay = optim::AdamW::default_hyper();
  decay.lr = kBaseLr[0];
  decay.weight_decay = 0.1;
  no_decay.lr = kBaseLr[1];
  no_decay.weight_decay = 0.0;
  std::vector<Tensor> d, nd;
  for (const Tensor& p : model.parameters()) (p.shape().size() >= 2 ? d : nd).push_back(p);
  return {{d, decay}, {nd, no_decay}};
}

double LrFactor(int step) { return optim::warmup_cosine_factor(step, 2, kCkptSteps, 0.1); }

Params CkptReference() {
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(TinyConfig(), 1);
  auto opt = optim::AdamW::factory()(GptGroups(model));
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kCkptSteps; ++step) {
    for (std::size_t g = 0; g < 2; ++g) (*opt)->mutable_hyper(g).lr = kBaseLr[g] * LrFactor(step);
    auto [x, y] = Batch(step, 0, kBatch);
    (*opt)->zero_grad();
    autograd::backward(model.loss(x, y));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(model);
}

std::vector<nn::Module*> Blocks(nn::GPT& model) { return modules_of_type(model, "TransformerBlock"); }

nn::StateDict Copy(const nn::StateDict& sd) {
  nn::StateDict out;
  for (const auto& [name, t] : sd) out.emplace_back(name, t.clone());
  return out;
}

// Steps [first, last) of GPT-tiny under `c`, each rank on its rows; starts from the checkpoint when `model_in` is
// given; writes the checkpoint (full model and optimizer state, rank 0's copy) when `model_out` is.
absl::Status TrainSpan(const Layout& c, int first, int last, const nn::StateDict* model_in,
                       const optim::OptimizerStateDict* opt_in, nn::StateDict* model_out,
                       optim::OptimizerStateDict* opt_out, std::vector<std::vector<std::vector<float>>>* got) {
  return comm::RunRanks(c.world(), [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(TinyConfig(), model_in != nullptr ? 7 : 1);
    if (absl::Status s = Shard(model, Blocks(model), env, c); !s.ok()) return s;
    auto opt = optim::AdamW::factory()(GptGroups(model));
    if (!opt.ok()) return opt.status();
    if (model_in != nullptr) {
      if (absl::Status s = load_full_state_dict(model, *model_in); !s.ok()) return s;
      if (absl::Status s = load_full_optimizer_state(model, **opt, *opt_in); !s.ok()) return s;
    }
    const int rows = kBatch / c.world();
    for (int step = first; step < last; ++step) {
      for (std::size_t g = 0; g < 2; ++g) (*opt)->mutable_hyper(g).lr = kBaseLr[g] * LrFactor(step);
      auto [x, y] = Batch(step, env.rank * rows, rows);
      (*opt)->zero_grad();
      if (absl::Status s = autograd::try_backward(model.loss(x, y)); !s.ok()) return s;
      if (absl::Status s = (*opt)->step(); !s.ok()) return s;
    }
    if (model_out != nullptr) {
      auto msd = full_state_dict(model);
      if (!msd.ok()) return msd.status();
      auto osd = full_optimizer_state(model, **opt);
      if (!osd.ok()) return osd.status();
      if (env.rank == 0) *model_out = Copy(*msd), *opt_out = osd->clone();
    }
    if (got != nullptr) return test_util::StoreFullValues(model, *got, env.rank);
    return absl::OkStatus();
  });
}

// Steps 0..3 under layout A, full checkpoint, steps 4..7 under layout B from it (another world size, HSDP or cpu
// offload on one side): equal to uninterrupted single-rank training (tests/fsdp/fsdp_state_test.cc's tolerance).
TEST(FsdpCheckpointCombo, GroupsAndScheduleResumedUnderAnotherLayoutAsUninterruptedOneRank) {
  static const Params want = CkptReference();
  const std::pair<Layout, Layout> cases[] = {
      {{.replicas = 2, .shards = 2}, {.shards = 3}},
      {{.shards = 2, .offload = true}, {.replicas = 2, .shards = 2}},
      {{.shards = 3}, {.shards = 2, .offload = true}},
      {{.replicas = 2, .shards = 2, .offload = true}, {.replicas = 1, .shards = 2}},
  };
  for (const auto& [a, b] : cases) {
    SCOPED_TRACE(absl::StrCat(Describe(a), " -> ", Describe(b)));
    nn::StateDict model_sd;
    optim::OptimizerStateDict opt_sd;
    absl::Status st = TrainSpan(a, 0, kCkptAt, nullptr, nullptr, &model_sd, &opt_sd, nullptr);
    ASSERT_TRUE(st.ok()) << st;
    ASSERT_EQ(opt_sd.param_groups.size(), 2u);
    std::vector<std::vector<std::vector<float>>> got(static_cast<std::size_t>(b.world()));
    st = TrainSpan(b, kCkptAt, kCkptSteps, &model_sd, &opt_sd, nullptr, nullptr, &got);
    ASSERT_TRUE(st.ok()) << st;
    gpt_tiny::ExpectMatches(got, want, 2e-5);
  }
}

}  // namespace
}  // namespace shardkit::fsdp
