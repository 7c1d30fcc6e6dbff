// Parameter groups, hyper-parameters and per-parameter optimizer state (DESIGN.md section 2, optim/).
//
// A ParamGroup is a list of parameter tensors plus one HyperParams. Every optimizer reads the fields it
// uses and ignores the rest (SGD: lr, weight_decay, momentum, dampening, nesterov, maximize; Adam/AdamW:
// lr, beta1, beta2, eps, weight_decay, maximize). Fields are doubles so schedules and state dicts carry
// them exactly; the fused kernels round them to fp32 once per tensor and step.
//
// ParamState is the state one parameter has after its first step: a step count (a plain integer, never a
// tensor: it is not charged to the ledger) and named fp32 tensors shaped like the parameter, all charged
// to MemoryCategory::optimizer_state.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "common/tensor/tensor.h"

namespace shardkit::optim {

struct HyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;     // Adam / AdamW
  double beta2 = 0.999;   // Adam / AdamW
  double eps = 1e-8;      // Adam / AdamW
  double weight_decay = 0.0;
  double momentum = 0.0;   // SGD
  double dampening = 0.0;  // SGD
  bool nesterov = false;   // SGD (needs momentum > 0 and dampening == 0)
  bool maximize = false;   // ascend instead of descend (the gradient is negated first)

  bool operator==(const HyperParams&) const = default;
};

// Short description for messages: "lr=0.001 betas=(0.9, 0.999) ...".
std::string hyper_params_str(const HyperParams& h);

struct ParamGroup {
  std::vector<Tensor> params;
  HyperParams hyper;
};

// Names of the state tensors (as in PyTorch's state dicts, plus "master").
inline constexpr char kExpAvg[] = "exp_avg";
inline constexpr char kExpAvgSq[] = "exp_avg_sq";
inline constexpr char kMomentumBuffer[] = "momentum_buffer";
// The fp32 master copy of a bf16/f16 parameter (absent for fp32 parameters). See Note [master weights].
inline constexpr char kMaster[] = "master";

struct ParamState {
  std::int64_t step = 0;                  // number of steps this parameter has taken
  std::map<std::string, Tensor> tensors;  // fp32, each shaped like the parameter
};

// True for the dtypes the optimizer keeps an fp32 master copy for (bf16, f16).
inline bool needs_master(DType d) { return d == DType::bf16 || d == DType::f16; }

}  // namespace shardkit::optim
