#include "common/kernels/gemm.h"

#include <bit>
#include <cmath>
#include <limits>
#include <thread>
#include <tuple>
#include <vector>

#include "common/tensor/tensor.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/kernels/test_util.h"

extern "C" int openblas_get_num_threads(void);  // OpenBLAS's own API (cblas.h is private to the library)

namespace shardkit::kernels {
namespace {

using ::testing::Each;
using ::testing::HasSubstr;
using testing::RandomFloats;

struct GemmCase {
  std::int64_t m, n, k;
};

// Stored element (i, j) of op(X) when X is row-major with leading dimension ld.
float OpAt(const std::vector<float>& x, bool trans, std::int64_t ld, std::int64_t i, std::int64_t j) {
  return trans ? x[static_cast<std::size_t>(j * ld + i)] : x[static_cast<std::size_t>(i * ld + j)];
}

// Runs gemm on random operands with padded leading dimensions and compares every element of C (and
// the padding, which must be untouched) with a double-precision reference.
void CheckGemm(bool ta, bool tb, GemmCase s, float alpha, float beta, std::int64_t pad, std::uint64_t seed) {
  SCOPED_TRACE(::testing::Message() << "ta=" << ta << " tb=" << tb << " m=" << s.m << " n=" << s.n << " k=" << s.k
                                    << " alpha=" << alpha << " beta=" << beta << " pad=" << pad);
  const std::int64_t a_rows = ta ? s.k : s.m, a_cols = ta ? s.m : s.k;
  const std::int64_t b_rows = tb ? s.n : s.k, b_cols = tb ? s.k : s.n;
  const std::int64_t lda = std::max<std::int64_t>(1, a_cols + pad);
  const std::int64_t ldb = std::max<std::int64_t>(1, b_cols + pad);
  const std::int64_t ldc = std::max<std::int64_t>(1, s.n + pad);
  const std::vector<float> a = RandomFloats(a_rows * lda, seed);
  const std::vector<float> b = RandomFloats(b_rows * ldb, seed + 1);
  std::vector<float> c = RandomFloats(s.m * ldc, seed + 2);
  if (beta == 0.f && !c.empty()) c[0] = std::numeric_limits<float>::quiet_NaN();  // beta == 0 must not read C
  const std::vector<float> c0 = c;

  gemm(ta, tb, s.m, s.n, s.k, alpha, a.data(), lda, b.data(), ldb, beta, c.data(), ldc);

  for (std::int64_t i = 0; i < s.m; ++i) {
    for (std::int64_t j = 0; j < ldc; ++j) {
      const std::size_t idx = static_cast<std::size_t>(i * ldc + j);
      if (j >= s.n) {  // padding between rows of C is never written
        ASSERT_EQ(std::bit_cast<std::uint32_t>(c[idx]), std::bit_cast<std::uint32_t>(c0[idx])) << i << "," << j;
        continue;
      }
      double ref = 0, mag = 0;
      for (std::int64_t l = 0; l < s.k; ++l) {
        const double p = static_cast<double>(OpAt(a, ta, lda, i, l)) * OpAt(b, tb, ldb, l, j);
        ref += p;
        mag += std::abs(p);
      }
      ref *= alpha;
      mag *= std::abs(alpha);
      if (beta != 0.f) {
        ref += static_cast<double>(beta) * c0[idx];
        mag += std::abs(static_cast<double>(beta) * c0[idx]);
      }
      // Tolerance: an fp32 dot product of length k (any summation order or blocking, with or without
      // FMA) errs by at most about (k + 2) * 2^-24 * sum |a_il * b_lj| (the standard gamma_k bound), plus
      // the alpha/beta roundings; 2x that covers the bound with margin and still catches any wrong
      // element (which would be off by O(mag)).
      const double tol = 2.0 * (static_cast<double>(s.k) + 3.0) * 0x1p-24 * mag + 1e-30;
      ASSERT_NEAR(c[idx], ref, tol) << "C(" << i << ", " << j << ")";
    }
  }
}

TEST(GemmTest, AllTransposesOddShapesAgainstDoubleReference) {
  const std::vector<GemmCase> shapes = {{1, 1, 1}, {7, 5, 3}, {3, 7, 1}, {33, 17, 65}, {64, 1, 129}, {1, 1023, 7}};
  std::uint64_t seed = 1;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      for (GemmCase s : shapes) {
        CheckGemm(ta, tb, s, 1.f, 0.f, 0, seed++);
        CheckGemm(ta, tb, s, 1.5f, -0.75f, 3, seed++);  // beta != 0 and non-trivial leading dimensions
      }
    }
  }
}

