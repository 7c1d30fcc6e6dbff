// A CPU emulation of shardkit::cuda's seams (Note [cuda emulator]), for tests only: built with
// -DSHARDKIT_CUDA_EMULATOR=ON in a build without CUDA (CI's sanitizer job), linked into the test binaries whose
// CUDA cases would otherwise skip.
//
// Note [cuda emulator]
// No session of this project is sure to have a GPU, so the code paths that run on CUDA tensors (device memory,
// Tensor::to / copy_ between devices, the autograd ops' device dispatch, the optimizers' device kernels, the
// in-process backend's CUDA path, DDP / OSS / ShardedDDP / FSDP on CUDA parameters) would otherwise never run in CI.
// This file registers, through the same seams shardkit::cuda registers (Note [cuda component]), an emulated device
// 0 with what catches the mistakes those paths can make without a GPU:
//   - device memory is mmap'd and kept PROT_NONE except while an emulated kernel or copy runs, so the host reading
//     or writing device memory faults at the access;
//   - fresh device memory is filled with 0xff bytes (NaN floats), so a read of bytes nobody wrote shows;
//   - each thread's kernels are queued and run only when that thread synchronises (a reduction, a copy to the
//     host, cuda_synchronize), or when a free on the legacy stream runs everything queued: work read before its
//     stream is waited for reads stale bytes, as on a GPU;
//   - every pointer a kernel is given must lie inside one device allocation, and cuBLAS calls check their leading
//     dimensions as cuBLAS does (column-major, CUBLAS_STATUS_INVALID_VALUE).
// The kernels compute in plain CPU fp32 loops mirroring the .cu files (warp sums as 32 lane partials, column sums
// in chunks of 64 rows), under one process-wide lock: the emulated device is process-global state, as a real
// device is. It does not emulate the .cu code itself, numerics of cuBLAS or GPU reductions, concurrency between
// streams, several devices, page locking (its pinned memory is the heap's) or NCCL (the NCCL cases still skip).
// Passing here is no evidence of speed or of the device kernels' correctness; failing here is a bug in the device
// paths (or in this file).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <set>
#include <atomic>
#include <bit>
#include <cstdint>

#include "common/kernels/cuda/bf16_gemm_plan.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/gemm.h"
#include "common/optim/cuda/cuda_optim_kernels.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/tensor.h"

namespace shardkit {
namespace {

// Device memory: blocks of one reserved region (kArenaBytes of address space, pages only where used), in power-of-
// two size classes of at least 256 bytes (cudaMalloc's alignment), reused through per-class free lists. Blocks are
// PROT_NONE; while an emulated kernel or copy runs (an Open scope), each block it is given (Dev() checks every
// pointer) is made accessible, and every such block is PROT_NONE again when the outermost scope closes.
constexpr std::size_t kArenaBytes = std::size_t{16} << 30;
constexpr std::size_t kMinBlock = 256;
char* g_arena = nullptr;
std::size_t g_arena_used = 0;                             // bytes handed out from the region's start (high water)
std::map<std::size_t, std::vector<char*>> g_free_blocks;  // class size -> blocks
std::map<char*, std::size_t> g_allocs;                    // base -> requested bytes
int g_open = 0;
std::vector<std::pair<char*, std::size_t>> g_opened;  // blocks made accessible in the current Open scope
std::set<char*> g_opened_bases;                       // their bases

std::size_t PageSize() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }
std::size_t BlockSize(std::size_t n) { return std::bit_ceil(std::max(n, kMinBlock)); }
// The pages covering [p, p + n), made `prot`.
void Protect(char* p, std::size_t n, int prot) {
  const std::size_t pg = PageSize();
  const auto lo = reinterpret_cast<std::uintptr_t>(p) / pg * pg;
  const auto hi = (reinterpret_cast<std::uintptr_t>(p) + n + pg - 1) / pg * pg;
  if (hi > lo) mprotect(reinterpret_cast<void*>(lo), hi - lo, prot);
}
struct Open {
  Open() { ++g_open; }
  ~Open() {
    if (--g_open > 0) return;
    for (const auto& [p, size] : g_opened) Protect(p, size, PROT_NONE);
    g_opened.clear();
    g_opened_bases.clear();
  }
};

[[noreturn]] void Fail(const std::string& m) {
  std::fprintf(stderr, "cuda emulator: %s\n", m.c_str());
  throw std::runtime_error("cuda emulator: " + m);
}

// ptr .. ptr+bytes lies in one device allocation (bytes == 0: only the base is checked when non-null).
void Dev(const void* ptr, std::size_t bytes, const char* what) {
  if (bytes == 0) return;
  if (ptr == nullptr) Fail(std::string(what) + ": null device pointer for a non-empty range");
  const char* p = static_cast<const char*>(ptr);
  auto it = g_allocs.upper_bound(const_cast<char*>(p));
  if (it == g_allocs.begin()) Fail(std::string(what) + ": pointer not in device memory");
  --it;
  if (p < it->first || p + bytes > it->first + it->second) {
    Fail(std::string(what) + ": range [" + std::to_string(p - it->first) + ", +" + std::to_string(bytes) +
         ") outside its allocation of " + std::to_string(it->second) + " bytes (or a host pointer)");
  }
  // Inside a kernel or copy: its block becomes accessible until the outermost Open scope closes.
  if (g_open > 0 && g_opened_bases.insert(it->first).second) {
    g_opened.emplace_back(it->first, BlockSize(it->second));
    Protect(it->first, BlockSize(it->second), PROT_READ | PROT_WRITE);
  }
}
void Guard(Device d) {
  if (!d.is_cuda()) Fail("kernel on " + d.str());
}
void Grid(std::int64_t x, std::int64_t y, const char* what) {
  if (x < 1 || x > 2147483647LL || y < 1 || y > 65535) Fail(std::string(what) + ": bad grid");
}

// ---- streams: each thread's kernels are queued and run only when that thread synchronises (or a legacy-stream
// free / a device-wide flush runs everything queued).
std::recursive_mutex g_mu;
struct Stream { std::deque<std::function<void()>> q; };
std::set<Stream*> g_streams;
void RunQueue(Stream* s) {
  if (s->q.empty()) return;
  Open o;
  while (!s->q.empty()) {
    auto f = std::move(s->q.front());
    s->q.pop_front();
    f();
  }
}
struct StreamHolder {
  Stream s;
  StreamHolder() { std::lock_guard<std::recursive_mutex> l(g_mu); g_streams.insert(&s); }
  ~StreamHolder() { std::lock_guard<std::recursive_mutex> l(g_mu); RunQueue(&s); g_streams.erase(&s); }
};
Stream* Mine() { thread_local StreamHolder h; return &h.s; }
void FlushMine() { std::lock_guard<std::recursive_mutex> l(g_mu); RunQueue(Mine()); }
void FlushAll() { std::lock_guard<std::recursive_mutex> l(g_mu); for (Stream* s : g_streams) RunQueue(s); }
void Enqueue(std::function<void()> f) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  Mine()->q.push_back(std::move(f));
}
template <auto F> struct Defer;
template <typename... A, void (*F)(A...)> struct Defer<F> {
  static void run(A... a) { Enqueue([=] { F(a...); }); }
};
template <auto F> struct Synced;
template <typename R, typename... A, R (*F)(A...)> struct Synced<F> {
  static R run(A... a) { std::lock_guard<std::recursive_mutex> l(g_mu); RunQueue(Mine()); return F(a...); }
};

