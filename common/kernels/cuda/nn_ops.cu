// The CUDA kernels behind the autograd ops (common/autograd/ops) for fp32 tensors on a device: broadcast
// rows, column sums, GELU, LayerNorm, causal softmax, cross-entropy, embedding, and 2-d copies.
//
// Note [deterministic column sums]: gradients of per-feature parameters (a bias, LayerNorm's weight and bias)
// sum over every row. Atomics would make the sum depend on scheduling; instead rows are cut into chunks of
// kRowsPerChunk, one thread per (column, chunk) sums its chunk in row order into a partial, and a second kernel
// adds the partials of each column in chunk order. The result is the same on every run. Only the embedding's
// backward uses atomics (a token's row gets as many adds as it has occurrences, in no fixed order), as
// PyTorch's does outside its deterministic mode.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <type_traits>

#include "common/kernels/cuda/bf16_gemm_plan.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/cuda/cuda_util.cuh"

namespace shardkit::kernels::cuda {
namespace {

#define SK_NN_GRID_STRIDE(i, n)                                                                  \
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < (n); \
       i += static_cast<std::int64_t>(blockDim.x) * gridDim.x)

constexpr float kGeluC = 0.7978845608028654f;      // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;
constexpr float kInvSqrt2Pi = 0.3989422804014327f;  // 1 / sqrt(2 pi)
constexpr std::int64_t kRowsPerChunk = 64;
constexpr int kWarpsPerBlock = kThreads / 32;

__device__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// ---- broadcast rows -----------------------------------------------------------------------------------
template <RowOp kOp>
__global__ void BroadcastRowsKernel(const float* a, const float* b, float* out, std::int64_t rows, std::int64_t n) {
  SK_NN_GRID_STRIDE(i, rows * n) {
    const float x = a != nullptr ? a[i] : 0.f;
    const float y = b[i % n];
    if constexpr (kOp == RowOp::add) out[i] = x + y;
    if constexpr (kOp == RowOp::sub) out[i] = x - y;
    if constexpr (kOp == RowOp::mul) out[i] = x * y;
    if constexpr (kOp == RowOp::assign) out[i] = y;
  }
}

// ---- column sums (Note [deterministic column sums]) -------------------------------------------------------
// What a column sum adds per element: the plain value, or LayerNorm's g * xhat.
struct PlainTerm {
  const float* x;
  __device__ float operator()(std::int64_t r, std::int64_t j, std::int64_t n) const { return x[r * n + j]; }
};
struct NormWeightTerm {
  const float* x;
  const float* g;
  const float* mean;
  const float* rstd;
  __device__ float operator()(std::int64_t r, std::int64_t j, std::int64_t n) const {
    return g[r * n + j] * (x[r * n + j] - mean[r]) * rstd[r];
  }
};

template <typename Term>
__global__ void ChunkColumnSumsKernel(Term term, float* partials, std::int64_t rows, std::int64_t n) {
  const std::int64_t j = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  const std::int64_t chunk = blockIdx.y;
  if (j >= n) return;
  const std::int64_t r0 = chunk * kRowsPerChunk;
  const std::int64_t r1 = min(rows, r0 + kRowsPerChunk);
  float acc = 0.f;
  for (std::int64_t r = r0; r < r1; ++r) acc += term(r, j, n);
  partials[chunk * n + j] = acc;
}

__global__ void AddChunksKernel(const float* partials, float* out, std::int64_t chunks, std::int64_t n,
                                bool accumulate) {
  SK_NN_GRID_STRIDE(j, n) {
    float acc = accumulate ? out[j] : 0.f;
    for (std::int64_t c = 0; c < chunks; ++c) acc += partials[c * n + j];
    out[j] = acc;
  }
}

template <typename Term>
void ColumnSums(Term term, float* out, std::int64_t rows, std::int64_t n, bool accumulate) {
  if (n == 0) return;
  const std::int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  if (chunks == 0) {
    if (!accumulate) SK_CUDA_CHECK(cudaMemsetAsync(out, 0, static_cast<std::size_t>(n) * sizeof(float),
                                                   cudaStreamPerThread));
    return;
  }
  SK_CHECK(chunks <= 65535) << "column sum over " << rows << " rows: more chunks than a grid's y dimension";
  const StreamScratch<float> partials(chunks * n);
  const dim3 grid(static_cast<unsigned>((n + kThreads - 1) / kThreads), static_cast<unsigned>(chunks));
  ChunkColumnSumsKernel<<<grid, kThreads, 0, cudaStreamPerThread>>>(term, partials.get(), rows, n);
  CheckLaunch("column sums");
  AddChunksKernel<<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(partials.get(), out, chunks, n,
                                                                     accumulate);
  CheckLaunch("column sums (chunks)");
}

// ---- GELU ---------------------------------------------------------------------------------------------
__global__ void GeluKernel(bool tanh_approx, const float* x, float* y, std::int64_t n) {
  SK_NN_GRID_STRIDE(i, n) {
    const float v = x[i];
    if (tanh_approx) {
      y[i] = 0.5f * v * (1.f + tanhf(kGeluC * (v + kGeluA * v * v * v)));
    } else {
      y[i] = v * normcdff(v);
    }
  }
}

__global__ void GeluBackwardKernel(bool tanh_approx, const float* x, const float* gy, float* gx, std::int64_t n) {
  SK_NN_GRID_STRIDE(i, n) {
    const float v = x[i];
    if (tanh_approx) {
      const float t = tanhf(kGeluC * (v + kGeluA * v * v * v));
      const float du = kGeluC * (1.f + 3.f * kGeluA * v * v);
      gx[i] = gy[i] * (0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du);
    } else {
      gx[i] = gy[i] * (normcdff(v) + v * kInvSqrt2Pi * expf(-0.5f * v * v));
    }
  }
}

// ---- LayerNorm: one warp per row ------------------------------------------------------------------------
__global__ void LayerNormKernel(const float* x, const float* w, const float* b, float* y, float* mean_out,
                                float* rstd_out, std::int64_t rows, std::int64_t c, float eps) {
  const std::int64_t r = blockIdx.x * static_cast<std::int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float* xr = x + r * c;
  float s = 0.f;
  for (std::int64_t j = lane; j < c; j += 32) s += xr[j];
  const float mean = WarpSum(s) / static_cast<float>(c);
  float v = 0.f;
  for (std::int64_t j = lane; j < c; j += 32) v += (xr[j] - mean) * (xr[j] - mean);
  const float rstd = rsqrtf(WarpSum(v) / static_cast<float>(c) + eps);
  float* yr = y + r * c;
  for (std::int64_t j = lane; j < c; j += 32) {
    float t = (xr[j] - mean) * rstd;
    if (w != nullptr) t *= w[j];
    if (b != nullptr) t += b[j];
    yr[j] = t;
  }
  if (lane == 0) {
    mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
}

// dxhat = g * w; dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)).
__global__ void LayerNormBackwardKernel(const float* x, const float* gy, const float* w, const float* mean_in,
                                        const float* rstd_in, float* gx, std::int64_t rows, std::int64_t c) {
  const std::int64_t r = blockIdx.x * static_cast<std::int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (r >= rows) return;
  const float* xr = x + r * c;
  const float* gr = gy + r * c;
  const float mean = mean_in[r], rstd = rstd_in[r];
  float s1 = 0.f, s2 = 0.f;
  for (std::int64_t j = lane; j < c; j += 32) {
    const float d = w != nullptr ? gr[j] * w[j] : gr[j];
    s1 += d;
    s2 += d * (xr[j] - mean) * rstd;
  }
  s1 = WarpSum(s1) / static_cast<float>(c);
  s2 = WarpSum(s2) / static_cast<float>(c);
  float* gxr = gx + r * c;
  for (std::int64_t j = lane; j < c; j += 32) {
    const float d = w != nullptr ? gr[j] * w[j] : gr[j];
    gxr[j] = rstd * (d - s1 - (xr[j] - mean) * rstd * s2);
  }
}

// ---- causal softmax over [matrices, t, t]: one warp per row ---------------------------------------------
// Note [softmax rows in registers]: a row of up to 32 * kPerLane columns stays in its warp's registers (lane l
// holds columns l, l + 32, ...), so the forward reads the causal part once and writes the row once, and the
// backward reads P and dP's causal parts once and writes dS once: half the memory traffic of the streaming
// kernels below (the forward's three passes, the backward's two), which longer rows still use. The arithmetic is
// the streaming kernels', in the same order (each lane sums its columns in increasing order, then the warp), so
// both give the same bits. On an H200 (stop 32) the streaming kernels took 3.4 ms of a 36 ms GPT-2 small step.
// Each kernel also writes its result's packed bf16 copy where asked (Note [softmax writes the bf16 copy] in
// common/autograd/ops/attention.cc): the row's first t elements, rounded as pack_bf16 rounds; the launcher zeroes
// the copy first when t is not a multiple of 8 (its padding).

// Row `row` (of every matrix's rows, counted together) of the packed bf16 copies at out16, or null when none.
__device__ __forceinline__ __nv_bfloat16* CopyRow(__nv_bfloat16* out16, std::int64_t row, std::int64_t t) {
  if (out16 == nullptr) return nullptr;
  const std::int64_t pad = round_up_to_pad(t);
  return out16 + (row / t) * pad * pad + (row % t) * pad;
}
template <int kPerLane>
__global__ void CausalSoftmaxRowKernel(float* s, __nv_bfloat16* out16, std::int64_t rows_total, std::int64_t t) {
  const std::int64_t row = blockIdx.x * static_cast<std::int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows_total) return;
  const std::int64_t i = row % t;  // row i keeps columns 0..i
  float* p = s + row * t;
  float v[kPerLane];
  float mx = -INFINITY;
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) {
    const std::int64_t j = q * 32 + lane;
    v[q] = j <= i ? p[j] : -INFINITY;
    mx = fmaxf(mx, v[q]);
  }
  mx = WarpMax(mx);
  float sum = 0.f;
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) {
    const std::int64_t j = q * 32 + lane;
    v[q] = j <= i ? expf(v[q] - mx) : 0.f;
    sum += v[q];
  }
  const float inv = 1.f / WarpSum(sum);
  __nv_bfloat16* const o = CopyRow(out16, row, t);
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) {
    const std::int64_t j = q * 32 + lane;
    if (j < t) {
      const float x = j <= i ? v[q] * inv : 0.f;
      p[j] = x;
      if (o != nullptr) o[j] = __float2bfloat16_rn(x);
    }
  }
}

