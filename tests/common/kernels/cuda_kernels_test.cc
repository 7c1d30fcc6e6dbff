// The CUDA kernels against the CPU kernels (themselves checked against double references in the other
// test files). Every test skips, with the reason, when no CUDA device is usable at run time.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "common/kernels/cuda/bf16_gemm_plan.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/elementwise.h"
#include "common/kernels/gemm.h"
#include "common/kernels/reduce.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/rank_context.h"
#include "common/tensor/tensor.h"
#include "gtest/gtest.h"
#include "tests/common/tensor/cuda_test_util.h"
#include "tests/common/kernels/test_util.h"

namespace shardkit::kernels {
namespace {

using testing::RandomFloats;
using testing::TestSizes;

const Device kGpu = Device::cuda(0);

TensorOptions OnGpu(DType dtype) {
  TensorOptions o = TensorOptions{}.with_dtype(dtype);
  o.device = kGpu;
  return o;
}

Tensor ToGpu(const Tensor& cpu) {
  Tensor g = Tensor::empty(cpu.shape(), OnGpu(cpu.dtype()));
  cast(cpu, g);
  return g;
}

Tensor ToCpu(const Tensor& gpu, DType dtype) {
  Tensor c = Tensor::empty(gpu.shape(), TensorOptions{}.with_dtype(dtype));
  cast(gpu, c);
  return c;
}

TEST(CudaKernelsTest, CublasLoadsWithoutADevice) {
#if defined(SHARDKIT_HAS_CUDA) || defined(SHARDKIT_CUDA_EMULATOR)
  // cuBLAS is dlopen'ed on first use (Note [cuBLAS loaded on first use]): loading needs no GPU (the emulator's
  // is always there).
  EXPECT_EQ(cuda::cublas_load_error(), "");
#else
  EXPECT_EQ(cuda::cublas_load_error(), "shardkit was built without CUDA");
#endif
}

#ifdef SHARDKIT_CUDA_EMULATOR
// What the CUDA emulator is for (Note [cuda emulator] in tests/testing/cuda_emulator): the host touching device
// memory faults at the access, and bytes nobody wrote read as NaN.
TEST(CudaEmulatorTest, HostAccessOfDeviceMemoryFaultsAndFreshBytesAreNan) {
  const Tensor t = Tensor::empty({300}, TensorOptions{}.with_device(Device::cuda(0)));
  for (const float v : t.to(Device::cpu()).to_vector()) ASSERT_TRUE(std::isnan(v));
  EXPECT_DEATH(
      {
        volatile float x = static_cast<const float*>(t.raw_data())[7];
        (void)x;
      },
      "");
  // A kernel on it in between (a copy in, a cast) leaves it protected again afterwards.
  t.copy_(Tensor::full({300}, 2.0));
  EXPECT_EQ(t.to(Device::cpu()).to_vector()[7], 2.0f);
  EXPECT_DEATH(static_cast<float*>(t.raw_data())[7] = 1.0f, "");
}
#endif

// Tensor::zeros and zero_ on a device: the bytes are zero (cudaMalloc's are not), in every dtype.
TEST(CudaKernelsTest, TensorZerosAndZeroOnADeviceAreZero) {
  SK_REQUIRE_CUDA_DEVICE("CUDA kernels");
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (std::int64_t n : TestSizes()) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " n=" << n);
      // A first tensor filled with ones and freed, so the next allocation likely reuses non-zero memory.
      { fill(Tensor::empty({n}, OnGpu(DType::f32)), 1.0f); }
      const Tensor z = Tensor::zeros({n}, OnGpu(dtype));
      EXPECT_EQ(max_abs(ToCpu(z, DType::f32)), 0.0);
      const Tensor g = ToGpu(Tensor::full({n}, 3.0, TensorOptions{}.with_dtype(dtype)));
      g.zero_();
      EXPECT_EQ(max_abs(ToCpu(g, DType::f32)), 0.0);
    }
  }
}