// ---- memory ----
void* Allocate(Device d, std::size_t nbytes) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  Guard(d);
  if (g_arena == nullptr) {
    void* region = mmap(nullptr, kArenaBytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (region == MAP_FAILED) Fail("mmap of the emulated device memory");
    g_arena = static_cast<char*>(region);
  }
  const std::size_t size = BlockSize(nbytes);
  char* p = nullptr;
  if (auto& blocks = g_free_blocks[size]; !blocks.empty()) {
    p = blocks.back();
    blocks.pop_back();
  } else {
    if (g_arena_used + size > kArenaBytes) Fail("out of emulated device memory");
    p = g_arena + g_arena_used;
    g_arena_used += size;
  }
  Protect(p, size, PROT_READ | PROT_WRITE);
  std::memset(p, 0xff, size);  // NaN floats: a read of bytes nobody wrote shows
  Protect(p, size, PROT_NONE);
  g_allocs[p] = nbytes;
  return p;
}
// cudaFreeAsync on the legacy stream: after everything every thread queued so far.
void Free(Device, void* p) noexcept {
  if (p == nullptr) return;
  std::lock_guard<std::recursive_mutex> l(g_mu);
  FlushAll();
  auto it = g_allocs.find(static_cast<char*>(p));
  if (it == g_allocs.end()) {
    std::fprintf(stderr, "cuda emulator: free of unknown pointer\n");
    std::abort();
  }
  g_free_blocks[BlockSize(it->second)].push_back(it->first);
  g_allocs.erase(it);
}
void Zero(Device d, void* p, std::size_t n) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  RunQueue(Mine());
  Guard(d);
  Open o;
  Dev(p, n, "cuda_zero");
  std::memset(p, 0, n);
}
// Pinned host memory is host memory the host may touch: the heap, 64-byte aligned as Storage requires.
void* HostAlloc(std::size_t nbytes) noexcept { return std::aligned_alloc(64, (std::max<std::size_t>(nbytes, 1) + 63) / 64 * 64); }
void HostFree(void* p) noexcept { std::free(p); }
void SyncDev(Device d) { Guard(d); FlushMine(); }
int Count() noexcept { return 1; }

// A value rounded to bf16 (to nearest even) and back.
float B16(float x) { return bf16_to_f32(f32_to_bf16(x)); }

// An operand as tensor cores see it below MatmulPrecision::highest: each value rounded to nearest even, to
// bf16 (medium) or to TF32's 10-bit mantissa (high); NaN and infinities kept.
std::vector<float> Rounded(const float* x, std::size_t n, MatmulPrecision p) {
  std::vector<float> out(x, x + n);
  for (float& v : out) {
    if (!std::isfinite(v)) continue;
    if (p == MatmulPrecision::medium) {
      v = B16(v);
    } else {
      const std::uint32_t bits = std::bit_cast<std::uint32_t>(v);
      v = std::bit_cast<float>((bits + 0xfffu + ((bits >> 13) & 1u)) & ~0x1fffu);
    }
  }
  return out;
}

// ---- cuBLAS column-major sgemm (cublasGemmEx with a FAST_TF32 / FAST_16BF compute type below highest) with its
// argument checks ----
void Sgemm(bool ta, bool tb, std::int64_t m, std::int64_t n, std::int64_t k, float alpha, const float* a,
           std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc,
           MatmulPrecision precision, const char* what) {
  if (m < 0 || n < 0 || k < 0) Fail(std::string(what) + ": negative");
  if (lda < std::max<std::int64_t>(1, ta ? k : m)) Fail(std::string(what) + ": CUBLAS_STATUS_INVALID_VALUE lda");
  if (ldb < std::max<std::int64_t>(1, tb ? n : k)) Fail(std::string(what) + ": CUBLAS_STATUS_INVALID_VALUE ldb");
  if (ldc < std::max<std::int64_t>(1, m)) Fail(std::string(what) + ": CUBLAS_STATUS_INVALID_VALUE ldc");
  if (m == 0 || n == 0) return;
  // extents
  const std::int64_t a_cols = ta ? m : k, a_rows = ta ? k : m;
  const std::int64_t b_cols = tb ? k : n, b_rows = tb ? n : k;
  const std::size_t a_extent = static_cast<std::size_t>((a_cols - 1) * lda + a_rows);
  const std::size_t b_extent = static_cast<std::size_t>((b_cols - 1) * ldb + b_rows);
  if (k > 0 && alpha != 0.f) {
    Dev(a, a_extent * 4, "gemm A");
    Dev(b, b_extent * 4, "gemm B");
  }
  Dev(c, static_cast<std::size_t>((n - 1) * ldc + m) * 4, "gemm C");
  // Column-major C = op(A) op(B) is row-major C^T = op(B)^T op(A)^T: the CPU GEMM with the operands swapped.
  if (precision == MatmulPrecision::highest || k == 0 || alpha == 0.f) {
    kernels::gemm(tb, ta, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc);
    return;
  }
  // "medium" falls back to TF32 where bf16 copies would not pay (the GEMM's m, n: this one's n, m).
  const MatmulPrecision p = precision == MatmulPrecision::medium && !medium_gemm_uses_bf16(n, m) ? MatmulPrecision::high
                                                                                                 : precision;
  const std::vector<float> ra = Rounded(a, a_extent, p), rb = Rounded(b, b_extent, p);
  kernels::gemm(tb, ta, n, m, k, alpha, rb.data(), ldb, ra.data(), lda, beta, c, ldc);
}

