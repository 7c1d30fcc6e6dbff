// sddp::ShardedGradScaler (sddp/grad_scaler.h) with fully_shard, on a 1-D group and on an HSDP mesh, each against
// single-rank training (DESIGN.md section 8). The scaler gets the sharded gradients (model.parameters()' .grad(): the
// shards') and a group to agree on found_inf over:
//   * an inf or nan planted in ONE rank's pre-reduction gradient, in rows of one parameter that another rank's shard
//     holds: after the reduce-scatter only the shard owners see it, so every rank must still skip the step (agreed
//     found_inf), keep its shards, and back the scale off alike; training goes on as one rank that skips the step;
//     on a 1-D group, on HSDP with the world group and with the shard group (the one FSDP's root reports), with
//     offload, and with the inf in the first of two micro-batches whose all-reduce across replicas is deferred;
//   * a clean run with the scale growing: loss scaling by powers of two is exact, so the run gives the bits of the
//     run without the scaler (f32, bf16 with offload, HSDP with accumulation), and f32 equals one rank.
//
// Under HSDP the group does not matter for correctness: the all-reduce across replicas carries an inf or nan to the
// same rows of every replica, so each shard group sees every overflow (checked by both HSDP cases). The replicate
// group (mesh dim 0) is NOT enough: a column whose ranks hold no overflowed rows steps while the others skip, and the
// replicas silently diverge (the first test fails that way when given mesh->group_ptr(0)).
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/hooks.h"
#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/reduce.h"
#include "common/comm/device_mesh.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/layers.h"
#include "common/optim/finite.h"
#include "common/optim/sgd.h"
#include "fsdp/fully_shard.h"
#include "gtest/gtest.h"
#include "sddp/grad_scaler.h"
#include "tests/fsdp/fsdp_combo6_util.h"
#include "tests/fsdp/fsdp_test_util.h"
#include "tests/testing/gpt_tiny_data.h"
#include "tests/testing/two_head_net.h"

namespace shardkit::fsdp {
namespace {

using combo6::Accumulate;
using combo6::GptCase;
using combo6::Params;
using two_head::HeadInput;

// ---- an overflow in one rank's gradient of rows another rank holds ------------------------------------------------

// trunk (Linear 4 -> 8, in the root's unit) -> relu -> head (Linear 8 -> 3, a unit of its own); loss mean(y^2). When
// `plant` is set, the gradient w.r.t. trunk's output gets `plant` in column 0, which reaches trunk.weight's row 0 and
// trunk.bias[0] only (the input needs no gradient): after the reduce-scatter only the shard holding row 0 (shard rank
// 0) sees it.
class PlantNet : public nn::Module {
 public:
  PlantNet() : Module("PlantNet") {
    Generator gen(5, 0);
    trunk = register_module("trunk", std::make_shared<nn::Linear>(4, 8, gen));
    head = register_module("head", std::make_shared<nn::Linear>(8, 3, gen));
  }
  std::optional<float> plant;
  std::shared_ptr<nn::Linear> trunk, head;

 protected:
  Tensor forward(const Tensor& x) override {
    const Tensor pre = (*trunk)(x);
    hooks_.clear();
    if (plant) {
      const float value = *plant;
      hooks_.push_back(autograd::register_hook(pre, [value](const Tensor& g) -> std::optional<Tensor> {
        std::vector<float> v = g.to_vector();
        const std::int64_t cols = g.shape()[1];
        for (std::size_t i = 0; i < v.size(); i += static_cast<std::size_t>(cols)) v[i] = value;
        return Tensor::from_vector(v, g.shape());
      }));
    }
    const Tensor y = (*head)(autograd::relu(pre));
    return autograd::mean(autograd::mul(y, y));
  }

