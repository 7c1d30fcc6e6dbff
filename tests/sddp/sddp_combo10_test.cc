// Tenth round of feature combinations of DDP, OSS + DDP and OSS + ShardedDDP (greedy, flat reduce-scatter, flat
// reduce to owner), each against single-rank training (DESIGN.md section 8): parameters used more than once.
//   * a layer applied twice in one forward, and a second module registered over the same tensors (tied weights,
//     the shared parameter listed once): one gradient per backward from three uses;
//   * the model called twice per step (two forwards, one backward of the summed losses) in some steps: each call's
//     mixed-precision rounded copies feed the same master gradient;
//   * a head used by some ranks only, in one of the two calls;
//   * bucket options: reduce_buffer_size 0 (no buckets / one chunk per group), 16 elements with
//     max_buckets_in_flight 1, and one large bucket;
//   * f32 (within float rounding of the one-rank mean) and bf16 mixed precision (bit for bit against one rank doing
//     the same casts), and the f32 case over the TCP and shared-memory backends.
#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/reduce.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/layers.h"
#include "common/nn/mixed_precision.h"
#include "common/optim/adam.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"
#include "tests/sddp/sddp_test_util.h"
#include "tests/sddp/sddp_trainer.h"
#include "tests/testing/tcp_ranks.h"
#include "tests/testing/two_head_net.h"

namespace shardkit::sddp {
namespace {

using tcp_ranks::RunTcpRanks;
using test_util::kModes;
using test_util::Mode;
using test_util::ModeName;
using test_util::Trainer;
using test_util::Values;
using two_head::HeadInput;

using Params = std::vector<std::vector<float>>;

// emb -> mid -> mid again -> tied (a Linear over mid's very tensors) -> head; `extra` on the last hidden state only
// while use_extra.
class TiedNet : public nn::Module {
 public:
  TiedNet() : Module("TiedNet") {
    Generator gen(23, 0);
    emb = register_module("emb", std::make_shared<nn::Linear>(4, 6, gen));
    mid = register_module("mid", std::make_shared<nn::Linear>(6, 6, gen));
    tied = register_module("tied", std::make_shared<nn::Linear>(mid->weight(), mid->parameter("bias")));
    head = register_module("head", std::make_shared<nn::Linear>(6, 3, gen));
    extra = register_module("extra", std::make_shared<nn::Linear>(6, 2, gen));
  }
  bool use_extra = false;
  std::shared_ptr<nn::Linear> emb, mid, tied, head, extra;

