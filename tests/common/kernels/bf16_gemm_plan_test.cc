// The layout of "medium" GEMMs on padded bf16 copies (Note [padded bf16 copies] in
// common/kernels/cuda/bf16_gemm_plan.h), run on the CPU: each copy built group by group as the device's copy kernel
// builds it (without the rounding, which the GPU tests check), the product made with the arguments the cuBLAS call
// gets (in row-major form), C written through the staging buffer when the plan says so. The result must equal the
// product of the original operands, for every transpose, odd sizes, leading dimensions and C strides, strided
// batches that overlap (attention's heads), and beta != 0; C's elements between n and its leading dimension stay
// untouched.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/kernels/cuda/bf16_gemm_plan.h"
#include "common/kernels/gemm.h"
#include "gtest/gtest.h"

namespace shardkit::kernels::cuda {
namespace {

std::vector<float> Packed(const PackShape& s, const std::vector<float>& src) {
  std::vector<float> out(static_cast<std::size_t>(s.numel()), std::numeric_limits<float>::quiet_NaN());
  for (std::int64_t g = 0; g < s.groups(); ++g) {
    const PackGroup pg = pack_group(s, g);
    for (int e = 0; e < static_cast<int>(kBf16PadTo); ++e) {
      out[static_cast<std::size_t>(pg.dst + e)] = e < pg.valid ? src.at(static_cast<std::size_t>(pg.src + e)) : 0.f;
    }
  }
  return out;
}

struct Case {
  bool ta, tb;
  std::int64_t m, n, k, lda, ldb, ldc, stride_a, stride_b, stride_c, batches;
  float beta;
  bool c_aligned = true;
};

std::vector<float> Filled(std::int64_t n, float scale) {
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::size_t i = 0; i < v.size(); ++i) v[i] = scale * static_cast<float>((i * 37 + 11) % 97) / 97.f - 0.4f;
  return v;
}

// Enough elements for `batches` matrices of rows x cols with leading dimension ld, `stride` apart.
std::int64_t Extent(std::int64_t rows, std::int64_t cols, std::int64_t ld, std::int64_t stride, std::int64_t batches) {
  return (batches - 1) * stride + (rows - 1) * ld + cols;
}

void Check(const Case& c) {
  SCOPED_TRACE(::testing::Message() << "ta=" << c.ta << " tb=" << c.tb << " m=" << c.m << " n=" << c.n << " k=" << c.k
                                    << " lda=" << c.lda << " ldb=" << c.ldb << " ldc=" << c.ldc << " batches="
                                    << c.batches << " beta=" << c.beta << " c_aligned=" << c.c_aligned);
  const std::int64_t a_rows = c.ta ? c.k : c.m, a_cols = c.ta ? c.m : c.k;
  const std::int64_t b_rows = c.tb ? c.n : c.k, b_cols = c.tb ? c.k : c.n;
  const std::vector<float> a = Filled(Extent(a_rows, a_cols, c.lda, c.stride_a, c.batches), 1.f);
  const std::vector<float> b = Filled(Extent(b_rows, b_cols, c.ldb, c.stride_b, c.batches), 0.5f);
  const std::vector<float> c0 = Filled(Extent(c.m, c.ldc, c.ldc, c.stride_c, c.batches), 2.f);
  std::vector<float> want = c0;
  for (std::int64_t i = 0; i < c.batches; ++i) {
    gemm(c.ta, c.tb, c.m, c.n, c.k, 1.f, a.data() + i * c.stride_a, c.lda, b.data() + i * c.stride_b, c.ldb, c.beta,
         want.data() + i * c.stride_c, c.ldc);
  }
  const Bf16GemmPlan p = plan_bf16_gemm(c.ta, c.tb, c.m, c.n, c.k, c.lda, c.stride_a, c.ldb, c.stride_b, c.ldc,
                                        c.stride_c, c.batches, c.c_aligned);
  EXPECT_EQ(p.k % kBf16PadTo, 0);
  EXPECT_EQ(p.a.pad_cols % kBf16PadTo, 0);
  EXPECT_EQ(p.b.pad_cols % kBf16PadTo, 0);
  EXPECT_EQ(p.ldc % 4, 0) << "C's rows 16-byte aligned";
  EXPECT_EQ(p.staged, !c.c_aligned || c.ldc % 4 != 0 || (c.batches > 1 && c.stride_c % 4 != 0));
  EXPECT_EQ(p.n, p.staged ? (c.n + kBf16PadTo - 1) / kBf16PadTo * kBf16PadTo : c.n) << "staged: n padded to 8";
  const std::vector<float> a16 = Packed(p.a, a), b16 = Packed(p.b, b);
  std::vector<float> got = c0;
  std::vector<float> staging;
  float* out = got.data();
  std::int64_t out_stride = c.stride_c;
  if (p.staged) {
    staging.assign(static_cast<std::size_t>(c.batches * p.stride_c), std::numeric_limits<float>::quiet_NaN());
    out = staging.data();
    out_stride = p.stride_c;
    if (c.beta != 0.f) {  // C copied in, as CopyStaged(..., to_staging = true)
      for (std::int64_t i = 0; i < c.batches; ++i) {
        for (std::int64_t r = 0; r < c.m; ++r) {
          for (std::int64_t j = 0; j < c.n; ++j) out[i * p.stride_c + r * p.ldc + j] = got[i * c.stride_c + r * c.ldc + j];
        }
      }
    }
  }
  // cuBLAS gets (op_b, op_a, p.n, m, p.k, B copy with ld b.pad_cols, A copy with ld a.pad_cols, out with ld p.ldc),
  // which is this row-major product.
  for (std::int64_t i = 0; i < c.batches; ++i) {
    gemm(c.ta, c.tb, c.m, p.n, p.k, 1.f, a16.data() + i * p.a.copy_stride(), p.a.pad_cols,
         b16.data() + i * p.b.copy_stride(), p.b.pad_cols, c.beta, out + i * out_stride, p.ldc);
  }
  if (p.staged) {  // copied back, as CopyStaged(..., to_staging = false): n columns of each row
    for (std::int64_t i = 0; i < c.batches; ++i) {
      for (std::int64_t r = 0; r < c.m; ++r) {
        for (std::int64_t j = 0; j < c.n; ++j) got[i * c.stride_c + r * c.ldc + j] = out[i * p.stride_c + r * p.ldc + j];
      }
    }
  }
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t e = 0; e < got.size(); ++e) {
    ASSERT_NEAR(got[e], want[e], 1e-4 * (1 + std::abs(want[e]))) << "element " << e;
  }
}

