// OSS clip_grad_norm against the unsharded computation, and the optimizer-state ledger figures.
#include <cmath>
#include <cstdio>
#include <limits>

#include "common/comm/testing/run_ranks.h"
#include "common/optim/adam.h"
#include "gtest/gtest.h"
#include "oss/oss.h"

namespace shardkit::oss {
namespace {

const std::vector<Shape> kShapes = {{7, 3}, {5}, {13}, {2, 2}, {1}, {11}};

// Parameters of `dtype` whose gradients (also `dtype`) include values whose squares overflow f16.
std::vector<Tensor> ParamsWithGrads(DType dtype) {
  Generator gen(3);
  std::vector<Tensor> out;
  for (const Shape& s : kShapes) {
    Tensor p = Tensor::normal(s, gen, 0.f, 1.f, TensorOptions{}.with_dtype(dtype));
    p.set_requires_grad(true);
    std::vector<float> g(static_cast<std::size_t>(p.numel()));
    gen.fill_uniform(g.data(), p.numel(), -400.f, 400.f);  // 400^2 = 160000 > 65504
    p.set_grad(Tensor::from_vector(g, s, TensorOptions{}.with_dtype(dtype)));
    out.push_back(p);
  }
  return out;
}

double ReferenceNorm(const std::vector<Tensor>& params, double norm_type) {
  double acc = 0;
  for (const Tensor& p : params) {
    for (float g : p.grad().to_vector()) {
      acc = std::isinf(norm_type) ? std::max(acc, static_cast<double>(std::abs(g))) : acc + double{g} * g;
    }
  }
  return std::isinf(norm_type) ? acc : std::sqrt(acc);
}

class OssClip : public ::testing::TestWithParam<std::tuple<DType, double, PartitionPolicy>> {};

TEST_P(OssClip, EqualsUnshardedNormAndScaling) {
  const auto [dtype, norm_type, policy] = GetParam();
  std::vector<Tensor> ref = ParamsWithGrads(dtype);
  const double want = ReferenceNorm(ref, norm_type);
  const double max_norm = want / 4;  // forces clipping
  const double coef = max_norm / (want + 1e-6);
  for (int world : {1, 3, 4}) {
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      std::vector<Tensor> params = ParamsWithGrads(dtype);
      auto oss = Oss::create({{params, optim::AdamW::default_hyper()}}, optim::AdamW::factory(), env.group_ptr,
                             {.policy = policy});
      if (!oss.ok()) return oss.status();
      absl::StatusOr<double> norm = (*oss)->clip_grad_norm(max_norm, norm_type);
      if (!norm.ok()) return norm.status();
      // The partial is carried in fp32 by the all_reduce: relative error ~1e-7.
      EXPECT_NEAR(*norm, want, want * 1e-6) << "world " << world;
      EXPECT_TRUE(std::isfinite(*norm));
      for (std::size_t i = 0; i < params.size(); ++i) {
        const std::vector<float> got = params[i].grad().to_vector(), orig = ref[i].grad().to_vector();
        for (std::size_t k = 0; k < got.size(); ++k) {
          // Scaled in fp32 then rounded to the gradient dtype: within one rounding of that dtype.
          const double tol = std::abs(orig[k] * coef) * (dtype == DType::f32 ? 1e-6 : 1e-2) + 1e-6;
          EXPECT_NEAR(got[k], orig[k] * coef, tol);
        }
      }
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
  }
}

INSTANTIATE_TEST_SUITE_P(
    Norms, OssClip,
    ::testing::Combine(::testing::Values(DType::f32, DType::bf16, DType::f16),
                       ::testing::Values(2.0, std::numeric_limits<double>::infinity()),
                       ::testing::Values(PartitionPolicy::greedy, PartitionPolicy::flat)),
    [](const auto& info) {
      return std::string(dtype_name(std::get<0>(info.param))) + (std::isinf(std::get<1>(info.param)) ? "_inf" : "_l2") +
             "_" + partition_policy_name(std::get<2>(info.param));
    });

TEST(OssClipTest, RejectsOtherNorms) {
  absl::Status st = comm::RunRanks(1, [&](comm::RankEnv& env) {
    std::vector<Tensor> params = ParamsWithGrads(DType::f32);
    auto oss = Oss::create({{params, {}}}, optim::AdamW::factory(), env.group_ptr);
    EXPECT_EQ((*oss)->clip_grad_norm(1.0, 1.0).status().message(), "clip_grad_norm: expected norm_type 2 or inf, found 1");
  });
  EXPECT_TRUE(st.ok()) << st;
}

// max_norm <= 0 or NaN would zero, negate or NaN every gradient: refused, the gradients untouched.
TEST(OssClipTest, RejectsAMaxNormThatIsNotPositive) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) {
    std::vector<Tensor> params = ParamsWithGrads(DType::f32);
    auto oss = Oss::create({{params, {}}}, optim::AdamW::factory(), env.group_ptr);
    const std::vector<float> before = params[0].grad().to_vector();
    for (const double m : {0.0, -1.0, std::numeric_limits<double>::quiet_NaN()}) {
      const absl::Status s = (*oss)->clip_grad_norm(m).status();
      EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "max_norm " << m;
      EXPECT_NE(std::string(s.message()).find("expected max_norm > 0"), std::string::npos) << s;
    }
    EXPECT_EQ(params[0].grad().to_vector(), before);
  });
  EXPECT_TRUE(st.ok()) << st;
}

