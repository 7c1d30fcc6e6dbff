// 10-step trajectories of SGD, Adam and AdamW against the double-precision reference (reference.h).
//
// Tolerances. Each fused step evaluates a handful of fp32 operations per element, each rounding with
// relative error <= 2^-24 (6e-8); weights stay below ~2 in magnitude, so one step adds at most ~1e-6
// absolute error and ten steps ~1e-5 at the very worst (in practice ~1e-6, far below). The gradients fed
// to both sides are the same values (computed from the optimizer's own parameters), so errors are not
// amplified by the objective. Hence: |w - w_ref| <= 2e-5. State tensors are running sums of O(1) terms
// (|g| <= ~5) that may cancel to small values, so their error bound is absolute, not relative: ten steps of
// a few roundings of terms up to ~5 (ulp 4.8e-7) stay below 2e-6; we allow 2e-6 + 2e-5 * |ref|. With bf16/f16 parameters the fp32 master obeys the same bound, and the parameter must be
// exactly the master rounded to nearest even.
#include <cmath>
#include <string>
#include <vector>

#include "common/optim/adam.h"
#include "common/optim/fused_kernels.h"
#include "common/optim/sgd.h"
#include "gtest/gtest.h"
#include "test_util.h"

namespace shardkit::optim::testing {
namespace {

struct Case {
  std::string name;
  Algo algo;
  RefHyper h;
  DType param_dtype = DType::f32;
  DType grad_dtype = DType::f32;
};

std::string PrintCase(const ::testing::TestParamInfo<Case>& info) { return info.param.name; }

class TrajectoryTest : public ::testing::TestWithParam<Case> {};

TEST_P(TrajectoryTest, TenStepsMatchDoubleReference) {
  const Case& c = GetParam();
  Generator gen(1234);
  const std::vector<Shape> shapes = {{33}, {40, 27}, {1}, {5}};  // the last one never gets a gradient
  std::vector<Tensor> params;
  std::vector<std::vector<float>> targets;
  std::vector<RefState> refs;
  for (const Shape& s : shapes) {
    params.push_back(Tensor::uniform(s, gen, -1.f, 1.f, TensorOptions{}.with_dtype(c.param_dtype)));
    std::vector<float> target(static_cast<std::size_t>(shape_numel(s)));
    gen.fill_uniform(target.data(), static_cast<std::int64_t>(target.size()), -0.5f, 0.5f);
    targets.push_back(target);
    refs.push_back(ref_init(params.back().to_vector()));
  }
  const Tensor frozen_before = params[3].clone();
  RefHyper h = c.h;
  std::unique_ptr<Optimizer> opt = MakeOptimizer(c.algo, {ParamGroup{params, ToHyper(h)}});

  for (int t = 0; t < 10; ++t) {
    if (t == 5) {  // a mid-run hyper-parameter change, as a schedule makes
      h.lr *= 0.5;
      opt->mutable_hyper(0).lr = h.lr;
    }
    for (int k = 0; k < 3; ++k) {
      Tensor g = MakeGrad(params[k], targets[k], t, k, c.grad_dtype);
      params[k].set_grad(g);
      const std::vector<float> gv = g.to_vector();
      if (c.algo == Algo::kSgd) ref_sgd(h, refs[k], gv);
      else ref_adam(h, refs[k], gv, c.algo == Algo::kAdamW);
    }
    ASSERT_TRUE(opt->step().ok());
  }

  for (int k = 0; k < 3; ++k) {
    SCOPED_TRACE("parameter " + std::to_string(k));
    const ParamState* st = opt->state(k);
    ASSERT_NE(st, nullptr);
    EXPECT_EQ(st->step, 10);
    const bool master = needs_master(c.param_dtype);
    const Tensor weights = master ? st->tensors.at(kMaster) : params[k];
    ASSERT_EQ(weights.dtype(), DType::f32);
    const std::vector<float> w = weights.to_vector();
    for (std::size_t i = 0; i < w.size(); ++i) {
      ASSERT_NEAR(w[i], refs[k].w[i], 2e-5) << "element " << i;
    }
    if (master) {  // the parameter is exactly the master rounded to nearest even
      const Tensor rounded = weights.to(c.param_dtype);
      EXPECT_TRUE(SameBits(rounded, params[k]));
    }
    auto expect_state = [&](const char* key, const std::vector<double>& ref) {
      SCOPED_TRACE(key);
      const std::vector<float> s = st->tensors.at(key).to_vector();
      for (std::size_t i = 0; i < s.size(); ++i) {
        ASSERT_NEAR(s[i], ref[i], 2e-6 + 2e-5 * std::fabs(ref[i])) << "element " << i;
      }
    };
    if (c.algo == Algo::kSgd) {
      EXPECT_EQ(st->tensors.contains(kMomentumBuffer), h.momentum != 0);
      if (h.momentum != 0) expect_state(kMomentumBuffer, refs[k].b);
    } else {
      expect_state(kExpAvg, refs[k].m);
      expect_state(kExpAvgSq, refs[k].v);
    }
    EXPECT_EQ(st->tensors.size(), (master ? 1u : 0u) + (c.algo == Algo::kSgd ? (h.momentum != 0 ? 1u : 0u) : 2u));
  }
  // A parameter without a gradient is skipped: unchanged, no state.
  EXPECT_EQ(opt->state(3), nullptr);
  EXPECT_TRUE(SameBits(params[3], frozen_before));
}

std::vector<Case> SgdCases() {
  std::vector<Case> cases;
  struct M {
    const char* name;
    double momentum, dampening;
    bool nesterov;
  };
  const M ms[] = {{"plain", 0, 0, false}, {"mom", 0.9, 0, false}, {"momdamp", 0.9, 0.3, false}, {"nesterov", 0.9, 0, true}};
  for (const M& m : ms) {
    for (double wd : {0.0, 0.05}) {
      for (bool maximize : {false, true}) {
        Case c;
        c.algo = Algo::kSgd;
        c.h.lr = 0.05;
        c.h.momentum = m.momentum;
        c.h.dampening = m.dampening;
        c.h.nesterov = m.nesterov;
        c.h.weight_decay = wd;
        c.h.maximize = maximize;
        c.name = std::string("Sgd_") + m.name + (wd != 0 ? "_wd" : "") + (maximize ? "_max" : "");
        cases.push_back(c);
      }
    }
  }
  return cases;
}

std::vector<Case> AdamCases() {
  std::vector<Case> cases;
  for (Algo algo : {Algo::kAdam, Algo::kAdamW}) {
    for (double wd : {0.0, 0.1}) {
      for (bool maximize : {false, true}) {
        Case c;
        c.algo = algo;
        c.h.lr = 0.01;
        c.h.beta1 = 0.8;
        c.h.beta2 = 0.95;
        c.h.eps = 1e-6;
        c.h.weight_decay = wd;
        c.h.maximize = maximize;
        c.name = std::string(algo == Algo::kAdam ? "Adam" : "AdamW") + (wd != 0 ? "_wd" : "") + (maximize ? "_max" : "");
        cases.push_back(c);
      }
    }
  }
  return cases;
}

// Low-precision parameters (fp32 master) and mixed gradient dtypes.
std::vector<Case> MixedCases() {
  std::vector<Case> cases;
  struct D {
    const char* name;
    DType p, g;
  };
  const D ds[] = {{"p_bf16_g_bf16", DType::bf16, DType::bf16}, {"p_bf16_g_f32", DType::bf16, DType::f32},
                  {"p_f16_g_f16", DType::f16, DType::f16},     {"p_f16_g_bf16", DType::f16, DType::bf16},
                  {"p_f32_g_bf16", DType::f32, DType::bf16},   {"p_f32_g_f16", DType::f32, DType::f16}};
  for (const D& d : ds) {
    for (Algo algo : {Algo::kSgd, Algo::kAdam, Algo::kAdamW}) {
      Case c;
      c.algo = algo;
      c.param_dtype = d.p;
      c.grad_dtype = d.g;
      if (algo == Algo::kSgd) {
        c.h.lr = 0.05;
        c.h.momentum = 0.9;
        c.h.nesterov = true;
        c.h.weight_decay = 0.05;
      } else {
        c.h.lr = 0.01;
        c.h.weight_decay = 0.1;
      }
      c.name = std::string(algo == Algo::kSgd ? "Sgd_" : algo == Algo::kAdam ? "Adam_" : "AdamW_") + d.name;
      cases.push_back(c);
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(Sgd, TrajectoryTest, ::testing::ValuesIn(SgdCases()), PrintCase);
INSTANTIATE_TEST_SUITE_P(Adam, TrajectoryTest, ::testing::ValuesIn(AdamCases()), PrintCase);
INSTANTIATE_TEST_SUITE_P(Mixed, TrajectoryTest, ::testing::ValuesIn(MixedCases()), PrintCase);

// SGD: momentum switched on mid-run creates the buffer then (b = g at that step), as PyTorch.
TEST(SgdTest, MomentumSwitchedOnMidRun) {
  Generator gen(7);
  Tensor p = Tensor::uniform({17}, gen, -1.f, 1.f);
  std::vector<float> target(17, 0.25f);
  RefHyper h;
  h.lr = 0.1;
  Sgd opt({p}, ToHyper(h));
  RefState ref = ref_init(p.to_vector());
  for (int t = 0; t < 6; ++t) {
    if (t == 3) {
      h.momentum = 0.5;
      opt.mutable_hyper(0).momentum = 0.5;
    }
    Tensor g = MakeGrad(p, target, t, 0, DType::f32);
    p.set_grad(g);
    ref_sgd(h, ref, g.to_vector());
    ASSERT_TRUE(opt.step().ok());
  }
  const std::vector<float> w = p.to_vector();
  for (std::size_t i = 0; i < w.size(); ++i) EXPECT_NEAR(w[i], ref.w[i], 1e-6);
  const std::vector<float> b = opt.state(0)->tensors.at(kMomentumBuffer).to_vector();
  for (std::size_t i = 0; i < b.size(); ++i) EXPECT_NEAR(b[i], ref.b[i], 1e-6);
}

// One fused AdamW step at the kernel sizes the kernel tests use (vector body, tails, empty).
TEST(FusedKernelTest, AdamWOneStepAtManySizes) {
  for (std::int64_t n : {0, 1, 7, 1023, (1 << 20) + 3}) {
    SCOPED_TRACE("n = " + std::to_string(n));
    Generator gen(static_cast<std::uint64_t>(n));
    Tensor p = Tensor::uniform({n}, gen, -1.f, 1.f);
    Tensor g = Tensor::normal({n}, gen, 0.f, 1.f);
    RefHyper h;
    h.lr = 0.01;
    h.weight_decay = 0.1;
    RefState ref = ref_init(p.to_vector());
    for (int t = 0; t < 2; ++t) ref_adam(h, ref, g.to_vector(), true);
    AdamW opt({p}, ToHyper(h));
    p.set_grad(g);
    ASSERT_TRUE(opt.step().ok());
    ASSERT_TRUE(opt.step().ok());
    const std::vector<float> w = p.to_vector();
    for (std::int64_t i = 0; i < n; ++i) ASSERT_NEAR(w[static_cast<std::size_t>(i)], ref.w[static_cast<std::size_t>(i)], 1e-6);
  }
}

TEST(FusedKernelTest, BranchFreeRoundingMatchesDtypeConversions) {
  // Every 2^32 / 2^22 pattern, plus the neighbourhood of rounding ties and the special values.
  std::vector<std::uint32_t> bits;
  for (std::uint64_t x = 0; x < (1ull << 32); x += 1021) bits.push_back(static_cast<std::uint32_t>(x));
  for (std::uint32_t hi : {0x3f80u, 0x3f81u, 0x7f7fu, 0x0000u, 0x8000u, 0xbf80u}) {
    for (std::uint32_t lo : {0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x0000u, 0x0001u}) bits.push_back(hi << 16 | lo);
  }
  // f16 boundaries: smallest normal, subnormal ties, overflow threshold 65520.
  for (std::uint32_t c : {0x38800000u, 0x387fffffu, 0x33000000u, 0x33000001u, 0x477ff000u, 0x477fefffu, 0x477fe000u}) {
    for (std::uint32_t d = 0; d < 8; ++d) bits.push_back(c + d - 4), bits.push_back((c + d - 4) | 0x80000000u);
  }
  for (std::uint32_t s : {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u, 0xffffffffu, 0x7f7fffffu}) bits.push_back(s);
  for (std::uint32_t b : bits) {
    const float f = std::bit_cast<float>(b);
    ASSERT_EQ(fused::round_to_bf16_bits(f), f32_to_bf16(f).bits) << std::hex << b;
    ASSERT_EQ(fused::round_to_f16_bits(f), f32_to_f16(f).bits) << std::hex << b;
  }
  for (std::uint32_t h = 0; h < 0x10000u; ++h) {  // every f16
    const float a = fused::f16_bits_to_f32(static_cast<std::uint16_t>(h));
    const float b = f16_to_f32(f16_t{static_cast<std::uint16_t>(h)});
    ASSERT_EQ(std::bit_cast<std::uint32_t>(a), std::bit_cast<std::uint32_t>(b)) << std::hex << h;
  }
}

}  // namespace
}  // namespace shardkit::optim::testing
