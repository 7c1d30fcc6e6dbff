// Tensor: a cheap, shared handle to a contiguous n-d array (DESIGN.md section 2).
//
// A Tensor is (Storage, byte offset, shape, dtype). Copying a Tensor copies the handle: both names
// refer to the same tensor (same grad slot, same requires_grad flag), like a PyTorch Python variable.
// view()/reshape() make a *different* tensor over the same bytes (no grad slot of its own).
//
// Memory: new tensors are charged to the calling thread's rank ledger under the thread's current
// MemoryCategory (see rank_context.h) unless TensorOptions::category says otherwise.
//
// Autograd: requires_grad, the grad slot and an opaque autograd metadata pointer live here so that
// common/autograd can attach its graph without tensor/ knowing about it.
//
// Element access (data<T>(), fill_, to_vector) is for CPU tensors; CUDA tensors are computed on with the
// kernels in common/kernels. copy_ / to / clone / zero_ work on any device.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/base/check.h"
#include "common/tensor/device.h"
#include "common/tensor/dtype.h"
#include "common/tensor/memory_tracker.h"
#include "common/tensor/random.h"
#include "common/tensor/storage.h"

namespace shardkit {

namespace autograd {
struct AutogradMeta;  // defined by common/autograd
}

using Shape = std::vector<std::int64_t>;

// Note [checked shapes]: a shape's element count, and its byte count in a dtype, must fit in int64 (a
// product that overflows would wrap to a small or negative count and the tensor would be addressed past
// its storage). Shapes the library builds itself go through shape_numel, which checks (SK_CHECK: a broken
// invariant). Shapes read from outside -- a checkpoint file, another rank, a user -- go through
// checked_numel first, which returns the error instead. A zero dimension makes the count 0 whatever the
// other dimensions are.

// Elements of `shape`. SK_CHECKs that no dimension is negative and that the count fits in int64.
std::int64_t shape_numel(const Shape& shape);
// Elements of `shape`, or InvalidArgument naming the shape when a dimension is negative or the element
// count, or the byte count in `dtype`, exceeds INT64_MAX.
absl::StatusOr<std::int64_t> checked_numel(const Shape& shape, DType dtype);
std::string shape_str(const Shape& shape);

struct TensorOptions {
  DType dtype = DType::f32;
  Device device = Device::cpu();
  // Ledger category; empty = the calling thread's current category.
  std::optional<MemoryCategory> category;

  TensorOptions with_dtype(DType d) const { TensorOptions o = *this; o.dtype = d; return o; }
  TensorOptions with_category(MemoryCategory c) const { TensorOptions o = *this; o.category = c; return o; }
  TensorOptions with_device(Device d) const { TensorOptions o = *this; o.device = d; return o; }
};

class Tensor;

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  std::size_t offset_bytes = 0;
  Shape shape;
  std::int64_t numel = 0;
  DType dtype = DType::f32;
  bool requires_grad = false;
  std::shared_ptr<TensorImpl> grad;
  std::shared_ptr<autograd::AutogradMeta> autograd;
};

class Tensor {
 public:
  Tensor() = default;  // undefined tensor
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // ---- creation ------------------------------------------------------------------------------
  static Tensor empty(const Shape& shape, const TensorOptions& options = {});
  static Tensor zeros(const Shape& shape, const TensorOptions& options = {});  // on any device
  static Tensor full(const Shape& shape, double value, const TensorOptions& options = {});
  // Values are rounded to the dtype (round to nearest even for bf16/f16).
  static Tensor from_vector(const std::vector<float>& values, const Shape& shape, const TensorOptions& options = {});
  static Tensor from_int64(const std::vector<std::int64_t>& values, const Shape& shape, const TensorOptions& options = {});
  static Tensor uniform(const Shape& shape, Generator& gen, float lo, float hi, const TensorOptions& options = {});
  static Tensor normal(const Shape& shape, Generator& gen, float mean, float stddev, const TensorOptions& options = {});
  // A tensor over existing storage (no copy, no charge).
  static Tensor over(std::shared_ptr<Storage> storage, std::size_t offset_bytes, const Shape& shape, DType dtype);

