// Flags every rank learns the "any" of: one element per flag, set (1) or not (0), all-reduced with
// ReduceOp::max() over a group, then read back on the host. The sharding layers use it to tell which parameters
// some rank had a gradient for (Note [parameters no rank used] in sddp/reducer.cc and fsdp/param_group.cc).
#pragma once

#include <vector>

#include "common/tensor/tensor.h"

namespace shardkit::comm {

// `flags` as a tensor to all-reduce (max): in `dtype` (any float dtype holds 0 and 1 exactly) on `device` (a
// backend that moves only device tensors, NCCL, takes it there), counted as a communication buffer.
Tensor flags_tensor(const std::vector<char>& flags, Device device, DType dtype);

// The flags of an all-reduced flags tensor (on any device): element i is set when it is nonzero.
std::vector<char> read_flags(const Tensor& reduced);

}  // namespace shardkit::comm
