// Elementwise reduction of n equally long source arrays into m destination arrays: the arithmetic of
// every reducing collective (all_reduce, reduce, reduce_scatter) of the CPU backends.
//
// Semantics (process_group.h, ReduceOp): sources are combined in the order given (so every rank that
// reduces the same sources gets bit-identical results); bf16/f16 are accumulated in f32 and rounded once
// when stored; i64 uses wrapping integer arithmetic. The work is done chunk by chunk through a scratch
// accumulator of ReduceScratch::chunk_elements elements (kept cache-resident), f32 in blocks of 16 elements
// held in registers instead (Note [f32 reduction fast path], same results), so sources may alias
// destinations element for element (in place): each chunk is read from every source before it is
// written to any destination.
//
// Thread-safety: pure functions; a ReduceScratch belongs to one thread at a time.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "common/comm/process_group.h"
#include "common/tensor/dtype.h"

namespace shardkit::comm {

struct ReduceScratch {
  explicit ReduceScratch(std::int64_t chunk_bytes);
  std::int64_t chunk_elements;     // >= 1
  std::vector<float> f32;          // grown on first use
  std::vector<std::int64_t> i64;
};

// dst[d][i] = reduce_s(src[s][i]) for i in [0, count), every d. srcs.size() >= 1.
void reduce_into(DType dtype, const ReduceOp& op, absl::Span<const void* const> srcs, absl::Span<void* const> dsts,
                 std::int64_t count, ReduceScratch& scratch);

}  // namespace shardkit::comm
