// Shared helpers for the optimizer tests.
#pragma once

#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/optim/adam.h"
#include "common/optim/sgd.h"
#include "common/tensor/tensor.h"
#include "reference.h"

namespace shardkit::optim::testing {

enum class Algo { kSgd, kAdam, kAdamW };

inline HyperParams ToHyper(const RefHyper& r) {
  HyperParams h;
  h.lr = r.lr;
  h.beta1 = r.beta1;
  h.beta2 = r.beta2;
  h.eps = r.eps;
  h.weight_decay = r.weight_decay;
  h.momentum = r.momentum;
  h.dampening = r.dampening;
  h.nesterov = r.nesterov;
  h.maximize = r.maximize;
  return h;
}

inline std::unique_ptr<Optimizer> MakeOptimizer(Algo algo, std::vector<ParamGroup> groups) {
  absl::StatusOr<std::unique_ptr<Optimizer>> o;
  switch (algo) {
    case Algo::kSgd: o = Sgd::make(std::move(groups)); break;
    case Algo::kAdam: o = Adam::make(std::move(groups)); break;
    case Algo::kAdamW: o = AdamW::make(std::move(groups)); break;
  }
  SK_CHECK(o.ok()) << o.status().message();
  return std::move(*o);
}

// Deterministic gradient for parameter k at step t: 2 (w - target) + 0.1 noise, computed in fp32 from the
// parameter's current values and rounded to `dtype`.
inline Tensor MakeGrad(const Tensor& param, const std::vector<float>& target, int t, int k, DType dtype) {
  std::vector<float> w = param.to_vector();
  std::vector<float> noise(w.size());
  Generator(99, static_cast<std::uint64_t>(t * 16 + k)).fill_normal(noise.data(), static_cast<std::int64_t>(noise.size()));
  std::vector<float> g(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) g[i] = 2.0f * (w[i] - target[i]) + 0.1f * noise[i];
  return Tensor::from_vector(g, param.shape(), TensorOptions{}.with_dtype(dtype).with_category(MemoryCategory::gradient));
}

// True when a and b have the same dtype, shape and bytes.
inline bool SameBits(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined()) return false;
  if (!a.defined()) return true;
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         (a.nbytes() == 0 || std::memcmp(a.raw_data(), b.raw_data(), a.nbytes()) == 0);
}

inline bool SameState(const OptimizerStateDict& a, const OptimizerStateDict& b) {
  if (a.optimizer != b.optimizer || a.param_groups.size() != b.param_groups.size() || a.state.size() != b.state.size()) {
    return false;
  }
  for (std::size_t g = 0; g < a.param_groups.size(); ++g) {
    if (!(a.param_groups[g].hyper == b.param_groups[g].hyper) || a.param_groups[g].params != b.param_groups[g].params) {
      return false;
    }
  }
  for (const auto& [i, s] : a.state) {
    auto it = b.state.find(i);
    if (it == b.state.end() || it->second.step != s.step || it->second.tensors.size() != s.tensors.size()) return false;
    for (const auto& [k, t] : s.tensors) {
      auto jt = it->second.tensors.find(k);
      if (jt == it->second.tensors.end() || !SameBits(t, jt->second)) return false;
    }
  }
  return true;
}

}  // namespace shardkit::optim::testing