 private:
  std::vector<autograd::HookHandle> hooks_;
};

constexpr int kPlantSteps = 5;
constexpr int kPlantStep = 2;
const optim::HyperParams kSgd{.lr = 0.05, .momentum = 0.9};

// One rank on every rank's inputs (micro-batch m of step s of rank r: HeadInput(s * micros + m, r)), SGD with
// momentum, step kPlantStep skipped entirely (what a scaler that found the overflow does).
Params PlantReference(int world, int micros) {
  RankContext ctx;
  RankContextScope scope(ctx);
  PlantNet net;
  auto opt = optim::Sgd::factory()({{net.parameters(), kSgd}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kPlantSteps; ++step) {
    if (step == kPlantStep) continue;
    (*opt)->zero_grad();
    Tensor loss;
    for (int r = 0; r < world; ++r) {
      for (int m = 0; m < micros; ++m) {
        const Tensor l = net(HeadInput(step * micros + m, r));
        loss = loss.defined() ? autograd::add(loss, l) : l;
      }
    }
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world * micros)));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return gpt_tiny::Values(net);
}

struct PlantCase {
  int replicas = 1;
  int shards = 2;
  bool shard_group = false;  // HSDP: the scaler agrees over the shard group instead of the world
  bool offload = false;
  int micros = 1;             // with 2: the HSDP all-reduce across replicas deferred to the second
  int plant_micro = 0;        // the micro-batch the overflow is planted in
  float value = std::numeric_limits<float>::infinity();
  int world() const { return replicas * shards; }
};

std::string Describe(const PlantCase& c) {
  return absl::StrCat(c.replicas > 1 ? absl::StrCat("hsdp ", c.replicas, "x") : "1-D ", c.shards,
                      c.shard_group ? " shard group" : " world group", c.offload ? " offload" : "", " micros ", c.micros,
                      " planted ", c.value, " in micro ", c.plant_micro);
}

// The overflow is planted on the last rank (a rank of shard rank > 0, so not a rank that holds row 0): every rank
// skips step kPlantStep, keeps its shards there, has the same scale after every step (1024, halved once), and ends
// where one rank that skips the step ends; some rank saw no overflow in the gradients it holds (the agreement is
// what makes it skip).
TEST(FsdpScalerCombo, AnOverflowOnOneRankMakesEveryRankSkipAlike) {
  const PlantCase cases[] = {
      {.shards = 2},
      {.shards = 3, .value = std::numeric_limits<float>::quiet_NaN()},
      {.shards = 2, .offload = true},
      {.replicas = 2, .shards = 2},
      {.replicas = 2, .shards = 2, .shard_group = true},
      {.replicas = 2, .shards = 2, .shard_group = true, .offload = true, .value = std::numeric_limits<float>::quiet_NaN()},
      {.replicas = 2, .shards = 2, .shard_group = true, .micros = 2, .plant_micro = 0},
      {.replicas = 2, .shards = 3, .micros = 2, .plant_micro = 0},
  };
  for (const PlantCase& c : cases) {
    SCOPED_TRACE(Describe(c));
    const int world = c.world();
    const Params want = PlantReference(world, c.micros);
    std::vector<Params> got(static_cast<std::size_t>(world));
    std::vector<std::vector<double>> scales(static_cast<std::size_t>(world));
    std::vector<int> saw_locally(static_cast<std::size_t>(world), 0);
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      const auto r = static_cast<std::size_t>(env.rank);
      PlantNet net;
      std::optional<comm::DeviceMesh> mesh;
      if (c.replicas > 1) {
        auto m = comm::DeviceMesh::create(env.group_ptr, {c.replicas, c.shards}, {"replicate", "shard"});
        if (!m.ok()) return m.status();
        mesh.emplace(std::move(*m));
      }
      const FullyShardOptions o{.offload_policy = {.cpu = c.offload}};
      for (nn::Module* m : {static_cast<nn::Module*>(net.head.get()), static_cast<nn::Module*>(&net)}) {
        if (auto s = mesh ? fully_shard(*m, *mesh, o) : fully_shard(*m, env.group_ptr, o); !s.ok()) return s.status();
      }
      FSDPModule root = *state_of(net);
      auto opt = optim::Sgd::factory()({{net.parameters(), kSgd}});
      if (!opt.ok()) return opt.status();
      sddp::ShardedGradScaler scaler(c.shard_group ? mesh->group_ptr(1) : env.group_ptr,
                                     {.init_scale = 1024.0, .growth_interval = 100});
      for (int step = 0; step < kPlantSteps; ++step) {
        (*opt)->zero_grad();
        for (int m = 0; m < c.micros; ++m) {
          if (c.replicas > 1) root.set_requires_all_reduce(m == c.micros - 1);
          net.plant = step == kPlantStep && m == c.plant_micro && env.rank == world - 1 ? std::optional<float>(c.value)
                                                                                          : std::nullopt;
          Tensor loss = net(HeadInput(step * c.micros + m, env.rank));
          if (c.micros > 1) loss = autograd::scale(loss, 1.0f / static_cast<float>(c.micros));
          if (absl::Status s = autograd::try_backward(scaler.scale(loss)); !s.ok()) return s;
        }
        std::vector<Tensor> grads;
        for (const Tensor& p : net.parameters()) grads.push_back(p.grad());
        if (step == kPlantStep) saw_locally[r] = optim::all_finite(grads) ? 0 : 1;
        const Params before = gpt_tiny::Values(net);
        auto stepped = scaler.step(grads, [&] { return (*opt)->step(); });
        if (!stepped.ok()) return stepped.status();
        EXPECT_EQ(*stepped, step != kPlantStep) << "rank " << env.rank << " step " << step;
        if (!*stepped) {
          EXPECT_EQ(gpt_tiny::Values(net), before) << "rank " << env.rank << ": a skipped step moved shards";
        }
        scaler.update();
        scales[r].push_back(scaler.get_scale());
      }
      return test_util::StoreFullValues(net, got, env.rank);
    });
    ASSERT_TRUE(st.ok()) << st;
    const std::vector<double> want_scales = {1024, 1024, 512, 512, 512};
    for (int r = 0; r < world; ++r) EXPECT_EQ(scales[static_cast<std::size_t>(r)], want_scales) << "rank " << r;
    int saw = 0;
    for (int s : saw_locally) saw += s;
    EXPECT_GT(saw, 0) << "no rank holds the planted overflow: the plant missed";
    EXPECT_LT(saw, world) << "every rank saw the overflow itself: the agreement is not exercised";
    gpt_tiny::ExpectMatches(got, want, 1e-6);
  }
}

