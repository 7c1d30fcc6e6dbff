#include "common/optim/fused_kernels.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "common/base/check.h"

namespace shardkit::optim::fused {
namespace {

// The parameter is the fp32 weight array itself: nothing to write back.
struct NoParamOut {};

// Note [rounding lag]
// For a bf16/f16 parameter the update loop also writes p[i - kLag] = round(w[i - kLag]), the weight it
// updated kLag elements earlier, read back from L1; the first kLag elements have nothing behind them and
// the last kLag are rounded after the loop. DRAM traffic is the same as rounding w[i] itself; the
// schedule is what differs. On AVX2 the rounding takes about 22 integer vector instructions per 16
// elements. Made right after w[i] is computed they wait at the end of the sqrt/divide chain, fill the
// scheduler, and fewer iterations stay in flight: 0.6-0.7 of optim_bench's memory limit on Zen 3 (0.8
// with the rounding in as few instructions as we could, Note [bf16 rounding shape]). Made kLag behind,
// they depend on nothing in flight and run in the gaps. Measured on that VM at load ~1 (optim_bench
// AdamW bf16+master): rounding 64 behind 0.83-0.88 (32 and 128 behind the same within noise); rounding
// each 512-element tile in a second loop instead 0.79 (no DRAM traffic overlaps that loop); the same
// update loop storing truncated bf16, i.e. with no rounding work at all, 0.88. SGD bf16+master: 0.92-1.02.
// kLag is at least the longest vector gcc uses (32 16-bit lanes with AVX-512), so the loop vectorises:
// the read of w[i - kLag] follows the store of w[i] at dependence distance kLag.
constexpr std::int64_t kLag = 64;

template <typename P>
inline void store_rounded(P* p, std::int64_t i, float x) {
  if constexpr (std::is_same_v<P, bf16_t>) p[i] = bf16_t{round_to_bf16_bits(x)};
  else p[i] = f16_t{round_to_f16_bits(x)};
}

// Runs loop(p, begin, end) over [0, n) so that each weight is updated and, for a bf16/f16 parameter,
// rounded into p (Note [rounding lag]): the first kLag elements with nothing to round yet, the rest
// rounding kLag behind, then the last kLag elements on their own.
template <typename P, typename Loop>
void UpdateAndRound(const float* w, P* p, std::int64_t n, Loop&& loop) {
  if constexpr (std::is_same_v<P, NoParamOut>) {
    loop(p, std::int64_t{0}, n);
  } else {
    const std::int64_t head = std::min(n, kLag);
    loop(static_cast<NoParamOut*>(nullptr), std::int64_t{0}, head);
    loop(p, head, n);
    if constexpr (std::is_same_v<P, bf16_t>) round_to_bf16(w + n - head, p + n - head, head);
    else round_to_f16(w + n - head, p + n - head, head);
  }
}

// Note [software prefetch]
// The Adam loop runs in blocks of kBlock elements and, before each block, asks for the lines of w, m, v
// and the gradient kPrefetchAhead elements further on (prefetcht0: never faults, changes no result).
// Its body is about 70 instructions per 16 elements with a sqrt and a divide in their chain, so the
// out-of-order window reaches only about 60 elements ahead, and the hardware prefetchers alone did not
// keep the memory bus busy. On the AVX2-only Zen 3 VM, optim_bench AdamW bf16+master went from 0.82-0.88
// of its limit (median 0.84) to 0.93-1.05 (median 0.975): medians of 5 repetitions, 14 runs of each,
// alternated, load average 1.7-10. AdamW fp32, the same loop, 0.91 -> 1.04 (one run each, load 3-4).
// In a harness at load 1-3, distances of 128-384 elements measured the same within noise (0.92-0.96;
// 512 and 768 a little lower): 256 kept. Prefetching the bf16/f16 parameter for writing as well made it
// worse (0.86): that stream is only written, and left to the stores. The prefetches stop
// kPrefetchAhead elements before the end, so no address past the arrays is formed.
constexpr std::int64_t kBlock = 32;
constexpr std::int64_t kPrefetchAhead = 256;

// Asks for the cache lines of x[i, i + kBlock). Always inlined: gcc 12 takes a function whose only
// statements are prefetches for one with no effect, and deletes its calls.
template <typename T>
[[gnu::always_inline]] inline void prefetch_block(const T* x, std::int64_t i) {
  const char* b = reinterpret_cast<const char*>(x + i);
  for (std::size_t k = 0; k < kBlock * sizeof(T); k += 64) __builtin_prefetch(b + k, 0, 3);
}

// Runs loop(begin, end) over [begin, end) in blocks of kBlock, before the block at i asking for
// streams[i + kPrefetchAhead, + kBlock) while that lies inside [begin, end) (Note [software prefetch]).
template <typename Loop, typename... T>
inline void Blocked(std::int64_t begin, std::int64_t end, Loop&& loop, const T*... streams) {
  std::int64_t i = begin;
  for (; end - i >= kBlock + kPrefetchAhead; i += kBlock) {
    (prefetch_block(streams, i + kPrefetchAhead), ...);
    loop(i, i + kBlock);
  }
  loop(i, end);
}

template <typename G>
inline float load(const G* g, std::int64_t i) {
  if constexpr (std::is_same_v<G, float>) return g[i];
  else if constexpr (std::is_same_v<G, bf16_t>) return bf16_to_f32(g[i]);
  else return f16_bits_to_f32(g[i].bits);
}

// Note [fused loop shape]
// One loop, every value loaded once into a register and every result stored once (a bf16/f16 parameter
// also re-reads w from L1, Note [rounding lag]); coefficients are locals (not loads through the struct)
// and all pointers are __restrict, so gcc vectorises the loop without runtime alias checks. sqrtf
// vectorises because the project builds with -fno-math-errno.
// The coefficients come by value, from a copy the caller keeps in registers: through a reference, the
// loop would reload them for every block (a float store into w may alias a float in the caller's struct).
template <typename P, typename G>
inline void AdamLoop(float* __restrict w, P* __restrict p, const G* __restrict g, float* __restrict m,
                     float* __restrict v, std::int64_t begin, std::int64_t end, const AdamCoeffs c) {
  const float sign = c.sign, l2 = c.l2, decay = c.decay, b1 = c.beta1, omb1 = c.one_minus_beta1, b2 = c.beta2,
              omb2 = c.one_minus_beta2, step_size = c.step_size, inv_sqrt_bc2 = c.inv_sqrt_bc2, eps = c.eps;
  for (std::int64_t i = begin; i < end; ++i) {
    float wi = w[i];
    const float gi = sign * load(g, i) + l2 * wi;
    wi *= decay;
    const float mi = b1 * m[i] + omb1 * gi;
    const float vi = b2 * v[i] + omb2 * (gi * gi);
    const float denom = std::sqrt(vi) * inv_sqrt_bc2 + eps;
    wi -= step_size * (mi / denom);
    m[i] = mi;
    v[i] = vi;
    w[i] = wi;
    if constexpr (!std::is_same_v<P, NoParamOut>) store_rounded(p, i - kLag, w[i - kLag]);
  }
}

template <typename P, typename G, bool kMomentum, bool kNesterov>
void SgdLoop(float* __restrict w, P* __restrict p, const G* __restrict g, float* __restrict b, std::int64_t begin,
             std::int64_t end, const SgdCoeffs& c) {
  const float sign = c.sign, wd = c.weight_decay, lr = c.lr, mu = c.momentum, keep = c.keep, take = c.take;
  for (std::int64_t i = begin; i < end; ++i) {
    float wi = w[i];
    float gi = sign * load(g, i) + wd * wi;
    if constexpr (kMomentum) {
      const float bi = keep * b[i] + take * gi;
      b[i] = bi;
      if constexpr (kNesterov) gi = gi + mu * bi;
      else gi = bi;
    }
    wi -= lr * gi;
    w[i] = wi;
    if constexpr (!std::is_same_v<P, NoParamOut>) store_rounded(p, i - kLag, w[i - kLag]);
  }
}

template <typename P, typename G>
void Sgd(float* w, P* p, const G* g, float* b, std::int64_t n, const SgdCoeffs& c) {
  if (!c.has_momentum) {
    return UpdateAndRound(w, p, n, [&](auto* q, std::int64_t begin, std::int64_t end) {
      SgdLoop<std::remove_pointer_t<decltype(q)>, G, false, false>(w, q, g, nullptr, begin, end, c);
    });
  }
  SK_CHECK(b != nullptr) << "SGD with momentum needs a buffer";
  if (c.nesterov) {
    return UpdateAndRound(w, p, n, [&](auto* q, std::int64_t begin, std::int64_t end) {
      SgdLoop<std::remove_pointer_t<decltype(q)>, G, true, true>(w, q, g, b, begin, end, c);
    });
  }
  UpdateAndRound(w, p, n, [&](auto* q, std::int64_t begin, std::int64_t end) {
    SgdLoop<std::remove_pointer_t<decltype(q)>, G, true, false>(w, q, g, b, begin, end, c);
  });
}

// Calls fn(P* param_out, const G* grad) with the static types behind the dtypes.
template <typename Fn>
void Dispatch(void* param_out, DType param_dtype, const void* grad, DType grad_dtype, Fn&& fn) {
  auto with_grad = [&](auto* p) {
    switch (grad_dtype) {
      case DType::f32: return fn(p, static_cast<const float*>(grad));
      case DType::bf16: return fn(p, static_cast<const bf16_t*>(grad));
      case DType::f16: return fn(p, static_cast<const f16_t*>(grad));
      case DType::i64: break;
    }
    SK_CHECK(false) << "gradient dtype " << dtype_name(grad_dtype) << " is not floating point";
  };
  if (param_out == nullptr) {
    SK_CHECK(param_dtype == DType::f32) << "a " << dtype_name(param_dtype) << " parameter needs an output";
    return with_grad(static_cast<NoParamOut*>(nullptr));
  }
  switch (param_dtype) {
    case DType::bf16: return with_grad(static_cast<bf16_t*>(param_out));
    case DType::f16: return with_grad(static_cast<f16_t*>(param_out));
    default: break;
  }
  SK_CHECK(false) << "parameter output of dtype " << dtype_name(param_dtype);
}

}  // namespace

void round_to_bf16(const float* __restrict src, bf16_t* __restrict dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = bf16_t{round_to_bf16_bits(src[i])};
}

void round_to_f16(const float* __restrict src, f16_t* __restrict dst, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) dst[i] = f16_t{round_to_f16_bits(src[i])};
}

