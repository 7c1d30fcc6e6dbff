// Autograd ops on CUDA tensors (Note [ops on devices] in common/autograd/ops/op_utils.h) against the same ops on
// the CPU: the forward value and every floating input's gradient, for each op the GPT uses, and GPT-tiny training
// on a GPU against the CPU over 20 AdamW steps. The CUDA tests skip, with the reason, when no CUDA device is
// usable. The device checks run everywhere: a tensor labelled cuda:0 over host bytes reaches them, and they fail
// before any kernel would run.
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "common/autograd/engine.h"
#include "common/autograd/ops.h"
#include "common/kernels/cuda/bf16_gemm_plan.h"
#include "common/kernels/cuda/cuda_kernels.h"
#include "common/nn/nn.h"
#include "common/optim/adam.h"
#include "common/optim/clip_grad.h"
#include "common/tensor/rank_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/tensor/cuda_test_util.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::autograd {
namespace {

using ::testing::HasSubstr;

const Device kGpu = Device::cuda(0);

std::vector<float> HostValues(const Tensor& t) { return t.to(Device::cpu()).to_vector(); }

// Values uniform in [-bound, bound).
Tensor Uniform(const Shape& shape, std::uint64_t seed, float bound = 1.0f) {
  Generator gen(seed);
  return Tensor::uniform(shape, gen, -bound, bound);
}

Tensor Indices(const Shape& shape, const std::vector<std::int64_t>& values) {
  TensorOptions o;
  o.dtype = DType::i64;
  Tensor t = Tensor::empty(shape, o);
  EXPECT_EQ(static_cast<std::size_t>(t.numel()), values.size());
  for (std::size_t i = 0; i < values.size(); ++i) t.data<std::int64_t>()[i] = values[i];
  return t;
}

// |gpu - cpu| <= tol * (1 + |cpu|) elementwise.
void ExpectNear(const std::vector<float>& gpu, const std::vector<float>& cpu, double tol, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  int reported = 0;
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    const double bound = tol * (1.0 + std::fabs(cpu[i]));
    if (!(std::fabs(static_cast<double>(gpu[i]) - cpu[i]) <= bound) && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: gpu " << gpu[i] << ", cpu " << cpu[i];
    }
  }
}

using Op = std::function<Tensor(const TensorList&)>;

// Runs `op` on CPU copies and on GPU copies of `inputs` (floating ones require grad), backpropagates one random
// upstream gradient through both, and compares the results and each floating input's gradient.
void ExpectSameOnDevice(const TensorList& inputs, const Op& op, double tol) {
  TensorList cpu, gpu;
  for (const Tensor& t : inputs) {
    Tensor c = t.clone();
    Tensor g = t.to(kGpu);
    if (is_floating(t.dtype())) {
      c.set_requires_grad(true);
      g.set_requires_grad(true);
    }
    cpu.push_back(c);
    gpu.push_back(g);
  }
  Tensor yc = op(cpu);
  Tensor yg = op(gpu);
  ASSERT_TRUE(yg.device() == kGpu) << yg.describe();
  ASSERT_EQ(yg.shape(), yc.shape());
  ExpectNear(HostValues(yg), yc.to_vector(), tol, "output");
  const Tensor up = Uniform(yc.shape(), 99);
  backward(yc, up);
  backward(yg, up.to(kGpu));
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    if (!is_floating(inputs[i].dtype())) continue;
    ASSERT_TRUE(gpu[i].grad().defined()) << "input " << i;
    ASSERT_TRUE(gpu[i].grad().device() == kGpu) << gpu[i].grad().describe();
    ExpectNear(HostValues(gpu[i].grad()), cpu[i].grad().to_vector(), tol, "gradient of input " + std::to_string(i));
  }
}

constexpr double kTol = 1e-4;

TEST(CudaOpsTest, LinearWithAndWithoutBias) {
  SK_REQUIRE_CUDA_DEVICE("linear on a GPU");
  ExpectSameOnDevice({Uniform({3, 5, 16}, 1), Uniform({24, 16}, 2), Uniform({24}, 3)},
                     [](const TensorList& t) { return linear(t[0], t[1], t[2]); }, kTol);
  ExpectSameOnDevice({Uniform({7, 16}, 4), Uniform({9, 16}, 5)},
                     [](const TensorList& t) { return linear(t[0], t[1]); }, kTol);
}

