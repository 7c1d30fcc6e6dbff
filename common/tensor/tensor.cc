#include "common/tensor/tensor.h"

#include <bit>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/copy_bytes.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/rank_context.h"
#include "common/tensor/trace_hook.h"

namespace shardkit {

namespace {

// The product of the dimensions, or nullopt when it exceeds INT64_MAX (Note [checked shapes]). Dimensions
// must be >= 0.
std::optional<std::int64_t> product(const Shape& shape) {
  for (std::int64_t d : shape) {
    if (d == 0) return 0;
  }
  std::int64_t n = 1;
  for (std::int64_t d : shape) {
    if (__builtin_mul_overflow(n, d, &n)) return std::nullopt;
  }
  return n;
}

}  // namespace

std::int64_t shape_numel(const Shape& shape) {
  for (std::int64_t d : shape) SK_CHECK_GE(d, 0) << "negative dimension in " << shape_str(shape);
  const std::optional<std::int64_t> n = product(shape);
  SK_CHECK(n.has_value()) << "the element count of shape " << shape_str(shape) << " exceeds INT64_MAX";
  return *n;
}

absl::StatusOr<std::int64_t> checked_numel(const Shape& shape, DType dtype) {
  for (std::int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("expected dimensions >= 0, found ", d, " in shape ", shape_str(shape)));
    }
  }
  const std::optional<std::int64_t> n = product(shape);
  if (!n) {
    return absl::InvalidArgumentError(absl::StrCat("expected at most ", std::numeric_limits<std::int64_t>::max(),
                                                   " elements, found shape ", shape_str(shape)));
  }
  if (std::int64_t bytes = 0; __builtin_mul_overflow(*n, static_cast<std::int64_t>(dtype_size(dtype)), &bytes)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "expected at most ", std::numeric_limits<std::int64_t>::max(), " bytes, found shape ", shape_str(shape), " of ",
        std::string(dtype_name(dtype)), " (", *n, " elements of ", dtype_size(dtype), " bytes)"));
  }
  return *n;
}

std::string shape_str(const Shape& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

namespace {

std::shared_ptr<TensorImpl> MakeImpl(std::shared_ptr<Storage> storage, std::size_t offset, const Shape& shape,
                                     DType dtype) {
  auto impl = std::make_shared<TensorImpl>();
  impl->storage = std::move(storage);
  impl->offset_bytes = offset;
  impl->shape = shape;
  impl->numel = shape_numel(shape);
  impl->dtype = dtype;
  return impl;
}

// f16 -> f32 without branches, so the conversion loops vectorise (f16_to_f32 in dtype.h has a branch per
// case and does not). Same result for every input (kernels_test checks all 65536 patterns against
// f16_to_f32; common/kernels/widen.h carries the same code for the kernels). Placing the half's exponent
// and mantissa at fp32's positions gives an fp32 biased by 127 instead of 15; multiplying by 2^112 fixes
// the bias exactly for normal and subnormal halves alike. Only inf/NaN need a select.
inline float F16ToF32Branchless(f16_t v) {
  const std::uint32_t h = v.bits;
  const std::uint32_t sign = (h & 0x8000u) << 16;
  const std::uint32_t em = (h & 0x7fffu) << 13;
  const std::uint32_t finite = std::bit_cast<std::uint32_t>(std::bit_cast<float>(em) * 0x1p112f);
  const std::uint32_t special = 0x7f800000u | (em & 0x007fe000u);
  return std::bit_cast<float>(sign | (em >= (0x7c00u << 13) ? special : finite));
}

// Typed loads / stores through fp32 (or int64) so conversions are a single generic loop per pair.
template <typename Src, typename Dst>
void ConvertLoop(const Src* s, Dst* d, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<Src, bf16_t>) {
      const float v = bf16_to_f32(s[i]);
      if constexpr (std::is_same_v<Dst, float>) d[i] = v;
      else if constexpr (std::is_same_v<Dst, f16_t>) d[i] = f32_to_f16(v);
      else if constexpr (std::is_same_v<Dst, std::int64_t>) d[i] = static_cast<std::int64_t>(v);
      else d[i] = s[i];
    } else if constexpr (std::is_same_v<Src, f16_t>) {
      const float v = F16ToF32Branchless(s[i]);
      if constexpr (std::is_same_v<Dst, float>) d[i] = v;
      else if constexpr (std::is_same_v<Dst, bf16_t>) d[i] = f32_to_bf16(v);
      else if constexpr (std::is_same_v<Dst, std::int64_t>) d[i] = static_cast<std::int64_t>(v);
      else d[i] = s[i];
    } else {  // float or int64 source
      if constexpr (std::is_same_v<Dst, bf16_t>) d[i] = f32_to_bf16(static_cast<float>(s[i]));
      else if constexpr (std::is_same_v<Dst, f16_t>) d[i] = f32_to_f16(static_cast<float>(s[i]));
      else d[i] = static_cast<Dst>(s[i]);
    }
  }
}

