#include "common/autograd/ops/shape.h"

#include <numeric>

#include "common/autograd/ops/op_utils.h"
#include "common/base/copy_bytes.h"
#include "common/kernels/cuda/cuda_kernels.h"

namespace shardkit::autograd {
namespace {

std::int64_t NormDim(const char* op, std::int64_t dim, std::int64_t rank) {
  const std::int64_t d = dim < 0 ? dim + rank : dim;
  SK_CHECK(d >= 0 && d < rank) << op << ": dimension " << dim << " of a " << rank << "-d tensor";
  return d;
}

// Views a tensor as [outer, size(dim), inner].
struct Split3 {
  std::int64_t outer = 1, mid = 1, inner = 1;
};
Split3 Around(const Shape& s, std::int64_t d) {
  Split3 r;
  for (std::int64_t i = 0; i < d; ++i) r.outer *= s[static_cast<std::size_t>(i)];
  r.mid = s[static_cast<std::size_t>(d)];
  for (std::size_t i = static_cast<std::size_t>(d) + 1; i < s.size(); ++i) r.inner *= s[i];
  return r;
}

Tensor PermuteCopy(const Tensor& x, const std::vector<std::int64_t>& dims) {
  const std::int64_t rank = x.dim();
  Shape out_shape(static_cast<std::size_t>(rank));
  std::vector<std::int64_t> in_strides(static_cast<std::size_t>(rank));
  std::int64_t stride = 1;
  for (std::int64_t i = rank - 1; i >= 0; --i) {
    in_strides[static_cast<std::size_t>(i)] = stride;
    stride *= x.shape()[static_cast<std::size_t>(i)];
  }
  // Stride in x of each output dimension.
  std::vector<std::int64_t> src_stride(static_cast<std::size_t>(rank));
  for (std::int64_t i = 0; i < rank; ++i) {
    out_shape[static_cast<std::size_t>(i)] = x.shape()[static_cast<std::size_t>(dims[static_cast<std::size_t>(i)])];
    src_stride[static_cast<std::size_t>(i)] = in_strides[static_cast<std::size_t>(dims[static_cast<std::size_t>(i)])];
  }
  Tensor out = detail::new_activation(out_shape);
  const std::int64_t n = out.numel();
  if (n == 0) return out;
  const float* src = x.data<float>();
  float* dst = out.data<float>();
  // Walk the output in order; the innermost output dimension is a strided read.
  const std::int64_t last = rank - 1;
  const std::int64_t inner_n = out_shape[static_cast<std::size_t>(last)];
  const std::int64_t inner_s = src_stride[static_cast<std::size_t>(last)];
  std::vector<std::int64_t> idx(static_cast<std::size_t>(rank), 0);
  std::int64_t base = 0;
  for (std::int64_t o = 0; o < n; o += inner_n) {
    for (std::int64_t j = 0; j < inner_n; ++j) dst[o + j] = src[base + j * inner_s];
    // Advance the outer index (dimensions 0 .. last-1).
    for (std::int64_t d = last - 1; d >= 0; --d) {
      auto du = static_cast<std::size_t>(d);
      base += src_stride[du];
      if (++idx[du] < out_shape[du]) break;
      base -= src_stride[du] * out_shape[du];
      idx[du] = 0;
    }
  }
  return out;
}

std::size_t Bytes(std::int64_t floats) { return static_cast<std::size_t>(floats) * sizeof(float); }

// Copies x ([outer, mid_x, inner]) into out ([outer, mid_out, inner]) at offset `at` along mid.
void PlaceAlong(const Tensor& x, const Tensor& out, std::int64_t d, std::int64_t at) {
  const Split3 xs = Around(x.shape(), d);
  const Split3 os = Around(out.shape(), d);
  const float* src = x.data<float>();
  float* dst = out.data<float>();
  const std::int64_t chunk = xs.mid * xs.inner;
  if (out.device().is_cuda()) {
    kernels::cuda::copy_2d(out.device(), src, Bytes(chunk), dst + at * os.inner, Bytes(os.mid * os.inner),
                           Bytes(chunk), xs.outer);
    return;
  }
  for (std::int64_t o = 0; o < xs.outer; ++o) {
    copy_bytes(dst + (o * os.mid + at) * os.inner, src + o * chunk, static_cast<std::size_t>(chunk) * sizeof(float));
  }
}

// out ([outer, len, inner]) = x[:, at:at+len, :].
void TakeAlong(const Tensor& x, const Tensor& out, std::int64_t d, std::int64_t at) {
  const Split3 xs = Around(x.shape(), d);
  const Split3 os = Around(out.shape(), d);
  const float* src = x.data<float>();
  float* dst = out.data<float>();
  const std::int64_t chunk = os.mid * os.inner;
  if (out.device().is_cuda()) {
    kernels::cuda::copy_2d(out.device(), src + at * xs.inner, Bytes(xs.mid * xs.inner), dst, Bytes(chunk),
                           Bytes(chunk), os.outer);
    return;
  }
  for (std::int64_t o = 0; o < os.outer; ++o) {
    copy_bytes(dst + o * chunk, src + (o * xs.mid + at) * xs.inner, static_cast<std::size_t>(chunk) * sizeof(float));
  }
}

}  // namespace

Tensor reshape_compute(const Tensor& x, const Shape& shape) {
  SK_CHECK(x.defined()) << "reshape: undefined input";
  Tensor out = x.reshape(shape);
  if (should_record({&x})) {
    detail::record("ReshapeBackward", {&x}, {&out},
                   [in_shape = x.shape()](TensorList&& g) -> TensorList { return {g[0].reshape(in_shape)}; });
  }
  return out;
}

Tensor permute_compute(const Tensor& x, const std::vector<std::int64_t>& dims_in) {
  detail::check_f32_cpu("permute", x);
  const std::int64_t rank = x.dim();
  SK_CHECK_EQ(static_cast<std::int64_t>(dims_in.size()), rank) << "permute: one entry per dimension of " << x.describe();
  std::vector<std::int64_t> dims(dims_in.size());
  std::vector<bool> used(dims_in.size(), false);
  for (std::size_t i = 0; i < dims.size(); ++i) {
    dims[i] = NormDim("permute", dims_in[i], rank);
    SK_CHECK(!used[static_cast<std::size_t>(dims[i])]) << "permute: dimension " << dims[i] << " repeated";
    used[static_cast<std::size_t>(dims[i])] = true;
  }
  Tensor out = PermuteCopy(x, dims);
  if (should_record({&x})) {
    std::vector<std::int64_t> inverse(dims.size());
    for (std::size_t i = 0; i < dims.size(); ++i) inverse[static_cast<std::size_t>(dims[i])] = static_cast<std::int64_t>(i);
    detail::record("PermuteBackward", {&x}, {&out},
                   [inverse](TensorList&& g) -> TensorList { return {PermuteCopy(g[0], inverse)}; });
  }
  return out;
}

Tensor transpose(const Tensor& x, std::int64_t dim0, std::int64_t dim1) {
  const std::int64_t rank = x.dim();
  std::vector<std::int64_t> dims(static_cast<std::size_t>(rank));
  std::iota(dims.begin(), dims.end(), 0);
  std::swap(dims[static_cast<std::size_t>(NormDim("transpose", dim0, rank))],
            dims[static_cast<std::size_t>(NormDim("transpose", dim1, rank))]);
  return permute(x, dims);
}

std::vector<Tensor> split_compute(const Tensor& x, const std::vector<std::int64_t>& sizes, std::int64_t dim) {
  detail::check_f32("split", x);
  const std::int64_t d = NormDim("split", dim, x.dim());
  std::int64_t total = 0;
  for (std::int64_t s : sizes) {
    SK_CHECK_GE(s, 0) << "split: negative size";
    total += s;
  }
  SK_CHECK_EQ(total, x.size(d)) << "split: sizes must add up to dimension " << d << " of " << x.describe();
  std::vector<Tensor> outs;
  std::int64_t at = 0;
  for (std::int64_t s : sizes) {
    Shape sh = x.shape();
    sh[static_cast<std::size_t>(d)] = s;
    Tensor o = detail::new_activation(sh, DType::f32, x.device());
    TakeAlong(x, o, d, at);
    at += s;
    outs.push_back(std::move(o));
  }
  if (should_record({&x})) {
    auto node = std::make_shared<detail::LambdaBackward>(
        "SplitBackward", [d, in_shape = x.shape(), device = x.device()](TensorList&& g) -> TensorList {
          Tensor gx = detail::new_activation(in_shape, DType::f32, device);
          std::int64_t pos = 0;
          for (const Tensor& gi : g) {
            PlaceAlong(gi, gx, d, pos);
            pos += gi.size(d);
          }
          return {gx};
        });
    node->set_next_edges(collect_next_edges({&x}));
    for (const Tensor& o : outs) set_history(o, node);
  }
  return outs;
}

Tensor concat_compute(const std::vector<Tensor>& xs, std::int64_t dim) {
  SK_CHECK(!xs.empty()) << "concat: no tensors";
  const std::int64_t d = NormDim("concat", dim, xs[0].dim());
  Shape sh = xs[0].shape();
  sh[static_cast<std::size_t>(d)] = 0;
  std::vector<std::int64_t> sizes;
  for (const Tensor& t : xs) {
    detail::check_f32("concat", t);
    detail::check_on("concat", t, xs[0].device());
    Shape ts = t.shape();
    SK_CHECK_EQ(t.dim(), xs[0].dim()) << "concat: ranks differ";
    sizes.push_back(ts[static_cast<std::size_t>(d)]);
    sh[static_cast<std::size_t>(d)] += ts[static_cast<std::size_t>(d)];
    ts[static_cast<std::size_t>(d)] = 0;
    Shape ref = xs[0].shape();
    ref[static_cast<std::size_t>(d)] = 0;
    SK_CHECK(ts == ref) << "concat: " << t.describe() << " does not match " << xs[0].describe()
                        << " outside dimension " << d;
  }
  Tensor out = detail::new_activation(sh, DType::f32, xs[0].device());
  std::int64_t at = 0;
  for (const Tensor& t : xs) {
    PlaceAlong(t, out, d, at);
    at += t.size(d);
  }
  if (should_record(xs)) {
    std::vector<bool> need;
    for (const Tensor& t : xs) need.push_back(detail::needs_grad(t));
    detail::record("ConcatBackward", xs, {out}, [d, sizes, need](TensorList&& g) -> TensorList {
      TensorList gs;
      std::int64_t pos = 0;
      for (std::size_t i = 0; i < sizes.size(); ++i) {
        if (need[i]) {
          Shape s = g[0].shape();
          s[static_cast<std::size_t>(d)] = sizes[i];
          Tensor gi = detail::new_activation(s, DType::f32, g[0].device());
          TakeAlong(g[0], gi, d, pos);
          gs.push_back(gi);
        } else {
          gs.emplace_back();
        }
        pos += sizes[i];
      }
      return gs;
    });
  }
  return out;
}

Tensor narrow_compute(const Tensor& x, std::int64_t dim, std::int64_t start, std::int64_t length) {
  detail::check_f32("narrow", x);
  const std::int64_t d = NormDim("narrow", dim, x.dim());
  SK_CHECK(start >= 0 && length >= 0 && start + length <= x.size(d))
      << "narrow: [" << start << ", " << start + length << ") of dimension " << d << " of " << x.describe();
  Shape sh = x.shape();
  sh[static_cast<std::size_t>(d)] = length;
  Tensor out = detail::new_activation(sh, DType::f32, x.device());
  TakeAlong(x, out, d, start);
  if (should_record({&x})) {
    detail::record("NarrowBackward", {&x}, {&out},
                   [d, start, in_shape = x.shape(), device = x.device()](TensorList&& g) -> TensorList {
                     Tensor gx = detail::zeros_activation(in_shape, DType::f32, device);
                     PlaceAlong(g[0], gx, d, start);
                     return {gx};
                   });
  }
  return out;
}

Tensor cast_compute(const Tensor& x, DType dtype) {
  SK_CHECK(x.defined()) << "cast: undefined input";
  SK_CHECK(is_floating(dtype) && is_floating(x.dtype())) << "cast: float dtypes only, " << x.describe();
  Tensor out = detail::new_activation(x.shape(), dtype, x.device());
  detail::copy_into(out, x);
  if (should_record({&x})) {
    detail::record("CastBackward", {&x}, {&out}, [from = x.dtype()](TensorList&& g) -> TensorList {
      Tensor gx = detail::new_activation(g[0].shape(), from, g[0].device());
      detail::copy_into(gx, g[0]);
      return {gx};
    });
  }
  return out;
}

Tensor reshape(const Tensor& x, const Shape& shape) {
  return detail::traced("reshape", {x}, [shape](const TensorList& t) { return reshape_compute(t[0], shape); });
}

Tensor permute(const Tensor& x, const std::vector<std::int64_t>& dims_in) {
  return detail::traced("permute", {x}, [dims_in](const TensorList& t) { return permute_compute(t[0], dims_in); });
}

std::vector<Tensor> split(const Tensor& x, const std::vector<std::int64_t>& sizes, std::int64_t dim) {
  return detail::traced_list("split", {x}, [sizes, dim](const TensorList& t) { return split_compute(t[0], sizes, dim); });
}

Tensor concat(const std::vector<Tensor>& xs, std::int64_t dim) {
  return detail::traced("concat", xs, [dim](const TensorList& t) { return concat_compute(t, dim); });
}

Tensor narrow(const Tensor& x, std::int64_t dim, std::int64_t start, std::int64_t length) {
  return detail::traced("narrow", {x}, [dim, start, length](const TensorList& t) { return narrow_compute(t[0], dim, start, length); });
}

Tensor cast(const Tensor& x, DType dtype) {
  return detail::traced("cast", {x}, [dtype](const TensorList& t) { return cast_compute(t[0], dtype); });
}

}  // namespace shardkit::autograd