void Gemm(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k, float alpha,
          const float* a, std::int64_t lda, const float* b, std::int64_t ldb, float beta, float* c, std::int64_t ldc,
          MatmulPrecision precision) {
  if (m < 0 || n < 0 || k < 0) Fail("gemm negative");
  if (m == 0 || n == 0) return;
  Guard(device);
  Open o;
  if (k == 0 || alpha == 0.f) {
    Dev(c, static_cast<std::size_t>((m - 1) * ldc + n) * 4, "gemm scale C");
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) {
        float* p = c + i * ldc + j;
        *p = beta == 0.f ? 0.f : beta * *p;
      }
    return;
  }
  Sgemm(trans_b, trans_a, n, m, k, alpha, b, ldb, a, lda, beta, c, ldc, precision, "cublasSgemm");
}

void GemmStridedBatched(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                        float alpha, const float* a, std::int64_t lda, std::int64_t stride_a, const float* b,
                        std::int64_t ldb, std::int64_t stride_b, float beta, float* c, std::int64_t ldc,
                        std::int64_t stride_c, std::int64_t batches, MatmulPrecision precision) {
  if (m < 0 || n < 0 || k < 0 || batches < 0) Fail("gemm_strided_batched negative");
  if (m == 0 || n == 0 || batches == 0) return;
  if (k == 0 || alpha == 0.f) {
    for (std::int64_t i = 0; i < batches; ++i) Gemm(device, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c + i * stride_c, ldc, precision);
    return;
  }
  Guard(device);
  Open o;
  for (std::int64_t i = 0; i < batches; ++i) {
    Sgemm(trans_b, trans_a, n, m, k, alpha, b + i * stride_b, ldb, a + i * stride_a, lda, beta, c + i * stride_c, ldc,
          precision, "cublasSgemmStridedBatched");
  }
}

// The packed bf16 copy (Note [padded bf16 copies] in common/kernels/cuda/bf16_gemm_plan.h): rows x cols rounded up to
// multiples of 8, zeros beyond.
void PackBf16(Device device, const float* src, std::int64_t rows, std::int64_t cols, std::int64_t ld, void* dst) {
  if (rows == 0 || cols == 0) return;  // the arguments were checked by the dispatch
  Guard(device);
  Open o;
  const std::int64_t pad_cols = kernels::cuda::round_up_to_pad(cols);
  Dev(src, static_cast<std::size_t>((rows - 1) * ld + cols) * 4, "pack_bf16 src");
  Dev(dst, static_cast<std::size_t>(kernels::cuda::packed_bf16_numel(rows, cols)) * 2, "pack_bf16 dst");
  auto* out = static_cast<bf16_t*>(dst);
  for (std::int64_t i = 0; i < kernels::cuda::round_up_to_pad(rows); ++i) {
    for (std::int64_t j = 0; j < pad_cols; ++j) {
      out[i * pad_cols + j] = f32_to_bf16(i < rows && j < cols ? src[i * ld + j] : 0.f);
    }
  }
}

