// Bucket assignment for the gradient reducer (DESIGN.md section 4): pure functions from parameter sizes and
// an expected gradient-ready order to buckets, in the order they will be launched. No tensors, no
// communication: every rank computes the same answer from the same inputs.
//
// Note [ready-order buckets]
// Buckets follow the order in which gradients become ready (reverse forward order), NOT parameter size
// (fairscale #800: size order made every bucket wait for the end of backward). A bucket is launched as soon
// as all its gradients are ready AND every earlier bucket has been launched (in-order launch, so all ranks
// issue collectives in the same order whatever the local timing). Buckets are therefore listed in launch
// order: by the position, in the expected ready order, of their last-ready member.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "oss/partition.h"

namespace shardkit::sddp {

// Whole-parameter buckets (all_reduce and reduce-to-owner strategies).
//   order:        parameter indices in expected gradient-ready order (a permutation of 0..n-1)
//   numel:        elements of each parameter (by index)
//   key:          parameters with different keys never share a bucket (owner rank, dtype)
//   bucket_numel: capacity of a bucket; a parameter with numel >= bucket_numel, or any parameter when
//                 bucket_numel <= 0, gets a bucket of its own.
// Returns the buckets in launch order; each lists parameter indices in ready order.
std::vector<std::vector<int>> assign_buckets(absl::Span<const int> order, absl::Span<const std::int64_t> numel,
                                             absl::Span<const int> key, std::int64_t bucket_numel);

// A piece of a flat-partitioned column bucket: elements [param_offset, param_offset + length) of parameter
// `param` go to rank `rank`'s segment of the bucket, at `segment_offset` within that segment.
struct ColumnPiece {
  int param = 0;
  std::int64_t param_offset = 0;
  int rank = 0;
  std::int64_t segment_offset = 0;
  std::int64_t length = 0;
  friend bool operator==(const ColumnPiece&, const ColumnPiece&) = default;
};

// Note [column buckets]
// Flat ZeRO-2: one reduce_scatter per bucket delivers to every rank a contiguous part of its own flat range.
// For the reduce-scatter to carry no padding, a bucket is a *column* of the flat split: elements
// [begin(r) + offset, begin(r) + offset + width) of every rank r's range (clipped to the range). Its input
// is `world` segments of `width` elements, segment r holding rank r's part; rank r receives its reduced part
// in an output of `width` elements. Columns are then launched in expected ready order like other buckets.
// A column is ready when its part of every rank's range is: all the columns of one chunk fill together,
// as the chunk's gradients arrive (Note [flat chunks] in oss/partition.h), which is why a chunk should be no
// larger than a bucket.
struct Column {
  int space = 0;              // which flat space (one per chunk of each optimizer, Note [flat chunks])
  std::int64_t offset = 0;    // offset inside every rank's range
  std::int64_t width = 0;     // segment width (output numel)
  std::vector<ColumnPiece> pieces;
};

// The parameters of one flat space: parameter `param` (reducer index) occupies flat elements
// [flat_offset, flat_offset + numel).
struct FlatMember {
  int param = 0;
  std::int64_t flat_offset = 0;
  std::int64_t numel = 0;
};

// Splits `space`'s flat split into columns of `width` elements (width <= 0: one column per space, i.e. one
// reduce_scatter of the whole space). Members must be sorted by flat_offset and not overlap; elements of no member are
// left out of every column (the reducer sends zeros there).
std::vector<Column> assign_columns(int space, const oss::FlatChunk& chunk, absl::Span<const FlatMember> members,
                                   int world, std::int64_t width);

// Orders buckets for launch: by the largest position (in `position`, indexed by parameter) of their members;
// ties keep the input order. `members[b]` lists the parameters of bucket b. Returns the permutation.
std::vector<int> launch_order(const std::vector<std::vector<int>>& members, absl::Span<const int> position);

}  // namespace shardkit::sddp
