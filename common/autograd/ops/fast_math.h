// Vectorisable exp, tanh and normal CDF for the activation, softmax and loss loops (internal).
//
// Note [fast exp]: libm's expf/tanhf are calls the vectoriser cannot inline, which makes softmax and GELU
// scalar. fast_exp is Cephes' expf (range reduction by ln 2 split in two parts, degree-6 polynomial,
// exponent built with integer arithmetic) in plain arithmetic, so gcc vectorises loops that use it, given
// -fno-trapping-math (Note [no-trapping-math] in cmake/ShardkitHelpers.cmake: without it gcc 12 keeps the range
// clamp as a branch and every such loop scalar; check the vectoriser's report, -fopt-info-vec, after a change).
// Relative error about 2 ulp on [-87, 88] (checked against libm in ops tests); inputs are clamped to that range (exp(-87) ~ 1.6e-38,
// below which results are irrelevant for softmax and GELU).
#pragma once

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>

namespace shardkit::autograd::detail {

inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  // n = round(x / ln 2) by the 1.5 * 2^23 trick: |x / ln 2| < 2^22, so adding and subtracting the magic
  // constant rounds to an integer in plain arithmetic (floorf or a conditional clamp would keep gcc
  // from vectorising the loop).
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const std::int32_t e = (static_cast<std::int32_t>(n) + 127) << 23;
  return p * std::bit_cast<float>(e);
}

// tanh(x) = 1 - 2 / (exp(2x) + 1); absolute error ~1e-7.
inline float fast_tanh(float x) { return 1.0f - 2.0f / (fast_exp(2.0f * x) + 1.0f); }

// Phi(x) = P(N(0, 1) <= x) = erfc(-x / sqrt 2) / 2, the standard normal CDF (the exact GELU's), in two
// pieces, both computed and one selected:
//   |x| < sqrt 2:  Phi(x) = 1/2 + x A(x^2), A a degree-6 polynomial;
//   |x| >= sqrt 2: q = Phi(-|x|) = exp(-x^2 / 2) t G(t), t = 1 / (1 + 0.3 |x|), G a degree-8 polynomial;
//                  Phi(x) = q for x < 0 (the lower tail directly, no 1 - (1 - q) cancellation), 1 - q else.
// A and G are Chebyshev fits (mpmath chebyfit, 50 digits) to A(s) = (Phi(sqrt s) - 1/2) / sqrt s on [0, 2]
// and G(t) = Phi(-y) exp(y^2 / 2) / t, y = (1/t - 1) / 0.3, on [0, 1 / (1 + 0.3 sqrt 2)]; their fit errors
// are 1.5e-9 and 4e-8 relative. Measured against erfc in double: absolute error <= 6.6e-8 on [-13, 13] (about an
// ulp of 0.5), relative error <= 7e-7 on [-5, 0] and <= 4e-6 down to -12 (the rounding of x^2 in the
// exponent); checked in ops tests.
inline float fast_normal_cdf(float x) {
  const float s = x * x;
  float a = 4.350847394e-7f;
  a = a * s - 8.857467346e-6f;
  a = a * s + 1.146637158e-4f;
  a = a * s - 1.186799714e-3f;
  a = a * s + 9.973382924e-3f;
  a = a * s - 6.649035844e-2f;
  a = a * s + 3.9894228e-1f;
  const float centre = 0.5f + x * a;
  const float t = 1.0f / (1.0f + 0.3f * std::fabs(x));
  float g = 2.937349761e-2f;
  g = g * t - 8.386683771e-2f;
  g = g * t + 5.016385604e-2f;
  g = g * t + 6.742613448e-3f;
  g = g * t + 6.255153277e-2f;
  g = g * t + 8.676617824e-2f;
  g = g * t + 1.08951247e-1f;
  g = g * t + 1.196816481e-1f;
  g = g * t + 1.196826886e-1f;
  const float q = fast_exp(-0.5f * s) * t * g;
  const float tail = x >= 0.0f ? 1.0f - q : q;
  return s < 2.0f ? centre : tail;
}

// Note [lane sums]
// A row reduction written as one accumulator (s += x[j]) is a chain of dependent adds, and gcc may not reorder
// float adds, so the loop stays scalar: about 4 cycles per element, and a loop that also computes fast_exp into
// that sum runs its exp scalar too. The helpers below keep kReduceLanes partial results, lane l taking elements
// l, l + kReduceLanes, ... in order, and combine the lanes in a fixed tree at the end. The order of every
// operation is written in the source, so the result is the same on every build and instruction set (gcc maps the
// lanes onto two AVX2 vectors or one AVX-512 vector; it does not reassociate), and the inner loop vectorises.
// The result differs from a one-accumulator sum in its last bits.
inline constexpr int kReduceLanes = 16;

inline float lane_combine(float (&acc)[kReduceLanes]) {
  for (int w = kReduceLanes / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
  }
  return acc[0];
}

// sum_j term(j) for j in [0, n), in the order of Note [lane sums]; term is inlined into the vectorised loop.
template <typename Term>
inline float lane_sum_of(std::int64_t n, Term term) {
  float acc[kReduceLanes] = {};
  std::int64_t j = 0;
  for (; j + kReduceLanes <= n; j += kReduceLanes) {
    for (int l = 0; l < kReduceLanes; ++l) acc[l] += term(j + l);
  }
  for (int l = 0; j + l < n; ++l) acc[l] += term(j + l);
  return lane_combine(acc);
}

inline float lane_sum(const float* __restrict x, std::int64_t n) {
  return lane_sum_of(n, [x](std::int64_t j) { return x[j]; });
}

inline float lane_dot(const float* __restrict x, const float* __restrict y, std::int64_t n) {
  return lane_sum_of(n, [x, y](std::int64_t j) { return x[j] * y[j]; });
}

// sum_j exp(x[j] - shift) with fast_exp, no buffer for the exps needed.
inline float lane_sum_exp(const float* __restrict x, std::int64_t n, float shift) {
  return lane_sum_of(n, [x, shift](std::int64_t j) { return fast_exp(x[j] - shift); });
}

// max_j x[j] (-inf for n = 0); exact whatever the order, for inputs without NaN.
inline float lane_max(const float* __restrict x, std::int64_t n) {
  float acc[kReduceLanes];
  for (float& a : acc) a = -INFINITY;
  std::int64_t j = 0;
  for (; j + kReduceLanes <= n; j += kReduceLanes) {
    for (int l = 0; l < kReduceLanes; ++l) acc[l] = std::max(acc[l], x[j + l]);
  }
  for (int l = 0; j + l < n; ++l) acc[l] = std::max(acc[l], x[j + l]);
  for (int w = kReduceLanes / 2; w >= 1; w /= 2) {
    for (int l = 0; l < w; ++l) acc[l] = std::max(acc[l], acc[l + w]);
  }
  return acc[0];
}

}  // namespace shardkit::autograd::detail
