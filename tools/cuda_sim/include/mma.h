// Stand-in for CUDA's mma.h (nvcuda::wmma) for tools/cuda_sim: every lane holds the whole 16 x 16 tile; loads
// assert WMMA's alignment and leading-dimension rules.
#pragma once
#include <cstdint>
#include <string>
#include "cuda_bf16.h"
#include "sim.h"
namespace nvcuda::wmma {
struct matrix_a {}; struct matrix_b {}; struct accumulator {};
struct row_major {}; struct col_major {};
enum layout_t { mem_row_major, mem_col_major };
// Model: every lane holds the whole 16x16 tile (values as float; bf16 operands are exact in float).
template <typename Use, int M, int N, int K, typename T, typename Layout = void>
struct fragment {
  static_assert(M == 16 && N == 16 && K == 16);
  float v[16][16];
};
namespace detail {
inline void Check(const void* p, unsigned ldm, unsigned mult, std::size_t elem, const char* what) {
  if (reinterpret_cast<std::uintptr_t>(p) % 32 != 0) sim::Error(std::string(what) + ": pointer not 32-byte aligned");
  if (ldm % mult != 0) sim::Error(std::string(what) + ": ldm " + std::to_string(ldm) + " not a multiple");
  if (!sim::InSmem(p, elem) || !sim::InSmem(static_cast<const unsigned char*>(p) + 15 * elem * ldm, 16 * elem))
    sim::Error(std::string(what) + ": tile outside dynamic shared memory");
}
}  // namespace detail
template <typename Use, typename Layout>
inline void load_matrix_sync(fragment<Use, 16, 16, 16, __nv_bfloat16, Layout>& f, const __nv_bfloat16* p, unsigned ldm) {
  static_assert(std::is_same_v<Layout, row_major> || std::is_same_v<Layout, col_major>);
  detail::Check(p, ldm, 8, 2, "load bf16");
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) {
      const __nv_bfloat16 x = std::is_same_v<Layout, row_major> ? p[r * ldm + c] : p[c * ldm + r];
      f.v[r][c] = __bfloat162float(x);
      if (std::isnan(f.v[r][c])) sim::Error("bf16 WMMA load read NaN (uninitialised shared memory?)");
    }
}
inline void load_matrix_sync(fragment<accumulator, 16, 16, 16, float>& f, const float* p, unsigned ldm, layout_t l) {
  detail::Check(p, ldm, 4, 4, "load f32");
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c) {
      f.v[r][c] = l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r];
      if (std::isnan(f.v[r][c])) sim::Error("f32 WMMA load read NaN (uninitialised shared memory?)");
    }
}
inline void store_matrix_sync(float* p, const fragment<accumulator, 16, 16, 16, float>& f, unsigned ldm, layout_t l) {
  detail::Check(p, ldm, 4, 4, "store f32");
  // Each lane writes the elements it owns in sm_80's mma accumulator layout: (r, c) with
  // lane == (r % 8) * 4 + (c % 8) / 2.
  const int lane = sim::tid & 31;
  for (int r = 0; r < 16; ++r)
    for (int c = 0; c < 16; ++c)
      if ((r % 8) * 4 + (c % 8) / 2 == lane) (l == mem_row_major ? p[r * ldm + c] : p[c * ldm + r]) = f.v[r][c];
}
template <typename T>
inline void fill_fragment(T& f, float x) {
  for (auto& row : f.v)
    for (auto& e : row) e = x;
}
template <typename LA, typename LB>
inline void mma_sync(fragment<accumulator, 16, 16, 16, float>& d,
                     const fragment<matrix_a, 16, 16, 16, __nv_bfloat16, LA>& a,
                     const fragment<matrix_b, 16, 16, 16, __nv_bfloat16, LB>& b,
                     const fragment<accumulator, 16, 16, 16, float>& c) {
  sim::WarpBarrier();  // warp-wide instruction: every lane's inputs are consumed before any lane's result exists
  float out[16][16];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) {
      float s = c.v[i][j];
      for (int k = 0; k < 16; ++k) s += a.v[i][k] * b.v[k][j];
      out[i][j] = s;
    }
  std::memcpy(d.v, out, sizeof out);
}
}  // namespace nvcuda::wmma