  // ---- metadata ------------------------------------------------------------------------------
  bool defined() const { return impl_ != nullptr; }
  const Shape& shape() const { return impl().shape; }
  std::int64_t dim() const { return static_cast<std::int64_t>(impl().shape.size()); }
  std::int64_t size(std::int64_t d) const;
  std::int64_t numel() const { return impl().numel; }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage ? impl().storage->device() : Device::cpu(); }
  std::size_t element_size() const { return dtype_size(dtype()); }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * element_size(); }
  std::size_t offset_bytes() const { return impl().offset_bytes; }
  const std::shared_ptr<Storage>& storage() const { return impl().storage; }
  // "f32[2, 3] cpu"
  std::string describe() const;

  // ---- data ----------------------------------------------------------------------------------
  void* raw_data() const;
  template <typename T>
  T* data() const {
    return static_cast<T*>(raw_data());
  }
  // Element i converted to double (any dtype; CPU).
  double item_at(std::int64_t i) const;
  double item() const;
  std::vector<float> to_vector() const;  // converted to fp32 (CPU)

  // ---- in-place and copies ----------------------------------------------------------------------
  // These write the elements, not the handle, so they are const like every handle method.
  const Tensor& fill_(double value) const;
  const Tensor& zero_() const;  // on any device (fill_ is CPU only)
  // Copies src's elements into this tensor (same numel), converting dtype, between any two devices. With a
  // CUDA side it is ordered after the calling thread's earlier kernels and returns once the values are in place
  // (detail::cuda_copy). Overlapping source and destination are not allowed.
  const Tensor& copy_(const Tensor& src) const;
  // A new tensor with this one's values in `dtype`, on this tensor's device (charged like any new tensor).
  Tensor to(DType dtype, std::optional<MemoryCategory> category = std::nullopt) const;
  // A new tensor with this one's values and dtype on `device` (charged like any new tensor).
  Tensor to(Device device, std::optional<MemoryCategory> category = std::nullopt) const;
  Tensor clone(std::optional<MemoryCategory> category = std::nullopt) const;

  // ---- views (share storage; a view has no grad slot of its own) -----------------------------
  Tensor view(std::int64_t element_offset, const Shape& shape) const;
  Tensor reshape(const Shape& shape) const;  // same bytes, same numel, -1 allowed once
  Tensor flatten() const { return reshape({numel()}); }
  // Rows [start, start + length) along dim 0.
  Tensor narrow0(std::int64_t start, std::int64_t length) const;
  // The same bytes as a fresh tensor with no autograd state.
  Tensor detach() const;

  // ---- storage lifecycle (FSDP) --------------------------------------------------------------
  // Frees the storage's bytes (every tensor over it sees released()).
  void release_storage() const;
  void reallocate_storage() const;
  bool storage_released() const { return storage() && storage()->released(); }
  // This tensor (and every handle to it) now refers to src's bytes. Shape and dtype must match.
  void rebind(const Tensor& src) const;

  // ---- autograd slots ------------------------------------------------------------------------
  bool requires_grad() const { return impl().requires_grad; }
  const Tensor& set_requires_grad(bool value) const;
  Tensor grad() const { return Tensor(impl().grad); }
  void set_grad(const Tensor& g) const;
  const std::shared_ptr<autograd::AutogradMeta>& autograd_meta() const { return impl().autograd; }
  void set_autograd_meta(std::shared_ptr<autograd::AutogradMeta> meta) const { impl().autograd = std::move(meta); }

  // ---- identity ------------------------------------------------------------------------------
  bool is_same(const Tensor& other) const { return impl_ == other.impl_; }
  const TensorImpl* id() const { return impl_.get(); }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

 private:
  TensorImpl& impl() const {
    SK_CHECK(impl_ != nullptr) << "use of an undefined tensor";
    return *impl_;
  }
  std::shared_ptr<TensorImpl> impl_;
};

// Element conversions between any two dtypes (CPU), n elements.
void convert_elements(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n);

}  // namespace shardkit
