// A model whose parameters may sit out a step, for the combination tests (tests/sddp/*combo*, tests/fsdp/*combo*):
// a trunk and two heads, head b in the loss only while use_b (set the same on every rank).
#pragma once

#include <cstdint>
#include <memory>

#include "common/autograd/ops/activation.h"
#include "common/autograd/ops/elementwise.h"
#include "common/autograd/ops/loss.h"
#include "common/autograd/ops/reduce.h"
#include "common/nn/layers.h"
#include "common/nn/module.h"
#include "common/tensor/tensor.h"

namespace shardkit::two_head {

class TwoHeadNet : public nn::Module {
 public:
  explicit TwoHeadNet(std::uint64_t seed) : Module("TwoHeadNet") {
    Generator gen(seed, 0);
    trunk = register_module("trunk", std::make_shared<nn::Linear>(4, 8, gen));
    a = register_module("a", std::make_shared<nn::Linear>(8, 3, gen));
    b = register_module("b", std::make_shared<nn::Linear>(8, 5, gen));
  }
  bool use_b = true;
  float b_factor = 1.0f;  // head b's loss term is multiplied by it (not at all when 1)
  std::shared_ptr<nn::Linear> trunk, a, b;

 protected:
  // The loss itself (a scalar), so the wrappers' forward hooks run on every call.
  Tensor forward(const Tensor& x) override {
    const Tensor h = autograd::relu((*trunk)(x));
    const Tensor ya = (*a)(h);
    Tensor loss = autograd::mean(autograd::mul(ya, ya));
    if (use_b) {
      const Tensor yb = (*b)(h);
      Tensor lb = autograd::mean(autograd::mul(yb, yb));
      if (b_factor != 1.0f) lb = autograd::scale(lb, b_factor);
      loss = autograd::add(loss, lb);
    }
    return loss;
  }
};

// The same model with a loss every op of which runs on CUDA tensors too (gelu and cross-entropy; relu and mean
// are CPU-only), for the device-only (NCCL-like) group tests.
class DeviceHeadNet : public TwoHeadNet {
 public:
  using TwoHeadNet::TwoHeadNet;

 protected:
  Tensor forward(const Tensor& x) override {
    const Tensor h = autograd::gelu((*trunk)(x));
    Tensor loss = autograd::cross_entropy((*a)(h), Tensor::from_int64({0, 2, 1}, {3}).to(x.device()));
    if (use_b) {
      loss = autograd::add(loss, autograd::cross_entropy((*b)(h), Tensor::from_int64({4, 1, 3}, {3}).to(x.device())));
    }
    return loss;
  }
};

// Rank `rank`'s input in step `step`: 3 rows of 4.
inline Tensor HeadInput(int step, int rank) {
  Generator data(9, static_cast<std::uint64_t>(step * 16 + rank));
  return Tensor::uniform({3, 4}, data, -1, 1);
}

}  // namespace shardkit::two_head