// At most 128 registers a thread, so two 256-thread blocks fit on an SM (k = 32 took 138 and one block without).
template <int kPerLane>
__global__ void __launch_bounds__(kThreads, 2)
    CausalSoftmaxBackwardRowKernel(const float* p, float* dp, __nv_bfloat16* out16, std::int64_t rows_total,
                                   std::int64_t t) {
  const std::int64_t row = blockIdx.x * static_cast<std::int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows_total) return;
  const std::int64_t i = row % t;
  const float* pr = p + row * t;
  float* dr = dp + row * t;
  float pv[kPerLane], dv[kPerLane];
  float dot = 0.f;
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) {
    const std::int64_t j = q * 32 + lane;
    pv[q] = j <= i ? pr[j] : 0.f;
    dv[q] = j <= i ? dr[j] : 0.f;
    if (j <= i) dot += pv[q] * dv[q];
  }
  dot = WarpSum(dot);
  __nv_bfloat16* const o = CopyRow(out16, row, t);
#pragma unroll
  for (int q = 0; q < kPerLane; ++q) {
    const std::int64_t j = q * 32 + lane;
    if (j < t) {
      const float x = j <= i ? pv[q] * (dv[q] - dot) : 0.f;
      dr[j] = x;
      if (o != nullptr) o[j] = __float2bfloat16_rn(x);
    }
  }
}

