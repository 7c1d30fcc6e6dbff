#include "common/autograd/ops/linalg.h"

#include "common/autograd/ops/gemm_timing.h"
#include "common/autograd/ops/op_utils.h"
#include "common/kernels/cuda/bf16_gemm_plan.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/tensor/rank_context.h"

namespace shardkit::autograd {
namespace {

struct MatDims {
  std::int64_t m, k, n;
};

MatDims Dims(const char* op, const Shape& a, const Shape& b, bool ta, bool tb) {
  const std::size_t r = a.size();
  const std::int64_t m = ta ? a[r - 1] : a[r - 2];
  const std::int64_t k = ta ? a[r - 2] : a[r - 1];
  const std::int64_t kb = tb ? b[r - 1] : b[r - 2];
  const std::int64_t n = tb ? b[r - 2] : b[r - 1];
  SK_CHECK_EQ(k, kb) << op << ": inner dimensions differ: a " << shape_str(a) << (ta ? " (transposed)" : "") << ", b "
                     << shape_str(b) << (tb ? " (transposed)" : "");
  return {m, k, n};
}

// For `batches` products of op(A_i) [m, k] and op(B_i) [k, n] stored contiguously:
//   C_i = op(A_i) op(B_i) (+ C_i when accumulate).
void Gemms(Device device, std::int64_t batches, bool ta, bool tb, MatDims d, const float* a, const float* b,
           float* c, float beta) {
  const std::int64_t lda = ta ? d.m : d.k;
  const std::int64_t ldb = tb ? d.k : d.n;
  if (device.is_cuda() && batches > 1) {  // one launch for every batch
    kernels::cuda::gemm_strided_batched(device, ta, tb, d.m, d.n, d.k, 1.f, a, lda, d.m * d.k, b, ldb, d.k * d.n,
                                        beta, c, d.n, d.m * d.n, batches, current_rank_context().matmul_precision);
    return;
  }
  for (std::int64_t i = 0; i < batches; ++i) {
    detail::gemm_on(device, ta, tb, d.m, d.n, d.k, 1.f, a + i * d.m * d.k, lda, b + i * d.k * d.n, ldb, beta,
                    c + i * d.m * d.n, d.n);
  }
}

// Gradients of C = op(A) op(B) per batch, written into fresh tensors of A's / B's shapes.
Tensor GradA(std::int64_t batches, bool ta, bool tb, MatDims d, const Tensor& g, const Tensor& b,
             const Shape& a_shape) {
  Tensor ga = detail::new_activation(a_shape, DType::f32, g.device());
  const float* gp = g.data<float>();
  const float* bp = b.data<float>();
  float* out = ga.data<float>();
  const std::int64_t ldb = tb ? d.k : d.n;
  for (std::int64_t i = 0; i < batches; ++i) {
    const float* gi = gp + i * d.m * d.n;
    const float* bi = bp + i * d.k * d.n;
    float* oi = out + i * d.m * d.k;
    if (!ta) {  // dA [m, k] = dC [m, n] op(B)^T
      detail::gemm_on(g.device(), false, !tb, d.m, d.k, d.n, 1.f, gi, d.n, bi, ldb, 0.f, oi, d.k);
    } else {  // A stored [k, m]: dA = op(B) dC^T
      detail::gemm_on(g.device(), tb, true, d.k, d.m, d.n, 1.f, bi, ldb, gi, d.n, 0.f, oi, d.m);
    }
  }
  return ga;
}

Tensor GradB(std::int64_t batches, bool ta, bool tb, MatDims d, const Tensor& g, const Tensor& a,
             const Shape& b_shape) {
  Tensor gb = detail::new_activation(b_shape, DType::f32, g.device());
  const float* gp = g.data<float>();
  const float* ap = a.data<float>();
  float* out = gb.data<float>();
  const std::int64_t lda = ta ? d.m : d.k;
  for (std::int64_t i = 0; i < batches; ++i) {
    const float* gi = gp + i * d.m * d.n;
    const float* ai = ap + i * d.m * d.k;
    float* oi = out + i * d.k * d.n;
    if (!tb) {  // dB [k, n] = op(A)^T dC
      detail::gemm_on(g.device(), !ta, false, d.k, d.n, d.m, 1.f, ai, lda, gi, d.n, 0.f, oi, d.n);
    } else {  // B stored [n, k]: dB = dC^T op(A)
      detail::gemm_on(g.device(), true, ta, d.n, d.k, d.m, 1.f, gi, d.n, ai, lda, 0.f, oi, d.k);
    }
  }
  return gb;
}

Tensor Product(const char* op, const char* node_name, const Tensor& a, const Tensor& b, bool ta, bool tb,
               int rank) {
  detail::check_f32(op, a);
  detail::check_f32(op, b);
  detail::check_on(op, b, a.device());
  SK_CHECK(a.dim() == rank && b.dim() == rank) << op << ": expected " << rank << "-d tensors, found a "
                                               << a.describe() << ", b " << b.describe();
  const std::int64_t batches = rank == 3 ? a.size(0) : 1;
  if (rank == 3) {
    SK_CHECK_EQ(a.size(0), b.size(0)) << op << ": batch sizes differ";
  }
  const MatDims d = Dims(op, a.shape(), b.shape(), ta, tb);
  Shape out_shape = rank == 3 ? Shape{batches, d.m, d.n} : Shape{d.m, d.n};
  Tensor out = detail::new_activation(out_shape, DType::f32, a.device());
  Gemms(a.device(), batches, ta, tb, d, a.data<float>(), b.data<float>(), out.data<float>(), 0.f);
  if (should_record({&a, &b})) {
    detail::record(node_name, {&a, &b}, {&out},
                   [a, b, ta, tb, d, batches, need_a = detail::needs_grad(a),
                    need_b = detail::needs_grad(b)](TensorList&& g) -> TensorList {
                     Tensor ga, gb;
                     if (need_a) ga = GradA(batches, ta, tb, d, g[0], b, a.shape());
                     if (need_b) gb = GradB(batches, ta, tb, d, g[0], a, b.shape());
                     return {ga, gb};
                   });
  }
  return out;
}

}  // namespace

Tensor matmul(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  return detail::traced("matmul", {a, b}, [trans_a, trans_b](const TensorList& t) {
    return Product("matmul", "MatmulBackward", t[0], t[1], trans_a, trans_b, 2);
  });
}

Tensor bmm(const Tensor& a, const Tensor& b, bool trans_a, bool trans_b) {
  return detail::traced("bmm", {a, b}, [trans_a, trans_b](const TensorList& t) {
    return Product("bmm", "BmmBackward", t[0], t[1], trans_a, trans_b, 3);
  });
}

// Note [bf16 copies kept across a linear's GEMMs]
// At MatmulPrecision::medium on CUDA each GEMM copies its fp32 operands to bf16 (Note [bf16 operand copies] in
// common/kernels/cuda/gemm.cu), so a linear layer's three products would copy x twice (forward, dW), dy twice (dX,
// dW) and W twice (forward, dX). The op makes the copies itself instead (kernels::cuda::pack_bf16; a copy's layout
// depends only on the matrix as stored, not on its role in a product) and multiplies them with
// gemm_on_bf16_copies: x is copied once, in forward, and backward keeps that copy for dW in place of the fp32 x
// (half the bytes held between the passes, as torch.autocast keeps its bf16 casts); dy is copied once for both
// backward products. W is copied in each pass, as before: keeping its copy from forward to backward would hold 2
// bytes per parameter of every layer between the passes, which fully_shard's resharding after forward is there to
// avoid. A product takes copies only where gemm would have made them (LinearProducts), so every result has the
// same bits as before. The copies are activation tensors of the memory ledger; gemm's own are scratch outside it.
namespace {

// Which of a linear layer's three products (x [rows, in], W [out, in]) run on bf16 copies: the forward's
// x W^T, backward's dy W and dy^T x.
struct LinearProducts {
  bool forward = false, grad_x = false, grad_w = false;
};

LinearProducts ProductsOnBf16Copies(Device device, std::int64_t rows, std::int64_t in, std::int64_t out) {
  if (!device.is_cuda() || current_rank_context().matmul_precision != MatmulPrecision::medium || rows < 1 ||
      in < 1 || out < 1) {
    return {};
  }
  using kernels::cuda::medium_gemm_runs_on_bf16_copies;
  return {medium_gemm_runs_on_bf16_copies(rows, out, in), medium_gemm_runs_on_bf16_copies(rows, in, out),
          medium_gemm_runs_on_bf16_copies(out, in, rows)};
}

// The packed bf16 copy of a contiguous rows x cols fp32 matrix on a CUDA device, as an activation tensor.
Tensor Bf16Copy(const float* src, std::int64_t rows, std::int64_t cols, Device device) {
  Tensor copy = detail::new_activation(
      {kernels::cuda::round_up_to_pad(rows), kernels::cuda::round_up_to_pad(cols)}, DType::bf16, device);
  kernels::cuda::pack_bf16(device, src, rows, cols, cols, copy.raw_data());
  return copy;
}

}  // namespace

Tensor linear_compute(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  detail::check_f32("linear", x);
  detail::check_f32("linear", weight);
  const Device device = x.device();
  detail::check_on("linear", weight, device);
  SK_CHECK(weight.dim() == 2 && x.dim() >= 1 && x.size(-1) == weight.size(1))
      << "linear: expected x [..., in] and weight [out, in], found x " << x.describe() << ", weight "
      << weight.describe();
  const std::int64_t in = weight.size(1);
  const std::int64_t out_f = weight.size(0);
  const std::int64_t rows = in == 0 ? 0 : x.numel() / in;
  if (bias.defined()) {
    detail::check_f32("linear", bias);
    detail::check_on("linear", bias, device);
    SK_CHECK(bias.dim() == 1 && bias.size(0) == out_f)
        << "linear: expected bias [" << out_f << "], found " << bias.describe();
  }
  Shape out_shape = x.shape();
  out_shape.back() = out_f;
  Tensor out = detail::new_activation(out_shape, DType::f32, device);
  float* y = out.data<float>();
  // Bias first, then the GEMM accumulates onto it (beta = 1): one pass over y.
  if (bias.defined() && device.is_cuda()) {
    kernels::cuda::broadcast_rows(device, kernels::cuda::RowOp::assign, nullptr, bias.data<float>(), y, rows, out_f);
  } else if (bias.defined()) {
    const float* bp = bias.data<float>();
    for (std::int64_t r = 0; r < rows; ++r) {
      float* __restrict yr = y + r * out_f;
      for (std::int64_t j = 0; j < out_f; ++j) yr[j] = bp[j];
    }
  }
  const bool recording = should_record({&x, &weight, &bias});
  const bool need_x = recording && detail::needs_grad(x);
  const bool need_w = recording && detail::needs_grad(weight);
  const bool need_b = recording && detail::needs_grad(bias);
  // Note [bf16 copies kept across a linear's GEMMs].
  const LinearProducts on_copies = ProductsOnBf16Copies(device, rows, in, out_f);
  const bool keep_x16 = on_copies.grad_w && need_w;
  Tensor x16;
  if (on_copies.forward || keep_x16) x16 = Bf16Copy(x.data<float>(), rows, in, device);
  if (on_copies.forward) {
    const Tensor w16 = Bf16Copy(weight.data<float>(), out_f, in, device);
    detail::gemm_on_bf16_copies(device, false, true, rows, out_f, in, 1.f, x16.raw_data(), w16.raw_data(),
                                bias.defined() ? 1.f : 0.f, y, out_f);
  } else {
    detail::gemm_on(device, false, true, rows, out_f, in, 1.f, x.data<float>(), in, weight.data<float>(), in,
                    bias.defined() ? 1.f : 0.f, y, out_f);
  }
  if (!keep_x16) x16 = Tensor();
  if (recording) {
    detail::record("LinearBackward", {&x, &weight, &bias}, {&out},
                   [x = keep_x16 ? Tensor() : x, x_shape = x.shape(), x16, weight, device, rows, in, out_f, on_copies,
                    has_bias = bias.defined(), need_x, need_w, need_b](TensorList&& g) -> TensorList {
                     const float* gy = g[0].data<float>();
                     Tensor gx, gw, gb;
                     Tensor gy16;  // dy's copy, for both products that run on copies
                     if ((need_x && on_copies.grad_x) || (need_w && on_copies.grad_w)) {
                       gy16 = Bf16Copy(gy, rows, out_f, device);
                     }
                     if (need_x) {  // dx [rows, in] = dy [rows, out] W [out, in]
                       gx = detail::new_activation(x_shape, DType::f32, device);
                       if (on_copies.grad_x) {
                         const Tensor w16 = Bf16Copy(weight.data<float>(), out_f, in, device);
                         detail::gemm_on_bf16_copies(device, false, false, rows, in, out_f, 1.f, gy16.raw_data(),
                                                     w16.raw_data(), 0.f, gx.data<float>(), in);
                       } else {
                         detail::gemm_on(device, false, false, rows, in, out_f, 1.f, gy, out_f, weight.data<float>(),
                                         in, 0.f, gx.data<float>(), in);
                       }
                     }
                     if (need_w) {  // dW [out, in] = dy^T x
                       gw = detail::new_activation(weight.shape(), DType::f32, device);
                       if (on_copies.grad_w) {
                         detail::gemm_on_bf16_copies(device, true, false, out_f, in, rows, 1.f, gy16.raw_data(),
                                                     x16.raw_data(), 0.f, gw.data<float>(), in);
                       } else {
                         detail::gemm_on(device, true, false, out_f, in, rows, 1.f, gy, out_f, x.data<float>(), in,
                                         0.f, gw.data<float>(), in);
                       }
                     }
                     if (has_bias && need_b && device.is_cuda()) {
                       gb = detail::new_activation({out_f}, DType::f32, device);
                       kernels::cuda::sum_rows(device, gy, gb.data<float>(), rows, out_f, /*accumulate=*/false);
                     } else if (has_bias && need_b) {
                       gb = detail::zeros_activation({out_f});
                       float* __restrict o = gb.data<float>();
                       for (std::int64_t r = 0; r < rows; ++r) {
                         const float* __restrict gr = gy + r * out_f;
                         for (std::int64_t j = 0; j < out_f; ++j) o[j] += gr[j];
                       }
                     }
                     return {gx, gw, gb};
                   });
  }
  return out;
}

Tensor linear(const Tensor& x, const Tensor& weight, const Tensor& bias) {
  return detail::traced("linear", {x, weight, bias}, [](const TensorList& t) { return linear_compute(t[0], t[1], t[2]); });
}

}  // namespace shardkit::autograd
