// The CPU run of flash_attention.cu's kernels (tools/cuda_sim/run.sh says what it checks): for each shape, the
// forward, delta and both backward kernels under four thread schedules, against fp64 attention and against an fp64
// emulation of the kernels' own roundings (bf16 operands, online softmax in blocks of 64, bf16 P and dS).
// Arguments: policies (0/1: also the reverse and random schedules), invariance (0/1: a later row or another head
// changed must leave the rest bit-identical), and optionally one shape index.
#include <cstdio>
#include <cstdlib>
#include <vector>
#include <cmath>
#include <random>
#include <cstring>
#include <string>
#include <type_traits>
#include "cuda_runtime.h"
#include "flash_attention_kernels.inc"  // made by run.sh from common/kernels/cuda/flash_attention.cu

namespace fa = shardkit::kernels::cuda;
using sim::Policy;

// Runs body() as every thread of every block, blocks one after another.
template <typename F>
void Launch(dim3 grid, int threads, std::size_t smem_bytes, Policy pol, unsigned seed, F body) {
  for (unsigned by = 0; by < grid.y; ++by)
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      sim::Block b(threads, pol, seed + bx * 7919 + by * 104729);
      const std::size_t guard = 4096;
      std::size_t alloc = (smem_bytes + guard + 127) / 128 * 128;
      unsigned char* mem = static_cast<unsigned char*>(std::aligned_alloc(128, alloc));
      std::memset(mem, 0xFF, alloc);  // bf16 / f32 NaN everywhere
      b.smem = smem_bytes ? mem : nullptr;
      b.smem_bytes = smem_bytes;
      {
        std::lock_guard<std::mutex> lk(b.mu);
        b.current = b.Pick();
      }
      std::vector<std::thread> ts;
      for (int t = 0; t < threads; ++t)
        ts.emplace_back([&, t] {
          sim::tid = t;
          sim::blk = &b;
          threadIdx.x = t; threadIdx.y = threadIdx.z = 0;
          blockIdx.x = bx; blockIdx.y = by; blockIdx.z = 0;
          blockDim = dim3(threads);
          gridDim = grid;
          {
            std::unique_lock<std::mutex> lk(b.mu);
            b.cv[t].wait(lk, [&] { return b.current == t; });
          }
          body();
          std::unique_lock<std::mutex> lk(b.mu);
          b.done[t] = 1;
          sim::SwitchNext(lk);
        });
      for (auto& th : ts) th.join();
      for (std::size_t i = smem_bytes; i < alloc; ++i)
        if (mem[i] != 0xFF) { sim::Error("write past the dynamic shared memory"); break; }
      std::free(mem);
    }
}

struct Shape { int B, T, H, hs; };

struct Result { std::vector<float> y, lse, dqkv; };

