// Independent double-precision reference optimizers for the tests, written from the algorithm boxes of
// PyTorch's torch.optim documentation (SGD, Adam, AdamW), one element at a time, with no code shared with
// common/optim.
//
// One deliberate choice, documented in common/optim/sgd.h: for SGD with maximize, the gradient is negated
// first (what PyTorch's implementation does, and what the Adam/AdamW boxes say); the SGD box instead flips
// the sign of the final update, which differs only when weight_decay != 0.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

namespace shardkit::optim::testing {

struct RefHyper {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0, momentum = 0, dampening = 0;
  bool nesterov = false, maximize = false;
};

struct RefState {
  std::vector<double> w, m, v, b;  // b: momentum buffer
  std::int64_t t = 0;
  bool has_b = false;
};

inline RefState ref_init(const std::vector<float>& w) {
  RefState s;
  s.w.assign(w.begin(), w.end());
  s.m.assign(w.size(), 0.0);
  s.v.assign(w.size(), 0.0);
  s.b.assign(w.size(), 0.0);
  return s;
}

inline void ref_sgd(const RefHyper& h, RefState& s, const std::vector<float>& grad) {
  ++s.t;
  for (std::size_t i = 0; i < s.w.size(); ++i) {
    double g = h.maximize ? -static_cast<double>(grad[i]) : static_cast<double>(grad[i]);
    if (h.weight_decay != 0) g = g + h.weight_decay * s.w[i];
    if (h.momentum != 0) {
      if (s.has_b) s.b[i] = h.momentum * s.b[i] + (1 - h.dampening) * g;
      else s.b[i] = g;
      g = h.nesterov ? g + h.momentum * s.b[i] : s.b[i];
    }
    s.w[i] = s.w[i] - h.lr * g;
  }
  if (h.momentum != 0) s.has_b = true;
}

// decoupled = AdamW.
inline void ref_adam(const RefHyper& h, RefState& s, const std::vector<float>& grad, bool decoupled) {
  ++s.t;
  const double bc1 = 1 - std::pow(h.beta1, static_cast<double>(s.t));
  const double bc2 = 1 - std::pow(h.beta2, static_cast<double>(s.t));
  for (std::size_t i = 0; i < s.w.size(); ++i) {
    double g = h.maximize ? -static_cast<double>(grad[i]) : static_cast<double>(grad[i]);
    if (decoupled) {
      s.w[i] = s.w[i] - h.lr * h.weight_decay * s.w[i];
    } else if (h.weight_decay != 0) {
      g = g + h.weight_decay * s.w[i];
    }
    s.m[i] = h.beta1 * s.m[i] + (1 - h.beta1) * g;
    s.v[i] = h.beta2 * s.v[i] + (1 - h.beta2) * g * g;
    const double m_hat = s.m[i] / bc1;
    const double v_hat = s.v[i] / bc2;
    s.w[i] = s.w[i] - h.lr * m_hat / (std::sqrt(v_hat) + h.eps);
  }
}

}  // namespace shardkit::optim::testing
