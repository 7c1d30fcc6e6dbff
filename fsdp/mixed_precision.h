// fsdp::fully_shard's mixed precision. The policy and the rounding are common to the sharding layers
// (common/nn/mixed_precision.h: MixedPrecisionPolicy, round_floating, Note [mixed precision on f32 ops]), since
// sddp::DataParallel takes the same choices; FSDP2 spells the policy fsdp::MixedPrecisionPolicy, so it is named
// here too. What fsdp does with it: a unit's all-gather moves its shard cast to param_dtype and the unsharded
// parameters hold those values; the reduce-scatter moves reduce_in(); the shards stay f32 masters.
#pragma once

#include "common/nn/mixed_precision.h"

namespace shardkit::fsdp {

using nn::MixedPrecisionPolicy;
using nn::round_floating;

}  // namespace shardkit::fsdp