 protected:
  Tensor forward(const Tensor& x) override {
    Tensor h = autograd::relu((*emb)(x));
    h = autograd::relu((*mid)(h));
    h = autograd::relu((*mid)(h));
    h = autograd::relu((*tied)(h));
    const Tensor y = (*head)(h);
    Tensor loss = autograd::mean(autograd::mul(y, y));
    if (use_extra) {
      const Tensor e = (*extra)(h);
      loss = autograd::add(loss, autograd::mean(autograd::mul(e, e)));
    }
    return loss;
  }
};

constexpr int kSteps = 5;
int Calls(int step) { return step % 2 == 0 ? 2 : 1; }
// extra: in call 0 only; rank 0 only in step 1, every rank in step 2, the last rank only in step 4, none otherwise.
bool UsesExtra(int step, int rank, int call, int world) {
  if (call != 0) return false;
  if (step == 1) return rank == 0;
  if (step == 2) return true;
  if (step == 4) return rank == world - 1;
  return false;
}
Tensor Input(int step, int rank, int call) { return HeadInput(step * 2 + call, rank); }

optim::HyperParams Hyper() {
  optim::HyperParams h = optim::AdamW::default_hyper();
  h.lr = 1e-2;
  return h;
}

// f32: one rank on every rank's calls, the mean over ranks of each rank's summed call losses.
Params F32Reference(int world) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TiedNet net;
  auto opt = optim::AdamW::factory()({{net.parameters(), Hyper()}});
  EXPECT_TRUE(opt.ok());
  for (int step = 0; step < kSteps; ++step) {
    (*opt)->zero_grad();
    Tensor loss;
    for (int r = 0; r < world; ++r) {
      for (int c = 0; c < Calls(step); ++c) {
        net.use_extra = UsesExtra(step, r, c, world);
        const Tensor l = net(Input(step, r, c));
        loss = loss.defined() ? autograd::add(loss, l) : l;
      }
    }
    autograd::backward(autograd::scale(loss, 1.0f / static_cast<float>(world)));
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(net);
}

std::vector<float> RoundBf16(const std::vector<float>& v) {
  return Tensor::from_vector(v, {static_cast<std::int64_t>(v.size())}).to(DType::bf16).to_vector();
}

// bf16 with the wrapper's casts by hand: each call runs on the master rounded to bf16 (and its input rounded); a
// rank's gradient is the sum of its calls' gradients (each call's rounded copies sum their uses, then the master
// adds the calls'); the reducer scales it by 1/world and rounds to bf16; the backend sums in rank order in f32 and
// rounds once. A parameter no rank used keeps no gradient.
Params Bf16Reference(int world) {
  RankContext ctx;
  RankContextScope scope(ctx);
  TiedNet master, compute;
  const std::vector<Tensor> mp = master.parameters(), cp = compute.parameters();
  auto opt = optim::AdamW::factory()({{mp, Hyper()}});
  EXPECT_TRUE(opt.ok());
  const float inv_world = 1.0f / static_cast<float>(world);
  for (int step = 0; step < kSteps; ++step) {
    (*opt)->zero_grad();
    for (std::size_t i = 0; i < mp.size(); ++i) cp[i].copy_(mp[i].to(DType::bf16).to(DType::f32));
    std::vector<std::vector<std::vector<float>>> acc(static_cast<std::size_t>(world),
                                                     std::vector<std::vector<float>>(mp.size()));
    for (int r = 0; r < world; ++r) {
      for (int c = 0; c < Calls(step); ++c) {
        for (const Tensor& p : cp) p.set_grad(Tensor());
        compute.use_extra = UsesExtra(step, r, c, world);
        autograd::backward(compute(Input(step, r, c).to(DType::bf16).to(DType::f32)));
        for (std::size_t i = 0; i < cp.size(); ++i) {
          if (!cp[i].grad().defined()) continue;
          const std::vector<float> g = cp[i].grad().to_vector();
          auto& a = acc[static_cast<std::size_t>(r)][i];
          if (a.empty()) {
            a = g;
          } else {
            for (std::size_t k = 0; k < g.size(); ++k) a[k] += g[k];
          }
        }
      }
    }
    for (std::size_t i = 0; i < mp.size(); ++i) {
      bool used = false;
      for (int r = 0; r < world; ++r) used = used || !acc[static_cast<std::size_t>(r)][i].empty();
      if (!used) continue;
      std::vector<float> sum;
      for (int r = 0; r < world; ++r) {
        std::vector<float> v = acc[static_cast<std::size_t>(r)][i];
        if (v.empty()) v.assign(static_cast<std::size_t>(mp[i].numel()), 0.0f);
        for (float& e : v) e *= inv_world;
        v = RoundBf16(v);
        if (r == 0) {
          sum = v;
        } else {
          for (std::size_t k = 0; k < v.size(); ++k) sum[k] += v[k];
        }
      }
      mp[i].set_grad(Tensor::from_vector(RoundBf16(sum), mp[i].shape()));
    }
    EXPECT_TRUE((*opt)->step().ok());
  }
  return Values(master);
}

absl::Status TrainRank(Mode mode, bool bf16, std::int64_t bucket, const std::shared_ptr<comm::ProcessGroup>& pg,
                       std::vector<Params>* got) {
  const int rank = pg->rank(), world = pg->size();
  TiedNet net;
  DataParallelOptions options{.reduce_buffer_size = bucket, .max_buckets_in_flight = bucket == 16 ? 1 : 4};
  if (bf16) options.mixed_precision = {.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};
  auto t = Trainer::make(mode, net, {{net.parameters(), Hyper()}}, optim::AdamW::factory(), pg, options);
  if (!t.ok()) return t.status();
  if (net.parameters().size() != 8) return absl::InternalError("the tied tensors must be listed once");
  for (int step = 0; step < kSteps; ++step) {
    t->zero_grad();
    Tensor loss;
    for (int c = 0; c < Calls(step); ++c) {
      net.use_extra = UsesExtra(step, rank, c, world);
      const Tensor l = net(Input(step, rank, c));
      loss = loss.defined() ? autograd::add(loss, l) : l;
    }
    if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
    if (absl::Status s = t->step(); !s.ok()) return s;
  }
  (*got)[static_cast<std::size_t>(rank)] = Values(net);
  return absl::OkStatus();
}

TEST(TiedComboReference, TheReferencesDiffer) {
  EXPECT_NE(F32Reference(2), Bf16Reference(2));
}

class TiedCombo : public ::testing::TestWithParam<std::tuple<bool, std::int64_t, int, Mode>> {};

TEST_P(TiedCombo, SharedAndTwiceCalledParametersTrainAsOnOneRank) {
  const auto [bf16, bucket, world, mode] = GetParam();
  const Params want = bf16 ? Bf16Reference(world) : F32Reference(world);
  std::vector<Params> got(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    return TrainRank(mode, bf16, bucket, env.group_ptr, &got);
  });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, bf16 ? 0.0 : 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Buckets, TiedCombo,
                         ::testing::Combine(::testing::Bool(), ::testing::Values<std::int64_t>(0, 16, 1 << 20),
                                            ::testing::Values(2, 3), ::testing::ValuesIn(kModes)),
                         [](const auto& info) {
                           return absl::StrCat(std::get<0>(info.param) ? "bf16_" : "f32_", "bucket",
                                               std::get<1>(info.param), "_", ModeName(std::get<3>(info.param)), "_n",
                                               std::get<2>(info.param));
                         });

class TiedProcessBackendCombo : public ::testing::TestWithParam<std::tuple<std::string, Mode>> {};

TEST_P(TiedProcessBackendCombo, SharedAndTwiceCalledParametersTrainAsOnOneRank) {
  const auto& [transport, mode] = GetParam();
  constexpr int kWorld = 3;
  const Params want = F32Reference(kWorld);
  std::vector<Params> got(kWorld);
  static int run = 0;
  absl::Status st = RunTcpRanks(kWorld, transport, absl::StrCat("combo10_", run++),
                                [&](std::shared_ptr<comm::ProcessGroup> pg) {
                                  return TrainRank(mode, /*bf16=*/false, 16, pg, &got);
                                });
  ASSERT_TRUE(st.ok()) << st;
  test_util::ExpectMatches(got, want, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Transports, TiedProcessBackendCombo,
                         ::testing::Combine(::testing::Values(std::string("tcp"), std::string("shm")),
                                            ::testing::ValuesIn(kModes)),
                         [](const auto& info) { return std::get<0>(info.param) + "_" + ModeName(std::get<1>(info.param)); });

}  // namespace
}  // namespace shardkit::sddp