TEST(CudaKernelsTest, ElementwiseMatchesCpu) {
  SK_REQUIRE_CUDA_DEVICE("CUDA kernels");
  std::uint64_t seed = 1;
  for (std::int64_t n : TestSizes()) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    const Tensor a = Tensor::from_vector(RandomFloats(n, seed++), {n});
    const Tensor b = Tensor::from_vector(RandomFloats(n, seed++), {n});
    const Tensor ga = ToGpu(a), gb = ToGpu(b), gout = Tensor::empty({n}, OnGpu(DType::f32));
    const Tensor out = Tensor::empty({n});
    // add/sub/mul/scale are single correctly rounded IEEE operations on both sides: bit-identical.
    add(a, b, out);
    add(ga, gb, gout);
    EXPECT_EQ(ToCpu(gout, DType::f32).to_vector(), out.to_vector());
    sub(a, b, out);
    sub(ga, gb, gout);
    EXPECT_EQ(ToCpu(gout, DType::f32).to_vector(), out.to_vector());
    mul(a, b, out);
    mul(ga, gb, gout);
    EXPECT_EQ(ToCpu(gout, DType::f32).to_vector(), out.to_vector());
    scale(0.3f, a, out);
    scale(0.3f, ga, gout);
    EXPECT_EQ(ToCpu(gout, DType::f32).to_vector(), out.to_vector());
    fill(gout, 1.5f);
    EXPECT_EQ(max_abs(ToCpu(gout, DType::f32)), n > 0 ? 1.5 : 0.0);
    // axpy / axpby: the GPU contracts to FMA, the CPU may not: within two fp32 roundings (|terms| <= 2).
    const Tensor y = b.clone(), gy = ToGpu(b);
    axpy(0.7f, a, y);
    axpy(0.7f, ga, gy);
    std::vector<float> got = ToCpu(gy, DType::f32).to_vector(), want = y.to_vector();
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 4 * 0x1p-24) << i;
    axpby(0.7f, a, -1.1f, y);
    axpby(0.7f, ga, -1.1f, gy);
    got = ToCpu(gy, DType::f32).to_vector();
    want = y.to_vector();
    for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 8 * 0x1p-24) << i;
  }
}

TEST(CudaKernelsTest, ReductionsMatchCpu) {
  SK_REQUIRE_CUDA_DEVICE("CUDA kernels");
  std::uint64_t seed = 10;
  for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (std::int64_t n : TestSizes()) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " n=" << n);
      std::vector<float> v = RandomFloats(n, seed++, -0.75f, 1.25f);
      if (n > 0 && dtype == DType::f16) v[0] = 60000.f;  // its square overflows f16, not the fp32 accumulator
      const Tensor t = Tensor::from_vector(v, {n}, TensorOptions{}.with_dtype(dtype));
      const Tensor g = ToGpu(t);
      double sum_abs = 0, sum_sq = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        sum_abs += std::abs(t.item_at(i));
        sum_sq += t.item_at(i) * t.item_at(i);
      }
      // Each GPU thread adds at most ceil(n / (1024 * 256)) terms in fp32; blocks combine in double. With
      // the CPU's bound (reduce_test.cc) the two results differ by at most the sum of both bounds.
      const double lane = std::ceil(static_cast<double>(n) / (1024.0 * 256.0)) + 2.0;
      EXPECT_NEAR(sum(g), sum(t), (lane + 66.0) * 0x1p-24 * sum_abs + 1e-300);
      EXPECT_NEAR(sum_squares(g), sum_squares(t), (lane + 66.0) * 0x1p-24 * sum_sq + 1e-300);
      EXPECT_EQ(max_abs(g), max_abs(t));
    }
  }
  std::vector<float> v(1000, 1.f);
  v[777] = std::nanf("");
  EXPECT_TRUE(std::isnan(max_abs(ToGpu(Tensor::from_vector(v, {1000}, TensorOptions{}.with_dtype(DType::f16))))));
}

// The elements of `converted` whose source value is finite. A float -> i64 cast of an infinity (f16 overflows at
// 65520) is undefined (elementwise.h): x86 gives INT64_MIN, the GPU saturates.
std::vector<float> InRange(const Tensor& converted, const Tensor& src) {
  const std::vector<float> c = converted.to_vector(), s = src.to_vector();
  std::vector<float> kept;
  for (std::size_t i = 0; i < c.size(); ++i) {
    if (converted.dtype() != DType::i64 || std::isfinite(s[i])) kept.push_back(c[i]);
  }
  return kept;
}