// Streaming versions, for rows longer than the register kernels hold.
__global__ void CausalSoftmaxKernel(float* s, __nv_bfloat16* out16, std::int64_t rows_total, std::int64_t t) {
  const std::int64_t row = blockIdx.x * static_cast<std::int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows_total) return;
  const std::int64_t i = row % t;  // row i keeps columns 0..i
  float* p = s + row * t;
  float mx = -INFINITY;
  for (std::int64_t j = lane; j <= i; j += 32) mx = fmaxf(mx, p[j]);
  mx = WarpMax(mx);
  float sum = 0.f;
  for (std::int64_t j = lane; j <= i; j += 32) {
    const float e = expf(p[j] - mx);
    p[j] = e;
    sum += e;
  }
  const float inv = 1.f / WarpSum(sum);
  __nv_bfloat16* const o = CopyRow(out16, row, t);
  for (std::int64_t j = lane; j < t; j += 32) {
    const float x = j <= i ? p[j] * inv : 0.f;
    p[j] = x;
    if (o != nullptr) o[j] = __float2bfloat16_rn(x);
  }
}

// dS = P * (dP - rowsum(P * dP)) on the causal part, zero above it; dp is overwritten by dS.
__global__ void CausalSoftmaxBackwardKernel(const float* p, float* dp, __nv_bfloat16* out16, std::int64_t rows_total,
                                            std::int64_t t) {
  const std::int64_t row = blockIdx.x * static_cast<std::int64_t>(kWarpsPerBlock) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows_total) return;
  const std::int64_t i = row % t;
  const float* pr = p + row * t;
  float* dr = dp + row * t;
  float dot = 0.f;
  for (std::int64_t j = lane; j <= i; j += 32) dot += pr[j] * dr[j];
  dot = WarpSum(dot);
  __nv_bfloat16* const o = CopyRow(out16, row, t);
  for (std::int64_t j = lane; j < t; j += 32) {
    const float x = j <= i ? pr[j] * (dr[j] - dot) : 0.f;
    dr[j] = x;
    if (o != nullptr) o[j] = __float2bfloat16_rn(x);
  }
}

