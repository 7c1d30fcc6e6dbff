// Fused causal attention on bf16 tensor cores (behind cuda::flash_attention / flash_attention_backward).
//
// Note [flash attention]
// The materialised path (common/autograd/ops/attention.cc) writes the scores S [B, H, T, T] to memory, softmaxes
// them in place and reads them back for P V, and the backward does the same with dP: at GPT-2 small's T = 1024 that
// is about 10 ms of a 36 ms step on an H200, most of it moving T x T matrices. Here the T x T matrices never leave
// the chip (FlashAttention's scheme, written for this library's layout and tensors):
// - Forward: a block of 4 warps takes 64 query rows of one (batch, head), each warp 16 of them, and walks the key
//   blocks of 64 up to the diagonal. Per key block: S = Q K^T on tensor cores (bf16 operands, fp32 accumulation,
//   WMMA 16 x 16 x 16 tiles) into shared memory; the online softmax (a running row max m and sum l; the
//   accumulated output rescaled by exp(m_old - m_new)) turns S into P, rounded to bf16; O += P V on tensor cores.
//   At the end O / l is written, and m + log(l), the row's log-sum-exp, is saved for the backward.
// - Backward, without atomics (the same bits on every run, as Note [deterministic column sums]): delta = rowsum(dY *
//   Y) first; then one kernel per key block (dK, dV: walks the query blocks from the diagonal down, recomputing
//   P = exp(scale S - lse) and dS = P (dP - delta) with dP = dY V^T; dV += P^T dY, dK += dS^T Q) and one per query
//   block (dQ += dS K over the key blocks up to the diagonal). S and dP are computed twice, once in each kernel:
//   the price of no atomics, on tensor cores.
// - Head sizes up to 128: the tiles are HS = 16, 32, 64 or 128 wide (the smallest that holds the head), columns
//   past the head read as zeros (they add nothing to Q K^T and their outputs are not written). Rows past T read as
//   zeros and are masked like the future.
// - Precision: the products take bf16 operands (Q, K, V, dY, P, dS) with fp32 accumulation, like the GEMMs at
//   MatmulPrecision::medium (Note [matmul precision]); the softmax, the scale and every sum are fp32. The op uses
//   this path at medium only; at high and highest the materialised fp32 path stays.
// - WMMA's bf16 fragments need sm_80 or newer. The kernels are compiled for the build's architectures; where the
//   code for a device is older than sm_80 (its PTX version, cudaFuncGetAttributes), flash_attention_supported says
//   no and the op keeps the materialised path. The bodies trap if ever run from such code.
// - Without a GPU, `sh tools/cuda_sim/run.sh` runs these kernels' source on the CPU (a block's threads one at a
//   time, switching at barriers, in four orders) against fp64 attention: it checks indexing, masking, padding and
//   barriers, not speed or the hardware's own rounding.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <cmath>
#include <cstdint>

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/cuda/cuda_util.cuh"