AdamCoeffs adam_coeffs(const HyperParams& h, std::int64_t step, bool decoupled) {
  SK_CHECK_GE(step, 1);
  AdamCoeffs c;
  c.sign = h.maximize ? -1.0f : 1.0f;
  c.l2 = decoupled ? 0.0f : static_cast<float>(h.weight_decay);
  c.decay = decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.beta1 = static_cast<float>(h.beta1);
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  const double t = static_cast<double>(step);
  const double bc1 = 1.0 - std::pow(h.beta1, t);
  const double bc2 = 1.0 - std::pow(h.beta2, t);
  c.step_size = static_cast<float>(h.lr / bc1);
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  return c;
}

void adam_step(float* w, void* param_out, DType param_dtype, const void* grad, DType grad_dtype, float* m, float* v,
               std::int64_t n, const AdamCoeffs& c) {
  if (n == 0) return;
  Dispatch(param_out, param_dtype, grad, grad_dtype, [&](auto* p, auto* g) {
    UpdateAndRound(w, p, n, [&](auto* q, std::int64_t begin, std::int64_t end) {
      // A copy whose address does not escape: its values stay in registers across the blocks.
      Blocked(begin, end, [&, co = c](std::int64_t b, std::int64_t e) { AdamLoop(w, q, g, m, v, b, e, co); }, w, m, v, g);
    });
  });
}

SgdCoeffs sgd_coeffs(const HyperParams& h, bool first_momentum_step) {
  SgdCoeffs c;
  c.sign = h.maximize ? -1.0f : 1.0f;
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.lr = static_cast<float>(h.lr);
  c.has_momentum = h.momentum != 0.0;
  c.nesterov = h.nesterov;
  c.momentum = static_cast<float>(h.momentum);
  c.keep = first_momentum_step ? 0.0f : static_cast<float>(h.momentum);
  c.take = first_momentum_step ? 1.0f : static_cast<float>(1.0 - h.dampening);
  return c;
}

void sgd_step(float* w, void* param_out, DType param_dtype, const void* grad, DType grad_dtype, float* buf,
              std::int64_t n, const SgdCoeffs& c) {
  if (n == 0) return;
  Dispatch(param_out, param_dtype, grad, grad_dtype, [&](auto* p, auto* g) { Sgd(w, p, g, buf, n, c); });
}

}  // namespace shardkit::optim::fused
