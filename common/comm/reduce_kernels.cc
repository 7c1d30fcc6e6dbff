#include "common/comm/reduce_kernels.h"

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "common/base/check.h"
#include "common/base/copy_bytes.h"

namespace shardkit::comm {
namespace {

// ---- loading one source into / combining it with the f32 accumulator ---------------------------

inline float load(const float* p, std::int64_t i) { return p[i]; }
inline float load(const bf16_t* p, std::int64_t i) { return bf16_to_f32(p[i]); }
inline float load(const f16_t* p, std::int64_t i) { return f16_to_f32(p[i]); }
inline void store(float* p, std::int64_t i, float v) { p[i] = v; }
inline void store(bf16_t* p, std::int64_t i, float v) { p[i] = f32_to_bf16(v); }
inline void store(f16_t* p, std::int64_t i, float v) { p[i] = f32_to_f16(v); }

struct SumF {
  float operator()(float a, float x) const { return a + x; }
};
struct MinF {
  float operator()(float a, float x) const { return x < a ? x : a; }
};
struct MaxF {
  float operator()(float a, float x) const { return x > a ? x : a; }
};

template <typename T>
void first_f(float* __restrict acc, const T* __restrict src, std::int64_t n, bool premul, float f) {
  if (premul) {
    for (std::int64_t i = 0; i < n; ++i) acc[i] = f * load(src, i);
  } else {
    for (std::int64_t i = 0; i < n; ++i) acc[i] = load(src, i);
  }
}

template <typename T, typename C>
void combine_f(float* __restrict acc, const T* __restrict src, std::int64_t n, C c) {
  for (std::int64_t i = 0; i < n; ++i) acc[i] = c(acc[i], load(src, i));
}

template <typename T>
void combine_premul_f(float* __restrict acc, const T* __restrict src, std::int64_t n, float f) {
  for (std::int64_t i = 0; i < n; ++i) acc[i] = acc[i] + f * load(src, i);
}

// Two sources in one pass (the common n = 2 sum, and the first step of every sum).
template <typename T>
void sum2_f(float* __restrict acc, const T* __restrict a, const T* __restrict b, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) acc[i] = load(a, i) + load(b, i);
}

template <typename T>
void store_f(T* __restrict dst, const float* __restrict acc, std::int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    copy_bytes(dst, acc, static_cast<std::size_t>(n) * sizeof(float));
  } else {
    for (std::int64_t i = 0; i < n; ++i) store(dst, i, acc[i]);
  }
}

template <typename T>
void reduce_float(const ReduceOp& op, absl::Span<const void* const> srcs, absl::Span<void* const> dsts,
                  std::int64_t count, ReduceScratch& scratch) {
  const std::int64_t chunk = scratch.chunk_elements;
  if (static_cast<std::int64_t>(scratch.f32.size()) < std::min(chunk, count)) {
    scratch.f32.resize(static_cast<std::size_t>(std::min(chunk, count)));
  }
  float* acc = scratch.f32.data();
  const std::size_t ns = srcs.size();
  const float f = static_cast<float>(op.factor);
  for (std::int64_t off = 0; off < count; off += chunk) {
    const std::int64_t len = std::min(chunk, count - off);
    auto src = [&](std::size_t s) { return static_cast<const T*>(srcs[s]) + off; };
    switch (op.kind) {
      case ReduceKind::sum:
      case ReduceKind::avg:
        if (ns >= 2) {
          sum2_f(acc, src(0), src(1), len);
        } else {
          first_f(acc, src(0), len, false, 1.f);
        }
        for (std::size_t s = 2; s < ns; ++s) combine_f(acc, src(s), len, SumF{});
        if (op.kind == ReduceKind::avg) {
          const float n = static_cast<float>(ns);
          for (std::int64_t i = 0; i < len; ++i) acc[i] = acc[i] / n;
        }
        break;
      case ReduceKind::premul_sum:
        first_f(acc, src(0), len, true, f);
        for (std::size_t s = 1; s < ns; ++s) combine_premul_f(acc, src(s), len, f);
        break;
      case ReduceKind::min:
        first_f(acc, src(0), len, false, 1.f);
        for (std::size_t s = 1; s < ns; ++s) combine_f(acc, src(s), len, MinF{});
        break;
      case ReduceKind::max:
        first_f(acc, src(0), len, false, 1.f);
        for (std::size_t s = 1; s < ns; ++s) combine_f(acc, src(s), len, MaxF{});
        break;
    }
    for (void* d : dsts) store_f(static_cast<T*>(d) + off, acc, len);
  }
}