// ---- cross-entropy ----------------------------------------------------------------------------------------
// lse[r] = log sum exp of row r (0 for an ignored row); one block per row.
__global__ void RowLogSumExpKernel(const float* x, const std::int64_t* targets, float* lse, std::int64_t v,
                                   std::int64_t ignore_index) {
  __shared__ float shared[kWarpsPerBlock];
  const std::int64_t r = blockIdx.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (targets[r] == ignore_index) {
    if (threadIdx.x == 0) lse[r] = 0.f;
    return;
  }
  const float* xr = x + r * v;
  float mx = -INFINITY;
  for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x) mx = fmaxf(mx, xr[j]);
  mx = WarpMax(mx);
  if (lane == 0) shared[warp] = mx;
  __syncthreads();
  mx = shared[0];
  for (int k = 1; k < kWarpsPerBlock; ++k) mx = fmaxf(mx, shared[k]);
  __syncthreads();
  float s = 0.f;
  for (std::int64_t j = threadIdx.x; j < v; j += blockDim.x) s += expf(xr[j] - mx);
  s = WarpSum(s);
  if (lane == 0) shared[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int k = 0; k < kWarpsPerBlock; ++k) total += shared[k];
    lse[r] = mx + logf(total);
  }
}

// One block: loss = mean over kept rows of lse[r] - x[r, t[r]], summed in double in a fixed order; the first
// out-of-range target's position goes to bad[0] (rows whose target is out of range add nothing).
__global__ void CrossEntropyLossKernel(const float* x, const std::int64_t* targets, const float* lse, float* loss,
                                       float* count_out, unsigned long long* bad, std::int64_t rows, std::int64_t v,
                                       std::int64_t ignore_index) {
  __shared__ double sums[kThreads];
  __shared__ double counts[kThreads];
  double s = 0, n = 0;
  for (std::int64_t r = threadIdx.x; r < rows; r += blockDim.x) {
    const std::int64_t t = targets[r];
    if (t == ignore_index) continue;
    if (t < 0 || t >= v) {
      atomicMin(bad, static_cast<unsigned long long>(r));
      continue;
    }
    s += static_cast<double>(lse[r]) - static_cast<double>(x[r * v + t]);
    n += 1;
  }
  sums[threadIdx.x] = s;
  counts[threadIdx.x] = n;
  __syncthreads();
  for (unsigned k = blockDim.x / 2; k > 0; k >>= 1) {
    if (threadIdx.x < k) {
      sums[threadIdx.x] += sums[threadIdx.x + k];
      counts[threadIdx.x] += counts[threadIdx.x + k];
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    loss[0] = counts[0] > 0 ? static_cast<float>(sums[0] / counts[0]) : 0.f;
    count_out[0] = static_cast<float>(counts[0]);
  }
}

__global__ void CrossEntropyBackwardKernel(const float* x, const std::int64_t* targets, const float* lse,
                                           const float* gloss, const float* count, float* gx, std::int64_t rows,
                                           std::int64_t v, std::int64_t ignore_index) {
  const float scale = count[0] > 0.f ? gloss[0] / count[0] : 0.f;
  SK_NN_GRID_STRIDE(i, rows * v) {
    const std::int64_t r = i / v, j = i % v;
    const std::int64_t t = targets[r];
    if (t == ignore_index) {
      gx[i] = 0.f;
    } else {
      gx[i] = scale * (expf(x[i] - lse[r]) - (j == t ? 1.f : 0.f));
    }
  }
}

// ---- embedding ----------------------------------------------------------------------------------------------
__global__ void CheckIndicesKernel(const std::int64_t* idx, std::int64_t n, std::int64_t vocab,
                                   unsigned long long* bad) {
  SK_NN_GRID_STRIDE(i, n) {
    if (idx[i] < 0 || idx[i] >= vocab) atomicMin(bad, static_cast<unsigned long long>(i));
  }
}

__global__ void EmbeddingKernel(const float* w, const std::int64_t* idx, float* y, std::int64_t n, std::int64_t c,
                                std::int64_t vocab) {
  SK_NN_GRID_STRIDE(i, n * c) {
    const std::int64_t row = i / c;
    const std::int64_t k = idx[row];
    if (k < 0 || k >= vocab) {
      y[i] = 0.f;  // reported by CheckIndicesKernel
    } else {
      y[i] = w[k * c + i % c];
    }
  }
}

__global__ void EmbeddingBackwardKernel(const std::int64_t* idx, const float* gy, float* gw, std::int64_t n,
                                        std::int64_t c) {
  SK_NN_GRID_STRIDE(i, n * c) atomicAdd(gw + idx[i / c] * c + i % c, gy[i]);
}

unsigned RowBlocks(std::int64_t rows) {
  return static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock);
}

