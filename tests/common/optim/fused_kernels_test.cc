// The fused kernels' bf16/f16 parameter output (Note [rounding lag] in common/optim/fused_kernels.cc):
// the vectorised rounding loops against plain scalar conversions over every class of input, and whole
// AdamW / SGD steps with a bf16 or f16 parameter against a scalar reference, bitwise.
#include <bit>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#include "common/optim/fused_kernels.h"
#include "common/tensor/dtype.h"
#include "common/tensor/random.h"
#include "gtest/gtest.h"
#include "rounding_reference.h"

namespace shardkit::optim::testing {
namespace {

// Bit patterns covering every class of fp32 input to a 16-bit rounding: every value of the upper half
// (each sign, exponent - zero/subnormal, normal, inf/NaN - and top mantissa bits) with lower halves that
// make exact values, ties, and the neighbours of ties, plus a strided sweep over all 2^32 patterns.
std::vector<std::uint32_t> RoundingInputs() {
  std::vector<std::uint32_t> bits;
  const std::uint32_t lows[] = {0x0000u, 0x0001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu, 0x1234u, 0xc001u};
  for (std::uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (std::uint32_t lo : lows) bits.push_back(hi << 16 | lo);
  }
  for (std::uint64_t x = 0; x < (std::uint64_t{1} << 32); x += 4093) bits.push_back(static_cast<std::uint32_t>(x));
  // f16 boundaries: smallest normal, subnormal ties, the overflow threshold 65520.
  for (std::uint32_t c : {0x38800000u, 0x33000000u, 0x477ff000u, 0x477fe000u}) {
    for (std::uint32_t d = 0; d < 16; ++d) bits.push_back(c + d - 8), bits.push_back((c + d - 8) | 0x80000000u);
  }
  return bits;
}

std::vector<float> AsFloats(const std::vector<std::uint32_t>& bits) {
  std::vector<float> f(bits.size());
  for (std::size_t i = 0; i < bits.size(); ++i) f[i] = std::bit_cast<float>(bits[i]);
  return f;
}

// Runs pass(src + i, dst + i, len) over [0, n) in chunks of 1, 2, ..., 40 elements and then one long
// chunk, so the vector body, the tails and every start alignment are exercised.
template <typename Pass, typename D>
void RunInChunks(Pass pass, const std::vector<float>& src, std::vector<D>& dst) {
  const std::int64_t n = static_cast<std::int64_t>(src.size());
  std::int64_t i = 0;
  for (std::int64_t len = 1; i + len <= n / 2; len = len % 40 + 1) {
    pass(src.data() + i, dst.data() + i, len);
    i += len;
  }
  pass(src.data() + i, dst.data() + i, n - i);
}

TEST(FusedRoundingTest, Bf16PassMatchesScalarReferenceOnEveryClassOfInput) {
  const std::vector<std::uint32_t> bits = RoundingInputs();
  const std::vector<float> src = AsFloats(bits);
  std::vector<bf16_t> dst(src.size(), bf16_t{0xdeadu});
  RunInChunks(fused::round_to_bf16, src, dst);
  for (std::size_t i = 0; i < bits.size(); ++i) {
    ASSERT_EQ(dst[i].bits, RefBf16Bits(bits[i])) << "input bits " << std::hex << bits[i];
    ASSERT_EQ(dst[i].bits, f32_to_bf16(src[i]).bits) << "input bits " << std::hex << bits[i];  // the library's
  }
}

TEST(FusedRoundingTest, Bf16PassSpecialValues) {
  struct Case {
    std::uint32_t in;
    std::uint16_t out;
  };
  const Case cases[] = {
      {0x3f808000u, 0x3f80u},  // 1 + 2^-8: a tie, stays on the even 1.0
      {0x3f818000u, 0x3f82u},  // a tie above an odd value rounds up to even
      {0x3f808001u, 0x3f81u},  // just past the tie
      {0x7f7fffffu, 0x7f80u},  // max finite rounds to infinity
      {0x7f7f7fffu, 0x7f7fu},  // below the tie under max finite stays finite
      {0xff800000u, 0xff80u},  // -inf
      {0x7f800001u, 0x7fc0u},  // NaN with its payload in the dropped bits stays NaN (quiet)
      {0xffa00000u, 0xffe0u},  // signalling NaN: sign and payload kept, quiet bit set
      {0x7fffffffu, 0x7fffu},  // a NaN must not carry into the sign
      {0x80000000u, 0x8000u},  // -0
      {0x00008000u, 0x0000u},  // subnormal tie to even (0)
      {0x00018000u, 0x0002u},  // subnormal tie to even (2)
      {0x007fffffu, 0x0080u},  // largest subnormal rounds up to the smallest normal
  };
  std::vector<float> src;
  for (const Case& c : cases) src.push_back(std::bit_cast<float>(c.in));
  std::vector<bf16_t> dst(src.size());
  fused::round_to_bf16(src.data(), dst.data(), static_cast<std::int64_t>(src.size()));
  for (std::size_t i = 0; i < src.size(); ++i) EXPECT_EQ(dst[i].bits, cases[i].out) << std::hex << cases[i].in;
}

TEST(FusedRoundingTest, F16PassMatchesScalarConversionOnEveryClassOfInput) {
  const std::vector<std::uint32_t> bits = RoundingInputs();
  const std::vector<float> src = AsFloats(bits);
  std::vector<f16_t> dst(src.size(), f16_t{0xdeadu});
  RunInChunks(fused::round_to_f16, src, dst);
  for (std::size_t i = 0; i < bits.size(); ++i) {
    ASSERT_EQ(dst[i].bits, f32_to_f16(src[i]).bits) << "input bits " << std::hex << bits[i];
  }
}

// ---- whole steps --------------------------------------------------------------------------------------

// The scalar references below are the kernels' formulas (fused_kernels.h) written once more, one
// element at a time, in the same fp32 operations and order; the same compiler and flags make the same
// roundings (and the same fused multiply-adds), so results must agree bit for bit.
struct Arrays {
  std::vector<float> w, m, v, g;  // g: the gradient, widened to fp32 (exact for bf16/f16)
};

void RefAdamStep(Arrays& a, const fused::AdamCoeffs& c) {
  for (std::size_t i = 0; i < a.w.size(); ++i) {
    float wi = a.w[i];
    const float gi = c.sign * a.g[i] + c.l2 * wi;
    wi *= c.decay;
    const float mi = c.beta1 * a.m[i] + c.one_minus_beta1 * gi;
    const float vi = c.beta2 * a.v[i] + c.one_minus_beta2 * (gi * gi);
    const float denom = std::sqrt(vi) * c.inv_sqrt_bc2 + c.eps;
    wi -= c.step_size * (mi / denom);
    a.m[i] = mi;
    a.v[i] = vi;
    a.w[i] = wi;
  }
}

void RefSgdStep(Arrays& a, const fused::SgdCoeffs& c) {
  for (std::size_t i = 0; i < a.w.size(); ++i) {
    float wi = a.w[i];
    float gi = c.sign * a.g[i] + c.weight_decay * wi;
    if (c.has_momentum) {
      const float bi = c.keep * a.m[i] + c.take * gi;
      a.m[i] = bi;
      gi = c.nesterov ? gi + c.momentum * bi : bi;
    }
    wi -= c.lr * gi;
    a.w[i] = wi;
  }
}

// Sizes below one vector, around the kernels' 64-element rounding lag (Note [rounding lag]), around the
// first size the Adam loop runs in prefetching blocks (32-element blocks, 256 ahead, Note [software
// prefetch]: 288 elements, or 64 + 288 behind the lag), and larger.
const std::int64_t kSizes[] = {1,   15,  16,  17,  63,  64,  65,  127, 128,  129,
                               287, 288, 289, 321, 351, 352, 353, 385, 1000, 4096 + 77};

// Master weights in [-1, 1) with, every 97 elements, one of the values whose rounding is delicate.
Arrays MakeArrays(std::int64_t n, std::uint64_t seed) {
  Arrays a;
  const std::size_t un = static_cast<std::size_t>(n);
  a.w.resize(un);
  a.m.resize(un);
  a.v.resize(un);
  a.g.resize(un);
  Generator gen(seed);
  gen.fill_uniform(a.w.data(), n, -1.f, 1.f);
  gen.fill_uniform(a.m.data(), n, -0.1f, 0.1f);
  gen.fill_uniform(a.v.data(), n, 0.f, 0.01f);
  gen.fill_normal(a.g.data(), n);
  const std::uint32_t specials[] = {0x3f808000u, 0x3f818000u, 0x7f7fffffu, 0x80000000u, 0x00018000u,
                                    0x7fc01234u, 0xffc00001u, 0x38800000u, 0x477ff000u, 0xbf7fffffu};
  for (std::size_t i = 0, k = 0; i < un; i += 97, ++k) a.w[i] = std::bit_cast<float>(specials[k % 10]);
  return a;
}

template <typename T>
std::vector<T> Narrowed(const std::vector<float>& x) {
  std::vector<T> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    if constexpr (std::is_same_v<T, bf16_t>) out[i] = f32_to_bf16(x[i]);
    else out[i] = f32_to_f16(x[i]);
  }
  return out;
}

std::vector<float> Widened(const std::vector<bf16_t>& x) {
  std::vector<float> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = bf16_to_f32(x[i]);
  return out;
}

void ExpectSameBits(const std::vector<float>& got, const std::vector<float>& want, const char* what) {
  ASSERT_EQ(got.size(), want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(std::bit_cast<std::uint32_t>(got[i]), std::bit_cast<std::uint32_t>(want[i]))
        << what << "[" << i << "]: " << got[i] << " vs reference " << want[i];
  }
}

// The bf16 parameter is exactly the new master rounded to nearest even (plain scalar rounding).
void ExpectRoundedMaster(const std::vector<bf16_t>& p, const std::vector<float>& master) {
  ASSERT_EQ(p.size(), master.size());
  for (std::size_t i = 0; i < p.size(); ++i) {
    ASSERT_EQ(p[i].bits, RefBf16Bits(std::bit_cast<std::uint32_t>(master[i])))
        << "param[" << i << "], master bits " << std::hex << std::bit_cast<std::uint32_t>(master[i]);
  }
}

TEST(FusedStepTest, AdamWBf16MasterStepEqualsScalarReferenceBitwise) {
  for (std::int64_t n : kSizes) {
    for (double lr : {1e-2, 0.0}) {  // lr = 0 carries the special weights unchanged into the rounding
      for (DType grad_dtype : {DType::bf16, DType::f32}) {
        SCOPED_TRACE("n = " + std::to_string(n) + ", lr = " + std::to_string(lr) + ", grad " +
                     std::string(dtype_name(grad_dtype)));
        Arrays a = MakeArrays(n, static_cast<std::uint64_t>(n));
        const std::vector<bf16_t> g16 = Narrowed<bf16_t>(a.g);
        if (grad_dtype == DType::bf16) a.g = Widened(g16);
        HyperParams h;
        h.lr = lr;
        h.weight_decay = 0.1;
        const fused::AdamCoeffs c = fused::adam_coeffs(h, 3, /*decoupled=*/true);
        Arrays k = a;  // the kernel's copy
        std::vector<bf16_t> p(static_cast<std::size_t>(n), bf16_t{0xdeadu});
        const void* grad = grad_dtype == DType::bf16 ? static_cast<const void*>(g16.data()) : a.g.data();
        fused::adam_step(k.w.data(), p.data(), DType::bf16, grad, grad_dtype, k.m.data(), k.v.data(), n, c);
        RefAdamStep(a, c);
        ExpectSameBits(k.w, a.w, "master");
        ExpectSameBits(k.m, a.m, "exp_avg");
        ExpectSameBits(k.v, a.v, "exp_avg_sq");
        ExpectRoundedMaster(p, a.w);
      }
    }
  }
}

TEST(FusedStepTest, SgdBf16MasterStepEqualsScalarReferenceBitwise) {
  struct Variant {
    const char* name;
    double momentum;
    bool nesterov;
    bool first;
  };
  for (const Variant& var : {Variant{"plain", 0.0, false, false}, Variant{"momentum first step", 0.9, false, true},
                             Variant{"momentum", 0.9, false, false}, Variant{"nesterov", 0.9, true, false}}) {
    for (std::int64_t n : kSizes) {
      SCOPED_TRACE(std::string(var.name) + ", n = " + std::to_string(n));
      Arrays a = MakeArrays(n, static_cast<std::uint64_t>(n) + 7);
      const std::vector<bf16_t> g16 = Narrowed<bf16_t>(a.g);
      a.g = Widened(g16);
      HyperParams h;
      h.lr = 1e-2;
      h.weight_decay = 0.01;
      h.momentum = var.momentum;
      h.nesterov = var.nesterov;
      const fused::SgdCoeffs c = fused::sgd_coeffs(h, var.first);
      Arrays k = a;
      std::vector<bf16_t> p(static_cast<std::size_t>(n), bf16_t{0xdeadu});
      fused::sgd_step(k.w.data(), p.data(), DType::bf16, g16.data(), DType::bf16, c.has_momentum ? k.m.data() : nullptr,
                      n, c);
      RefSgdStep(a, c);
      ExpectSameBits(k.w, a.w, "master");
      if (c.has_momentum) ExpectSameBits(k.m, a.m, "momentum_buffer");
      ExpectRoundedMaster(p, a.w);
    }
  }
}

// An fp32 parameter (no rounded copy): the update loop alone, for each gradient dtype.
TEST(FusedStepTest, AdamFp32StepEqualsScalarReferenceBitwise) {
  for (std::int64_t n : kSizes) {
    for (bool decoupled : {true, false}) {
      for (DType grad_dtype : {DType::f32, DType::bf16, DType::f16}) {
        SCOPED_TRACE("n = " + std::to_string(n) + (decoupled ? ", AdamW" : ", Adam") + ", grad " +
                     std::string(dtype_name(grad_dtype)));
        Arrays a = MakeArrays(n, static_cast<std::uint64_t>(n) + 13);
        const std::vector<bf16_t> g_bf16 = Narrowed<bf16_t>(a.g);
        const std::vector<f16_t> g_f16 = Narrowed<f16_t>(a.g);
        const void* grad = a.g.data();
        if (grad_dtype == DType::bf16) {
          a.g = Widened(g_bf16);
          grad = g_bf16.data();
        } else if (grad_dtype == DType::f16) {
          for (std::size_t i = 0; i < a.g.size(); ++i) a.g[i] = f16_to_f32(g_f16[i]);
          grad = g_f16.data();
        }
        HyperParams h;
        h.lr = 1e-2;
        h.weight_decay = 0.1;
        h.maximize = !decoupled;  // the sign too
        const fused::AdamCoeffs c = fused::adam_coeffs(h, 4, decoupled);
        Arrays k = a;
        fused::adam_step(k.w.data(), nullptr, DType::f32, grad, grad_dtype, k.m.data(), k.v.data(), n, c);
        RefAdamStep(a, c);
        ExpectSameBits(k.w, a.w, "param");
        ExpectSameBits(k.m, a.m, "exp_avg");
        ExpectSameBits(k.v, a.v, "exp_avg_sq");
      }
    }
  }
}

// An f16 parameter is written the same way: the master is the fp32-parameter step's, the parameter its
// f16 rounding.
TEST(FusedStepTest, AdamWF16MasterStepEqualsFp32StepAndItsRounding) {
  for (std::int64_t n : kSizes) {
    SCOPED_TRACE("n = " + std::to_string(n));
    Arrays a = MakeArrays(n, static_cast<std::uint64_t>(n) + 11);
    const std::vector<f16_t> g16 = Narrowed<f16_t>(a.g);
    HyperParams h;
    h.lr = 1e-2;
    h.weight_decay = 0.1;
    const fused::AdamCoeffs c = fused::adam_coeffs(h, 2, /*decoupled=*/true);
    Arrays k = a;
    std::vector<f16_t> p(static_cast<std::size_t>(n), f16_t{0xdeadu});
    fused::adam_step(k.w.data(), p.data(), DType::f16, g16.data(), DType::f16, k.m.data(), k.v.data(), n, c);
    fused::adam_step(a.w.data(), nullptr, DType::f32, g16.data(), DType::f16, a.m.data(), a.v.data(), n, c);
    ExpectSameBits(k.w, a.w, "master");
    ExpectSameBits(k.m, a.m, "exp_avg");
    ExpectSameBits(k.v, a.v, "exp_avg_sq");
    for (std::size_t i = 0; i < p.size(); ++i) ASSERT_EQ(p[i].bits, f32_to_f16(a.w[i]).bits) << "param[" << i << "]";
  }
}

}  // namespace
}  // namespace shardkit::optim::testing