// ---- a clean run with the scale growing ---------------------------------------------------------------------------

constexpr int kCleanSteps = 4;

// GPT-tiny under `c`, the loss scaled by a ShardedGradScaler (2^16, doubling every 2 clean steps) over the world or
// (HSDP) the shard group; the shards' gradients unscaled and stepped through it. Every rank's full values.
std::vector<Params> TrainScaled(const GptCase& c, bool shard_group, std::vector<std::vector<double>>* scales) {
  std::vector<Params> got(static_cast<std::size_t>(c.world()));
  scales->assign(static_cast<std::size_t>(c.world()), {});
  absl::Status st = comm::RunRanks(c.world(), [&](comm::RankEnv& env) -> absl::Status {
    nn::GPT model(gpt_tiny::TinyConfig(), 1);
    if (absl::Status s = combo6::ShardGptCase(model, env.group_ptr, c); !s.ok()) return s;
    FSDPModule root = *state_of(model);
    auto opt = optim::AdamW::factory()({{model.parameters(), optim::AdamW::default_hyper()}});
    if (!opt.ok()) return opt.status();
    // The root's group is the shard group under HSDP (fully_shard.h: sharded over the mesh's dim-1 group).
    std::shared_ptr<comm::ProcessGroup> group = env.group_ptr;
    if (shard_group) {
      auto m = comm::DeviceMesh::create(env.group_ptr, {c.replicas, c.shards}, {"replicate", "shard"});
      if (!m.ok()) return m.status();
      group = m->group_ptr(1);
    }
    sddp::ShardedGradScaler scaler(group, {.init_scale = 65536.0, .growth_interval = 2});
    const int rows = gpt_tiny::kBatch / c.world();
    const int parts = c.accumulate == Accumulate::none ? 1 : 2;
    for (int step = 0; step < kCleanSteps; ++step) {
      (*opt)->zero_grad();
      for (int part = 0; part < parts; ++part) {
        if (c.accumulate == Accumulate::defer_all_reduce) root.set_requires_all_reduce(part == parts - 1);
        if (c.accumulate == Accumulate::no_sync) root.set_requires_gradient_sync(part == parts - 1);
        auto [x, y] = gpt_tiny::Batch(step, env.rank * rows + part * rows / parts, rows / parts);
        Tensor loss = model.loss(x, y);
        if (parts > 1) loss = autograd::scale(loss, 1.0f / static_cast<float>(parts));
        if (absl::Status s = autograd::try_backward(scaler.scale(loss)); !s.ok()) return s;
      }
      std::vector<Tensor> grads;
      for (const Tensor& p : model.parameters()) grads.push_back(p.grad());
      auto stepped = scaler.step(grads, [&] { return (*opt)->step(); });
      if (!stepped.ok()) return stepped.status();
      EXPECT_TRUE(*stepped) << "rank " << env.rank << " step " << step;
      scaler.update();
      (*scales)[static_cast<std::size_t>(env.rank)].push_back(scaler.get_scale());
    }
    return test_util::StoreFullValues(model, got, env.rank);
  });
  EXPECT_TRUE(st.ok()) << st;
  return got;
}

// Loss scaling by powers of two is exact: every case gives the bits of the same training without the scaler, the
// scale grows alike on every rank, and f32 equals one rank.
TEST(FsdpScalerCombo, ACleanRunGivesTheBitsOfTrainingWithoutTheScaler) {
  static const Params want = gpt_tiny::Reference(kCleanSteps);
  struct Case {
    GptCase gpt;
    bool shard_group;
  };
  const Case cases[] = {
      {{.shards = 2}, false},
      {{.shards = 3, .offload = true, .accumulate = Accumulate::no_sync}, false},
      {{.replicas = 2, .shards = 2}, false},
      {{.replicas = 2, .shards = 2}, true},
      {{.replicas = 2, .shards = 2, .bf16 = true, .offload = true, .accumulate = Accumulate::defer_all_reduce}, true},
      {{.shards = 2, .bf16 = true}, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(absl::StrCat(combo6::Describe(c.gpt), c.shard_group ? ", scaler on the shard group" : ", scaler on the world"));
    std::vector<std::vector<double>> scales;
    const std::vector<Params> got = TrainScaled(c.gpt, c.shard_group, &scales);
    for (const auto& s : scales) EXPECT_EQ(s, (std::vector<double>{65536, 131072, 131072, 262144}));
    gpt_tiny::ExpectMatches(got, combo6::InProcess(c.gpt, kCleanSteps)[0], 0.0);
    if (!c.gpt.bf16) gpt_tiny::ExpectMatches(got, want, 2e-5);
  }
}

}  // namespace
}  // namespace shardkit::fsdp
