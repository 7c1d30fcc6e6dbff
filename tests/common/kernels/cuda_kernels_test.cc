// The CUDA kernels against the CPU kernels (themselves checked against double references in the other
// test files). Every test skips, with the reason, when no CUDA device is usable at run time.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <cmath>
#include <iostream>
#include <vector>

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

// Below MatmulPrecision::highest (Note [matmul precision]) the device multiplies operands rounded to TF32 / bf16
// and accumulates in fp32, and the result is not the fp32 GEMM of the unrounded operands; the batched GEMM too. The
// CPU GEMM ignores the setting. TF32 (seen on an H200): the CPU's fp32 GEMM of the operands rounded to nearest
// (products of rounded values are exact in fp32; only the order of the sums differs). bf16: cuBLAS does not say how
// it rounds, and on an H200 the result was up to 0.045 from the round-to-nearest reference here, so the check is
// the bound any bf16 rounding of the operands keeps: each product within 2^-7 of its value (truncation's bound).
TEST(CudaKernelsTest, MatmulAtReducedPrecisionMultipliesRoundedOperands) {
  SK_REQUIRE_CUDA_DEVICE("CUDA kernels");
  const std::int64_t m = 96, n = 80, k = 256;
  Generator gen(11);
  const Tensor a = Tensor::uniform({m, k}, gen, -1, 1), b = Tensor::uniform({k, n}, gen, -1, 1);
  Tensor exact = Tensor::zeros({m, n});
  matmul(a, b, exact);
  auto twice = [](const Tensor& t) {
    std::vector<float> v = t.to_vector();
    v.insert(v.end(), v.begin(), v.end());
    return ToGpu(Tensor::from_vector(v, {2 * t.size(0), t.size(1)}));
  };
  const Tensor ga2 = twice(a), gb2 = twice(b);
  for (MatmulPrecision p : {MatmulPrecision::high, MatmulPrecision::medium}) {
    SCOPED_TRACE(matmul_precision_name(p));
    // TF32 keeps 10 mantissa bits, as f16 does (the values here are far from f16's range limits).
    const DType rounding = p == MatmulPrecision::medium ? DType::bf16 : DType::f16;
    Tensor want = Tensor::zeros({m, n});
    matmul(a.to(rounding).to(DType::f32), b.to(rounding).to(DType::f32), want);
    RankContext ctx;
    ctx.matmul_precision = p;
    RankContextScope scope(ctx);
    Tensor cpu = Tensor::zeros({m, n});
    matmul(a, b, cpu);
    EXPECT_EQ(cpu.to_vector(), exact.to_vector()) << "the CPU GEMM is always fp32";
    const Tensor gc = Tensor::empty({m, n}, OnGpu(DType::f32));
    matmul(ToGpu(a), ToGpu(b), gc);
    // Batched: the same product twice through gemm_strided_batched.
    const Tensor gc2 = Tensor::empty({2 * m, n}, OnGpu(DType::f32));
    cuda::gemm_strided_batched(kGpu, false, false, m, n, k, 1.f, ga2.data<float>(), k, m * k, gb2.data<float>(), n,
                               k * n, 0.f, gc2.data<float>(), n, m * n, 2, p);
    const std::vector<float> got = ToCpu(gc, DType::f32).to_vector(), got2 = ToCpu(gc2, DType::f32).to_vector();
    const std::vector<float> w = want.to_vector(), x = exact.to_vector();
    // fp32 sums of k exact products, in two orders: about sqrt(k) 2^-24 apart; rounding the operands moves a
    // result by about sqrt(k) 2^-9 (bf16) or 2^-11 (TF32), far more.
    double off = 0, off_batched = 0, from_exact = 0;
    for (std::size_t i = 0; i < got.size(); ++i) {
      off = std::max(off, std::abs(static_cast<double>(got[i]) - w[i]));
      off_batched = std::max({off_batched, std::abs(static_cast<double>(got2[i]) - w[i]),
                              std::abs(static_cast<double>(got2[got.size() + i]) - w[i])});
      from_exact = std::max(from_exact, std::abs(static_cast<double>(got[i]) - x[i]));
    }
    EXPECT_GT(from_exact, 1e-3) << "the operands were not rounded";
    if (p == MatmulPrecision::high) {
      EXPECT_LT(off, 1e-4) << "largest difference from the GEMM of rounded operands";
      EXPECT_LT(off_batched, 1e-4) << "batched: largest difference from the GEMM of rounded operands";
      continue;
    }
    const std::vector<float> av = a.to_vector(), bv = b.to_vector();
    for (std::int64_t i = 0; i < m; ++i) {
      for (std::int64_t j = 0; j < n; ++j) {
        double bound = 0;  // 2^-7 sum_l |a_il b_lj|, and the fp32 sums' own error
        for (std::int64_t l = 0; l < k; ++l) bound += std::abs(static_cast<double>(av[i * k + l]) * bv[l * n + j]);
        bound = bound * 0x1p-7 + 1e-4;
        const std::size_t e = static_cast<std::size_t>(i * n + j);
        ASSERT_LE(std::abs(got[e] - x[e]), bound) << "element " << e << " (round-to-nearest reference " << w[e] << ")";
        ASSERT_LE(std::abs(got2[e] - x[e]), bound) << "batched, element " << e;
        ASSERT_LE(std::abs(got2[got.size() + e] - x[e]), bound) << "batched, second, element " << e;
      }
    }
    // What the rounding looks like, for the record: the GEMM of operands truncated to bf16.
    auto truncated = [](const Tensor& t) {
      std::vector<float> v = t.to_vector();
      for (float& f : v) f = std::bit_cast<float>(std::bit_cast<std::uint32_t>(f) & 0xffff0000u);
      return Tensor::from_vector(v, t.shape());
    };
    Tensor rz = Tensor::zeros({m, n});
    matmul(truncated(a), truncated(b), rz);
    double off_rz = 0;
    const std::vector<float> z = rz.to_vector();
    for (std::size_t i = 0; i < got.size(); ++i) off_rz = std::max(off_rz, std::abs(static_cast<double>(got[i]) - z[i]));
    std::cout << "[ info     ] medium: largest difference from the fp32 GEMM " << from_exact
              << ", from the GEMM of bf16 operands rounded to nearest " << off << ", truncated " << off_rz << "\n";
  }
}

}  // namespace
}  // namespace shardkit::kernels
