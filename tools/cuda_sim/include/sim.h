// Cooperative SIMT scheduler for running CUDA kernel source on the CPU (harness only).
#pragma once
#include <algorithm>
#include <atomic>
#include <cassert>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

struct uint3 { unsigned x = 0, y = 0, z = 0; };
struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3() = default;
  dim3(unsigned a, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {}
};

namespace sim {
enum Policy { kForward = 0, kReverse = 1, kRandom = 2 };

inline std::atomic<long> g_errors{0};
inline void Error(const std::string& msg) {
  if (g_errors.fetch_add(1) < 20) std::fprintf(stderr, "SIM ERROR: %s\n", msg.c_str());
}

struct Block {
  int n;
  std::mutex mu;
  std::vector<std::condition_variable> cv;
  int current = -1;
  std::vector<char> runnable, done;
  int block_count = 0;
  std::vector<int> warp_count;
  Policy policy;
  std::mt19937 rng;
  unsigned char* smem = nullptr;
  std::size_t smem_bytes = 0;
  std::vector<float> shfl;
  bool dead = false;
  Block(int n_, Policy p, unsigned seed)
      : n(n_), cv(n_), runnable(n_, 1), done(n_, 0), warp_count((n_ + 31) / 32, 0), policy(p), rng(seed), shfl(n_) {}
  int Pick() {
    std::vector<int> r;
    for (int i = 0; i < n; ++i)
      if (runnable[i] && !done[i]) r.push_back(i);
    if (r.empty()) return -1;
    if (policy == kForward) return r.front();
    if (policy == kReverse) return r.back();
    return r[rng() % r.size()];
  }
};

inline thread_local int tid = 0;
inline thread_local Block* blk = nullptr;

inline void SwitchNext(std::unique_lock<std::mutex>& lk) {
  const int next = blk->Pick();
  if (next < 0) {
    bool all_done = true;
    for (int i = 0; i < blk->n; ++i) all_done &= blk->done[i] != 0;
    if (!all_done) {
      std::fprintf(stderr, "SIM DEADLOCK (barrier not reached by every member)\n");
      std::abort();
    }
    return;
  }
  blk->current = next;
  if (next != tid) {
    blk->cv[next].notify_one();
    if (!blk->done[tid]) blk->cv[tid].wait(lk, [] { return blk->current == tid; });
  }
}

inline void BlockBarrier() {
  std::unique_lock<std::mutex> lk(blk->mu);
  blk->runnable[tid] = 0;
  if (++blk->block_count == blk->n) {
    blk->block_count = 0;
    for (int i = 0; i < blk->n; ++i) blk->runnable[i] = 1;
  }
  SwitchNext(lk);
}

inline void WarpBarrier() {
  std::unique_lock<std::mutex> lk(blk->mu);
  const int w = tid / 32;
  const int size = std::min(32, blk->n - w * 32);
  blk->runnable[tid] = 0;
  if (++blk->warp_count[w] == size) {
    blk->warp_count[w] = 0;
    for (int i = w * 32; i < w * 32 + size; ++i) blk->runnable[i] = 1;
  }
  SwitchNext(lk);
}

inline unsigned char* block_smem() { return blk->smem; }

inline float Shfl(float v, int src_lane) {
  blk->shfl[tid] = v;
  WarpBarrier();
  const float r = blk->shfl[(tid & ~31) + (src_lane & 31)];
  WarpBarrier();
  return r;
}

inline bool InSmem(const void* p, std::size_t bytes) {
  auto* c = static_cast<const unsigned char*>(p);
  return c >= blk->smem && c + bytes <= blk->smem + blk->smem_bytes;
}
}  // namespace sim

inline thread_local uint3 threadIdx, blockIdx;
inline thread_local dim3 blockDim, gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __restrict__
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

inline void __syncthreads() { sim::BlockBarrier(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  if (mask != 0xffffffffu) sim::Error("__syncwarp with partial mask");
  sim::WarpBarrier();
}
inline float __shfl_xor_sync(unsigned mask, float v, int lane_mask, int width = 32) {
  if (mask != 0xffffffffu || width != 32) sim::Error("shfl_xor partial");
  return sim::Shfl(v, (sim::tid & 31) ^ lane_mask);
}
inline float __shfl_sync(unsigned mask, float v, int src, int width = 32) {
  if (mask != 0xffffffffu || width != 32) sim::Error("shfl partial");
  return sim::Shfl(v, src);
}
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
[[noreturn]] inline void __trap() { std::abort(); }

// Minimal runtime surface used by the non-kernel helpers (never called).
typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
template <typename K>
inline cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute, int) { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t) { return "sim"; }
