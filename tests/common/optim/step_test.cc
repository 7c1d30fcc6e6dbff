// Optimizer::step() reports user mistakes as a Status and then updates nothing (Note [training step
// contract] in common/optim/optimizer.h).
#include <vector>

#include "common/optim/adam.h"
#include "common/optim/sgd.h"
#include "common/tensor/storage.h"
#include "common/tensor/trace_hook.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::optim {
namespace {

using ::testing::HasSubstr;

// A parameter whose storage is released (what an optimizer built from model.parameters() before fsdp::fully_shard
// sees) is a FailedPrecondition naming it, and the live parameter before it is not
// stepped either.
TEST(OptimizerStepTest, ReleasedParameterIsFailedPreconditionAndStepsNothing) {
  Tensor a = Tensor::full({3}, 1.0);
  Tensor b = Tensor::full({2}, 1.0);
  a.set_grad(Tensor::full({3}, 1.0));
  b.set_grad(Tensor::full({2}, 1.0));
  b.release_storage();
  AdamW opt({a, b});
  absl::Status s = opt.step();
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  EXPECT_THAT(s.message(), HasSubstr("AdamW step: param group 0, parameter 1: expected a parameter with live "
                                     "storage, found f32[2] cpu (released)"));
  EXPECT_THAT(s.message(), HasSubstr("build the optimizer from model.parameters() after fully_shard"));
  EXPECT_EQ(a.to_vector(), std::vector<float>(3, 1.0f));
  EXPECT_EQ(opt.state(0), nullptr);
}

// Hyper-parameters set out of range between steps (mutable_hyper) are an InvalidArgument naming the group;
// nothing is updated, and the step goes through once they are fixed.
TEST(OptimizerStepTest, InvalidHyperIsInvalidArgumentAndStepsNothing) {
  Tensor a = Tensor::full({3}, 1.0);
  Tensor b = Tensor::full({2}, 1.0);
  a.set_grad(Tensor::full({3}, 1.0));
  b.set_grad(Tensor::full({2}, 1.0));
  Sgd opt({a}, HyperParams{.lr = 0.5});
  ASSERT_TRUE(opt.add_param_group(ParamGroup{{b}, HyperParams{.lr = 0.5}}).ok());
  opt.mutable_hyper(1).lr = -1;
  absl::Status s = opt.step();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("SGD step: param group 1: expected lr >= 0, found -1"));
  EXPECT_EQ(a.to_vector(), std::vector<float>(3, 1.0f));
  opt.mutable_hyper(1).lr = 0.5;
  ASSERT_TRUE(opt.step().ok());
  EXPECT_EQ(a.to_vector(), std::vector<float>(3, 0.5f));
  EXPECT_EQ(b.to_vector(), std::vector<float>(2, 0.5f));
}

// A tensor that says it lives on cuda:0 over host bytes (borrowed storage: nothing is allocated on a device), so
// the optimizer's checks of CUDA parameters run without a GPU. Its values are never read here.
Tensor OnCudaLabel(std::vector<float>& bytes) {
  return Tensor::over(Storage::borrow(bytes.data(), bytes.size() * sizeof(float), Device::cuda(0)), 0,
                      {static_cast<std::int64_t>(bytes.size())}, DType::f32);
}

// An optimizer without CUDA kernels (has_device_kernels() false, the default) refuses a CUDA parameter when it is
// added, naming itself; SGD, Adam and AdamW take it.
TEST(OptimizerDeviceTest, OnlyOptimizersWithDeviceKernelsTakeCudaParameters) {
  class CpuOnly final : public Optimizer {
   public:
    CpuOnly() : Optimizer("CpuOnly", HyperParams{}) {}

   protected:
    absl::Status validate_hyper(const HyperParams&) const override { return absl::OkStatus(); }
    std::vector<std::string> required_state_keys(const HyperParams&) const override { return {}; }
    void init_state(const HyperParams&, const Tensor&, ParamState&) const override {}
    void update(const HyperParams&, const Tensor&, const Tensor&, const Tensor&, ParamState&) override {}
  };
  std::vector<float> bytes(4, 0.0f);
  const Tensor p = OnCudaLabel(bytes);
  CpuOnly cpu_only;
  const absl::Status s = cpu_only.add_param_group(std::vector<Tensor>{p});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(s.message(), HasSubstr("CpuOnly param group 0, parameter 0: expected a CPU tensor (CpuOnly has no CUDA "
                                     "kernels), found f32[4] cuda:0"));
  EXPECT_EQ(cpu_only.num_params(), 0);
  EXPECT_TRUE(Sgd(std::vector<Tensor>{}).add_param_group(std::vector<Tensor>{p}).ok());
  EXPECT_TRUE(Adam(std::vector<Tensor>{}).add_param_group(std::vector<Tensor>{p}).ok());
  EXPECT_TRUE(AdamW(std::vector<Tensor>{}).add_param_group(std::vector<Tensor>{p}).ok());
}

// A captured step (common/capture) runs on the CPU: step() under a tracer refuses a CUDA parameter before it
// updates anything, the CPU parameter in front of it included.
TEST(OptimizerDeviceTest, ACapturedStepRefusesCudaParametersAndStepsNothing) {
  struct NullTracer final : trace::Tracer {
    void on_op(std::string_view, std::vector<Tensor>, std::vector<Tensor>, trace::Kernel, const void*) override {}
    void on_unsupported(std::string_view) override {}
  };
  Tensor a = Tensor::full({3}, 1.0);
  a.set_grad(Tensor::full({3}, 1.0));
  std::vector<float> bytes(2, 0.0f);
  Tensor b = OnCudaLabel(bytes);
  AdamW opt({a, b});
  NullTracer tracer;
  trace::TracerScope scope(&tracer);
  const absl::Status s = opt.step();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  EXPECT_THAT(s.message(), HasSubstr("AdamW step: param group 0, parameter 1: a captured step (common/capture) runs "
                                     "on the CPU only, found f32[2] cuda:0"));
  EXPECT_EQ(a.to_vector(), std::vector<float>(3, 1.0f));
  EXPECT_EQ(opt.state(0), nullptr);
}

}  // namespace
}  // namespace shardkit::optim
