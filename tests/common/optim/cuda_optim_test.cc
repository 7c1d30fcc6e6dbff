// The fused CUDA optimizers (common/optim/cuda/fused_optim.cu) against the CPU ones (themselves checked against
// double references in the other files): SGD, Adam and AdamW on parameters on a CUDA device, every parameter /
// gradient dtype pair, more tensors than one launch takes, a parameter that skips a step. Every test skips, with
// the reason, when no CUDA device is usable at run time.
#include <bit>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "common/kernels/elementwise.h"
#include "common/optim/adam.h"
#include "common/optim/cuda/cuda_optim_kernels.h"
#include "common/optim/finite.h"
#include "common/optim/sgd.h"
#include "common/tensor/device_memory.h"
#include "common/tensor/random.h"
#include "gtest/gtest.h"
#include "tests/common/tensor/cuda_test_util.h"

namespace shardkit::optim {
namespace {


const Device kGpu = Device::cuda(0);

Tensor ToDevice(const Tensor& t, Device device, std::optional<DType> dtype = std::nullopt) {
  TensorOptions o = TensorOptions{}.with_dtype(dtype.value_or(t.dtype()));
  o.device = device;
  Tensor out = Tensor::empty(t.shape(), o);
  kernels::cast(t, out);
  return out;
}

Tensor Random(std::int64_t n, std::uint64_t seed, DType dtype) {
  Generator gen(seed);
  return ToDevice(Tensor::uniform({n}, gen, -1.0f, 1.0f), Device::cpu(), dtype);
}

enum class Algo { sgd, sgd_momentum, sgd_nesterov, adam, adamw };

std::unique_ptr<Optimizer> Make(Algo algo, std::vector<Tensor> params) {
  HyperParams h{.lr = 0.01, .weight_decay = 0.1};
  switch (algo) {
    case Algo::sgd: return std::make_unique<Sgd>(std::move(params), h);
    case Algo::sgd_momentum:
      h.momentum = 0.9;
      h.dampening = 0.1;
      return std::make_unique<Sgd>(std::move(params), h);
    case Algo::sgd_nesterov:
      h.momentum = 0.9;
      h.nesterov = true;
      h.maximize = true;
      return std::make_unique<Sgd>(std::move(params), h);
    case Algo::adam: return std::make_unique<Adam>(std::move(params), h);
    case Algo::adamw: return std::make_unique<AdamW>(std::move(params), h);
  }
  return nullptr;
}

struct Case {
  Algo algo;
  DType param, grad;
};

class CudaOptimizerTest : public ::testing::TestWithParam<Case> {};

// Sizes: empty, one, short tails, a chunk and one past it, several chunks; 2 * kMaxTensorsPerLaunch + 3 tensors,
// so one step takes three launches per dtype pair.
std::vector<std::int64_t> Sizes() {
  const std::int64_t chunk = cuda::kChunkNumel;
  const std::vector<std::int64_t> base = {0, 1, 7, 255, 1023, chunk, chunk + 1, 3 * chunk + 17};
  std::vector<std::int64_t> sizes;
  for (int i = 0; i < 2 * cuda::kMaxTensorsPerLaunch + 3; ++i) sizes.push_back(base[static_cast<std::size_t>(i) % base.size()]);
  return sizes;
}

TEST_P(CudaOptimizerTest, StepsEqualTheCpuOptimizer) {
  SK_REQUIRE_CUDA_DEVICE("CUDA optimizers");
  const Case c = GetParam();
  const std::vector<std::int64_t> sizes = Sizes();
  std::vector<Tensor> cpu, gpu;
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    cpu.push_back(Random(sizes[i], 100 + i, c.param));
    gpu.push_back(ToDevice(cpu.back(), kGpu));
  }
  std::unique_ptr<Optimizer> cpu_opt = Make(c.algo, cpu), gpu_opt = Make(c.algo, gpu);
  for (int step = 0; step < 4; ++step) {
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      // Parameter 3 skips step 1, so its step count (Adam's bias correction) differs from the others' after it.
      if (step == 1 && i == 3) {
        cpu[i].set_grad(Tensor());
        gpu[i].set_grad(Tensor());
        continue;
      }
      const Tensor g = Random(sizes[i], 1000 * (step + 1) + i, c.grad);
      cpu[i].set_grad(g);
      gpu[i].set_grad(ToDevice(g, kGpu));
    }
    ASSERT_TRUE(cpu_opt->step().ok());
    ASSERT_TRUE(gpu_opt->step().ok());
  }
  // The same fp32 arithmetic in the same order, no FMA on either side (Note [no contraction] in fused_optim.cu):
  // state, fp32 weights and rounded bf16/f16 parameters equal bit for bit.
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    SCOPED_TRACE(::testing::Message() << "parameter " << i << " of " << sizes[i] << " elements");
    const ParamState* cs = cpu_opt->state(static_cast<std::int64_t>(i));
    const ParamState* gs = gpu_opt->state(static_cast<std::int64_t>(i));
    ASSERT_EQ(cs == nullptr, gs == nullptr);
    if (cs == nullptr) continue;
    EXPECT_EQ(gs->step, cs->step);
    ASSERT_EQ(gs->tensors.size(), cs->tensors.size());
    for (const auto& [key, t] : cs->tensors) {
      const std::vector<float> want = t.to_vector();
      const std::vector<float> got = ToDevice(gs->tensors.at(key), Device::cpu()).to_vector();
      for (std::size_t k = 0; k < want.size(); ++k) {
        ASSERT_EQ(std::bit_cast<std::uint32_t>(got[k]), std::bit_cast<std::uint32_t>(want[k]))
            << key << " element " << k << ": " << got[k] << " on the device, " << want[k] << " on the CPU";
      }
    }
    // to_vector widens a bf16 / f16 parameter exactly: equal floats, equal parameters.
    const std::vector<float> want = cpu[i].to_vector(), got = ToDevice(gpu[i], Device::cpu()).to_vector();
    for (std::size_t k = 0; k < want.size(); ++k) {
      ASSERT_EQ(std::bit_cast<std::uint32_t>(got[k]), std::bit_cast<std::uint32_t>(want[k]))
          << "parameter element " << k << ": " << got[k] << " on the device, " << want[k] << " on the CPU";
    }
  }
}