// cublasGemmEx on the copies: the operands widened back to fp32 as stored (leading dimension: the copy's padded
// width), then the CPU GEMM as Sgemm runs a "medium" product on bf16-rounded operands.
void GemmOnBf16Copies(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n, std::int64_t k,
                      float alpha, const void* a16, const void* b16, float beta, float* c, std::int64_t ldc) {
  Guard(device);  // the arguments were checked by the dispatch (cuda_kernels_dispatch.cc)
  Open o;
  Dev(c, static_cast<std::size_t>((m - 1) * ldc + n) * 4, "gemm_on_bf16_copies C");
  if (alpha == 0.f) {
    for (std::int64_t i = 0; i < m; ++i)
      for (std::int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0.f ? 0.f : beta * c[i * ldc + j];
    return;
  }
  auto widen = [](const void* p, std::int64_t rows, std::int64_t cols, const char* what) {
    const std::int64_t numel = kernels::cuda::packed_bf16_numel(rows, cols);
    Dev(p, static_cast<std::size_t>(numel) * 2, what);
    std::vector<float> v(static_cast<std::size_t>(numel));
    for (std::int64_t i = 0; i < numel; ++i) v[static_cast<std::size_t>(i)] = bf16_to_f32(static_cast<const bf16_t*>(p)[i]);
    return v;
  };
  const std::vector<float> a = trans_a ? widen(a16, k, m, "gemm A") : widen(a16, m, k, "gemm A");
  const std::vector<float> b = trans_b ? widen(b16, n, k, "gemm B") : widen(b16, k, n, "gemm B");
  const std::int64_t lda = kernels::cuda::round_up_to_pad(trans_a ? m : k);
  const std::int64_t ldb = kernels::cuda::round_up_to_pad(trans_b ? k : n);
  kernels::gemm(trans_a, trans_b, m, n, k, alpha, a.data(), lda, b.data(), ldb, beta, c, ldc);
}

// cublasGemmStridedBatchedEx on A's packed copies and B copied to bf16 (gemm.cu): A widened back to fp32 as stored,
// B rounded to bf16 as Sgemm rounds a "medium" operand, then the CPU GEMM per matrix.
void GemmStridedBatchedOnBf16A(Device device, bool trans_a, bool trans_b, std::int64_t m, std::int64_t n,
                               std::int64_t k, float alpha, const void* a16, const float* b, std::int64_t ldb,
                               std::int64_t stride_b, float beta, float* c, std::int64_t ldc, std::int64_t stride_c,
                               std::int64_t batches) {
  Guard(device);  // the arguments were checked by the dispatch (cuda_kernels_dispatch.cc)
  Open o;
  const std::int64_t a_rows = trans_a ? k : m, a_cols = trans_a ? m : k;
  const std::int64_t b_rows = trans_b ? n : k, b_cols = trans_b ? k : n;
  const std::int64_t a_numel = kernels::cuda::packed_bf16_numel(a_rows, a_cols);
  const std::int64_t lda = kernels::cuda::round_up_to_pad(a_cols);
  if (alpha != 0.f) Dev(a16, static_cast<std::size_t>(batches * a_numel) * 2, "gemm_on_bf16_a A");
  std::vector<float> a(static_cast<std::size_t>(a_numel));
  for (std::int64_t bi = 0; bi < batches; ++bi) {
    float* cb = c + bi * stride_c;
    Dev(cb, static_cast<std::size_t>((m - 1) * ldc + n) * 4, "gemm_on_bf16_a C");
    if (alpha == 0.f) {
      for (std::int64_t i = 0; i < m; ++i)
        for (std::int64_t j = 0; j < n; ++j) cb[i * ldc + j] = beta == 0.f ? 0.f : beta * cb[i * ldc + j];
      continue;
    }
    const float* bb = b + bi * stride_b;
    const std::size_t b_extent = static_cast<std::size_t>((b_rows - 1) * ldb + b_cols);
    Dev(bb, b_extent * 4, "gemm_on_bf16_a B");
    const auto* ab = static_cast<const bf16_t*>(a16) + bi * a_numel;
    for (std::int64_t i = 0; i < a_numel; ++i) a[static_cast<std::size_t>(i)] = bf16_to_f32(ab[i]);
    const std::vector<float> rb = Rounded(bb, b_extent, MatmulPrecision::medium);
    kernels::gemm(trans_a, trans_b, m, n, k, alpha, a.data(), lda, rb.data(), ldb, beta, cb, ldc);
  }
}

std::string CublasError() { return ""; }

// ---- reductions / elementwise ----
std::vector<float> AsF32(const void* x, DType dt, std::int64_t n) {
  std::vector<float> v(static_cast<std::size_t>(n));
  convert_elements(x, dt, v.data(), DType::f32, n);
  return v;
}
double Sum(Device d, const void* x, DType dt, std::int64_t n) {
  Guard(d); Open o; Dev(x, n * dtype_size(dt), "sum");
  double s = 0; for (float f : AsF32(x, dt, n)) s += f; return s;
}
double SumSq(Device d, const void* x, DType dt, std::int64_t n) {
  Guard(d); Open o; Dev(x, n * dtype_size(dt), "sum_squares");
  double s = 0; for (float f : AsF32(x, dt, n)) s += double(f) * f; return s;
}
double MaxAbs(Device d, const void* x, DType dt, std::int64_t n) {
  Guard(d); Open o; Dev(x, n * dtype_size(dt), "max_abs");
  double s = 0;
  for (float f : AsF32(x, dt, n)) {
    if (std::isnan(f)) return f;  // NaN propagates, as in the device kernel
    s = std::max(s, double(std::fabs(f)));
  }
  return s;
}
#define EW(NAME, EXPR)                                                                              \
  void NAME(Device d, const float* a, const float* b, float* out, std::int64_t n) {                 \
    Guard(d); Open o; Dev(a, n * 4, #NAME); Dev(b, n * 4, #NAME); Dev(out, n * 4, #NAME);          \
    for (std::int64_t i = 0; i < n; ++i) out[i] = EXPR;                                            \
  }
EW(Add, a[i] + b[i])
EW(Sub, a[i] - b[i])
EW(Mul, a[i] * b[i])
void Scale(Device d, float s, const float* a, float* out, std::int64_t n) {
  Guard(d); Open o; Dev(a, n * 4, "scale"); Dev(out, n * 4, "scale");
  for (std::int64_t i = 0; i < n; ++i) out[i] = s * a[i];
}
void Axpy(Device d, float al, const float* x, float* y, std::int64_t n) {
  Guard(d); Open o; Dev(x, n * 4, "axpy"); Dev(y, n * 4, "axpy");
  for (std::int64_t i = 0; i < n; ++i) y[i] += al * x[i];
}
void Axpby(Device d, float al, const float* x, float be, float* y, std::int64_t n) {
  Guard(d); Open o; Dev(x, n * 4, "axpby"); Dev(y, n * 4, "axpby");
  for (std::int64_t i = 0; i < n; ++i) y[i] = al * x[i] + be * y[i];
}
void Fill(Device d, float* x, std::int64_t n, float v) {
  Guard(d); Open o; Dev(x, n * 4, "fill");
  for (std::int64_t i = 0; i < n; ++i) x[i] = v;
}
void Cast(Device d, const void* src, DType sd, void* dst, DType dd, std::int64_t n) {
  if (n == 0) return;
  Guard(d); Open o; Dev(src, n * dtype_size(sd), "cast src"); Dev(dst, n * dtype_size(dd), "cast dst");
  if (sd == dd) { std::memmove(dst, src, n * dtype_size(sd)); return; }
  convert_elements(src, sd, dst, dd, n);
}
void CopyBytes(const void* src, Device sd, void* dst, Device dd, std::size_t nbytes) {
  if (nbytes == 0) return;
  Open o;
  if (sd.is_cuda()) Dev(src, nbytes, "copy_bytes src");
  if (dd.is_cuda()) Dev(dst, nbytes, "copy_bytes dst");
  std::memmove(dst, src, nbytes);
}

// ---- the kernels behind the autograd ops (nn_ops.cu), threads emulated ----
using kernels::cuda::RowOp;
constexpr std::int64_t kRowsPerChunk = 64;

void BroadcastRows(Device d, RowOp op, const float* a, const float* b, float* out, std::int64_t rows, std::int64_t n) {
  if (rows * n == 0) return;
  Guard(d); Open o;
  if (op != RowOp::assign) Dev(a, rows * n * 4, "broadcast_rows a");
  Dev(b, n * 4, "broadcast_rows b"); Dev(out, rows * n * 4, "broadcast_rows out");
  for (std::int64_t i = 0; i < rows * n; ++i) {
    const float x = op != RowOp::assign ? a[i] : 0.f;
    const float y = b[i % n];
    switch (op) {
      case RowOp::add: out[i] = x + y; break;
      case RowOp::sub: out[i] = x - y; break;
      case RowOp::mul: out[i] = x * y; break;
      case RowOp::assign: out[i] = y; break;
    }
  }
}

template <typename Term>
void ColumnSums(Term term, float* out, std::int64_t rows, std::int64_t n, bool accumulate) {
  if (n == 0) return;
  const std::int64_t chunks = (rows + kRowsPerChunk - 1) / kRowsPerChunk;
  Dev(out, n * 4, "column sums out");
  if (chunks == 0) {
    if (!accumulate) std::memset(out, 0, n * 4);
    return;
  }
  if (chunks > 65535) Fail("chunks");
  Grid((n + 255) / 256, chunks, "column sums");
  std::vector<float> partials(static_cast<std::size_t>(chunks * n), std::nanf(""));
  for (std::int64_t chunk = 0; chunk < chunks; ++chunk)
    for (std::int64_t j = 0; j < n; ++j) {
      const std::int64_t r0 = chunk * kRowsPerChunk, r1 = std::min(rows, r0 + kRowsPerChunk);
      float acc = 0.f;
      for (std::int64_t r = r0; r < r1; ++r) acc += term(r, j, n);
      partials[chunk * n + j] = acc;
    }
  for (std::int64_t j = 0; j < n; ++j) {
    float acc = accumulate ? out[j] : 0.f;
    for (std::int64_t c = 0; c < chunks; ++c) acc += partials[c * n + j];
    out[j] = acc;
  }
}

void SumRows(Device d, const float* x, float* out, std::int64_t rows, std::int64_t n, bool accumulate) {
  Guard(d); Open o;
  Dev(x, rows * n * 4, "sum_rows x");
  ColumnSums([x](std::int64_t r, std::int64_t j, std::int64_t n) { return x[r * n + j]; }, out, rows, n, accumulate);
}

constexpr float kGeluC = 0.7978845608028654f, kGeluA = 0.044715f, kInvSqrt2Pi = 0.3989422804014327f;
float NormCdf(float v) { return 0.5f * std::erfc(-v / std::sqrt(2.f)); }
void Gelu(Device d, bool th, const float* x, float* y, std::int64_t n) {
  if (n == 0) return;
  Guard(d); Open o; Dev(x, n * 4, "gelu x"); Dev(y, n * 4, "gelu y");
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    y[i] = th ? 0.5f * v * (1.f + std::tanh(kGeluC * (v + kGeluA * v * v * v))) : v * NormCdf(v);
  }
}
void GeluBackward(Device d, bool th, const float* x, const float* gy, float* gx, std::int64_t n) {
  if (n == 0) return;
  Guard(d); Open o; Dev(x, n * 4, "gelu_b x"); Dev(gy, n * 4, "gelu_b gy"); Dev(gx, n * 4, "gelu_b gx");
  for (std::int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    if (th) {
      const float t = std::tanh(kGeluC * (v + kGeluA * v * v * v));
      const float du = kGeluC * (1.f + 3.f * kGeluA * v * v);
      gx[i] = gy[i] * (0.5f * (1.f + t) + 0.5f * v * (1.f - t * t) * du);
    } else {
      gx[i] = gy[i] * (NormCdf(v) + v * kInvSqrt2Pi * std::exp(-0.5f * v * v));
    }
  }
}

// Warp emulation: per-lane partials of f(j) over j = lane, lane + 32, ... < end, summed.
template <typename F>
float WarpSumOf(std::int64_t end, F f) {
  float lanes[32] = {};
  for (int lane = 0; lane < 32; ++lane)
    for (std::int64_t j = lane; j < end; j += 32) lanes[lane] += f(j);
  float s = 0; for (float v : lanes) s += v; return s;
}

void LayerNorm(Device d, const float* x, const float* w, const float* b, float* y, float* mean_out, float* rstd_out,
               std::int64_t rows, std::int64_t c, float eps) {
  if (rows == 0) return;
  Guard(d); Open o;
  Grid((rows + 7) / 8, 1, "layer_norm");
  Dev(x, rows * c * 4, "ln x"); Dev(y, rows * c * 4, "ln y");
  if (w) Dev(w, c * 4, "ln w");
  if (b) Dev(b, c * 4, "ln b");
  Dev(mean_out, rows * 4, "ln mean"); Dev(rstd_out, rows * 4, "ln rstd");
  for (std::int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * c;
    const float mean = WarpSumOf(c, [&](std::int64_t j) { return xr[j]; }) / static_cast<float>(c);
    const float var = WarpSumOf(c, [&](std::int64_t j) { return (xr[j] - mean) * (xr[j] - mean); }) / static_cast<float>(c);
    const float rstd = 1.f / std::sqrt(var + eps);
    for (std::int64_t j = 0; j < c; ++j) {
      float t = (xr[j] - mean) * rstd;
      if (w) t *= w[j];
      if (b) t += b[j];
      y[r * c + j] = t;
    }
    mean_out[r] = mean;
    rstd_out[r] = rstd;
  }
}
void LayerNormBackward(Device d, const float* x, const float* gy, const float* w, const float* mean_in,
                       const float* rstd_in, float* gx, float* gw, float* gb, std::int64_t rows, std::int64_t c) {
  Guard(d); Open o;
  Dev(x, rows * c * 4, "lnb x"); Dev(gy, rows * c * 4, "lnb gy");
  if (w) Dev(w, c * 4, "lnb w");
  Dev(mean_in, rows * 4, "lnb mean"); Dev(rstd_in, rows * 4, "lnb rstd");
  if (gx != nullptr && rows > 0) {
    Dev(gx, rows * c * 4, "lnb gx");
    for (std::int64_t r = 0; r < rows; ++r) {
      const float* xr = x + r * c; const float* gr = gy + r * c;
      const float mean = mean_in[r], rstd = rstd_in[r];
      auto dd = [&](std::int64_t j) { return w != nullptr ? gr[j] * w[j] : gr[j]; };
      const float s1 = WarpSumOf(c, dd) / static_cast<float>(c);
      const float s2 = WarpSumOf(c, [&](std::int64_t j) { return dd(j) * (xr[j] - mean) * rstd; }) / static_cast<float>(c);
      for (std::int64_t j = 0; j < c; ++j) gx[r * c + j] = rstd * (dd(j) - s1 - (xr[j] - mean) * rstd * s2);
    }
  }
  if (gw) ColumnSums([&](std::int64_t r, std::int64_t j, std::int64_t n) { return gy[r * n + j] * (x[r * n + j] - mean_in[r]) * rstd_in[r]; }, gw, rows, c, false);
  if (gb) ColumnSums([&](std::int64_t r, std::int64_t j, std::int64_t n) { return gy[r * n + j]; }, gb, rows, c, false);
}

// The packed bf16 copies the softmax kernels write where asked (Note [softmax writes the bf16 copy] in
// common/autograd/ops/attention.cc): `matrices` copies of the t x t results, as PackBf16 writes each.
void SoftmaxCopies(const float* x, std::int64_t matrices, std::int64_t t, void* out16, const char* what) {
  if (out16 == nullptr) return;
  const std::int64_t pad = kernels::cuda::round_up_to_pad(t);
  Dev(out16, static_cast<std::size_t>(matrices * pad * pad) * 2, what);
  auto* out = static_cast<bf16_t*>(out16);
  for (std::int64_t m = 0; m < matrices; ++m)
    for (std::int64_t i = 0; i < pad; ++i)
      for (std::int64_t j = 0; j < pad; ++j)
        out[(m * pad + i) * pad + j] = f32_to_bf16(i < t && j < t ? x[(m * t + i) * t + j] : 0.f);
}

void CausalSoftmax(Device d, float* s, std::int64_t matrices, std::int64_t t, void* out16) {
  if (matrices * t == 0) return;
  Guard(d); Open o; Grid((matrices * t + 7) / 8, 1, "causal_softmax");
  Dev(s, matrices * t * t * 4, "causal_softmax s");
  for (std::int64_t row = 0; row < matrices * t; ++row) {
    const std::int64_t i = row % t;
    float* p = s + row * t;
    float mx = -INFINITY;
    for (std::int64_t j = 0; j <= i; ++j) mx = std::max(mx, p[j]);
    float sum = 0.f;
    for (std::int64_t j = 0; j <= i; ++j) { p[j] = std::exp(p[j] - mx); sum += p[j]; }
    const float inv = 1.f / sum;
    for (std::int64_t j = 0; j < t; ++j) p[j] = j <= i ? p[j] * inv : 0.f;
  }
  SoftmaxCopies(s, matrices, t, out16, "causal_softmax out16");
}
void CausalSoftmaxBackward(Device d, const float* p, float* dp, std::int64_t matrices, std::int64_t t, void* out16) {
  if (matrices * t == 0) return;
  Guard(d); Open o; Grid((matrices * t + 7) / 8, 1, "causal_softmax_b");
  Dev(p, matrices * t * t * 4, "csb p"); Dev(dp, matrices * t * t * 4, "csb dp");
  for (std::int64_t row = 0; row < matrices * t; ++row) {
    const std::int64_t i = row % t;
    const float* pr = p + row * t; float* dr = dp + row * t;
    float dot = 0.f;
    for (std::int64_t j = 0; j <= i; ++j) dot += pr[j] * dr[j];
    for (std::int64_t j = 0; j < t; ++j) dr[j] = j <= i ? pr[j] * (dr[j] - dot) : 0.f;
  }
  SoftmaxCopies(dp, matrices, t, out16, "csb out16");
}

// The fused attention (flash_attention.cu) computed plainly, with the kernels' roundings: Q, K, V, dY, P and dS
// to bf16 before each product, fp32 everywhere else.
bool FlashSupported(Device d, std::int64_t hs) { Guard(d); return hs >= 1 && hs <= 128; }
void FlashAttention(Device d, const float* qkv, float* y, float* lse, std::int64_t b_n, std::int64_t t,
                    std::int64_t heads, std::int64_t hs, float scale) {
  if (b_n * t * heads == 0) return;
  Guard(d); Open o; Grid((t + 63) / 64, b_n * heads, "flash_attention");
  const std::int64_t c = heads * hs;
  Dev(qkv, b_n * t * 3 * c * 4, "flash qkv"); Dev(y, b_n * t * c * 4, "flash y"); Dev(lse, b_n * heads * t * 4, "flash lse");
  std::vector<float> p(static_cast<std::size_t>(t));
  for (std::int64_t b = 0; b < b_n; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < t; ++i) {
        const float* q = qkv + (b * t + i) * 3 * c + h * hs;
        float m = -INFINITY;
        for (std::int64_t j = 0; j <= i; ++j) {
          const float* k = qkv + (b * t + j) * 3 * c + c + h * hs;
          float dot = 0.f;
          for (std::int64_t e = 0; e < hs; ++e) dot += B16(q[e]) * B16(k[e]);
          p[j] = dot * scale;
          m = std::max(m, p[j]);
        }
        float l = 0.f;
        for (std::int64_t j = 0; j <= i; ++j) { p[j] = std::exp(p[j] - m); l += p[j]; }
        float* yr = y + (b * t + i) * c + h * hs;
        for (std::int64_t e = 0; e < hs; ++e) {
          float acc = 0.f;
          for (std::int64_t j = 0; j <= i; ++j) acc += B16(p[j]) * B16(qkv[(b * t + j) * 3 * c + 2 * c + h * hs + e]);
          yr[e] = acc / l;
        }
        lse[(b * heads + h) * t + i] = m + std::log(l);
      }
}
void FlashAttentionBackward(Device d, const float* qkv, const float* y, const float* dy, const float* lse, float* dqkv,
                            std::int64_t b_n, std::int64_t t, std::int64_t heads, std::int64_t hs, float scale) {
  if (b_n * t * heads == 0) return;
  Guard(d); Open o; Grid((t + 63) / 64, b_n * heads, "flash_attention_backward");
  const std::int64_t c = heads * hs;
  Dev(qkv, b_n * t * 3 * c * 4, "flash_b qkv"); Dev(y, b_n * t * c * 4, "flash_b y");
  Dev(dy, b_n * t * c * 4, "flash_b dy"); Dev(lse, b_n * heads * t * 4, "flash_b lse");
  Dev(dqkv, b_n * t * 3 * c * 4, "flash_b dqkv");
  std::fill(dqkv, dqkv + b_n * t * 3 * c, 0.f);
  for (std::int64_t b = 0; b < b_n; ++b)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t i = 0; i < t; ++i) {
        const std::int64_t yi = (b * t + i) * c + h * hs, qi = (b * t + i) * 3 * c + h * hs;
        float delta = 0.f;
        for (std::int64_t e = 0; e < hs; ++e) delta += dy[yi + e] * y[yi + e];
        for (std::int64_t j = 0; j <= i; ++j) {
          const std::int64_t kj = (b * t + j) * 3 * c + c + h * hs, vj = kj + c;
          float s = 0.f, dp = 0.f;
          for (std::int64_t e = 0; e < hs; ++e) {
            s += B16(qkv[qi + e]) * B16(qkv[kj + e]);
            dp += B16(dy[yi + e]) * B16(qkv[vj + e]);
          }
          const float pr = std::exp(s * scale - lse[(b * heads + h) * t + i]);
          const float ds = B16(pr * (dp - delta));
          for (std::int64_t e = 0; e < hs; ++e) {
            dqkv[vj + e] += B16(pr) * B16(dy[yi + e]);
            dqkv[kj + e] += scale * ds * B16(qkv[qi + e]);
            dqkv[qi + e] += scale * ds * B16(qkv[kj + e]);
          }
        }
      }
}