TEST(GemmTest, LongInnerDimension) {
  // k = 2^20 + 3: a long dot product (the largest of the sizes) stays within the gamma_k bound.
  CheckGemm(false, true, {1, 2, (std::int64_t{1} << 20) + 3}, 1.f, 0.5f, 0, 99);
  CheckGemm(true, false, {2, 1, (std::int64_t{1} << 20) + 3}, 0.25f, 0.f, 1, 100);
}

TEST(GemmTest, ZeroSizes) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      CheckGemm(ta, tb, {0, 5, 4}, 1.f, 0.5f, 2, 7);
      CheckGemm(ta, tb, {5, 0, 4}, 1.f, 0.5f, 2, 8);
      CheckGemm(ta, tb, {5, 3, 0}, 1.f, 0.5f, 2, 9);  // k == 0: C = beta * C
      CheckGemm(ta, tb, {5, 3, 0}, 1.f, 0.f, 2, 10);  // k == 0, beta == 0: C = 0 even over NaN
    }
  }
  // Null pointers are fine when nothing is read.
  gemm(false, false, 0, 0, 0, 1.f, nullptr, 1, nullptr, 1, 0.f, nullptr, 1);
}

TEST(GemmTest, AlphaZeroDoesNotReadOperands) {
  std::vector<float> a = {std::numeric_limits<float>::quiet_NaN(), 1.f};
  std::vector<float> b = {1.f, 2.f};
  std::vector<float> c = {4.f};
  gemm(false, false, 1, 1, 2, 0.f, a.data(), 2, b.data(), 1, 0.5f, c.data(), 1);
  EXPECT_EQ(c[0], 2.f);
}

TEST(GemmTest, BadLeadingDimensionThrows) {
  std::vector<float> a(12), b(12), c(12);
  try {
    gemm(false, false, 3, 4, 4, 1.f, a.data(), 3, b.data(), 4, 0.f, c.data(), 4);
    FAIL() << "expected InternalError";
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), HasSubstr("lda"));
  }
  EXPECT_THROW(gemm(false, true, 3, 4, 4, 1.f, a.data(), 4, b.data(), 3, 0.f, c.data(), 4), InternalError);
  EXPECT_THROW(gemm(false, false, 3, 4, 4, 1.f, a.data(), 4, b.data(), 4, 0.f, c.data(), 3), InternalError);
  EXPECT_THROW(gemm(false, false, -1, 4, 4, 1.f, a.data(), 4, b.data(), 4, 0.f, c.data(), 4), InternalError);
}

TEST(GemmTest, BlasRunsOneThreadAfterFirstUse) {
  std::vector<float> a(4, 1.f), b(4, 1.f), c(4);
  gemm(false, false, 2, 2, 2, 1.f, a.data(), 2, b.data(), 2, 0.f, c.data(), 2);  // first use sets 1 thread
  EXPECT_EQ(openblas_get_num_threads(), 1);
  set_blas_single_threaded();  // idempotent
  set_blas_single_threaded();
  EXPECT_EQ(openblas_get_num_threads(), 1);
}

