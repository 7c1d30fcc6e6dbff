// Device-side loads of the storage dtypes as fp32 and stores with round to nearest even (internal).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "common/tensor/dtype.h"

namespace shardkit::kernels::cuda {

__device__ __forceinline__ float load_f32(const float* p, std::int64_t i) { return p[i]; }
__device__ __forceinline__ float load_f32(const bf16_t* p, std::int64_t i) {
  return __bfloat162float(__ushort_as_bfloat16(p[i].bits));
}
__device__ __forceinline__ float load_f32(const f16_t* p, std::int64_t i) {
  return __half2float(__ushort_as_half(p[i].bits));
}

__device__ __forceinline__ void store_f32(float* p, std::int64_t i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f32(bf16_t* p, std::int64_t i, float v) {
  p[i].bits = __bfloat16_as_ushort(__float2bfloat16_rn(v));
}
__device__ __forceinline__ void store_f32(f16_t* p, std::int64_t i, float v) {
  p[i].bits = __half_as_ushort(__float2half_rn(v));
}

// i64 goes through fp32 as convert_elements does on the CPU (float -> i64 truncates toward zero).
__device__ __forceinline__ float load_f32(const std::int64_t* p, std::int64_t i) { return static_cast<float>(p[i]); }
__device__ __forceinline__ void store_f32(std::int64_t* p, std::int64_t i, float v) {
  p[i] = static_cast<std::int64_t>(v);
}

}  // namespace shardkit::kernels::cuda