TEST(CudaKernelsTest, CastsMatchCpuForEveryPair) {
  SK_REQUIRE_CUDA_DEVICE("CUDA kernels");
  const std::int64_t n = (std::int64_t{1} << 20) + 3;
  std::vector<float> v = RandomFloats(n, 77, -70000.f, 70000.f);  // includes f16 overflow
  for (DType from : {DType::f32, DType::bf16, DType::f16, DType::i64}) {
    for (DType to : {DType::f32, DType::bf16, DType::f16, DType::i64}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(from) << " -> " << dtype_name(to));
      const Tensor src = Tensor::from_vector(v, {n}).to(from);
      Tensor want = Tensor::empty({n}, TensorOptions{}.with_dtype(to));
      cast(src, want);
      const Tensor g_src = ToGpu(src);
      Tensor g_dst = Tensor::empty({n}, OnGpu(to));
      cast(g_src, g_dst);                               // on the device
      EXPECT_EQ(InRange(ToCpu(g_dst, to), src), InRange(want, src));
      EXPECT_EQ(InRange(ToCpu(g_src, to), src), InRange(want, src));  // device -> host, converting
      Tensor g_direct = Tensor::empty({n}, OnGpu(to));
      cast(src, g_direct);                              // host -> device, converting
      EXPECT_EQ(InRange(ToCpu(g_direct, to), src), InRange(want, src));
    }
  }
}

TEST(CudaKernelsTest, MatmulMatchesCpuForEveryTranspose) {
  SK_REQUIRE_CUDA_DEVICE("CUDA kernels");
  const std::int64_t m = 33, n = 17, k = 65;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "ta=" << ta << " tb=" << tb);
      Generator gen(3);
      const Tensor a = Tensor::uniform(ta ? Shape{k, m} : Shape{m, k}, gen, -1, 1);
      const Tensor b = Tensor::uniform(tb ? Shape{n, k} : Shape{k, n}, gen, -1, 1);
      const Tensor c = Tensor::uniform({m, n}, gen, -1, 1);
      const Tensor gc = ToGpu(c);
      matmul(a, b, c, ta, tb, 0.5f);
      matmul(ToGpu(a), ToGpu(b), gc, ta, tb, 0.5f);
      const std::vector<float> got = ToCpu(gc, DType::f32).to_vector(), want = c.to_vector();
      // Both are within (k + 3) * 2^-24 * sum|a_il b_lj| (<= k + 0.5) of the exact result.
      for (std::size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 2 * (k + 3) * 0x1p-24 * (k + 0.5)) << i;
    }
  }
  // k == 0: out = beta * out on the device too.
  const Tensor out = ToGpu(Tensor::full({2, 3}, 4.0));
  matmul(Tensor::empty({2, 0}, OnGpu(DType::f32)), Tensor::empty({0, 3}, OnGpu(DType::f32)),
         out, false, false, 0.25f);
  EXPECT_EQ(ToCpu(out, DType::f32).to_vector(), std::vector<float>(6, 1.f));
}

// Below MatmulPrecision::highest (Note [matmul precision]) the device accumulates in fp32 products of operands
// rounded to nearest: on bf16 copies ("medium" where medium_gemm_uses_bf16 says so) the result is the CPU's fp32
// GEMM of the bf16-rounded operands (products of rounded values are exact in fp32; only the order of the sums
// differs) and not the fp32 GEMM of the unrounded ones. Elsewhere cuBLAS's FAST_TF32 only allows TF32: on an H200
// it ran TF32 for some shapes and full fp32 for others (600 x 520 x 131), so the result is either the GEMM of the
// TF32-rounded operands or the fp32 one. The CPU GEMM ignores the setting. Odd sizes and leading dimensions, and
// attention's strided heads inside the qkv rows, check the bf16 copies' packing (Note [bf16 operand copies] in
// gemm.cu).
double MaxDiff(const std::vector<float>& x, const std::vector<float>& y) {
  double d = 0;
  for (std::size_t i = 0; i < x.size(); ++i) d = std::max(d, std::abs(static_cast<double>(x[i]) - y[i]));
  return d;
}

// How the device may round a GEMM's operands at `p`: bf16, or TF32 (f16's 10-bit mantissa; the values here are
// far from f16's range limits).
DType RoundingOf(MatmulPrecision p, std::int64_t m, std::int64_t n) {
  return p == MatmulPrecision::medium && medium_gemm_uses_bf16(m, n) ? DType::bf16 : DType::f16;
}

