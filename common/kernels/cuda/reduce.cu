// Full reductions on the device: each thread accumulates a grid-stride slice in fp32, each block combines
// its threads in double (sum) or as integers (max_abs, see Note [max_abs on bits] in reduce.cc), and the
// host adds the per-block partials in double. Accuracy as in Note [reduction accuracy] (reduce.h).
#include <limits>
#include <vector>

#include "common/kernels/cuda/cuda_kernels.h"
#include "common/kernels/cuda/cuda_util.cuh"
#include "common/kernels/cuda/widen.cuh"

namespace shardkit::kernels::cuda {
namespace {

enum class Op { sum, sum_squares, max_abs };

constexpr std::int64_t kMaxBlocks = 1024;

template <Op kOp, typename T>
__global__ void ReduceKernel(const T* __restrict__ x, std::int64_t n, double* __restrict__ partials) {
  __shared__ double sdata[kThreads];
  float acc = 0.f;
  unsigned int mbits = 0;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(blockDim.x) * gridDim.x) {
    const float v = load_f32(x, i);
    if constexpr (kOp == Op::sum) acc += v;
    if constexpr (kOp == Op::sum_squares) acc += v * v;
    if constexpr (kOp == Op::max_abs) mbits = max(mbits, __float_as_uint(v) & 0x7fffffffu);
  }
  sdata[threadIdx.x] = kOp == Op::max_abs ? static_cast<double>(mbits) : static_cast<double>(acc);
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (threadIdx.x < s) {
      if constexpr (kOp == Op::max_abs) {
        sdata[threadIdx.x] = fmax(sdata[threadIdx.x], sdata[threadIdx.x + s]);  // integers, exact in double
      } else {
        sdata[threadIdx.x] += sdata[threadIdx.x + s];
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = sdata[0];
}

template <Op kOp>
double Run(Device device, const void* x, DType dtype, std::int64_t n) {
  SK_CHECK(is_floating(dtype)) << "cuda reduction of dtype " << dtype_name(dtype);
  if (n == 0) return 0.0;
  DeviceGuard guard(device);
  const unsigned blocks = GridFor(n, kMaxBlocks);
  double* partials = nullptr;
  SK_CUDA_CHECK(cudaMallocAsync(&partials, blocks * sizeof(double), cudaStreamPerThread));
  switch (dtype) {
    case DType::f32:
      ReduceKernel<kOp><<<blocks, kThreads, 0, cudaStreamPerThread>>>(static_cast<const float*>(x), n, partials);
      break;
    case DType::bf16:
      ReduceKernel<kOp><<<blocks, kThreads, 0, cudaStreamPerThread>>>(static_cast<const bf16_t*>(x), n, partials);
      break;
    case DType::f16:
      ReduceKernel<kOp><<<blocks, kThreads, 0, cudaStreamPerThread>>>(static_cast<const f16_t*>(x), n, partials);
      break;
    case DType::i64: break;
  }
  const cudaError_t launch = cudaGetLastError();
  std::vector<double> host(blocks);
  const cudaError_t copy =
      cudaMemcpyAsync(host.data(), partials, blocks * sizeof(double), cudaMemcpyDeviceToHost, cudaStreamPerThread);
  cudaFreeAsync(partials, cudaStreamPerThread);
  const cudaError_t sync = cudaStreamSynchronize(cudaStreamPerThread);
  SK_CHECK(launch == cudaSuccess) << "cuda reduction launch: " << cudaGetErrorString(launch);
  SK_CHECK(copy == cudaSuccess) << "cuda reduction copy: " << cudaGetErrorString(copy);
  SK_CHECK(sync == cudaSuccess) << "cuda reduction: " << cudaGetErrorString(sync);
  double r = 0.0;
  for (double p : host) r = kOp == Op::max_abs ? (p > r ? p : r) : r + p;
  if constexpr (kOp == Op::max_abs) {
    const auto bits = static_cast<unsigned int>(r);
    if (bits > 0x7f800000u) return std::numeric_limits<double>::quiet_NaN();
    return static_cast<double>(__builtin_bit_cast(float, bits));
  }
  return r;
}

}  // namespace

namespace cuda_impl {

double sum(Device device, const void* x, DType dtype, std::int64_t n) { return Run<Op::sum>(device, x, dtype, n); }
double sum_squares(Device device, const void* x, DType dtype, std::int64_t n) {
  return Run<Op::sum_squares>(device, x, dtype, n);
}
double max_abs(Device device, const void* x, DType dtype, std::int64_t n) {
  return Run<Op::max_abs>(device, x, dtype, n);
}

}  // namespace cuda_impl
}  // namespace shardkit::kernels::cuda