namespace shardkit::kernels::cuda {
namespace {

namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;

constexpr int kBlock = 64;  // rows (queries, or keys) per block, and the columns walked per step
constexpr int kWarps = 4;   // each owns 16 of the block's rows
constexpr int kFlashThreads = kWarps * 32;
constexpr int kTile = 16;  // WMMA's tile edge
constexpr int kWarpRows = kBlock / kWarps;
static_assert(kWarpRows == kTile);

using AccFrag = wmma::fragment<wmma::accumulator, kTile, kTile, kTile, float>;
using RowA = wmma::fragment<wmma::matrix_a, kTile, kTile, kTile, bf16, wmma::row_major>;
using RowB = wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, bf16, wmma::row_major>;
using ColB = wmma::fragment<wmma::matrix_b, kTile, kTile, kTile, bf16, wmma::col_major>;

// Leading dimensions in shared memory (elements): multiples of 8 (bf16) or 4 (f32), as WMMA requires, padded past
// the row so consecutive rows start on different banks.
template <int HS>
struct Layout {
  static constexpr int kHead = HS + 8;         // bf16 [64][HS] tiles: Q, K, V, dY
  static constexpr int kScore = kBlock + 4;    // f32 [16][64] per warp: S, dP
  static constexpr int kProb = kBlock + 8;     // bf16 [16][64] per warp: P, dS
  static constexpr int kOut = HS + 4;          // f32 [16][HS] per warp: the forward's O
  static constexpr std::size_t kHeadBytes = sizeof(bf16) * kBlock * kHead;
  static constexpr std::size_t kScoreBytes = sizeof(float) * kWarps * kWarpRows * kScore;
  static constexpr std::size_t kProbBytes = sizeof(bf16) * kWarps * kWarpRows * kProb;
  static constexpr std::size_t kOutBytes = sizeof(float) * kWarps * kWarpRows * kOut;
  static constexpr std::size_t kRowBytes = sizeof(float) * kBlock;
  // Q, K, V; S; P; O.
  static constexpr std::size_t kForward = 3 * kHeadBytes + kScoreBytes + kProbBytes + kOutBytes;
  // Both backward kernels (BackwardShared): four tiles; S, dP; P, dS; lse and delta of the walked block.
  static constexpr std::size_t kBackward = 4 * kHeadBytes + 2 * kScoreBytes + 2 * kProbBytes + 2 * kRowBytes;
  // Every piece is a multiple of 128 bytes, so each starts 128-byte aligned (WMMA needs 32).
  static_assert(kHeadBytes % 128 == 0 && kScoreBytes % 128 == 0 && kProbBytes % 128 == 0 && kOutBytes % 128 == 0 &&
                kRowBytes % 128 == 0);
};

// Hands out consecutive pieces of the block's dynamic shared memory.
class SharedCarve {
 public:
  __device__ explicit SharedCarve(unsigned char* base) : at_(base) {}
  template <typename T>
  __device__ T* take(std::size_t bytes) {
    T* p = reinterpret_cast<T*>(at_);
    at_ += bytes;
    return p;
  }