Tensor Rounded(const Tensor& x, DType narrow) { return x.to(narrow).to(DType::f32); }

// The device's result `got` against the GEMM of operands rounded as RoundingOf says (`want`) and the fp32 one
// (`exact`): bf16 copies must give `want` and differ from `exact`; TF32 may give either.
void ExpectRoundedProduct(DType narrow, const std::vector<float>& got, const std::vector<float>& want,
                          const std::vector<float>& exact) {
  // fp32 sums of k exact products, in two orders: about sqrt(k) 2^-24 apart; rounding the operands moves a result
  // by about sqrt(k) 2^-9 (bf16) or 2^-11 (TF32), far more.
  const double from_want = MaxDiff(got, want), from_exact = MaxDiff(got, exact);
  if (narrow == DType::bf16) {
    EXPECT_LT(from_want, 1e-4) << "largest difference from the GEMM of bf16-rounded operands";
    EXPECT_GT(from_exact, 1e-3) << "the operands were not rounded to bf16";
  } else {
    EXPECT_LT(std::min(from_want, from_exact), 1e-4)
        << "neither the GEMM of TF32-rounded operands (" << from_want << " off) nor the fp32 one (" << from_exact
        << " off)";
  }
}

TEST(CudaKernelsTest, MatmulAtReducedPrecisionMultipliesRoundedOperands) {
  SK_REQUIRE_CUDA_DEVICE("CUDA kernels");
  ASSERT_TRUE(medium_gemm_uses_bf16(600, 523));
  ASSERT_FALSE(medium_gemm_uses_bf16(96, 77));
  Generator gen(11);
  // 523: C's rows are not 16-byte aligned (the bf16 path stages C: Note [padded bf16 copies]).
  for (const auto& [m, n] : {std::pair<std::int64_t, std::int64_t>{600, 523}, {96, 77}}) {
    const std::int64_t k = 131;
    const Tensor a = Tensor::uniform({m, k}, gen, -1, 1), b = Tensor::uniform({k, n}, gen, -1, 1);
    Tensor exact = Tensor::zeros({m, n});
    matmul(a, b, exact);
    const Tensor ga = ToGpu(a), gb = ToGpu(b);
    for (MatmulPrecision p : {MatmulPrecision::high, MatmulPrecision::medium}) {
      SCOPED_TRACE(::testing::Message() << matmul_precision_name(p) << " m=" << m << " n=" << n);
      const DType narrow = RoundingOf(p, m, n);
      Tensor want = Tensor::zeros({m, n});
      matmul(Rounded(a, narrow), Rounded(b, narrow), want);
      RankContext ctx;
      ctx.matmul_precision = p;
      RankContextScope scope(ctx);
      Tensor cpu = Tensor::zeros({m, n});
      matmul(a, b, cpu);
      EXPECT_EQ(cpu.to_vector(), exact.to_vector()) << "the CPU GEMM is always fp32";
      const Tensor gc = Tensor::empty({m, n}, OnGpu(DType::f32));
      matmul(ga, gb, gc);
      const std::vector<float> once = ToCpu(gc, DType::f32).to_vector();
      ExpectRoundedProduct(narrow, once, want.to_vector(), exact.to_vector());
      // Accumulating (beta = 1, C copied into the staging buffer first): what it added is the product. (Compared
      // as a difference: for TF32 cuBLAS may pick another kind of kernel for the second call.)
      matmul(ga, gb, gc, false, false, 1.f);
      std::vector<float> added = ToCpu(gc, DType::f32).to_vector();
      for (std::size_t i = 0; i < added.size(); ++i) added[i] -= once[i];
      ExpectRoundedProduct(narrow, added, want.to_vector(), exact.to_vector());
    }
  }
  // The bf16 path with transposed operands (A stored k x m, B stored n x k).
  for (const auto& [ta, tb] : {std::pair<bool, bool>{false, true}, {true, false}, {true, true}}) {
    SCOPED_TRACE(::testing::Message() << "medium ta=" << ta << " tb=" << tb);
    const std::int64_t m = 600, n = 523, k = 131;
    const Tensor a = Tensor::uniform(ta ? Shape{k, m} : Shape{m, k}, gen, -1, 1);
    const Tensor b = Tensor::uniform(tb ? Shape{n, k} : Shape{k, n}, gen, -1, 1);
    Tensor exact = Tensor::zeros({m, n}), want = Tensor::zeros({m, n});
    matmul(a, b, exact, ta, tb);
    matmul(Rounded(a, DType::bf16), Rounded(b, DType::bf16), want, ta, tb);
    RankContext ctx;
    ctx.matmul_precision = MatmulPrecision::medium;
    RankContextScope scope(ctx);
    const Tensor gc = Tensor::empty({m, n}, OnGpu(DType::f32));
    matmul(ToGpu(a), ToGpu(b), gc, ta, tb);
    ExpectRoundedProduct(DType::bf16, ToCpu(gc, DType::f32).to_vector(), want.to_vector(), exact.to_vector());
  }
  // Attention's product S_h = Q_h K_h^T, batched over `heads` heads of width hs inside qkv rows [t, 3c], hs apart;
  // t = 522: C's rows are not 16-byte aligned (staged, batch by batch).
  const std::int64_t t = 522, hs = 24, heads = 2, c = heads * hs;
  const Tensor qkv = Tensor::uniform({t, 3 * c}, gen, -1, 1);
  const Tensor gqkv = ToGpu(qkv);
  auto heads_product = [&](const Tensor& x) {  // on the CPU
    Tensor s = Tensor::zeros({heads, t, t});
    for (std::int64_t h = 0; h < heads; ++h) {
      gemm(false, true, t, t, hs, 1.f, x.data<float>() + h * hs, 3 * c, x.data<float>() + c + h * hs, 3 * c, 0.f,
           s.data<float>() + h * t * t, t);
    }
    return s.to_vector();
  };
  const std::vector<float> exact_s = heads_product(qkv);
  for (MatmulPrecision p : {MatmulPrecision::high, MatmulPrecision::medium}) {
    SCOPED_TRACE(::testing::Message() << matmul_precision_name(p) << " batched heads");
    const DType narrow = RoundingOf(p, t, t);
    const Tensor gs = Tensor::empty({heads, t, t}, OnGpu(DType::f32));
    cuda::gemm_strided_batched(kGpu, false, true, t, t, hs, 1.f, gqkv.data<float>(), 3 * c, hs,
                               gqkv.data<float>() + c, 3 * c, hs, 0.f, gs.data<float>(), t, t * t, heads, p);
    ExpectRoundedProduct(narrow, ToCpu(gs, DType::f32).to_vector(), heads_product(Rounded(qkv, narrow)), exact_s);
  }
}

