#include "common/nn/mixed_precision.h"

#include <algorithm>
#include <cstdint>
#include <memory>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/autograd/function.h"
#include "common/base/check.h"
#include "common/tensor/rank_context.h"

namespace shardkit::nn {
namespace {

// y = x rounded to a narrower dtype, kept f32; dy/dx = identity (the straight-through gradient of a cast).
class RoundTo : public autograd::Function {
 public:
  explicit RoundTo(DType dtype) : dtype_(dtype) {}
  std::string name() const override { return "RoundToParamDtype"; }
  TensorList forward(const TensorList& in) override { return {rounded_to(in[0], dtype_)}; }
  TensorList backward(const TensorList& grad_out) override { return {grad_out[0]}; }

 private:
  DType dtype_;
};

absl::Status check_floating(const std::optional<DType>& d, std::string_view field, std::string_view who) {
  if (!d || is_floating(*d)) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(std::string(who), ": expected mixed_precision.", std::string(field),
                                                 " a floating dtype (f32, bf16 or f16), found ",
                                                 std::string(dtype_name(*d))));
}

}  // namespace

absl::Status validate_mixed_precision(const MixedPrecisionPolicy& policy, std::string_view who) {
  if (absl::Status s = check_floating(policy.param_dtype, "param_dtype", who); !s.ok()) return s;
  if (absl::Status s = check_floating(policy.reduce_dtype, "reduce_dtype", who); !s.ok()) return s;
  return check_floating(policy.output_dtype, "output_dtype", who);
}

Tensor rounded_to(const Tensor& src, DType dtype) {
  SK_CHECK(src.dtype() == DType::f32) << "rounded_to: expected an f32 tensor, found " << src.describe();
  SK_CHECK(is_floating(dtype)) << "rounded_to: expected a floating dtype, found " << dtype_name(dtype);
  // On a device the bytes are not the host's: round through a tensor of `dtype` there (Tensor::to converts where
  // the tensor is).
  if (!src.device().is_cpu()) return dtype == DType::f32 ? src.clone() : src.to(dtype).to(DType::f32);
  Tensor out = Tensor::empty(src.shape(), TensorOptions{}.with_dtype(DType::f32));
  const float* s = src.data<float>();
  float* d = out.data<float>();
  // Through a small buffer of dtype's elements (2 bytes each), so the copy needs no tensor of dtype's size.
  constexpr std::int64_t kChunk = 2048;
  std::uint16_t narrow[kChunk];
  for (std::int64_t i = 0; i < src.numel(); i += kChunk) {
    const std::int64_t n = std::min(kChunk, src.numel() - i);
    if (dtype == DType::f32) {
      std::copy(s + i, s + i + n, d + i);
      continue;
    }
    convert_elements(s + i, DType::f32, narrow, dtype, n);
    convert_elements(narrow, dtype, d + i, DType::f32, n);
  }
  return out;
}

TensorList round_floating(const TensorList& values, DType dtype) {
  if (dtype == DType::f32) return values;
  TensorList out;
  out.reserve(values.size());
  for (const Tensor& t : values) {
    if (!t.defined() || t.dtype() != DType::f32) {
      out.push_back(t);
      continue;
    }
    out.push_back(autograd::apply_function(std::make_shared<RoundTo>(dtype), {t})[0]);
  }
  return out;
}

MixedPrecisionHooks::MixedPrecisionHooks(Module& root, const MixedPrecisionPolicy& policy)
    : root_(root), policy_(policy) {
  for (const auto& [name, m] : root.named_modules()) {
    std::vector<Module*>& below = subtree_[m];
    for (const auto& [sub_name, sub] : m->named_modules()) below.push_back(sub);
    hooks_.push_back(m->register_forward_pre_hook([this](Module& called, const TensorList& in) -> std::optional<TensorList> {
      // A call that threw never ran its post-hook: its rounded copies are still in place. The root's call, or a
      // new call of the module that opened, starts from the masters.
      if (opener_ != nullptr && (opener_ == &called || &called == &root_)) restore();
      if (opener_ == nullptr && policy_.param_dtype) open_for(called);
      if (&called == &root_ && policy_.cast_forward_inputs && policy_.param_dtype) {
        return round_floating(in, *policy_.param_dtype);
      }
      return std::nullopt;
    }));
    hooks_.push_back(m->register_forward_hook(
        [this](Module& called, const TensorList&, const TensorList& out) -> std::optional<TensorList> {
          if (opener_ == &called) restore();
          if (&called == &root_ && policy_.output_dtype) return round_floating(out, *policy_.output_dtype);
          return std::nullopt;
        }));
  }
}

MixedPrecisionHooks::~MixedPrecisionHooks() { restore(); }

void MixedPrecisionHooks::open_for(Module& m) {
  opener_ = &m;
  // The rounded copies are the parameters the call computes with (Note [rounded parameters in forward]).
  MemoryCategoryScope category(MemoryCategory::parameter);
  std::unordered_map<const TensorImpl*, Tensor> rounded;  // one copy per tensor, however many modules hold it
  const DType dtype = *policy_.param_dtype;
  for (Module* sub : subtree_.at(&m)) {
    const NamedTensors local = sub->local_parameters();  // a copy: replace_parameter writes the module's list
    for (const auto& [name, p] : local) {
      if (!p.defined() || p.dtype() != DType::f32 || !p.storage() || p.storage_released()) continue;
      auto [it, fresh] = rounded.try_emplace(p.id());
      if (fresh) it->second = round_floating({p}, dtype)[0];
      swapped_.emplace_back(sub, name, p);
      sub->replace_parameter(name, it->second);
    }
  }
}

void MixedPrecisionHooks::restore() {
  for (auto it = swapped_.rbegin(); it != swapped_.rend(); ++it) std::get<0>(*it)->replace_parameter(std::get<1>(*it), std::get<2>(*it));
  swapped_.clear();
  opener_ = nullptr;
}

}  // namespace shardkit::nn