static float bf(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

template <int HS>
Result RunKernels(const Shape& s, const std::vector<float>& qkv, const std::vector<float>& dy, Policy pol, unsigned seed) {
  const int B = s.B, T = s.T, H = s.H, hs = s.hs;
  const long C = (long)H * hs;
  const float scale = 1.f / std::sqrt((float)hs);
  const float NaN = std::nanf("");
  const long pad = 1024;  // guard bands around global buffers
  std::vector<float> y(B * T * C + 2 * pad, NaN), lse(B * H * T + 2 * pad, NaN), dqkv(B * T * 3 * C + 2 * pad, NaN);
  std::vector<float> delta(B * H * T + 2 * pad, NaN);
  const unsigned gx = (T + 63) / 64;
  dim3 grid(gx, B * H);
  Launch(grid, 128, fa::Layout<HS>::kForward, pol, seed, [&] {
    fa::FlashForwardKernel<HS>(qkv.data(), y.data() + pad, lse.data() + pad, T, H, hs, scale);
  });
  const long rows = (long)B * H * T;
  const int per = fa::kThreads / 32;
  Launch(dim3((rows + per - 1) / per), fa::kThreads, 0, pol, seed, [&] {
    fa::FlashDeltaKernel(y.data() + pad, dy.data(), delta.data() + pad, rows, T, H, hs);
  });
  Launch(grid, 128, fa::Layout<HS>::kBackward, pol, seed + 1, [&] {
    fa::FlashBackwardKeysKernel<HS>(qkv.data(), dy.data(), lse.data() + pad, delta.data() + pad, dqkv.data() + pad, T,
                                    H, hs, scale);
  });
  Launch(grid, 128, fa::Layout<HS>::kBackward, pol, seed + 2, [&] {
    fa::FlashBackwardQueriesKernel<HS>(qkv.data(), dy.data(), lse.data() + pad, delta.data() + pad, dqkv.data() + pad,
                                       T, H, hs, scale);
  });
  auto guard_ok = [&](const std::vector<float>& v, const char* name) {
    for (long i = 0; i < pad; ++i)
      if (!std::isnan(v[i]) || !std::isnan(v[v.size() - 1 - i])) { sim::Error(std::string("global write outside ") + name); return; }
  };
  guard_ok(y, "y"); guard_ok(lse, "lse"); guard_ok(dqkv, "dqkv"); guard_ok(delta, "delta");
  Result r;
  r.y.assign(y.begin() + pad, y.end() - pad);
  r.lse.assign(lse.begin() + pad, lse.end() - pad);
  r.dqkv.assign(dqkv.begin() + pad, dqkv.end() - pad);
  return r;
}

struct Ref { std::vector<double> y, lse, dqkv; };

Ref Reference(const Shape& s, const std::vector<float>& qkv_in, const std::vector<float>& dy_in, bool round_inputs) {
  const int B = s.B, T = s.T, H = s.H, hs = s.hs;
  const long C = (long)H * hs;
  const double scale = 1.0 / std::sqrt((double)(float)(1.0 / std::sqrt((double)hs)) * 0 + (double)hs);
  const double fscale = (float)(1.f / std::sqrt((float)hs));
  (void)scale;
  auto Q = [&](float x) { return round_inputs ? (double)bf(x) : (double)x; };
  Ref r;
  r.y.assign(B * T * C, 0); r.lse.assign(B * H * T, 0); r.dqkv.assign(B * T * 3 * C, 0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      auto q = [&](int i, int c) { return Q(qkv_in[((long)b * T + i) * 3 * C + h * hs + c]); };
      auto k = [&](int i, int c) { return Q(qkv_in[((long)b * T + i) * 3 * C + C + h * hs + c]); };
      auto v = [&](int i, int c) { return Q(qkv_in[((long)b * T + i) * 3 * C + 2 * C + h * hs + c]); };
      auto g = [&](int i, int c) { return Q(dy_in[((long)b * T + i) * C + h * hs + c]); };
      std::vector<double> P(T), dP(T);
      for (int i = 0; i < T; ++i) {
        double mx = -1e300;
        for (int j = 0; j <= i; ++j) {
          double d = 0;
          for (int c = 0; c < hs; ++c) d += q(i, c) * k(j, c);
          P[j] = d * fscale;
          mx = std::max(mx, P[j]);
        }
        double l = 0;
        for (int j = 0; j <= i; ++j) { P[j] = std::exp(P[j] - mx); l += P[j]; }
        for (int j = 0; j <= i; ++j) P[j] /= l;
        r.lse[((long)b * H + h) * T + i] = mx + std::log(l);
        double delta = 0;
        for (int c = 0; c < hs; ++c) {
          double yc = 0;
          for (int j = 0; j <= i; ++j) yc += P[j] * v(j, c);
          r.y[((long)b * T + i) * C + h * hs + c] = yc;
          delta += yc * g(i, c);
        }
        for (int j = 0; j <= i; ++j) {
          double d = 0;
          for (int c = 0; c < hs; ++c) d += g(i, c) * v(j, c);
          const double ds = P[j] * (d - delta);
          for (int c = 0; c < hs; ++c) {
            r.dqkv[((long)b * T + i) * 3 * C + h * hs + c] += fscale * ds * k(j, c);
            r.dqkv[((long)b * T + j) * 3 * C + C + h * hs + c] += fscale * ds * q(i, c);
            r.dqkv[((long)b * T + j) * 3 * C + 2 * C + h * hs + c] += P[j] * g(i, c);
          }
        }
      }
    }
  return r;
}


// The kernels' algorithm in double with the kernels' bf16 roundings (online softmax over key blocks of 64, P and dS
// rounded to bf16 for the products, delta from the kernel's y); the backward uses the kernel's lse and y so the two
// halves are checked separately.
Ref Emulated(const Shape& s, const std::vector<float>& qkv_in, const std::vector<float>& dy_in, const Result& k_out) {
  const int B = s.B, T = s.T, H = s.H, hs = s.hs;
  const long C = (long)H * hs;
  const double fscale = (float)(1.f / std::sqrt((float)hs));
  Ref r;
  r.y.assign(B * T * C, 0); r.lse.assign(B * H * T, 0); r.dqkv.assign(B * T * 3 * C, 0);
  for (int b = 0; b < B; ++b)
    for (int h = 0; h < H; ++h) {
      auto q = [&](int i, int c) { return (double)bf(qkv_in[((long)b * T + i) * 3 * C + h * hs + c]); };
      auto k = [&](int i, int c) { return (double)bf(qkv_in[((long)b * T + i) * 3 * C + C + h * hs + c]); };
      auto v = [&](int i, int c) { return (double)bf(qkv_in[((long)b * T + i) * 3 * C + 2 * C + h * hs + c]); };
      auto g = [&](int i, int c) { return (double)bf(dy_in[((long)b * T + i) * C + h * hs + c]); };
      auto g32 = [&](int i, int c) { return (double)dy_in[((long)b * T + i) * C + h * hs + c]; };
      auto S = [&](int i, int j) { double d = 0; for (int c = 0; c < hs; ++c) d += q(i, c) * k(j, c); return d * fscale; };
      for (int i = 0; i < T; ++i) {
        double m = -INFINITY, l = 0;
        std::vector<double> o(hs, 0.0);
        for (int k0 = 0; k0 <= i; k0 += 64) {
          const int k1 = std::min(i, k0 + 63);
          double bm = -INFINITY;
          std::vector<double> sv(k1 - k0 + 1);
          for (int j = k0; j <= k1; ++j) { sv[j - k0] = S(i, j); bm = std::max(bm, sv[j - k0]); }
          const double mn = std::max(m, bm);
          const double alpha = m == -INFINITY ? 0 : std::exp(m - mn);
          l *= alpha;
          for (auto& x : o) x *= alpha;
          for (int j = k0; j <= k1; ++j) {
            const double p = std::exp(sv[j - k0] - mn);
            l += p;
            const double pb = bf((float)p);
            for (int c = 0; c < hs; ++c) o[c] += pb * v(j, c);
          }
          m = mn;
        }
        r.lse[((long)b * H + h) * T + i] = m + std::log(l);
        for (int c = 0; c < hs; ++c) r.y[((long)b * T + i) * C + h * hs + c] = o[c] / l;
      }
      for (int i = 0; i < T; ++i) {
        const double lse = k_out.lse[((long)b * H + h) * T + i];
        double delta = 0;
        for (int c = 0; c < hs; ++c) delta += g32(i, c) * (double)k_out.y[((long)b * T + i) * C + h * hs + c];
        for (int j = 0; j <= i; ++j) {
          const double p = std::exp(S(i, j) - lse);
          double dp = 0;
          for (int c = 0; c < hs; ++c) dp += g(i, c) * v(j, c);
          const double ds = bf((float)(p * (dp - delta)));
          const double pb = bf((float)p);
          for (int c = 0; c < hs; ++c) {
            r.dqkv[((long)b * T + i) * 3 * C + h * hs + c] += fscale * ds * k(j, c);
            r.dqkv[((long)b * T + j) * 3 * C + C + h * hs + c] += fscale * ds * q(i, c);
            r.dqkv[((long)b * T + j) * 3 * C + 2 * C + h * hs + c] += pb * g(i, c);
          }
        }
      }
    }
  return r;
}

struct Err { double max_abs = 0, max_scaled = 0; long bad = 0, nonfinite = 0; long worst = -1; };
Err Compare(const std::vector<float>& got, const std::vector<double>& ref, double tol) {
  Err e;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (!std::isfinite(got[i])) { ++e.nonfinite; ++e.bad; if (e.worst < 0) e.worst = i; continue; }
    const double a = std::fabs(got[i] - ref[i]);
    const double sc = a / (1 + std::fabs(ref[i]));
    e.max_abs = std::max(e.max_abs, a);
    if (sc > e.max_scaled) { e.max_scaled = sc; if (e.nonfinite == 0) e.worst = i; }
    if (sc > tol) ++e.bad;
  }
  return e;
}

