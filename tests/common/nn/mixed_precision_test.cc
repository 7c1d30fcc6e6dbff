// nn::MixedPrecisionHooks (Note [rounded parameters in forward] in common/nn/mixed_precision.h): a call computes with
// the parameters' values rounded to param_dtype, the gradient reaches the f32 master, the module holds its masters
// again after the call (also after a call that threw, from the next call on), a tied parameter gets one rounded copy;
// cast_forward_inputs and output_dtype round the root's inputs and outputs.
#include "common/nn/mixed_precision.h"

#include <memory>
#include <stdexcept>
#include <vector>

#include "common/autograd/engine.h"
#include "common/autograd/ops.h"
#include "common/nn/gpt.h"
#include "common/nn/layers.h"
#include "common/tensor/rank_context.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::nn {
namespace {

using ::testing::HasSubstr;

constexpr float kOffGrid = 1.0f + 1.0f / 1024.0f;  // not a bf16 value: rounds to 1

float Bf16(float x) { return Tensor::from_vector({x}, {1}).to(DType::bf16).to_vector()[0]; }

Tensor Eye(std::int64_t n, float diagonal = 1.0f) {
  std::vector<float> v(static_cast<std::size_t>(n * n), 0.0f);
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i * n + i)] = diagonal;
  return Tensor::from_vector(v, {n, n});
}

// A Linear without bias whose weight is off the bf16 grid: y = x W^T with x = I gives W^T, so the output shows the
// values the call computed with.
std::shared_ptr<Linear> OffGridLinear() {
  std::vector<float> w(12);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = kOffGrid * static_cast<float>(i + 1);
  return std::make_shared<Linear>(Tensor::from_vector(w, {3, 4}));
}

TEST(RoundedTo, EqualsTheRoundTripThroughTheDtype) {
  const std::vector<float> v = {0.0f, -0.0f, kOffGrid, -3.14159f, 1e-30f, 3e38f, 65519.0f, 1e-6f};
  const Tensor t = Tensor::from_vector(v, {static_cast<std::int64_t>(v.size())});
  for (const DType d : {DType::bf16, DType::f16, DType::f32}) {
    EXPECT_EQ(rounded_to(t, d).to_vector(), t.to(d).to_vector()) << dtype_name(d);
  }
}

TEST(ValidateMixedPrecision, NamesTheFieldThatIsNotFloating) {
  EXPECT_TRUE(validate_mixed_precision({.param_dtype = DType::bf16, .reduce_dtype = DType::f32}, "X").ok());
  const absl::Status s = validate_mixed_precision({.output_dtype = DType::i64}, "Wrapper");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("Wrapper: expected mixed_precision.output_dtype a floating dtype (f32, bf16 or f16), found i64"));
}

TEST(MixedPrecisionHooks, ACallComputesOnRoundedValuesAndTheMasterGetsTheGradient) {
  RankContext ctx;
  RankContextScope scope(ctx);
  auto lin = OffGridLinear();
  const Tensor master = lin->weight();
  MixedPrecisionHooks hooks(*lin, {.param_dtype = DType::bf16});
  const Tensor y = (*lin)(Eye(4));
  const std::vector<float> w = master.to_vector(), got = y.to_vector();  // got = W^T
  for (std::int64_t o = 0; o < 3; ++o) {
    for (std::int64_t i = 0; i < 4; ++i) {
      EXPECT_EQ(got[static_cast<std::size_t>(i * 3 + o)], Bf16(w[static_cast<std::size_t>(o * 4 + i)]));
    }
  }
  EXPECT_NE(w[0], Bf16(w[0]));  // the master keeps its f32 value
  EXPECT_TRUE(lin->weight().is_same(master));
  EXPECT_FALSE(hooks.open());
  autograd::backward(autograd::sum(y));
  ASSERT_TRUE(master.grad().defined());
  EXPECT_EQ(master.grad().to_vector(), std::vector<float>(12, 1.0f));  // d sum(I W^T) / dW: ones
}

// A module whose forward throws after its child ran, when asked to.
class Thrower : public Module {
 public:
  Thrower() : Module("Thrower") { lin = register_module("lin", OffGridLinear()); }
  Tensor forward(const Tensor& x) override {
    Tensor y = (*lin)(x);
    if (fail) throw std::runtime_error("forward failed");
    return y;
  }
  std::shared_ptr<Linear> lin;
  bool fail = false;
};

TEST(MixedPrecisionHooks, ACallThatThrewIsUndoneByTheNextCall) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Thrower m;
  const Tensor master = m.lin->weight();
  MixedPrecisionHooks hooks(m, {.param_dtype = DType::bf16});
  m.fail = true;
  EXPECT_THROW((void)m(Eye(4)), std::runtime_error);
  EXPECT_TRUE(hooks.open());
  EXPECT_FALSE(m.lin->weight().is_same(master)) << "the rounded copy is still in place after the throw";
  m.fail = false;
  const std::vector<float> got = m(Eye(4)).to_vector();
  EXPECT_EQ(got[0], Bf16(master.to_vector()[0]));
  EXPECT_TRUE(m.lin->weight().is_same(master));
  EXPECT_FALSE(hooks.open());
  m.fail = true;
  EXPECT_THROW((void)m(Eye(4)), std::runtime_error);
  hooks.restore();
  EXPECT_TRUE(m.lin->weight().is_same(master));
}

// GPT's output projection shares the token embedding: inside the call both modules hold one rounded tensor.
TEST(MixedPrecisionHooks, ATiedParameterGetsOneRoundedCopy) {
  RankContext ctx;
  RankContextScope scope(ctx);
  GPT model(*GPTConfig::named("gpt-10k"), 1);
  const Tensor master = model.wte->weight();
  ASSERT_TRUE(model.lm_head->weight().is_same(master));
  MixedPrecisionHooks hooks(model, {.param_dtype = DType::bf16});
  bool seen = false;
  auto probe = model.lm_head->register_forward_pre_hook([&](Module&, const TensorList&) -> std::optional<TensorList> {
    seen = true;
    EXPECT_FALSE(model.lm_head->weight().is_same(master));
    EXPECT_TRUE(model.lm_head->weight().is_same(model.wte->weight()));
    return std::nullopt;
  });
  (void)model(Tensor::from_int64({1, 2, 3, 4}, {1, 4}));
  EXPECT_TRUE(seen);
  EXPECT_TRUE(model.wte->weight().is_same(master));
  EXPECT_TRUE(model.lm_head->weight().is_same(master));
}

TEST(MixedPrecisionHooks, RootInputsToParamDtypeAndOutputsToOutputDtype) {
  RankContext ctx;
  RankContextScope scope(ctx);
  Linear identity(Eye(2));
  const Tensor x = Tensor::from_vector({kOffGrid, 3.0f + 1.0f / 256.0f, 70000.0f, -kOffGrid}, {2, 2});
  {
    MixedPrecisionHooks hooks(identity, {.param_dtype = DType::bf16});
    const std::vector<float> got = identity(x).to_vector(), v = x.to_vector();
    for (std::size_t i = 0; i < v.size(); ++i) EXPECT_EQ(got[i], Bf16(v[i])) << i;
  }
  {
    MixedPrecisionHooks hooks(identity, {.param_dtype = DType::bf16, .cast_forward_inputs = false});
    EXPECT_EQ(identity(x).to_vector(), x.to_vector());
  }
  {
    MixedPrecisionHooks hooks(identity, {.output_dtype = DType::f16});
    EXPECT_EQ(identity(x).to_vector(), x.to(DType::f16).to_vector());  // 70000 overflows f16: inf
  }
}

}  // namespace
}  // namespace shardkit::nn
