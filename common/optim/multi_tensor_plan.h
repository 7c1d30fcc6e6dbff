// How a multi-tensor optimizer kernel covers many tensors in few launches (issue 14: "one kernel launch for many
// tensors"), as a pure function that the CUDA launcher follows and tests check without a GPU.
//
// Note [multi-tensor launches]
// An optimizer step touches every parameter, and a GPT has dozens of them, many small (biases, norms): a launch
// per tensor costs a few microseconds of launch latency each and leaves most of the GPU idle on the small ones.
// So one launch covers up to `max_tensors` tensors. Each tensor is cut into chunks of `chunk_numel` elements; a
// launch has one thread block per chunk of each of its tensors, and a block finds its tensor by searching
// `first_block` (block b belongs to the tensor t with first_block[t] <= b < first_block[t + 1]; its chunk is
// b - first_block[t]). The tensors' pointers travel as the kernel's argument (a fixed-size table, so
// `max_tensors` bounds it), not through device memory: no copy before the launch, nothing to free after.
// Empty tensors get no block and no slot. Tensors keep their order, and each appears in exactly one launch.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"

namespace shardkit::optim {

struct MultiTensorLaunch {
  std::vector<int> tensors;               // indices into the numels the plan was made from, ascending
  std::vector<std::int64_t> first_block;  // tensors.size() + 1 entries: prefix sums of each tensor's chunks
  std::int64_t blocks() const { return first_block.empty() ? 0 : first_block.back(); }
};

// numels: elements of each tensor (>= 0). chunk_numel >= 1; max_tensors >= 1.
std::vector<MultiTensorLaunch> plan_multi_tensor_launches(absl::Span<const std::int64_t> numels,
                                                          std::int64_t chunk_numel, int max_tensors);

}  // namespace shardkit::optim