template <int HS>
bool RunShape(const Shape& s, bool policies, bool invariance) {
  const long C = (long)s.H * s.hs;
  std::mt19937 rng(1234 + s.T * 31 + s.hs);
  std::uniform_real_distribution<float> U(-1.f, 1.f);
  std::vector<float> qkv(s.B * s.T * 3 * C), dy(s.B * s.T * C);
  for (auto& x : qkv) x = U(rng);
  if (const char* e = std::getenv("QK_SCALE")) {  // larger, growing scores: the running max moves every key block
    const float f = std::atof(e);
    for (int b = 0; b < s.B; ++b)
      for (int i = 0; i < s.T; ++i)
        for (long c = 0; c < 2 * C; ++c) qkv[((long)b * s.T + i) * 3 * C + c] *= f * (c >= C ? 1.f + 3.f * i / s.T : 1.f);
  }
  for (auto& x : dy) x = U(rng);
  const long err0 = sim::g_errors.load();
  Result r = RunKernels<HS>(s, qkv, dy, sim::kForward, 1);
  Ref ref = Reference(s, qkv, dy, false);
  Ref refb = Emulated(s, qkv, dy, r);
  bool ok = true;
  std::printf("shape B=%d T=%d H=%d hs=%d (HS=%d)\n", s.B, s.T, s.H, s.hs, HS);
  auto report = [&](const char* name, const std::vector<float>& got, const std::vector<double>& a, const std::vector<double>& b) {
    Err e = Compare(got, a, 2e-2), eb = Compare(got, b, 1e-3);
    const bool pass = e.bad == 0 && eb.bad == 0;
    ok &= pass;
    std::printf("  %-5s %s  vs fp64: max|err| %.3e max scaled %.3e (bad %ld, nonfinite %ld) | vs emulation: max|err| %.3e scaled %.3e (bad@1e-3 %ld) worst idx %ld\n",
                name, pass ? "PASS" : "FAIL", e.max_abs, e.max_scaled, e.bad, e.nonfinite, eb.max_abs, eb.max_scaled, eb.bad, eb.worst);
  };
  report("y", r.y, ref.y, refb.y);
  report("lse", r.lse, ref.lse, refb.lse);
  // split dqkv into dq, dk, dv
  for (int part = 0; part < 3; ++part) {
    std::vector<float> g; std::vector<double> a, b;
    for (long row = 0; row < (long)s.B * s.T; ++row)
      for (long c = 0; c < C; ++c) {
        const long i = row * 3 * C + part * C + c;
        g.push_back(r.dqkv[i]); a.push_back(ref.dqkv[i]); b.push_back(refb.dqkv[i]);
      }
    report(part == 0 ? "dq" : part == 1 ? "dk" : "dv", g, a, b);
  }
  if (policies) {
    for (int p = 1; p <= 3; ++p) {
      Result r2 = RunKernels<HS>(s, qkv, dy, p == 1 ? sim::kReverse : sim::kRandom, 99 + p);
      const bool same = std::memcmp(r2.y.data(), r.y.data(), r.y.size() * 4) == 0 &&
                        std::memcmp(r2.lse.data(), r.lse.data(), r.lse.size() * 4) == 0 &&
                        std::memcmp(r2.dqkv.data(), r.dqkv.data(), r.dqkv.size() * 4) == 0;
      std::printf("  schedule %s: %s\n", p == 1 ? "reverse" : "random", same ? "bit-identical" : "DIFFERS (race)");
      ok &= same;
    }
  }
  if (invariance) {
    // Perturb the last row (q, k, v, dy) of every head and everything of head H-1 (if H > 1):
    // outputs of rows < T-1 of heads < H-1 for y, lse and dq must be bit-identical.
    std::vector<float> q2 = qkv, d2 = dy;
    for (int b = 0; b < s.B; ++b) {
      for (long c = 0; c < 3 * C; ++c) q2[((long)b * s.T + s.T - 1) * 3 * C + c] = U(rng) * 5;
      for (long c = 0; c < C; ++c) d2[((long)b * s.T + s.T - 1) * C + c] = U(rng) * 5;
      if (s.H > 1)
        for (int i = 0; i < s.T; ++i) {
          for (int part = 0; part < 3; ++part)
            for (int c = 0; c < s.hs; ++c) q2[((long)b * s.T + i) * 3 * C + part * C + (s.H - 1) * s.hs + c] = U(rng) * 5;
          for (int c = 0; c < s.hs; ++c) d2[((long)b * s.T + i) * C + (s.H - 1) * s.hs + c] = U(rng) * 5;
        }
    }
    Result r2 = RunKernels<HS>(s, q2, d2, sim::kForward, 1);
    long diff = 0;
    for (int b = 0; b < s.B; ++b)
      for (int h = 0; h < (s.H > 1 ? s.H - 1 : 1); ++h)
        for (int i = 0; i < s.T - 1; ++i) {
          diff += r2.lse[((long)b * s.H + h) * s.T + i] != r.lse[((long)b * s.H + h) * s.T + i];
          for (int c = 0; c < s.hs; ++c) {
            diff += r2.y[((long)b * s.T + i) * C + h * s.hs + c] != r.y[((long)b * s.T + i) * C + h * s.hs + c];
            diff += r2.dqkv[((long)b * s.T + i) * 3 * C + h * s.hs + c] != r.dqkv[((long)b * s.T + i) * 3 * C + h * s.hs + c];
          }
        }
    // heads < H-1: dk, dv of rows < T-1 depend on later queries' dy... only the last row changed for those heads;
    // so only check them when T==1 trivially. Skip.
    std::printf("  invariance (future row / other head perturbed): %s (%ld differing values)\n", diff ? "LEAK" : "ok", diff);
    ok &= diff == 0;
  }
  const long errs = sim::g_errors.load() - err0;
  if (errs) std::printf("  SIM errors: %ld\n", errs);
  ok &= errs == 0;
  std::printf("  => %s\n", ok ? "PASS" : "FAIL");
  return ok;
}