// Note [f32 reduction fast path]: for f32 the reduction needs no scratch accumulator: each block of kF32Block
// floats is read from every source into a local array, combined there (same operations, same order as the
// scalar path above, so the results are bit-identical) and stored to every destination. Sources may alias
// destinations element for element (in place) because a block is fully read before it is written. Per element
// a rank reads n sources and writes to n destinations' 1/n slices, i.e. one memcpy's worth of traffic per rank;
// the scratch path also writes the scratch and copies it out again.
// Plain loops over a block of constant length, no intrinsics: the compiler vectorises them for whatever ISA
// -march selects (SHARDKIT_NATIVE; SSE2 without it) and keeps the block in registers (two AVX2 vectors, one
// AVX-512 vector). 16 floats, one cache line per source: measured with GCC 12 on AVX2 (Zen 3, 2 cores under
// load; n sources of 32 MiB / (n / 2) into one destination, median of 40), old scratch path -> 16-float
// blocks: n = 2 5.6 -> 4.4 ms, n = 4 5.3 -> 3.5 ms. Blocks of 32 or 64 floats were no better at n = 2 and
// slower at n = 4 (GCC vectorised the loop over the sources instead, with gathers); 1024 floats were slower
// than the scratch path. In comm_bench's in-process cases at 64 MiB (frac_of_limit, medians of 6 runs each,
// interleaved, load 2.6-5.8): all_reduce n = 2 0.61 -> 0.88, n = 4 0.39 -> 0.70; reduce_scatter n = 2
// 0.29 -> 0.39, n = 4 0.22 -> 0.41. The process backends' rings reduce with tcp_reduce.h instead.
// Plain stores, not non-temporal ones: measured on an AVX-512 VM (64 MiB all_reduce, n = 2) streaming stores
// cost 12.7 ms of CPU per call against 6.9 ms with plain stores (memcpy of 64 MiB: 9.4 ms), as the large
// shared L3 absorbs much of the write traffic.
constexpr std::int64_t kF32Block = 16;

template <ReduceKind K>
inline void f32_block(absl::Span<const void* const> srcs, absl::Span<void* const> dsts, std::int64_t at, float f,
                      float nf) {
  float acc[kF32Block];
  const float* s0 = static_cast<const float*>(srcs[0]) + at;
  for (std::int64_t i = 0; i < kF32Block; ++i) acc[i] = K == ReduceKind::premul_sum ? f * s0[i] : s0[i];
  for (std::size_t s = 1; s < srcs.size(); ++s) {
    const float* p = static_cast<const float*>(srcs[s]) + at;
    for (std::int64_t i = 0; i < kF32Block; ++i) {
      if constexpr (K == ReduceKind::sum || K == ReduceKind::avg) acc[i] = acc[i] + p[i];
      if constexpr (K == ReduceKind::premul_sum) acc[i] = acc[i] + f * p[i];
      if constexpr (K == ReduceKind::min) acc[i] = p[i] < acc[i] ? p[i] : acc[i];
      if constexpr (K == ReduceKind::max) acc[i] = p[i] > acc[i] ? p[i] : acc[i];
    }
  }
  if constexpr (K == ReduceKind::avg) {
    for (std::int64_t i = 0; i < kF32Block; ++i) acc[i] = acc[i] / nf;
  }
  for (void* d : dsts) {
    float* q = static_cast<float*>(d) + at;
    for (std::int64_t i = 0; i < kF32Block; ++i) q[i] = acc[i];
  }
}

template <ReduceKind K>
void f32_fast(const ReduceOp& op, absl::Span<const void* const> srcs, absl::Span<void* const> dsts,
              std::int64_t count, ReduceScratch& scratch) {
  const float f = static_cast<float>(op.factor);
  const float nf = static_cast<float>(srcs.size());
  const std::int64_t body_end = count / kF32Block * kF32Block;
  for (std::int64_t at = 0; at < body_end; at += kF32Block) f32_block<K>(srcs, dsts, at, f, nf);
  if (body_end == count) return;
  // The tail goes through the scalar path (same arithmetic).
  std::vector<const void*> s2;
  std::vector<void*> d2;
  for (const void* p : srcs) s2.push_back(static_cast<const float*>(p) + body_end);
  for (void* p : dsts) d2.push_back(static_cast<float*>(p) + body_end);
  reduce_float<float>(op, s2, d2, count - body_end, scratch);
}