// A device word set to "none" (all ones) for atomicMin, read back (synchronously) by Read().
class FirstBad {
 public:
  FirstBad() : word_(1) {
    SK_CUDA_CHECK(cudaMemsetAsync(word_.get(), 0xff, sizeof(unsigned long long), cudaStreamPerThread));
  }
  unsigned long long* get() const { return word_.get(); }
  std::int64_t Read() const {
    unsigned long long v = 0;
    SK_CUDA_CHECK(cudaMemcpyAsync(&v, get(), sizeof v, cudaMemcpyDeviceToHost, cudaStreamPerThread));
    SK_CUDA_CHECK(cudaStreamSynchronize(cudaStreamPerThread));
    return v == ~0ull ? -1 : static_cast<std::int64_t>(v);
  }

 private:
  StreamScratch<unsigned long long> word_;
};

}  // namespace

namespace cuda_impl {

void broadcast_rows(Device device, RowOp op, const float* a, const float* b, float* out, std::int64_t rows,
                    std::int64_t n) {
  if (rows * n == 0) return;
  DeviceGuard guard(device);
  const unsigned grid = GridFor(rows * n);
  switch (op) {
    case RowOp::add:
      BroadcastRowsKernel<RowOp::add><<<grid, kThreads, 0, cudaStreamPerThread>>>(a, b, out, rows, n);
      break;
    case RowOp::sub:
      BroadcastRowsKernel<RowOp::sub><<<grid, kThreads, 0, cudaStreamPerThread>>>(a, b, out, rows, n);
      break;
    case RowOp::mul:
      BroadcastRowsKernel<RowOp::mul><<<grid, kThreads, 0, cudaStreamPerThread>>>(a, b, out, rows, n);
      break;
    case RowOp::assign:
      BroadcastRowsKernel<RowOp::assign><<<grid, kThreads, 0, cudaStreamPerThread>>>(nullptr, b, out, rows, n);
      break;
  }
  CheckLaunch("cuda::broadcast_rows");
}

void sum_rows(Device device, const float* x, float* out, std::int64_t rows, std::int64_t n, bool accumulate) {
  DeviceGuard guard(device);
  ColumnSums(PlainTerm{x}, out, rows, n, accumulate);
}

void gelu(Device device, bool tanh_approx, const float* x, float* y, std::int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  GeluKernel<<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(tanh_approx, x, y, n);
  CheckLaunch("cuda::gelu");
}

void gelu_backward(Device device, bool tanh_approx, const float* x, const float* gy, float* gx, std::int64_t n) {
  if (n == 0) return;
  DeviceGuard guard(device);
  GeluBackwardKernel<<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(tanh_approx, x, gy, gx, n);
  CheckLaunch("cuda::gelu_backward");
}

void layer_norm(Device device, const float* x, const float* w, const float* b, float* y, float* mean, float* rstd,
                std::int64_t rows, std::int64_t c, float eps) {
  if (rows == 0) return;
  DeviceGuard guard(device);
  LayerNormKernel<<<RowBlocks(rows), kThreads, 0, cudaStreamPerThread>>>(x, w, b, y, mean, rstd, rows, c, eps);
  CheckLaunch("cuda::layer_norm");
}

void layer_norm_backward(Device device, const float* x, const float* gy, const float* w, const float* mean,
                         const float* rstd, float* gx, float* gw, float* gb, std::int64_t rows, std::int64_t c) {
  DeviceGuard guard(device);
  if (gx != nullptr && rows > 0) {
    LayerNormBackwardKernel<<<RowBlocks(rows), kThreads, 0, cudaStreamPerThread>>>(x, gy, w, mean, rstd, gx, rows,
                                                                                     c);
    CheckLaunch("cuda::layer_norm_backward");
  }
  if (gw != nullptr) ColumnSums(NormWeightTerm{x, gy, mean, rstd}, gw, rows, c, /*accumulate=*/false);
  if (gb != nullptr) ColumnSums(PlainTerm{gy}, gb, rows, c, /*accumulate=*/false);
}

// Calls launch(std::integral_constant<int, k>) with the smallest k in {4, 8, 16, 32} such that 32 k >= t: the
// register kernels' columns per lane (Note [softmax rows in registers]); k = 0 for longer rows (the streaming
// kernels).
template <typename Launch>
void ByRowLength(std::int64_t t, Launch&& launch) {
  if (t <= 32 * 4) return launch(std::integral_constant<int, 4>{});
  if (t <= 32 * 8) return launch(std::integral_constant<int, 8>{});
  if (t <= 32 * 16) return launch(std::integral_constant<int, 16>{});
  if (t <= 32 * 32) return launch(std::integral_constant<int, 32>{});
  return launch(std::integral_constant<int, 0>{});
}

// The bf16 copies' padding, zeroed before a softmax kernel writes the rest of them (t % 8 == 0: none).
static void ZeroCopyPadding(void* out16, std::int64_t matrices, std::int64_t t) {
  if (out16 == nullptr || t % kBf16PadTo == 0) return;
  const std::size_t bytes = static_cast<std::size_t>(matrices * packed_bf16_numel(t, t)) * sizeof(__nv_bfloat16);
  SK_CUDA_CHECK(cudaMemsetAsync(out16, 0, bytes, cudaStreamPerThread));
}

void causal_softmax(Device device, float* s, std::int64_t matrices, std::int64_t t, void* out16) {
  if (matrices * t == 0) return;
  DeviceGuard guard(device);
  ZeroCopyPadding(out16, matrices, t);
  auto* o = static_cast<__nv_bfloat16*>(out16);
  ByRowLength(t, [&](auto per_lane) {
    constexpr int k = decltype(per_lane)::value;
    if constexpr (k == 0) {
      CausalSoftmaxKernel<<<RowBlocks(matrices * t), kThreads, 0, cudaStreamPerThread>>>(s, o, matrices * t, t);
    } else {
      CausalSoftmaxRowKernel<k><<<RowBlocks(matrices * t), kThreads, 0, cudaStreamPerThread>>>(s, o, matrices * t,
                                                                                               t);
    }
  });
  CheckLaunch("cuda::causal_softmax");
}

void causal_softmax_backward(Device device, const float* p, float* dp, std::int64_t matrices, std::int64_t t,
                             void* out16) {
  if (matrices * t == 0) return;
  DeviceGuard guard(device);
  ZeroCopyPadding(out16, matrices, t);
  auto* o = static_cast<__nv_bfloat16*>(out16);
  ByRowLength(t, [&](auto per_lane) {
    constexpr int k = decltype(per_lane)::value;
    if constexpr (k == 0) {
      CausalSoftmaxBackwardKernel<<<RowBlocks(matrices * t), kThreads, 0, cudaStreamPerThread>>>(p, dp, o,
                                                                                                  matrices * t, t);
    } else {
      CausalSoftmaxBackwardRowKernel<k>
          <<<RowBlocks(matrices * t), kThreads, 0, cudaStreamPerThread>>>(p, dp, o, matrices * t, t);
    }
  });
  CheckLaunch("cuda::causal_softmax_backward");
}

std::int64_t cross_entropy(Device device, const float* logits, const std::int64_t* targets, float* lse, float* loss,
                           float* count, std::int64_t rows, std::int64_t v, std::int64_t ignore_index) {
  DeviceGuard guard(device);
  FirstBad bad;
  if (rows > 0) {
    RowLogSumExpKernel<<<static_cast<unsigned>(rows), kThreads, 0, cudaStreamPerThread>>>(logits, targets, lse, v,
                                                                                           ignore_index);
    CheckLaunch("cuda::cross_entropy (log-sum-exp)");
  }
  CrossEntropyLossKernel<<<1, kThreads, 0, cudaStreamPerThread>>>(logits, targets, lse, loss, count, bad.get(), rows,
                                                                  v, ignore_index);
  CheckLaunch("cuda::cross_entropy (loss)");
  return bad.Read();
}

void cross_entropy_backward(Device device, const float* logits, const std::int64_t* targets, const float* lse,
                            const float* gloss, const float* count, float* gx, std::int64_t rows, std::int64_t v,
                            std::int64_t ignore_index) {
  if (rows * v == 0) return;
  DeviceGuard guard(device);
  CrossEntropyBackwardKernel<<<GridFor(rows * v, 65536), kThreads, 0, cudaStreamPerThread>>>(
      logits, targets, lse, gloss, count, gx, rows, v, ignore_index);
  CheckLaunch("cuda::cross_entropy_backward");
}

std::int64_t embedding(Device device, const float* weight, const std::int64_t* indices, float* y, std::int64_t n,
                       std::int64_t c, std::int64_t vocab) {
  if (n == 0) return -1;
  DeviceGuard guard(device);
  FirstBad bad;
  CheckIndicesKernel<<<GridFor(n), kThreads, 0, cudaStreamPerThread>>>(indices, n, vocab, bad.get());
  CheckLaunch("cuda::embedding (indices)");
  if (c > 0) {
    EmbeddingKernel<<<GridFor(n * c, 65536), kThreads, 0, cudaStreamPerThread>>>(weight, indices, y, n, c, vocab);
    CheckLaunch("cuda::embedding");
  }
  return bad.Read();
}

void embedding_backward(Device device, const std::int64_t* indices, const float* gy, float* gw, std::int64_t n,
                        std::int64_t c) {
  if (n * c == 0) return;
  DeviceGuard guard(device);
  EmbeddingBackwardKernel<<<GridFor(n * c, 65536), kThreads, 0, cudaStreamPerThread>>>(indices, gy, gw, n, c);
  CheckLaunch("cuda::embedding_backward");
}

void copy_2d(Device device, const void* src, std::size_t src_pitch, void* dst, std::size_t dst_pitch,
             std::size_t width, std::int64_t height) {
  if (width == 0 || height == 0) return;
  DeviceGuard guard(device);
  if (height == 1) {  // one row: a plain copy (the pitches may then exceed what a 2-d copy accepts)
    SK_CUDA_CHECK(cudaMemcpyAsync(dst, src, width, cudaMemcpyDeviceToDevice, cudaStreamPerThread));
    return;
  }
  SK_CUDA_CHECK(cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, width, static_cast<std::size_t>(height),
                                  cudaMemcpyDeviceToDevice, cudaStreamPerThread));
}

}  // namespace cuda_impl
}  // namespace shardkit::kernels::cuda