template <typename Src>
void ConvertFrom(const Src* s, void* dst, DType dst_dtype, std::int64_t n) {
  switch (dst_dtype) {
    case DType::f32: return ConvertLoop(s, static_cast<float*>(dst), n);
    case DType::bf16: return ConvertLoop(s, static_cast<bf16_t*>(dst), n);
    case DType::f16: return ConvertLoop(s, static_cast<f16_t*>(dst), n);
    case DType::i64: return ConvertLoop(s, static_cast<std::int64_t*>(dst), n);
  }
}

}  // namespace

void convert_elements(const void* src, DType src_dtype, void* dst, DType dst_dtype, std::int64_t n) {
  if (n == 0) return;
  if (src_dtype == dst_dtype) {
    const std::size_t bytes = static_cast<std::size_t>(n) * dtype_size(src_dtype);
    const auto s = reinterpret_cast<std::uintptr_t>(src), d = reinterpret_cast<std::uintptr_t>(dst);
    if (s + bytes <= d || d + bytes <= s) {
      copy_bytes(dst, src, bytes);  // Note [copy alignment] in common/base/copy_bytes.cc
    } else if (src != dst) {
      std::memmove(dst, src, bytes);
    }
    return;
  }
  switch (src_dtype) {
    case DType::f32: return ConvertFrom(static_cast<const float*>(src), dst, dst_dtype, n);
    case DType::bf16: return ConvertFrom(static_cast<const bf16_t*>(src), dst, dst_dtype, n);
    case DType::f16: return ConvertFrom(static_cast<const f16_t*>(src), dst, dst_dtype, n);
    case DType::i64: return ConvertFrom(static_cast<const std::int64_t*>(src), dst, dst_dtype, n);
  }
}

Tensor Tensor::empty(const Shape& shape, const TensorOptions& options) {
  const std::int64_t numel = shape_numel(shape);
  SK_CHECK_LE(numel, std::numeric_limits<std::int64_t>::max() / static_cast<std::int64_t>(dtype_size(options.dtype)))
      << "bytes of shape " << shape_str(shape) << " in " << dtype_name(options.dtype) << " exceed INT64_MAX";
  const std::size_t nbytes = static_cast<std::size_t>(numel) * dtype_size(options.dtype);
  auto storage = Storage::allocate(nbytes, options.device, options.category.value_or(current_memory_category()));
  return Tensor(MakeImpl(std::move(storage), 0, shape, options.dtype));
}

Tensor Tensor::zeros(const Shape& shape, const TensorOptions& options) {
  Tensor t = empty(shape, options);
  if (t.nbytes() == 0) return t;
  if (t.device().is_cpu()) {
    std::memset(t.raw_data(), 0, t.nbytes());
  } else {
    detail::cuda_zero(t.device(), t.raw_data(), t.nbytes());
  }
  return t;
}

Tensor Tensor::full(const Shape& shape, double value, const TensorOptions& options) {
  Tensor t = empty(shape, options);
  t.fill_(value);
  return t;
}

Tensor Tensor::from_vector(const std::vector<float>& values, const Shape& shape, const TensorOptions& options) {
  SK_CHECK_EQ(static_cast<std::int64_t>(values.size()), shape_numel(shape)) << "values for shape " << shape_str(shape);
  Tensor t = empty(shape, options);
  convert_elements(values.data(), DType::f32, t.raw_data(), t.dtype(), t.numel());
  return t;
}

Tensor Tensor::from_int64(const std::vector<std::int64_t>& values, const Shape& shape, const TensorOptions& options) {
  SK_CHECK_EQ(static_cast<std::int64_t>(values.size()), shape_numel(shape)) << "values for shape " << shape_str(shape);
  Tensor t = empty(shape, options.with_dtype(DType::i64));
  if (!values.empty()) std::memcpy(t.raw_data(), values.data(), t.nbytes());
  return t;
}