void reduce_i64(const ReduceOp& op, absl::Span<const void* const> srcs, absl::Span<void* const> dsts,
                std::int64_t count, ReduceScratch& scratch) {
  const std::int64_t chunk = scratch.chunk_elements;
  if (static_cast<std::int64_t>(scratch.i64.size()) < std::min(chunk, count)) {
    scratch.i64.resize(static_cast<std::size_t>(std::min(chunk, count)));
  }
  // Wrapping arithmetic in uint64 (signed overflow would be undefined).
  std::uint64_t* acc = reinterpret_cast<std::uint64_t*>(scratch.i64.data());
  const std::size_t ns = srcs.size();
  const std::uint64_t f = static_cast<std::uint64_t>(static_cast<std::int64_t>(op.factor));
  for (std::int64_t off = 0; off < count; off += chunk) {
    const std::int64_t len = std::min(chunk, count - off);
    auto src = [&](std::size_t s) { return static_cast<const std::int64_t*>(srcs[s]) + off; };
    const std::int64_t* s0 = src(0);
    switch (op.kind) {
      case ReduceKind::sum:
      case ReduceKind::avg:
        for (std::int64_t i = 0; i < len; ++i) acc[i] = static_cast<std::uint64_t>(s0[i]);
        for (std::size_t s = 1; s < ns; ++s) {
          const std::int64_t* p = src(s);
          for (std::int64_t i = 0; i < len; ++i) acc[i] += static_cast<std::uint64_t>(p[i]);
        }
        if (op.kind == ReduceKind::avg) {
          const std::int64_t n = static_cast<std::int64_t>(ns);
          for (std::int64_t i = 0; i < len; ++i) acc[i] = static_cast<std::uint64_t>(static_cast<std::int64_t>(acc[i]) / n);
        }
        break;
      case ReduceKind::premul_sum:
        for (std::int64_t i = 0; i < len; ++i) acc[i] = f * static_cast<std::uint64_t>(s0[i]);
        for (std::size_t s = 1; s < ns; ++s) {
          const std::int64_t* p = src(s);
          for (std::int64_t i = 0; i < len; ++i) acc[i] += f * static_cast<std::uint64_t>(p[i]);
        }
        break;
      case ReduceKind::min:
      case ReduceKind::max: {
        std::int64_t* a = scratch.i64.data();
        for (std::int64_t i = 0; i < len; ++i) a[i] = s0[i];
        const bool is_min = op.kind == ReduceKind::min;
        for (std::size_t s = 1; s < ns; ++s) {
          const std::int64_t* p = src(s);
          if (is_min) {
            for (std::int64_t i = 0; i < len; ++i) a[i] = p[i] < a[i] ? p[i] : a[i];
          } else {
            for (std::int64_t i = 0; i < len; ++i) a[i] = p[i] > a[i] ? p[i] : a[i];
          }
        }
        break;
      }
    }
    for (void* d : dsts) {
      std::memcpy(static_cast<std::int64_t*>(d) + off, acc, static_cast<std::size_t>(len) * sizeof(std::int64_t));
    }
  }
}

}  // namespace

ReduceScratch::ReduceScratch(std::int64_t chunk_bytes) : chunk_elements(std::max<std::int64_t>(1, chunk_bytes / 4)) {}

void reduce_into(DType dtype, const ReduceOp& op, absl::Span<const void* const> srcs, absl::Span<void* const> dsts,
                 std::int64_t count, ReduceScratch& scratch) {
  SK_CHECK(!srcs.empty());
  if (count <= 0) return;
  switch (dtype) {
    case DType::f32:
      if (count >= kF32Block) {
        switch (op.kind) {
          case ReduceKind::sum: f32_fast<ReduceKind::sum>(op, srcs, dsts, count, scratch); return;
          case ReduceKind::avg: f32_fast<ReduceKind::avg>(op, srcs, dsts, count, scratch); return;
          case ReduceKind::min: f32_fast<ReduceKind::min>(op, srcs, dsts, count, scratch); return;
          case ReduceKind::max: f32_fast<ReduceKind::max>(op, srcs, dsts, count, scratch); return;
          case ReduceKind::premul_sum: f32_fast<ReduceKind::premul_sum>(op, srcs, dsts, count, scratch); return;
        }
      }
      reduce_float<float>(op, srcs, dsts, count, scratch);
      return;
    case DType::bf16: reduce_float<bf16_t>(op, srcs, dsts, count, scratch); return;
    case DType::f16: reduce_float<f16_t>(op, srcs, dsts, count, scratch); return;
    case DType::i64: reduce_i64(op, srcs, dsts, count, scratch); return;
  }
}

}  // namespace shardkit::comm
