// Vectorisable exp and tanh for the activation, softmax and loss loops (internal).
//
// Note [fast exp]: libm's expf/tanhf are calls the vectoriser cannot inline, which makes softmax and GELU
// scalar. fast_exp is Cephes' expf (range reduction by ln 2 split in two parts, degree-6 polynomial,
// exponent built with integer arithmetic) in plain arithmetic, so gcc vectorises loops that use it.
// Relative error about 2 ulp on [-87, 88] (checked against libm in ops tests); inputs are clamped to that range (exp(-87) ~ 1.6e-38,
// below which results are irrelevant for softmax and GELU).
#pragma once

#include <algorithm>
#include <bit>
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

}  // namespace shardkit::autograd::detail