// Note [bf16 copies kept across a linear's GEMMs] (common/autograd/ops/linalg.cc): at medium the op copies x once
// and dy once for its products, and the results are the bits of the three GEMMs as cuda::gemm makes them on the
// fp32 operands. Shapes where every product runs on copies, only the forward does, and only dW does (x copied in
// forward for backward's sake alone); x 3-d.
TEST(CudaOpsTest, LinearAtMediumGivesTheBitsOfItsThreeGemms) {
  SK_REQUIRE_CUDA_DEVICE("linear on a GPU");
  RankContext ctx;
  ctx.matmul_precision = MatmulPrecision::medium;
  RankContextScope scope(ctx);
  struct Case {
    Shape x;
    std::int64_t out;
  };
  std::uint64_t seed = 80;
  for (const Case& k : {Case{{2, 300, 523}, 768}, Case{{600, 100}, 768}, Case{{64, 600}, 700}}) {
    const std::int64_t in = k.x.back(), rows = Tensor::zeros(k.x).numel() / in;
    SCOPED_TRACE(::testing::Message() << "rows " << rows << " in " << in << " out " << k.out);
    Tensor x = Uniform(k.x, seed++).to(kGpu), w = Uniform({k.out, in}, seed++).to(kGpu);
    const Tensor b = Uniform({k.out}, seed++).to(kGpu);
    Shape y_shape = k.x;
    y_shape.back() = k.out;
    const Tensor up = Uniform(y_shape, seed++).to(kGpu);
    x.set_requires_grad(true);
    w.set_requires_grad(true);
    const Tensor y = linear(x, w, b);
    backward(y, up);
    // The same products on the fp32 operands, as the op made them before it kept copies.
    const Tensor want_y = Tensor::zeros({rows, k.out}).to(kGpu), want_dx = Tensor::zeros({rows, in}).to(kGpu);
    const Tensor want_dw = Tensor::zeros({k.out, in}).to(kGpu);
    const MatmulPrecision p = MatmulPrecision::medium;
    kernels::cuda::broadcast_rows(kGpu, kernels::cuda::RowOp::assign, nullptr, b.data<float>(), want_y.data<float>(),
                                  rows, k.out);
    kernels::cuda::gemm(kGpu, false, true, rows, k.out, in, 1.f, x.data<float>(), in, w.data<float>(), in, 1.f,
                        want_y.data<float>(), k.out, p);
    kernels::cuda::gemm(kGpu, false, false, rows, in, k.out, 1.f, up.data<float>(), k.out, w.data<float>(), in, 0.f,
                        want_dx.data<float>(), in, p);
    kernels::cuda::gemm(kGpu, true, false, k.out, in, rows, 1.f, up.data<float>(), k.out, x.data<float>(), in, 0.f,
                        want_dw.data<float>(), in, p);
    EXPECT_EQ(HostValues(y), HostValues(want_y)) << "y";
    EXPECT_EQ(HostValues(x.grad()), HostValues(want_dx)) << "dx";
    EXPECT_EQ(HostValues(w.grad()), HostValues(want_dw)) << "dW";
  }
}

// What a linear layer holds between forward and backward at medium: its output and the bf16 copy of its input
// (rows and columns padded to multiples of 8: Note [padded bf16 copies]), not the fp32 input; at highest the fp32
// input.
TEST(CudaOpsTest, LinearAtMediumKeepsABf16CopyOfItsInputForBackward) {
  SK_REQUIRE_CUDA_DEVICE("linear on a GPU");
  constexpr std::int64_t kRows = 600, kIn = 523, kOut = 768;
  Tensor w = Uniform({kOut, kIn}, 90).to(kGpu);
  w.set_requires_grad(true);
  const Tensor x_host = Uniform({kRows, kIn}, 91);
  auto held_after_forward = [&](MatmulPrecision precision) {
    RankContext ctx;
    ctx.matmul_precision = precision;
    RankContextScope scope(ctx);
    MemoryCategoryScope activations(MemoryCategory::activation);
    Tensor x = x_host.to(kGpu);
    const Tensor y = linear(x, w);
    x = Tensor();  // the caller's handle dropped: only the graph may keep it
    return ctx.memory->snapshot().at(MemoryLocation::device).current_of(MemoryCategory::activation);
  };
  const std::int64_t y_bytes = kRows * kOut * 4;
  EXPECT_EQ(held_after_forward(MatmulPrecision::highest), y_bytes + kRows * kIn * 4);
  EXPECT_EQ(held_after_forward(MatmulPrecision::medium), y_bytes + kRows * 528 * 2);
}