 private:
  unsigned char* at_;
};

// A backward kernel's shared memory: the two tiles of the block's own 64 rows (the keys' K and V, or the queries'
// Q and dY), the two of the block of rows it walks, and the calling warp's S, dP (f32) and P, dS (bf16) buffers;
// lse and delta of the walked rows (the keys kernel's; the queries kernel keeps its rows' in registers).
template <int HS>
struct BackwardShared {
  bf16 *own_a, *own_b, *walk_a, *walk_b;
  float *s, *dp;
  bf16 *p, *ds;
  float *lse, *delta;
  __device__ BackwardShared(unsigned char* base, int warp) {
    using L = Layout<HS>;
    SharedCarve carve(base);
    own_a = carve.take<bf16>(L::kHeadBytes);
    own_b = carve.take<bf16>(L::kHeadBytes);
    walk_a = carve.take<bf16>(L::kHeadBytes);
    walk_b = carve.take<bf16>(L::kHeadBytes);
    s = carve.take<float>(L::kScoreBytes) + warp * kWarpRows * L::kScore;
    dp = carve.take<float>(L::kScoreBytes) + warp * kWarpRows * L::kScore;
    p = carve.take<bf16>(L::kProbBytes) + warp * kWarpRows * L::kProb;
    ds = carve.take<bf16>(L::kProbBytes) + warp * kWarpRows * L::kProb;
    lse = carve.take<float>(L::kRowBytes);
    delta = carve.take<float>(L::kRowBytes);
  }
};

// Where one (batch, head) lives: rows of qkv [B, T, 3C] (q, k, v at column offsets 0, C, 2C of the head's columns)
// and of y / dY [B, T, C].
struct HeadView {
  const float* q;
  const float* k;
  const float* v;
  std::int64_t qkv_ld;  // 3C
  std::int64_t y_offset;  // (b T) C + h hs: the head's first element in y / dY
  std::int64_t qkv_offset;  // (b T) 3C + h hs: in qkv / dqkv
  std::int64_t row;  // (b H + h) T: the head's first row in lse / delta
  __device__ HeadView(const float* qkv, int bh, int t, int heads, int hs) {
    const int b = bh / heads, h = bh % heads;
    const std::int64_t c = static_cast<std::int64_t>(heads) * hs;
    qkv_ld = 3 * c;
    qkv_offset = static_cast<std::int64_t>(b) * t * qkv_ld + static_cast<std::int64_t>(h) * hs;
    y_offset = static_cast<std::int64_t>(b) * t * c + static_cast<std::int64_t>(h) * hs;
    row = static_cast<std::int64_t>(bh) * t;
    q = qkv + qkv_offset;
    k = q + c;
    v = q + 2 * c;
  }
};

// The j-th column a lane visits of N (a power of two) in the per-row loops: each lane starts at its own column, so
// the lanes of a warp, two to a row of a buffer whose rows are 4 banks apart, hit different banks (in order, the
// lanes of a row pair and rows r and r + 8 would share one: 4-way conflicts).
template <int N>
__device__ int Rotated(int j, int lane) {
  static_assert((N & (N - 1)) == 0);
  return (j + lane) & (N - 1);
}

// Rows [row0, row0 + 64) of `src` (rows `ld` floats apart, the head's columns from 0) as bf16 into dst [64][HS]
// (leading dimension Layout<HS>::kHead); rows >= t and columns >= hs as zeros. The whole block takes part.
template <int HS>
__device__ void LoadTile(const float* __restrict__ src, std::int64_t ld, int row0, int t, int hs, bf16* dst) {
  for (int i = threadIdx.x; i < kBlock * HS; i += kFlashThreads) {
    const int r = i / HS, c = i % HS;
    float x = 0.f;
    if (row0 + r < t && c < hs) x = src[static_cast<std::int64_t>(row0 + r) * ld + c];
    dst[r * Layout<HS>::kHead + c] = __float2bfloat16_rn(x);
  }
}

// out[16 x 64] (f32, leading dimension Layout<HS>::kScore) = A[16 x HS] B^T, B's 64 rows of HS in `b` (both bf16
// with leading dimension kHead): one warp.
template <int HS>
__device__ void RowsTimesTransposed(const bf16* a, const bf16* b, float* out) {
  for (int j = 0; j < kBlock / kTile; ++j) {
    AccFrag acc;
    wmma::fill_fragment(acc, 0.f);
    for (int kk = 0; kk < HS / kTile; ++kk) {
      RowA fa;
      ColB fb;
      wmma::load_matrix_sync(fa, a + kk * kTile, Layout<HS>::kHead);
      wmma::load_matrix_sync(fb, b + j * kTile * Layout<HS>::kHead + kk * kTile, Layout<HS>::kHead);
      wmma::mma_sync(acc, fa, fb, acc);
    }
    wmma::store_matrix_sync(out + j * kTile, acc, Layout<HS>::kScore, wmma::mem_row_major);
  }
}

// acc[j] += P[16 x 64] B[64 x HS] for each 16-column tile j of B (P bf16 with leading dimension kProb, B bf16 with
// kHead): one warp.
template <int HS>
__device__ void AccumulateRowsTimes(const bf16* p, const bf16* b, AccFrag (&acc)[HS / kTile]) {
  for (int j = 0; j < HS / kTile; ++j) {
    for (int kk = 0; kk < kBlock / kTile; ++kk) {
      RowA fa;
      RowB fb;
      wmma::load_matrix_sync(fa, p + kk * kTile, Layout<HS>::kProb);
      wmma::load_matrix_sync(fb, b + kk * kTile * Layout<HS>::kHead + j * kTile, Layout<HS>::kHead);
      wmma::mma_sync(acc[j], fa, fb, acc[j]);
    }
  }
}

// Writes acc (a warp's 16 rows, HS columns in tiles) times `scale` to dst rows row0 + r (r < 16) for rows < t and
// columns < hs, rows `ld` floats apart; `scratch` is the warp's [16][kScore] f32 buffer.
template <int HS>
__device__ void StoreRows(const AccFrag (&acc)[HS / kTile], float scale, float* scratch, float* dst, std::int64_t ld,
                          int row0, int t, int hs) {
  const int lane = threadIdx.x % 32;
  for (int j = 0; j < HS / kTile; ++j) {
    __syncwarp();
    wmma::store_matrix_sync(scratch, acc[j], Layout<HS>::kScore, wmma::mem_row_major);
    __syncwarp();
    for (int i = lane; i < kTile * kTile; i += 32) {
      const int r = i / kTile, c = j * kTile + i % kTile;
      if (row0 + r < t && c < hs) dst[static_cast<std::int64_t>(row0 + r) * ld + c] = scratch[r * Layout<HS>::kScore + i % kTile] * scale;
    }
  }
}

template <int HS>
__global__ void __launch_bounds__(kFlashThreads)
    FlashForwardKernel(const float* __restrict__ qkv, float* __restrict__ y, float* __restrict__ lse, int t, int heads,
                       int hs, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using L = Layout<HS>;
  extern __shared__ __align__(128) unsigned char smem[];
  SharedCarve carve(smem);
  bf16* qs = carve.take<bf16>(L::kHeadBytes);
  bf16* ks = carve.take<bf16>(L::kHeadBytes);
  bf16* vs = carve.take<bf16>(L::kHeadBytes);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* sw = carve.take<float>(L::kScoreBytes) + warp * kWarpRows * L::kScore;
  bf16* pw = carve.take<bf16>(L::kProbBytes) + warp * kWarpRows * L::kProb;
  float* ow = carve.take<float>(L::kOutBytes) + warp * kWarpRows * L::kOut;

  const int qb = gridDim.x - 1 - blockIdx.x;  // the longest rows (most key blocks) first
  const HeadView head(qkv, blockIdx.y, t, heads, hs);
  const int q0 = qb * kBlock;
  LoadTile<HS>(head.q, head.qkv_ld, q0, t, hs, qs);
  for (int i = lane; i < kWarpRows * HS; i += 32) ow[(i / HS) * L::kOut + i % HS] = 0.f;
  // In the softmax, lane pairs take a row each: row `row` of the warp's 16, columns [32 half, 32 half + 32).
  const int row = lane >> 1, half = lane & 1;
  const int qi = q0 + warp * kWarpRows + row;
  float m = -INFINITY, l = 0.f;
  for (int kb = 0; kb <= qb; ++kb) {
    const int k0 = kb * kBlock;
    __syncthreads();  // every warp is done with the previous K and V (and, the first time, Q is loaded)
    LoadTile<HS>(head.k, head.qkv_ld, k0, t, hs, ks);
    LoadTile<HS>(head.v, head.qkv_ld, k0, t, hs, vs);
    __syncthreads();
    RowsTimesTransposed<HS>(qs + warp * kWarpRows * L::kHead, ks, sw);
    __syncwarp();
    float* srow = sw + row * L::kScore + half * 32;
    float block_max = -INFINITY;
    for (int j = 0; j < 32; ++j) {
      const int c = Rotated<32>(j, lane);
      const int kj = k0 + half * 32 + c;
      const float s = (kj > qi || kj >= t) ? -INFINITY : srow[c] * scale;
      srow[c] = s;
      block_max = fmaxf(block_max, s);
    }
    block_max = fmaxf(block_max, __shfl_xor_sync(0xffffffffu, block_max, 1));
    const float m_new = fmaxf(m, block_max);
    const float alpha = m == -INFINITY ? 0.f : __expf(m - m_new);
    bf16* prow = pw + row * L::kProb + half * 32;
    float sum = 0.f;
    for (int j = 0; j < 32; ++j) {
      const int c = Rotated<32>(j, lane);
      const float p = srow[c] == -INFINITY ? 0.f : __expf(srow[c] - m_new);
      prow[c] = __float2bfloat16_rn(p);
      sum += p;
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    l = alpha * l + sum;
    m = m_new;
    float* orow = ow + row * L::kOut + half * (HS / 2);
    for (int j = 0; j < HS / 2; ++j) orow[Rotated<HS / 2>(j, lane)] *= alpha;
    __syncwarp();
    AccFrag acc[HS / kTile];
    for (int j = 0; j < HS / kTile; ++j) wmma::load_matrix_sync(acc[j], ow + j * kTile, L::kOut, wmma::mem_row_major);
    AccumulateRowsTimes<HS>(pw, vs, acc);
    for (int j = 0; j < HS / kTile; ++j) wmma::store_matrix_sync(ow + j * kTile, acc[j], L::kOut, wmma::mem_row_major);
    __syncwarp();
  }
  // Row r's m and l are with lanes 2r and 2r + 1; the whole warp writes each row (coalesced).
  for (int r = 0; r < kWarpRows; ++r) {
    const float lr = __shfl_sync(0xffffffffu, l, 2 * r);
    const float mr = __shfl_sync(0xffffffffu, m, 2 * r);
    const int i = q0 + warp * kWarpRows + r;
    if (i >= t) continue;
    const float inv = 1.f / lr;
    float* dst = y + head.y_offset + static_cast<std::int64_t>(i) * heads * hs;
    for (int c = lane; c < hs; c += 32) dst[c] = ow[r * L::kOut + c] * inv;
    if (lane == 0) lse[head.row + i] = mr + __logf(lr);
  }
#endif
}

// delta[(b H + h) T + i] = sum over the head's columns of dY * Y at row i: a warp a row.
__global__ void FlashDeltaKernel(const float* __restrict__ y, const float* __restrict__ dy, float* __restrict__ delta,
                                 std::int64_t rows, int t, int heads, int hs) {
  const std::int64_t r = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  if (r >= rows) return;
  const int lane = threadIdx.x % 32;
  const std::int64_t bh = r / t, i = r % t;
  const std::int64_t at = ((bh / heads) * t + i) * heads * hs + (bh % heads) * hs;
  float s = 0.f;
  for (int c = lane; c < hs; c += 32) s += dy[at + c] * y[at + c];
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (lane == 0) delta[r] = s;
}

// dK and dV of 64 keys: the query blocks from the diagonal down.
template <int HS>
__global__ void __launch_bounds__(kFlashThreads)
    FlashBackwardKeysKernel(const float* __restrict__ qkv, const float* __restrict__ dy, const float* __restrict__ lse,
                            const float* __restrict__ delta, float* __restrict__ dqkv, int t, int heads, int hs,
                            float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using L = Layout<HS>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const BackwardShared<HS> sh(smem, warp);
  bf16 *const ks = sh.own_a, *const vs = sh.own_b, *const qs = sh.walk_a, *const dys = sh.walk_b;
  float *const st = sh.s, *const dpt = sh.dp, *const lse_s = sh.lse, *const delta_s = sh.delta;
  bf16 *const pt = sh.p, *const dst = sh.ds;

  const HeadView head(qkv, blockIdx.y, t, heads, hs);
  const float* dyh = dy + head.y_offset;
  const std::int64_t y_ld = static_cast<std::int64_t>(heads) * hs;
  const int kb = blockIdx.x;  // the first key blocks see the most query blocks: scheduled first
  const int k0 = kb * kBlock;
  const int blocks = (t + kBlock - 1) / kBlock;
  LoadTile<HS>(head.k, head.qkv_ld, k0, t, hs, ks);
  LoadTile<HS>(head.v, head.qkv_ld, k0, t, hs, vs);
  AccFrag dk[HS / kTile], dv[HS / kTile];
  for (int j = 0; j < HS / kTile; ++j) {
    wmma::fill_fragment(dk[j], 0.f);
    wmma::fill_fragment(dv[j], 0.f);
  }
  // Lane pairs take a row each (a key): row `row` of the warp's 16, queries [32 half, 32 half + 32) of the block.
  const int row = lane >> 1, half = lane & 1;
  const int kj = k0 + warp * kWarpRows + row;
  for (int qb = kb; qb < blocks; ++qb) {
    const int q0 = qb * kBlock;
    __syncthreads();  // every warp is done with the previous Q, dY, lse and delta
    LoadTile<HS>(head.q, head.qkv_ld, q0, t, hs, qs);
    LoadTile<HS>(dyh, y_ld, q0, t, hs, dys);
    for (int i = threadIdx.x; i < kBlock; i += kFlashThreads) {
      const bool in = q0 + i < t;
      lse_s[i] = in ? lse[head.row + q0 + i] : INFINITY;  // a row past T: P = exp(-inf) = 0
      delta_s[i] = in ? delta[head.row + q0 + i] : 0.f;
    }
    __syncthreads();
    // S^T = K_w Q^T and dP^T = V_w dY^T, the warp's 16 keys against the block's 64 queries.
    RowsTimesTransposed<HS>(ks + warp * kWarpRows * L::kHead, qs, st);
    RowsTimesTransposed<HS>(vs + warp * kWarpRows * L::kHead, dys, dpt);
    __syncwarp();
    for (int j = 0; j < 32; ++j) {
      const int col = half * 32 + Rotated<32>(j, lane), qi = q0 + col;
      const float p =
          (qi < kj || kj >= t) ? 0.f : __expf(st[row * L::kScore + col] * scale - lse_s[col]);
      const float ds = p * (dpt[row * L::kScore + col] - delta_s[col]);
      pt[row * L::kProb + col] = __float2bfloat16_rn(p);
      dst[row * L::kProb + col] = __float2bfloat16_rn(ds);
    }
    __syncwarp();
    AccumulateRowsTimes<HS>(pt, dys, dv);  // dV += P^T dY
    AccumulateRowsTimes<HS>(dst, qs, dk);  // dK += dS^T Q (times scale when written)
  }
  float* dk_out = dqkv + head.qkv_offset + y_ld;
  float* dv_out = dqkv + head.qkv_offset + 2 * y_ld;
  StoreRows<HS>(dk, scale, st, dk_out, head.qkv_ld, k0 + warp * kWarpRows, t, hs);
  StoreRows<HS>(dv, 1.f, st, dv_out, head.qkv_ld, k0 + warp * kWarpRows, t, hs);
#endif
}

// dQ of 64 queries: the key blocks up to the diagonal.
template <int HS>
__global__ void __launch_bounds__(kFlashThreads)
    FlashBackwardQueriesKernel(const float* __restrict__ qkv, const float* __restrict__ dy,
                               const float* __restrict__ lse, const float* __restrict__ delta,
                               float* __restrict__ dqkv, int t, int heads, int hs, float scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
  __trap();
#else
  using L = Layout<HS>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const BackwardShared<HS> sh(smem, warp);
  bf16 *const qs = sh.own_a, *const dys = sh.own_b, *const ks = sh.walk_a, *const vs = sh.walk_b;
  float *const sw = sh.s, *const dpw = sh.dp;
  bf16* const dsw = sh.ds;

  const HeadView head(qkv, blockIdx.y, t, heads, hs);
  const std::int64_t y_ld = static_cast<std::int64_t>(heads) * hs;
  const int qb = gridDim.x - 1 - blockIdx.x;  // the longest rows first
  const int q0 = qb * kBlock;
  LoadTile<HS>(head.q, head.qkv_ld, q0, t, hs, qs);
  LoadTile<HS>(dy + head.y_offset, y_ld, q0, t, hs, dys);
  const int row = lane >> 1, half = lane & 1;
  const int qi = q0 + warp * kWarpRows + row;
  const float row_lse = qi < t ? lse[head.row + qi] : INFINITY;
  const float row_delta = qi < t ? delta[head.row + qi] : 0.f;
  AccFrag dq[HS / kTile];
  for (int j = 0; j < HS / kTile; ++j) wmma::fill_fragment(dq[j], 0.f);
  for (int kb = 0; kb <= qb; ++kb) {
    const int k0 = kb * kBlock;
    __syncthreads();
    LoadTile<HS>(head.k, head.qkv_ld, k0, t, hs, ks);
    LoadTile<HS>(head.v, head.qkv_ld, k0, t, hs, vs);
    __syncthreads();
    RowsTimesTransposed<HS>(qs + warp * kWarpRows * L::kHead, ks, sw);    // S = Q_w K^T
    RowsTimesTransposed<HS>(dys + warp * kWarpRows * L::kHead, vs, dpw);  // dP = dY_w V^T
    __syncwarp();
    for (int j = 0; j < 32; ++j) {
      const int col = half * 32 + Rotated<32>(j, lane), kj = k0 + col;
      const float p = (kj > qi || kj >= t) ? 0.f : __expf(sw[row * L::kScore + col] * scale - row_lse);
      dsw[row * L::kProb + col] = __float2bfloat16_rn(p * (dpw[row * L::kScore + col] - row_delta));
    }
    __syncwarp();
    AccumulateRowsTimes<HS>(dsw, ks, dq);  // dQ += dS K (times scale when written)
  }
  StoreRows<HS>(dq, scale, sw, dqkv + head.qkv_offset, head.qkv_ld, q0 + warp * kWarpRows, t, hs);
#endif
}

// Runs `launch` with the tile width for head size hs: a template argument HS of 16, 32, 64 or 128.
template <typename Launch>
void ByHeadSize(std::int64_t hs, Launch&& launch) {
  if (hs <= 16) {
    launch.template operator()<16>();
  } else if (hs <= 32) {
    launch.template operator()<32>();
  } else if (hs <= 64) {
    launch.template operator()<64>();
  } else {
    SK_CHECK(hs <= 128) << "flash attention: head size " << hs << " over 128";
    launch.template operator()<128>();
  }
}

// Lets `kernel` use `bytes` of dynamic shared memory (over the default 48 KiB needs asking) and returns the grid
// for t rows of b_h heads.
template <typename Kernel>
dim3 Prepare(Kernel kernel, std::size_t bytes, std::int64_t t, std::int64_t b_h) {
  SK_CHECK(b_h <= 65535) << "flash attention: " << b_h << " (batch x heads) is over the grid's 65535";
  SK_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  return dim3(static_cast<unsigned>((t + kBlock - 1) / kBlock), static_cast<unsigned>(b_h));
}

}  // namespace

namespace cuda_impl {

bool flash_attention_supported(Device device, std::int64_t hs) {
  if (hs < 1 || hs > 128) return false;
  DeviceGuard guard(device);
  int major = 0;
  SK_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index));
  if (major < 8) return false;
  // The code this device runs must have been compiled for sm_80 or newer (Note [flash attention]).
  cudaFuncAttributes attributes{};
  SK_CUDA_CHECK(cudaFuncGetAttributes(&attributes, FlashForwardKernel<64>));
  return attributes.ptxVersion >= 80;
}

void flash_attention(Device device, const float* qkv, float* y, float* lse, std::int64_t b_n, std::int64_t t,
                     std::int64_t heads, std::int64_t hs, float scale) {
  if (b_n * t * heads == 0) return;
  DeviceGuard guard(device);
  ByHeadSize(hs, [&]<int HS>() {
    const std::size_t bytes = Layout<HS>::kForward;
    const dim3 grid = Prepare(FlashForwardKernel<HS>, bytes, t, b_n * heads);
    FlashForwardKernel<HS><<<grid, kFlashThreads, bytes, cudaStreamPerThread>>>(
        qkv, y, lse, static_cast<int>(t), static_cast<int>(heads), static_cast<int>(hs), scale);
  });
  CheckLaunch("cuda::flash_attention");
}

void flash_attention_backward(Device device, const float* qkv, const float* y, const float* dy, const float* lse,
                              float* dqkv, std::int64_t b_n, std::int64_t t, std::int64_t heads, std::int64_t hs,
                              float scale) {
  if (b_n * t * heads == 0) return;
  DeviceGuard guard(device);
  const std::int64_t rows = b_n * heads * t;
  const StreamScratch<float> delta_scratch(rows);
  float* delta = delta_scratch.get();
  constexpr int kRowsPerBlock = kThreads / 32;
  FlashDeltaKernel<<<static_cast<unsigned>((rows + kRowsPerBlock - 1) / kRowsPerBlock), kThreads, 0,
                     cudaStreamPerThread>>>(y, dy, delta, rows, static_cast<int>(t), static_cast<int>(heads),
                                            static_cast<int>(hs));
  CheckLaunch("cuda::flash_attention_backward (delta)");
  ByHeadSize(hs, [&]<int HS>() {
    const std::size_t bytes = Layout<HS>::kBackward;
    const dim3 grid = Prepare(FlashBackwardKeysKernel<HS>, bytes, t, b_n * heads);
    FlashBackwardKeysKernel<HS><<<grid, kFlashThreads, bytes, cudaStreamPerThread>>>(
        qkv, dy, lse, delta, dqkv, static_cast<int>(t), static_cast<int>(heads), static_cast<int>(hs), scale);
    Prepare(FlashBackwardQueriesKernel<HS>, bytes, t, b_n * heads);
    FlashBackwardQueriesKernel<HS><<<grid, kFlashThreads, bytes, cudaStreamPerThread>>>(
        qkv, dy, lse, delta, dqkv, static_cast<int>(t), static_cast<int>(heads), static_cast<int>(hs), scale);
  });
  CheckLaunch("cuda::flash_attention_backward");
}

}  // namespace cuda_impl
}  // namespace shardkit::kernels::cuda
