#include "common/kernels/elementwise.h"

#include <cmath>
#include <vector>

#include "common/tensor/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/kernels/test_util.h"

namespace shardkit::kernels {
namespace {

using ::testing::HasSubstr;
using testing::RandomFloats;
using testing::TestSizes;

// Tolerances: add, sub, mul and scale of fp32 inputs are single IEEE operations, and the double
// reference rounded to fp32 is the correctly rounded fp32 result (double has more than 2 * 24 + 2 bits,
// so the double rounding is innocuous): they must match bit for bit. axpy and axpby do two or three
// roundings (or fewer with FMA contraction), so they get 2 * 2^-24 * (sum of |terms|).

TEST(ElementwiseTest, BinaryOpsAreCorrectlyRounded) {
  std::uint64_t seed = 1;
  for (std::int64_t n : TestSizes()) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    const std::vector<float> a = RandomFloats(n, seed++, -4.f, 4.f);
    const std::vector<float> b = RandomFloats(n, seed++, -4.f, 4.f);
    std::vector<float> sum_out(a.size()), diff_out(a.size()), prod_out(a.size()), scaled(a.size());
    add(a.data(), b.data(), sum_out.data(), n);
    sub(a.data(), b.data(), diff_out.data(), n);
    mul(a.data(), b.data(), prod_out.data(), n);
    scale(-0.3f, a.data(), scaled.data(), n);
    for (std::size_t i = 0; i < a.size(); ++i) {
      const double x = a[i], y = b[i];
      ASSERT_EQ(sum_out[i], static_cast<float>(x + y)) << i;
      ASSERT_EQ(diff_out[i], static_cast<float>(x - y)) << i;
      ASSERT_EQ(prod_out[i], static_cast<float>(x * y)) << i;
      ASSERT_EQ(scaled[i], static_cast<float>(static_cast<double>(-0.3f) * x)) << i;
    }
  }
}

TEST(ElementwiseTest, AxpyAndAxpbyMatchDoubleReference) {
  std::uint64_t seed = 50;
  const float alpha = 0.7f, beta = -1.3f;
  for (std::int64_t n : TestSizes()) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    const std::vector<float> x = RandomFloats(n, seed++, -2.f, 2.f);
    const std::vector<float> y0 = RandomFloats(n, seed++, -2.f, 2.f);
    std::vector<float> y1 = y0, y2 = y0;
    axpy(alpha, x.data(), y1.data(), n);
    axpby(alpha, x.data(), beta, y2.data(), n);
    for (std::size_t i = 0; i < x.size(); ++i) {
      const double ax = static_cast<double>(alpha) * x[i];
      const double by = static_cast<double>(beta) * y0[i];
      ASSERT_NEAR(y1[i], ax + y0[i], 2 * 0x1p-24 * (std::abs(ax) + std::abs(y0[i]))) << i;
      ASSERT_NEAR(y2[i], ax + by, 2 * 0x1p-24 * (std::abs(ax) + std::abs(by))) << i;
    }
  }
}

TEST(ElementwiseTest, FillWritesEveryElementAndNothingElse) {
  for (std::int64_t n : TestSizes()) {
    std::vector<float> v(static_cast<std::size_t>(n) + 2, -1.f);
    fill(v.data() + 1, n, 2.5f);
    EXPECT_EQ(v.front(), -1.f);
    EXPECT_EQ(v.back(), -1.f);
    for (std::int64_t i = 1; i <= n; ++i) ASSERT_EQ(v[static_cast<std::size_t>(i)], 2.5f) << i;
  }
}

TEST(ElementwiseTest, InPlaceCallsAreAllowed) {
  const std::int64_t n = 1023;
  std::vector<float> a = RandomFloats(n, 3), b = RandomFloats(n, 4);
  const std::vector<float> a0 = a;
  add(a.data(), b.data(), a.data(), n);  // out == a
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(a[i], a0[i] + b[i]) << i;
  std::vector<float> c = a0;
  mul(b.data(), c.data(), c.data(), n);  // out == b operand
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(c[i], b[i] * a0[i]) << i;
  std::vector<float> d = a0;
  scale(2.f, d.data(), d.data(), n);
  for (std::int64_t i = 0; i < n; ++i) ASSERT_EQ(d[i], 2.f * a0[i]) << i;
}

TEST(ElementwiseTensorTest, TensorFormsMatchRawForms) {
  Generator gen(5);
  const Tensor a = Tensor::uniform({7, 3}, gen, -1, 1);
  const Tensor b = Tensor::uniform({21}, gen, -1, 1);  // shapes may differ; numel must match
  const Tensor out = Tensor::empty({3, 7});
  const std::vector<float> av = a.to_vector(), bv = b.to_vector();
  add(a, b, out);
  for (std::size_t i = 0; i < 21; ++i) ASSERT_EQ(out.to_vector()[i], av[i] + bv[i]);
  sub(a, b, out);
  for (std::size_t i = 0; i < 21; ++i) ASSERT_EQ(out.to_vector()[i], av[i] - bv[i]);
  mul(a, b, out);
  for (std::size_t i = 0; i < 21; ++i) ASSERT_EQ(out.to_vector()[i], av[i] * bv[i]);
  scale(3.f, a, out);
  for (std::size_t i = 0; i < 21; ++i) ASSERT_EQ(out.to_vector()[i], 3.f * av[i]);
  const Tensor y = b.clone();
  axpy(2.f, a, y);
  std::vector<float> expect(21);
  for (std::size_t i = 0; i < 21; ++i) expect[i] = bv[i] + 2.f * av[i];
  for (std::size_t i = 0; i < 21; ++i) ASSERT_NEAR(y.to_vector()[i], expect[i], 1e-6);
  axpby(1.f, a, 0.f, y);
  EXPECT_EQ(y.to_vector(), av);
  fill(y, -4.f);
  EXPECT_THAT(y.to_vector(), ::testing::Each(-4.f));
  fill(Tensor::empty({0}), 1.f);  // empty tensors are fine
}

TEST(ElementwiseTensorTest, MismatchesThrowWithTheTensors) {
  const Tensor a = Tensor::zeros({4});
  try {
    add(a, Tensor::zeros({5}), Tensor::zeros({4}));
    FAIL() << "expected InternalError";
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), HasSubstr("add: sizes differ: f32[5] cpu and f32[4] cpu"));
  }
  try {
    axpy(1.f, a.to(DType::bf16), a);
    FAIL() << "expected InternalError";
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), HasSubstr("axpy: needs f32 tensors, got bf16[4] cpu"));
  }
  EXPECT_THROW(fill(a.to(DType::f16), 0.f), InternalError);
  // In place (the very same elements) is fine; a shifted view of the output is not.
  const Tensor flat = Tensor::from_vector({1, 2, 3, 4, 5}, {5});
  add(flat.view(0, {4}), flat.view(0, {4}), flat.view(0, {4}));
  EXPECT_EQ(flat.to_vector(), (std::vector<float>{2, 4, 6, 8, 5}));
  try {
    add(flat.view(1, {4}), flat.view(0, {4}), flat.view(0, {4}));
    FAIL() << "expected InternalError";
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), HasSubstr("partly overlaps the output"));
  }
}

}  // namespace
}  // namespace shardkit::kernels