Tensor Tensor::uniform(const Shape& shape, Generator& gen, float lo, float hi, const TensorOptions& options) {
  std::vector<float> v(static_cast<std::size_t>(shape_numel(shape)));
  gen.fill_uniform(v.data(), static_cast<std::int64_t>(v.size()), lo, hi);
  return from_vector(v, shape, options);
}

Tensor Tensor::normal(const Shape& shape, Generator& gen, float mean, float stddev, const TensorOptions& options) {
  std::vector<float> v(static_cast<std::size_t>(shape_numel(shape)));
  gen.fill_normal(v.data(), static_cast<std::int64_t>(v.size()), mean, stddev);
  return from_vector(v, shape, options);
}

Tensor Tensor::over(std::shared_ptr<Storage> storage, std::size_t offset_bytes, const Shape& shape, DType dtype) {
  SK_CHECK(storage != nullptr);
  std::size_t need = 0;
  SK_CHECK(!__builtin_mul_overflow(static_cast<std::size_t>(shape_numel(shape)), dtype_size(dtype), &need) &&
           !__builtin_add_overflow(need, offset_bytes, &need))
      << "tensor " << shape_str(shape) << " at byte " << offset_bytes << " overflows size_t";
  SK_CHECK_LE(need, storage->nbytes()) << "tensor " << shape_str(shape) << " past the end of its storage";
  return Tensor(MakeImpl(std::move(storage), offset_bytes, shape, dtype));
}

std::int64_t Tensor::size(std::int64_t d) const {
  const std::int64_t n = dim();
  if (d < 0) d += n;
  SK_CHECK(d >= 0 && d < n) << "dimension " << d << " of a " << n << "-d tensor";
  return shape()[static_cast<std::size_t>(d)];
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined";
  return absl::StrCat(std::string(dtype_name(dtype())), shape_str(shape()), " ", device().str(),
                      storage_released() ? " (released)" : "");
}

void* Tensor::raw_data() const {
  const TensorImpl& i = impl();
  SK_CHECK(!i.storage->released()) << "access to a tensor whose storage was released: " << describe();
  if (i.storage->data() == nullptr) return nullptr;
  return static_cast<char*>(i.storage->data()) + i.offset_bytes;
}

double Tensor::item_at(std::int64_t i) const {
  SK_CHECK(i >= 0 && i < numel()) << "index " << i << " of " << describe();
  SK_CHECK(device().is_cpu()) << "item_at on " << describe();
  const void* p = static_cast<const char*>(raw_data()) + static_cast<std::size_t>(i) * element_size();
  switch (dtype()) {
    case DType::f32: return *static_cast<const float*>(p);
    case DType::bf16: return bf16_to_f32(*static_cast<const bf16_t*>(p));
    case DType::f16: return f16_to_f32(*static_cast<const f16_t*>(p));
    case DType::i64: return static_cast<double>(*static_cast<const std::int64_t*>(p));
  }
  return 0;
}

double Tensor::item() const {
  SK_CHECK_EQ(numel(), 1) << "item() of " << describe();
  return item_at(0);
}

std::vector<float> Tensor::to_vector() const {
  SK_CHECK(device().is_cpu()) << "to_vector on " << describe();
  std::vector<float> out(static_cast<std::size_t>(numel()));
  convert_elements(raw_data(), dtype(), out.data(), DType::f32, numel());
  return out;
}

const Tensor& Tensor::zero_() const {
  if (device().is_cpu()) return fill_(0.0);
  if (trace::Tracer* t = trace::active_tracer()) t->on_untraced_write(*this, "Tensor::zero_");
  if (nbytes() > 0) detail::cuda_zero(device(), raw_data(), nbytes());  // all-zero bytes are +0 in every dtype
  return *this;
}

const Tensor& Tensor::fill_(double value) const {
  SK_CHECK(device().is_cpu()) << "fill_ on " << describe();
  if (trace::Tracer* t = trace::active_tracer()) t->on_untraced_write(*this, "Tensor::fill_");
  const std::int64_t n = numel();
  switch (dtype()) {
    case DType::f32: {
      float* p = data<float>();
      const float v = static_cast<float>(value);
      for (std::int64_t i = 0; i < n; ++i) p[i] = v;
      break;
    }
    case DType::bf16: {
      bf16_t* p = data<bf16_t>();
      const bf16_t v = f32_to_bf16(static_cast<float>(value));
      for (std::int64_t i = 0; i < n; ++i) p[i] = v;
      break;
    }
    case DType::f16: {
      f16_t* p = data<f16_t>();
      const f16_t v = f32_to_f16(static_cast<float>(value));
      for (std::int64_t i = 0; i < n; ++i) p[i] = v;
      break;
    }
    case DType::i64: {
      std::int64_t* p = data<std::int64_t>();
      const auto v = static_cast<std::int64_t>(value);
      for (std::int64_t i = 0; i < n; ++i) p[i] = v;
      break;
    }
  }
  return *this;
}

