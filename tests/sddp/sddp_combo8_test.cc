// Eighth round of feature combinations of DDP, OSS + DDP and OSS + ShardedDDP (greedy, flat reduce-scatter, flat
// reduce to owner): mixed precision (DataParallelOptions::mixed_precision) crossed with the step features the other
// rounds test in f32 only, each against single-rank training that does the same casts at the same points
// (Note [mixed precision on f32 ops] in common/nn/mixed_precision.h), bit for bit where the arithmetic is the same:
//   * f16 parameters and f16 reduction with ShardedGradScaler: one rank's head-b gradient is finite in f32 but
//     overflows once the reducer casts it to f16 for the reduction, so only the ranks that hold (part of) b after the
//     reduction see inf; every rank must skip, back off and later grow the scale alike; with clip_grad_norm (2, inf)
//     after unscale; with no_sync accumulation (the overflow inside the no_sync micro-batch);
//   * bf16 parameters with an explicit f32 reduce_dtype and zero_grad(set_to_none = false), a head used by every,
//     one or no rank in a step (AdamW must step a kept zero gradient as one rank does);
//   * f32 parameters with an f16 reduction, ShardedGradScaler and a head some or no rank uses, overflow on rank 0;
//   * bf16 with no_sync, a head used only in one rank's no_sync micro-batch, SGD Nesterov, clip 2;
//   * zero_grad(set_to_none = false) with no_sync, in f32 (a head used in one rank's no_sync micro-batch only) and in
//     f16 with the scaler;
//   * the same over the TCP and shared-memory backends (TcpProcessGroup, ranks as threads; a ring may round partial
//     sums, process_group.h): every rank bit-identical, the agreed skips and scales the same, near the reference.
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/reduce.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/layers.h"
#include "common/nn/mixed_precision.h"
#include "common/optim/clip_grad.h"
#include "common/optim/sgd.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"
#include "sddp/grad_scaler.h"
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

// A trunk and two heads (two_head::TwoHeadNet, seed 17); head b's loss term is in the loss only while use_b,
// multiplied by b_factor.
struct MpNet : two_head::TwoHeadNet {
  MpNet() : TwoHeadNet(17) {}
};

constexpr int kSteps = 5;
constexpr double kInitScale = 1024.0;
constexpr int kGrowthInterval = 2;
constexpr float kOverflow = 1e5f;  // b's gradient ~1e8 after scaling: finite in f32, inf in f16

enum class Opt { sgd, nesterov, adamw };

struct Variant {
  std::string name;
  nn::MixedPrecisionPolicy mp;
  bool scaler = false;
  double clip = 0;  // 0: none; else the norm type (2 or inf)
  bool keep = false;  // zero_grad(set_to_none = false)
  int micro = 1;      // micro-batches per rank and step, all but the last in no_sync()
  Opt opt = Opt::sgd;
  std::function<bool(int step, int rank, int m, int world)> uses_b;
  std::function<float(int step, int rank, int m, int world)> b_factor;
};

optim::HyperParams Hyper(Opt o) {
  switch (o) {
    case Opt::sgd: return {.lr = 0.05, .momentum = 0.9};
    case Opt::nesterov: return {.lr = 0.05, .momentum = 0.9, .nesterov = true};
    case Opt::adamw: {
      optim::HyperParams h = optim::AdamW::default_hyper();
      h.lr = 1e-2;
      return h;
    }
  }
  return {};
}
optim::OptimizerFactory Factory(Opt o) { return o == Opt::adamw ? optim::AdamW::factory() : optim::Sgd::factory(); }
double MaxNorm(double norm_type) { return std::isinf(norm_type) ? 0.02 : 0.05; }

Tensor Input(int step, int rank, int m) { return HeadInput(step * 4 + m, rank); }

std::vector<float> Round(std::vector<float> v, DType d) {
  if (d == DType::f32) return v;
  const auto n = static_cast<std::int64_t>(v.size());
  return Tensor::from_vector(v, {n}).to(d).to_vector();
}

struct Result {
  std::vector<Params> params;            // per rank (the reference: one entry)
  std::vector<std::vector<double>> scales;  // per rank: scale after each step's update()
  std::vector<std::vector<double>> norms;   // per rank: norm before clipping of each stepped step
  std::vector<std::vector<int>> stepped;    // per rank
};

