// Stand-in for common/kernels/cuda/cuda_util.cuh for tools/cuda_sim: checks abort, launches are the harness's.
#pragma once
#include <cstdio>
#include <cstdlib>
#include "sim.h"
struct SimCheckSink { template <typename T> SimCheckSink& operator<<(const T&) { return *this; } };
#define SK_CHECK(cond) if (cond) {} else (std::abort(), SimCheckSink{})
#define SK_CUDA_CHECK(expr) SK_CHECK((expr) == cudaSuccess)
namespace shardkit::kernels::cuda {
inline constexpr int kThreads = 256;
inline void CheckLaunch(const char*) {}
}