TEST(CudaOpsTest, MatmulEveryTransposeAndBmm) {
  SK_REQUIRE_CUDA_DEVICE("matmul / bmm on a GPU");
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      SCOPED_TRACE(::testing::Message() << "trans_a " << ta << " trans_b " << tb);
      const Shape a = ta ? Shape{6, 5} : Shape{5, 6};
      const Shape b = tb ? Shape{7, 6} : Shape{6, 7};
      ExpectSameOnDevice({Uniform(a, 6), Uniform(b, 7)},
                         [ta, tb](const TensorList& t) { return matmul(t[0], t[1], ta, tb); }, kTol);
      const Shape ba = ta ? Shape{3, 6, 5} : Shape{3, 5, 6};
      const Shape bb = tb ? Shape{3, 7, 6} : Shape{3, 6, 7};
      ExpectSameOnDevice({Uniform(ba, 8), Uniform(bb, 9)},
                         [ta, tb](const TensorList& t) { return bmm(t[0], t[1], ta, tb); }, kTol);
    }
  }
}

TEST(CudaOpsTest, ElementwiseWithAndWithoutBroadcast) {
  SK_REQUIRE_CUDA_DEVICE("add / sub / mul / scale on a GPU");
  ExpectSameOnDevice({Uniform({4, 6, 8}, 10), Uniform({6, 8}, 11)},
                     [](const TensorList& t) { return add(t[0], t[1]); }, kTol);
  ExpectSameOnDevice({Uniform({4, 6, 8}, 12), Uniform({4, 6, 8}, 13)},
                     [](const TensorList& t) { return sub(t[0], t[1]); }, kTol);
  ExpectSameOnDevice({Uniform({4, 6, 8}, 39), Uniform({8}, 40)},
                     [](const TensorList& t) { return sub(t[0], t[1]); }, kTol);
  ExpectSameOnDevice({Uniform({4, 6, 8}, 14), Uniform({8}, 15)},
                     [](const TensorList& t) { return mul(t[0], t[1]); }, kTol);
  ExpectSameOnDevice({Uniform({5, 3}, 16)}, [](const TensorList& t) { return scale(t[0], -2.5f); }, kTol);
}

TEST(CudaOpsTest, GeluBothForms) {
  SK_REQUIRE_CUDA_DEVICE("gelu on a GPU");
  for (GeluApproximation a : {GeluApproximation::none, GeluApproximation::tanh}) {
    ExpectSameOnDevice({Uniform({1000}, 17, 4.0f)},
                       [a](const TensorList& t) { return gelu(t[0], a); }, kTol);
  }
}

TEST(CudaOpsTest, LayerNormWithAndWithoutAffine) {
  SK_REQUIRE_CUDA_DEVICE("layer_norm on a GPU");
  // 130 rows: more than one chunk of the column sums; width 100: not a multiple of a warp.
  ExpectSameOnDevice({Uniform({10, 13, 100}, 18), Uniform({100}, 19), Uniform({100}, 20)},
                     [](const TensorList& t) { return layer_norm(t[0], t[1], t[2]); }, kTol);
  ExpectSameOnDevice({Uniform({6, 40}, 21)}, [](const TensorList& t) { return layer_norm(t[0], Tensor(), Tensor()); },
                     kTol);
}