TEST(GemmTest, ConcurrentCallersFromRankThreadsGetSerialResults) {
  // Simulated ranks are threads: each calls gemm on its own buffers at the same time.
  constexpr int kThreads = 4;
  const std::int64_t m = 37, n = 29, k = 53;
  std::vector<std::vector<float>> as, bs, serial(kThreads), parallel(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    as.push_back(RandomFloats(m * k, 300 + t));
    bs.push_back(RandomFloats(k * n, 400 + t));
    serial[t].assign(static_cast<std::size_t>(m * n), 0.f);
    parallel[t].assign(static_cast<std::size_t>(m * n), 0.f);
    gemm(false, false, m, n, k, 1.f, as[t].data(), k, bs[t].data(), n, 0.f, serial[t].data(), n);
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int rep = 0; rep < 20; ++rep) {
        gemm(false, false, m, n, k, 1.f, as[t].data(), k, bs[t].data(), n, 0.f, parallel[t].data(), n);
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(parallel[t], serial[t]) << "thread " << t;  // same code path: same bits
}

TEST(MatmulTest, MatchesGemmForEveryTranspose) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "ta=" << ta << " tb=" << tb);
      const std::int64_t m = 5, n = 3, k = 4;
      Generator gen(11);
      Tensor a = Tensor::uniform(ta ? Shape{k, m} : Shape{m, k}, gen, -1, 1);
      Tensor b = Tensor::uniform(tb ? Shape{n, k} : Shape{k, n}, gen, -1, 1);
      Tensor out = Tensor::uniform({m, n}, gen, -1, 1);
      const std::vector<float> out0 = out.to_vector();
      matmul(a, b, out, ta, tb, 0.5f);
      for (std::int64_t i = 0; i < m; ++i) {
        for (std::int64_t j = 0; j < n; ++j) {
          double ref = 0.5 * out0[static_cast<std::size_t>(i * n + j)];
          for (std::int64_t l = 0; l < k; ++l) {
            ref += (ta ? a.item_at(l * m + i) : a.item_at(i * k + l)) * (tb ? b.item_at(j * k + l) : b.item_at(l * n + j));
          }
          EXPECT_NEAR(out.item_at(i * n + j), ref, 1e-5) << i << "," << j;  // k = 4: error ~ 4 * 2^-24 * 4
        }
      }
    }
  }
}

TEST(MatmulTest, EmptyInnerDimension) {
  Tensor a = Tensor::empty({3, 0});
  Tensor b = Tensor::empty({0, 2});
  Tensor out = Tensor::full({3, 2}, 7.0);
  matmul(a, b, out);
  EXPECT_THAT(out.to_vector(), Each(0.f));
}

TEST(MatmulTest, ShapeErrorsNameTheShapes) {
  Tensor a = Tensor::zeros({2, 3});
  Tensor b = Tensor::zeros({4, 5});
  Tensor out = Tensor::zeros({2, 5});
  try {
    matmul(a, b, out);
    FAIL() << "expected InternalError";
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), HasSubstr("inner dimensions differ"));
    EXPECT_THAT(e.what(), HasSubstr("f32[2, 3]"));
    EXPECT_THAT(e.what(), HasSubstr("f32[4, 5]"));
  }
  try {
    matmul(a, Tensor::zeros({3, 5}), Tensor::zeros({5, 2}));
    FAIL() << "expected InternalError";
  } catch (const InternalError& e) {
    EXPECT_THAT(e.what(), HasSubstr("expected [2, 5]"));
  }
  EXPECT_THROW(matmul(Tensor::zeros({6}), b, out), InternalError);
  const Tensor square = Tensor::zeros({3, 3});
  EXPECT_THROW(matmul(square, Tensor::zeros({3, 3}), square), InternalError);  // BLAS cannot write its input
  EXPECT_THROW(matmul(a.to(DType::bf16), Tensor::zeros({3, 5}), out), InternalError);
}

// Note [BLAS kernel choice]: advice only when the chosen kernels lack AVX-512 and the CPU has it.
TEST(BlasKernelAdvice, OnlyForKernelsWithoutAvx512OnACpuWithIt) {
  EXPECT_THAT(blas_kernel_advice("Haswell", true), ::testing::HasSubstr("OPENBLAS_CORETYPE=SkylakeX"));
  EXPECT_THAT(blas_kernel_advice("Zen", true), ::testing::HasSubstr("runs its Zen kernels"));
  EXPECT_EQ(blas_kernel_advice("Haswell", false), "");
  EXPECT_EQ(blas_kernel_advice("SkylakeX", true), "");
  EXPECT_EQ(blas_kernel_advice("cooperlake", true), "");
  EXPECT_EQ(blas_kernel_advice("", true), "");
  // This process's BLAS names its kernels.
  EXPECT_FALSE(blas_core_name().empty());
}

}  // namespace
}  // namespace shardkit::kernels
