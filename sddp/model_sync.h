// Model agreement across ranks at wrapper construction (DESIGN.md section 4): every rank must hold the same
// parameter and buffer names, shapes and dtypes, and starts from rank 0's values.
//
// Both functions are collectives over `group` (every rank calls them, in the same order).
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"
#include "common/nn/module.h"

namespace shardkit::sddp {

// One line per parameter ("param blocks.0.attn.qkv.weight f32[16, 48]") then per buffer, in module order.
std::vector<std::string> describe_model(const nn::Module& module);

// OK when every rank's describe_model() is identical. Otherwise InvalidArgument, the same on every rank,
// naming the first rank that differs from rank 0 and its first differing entry:
//   "model on rank 1 differs from rank 0 at entry 3: expected 'param h.weight f32[4, 8]', found
//    'param h.weight f32[4, 9]'".
// Costs one all_gather of an 8-byte hash when the models agree.
absl::Status verify_same_model(const nn::Module& module, comm::ProcessGroup& group,
                               std::optional<absl::Duration> timeout = std::nullopt);

// Broadcasts every parameter (and, when `buffers`, every buffer) from rank 0, in module order.
absl::Status broadcast_module_state(const nn::Module& module, comm::ProcessGroup& group, bool parameters, bool buffers,
                                    std::optional<absl::Duration> timeout = std::nullopt);

}  // namespace shardkit::sddp
