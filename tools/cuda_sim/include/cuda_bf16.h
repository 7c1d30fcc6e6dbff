// Stand-in for CUDA's cuda_bf16.h for tools/cuda_sim: __nv_bfloat16 with round-to-nearest-even conversion.
#pragma once
#include <cstdint>
#include <cstring>
#include <cmath>
struct __nv_bfloat16 { unsigned short x; };
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  __nv_bfloat16 r;
  if (std::isnan(f)) { r.x = 0x7fc0; return r; }
  u += 0x7fffu + ((u >> 16) & 1u);
  r.x = static_cast<unsigned short>(u >> 16);
  return r;
}
inline float __bfloat162float(__nv_bfloat16 b) {
  std::uint32_t u = static_cast<std::uint32_t>(b.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