// Per-rank optimizer-state bytes are exactly 8 per owned element (fp32 AdamW: m and v), 12 with bf16
// parameters (+ fp32 master); printed against the ZeRO-1 formula 8Ψ/N (12Ψ/N).
class OssLedger : public ::testing::TestWithParam<std::tuple<DType, PartitionPolicy>> {};

TEST_P(OssLedger, OptimizerStateBytesAreExactlyTheOwnedShare) {
  const auto [dtype, policy] = GetParam();
  const std::int64_t per_elem = dtype == DType::f32 ? 8 : 12;
  for (int world : {1, 2, 3, 4, 8}) {
    std::int64_t psi = 0;
    for (const Shape& s : kShapes) psi += shape_numel(s);
    std::vector<std::int64_t> owned(static_cast<std::size_t>(world)), bytes(static_cast<std::size_t>(world));
    absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
      std::vector<Tensor> params = ParamsWithGrads(dtype);
      auto oss = Oss::create({{params, optim::AdamW::default_hyper()}}, optim::AdamW::factory(), env.group_ptr,
                             {.policy = policy});
      if (!oss.ok()) return oss.status();
      if (absl::Status s = (*oss)->step(); !s.ok()) return s;
      owned[static_cast<std::size_t>(env.rank)] = (*oss)->owned_numel();
      bytes[static_cast<std::size_t>(env.rank)] = env.context.memory->current(MemoryCategory::optimizer_state);
      return absl::OkStatus();
    });
    ASSERT_TRUE(st.ok()) << st;
    std::int64_t total_owned = 0;
    for (int r = 0; r < world; ++r) {
      EXPECT_EQ(bytes[static_cast<std::size_t>(r)], per_elem * owned[static_cast<std::size_t>(r)]) << "rank " << r;
      total_owned += owned[static_cast<std::size_t>(r)];
      std::printf("[ledger] %s %s n=%d rank %d: optimizer_state %lld B, formula %lld*Psi/N = %.1f B\n",
                  std::string(dtype_name(dtype)).c_str(), partition_policy_name(policy),
                  world, r, static_cast<long long>(bytes[static_cast<std::size_t>(r)]),
                  static_cast<long long>(per_elem), static_cast<double>(per_elem * psi) / world);
    }
    EXPECT_EQ(total_owned, psi);
    if (policy == PartitionPolicy::flat) {  // flat: within one element of Ψ/N
      for (int r = 0; r < world; ++r) EXPECT_LE(owned[static_cast<std::size_t>(r)], (psi + world - 1) / world);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Ledger, OssLedger,
                         ::testing::Combine(::testing::Values(DType::f32, DType::bf16),
                                            ::testing::Values(PartitionPolicy::greedy, PartitionPolicy::flat)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) +
                                  "_" + partition_policy_name(std::get<1>(info.param));
                         });

}  // namespace
}  // namespace shardkit::oss