std::vector<Case> Cases() {
  std::vector<Case> cases;
  for (Algo a : {Algo::sgd, Algo::sgd_momentum, Algo::sgd_nesterov, Algo::adam, Algo::adamw}) {
    cases.push_back({a, DType::f32, DType::f32});
    cases.push_back({a, DType::bf16, DType::bf16});
    cases.push_back({a, DType::bf16, DType::f32});
    cases.push_back({a, DType::f16, DType::f16});
  }
  return cases;
}

std::string CaseName(const ::testing::TestParamInfo<Case>& info) {
  static const char* const kAlgo[] = {"sgd", "sgd_momentum", "sgd_nesterov", "adam", "adamw"};
  return std::string(kAlgo[static_cast<int>(info.param.algo)]) + "_" + std::string(dtype_name(info.param.param)) +
         "_" + std::string(dtype_name(info.param.grad));
}

INSTANTIATE_TEST_SUITE_P(AllPairs, CudaOptimizerTest, ::testing::ValuesIn(Cases()), CaseName);

// A grad on another device than its parameter is a broken invariant (InternalError), as a grad of another size is.
TEST(CudaOptimizerRefusals, GradOnAnotherDeviceIsABrokenInvariant) {
  SK_REQUIRE_CUDA_DEVICE("CUDA optimizers");
  Tensor p = ToDevice(Tensor::full({4}, 1.0), kGpu);
  p.set_grad(Tensor::full({4}, 1.0));  // on the CPU
  AdamW opt({p});
  EXPECT_THROW((void)opt.step(), InternalError);
}

// A gradient scaler's unscale and the finite checks on device tensors (finite.h): the same flag and the same
// scaled values as on the CPU, in every float dtype, for finite tensors and for an inf or a NaN anywhere.
TEST(CudaFiniteChecks, ScaleAndFindNonFiniteEqualsTheCpu) {
  SK_REQUIRE_CUDA_DEVICE("finite checks on a device");
  for (const DType dtype : {DType::f32, DType::bf16, DType::f16}) {
    for (const float poison : {0.5f, INFINITY, -INFINITY, NAN}) {
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " poison " << poison);
      Generator gen(5);
      Tensor cpu = Tensor::uniform({3000}, gen, -1.0f, 1.0f);
      cpu.data<float>()[2345] = poison;
      cpu = ToDevice(cpu, Device::cpu(), dtype);
      const Tensor gpu = ToDevice(cpu, kGpu);
      EXPECT_EQ(all_finite({gpu}), all_finite({cpu}));
      const bool cpu_bad = scale_and_find_non_finite(cpu, 0.25f);
      EXPECT_EQ(scale_and_find_non_finite(gpu, 0.25f), cpu_bad);
      EXPECT_EQ(cpu_bad, !std::isfinite(poison));
      const std::vector<float> want = cpu.to(DType::f32).to_vector(), got = gpu.to(Device::cpu()).to(DType::f32).to_vector();
      for (std::size_t i = 0; i < want.size(); ++i) {
        if (std::isnan(want[i])) {
          EXPECT_TRUE(std::isnan(got[i])) << i;
        } else {
          EXPECT_EQ(got[i], want[i]) << i;
        }
      }
      Tensor p = ToDevice(Tensor::zeros({3000}), kGpu);
      p.set_grad(gpu);
      EXPECT_EQ(found_non_finite_grads({p}), cpu_bad);
    }
  }
}

}  // namespace
}  // namespace shardkit::optim