// One rank doing every rank's work with the wrapper's casts by hand: an f32 master net stepped by the optimizer; each
// step a compute net gets the master's values rounded to param_dtype, runs each rank's micro-batches (inputs rounded
// to param_dtype: cast_forward_inputs) with the loss multiplied by the scale, accumulating each rank's gradient in f32
// in micro-batch order; the reducer scales a rank's sum by 1/world in f32 and rounds it to the reduce dtype; the
// in-process backend sums the ranks' values in f32 in rank order and rounds once; a parameter no rank has a gradient
// for (and, with keep, had none before) keeps none. The scaler skips the step when any gradient is inf/nan,
// multiplies by 1/scale in f32 otherwise; the clip uses the single-rank norm.
Result Reference(const Variant& v, int world) {
  RankContext ctx;
  RankContextScope scope(ctx);
  MpNet master, compute;
  const std::vector<Tensor> mp = master.parameters(), cp = compute.parameters();
  auto opt = Factory(v.opt)({{mp, Hyper(v.opt)}});
  EXPECT_TRUE(opt.ok());
  const DType rd = v.mp.reduce_in();
  const float inv_world = 1.0f / static_cast<float>(world);
  double scale = kInitScale;
  int clean = 0;
  Result res;
  res.params.resize(1);
  res.scales.resize(1);
  res.norms.resize(1);
  res.stepped.resize(1);
  for (int step = 0; step < kSteps; ++step) {
    (*opt)->zero_grad(!v.keep);
    for (std::size_t i = 0; i < mp.size(); ++i) {
      cp[i].copy_(v.mp.param_dtype ? mp[i].to(*v.mp.param_dtype).to(DType::f32) : mp[i]);
    }
    // acc[r][i]: rank r's accumulated gradient of parameter i (empty: none).
    std::vector<std::vector<std::vector<float>>> acc(static_cast<std::size_t>(world),
                                                     std::vector<std::vector<float>>(mp.size()));
    for (int r = 0; r < world; ++r) {
      for (int m = 0; m < v.micro; ++m) {
        for (const Tensor& p : cp) p.set_grad(Tensor());
        compute.use_b = v.uses_b(step, r, m, world);
        compute.b_factor = v.b_factor(step, r, m, world);
        Tensor x = Input(step, r, m);
        if (v.mp.param_dtype) x = x.to(*v.mp.param_dtype).to(DType::f32);
        Tensor loss = compute(x);
        if (v.scaler) loss = autograd::scale(loss, static_cast<float>(scale));
        autograd::backward(loss);
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
      bool used = v.keep && mp[i].grad().defined();
      for (int r = 0; r < world; ++r) used = used || !acc[static_cast<std::size_t>(r)][i].empty();
      if (!used) continue;
      const auto n = static_cast<std::size_t>(mp[i].numel());
      std::vector<float> sum;
      for (int r = 0; r < world; ++r) {
        std::vector<float> c = acc[static_cast<std::size_t>(r)][i];
        if (c.empty()) c.assign(n, 0.0f);
        for (float& e : c) e *= inv_world;
        c = Round(c, rd);
        if (r == 0) {
          sum = c;
        } else {
          for (std::size_t k = 0; k < n; ++k) sum[k] += c[k];
        }
      }
      mp[i].set_grad(Tensor::from_vector(Round(sum, rd), mp[i].shape()));
    }
    bool found = false;
    if (v.scaler) {
      for (const Tensor& p : mp) {
        if (!p.grad().defined()) continue;
        for (float e : p.grad().to_vector()) found = found || !std::isfinite(e);
      }
    }
    res.stepped[0].push_back(found ? 0 : 1);
    if (!found) {
      if (v.scaler) {
        const float inv = static_cast<float>(1.0 / scale);
        for (const Tensor& p : mp) {
          if (!p.grad().defined()) continue;
          std::vector<float> g = p.grad().to_vector();
          for (float& e : g) e *= inv;
          p.set_grad(Tensor::from_vector(g, p.shape()));
        }
      }
      if (v.clip != 0) res.norms[0].push_back(optim::clip_grad_norm(mp, MaxNorm(v.clip), v.clip));
      EXPECT_TRUE((*opt)->step().ok());
    }
    if (v.scaler) {
      if (found) {
        scale *= 0.5;
        clean = 0;
      } else if (++clean >= kGrowthInterval) {
        scale *= 2.0;
        clean = 0;
      }
    }
    res.scales[0].push_back(v.scaler ? scale : 0.0);
  }
  res.params[0] = Values(master);
  return res;
}

// One rank's training in `mode` over `pg`; fills rank `rank` of *res.
absl::Status TrainRank(const Variant& v, Mode mode, const std::shared_ptr<comm::ProcessGroup>& pg, Result* res) {
  const int rank = pg->rank(), world = pg->size();
  const auto ri = static_cast<std::size_t>(rank);
  MpNet net;
  auto t = Trainer::make(mode, net, {{net.parameters(), Hyper(v.opt)}}, Factory(v.opt), pg,
                         {.reduce_buffer_size = 16, .mixed_precision = v.mp});
  if (!t.ok()) return t.status();
  ShardedGradScaler scaler(pg, {.init_scale = kInitScale, .growth_interval = kGrowthInterval});
  for (int step = 0; step < kSteps; ++step) {
    t->zero_grad(!v.keep);
    for (int m = 0; m < v.micro; ++m) {
      net.use_b = v.uses_b(step, rank, m, world);
      net.b_factor = v.b_factor(step, rank, m, world);
      Tensor loss = net(Input(step, rank, m));
      if (v.scaler) loss = scaler.scale(loss);
      absl::Status s;
      if (m < v.micro - 1) {
        auto scope = t->dp->no_sync();
        s = autograd::try_backward(loss);
      } else {
        s = autograd::try_backward(loss);
      }
      if (!s.ok()) return s;
    }
    bool found = false;
    if (v.scaler) {
      auto f = scaler.unscale(t->dp->held_gradients());
      if (!f.ok()) return f.status();
      found = *f;
    }
    res->stepped[ri].push_back(found ? 0 : 1);
    if (!found) {
      if (v.clip != 0) {
        absl::StatusOr<double> norm = t->plain ? optim::clip_grad_norm(t->params, MaxNorm(v.clip), v.clip)
                                               : t->oss->clip_grad_norm(MaxNorm(v.clip), v.clip);
        if (!norm.ok()) return norm.status();
        res->norms[ri].push_back(*norm);
      }
      if (absl::Status s = t->step(); !s.ok()) return s;
    }
    if (v.scaler) scaler.update();
    res->scales[ri].push_back(v.scaler ? scaler.get_scale() : 0.0);
  }
  res->params[ri] = Values(net);
  return absl::OkStatus();
}

Result Sized(int world) {
  Result r;
  r.params.resize(static_cast<std::size_t>(world));
  r.scales.resize(static_cast<std::size_t>(world));
  r.norms.resize(static_cast<std::size_t>(world));
  r.stepped.resize(static_cast<std::size_t>(world));
  return r;
}

// Every rank's scales, skips and norms equal the reference's; the parameters within tol (bitwise when 0).
void ExpectLikeReference(const Result& got, const Result& want, double tol, double norm_tol) {
  for (std::size_t r = 0; r < got.params.size(); ++r) {
    EXPECT_EQ(got.stepped[r], want.stepped[0]) << "rank " << r << ": steps taken / skipped";
    EXPECT_EQ(got.scales[r], want.scales[0]) << "rank " << r << ": scales";
    ASSERT_EQ(got.norms[r].size(), want.norms[0].size()) << "rank " << r;
    for (std::size_t k = 0; k < got.norms[r].size(); ++k) {
      EXPECT_NEAR(got.norms[r][k], want.norms[0][k], norm_tol * want.norms[0][k]) << "rank " << r << " norm " << k;
    }
  }
  test_util::ExpectMatches(got.params, want.params[0], tol);
}

const nn::MixedPrecisionPolicy kF16{.param_dtype = DType::f16, .reduce_dtype = DType::f16};
const nn::MixedPrecisionPolicy kBf16{.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};

bool Always(int, int, int, int) { return true; }
float One(int, int, int, int) { return 1.0f; }
// kOverflow on the last rank in step 2 (micro-batch 0).
float LastRankOverflowsAt2(int step, int rank, int m, int world) {
  return step == 2 && rank == world - 1 && m == 0 ? kOverflow : 1.0f;
}

std::vector<Variant> Variants() {
  std::vector<Variant> out;
  out.push_back({.name = "f16_scaler", .mp = kF16, .scaler = true, .uses_b = Always,
                 .b_factor = LastRankOverflowsAt2});
  out.push_back({.name = "f16_scaler_clip2", .mp = kF16, .scaler = true, .clip = 2.0, .uses_b = Always,
                 .b_factor = LastRankOverflowsAt2});
  // No_sync: rank 0 uses b in its no_sync micro-batch only; the overflow is in the last rank's no_sync micro-batch.
  out.push_back({.name = "f16_scaler_clipinf_nosync",
                 .mp = kF16,
                 .scaler = true,
                 .clip = std::numeric_limits<double>::infinity(),
                 .micro = 2,
                 .uses_b = [](int, int rank, int m, int) { return rank != 0 || m == 0; },
                 .b_factor = LastRankOverflowsAt2});
  // b: every rank in step 0, rank 0 only in 1, no rank in 2, the last rank only in 3, none in 4; gradients kept.
  out.push_back({.name = "bf16_f32reduce_keep_adamw",
                 .mp = {.param_dtype = DType::bf16, .reduce_dtype = DType::f32},
                 .keep = true,
                 .opt = Opt::adamw,
                 .uses_b =
                     [](int step, int rank, int, int world) {
                       return step == 0 || (step == 1 && rank == 0) || (step == 3 && rank == world - 1);
                     },
                 .b_factor = One});
  // f32 parameters, f16 reduction; b: no rank in 0 and 3, rank 0 only in 1 and 2 (overflowing in 2), all in 4.
  out.push_back({.name = "f16reduce_scaler_unused_adamw",
                 .mp = {.reduce_dtype = DType::f16},
                 .scaler = true,
                 .opt = Opt::adamw,
                 .uses_b = [](int step, int rank, int, int) { return step == 4 || ((step == 1 || step == 2) && rank == 0); },
                 .b_factor = [](int step, int rank, int, int) { return step == 2 && rank == 0 ? kOverflow : 1.0f; }});
  // b only in rank 1's no_sync micro-batch in step 1, in no rank's in step 3, everywhere otherwise.
  out.push_back({.name = "bf16_nosync_nesterov_clip2",
                 .mp = kBf16,
                 .clip = 2.0,
                 .micro = 2,
                 .opt = Opt::nesterov,
                 .uses_b =
                     [](int step, int rank, int m, int) {
                       if (step == 1) return rank == 1 && m == 0;
                       return step != 3;
                     },
                 .b_factor = One});
  // f32 throughout (bit for bit too): kept zero gradients with no_sync, b in rank 0's no_sync micro-batch only in
  // step 1, in no rank's in step 2, everywhere otherwise.
  out.push_back({.name = "f32_keep_nosync_adamw",
                 .mp = {},
                 .keep = true,
                 .micro = 2,
                 .opt = Opt::adamw,
                 .uses_b =
                     [](int step, int rank, int m, int) {
                       if (step == 1) return rank == 0 && m == 0;
                       return step != 2;
                     },
                 .b_factor = One});
  // f16 with kept zero gradients, no_sync and the scaler: the skipped step's gradients are zeroed, not dropped; b is
  // in no rank's loss in step 3 (its kept zero gradient still steps it: momentum).
  out.push_back({.name = "f16_keep_scaler_nosync", .mp = kF16, .scaler = true, .keep = true, .micro = 2,
                 .uses_b = [](int step, int, int, int) { return step != 3; }, .b_factor = LastRankOverflowsAt2});
  return out;
}

const Variant& VariantNamed(const std::string& name) {
  static const std::vector<Variant> all = Variants();
  for (const Variant& v : all) {
    if (v.name == name) return v;
  }
  ADD_FAILURE() << "no variant " << name;
  return all[0];
}

std::vector<std::string> VariantNames() {
  std::vector<std::string> out;
  for (const Variant& v : Variants()) out.push_back(v.name);
  return out;
}

// The reference itself: the overflow variants skip step 2 and grow the scale back; clipping acts; b moves.
TEST(MixedPrecisionComboReference, TheVariantsExerciseWhatTheyClaim) {
  for (const std::string& name : VariantNames()) {
    SCOPED_TRACE(name);
    const Variant& v = VariantNamed(name);
    const Result r = Reference(v, 3);
    if (v.scaler) {
      EXPECT_EQ(r.stepped[0], (std::vector<int>{1, 1, 0, 1, 1}));
      EXPECT_EQ(r.scales[0], (std::vector<double>{1024, 2048, 1024, 1024, 2048}));
    }
    if (v.clip != 0) {
      ASSERT_FALSE(r.norms[0].empty());
      int acted = 0;
      for (double n : r.norms[0]) acted += n > 1.5 * MaxNorm(v.clip) ? 1 : 0;
      EXPECT_GE(acted, 2) << "clipping must act";
    }
  }
  // The casts matter: f16 training ends elsewhere than f32 training of the same steps.
  Variant f32 = VariantNamed("f16_scaler");
  f32.mp = {};
  EXPECT_NE(Reference(VariantNamed("f16_scaler"), 2).params[0], Reference(f32, 2).params[0]);
}

class MixedPrecisionCombo : public ::testing::TestWithParam<std::tuple<std::string, int, Mode>> {};

TEST_P(MixedPrecisionCombo, EqualsSingleRankTrainingWithTheSameCasts) {
  const auto& [name, world, mode] = GetParam();
  const Variant& v = VariantNamed(name);
  const Result want = Reference(v, world);
  Result got = Sized(world);
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    return TrainRank(v, mode, env.group_ptr, &got);
  });
  ASSERT_TRUE(st.ok()) << st;
  // Bitwise, but for the 2-norm clip under Oss: the norm is summed over the ranks' partials in another order, so the
  // clip coefficient may differ in its last bit (seen: one ulp of one element).
  const double tol = v.clip == 2.0 && mode != Mode::ddp ? 1e-6 : 0.0;
  ExpectLikeReference(got, want, tol, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(Variants, MixedPrecisionCombo,
                         ::testing::Combine(::testing::ValuesIn(VariantNames()), ::testing::Values(2, 3),
                                            ::testing::ValuesIn(kModes)),
                         [](const auto& info) {
                           return std::get<0>(info.param) + "_" + ModeName(std::get<2>(info.param)) + "_n" +
                                  std::to_string(std::get<1>(info.param));
                         });

class MixedPrecisionProcessBackendCombo
    : public ::testing::TestWithParam<std::tuple<std::string, std::string, Mode>> {};

// Over TCP / shared memory a ring may round bf16 / f16 partial sums (process_group.h): every rank must still end
// bit-identical to the others, skip the same steps with the same scales, and stay near the in-process reference.
TEST_P(MixedPrecisionProcessBackendCombo, RanksAgreeAndStayNearTheReference) {
  const auto& [transport, name, mode] = GetParam();
  const Variant& v = VariantNamed(name);
  constexpr int kWorld = 3;
  const Result want = Reference(v, kWorld);
  Result got = Sized(kWorld);
  static int run = 0;
  absl::Status st = RunTcpRanks(kWorld, transport, absl::StrCat("combo8_", run++),
                                [&](std::shared_ptr<comm::ProcessGroup> pg) { return TrainRank(v, mode, pg, &got); });
  ASSERT_TRUE(st.ok()) << st;
  // f32 reduction: only the summation order differs; f16: a ring's partial sums are rounded to f16 too.
  const bool f32 = v.mp.reduce_in() == DType::f32;
  ExpectLikeReference(got, want, f32 ? 1e-6 : 2e-3, f32 ? 1e-6 : 1e-3);
}

INSTANTIATE_TEST_SUITE_P(
    Transports, MixedPrecisionProcessBackendCombo,
    ::testing::Combine(::testing::Values(std::string("tcp"), std::string("shm")),
                       ::testing::Values(std::string("f16_scaler_clip2"), std::string("bf16_f32reduce_keep_adamw")),
                       ::testing::Values(Mode::ddp, Mode::sddp_greedy, Mode::sddp_flat, Mode::sddp_flat_owner)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + std::get<1>(info.param) + "_" + ModeName(std::get<2>(info.param));
    });

}  // namespace
}  // namespace shardkit::sddp