// A product on copies made by pack_bf16 (Note [bf16 copies kept across a linear's GEMMs] in
// common/autograd/ops/linalg.cc) gives the bits gemm gives at medium, which makes the same copies itself: every
// transpose, C staged (n = 523) or not, beta 0 and 1, a source with a leading dimension wider than its rows. A
// product that would not run on copies is refused where the call is made.
TEST(CudaKernelsTest, GemmOnBf16CopiesGivesGemmsBitsAtMedium) {
  SK_REQUIRE_CUDA_DEVICE("CUDA kernels");
  Generator gen(12);
  // The packed copy of the rows x cols matrix at x's start, its rows `ld` apart.
  auto packed = [](const Tensor& x, std::int64_t rows, std::int64_t cols, std::int64_t ld) {
    Tensor copy = Tensor::empty({cuda::round_up_to_pad(rows), cuda::round_up_to_pad(cols)}, OnGpu(DType::bf16));
    cuda::pack_bf16(kGpu, x.data<float>(), rows, cols, ld, copy.raw_data());
    return copy;
  };
  for (const auto& [m, n, k] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{600, 523, 131},
                                {520, 768, 300}, {1030, 520, 77}}) {
    ASSERT_TRUE(cuda::medium_gemm_runs_on_bf16_copies(m, n, k));
    for (const auto& [ta, tb] : {std::pair<bool, bool>{false, false}, {false, true}, {true, false}, {true, true}}) {
      for (const float beta : {0.f, 1.f}) {
        SCOPED_TRACE(::testing::Message() << "m=" << m << " n=" << n << " k=" << k << " ta=" << ta << " tb=" << tb
                                          << " beta=" << beta);
        const std::int64_t a_rows = ta ? k : m, a_cols = ta ? m : k, b_rows = tb ? n : k, b_cols = tb ? k : n;
        const Tensor a = ToGpu(Tensor::uniform({a_rows, a_cols + 3}, gen, -1, 1));  // ld = cols + 3
        const Tensor b = ToGpu(Tensor::uniform({b_rows, b_cols}, gen, -1, 1));
        const Tensor c0 = Tensor::uniform({m, n}, gen, -1, 1);
        const Tensor want = ToGpu(c0), got = ToGpu(c0);
        cuda::gemm(kGpu, ta, tb, m, n, k, 0.75f, a.data<float>(), a_cols + 3, b.data<float>(), b_cols, beta,
                   want.data<float>(), n, MatmulPrecision::medium);
        const Tensor a16 = packed(a, a_rows, a_cols, a_cols + 3), b16 = packed(b, b_rows, b_cols, b_cols);
        cuda::gemm_on_bf16_copies(kGpu, ta, tb, m, n, k, 0.75f, a16.raw_data(), b16.raw_data(), beta,
                                  got.data<float>(), n);
        const std::vector<float> w = ToCpu(want, DType::f32).to_vector(), g = ToCpu(got, DType::f32).to_vector();
        ASSERT_EQ(g.size(), w.size());
        for (std::size_t i = 0; i < w.size(); ++i) {
          ASSERT_EQ(std::bit_cast<std::uint32_t>(g[i]), std::bit_cast<std::uint32_t>(w[i])) << i;
        }
      }
    }
  }
  const Tensor x = Tensor::empty({8, 128}, OnGpu(DType::bf16));
  const Tensor c = Tensor::empty({96, 77}, OnGpu(DType::f32));
  ASSERT_FALSE(cuda::medium_gemm_runs_on_bf16_copies(96, 77, 64));
  try {
    cuda::gemm_on_bf16_copies(kGpu, false, false, 96, 77, 64, 1.f, x.raw_data(), x.raw_data(), 0.f, c.data<float>(),
                              77);
    ADD_FAILURE() << "a product that does not run on bf16 copies was accepted";
  } catch (const InternalError& e) {
    EXPECT_NE(std::string(e.what()).find("not a product that runs on bf16 copies"), std::string::npos) << e.what();
  }
}