std::int64_t CrossEntropy(Device d, const float* x, const std::int64_t* targets, float* lse, float* loss, float* count,
                          std::int64_t rows, std::int64_t v, std::int64_t ignore_index) {
  Guard(d); Open o;
  Dev(x, rows * v * 4, "ce x"); Dev(targets, rows * 8, "ce targets"); Dev(lse, rows * 4, "ce lse");
  Dev(loss, 4, "ce loss"); Dev(count, 4, "ce count");
  unsigned long long bad = ~0ull;
  if (rows > 0) Grid(rows, 1, "ce lse");
  for (std::int64_t r = 0; r < rows; ++r) {
    if (targets[r] == ignore_index) { lse[r] = 0.f; continue; }
    const float* xr = x + r * v;
    float mx = -INFINITY;
    for (std::int64_t j = 0; j < v; ++j) mx = std::max(mx, xr[j]);
    float s = 0.f;
    for (std::int64_t j = 0; j < v; ++j) s += std::exp(xr[j] - mx);
    lse[r] = mx + std::log(s);
  }
  double s = 0, n = 0;
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t t = targets[r];
    if (t == ignore_index) continue;
    if (t < 0 || t >= v) { bad = std::min<unsigned long long>(bad, r); continue; }
    s += double(lse[r]) - double(x[r * v + t]);
    n += 1;
  }
  loss[0] = n > 0 ? static_cast<float>(s / n) : 0.f;
  count[0] = static_cast<float>(n);
  return bad == ~0ull ? -1 : static_cast<std::int64_t>(bad);
}
void CrossEntropyBackward(Device d, const float* x, const std::int64_t* targets, const float* lse, const float* gloss,
                          const float* count, float* gx, std::int64_t rows, std::int64_t v, std::int64_t ignore_index) {
  if (rows * v == 0) return;
  Guard(d); Open o;
  Dev(x, rows * v * 4, "ceb x"); Dev(targets, rows * 8, "ceb t"); Dev(lse, rows * 4, "ceb lse");
  Dev(gloss, 4, "ceb gloss"); Dev(count, 4, "ceb count"); Dev(gx, rows * v * 4, "ceb gx");
  const float scale = count[0] > 0.f ? gloss[0] / count[0] : 0.f;
  for (std::int64_t i = 0; i < rows * v; ++i) {
    const std::int64_t r = i / v, j = i % v, t = targets[r];
    gx[i] = t == ignore_index ? 0.f : scale * (std::exp(x[i] - lse[r]) - (j == t ? 1.f : 0.f));
  }
}
std::int64_t Embedding(Device d, const float* w, const std::int64_t* idx, float* y, std::int64_t n, std::int64_t c,
                       std::int64_t vocab) {
  if (n == 0) return -1;
  Guard(d); Open o;
  Dev(idx, n * 8, "emb idx");
  unsigned long long bad = ~0ull;
  for (std::int64_t i = 0; i < n; ++i) if (idx[i] < 0 || idx[i] >= vocab) bad = std::min<unsigned long long>(bad, i);
  if (c > 0) {
    Dev(w, vocab * c * 4, "emb w"); Dev(y, n * c * 4, "emb y");
    for (std::int64_t i = 0; i < n * c; ++i) {
      const std::int64_t row = i / c, k = idx[row];
      y[i] = (k < 0 || k >= vocab) ? 0.f : w[k * c + i % c];
    }
  }
  return bad == ~0ull ? -1 : static_cast<std::int64_t>(bad);
}
void EmbeddingBackward(Device d, const std::int64_t* idx, const float* gy, float* gw, std::int64_t n, std::int64_t c) {
  if (n * c == 0) return;
  Guard(d); Open o;
  Dev(idx, n * 8, "embb idx"); Dev(gy, n * c * 4, "embb gy");
  for (std::int64_t i = 0; i < n * c; ++i) {
    Dev(gw + idx[i / c] * c + i % c, 4, "embb gw");
    gw[idx[i / c] * c + i % c] += gy[i];
  }
}
void Copy2d(Device d, const void* src, std::size_t sp, void* dst, std::size_t dp, std::size_t width, std::int64_t height) {
  if (width == 0 || height == 0) return;
  Guard(d); Open o;
  if (height == 1) {
    Dev(src, width, "copy_2d src"); Dev(dst, width, "copy_2d dst");
    std::memmove(dst, src, width);
    return;
  }
  if (sp < width || dp < width) Fail("cudaMemcpy2DAsync: cudaErrorInvalidPitchValue");
  Dev(src, (height - 1) * sp + width, "copy_2d src"); Dev(dst, (height - 1) * dp + width, "copy_2d dst");
  for (std::int64_t h = 0; h < height; ++h)
    std::memmove(static_cast<char*>(dst) + h * dp, static_cast<const char*>(src) + h * sp, width);
}