TEST(CudaOpsTest, CausalAttention) {
  SK_REQUIRE_CUDA_DEVICE("causal_attention on a GPU");
  // T = 37: rows longer than a warp; 4 heads of 8.
  ExpectSameOnDevice({Uniform({2, 37, 96}, 22)}, [](const TensorList& t) { return causal_attention(t[0], 4); },
                     kTol);
}

// Matmul precision medium with RankContext::fused_attention on a device that runs it: attention is one fused kernel
// each way (Note [flash attention] in common/kernels/cuda/flash_attention.cu), bf16 products with fp32 softmax and
// sums, so the op follows the fp32 CPU op to bf16 accuracy. Row counts on both sides of the 64-row blocks, and head sizes for each tile width (16,
// 32, 64, 128) with and without padding columns.
TEST(CudaOpsTest, FusedAttentionAtMediumPrecisionMatchesTheCpu) {
  SK_REQUIRE_CUDA_DEVICE("fused attention on a GPU");
  if (!kernels::cuda::flash_attention_supported(kGpu, 64)) GTEST_SKIP() << "the fused attention needs sm_80 or newer";
  RankContext ctx;
  ctx.matmul_precision = MatmulPrecision::medium;
  ctx.fused_attention = true;
  RankContextScope scope(ctx);
  struct Case {
    std::int64_t b, t, heads, hs;
  };
  std::uint64_t seed = 60;
  for (const Case k : {Case{2, 1, 2, 64}, {1, 63, 3, 64}, {2, 64, 2, 64}, {1, 65, 2, 64}, {2, 130, 2, 16},
                       {1, 200, 2, 32}, {1, 129, 1, 128}, {2, 37, 4, 8}, {1, 70, 2, 48}, {1, 300, 2, 100}}) {
    SCOPED_TRACE(::testing::Message() << "B " << k.b << " T " << k.t << " heads " << k.heads << " hs " << k.hs);
    ExpectSameOnDevice({Uniform({k.b, k.t, 3 * k.heads * k.hs}, seed++)},
                       [h = k.heads](const TensorList& t) { return causal_attention(t[0], h); }, 2e-2);
  }
}

// Matmul precision medium with the materialised attention (RankContext::fused_attention off): the products run on
// bf16 tensor cores, the head-wide ones at T >= 512 on the bf16 copies of P and dS the softmax kernels write (Note
// [softmax writes the bf16 copy] in common/autograd/ops/attention.cc), so the op follows the fp32 CPU op to bf16
// accuracy, forward and gradients. T not a multiple of 8 (the copies' padding) on both sides of that threshold, and
// T = 512 (no padding).
TEST(CudaOpsTest, MaterialisedAttentionAtMediumPrecisionMatchesTheCpu) {
  SK_REQUIRE_CUDA_DEVICE("causal_attention on a GPU");
  RankContext ctx;
  ctx.matmul_precision = MatmulPrecision::medium;
  ctx.fused_attention = false;
  RankContextScope scope(ctx);
  struct Case {
    std::int64_t b, t, heads, hs;
    bool on_copies;  // attention_runs_on_softmax_copies(t, hs)
  };
  std::uint64_t seed = 80;
  for (const Case k : {Case{2, 37, 4, 8, false}, {1, 70, 2, 48, false}, {2, 517, 2, 64, true}, {1, 512, 2, 32, true}}) {
    SCOPED_TRACE(::testing::Message() << "B " << k.b << " T " << k.t << " heads " << k.heads << " hs " << k.hs);
    ASSERT_EQ(kernels::cuda::attention_runs_on_softmax_copies(k.t, k.hs), k.on_copies);
    ExpectSameOnDevice({Uniform({k.b, k.t, 3 * k.heads * k.hs}, seed++)},
                       [h = k.heads](const TensorList& t) { return causal_attention(t[0], h); }, 2e-2);
  }
}