// The causal softmax and its backward (attention's) against a double-precision CPU reference, at every row length
// class of the device kernels: rows held in registers with 4, 8, 16 and 32 columns a lane, and the streaming
// kernels past 1024 (Note [softmax rows in registers] in nn_ops.cu).
TEST(CudaKernelsTest, CausalSoftmaxMatchesCpuForEveryRowLength) {
  SK_REQUIRE_CUDA_DEVICE("CUDA kernels");
  const std::int64_t matrices = 2;
  for (const std::int64_t t : {1, 37, 128, 129, 300, 600, 1024, 1025}) {
    SCOPED_TRACE(::testing::Message() << "t=" << t);
    const std::int64_t n = matrices * t * t;
    const std::vector<float> scores = RandomFloats(n, 5, -3.f, 3.f), dp = RandomFloats(n, 6, -1.f, 1.f);
    std::vector<double> p(static_cast<std::size_t>(n)), ds(static_cast<std::size_t>(n));
    for (std::int64_t r = 0; r < matrices * t; ++r) {  // row i of a matrix keeps columns 0..i
      const std::int64_t i = r % t;
      const std::size_t base = static_cast<std::size_t>(r * t);
      double mx = -INFINITY, sum = 0, dot = 0;
      for (std::int64_t j = 0; j <= i; ++j) mx = std::max(mx, static_cast<double>(scores[base + j]));
      for (std::int64_t j = 0; j <= i; ++j) sum += std::exp(scores[base + j] - mx);
      for (std::int64_t j = 0; j <= i; ++j) {
        p[base + j] = std::exp(scores[base + j] - mx) / sum;
        dot += p[base + j] * dp[base + j];
      }
      for (std::int64_t j = 0; j <= i; ++j) ds[base + j] = p[base + j] * (dp[base + j] - dot);
    }
    const Tensor gs = ToGpu(Tensor::from_vector(scores, {n}));
    cuda::causal_softmax(kGpu, gs.data<float>(), matrices, t, nullptr);
    const Tensor gd = ToGpu(Tensor::from_vector(dp, {n}));
    cuda::causal_softmax_backward(kGpu, gs.data<float>(), gd.data<float>(), matrices, t, nullptr);
    const std::vector<float> got_p = ToCpu(gs, DType::f32).to_vector(), got_ds = ToCpu(gd, DType::f32).to_vector();
    for (std::size_t e = 0; e < got_p.size(); ++e) {
      ASSERT_NEAR(got_p[e], p[e], 1e-6 + 1e-5 * p[e]) << "P element " << e;
      ASSERT_NEAR(got_ds[e], ds[e], 1e-6 + 1e-4 * std::abs(ds[e])) << "dS element " << e;
      if (p[e] == 0) {  // above the diagonal: exactly zero
        ASSERT_EQ(got_p[e], 0.f) << e;
        ASSERT_EQ(got_ds[e], 0.f) << e;
      }
    }
  }
}