// ---- optimizer ----
void AdamStep(Device d, DType pd, DType gd, absl::Span<const optim::cuda::AdamTensor> ts, const optim::fused::AdamCoeffs& c) {
  Guard(d); Open o;
  for (const auto& t : ts) {
    Dev(t.w, t.n * 4, "adam w"); Dev(t.m, t.n * 4, "adam m"); Dev(t.v, t.n * 4, "adam v");
    Dev(t.grad, t.n * dtype_size(gd), "adam grad");
    if (t.param_out != nullptr) Dev(t.param_out, t.n * dtype_size(pd), "adam param_out");
    optim::fused::AdamCoeffs cc = c;
    cc.step_size = t.step_size;
    cc.inv_sqrt_bc2 = t.inv_sqrt_bc2;
    optim::fused::adam_step(t.w, t.param_out, pd, t.grad, gd, t.m, t.v, t.n, cc);
  }
}
void SgdStep(Device d, DType pd, DType gd, absl::Span<const optim::cuda::SgdTensor> ts, const optim::fused::SgdCoeffs& c) {
  Guard(d); Open o;
  for (const auto& t : ts) {
    Dev(t.w, t.n * 4, "sgd w"); Dev(t.grad, t.n * dtype_size(gd), "sgd grad");
    if (t.buf) Dev(t.buf, t.n * 4, "sgd buf");
    if (t.param_out != nullptr) Dev(t.param_out, t.n * dtype_size(pd), "sgd param_out");
    optim::fused::SgdCoeffs cc = c;
    cc.keep = t.keep;
    cc.take = t.take;
    optim::fused::sgd_step(t.w, t.param_out, pd, t.grad, gd, t.buf, t.n, cc);
  }
}
void SgdDeferred(Device d, DType pd, DType gd, absl::Span<const optim::cuda::SgdTensor> ts,
                 const optim::fused::SgdCoeffs& c) {
  std::vector<optim::cuda::SgdTensor> v(ts.begin(), ts.end());
  optim::fused::SgdCoeffs cc = c;
  Enqueue([=] { SgdStep(d, pd, gd, v, cc); });
}

