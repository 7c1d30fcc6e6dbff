#include "common/optim/multi_tensor_plan.h"

#include "common/base/check.h"

namespace shardkit::optim {

std::vector<MultiTensorLaunch> plan_multi_tensor_launches(absl::Span<const std::int64_t> numels,
                                                          std::int64_t chunk_numel, int max_tensors) {
  SK_CHECK_GE(chunk_numel, 1);
  SK_CHECK_GE(max_tensors, 1);
  std::vector<MultiTensorLaunch> launches;
  for (std::size_t i = 0; i < numels.size(); ++i) {
    SK_CHECK_GE(numels[i], 0) << "tensor " << i;
    if (numels[i] == 0) continue;
    if (launches.empty() || static_cast<int>(launches.back().tensors.size()) == max_tensors) {
      launches.emplace_back();
      launches.back().first_block.push_back(0);
    }
    MultiTensorLaunch& l = launches.back();
    l.tensors.push_back(static_cast<int>(i));
    l.first_block.push_back(l.first_block.back() + (numels[i] + chunk_numel - 1) / chunk_numel);
  }
  return launches;
}

}  // namespace shardkit::optim