int main(int argc, char** argv) {
  const bool policies = argc > 1 ? std::atoi(argv[1]) : 1;
  const bool invariance = argc > 2 ? std::atoi(argv[2]) : 1;
  std::vector<Shape> shapes = {{2, 1, 2, 64}, {1, 63, 3, 64}, {2, 64, 2, 64}, {1, 65, 2, 64}, {2, 130, 2, 16},
                               {1, 200, 2, 32}, {1, 129, 1, 128}, {2, 37, 4, 8}, {1, 70, 2, 48}, {1, 300, 2, 100}};
  int only = argc > 3 ? std::atoi(argv[3]) : -1;
  int fails = 0;
  for (int i = 0; i < (int)shapes.size(); ++i) {
    if (only >= 0 && i != only) continue;
    const Shape& s = shapes[i];
    bool ok;
    if (s.hs <= 16) ok = RunShape<16>(s, policies, invariance);
    else if (s.hs <= 32) ok = RunShape<32>(s, policies, invariance);
    else if (s.hs <= 64) ok = RunShape<64>(s, policies, invariance);
    else ok = RunShape<128>(s, policies, invariance);
    fails += !ok;
    std::fflush(stdout);
  }
  std::printf("%s: %d shape(s) failed\n", fails ? "FAIL" : "ALL PASS", fails);
  return fails != 0;
}
