// copy_bytes: memcpy that stays fast whatever the source's and destination's addresses are.
//
// Use it for bulk copies whose addresses the caller does not control (a tensor narrowed at any element, a ring
// position): collectives, tensor copies, shard packing. Same contract as std::memcpy: the ranges must not
// overlap (use std::memmove where they may).
#pragma once

#include <cstddef>

namespace shardkit {

// Copies n bytes from src to dst (non-overlapping). Note [copy alignment] in copy_bytes.cc says why it is not
// std::memcpy.
void copy_bytes(void* dst, const void* src, std::size_t n);

}  // namespace shardkit
