// The CUDA kernels in a build without CUDA: unreachable through the Tensor API (no CUDA tensor can be
// allocated), so each one only reports that CUDA is absent.
#include <string>

#include "common/base/check.h"
#include "common/kernels/cuda/cuda_kernels.h"

namespace shardkit::kernels::cuda {
namespace {
[[noreturn]] void NoCuda(const char* what) {
  throw InternalError(std::string(what) + ": shardkit was built without CUDA (SHARDKIT_CUDA=OFF or no toolkit found)");
}
}  // namespace

void gemm(Device, bool, bool, std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t,
          const float*, std::int64_t, float, float*, std::int64_t) {
  NoCuda("cuda::gemm");
}
std::string cublas_load_error() { return "shardkit was built without CUDA"; }
double sum(Device, const void*, DType, std::int64_t) { NoCuda("cuda::sum"); }
double sum_squares(Device, const void*, DType, std::int64_t) { NoCuda("cuda::sum_squares"); }
double max_abs(Device, const void*, DType, std::int64_t) { NoCuda("cuda::max_abs"); }
void add(Device, const float*, const float*, float*, std::int64_t) { NoCuda("cuda::add"); }
void sub(Device, const float*, const float*, float*, std::int64_t) { NoCuda("cuda::sub"); }
void mul(Device, const float*, const float*, float*, std::int64_t) { NoCuda("cuda::mul"); }
void scale(Device, float, const float*, float*, std::int64_t) { NoCuda("cuda::scale"); }
void axpy(Device, float, const float*, float*, std::int64_t) { NoCuda("cuda::axpy"); }
void axpby(Device, float, const float*, float, float*, std::int64_t) { NoCuda("cuda::axpby"); }
void fill(Device, float*, std::int64_t, float) { NoCuda("cuda::fill"); }
void cast(Device, const void*, DType, void*, DType, std::int64_t) { NoCuda("cuda::cast"); }
void copy_bytes(const void*, Device, void*, Device, std::size_t) { NoCuda("cuda::copy_bytes"); }

}  // namespace shardkit::kernels::cuda
