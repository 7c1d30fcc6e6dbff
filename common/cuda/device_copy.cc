// detail::cuda_copy for Tensor::copy_ (common/tensor/device_memory.h): the tensor library cannot call the kernels
// (they sit above it), so shardkit::cuda hands it kernels::cast over borrowed storage.
#include "common/kernels/elementwise.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/storage.h"
#include "common/tensor/tensor.h"

namespace shardkit::detail::cuda_impl {
namespace {

Tensor Over(const void* p, DType dtype, Device device, std::int64_t n) {
  const std::size_t nbytes = static_cast<std::size_t>(n) * dtype_size(dtype);
  return Tensor::over(Storage::borrow(const_cast<void*>(p), nbytes, device), 0, {n}, dtype);
}

}  // namespace

void cuda_copy(const void* src, DType src_dtype, Device src_device, void* dst, DType dst_dtype, Device dst_device,
               std::int64_t n) {
  if (n == 0) return;
  kernels::cast(Over(src, src_dtype, src_device, n), Over(dst, dst_dtype, dst_device, n));
  // A copy that crosses devices has waited already (kernels::cast); one within a device is only queued.
  if (src_device == dst_device) cuda_synchronize(dst_device);
}

}  // namespace shardkit::detail::cuda_impl