// The packed bf16 copy the softmax and its backward write where asked (Note [softmax writes the bf16 copy] in
// common/autograd/ops/attention.cc) is, bit for bit, pack_bf16 of the fp32 result they write, padding included
// (the copy starts out as garbage, not zeros); the fp32 result is the same as without the copy. Rows of 8 and 64
// (no padding), 13 (padding rows and columns), and the register (300) and streaming (1025) kernels' lengths.
TEST(CudaKernelsTest, CausalSoftmaxWritesPackBf16OfItsResult) {
  SK_REQUIRE_CUDA_DEVICE("CUDA kernels");
  const std::int64_t matrices = 3;
  for (const std::int64_t t : {8, 13, 64, 300, 1025}) {
    SCOPED_TRACE(::testing::Message() << "t=" << t);
    const std::int64_t n = matrices * t * t, copy_numel = cuda::packed_bf16_numel(t, t);
    const Tensor s = Tensor::from_vector(RandomFloats(n, 7, -3.f, 3.f), {n});
    const Tensor dp = Tensor::from_vector(RandomFloats(n, 8, -1.f, 1.f), {n});
    const Tensor garbage = Tensor::full({matrices * copy_numel}, 7.0, TensorOptions{}.with_dtype(DType::bf16));
    // The results and copies written by the kernels, and the same results written without copies.
    const Tensor gp = ToGpu(s), gp_plain = ToGpu(s), p16 = ToGpu(garbage);
    cuda::causal_softmax(kGpu, gp.data<float>(), matrices, t, p16.raw_data());
    cuda::causal_softmax(kGpu, gp_plain.data<float>(), matrices, t, nullptr);
    const Tensor gds = ToGpu(dp), gds_plain = ToGpu(dp), ds16 = ToGpu(garbage);
    cuda::causal_softmax_backward(kGpu, gp.data<float>(), gds.data<float>(), matrices, t, ds16.raw_data());
    cuda::causal_softmax_backward(kGpu, gp.data<float>(), gds_plain.data<float>(), matrices, t, nullptr);
    const auto expect_copy_of = [&](const Tensor& result, const Tensor& plain, const Tensor& copy, const char* what) {
      SCOPED_TRACE(what);
      const std::vector<float> r = ToCpu(result, DType::f32).to_vector(), q = ToCpu(plain, DType::f32).to_vector();
      for (std::size_t e = 0; e < r.size(); ++e) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(r[e]), std::bit_cast<std::uint32_t>(q[e])) << e;
      }
      const Tensor want = ToGpu(garbage);
      for (std::int64_t m = 0; m < matrices; ++m) {
        cuda::pack_bf16(kGpu, result.data<float>() + m * t * t, t, t, t, want.data<bf16_t>() + m * copy_numel);
      }
      const Tensor w = ToCpu(want, DType::bf16), g = ToCpu(copy, DType::bf16);
      for (std::int64_t e = 0; e < matrices * copy_numel; ++e) {
        ASSERT_EQ(g.data<bf16_t>()[e].bits, w.data<bf16_t>()[e].bits)
            << "element " << e << ": matrix " << e / copy_numel << ", row " << e % copy_numel / cuda::round_up_to_pad(t)
            << ", column " << e % cuda::round_up_to_pad(t);
      }
    };
    expect_copy_of(gp, gp_plain, p16, "P");
    expect_copy_of(gds, gds_plain, ds16, "dS");
  }
}