// The fused path holds no [B, H, T, T] matrix: the forward's device activations stay under one, where the
// materialised path (matmul precision highest, or medium with RankContext::fused_attention off) holds it.
TEST(CudaOpsTest, FusedAttentionHoldsNoScoreMatrix) {
  SK_REQUIRE_CUDA_DEVICE("fused attention on a GPU");
  if (!kernels::cuda::flash_attention_supported(kGpu, 64)) GTEST_SKIP() << "the fused attention needs sm_80 or newer";
  constexpr std::int64_t kB = 1, kT = 256, kHeads = 2, kHs = 64;
  const Tensor qkv = Uniform({kB, kT, 3 * kHeads * kHs}, 70).to(kGpu);
  auto forward_peak = [&](MatmulPrecision precision, bool fused = true) {
    Tensor x = qkv.clone();  // charged outside the measured ledger
    x.set_requires_grad(true);
    RankContext ctx;
    ctx.matmul_precision = precision;
    ctx.fused_attention = fused;
    RankContextScope scope(ctx);
    const Tensor y = causal_attention(x, kHeads);
    return ctx.memory->snapshot().at(MemoryLocation::device).peak_of(MemoryCategory::activation);
  };
  const std::int64_t scores = kB * kHeads * kT * kT * 4;
  EXPECT_GE(forward_peak(MatmulPrecision::highest), scores);
  EXPECT_GE(forward_peak(MatmulPrecision::medium, false), scores);
  EXPECT_LT(forward_peak(MatmulPrecision::medium), scores);
}

TEST(CudaOpsTest, CrossEntropyWithIgnoredRows) {
  SK_REQUIRE_CUDA_DEVICE("cross_entropy on a GPU");
  const Tensor targets = Indices({2, 3}, {4, -100, 0, 299, 7, -100});
  ExpectSameOnDevice({Uniform({2, 3, 300}, 23, 5.0f), targets},
                     [](const TensorList& t) { return cross_entropy(t[0], t[1]); }, 1e-5);
  // Every row ignored: loss 0, gradient 0, as on the CPU.
  ExpectSameOnDevice({Uniform({2, 5}, 24), Indices({2}, {-100, -100})},
                     [](const TensorList& t) { return cross_entropy(t[0], t[1]); }, 1e-6);
}

TEST(CudaOpsTest, EmbeddingWithRepeatedIndices) {
  SK_REQUIRE_CUDA_DEVICE("embedding on a GPU");
  ExpectSameOnDevice({Uniform({11, 20}, 25), Indices({2, 4}, {3, 0, 3, 10, 3, 1, 0, 9})},
                     [](const TensorList& t) { return embedding(t[0], t[1]); }, kTol);
}

TEST(CudaOpsTest, NarrowSplitConcatAndCast) {
  SK_REQUIRE_CUDA_DEVICE("shape ops on a GPU");
  ExpectSameOnDevice({Uniform({4, 9, 5}, 26)}, [](const TensorList& t) { return narrow(t[0], 1, 2, 4); }, kTol);
  ExpectSameOnDevice({Uniform({4, 9, 5}, 27)}, [](const TensorList& t) {
    std::vector<Tensor> parts = split(t[0], {2, 3, 4}, 1);
    return add(mul(parts[0], narrow(parts[2], 1, 0, 2)), narrow(parts[1], 1, 1, 2));
  }, kTol);
  // An unused output: the engine fills its gradient with zeros on the device.
  ExpectSameOnDevice({Uniform({4, 9, 5}, 41)}, [](const TensorList& t) { return split(t[0], {4, 5}, 1)[1]; }, kTol);
  ExpectSameOnDevice({Uniform({3, 2, 4}, 28), Uniform({3, 5, 4}, 29)},
                     [](const TensorList& t) { return concat({t[0], t[1]}, 1); }, kTol);
  ExpectSameOnDevice({Uniform({64}, 30)}, [](const TensorList& t) { return cast(cast(t[0], DType::bf16), DType::f32); },
                     0.0);
}

TEST(CudaOpsTest, OutOfRangeIndicesAreErrorsNamingThePosition) {
  SK_REQUIRE_CUDA_DEVICE("embedding / cross_entropy index checks on a GPU");
  const Tensor w = Uniform({5, 4}, 31).to(kGpu);
  try {
    embedding(w, Indices({3}, {1, 5, 2}).to(kGpu));
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("index 5 at position 1 is outside [0, 5)"));
  }
  try {
    cross_entropy(Uniform({3, 6}, 32).to(kGpu), Indices({3}, {0, 2, -1}).to(kGpu));
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("target -1 at position 2 is outside [0, 6)"));
  }
}