TEST(Bf16GemmPlanTest, PaddedCopiesGiveTheProductOfTheOperands) {
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      // Aligned sizes; odd m, n, k, leading dimensions and C rows (the logits' 50257 in small); beta != 0.
      Check({ta, tb, 16, 24, 32, ta ? 16 : 32, tb ? 32 : 24, 24, 0, 0, 0, 1, 0.f});
      Check({ta, tb, 13, 29, 31, (ta ? 13 : 31) + 2, (tb ? 31 : 29) + 3, 29, 0, 0, 0, 1, 0.f});
      Check({ta, tb, 13, 29, 31, ta ? 13 : 31, tb ? 31 : 29, 33, 0, 0, 0, 1, 0.5f});
      Check({ta, tb, 8, 8, 8, 8, 8, 8, 0, 0, 0, 1, 1.f, /*c_aligned=*/false});
      // Batches, strided and not, C strides odd and even.
      Check({ta, tb, 9, 7, 5, ta ? 9 : 5, tb ? 5 : 7, 7, 50, 40, 70, 3, 0.f});
      Check({ta, tb, 9, 7, 5, ta ? 9 : 5, tb ? 5 : 7, 8, 50, 40, 72, 3, 0.25f});
    }
  }
  // Attention's S_h = Q_h K_h^T: heads of width hs at offsets hs apart inside rows of 3c (overlapping batches).
  const std::int64_t t = 11, hs = 6, heads = 3, c = heads * hs;
  Check({false, true, t, t, hs, 3 * c, 3 * c, t, hs, hs, t * t, heads, 0.f});
  // dQ = dS K: dS [t, t] per head, K strided inside the rows.
  Check({false, false, t, hs, t, t, 3 * c, c, t * t, hs, hs, heads, 0.f});
}

TEST(Bf16GemmPlanTest, PackGroupsCoverTheCopyOnceWithZeroPadding) {
  const PackShape s = pack_shape(5, 11, 13, 70, 2);
  EXPECT_EQ(s.pad_rows, 8);
  EXPECT_EQ(s.pad_cols, 16);
  std::vector<int> written(static_cast<std::size_t>(s.numel()), 0);
  for (std::int64_t g = 0; g < s.groups(); ++g) {
    const PackGroup pg = pack_group(s, g);
    ASSERT_EQ(pg.dst % kBf16PadTo, 0) << "16-byte stores";
    for (int e = 0; e < static_cast<int>(kBf16PadTo); ++e) ++written[static_cast<std::size_t>(pg.dst + e)];
    const std::int64_t b = pg.dst / s.copy_stride(), i = pg.dst % s.copy_stride() / s.pad_cols, j = pg.dst % s.pad_cols;
    const int want_valid = i < s.rows ? static_cast<int>(std::max<std::int64_t>(0, std::min<std::int64_t>(8, s.cols - j))) : 0;
    EXPECT_EQ(pg.valid, want_valid) << "group " << g;
    if (pg.valid > 0) {
      EXPECT_EQ(pg.src, b * s.stride + i * s.ld + j) << "group " << g;
    }
  }
  for (int w : written) ASSERT_EQ(w, 1);
  EXPECT_EQ(pack_shape(5, 11, 13, 70, 1).stride, 0) << "one matrix: the stride is not used";
}

// Note [softmax writes the bf16 copy] (common/autograd/ops/attention.cc): attention's head-wide products run on the
// softmax's copies exactly where they would otherwise run TF32 and the T x T products run on bf16: GPT-2 small's
// T = 1024, hs = 64; not below T = 512 (S itself runs TF32), nor where hs is wide enough for copies to pay.
TEST(Bf16GemmPlanTest, AttentionRunsOnSoftmaxCopiesWhereOnlyTheTxTProductsRunOnBf16) {
  EXPECT_TRUE(attention_runs_on_softmax_copies(1024, 64));
  EXPECT_TRUE(attention_runs_on_softmax_copies(512, 64));
  EXPECT_TRUE(attention_runs_on_softmax_copies(517, 64));
  EXPECT_FALSE(attention_runs_on_softmax_copies(511, 64));
  EXPECT_FALSE(attention_runs_on_softmax_copies(37, 8));
  EXPECT_FALSE(attention_runs_on_softmax_copies(1024, 1024));
  EXPECT_FALSE(attention_runs_on_softmax_copies(0, 64));
  for (const std::int64_t t : {100, 512, 1024, 4096}) {
    for (const std::int64_t hs : {1, 16, 64, 128, 512}) {
      EXPECT_EQ(attention_runs_on_softmax_copies(t, hs),
                !medium_gemm_runs_on_bf16_copies(t, hs, t) && medium_gemm_runs_on_bf16_copies(t, t, hs))
          << "t=" << t << " hs=" << hs;
    }
  }
}

}  // namespace
}  // namespace shardkit::kernels::cuda