const Tensor& Tensor::copy_(const Tensor& src) const {
  SK_CHECK_EQ(numel(), src.numel()) << "copy_ from " << src.describe() << " into " << describe();
  if (trace::Tracer* t = trace::active_tracer()) t->on_untraced_write(*this, "Tensor::copy_");
  if (numel() == 0) return *this;
  if (device().is_cpu() && src.device().is_cpu()) {
    convert_elements(src.raw_data(), src.dtype(), raw_data(), dtype(), numel());
  } else {
    detail::cuda_copy(src.raw_data(), src.dtype(), src.device(), raw_data(), dtype(), device(), numel());
  }
  return *this;
}

Tensor Tensor::to(DType dtype, std::optional<MemoryCategory> category) const {
  TensorOptions o;
  o.dtype = dtype;
  o.device = device();
  o.category = category;
  Tensor t = empty(shape(), o);
  t.copy_(*this);
  return t;
}

Tensor Tensor::to(Device device, std::optional<MemoryCategory> category) const {
  TensorOptions o;
  o.dtype = dtype();
  o.device = device;
  o.category = category;
  Tensor t = empty(shape(), o);
  t.copy_(*this);
  return t;
}

Tensor Tensor::clone(std::optional<MemoryCategory> category) const { return to(dtype(), category); }

Tensor Tensor::view(std::int64_t element_offset, const Shape& shape) const {
  SK_CHECK_GE(element_offset, 0);
  return over(storage(), offset_bytes() + static_cast<std::size_t>(element_offset) * element_size(), shape, dtype());
}

Tensor Tensor::reshape(const Shape& new_shape) const {
  Shape s = new_shape;
  std::int64_t known = 1, infer = -1;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      SK_CHECK_EQ(infer, -1) << "more than one -1 in reshape to " << shape_str(new_shape);
      infer = static_cast<std::int64_t>(i);
    } else {
      SK_CHECK_GE(s[i], 0) << "negative dimension in reshape to " << shape_str(new_shape);
      SK_CHECK(!__builtin_mul_overflow(known, s[i], &known))
          << "the element count of reshape to " << shape_str(new_shape) << " exceeds INT64_MAX";
    }
  }
  if (infer >= 0) {
    SK_CHECK(known > 0 && numel() % known == 0) << "reshape " << describe() << " to " << shape_str(new_shape);
    s[static_cast<std::size_t>(infer)] = numel() / known;
  }
  SK_CHECK_EQ(shape_numel(s), numel()) << "reshape " << describe() << " to " << shape_str(new_shape);
  return over(storage(), offset_bytes(), s, dtype());
}

Tensor Tensor::narrow0(std::int64_t start, std::int64_t length) const {
  SK_CHECK_GE(dim(), 1);
  SK_CHECK(start >= 0 && length >= 0 && start + length <= size(0)) << "rows [" << start << ", " << start + length
                                                                   << ") of " << describe();
  Shape s = shape();
  s[0] = length;
  const std::int64_t row = size(0) == 0 ? 0 : numel() / size(0);
  return view(start * row, s);
}

Tensor Tensor::detach() const { return over(storage(), offset_bytes(), shape(), dtype()); }

void Tensor::release_storage() const { storage()->release(); }
void Tensor::reallocate_storage() const { storage()->reallocate(); }

void Tensor::rebind(const Tensor& src) const {
  SK_CHECK(shape() == src.shape() && dtype() == src.dtype()) << "rebind " << describe() << " to " << src.describe();
  TensorImpl& i = impl();
  i.storage = src.storage();
  i.offset_bytes = src.offset_bytes();
}

const Tensor& Tensor::set_requires_grad(bool value) const {
  SK_CHECK(!value || is_floating(dtype())) << "requires_grad on a non-floating tensor " << describe();
  impl().requires_grad = value;
  return *this;
}

void Tensor::set_grad(const Tensor& g) const {
  if (g.defined()) {
    SK_CHECK(g.shape() == shape()) << "grad " << g.describe() << " for " << describe();
  }
  impl().grad = g.impl_ptr();
}

}  // namespace shardkit