// gemm_strided_batched_on_bf16_a with A given as its packed copies: where gemm_strided_batched at medium runs on
// copies itself (t = 520, hs = 520), the same bits; where it does not (attention's head-wide products, t = 37 or 70,
// hs = 16 or 64), the product of the bf16-rounded operands to fp32 accuracy. A as attention's P or dS (t x t
// matrices one after another, either transpose), B and C as its heads (strided inside wider rows), beta 0 and 1.
TEST(CudaKernelsTest, GemmOnBf16AMultipliesTheCopies) {
  SK_REQUIRE_CUDA_DEVICE("CUDA kernels");
  Generator gen(13);
  const std::int64_t heads = 3;
  for (const auto& [t, hs] : {std::pair<std::int64_t, std::int64_t>{520, 520}, {37, 16}, {70, 64}}) {
    for (const bool ta : {false, true}) {
      for (const float beta : {0.f, 1.f}) {
        SCOPED_TRACE(::testing::Message() << "t=" << t << " hs=" << hs << " ta=" << ta << " beta=" << beta);
        const std::int64_t width = heads * hs + 5, copy_numel = cuda::packed_bf16_numel(t, t);
        const Tensor a = ToGpu(Tensor::uniform({heads, t, t}, gen, -1, 1));
        const Tensor b = ToGpu(Tensor::uniform({t, width}, gen, -1, 1));
        const Tensor c0 = Tensor::uniform({t, width}, gen, -1, 1);
        const Tensor a16 = Tensor::empty({heads * copy_numel}, OnGpu(DType::bf16));
        for (std::int64_t h = 0; h < heads; ++h) {
          cuda::pack_bf16(kGpu, a.data<float>() + h * t * t, t, t, t, a16.data<bf16_t>() + h * copy_numel);
        }
        const Tensor got = ToGpu(c0);
        cuda::gemm_strided_batched_on_bf16_a(kGpu, ta, false, t, hs, t, 0.75f, a16.raw_data(), b.data<float>(),
                                             width, hs, beta, got.data<float>(), width, hs, heads);
        const std::vector<float> g = ToCpu(got, DType::f32).to_vector(), before = c0.to_vector();
        if (cuda::medium_gemm_runs_on_bf16_copies(t, hs, t)) {
          const Tensor want = ToGpu(c0);
          cuda::gemm_strided_batched(kGpu, ta, false, t, hs, t, 0.75f, a.data<float>(), t, t * t, b.data<float>(),
                                     width, hs, beta, want.data<float>(), width, hs, heads, MatmulPrecision::medium);
          const std::vector<float> w = ToCpu(want, DType::f32).to_vector();
          for (std::size_t i = 0; i < w.size(); ++i) {
            ASSERT_EQ(std::bit_cast<std::uint32_t>(g[i]), std::bit_cast<std::uint32_t>(w[i])) << i;
          }
          continue;
        }
        // The reference: double sums of the bf16-rounded operands; columns outside the heads untouched.
        const std::vector<float> av = ToCpu(a, DType::f32).to_vector(), bv = ToCpu(b, DType::f32).to_vector();
        const auto r16 = [](float x) { return static_cast<double>(bf16_to_f32(f32_to_bf16(x))); };
        for (std::int64_t i = 0; i < t; ++i) {
          for (std::int64_t j = 0; j < width; ++j) {
            const std::size_t e = static_cast<std::size_t>(i * width + j);
            const std::int64_t h = j / hs;
            if (h >= heads) {
              ASSERT_EQ(g[e], before[e]) << "column " << j << " outside the heads";
              continue;
            }
            double want = beta * before[e];
            for (std::int64_t l = 0; l < t; ++l) {
              const float x = av[static_cast<std::size_t>(h * t * t + (ta ? l * t + i : i * t + l))];
              want += 0.75 * r16(x) * r16(bv[static_cast<std::size_t>(l * width + j)]);
            }
            ASSERT_NEAR(g[e], want, 1e-5 * (1 + std::abs(want)) + 1e-6 * t) << "row " << i << " column " << j;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace shardkit::kernels