// A tensor that says it lives on cuda:0 over host bytes: the device checks see a CUDA tensor, no kernel runs.
Tensor LabelledCuda(std::vector<float>& bytes, const Shape& shape) {
  return Tensor::over(Storage::borrow(bytes.data(), bytes.size() * sizeof(float), kGpu), 0, shape, DType::f32);
}

TEST(OpsOnDevicesTest, MixedDevicesAreErrorsNamingBothTensors) {
  std::vector<float> w_bytes(4 * 3), b_bytes(4);
  const Tensor w = LabelledCuda(w_bytes, {4, 3});
  const Tensor b = LabelledCuda(b_bytes, {4});
  const Tensor x = Uniform({2, 3}, 33);
  auto message = [](const std::function<void()>& f) -> std::string {
    try {
      f();
    } catch (const std::exception& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_THAT(message([&] { linear(x, w); }), HasSubstr("linear: tensors on different devices"));
  EXPECT_THAT(message([&] { add(Uniform({2, 4}, 34), b); }), HasSubstr("add: tensors on different devices"));
  EXPECT_THAT(message([&] { matmul(x, w, false, true); }), HasSubstr("matmul: tensors on different devices"));
  EXPECT_THAT(message([&] { layer_norm(Uniform({2, 4}, 35), b, Tensor()); }), HasSubstr("expected an f32 CPU tensor"));
  EXPECT_THAT(message([&] { embedding(w, Indices({2}, {0, 1})); }), HasSubstr("expected i64 indices on cuda:0"));
  EXPECT_THAT(message([&] { cross_entropy(w, Indices({4}, {0, 1, 2, 0})); }),
              HasSubstr("expected i64 targets on cuda:0"));
  // A CPU-only op names itself.
  EXPECT_THAT(message([&] { softmax(w); }), HasSubstr("softmax: expected an f32 CPU tensor"));
}

TEST(OpsOnDevicesTest, BackwardRefusesAGradientOfAnotherDeviceOrDtype) {
  std::vector<float> bytes(6);
  Tensor root = LabelledCuda(bytes, {2, 3});
  root.set_requires_grad(true);
  try {
    backward(root, Uniform({2, 3}, 36));
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("expected a gradient of dtype f32 on cuda:0"));
  }
  Tensor cpu_root = Uniform({2, 3}, 37);
  cpu_root.set_requires_grad(true);
  try {
    backward(cpu_root, Uniform({2, 3}, 38).to(DType::bf16));
    ADD_FAILURE() << "no error";
  } catch (const std::exception& e) {
    EXPECT_THAT(e.what(), HasSubstr("expected a gradient of dtype f32 on cpu"));
  }
}

TEST(CudaModuleTest, ClipToDtypeAndLoadStateDictOnADevice) {
  SK_REQUIRE_CUDA_DEVICE("clipping, Module::to(DType) and load_state_dict on a GPU");
  auto grads_of = [](nn::Module& m) {
    std::vector<float> out;
    for (const Tensor& p : m.parameters()) {
      const std::vector<float> v = HostValues(p.grad());
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  };
  nn::GPT cpu(gpt_tiny::TinyConfig(), 1), gpu(gpt_tiny::TinyConfig(), 2);
  ASSERT_TRUE(gpu.load_state_dict(cpu.state_dict()).ok());  // CPU -> CPU, then moved
  gpu.to(kGpu);
  auto [x, y] = gpt_tiny::Batch(0, 0, 4);
  backward(cpu.loss(x, y));
  backward(gpu.loss(x.to(kGpu), y.to(kGpu)));
  const double norm_cpu = optim::clip_grad_norm(cpu.parameters(), 0.1);
  const double norm_gpu = optim::clip_grad_norm(gpu.parameters(), 0.1);
  EXPECT_NEAR(norm_gpu, norm_cpu, 1e-4 * norm_cpu);
  ExpectNear(grads_of(gpu), grads_of(cpu), 1e-4, "clipped gradient");
  // load_state_dict from CPU tensors into a model on the device, then bf16 parameters there.
  nn::GPT other(gpt_tiny::TinyConfig(), 3);
  other.to(kGpu);
  ASSERT_TRUE(other.load_state_dict(cpu.state_dict()).ok());
  other.to(DType::bf16);
  for (const Tensor& p : other.parameters()) {
    EXPECT_TRUE(p.device() == kGpu && p.dtype() == DType::bf16) << p.describe();
  }
  ExpectNear(HostValues(other.parameters()[0]), cpu.parameters()[0].to_vector(), 1e-2, "bf16 parameter");
}

// ---- GPT-tiny on a GPU against the CPU -------------------------------------------------------------------------
struct TrainedGpt {
  std::vector<double> losses;
  std::vector<float> params;  // every parameter, concatenated
};

TrainedGpt TrainGpt(Device device, int steps, MatmulPrecision precision = MatmulPrecision::highest) {
  RankContext ctx;
  ctx.matmul_precision = precision;
  RankContextScope scope(ctx);
  nn::GPT model(gpt_tiny::TinyConfig(), 1);
  model.to(device);
  auto opt = optim::AdamW::make({{model.parameters(), optim::AdamW::default_hyper()}}, optim::AdamW::default_hyper());
  EXPECT_TRUE(opt.ok());
  TrainedGpt out;
  auto [x, y] = gpt_tiny::Batch(0, 0, 8);  // one batch, every step: the loss must fall
  for (int step = 0; step < steps; ++step) {
    (*opt)->zero_grad();
    Tensor loss = model.loss(x.to(device), y.to(device));
    out.losses.push_back(HostValues(loss)[0]);
    backward(loss);
    EXPECT_TRUE((*opt)->step().ok());
  }
  for (const Tensor& p : model.parameters()) {
    EXPECT_TRUE(p.device() == device) << p.describe();
    const std::vector<float> v = HostValues(p);
    out.params.insert(out.params.end(), v.begin(), v.end());
  }
  return out;
}

TEST(CudaGptTrainingTest, TwentyAdamWStepsMatchTheCpu) {
  SK_REQUIRE_CUDA_DEVICE("GPT training on a GPU");
  const TrainedGpt cpu = TrainGpt(Device::cpu(), 20);
  const TrainedGpt gpu = TrainGpt(kGpu, 20);
  ASSERT_EQ(gpu.losses.size(), cpu.losses.size());
  for (std::size_t i = 0; i < cpu.losses.size(); ++i) EXPECT_NEAR(gpu.losses[i], cpu.losses[i], 1e-3) << "step " << i;
  EXPECT_LT(gpu.losses.back(), gpu.losses.front() - 0.2);  // the CPU: 4.16 -> 3.87 on this one batch
  ExpectNear(gpu.params, cpu.params, 1e-3, "parameter");
}

// Matmul precision "medium" (Note [matmul precision]): every GEMM of the forward and backward, attention's included,
// on bf16-rounded operands. Training follows the fp32 CPU run to bf16 accuracy, and the setting is not ignored:
// the parameters differ from the GPU's own full-fp32 run.
TEST(CudaGptTrainingTest, MediumMatmulPrecisionTracksTheCpu) {
  SK_REQUIRE_CUDA_DEVICE("GPT training on a GPU");
  const TrainedGpt cpu = TrainGpt(Device::cpu(), 20);
  const TrainedGpt full = TrainGpt(kGpu, 20);
  const TrainedGpt medium = TrainGpt(kGpu, 20, MatmulPrecision::medium);
  ASSERT_EQ(medium.losses.size(), cpu.losses.size());
  for (std::size_t i = 0; i < cpu.losses.size(); ++i) {
    EXPECT_NEAR(medium.losses[i], cpu.losses[i], 2e-2) << "step " << i;
  }
  EXPECT_LT(medium.losses.back(), medium.losses.front() - 0.2);
  EXPECT_NE(medium.params, full.params) << "matmul precision medium changed nothing";
}

}  // namespace
}  // namespace shardkit::autograd