void AdamDeferred(Device d, DType pd, DType gd, absl::Span<const optim::cuda::AdamTensor> ts,
                  const optim::fused::AdamCoeffs& c) {
  std::vector<optim::cuda::AdamTensor> v(ts.begin(), ts.end());
  optim::fused::AdamCoeffs cc = c;
  Enqueue([=] { AdamStep(d, pd, gd, v, cc); });
}
// Deferred, except that a same-dtype cast is cudaMemcpyAsync D2D: also deferred.
void CopyBytesSynced(const void* src, Device sd, void* dst, Device dd, std::size_t nbytes) {
  std::lock_guard<std::recursive_mutex> l(g_mu);
  RunQueue(Mine());
  CopyBytes(src, sd, dst, dd, nbytes);
}

}  // namespace

namespace detail::cuda_impl {
void cuda_synchronize(Device device) { SyncDev(device); }
}  // namespace detail::cuda_impl

namespace {
constexpr detail::CudaMemoryOps kMemory{.allocate = &Allocate, .free = &Free, .zero = &Zero, .device_count = &Count,
                                         .copy = &detail::cuda_impl::cuda_copy,
                                         .synchronize = &detail::cuda_impl::cuda_synchronize,
                                         .host_alloc = &HostAlloc, .host_free = &HostFree};
constexpr kernels::cuda::CudaKernelOps kKernels{
    .gemm = &Defer<&Gemm>::run, .pack_bf16 = &Defer<&PackBf16>::run,
    .gemm_on_bf16_copies = &Defer<&GemmOnBf16Copies>::run,
    .gemm_strided_batched_on_bf16_a = &Defer<&GemmStridedBatchedOnBf16A>::run, .cublas_load_error = &CublasError, .sum = &Synced<&Sum>::run,
    .sum_squares = &Synced<&SumSq>::run, .max_abs = &Synced<&MaxAbs>::run,
    .add = &Defer<&Add>::run, .sub = &Defer<&Sub>::run, .mul = &Defer<&Mul>::run, .scale = &Defer<&Scale>::run,
    .axpy = &Defer<&Axpy>::run, .axpby = &Defer<&Axpby>::run, .fill = &Defer<&Fill>::run,
    .cast = &Defer<&Cast>::run, .copy_bytes = &CopyBytesSynced, .broadcast_rows = &Defer<&BroadcastRows>::run,
    .sum_rows = &Defer<&SumRows>::run, .gelu = &Defer<&Gelu>::run,
    .gelu_backward = &Defer<&GeluBackward>::run, .layer_norm = &Defer<&LayerNorm>::run,
    .layer_norm_backward = &Defer<&LayerNormBackward>::run,
    .causal_softmax = &Defer<&CausalSoftmax>::run, .causal_softmax_backward = &Defer<&CausalSoftmaxBackward>::run,
    .gemm_strided_batched = &Defer<&GemmStridedBatched>::run, .flash_attention_supported = &FlashSupported,
    .flash_attention = &Defer<&FlashAttention>::run, .flash_attention_backward = &Defer<&FlashAttentionBackward>::run,
    .cross_entropy = &Synced<&CrossEntropy>::run,
    .cross_entropy_backward = &Defer<&CrossEntropyBackward>::run, .embedding = &Synced<&Embedding>::run,
    .embedding_backward = &Defer<&EmbeddingBackward>::run, .copy_2d = &Defer<&Copy2d>::run};
constexpr optim::cuda::CudaOptimOps kOptim{.adam_step = &AdamDeferred, .sgd_step = &SgdDeferred};

struct Registration {
  Registration() {
    detail::register_cuda_memory(&kMemory);
    kernels::cuda::register_cuda_kernels(&kKernels);
    optim::cuda::register_cuda_optim_kernels(&kOptim);
  }
};
const Registration kRegistration;

}  // namespace
}  // namespace shardkit
