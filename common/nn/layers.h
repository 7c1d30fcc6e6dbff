// Basic layers: Linear, Embedding, LayerNorm, BatchNorm1d, ReLU, GELU, Dropout, and the containers
// Sequential and ModuleList (DESIGN.md section 2, nn/). Each layer's forward is one autograd op
// (common/autograd/ops.h); parameters are read by name at every call (Module::replace_parameter).
#pragma once

#include <cmath>
#include <memory>

#include "common/autograd/ops.h"
#include "common/nn/init.h"
#include "common/nn/module.h"

namespace shardkit::nn {

// A parameter as the fp32 ops need it: itself when fp32, else a differentiable cast (its gradient
// flows back in the parameter's dtype). See Module::to.
inline Tensor as_f32(const Tensor& p) {
  if (!p.defined() || p.dtype() == DType::f32) return p;
  return autograd::cast(p, DType::f32);
}

// y = x W^T + b, W [out, in]. Default init as PyTorch: U(-1/sqrt(in), 1/sqrt(in)) for W and b;
// with init_std > 0 instead W ~ N(0, init_std) and b = 0 (GPT-2's init).
class Linear : public Module {
 public:
  Linear(std::int64_t in_features, std::int64_t out_features, Generator& gen, bool bias = true,
         float init_std = 0.f);
  // Over existing tensors (weight [out, in], bias [out] or undefined), e.g. a tied output projection:
  // the module registers the very same tensors (a shared parameter when they are registered elsewhere too).
  explicit Linear(Tensor weight, Tensor bias = Tensor());
  const Tensor& weight() const { return parameter("weight"); }
  bool has_bias() const { return has_parameter("bias"); }
  std::int64_t in_features() const { return in_; }
  std::int64_t out_features() const { return out_; }

 protected:
  Tensor forward(const Tensor& x) override;

 private:
  std::int64_t in_, out_;
};

// Rows of weight [num, dim] picked by i64 indices. Init N(0, init_std).
class Embedding : public Module {
 public:
  Embedding(std::int64_t num_embeddings, std::int64_t dim, Generator& gen, float init_std = 1.f);
  const Tensor& weight() const { return parameter("weight"); }

 protected:
  Tensor forward(const Tensor& indices) override;
};

// Over the last dimension; weight = 1, bias = 0 at init.
class LayerNorm : public Module {
 public:
  explicit LayerNorm(std::int64_t dim, float eps = 1e-5f);

 protected:
  Tensor forward(const Tensor& x) override;

 private:
  float eps_;
};

// x [N, C]; parameters weight (1), bias (0); buffers running_mean (0) and running_var (1), updated in
// training mode and used in evaluation mode.
class BatchNorm1d : public Module {
 public:
  explicit BatchNorm1d(std::int64_t features, float momentum = 0.1f, float eps = 1e-5f);

 protected:
  Tensor forward(const Tensor& x) override;

 private:
  float momentum_, eps_;
};

class ReLU : public Module {
 public:
  ReLU() : Module("ReLU") {}

 protected:
  Tensor forward(const Tensor& x) override { return autograd::relu(x); }
};

using autograd::GeluApproximation;

// GELU(x) = x Phi(x), with PyTorch's option nn.GELU(approximate='none' | 'tanh'): none (the default) is
// the exact form through erf, tanh GPT-2's 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); they differ by
// up to 4.8e-4 (autograd/ops/activation.h). The default is exact because it is PyTorch's: a model written
// after a PyTorch one that says nn.GELU() computes the same function here. GPT-2-style models name tanh
// (the transformer MLP in transformer.h does).
class GELU : public Module {
 public:
  explicit GELU(GeluApproximation approximate = GeluApproximation::none)
      : Module("GELU"), approximate_(approximate) {}
  GeluApproximation approximate() const { return approximate_; }

 protected:
  Tensor forward(const Tensor& x) override { return autograd::gelu(x, approximate_); }

 private:
  GeluApproximation approximate_;
};

// Active in training mode only; the mask comes from the calling rank's generator.
class Dropout : public Module {
 public:
  explicit Dropout(float p) : Module("Dropout"), p_(p) {}

 protected:
  Tensor forward(const Tensor& x) override { return autograd::dropout(x, p_, is_training()); }

 private:
  float p_;
};

// Children "0", "1", ... applied in order.
class Sequential : public Module {
 public:
  Sequential() : Module("Sequential") {}
  // Appends a child named by its position.
  template <typename M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> m) {
    return register_module(std::to_string(named_children().size()), std::move(m));
  }
  std::size_t size() const { return named_children().size(); }

 protected:
  Tensor forward(const Tensor& x) override;
};

// Children "0", "1", ... with no forward of its own (a transformer's blocks).
class ModuleList : public Module {
 public:
  ModuleList() : Module("ModuleList") {}
  template <typename M>
  std::shared_ptr<M> push_back(std::shared_ptr<M> m) {
    return register_module(std::to_string(named_children().size()), std::move(m));
  }
  std::size_t size() const { return named_children().size(); }
  const std::shared_ptr<Module>& operator[](std::size_t i) const { return named_children().at(i).second; }
  bool has_forward() const override { return false; }
};

}  // namespace shardkit::nn
