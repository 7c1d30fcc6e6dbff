// Passes over a StepGraph (issue 16 item 4): pure functions from a graph to a graph, each tested on hand-built
// graphs. They run after a parallel mode has inserted its collectives and before a user's transform.
//
// Note [dedup collectives]
// Two collectives are the same when they have the same kind, reduce op and group, read the same slot, and
// nothing writes that slot between them: the second would compute what the first did. When in addition
// (all_gather / reduce_scatter) nothing writes the first one's output slot between them, the second is removed
// and every later read of its output slot reads the first's output instead (an FSDP unit whose parameters are
// used twice in forward: one all_gather, not two; a parameter shared by two units). A second call that writes the
// first one's own output slot (a parallel mode gathers a parameter into one slot before each use) is removed with
// nothing to rename. In-place collectives
// (all_reduce, broadcast, reduce) read and write one slot, so a second one on that slot is never a duplicate
// (it would reduce the already reduced values): they are left alone.
//
// Note [coalesce collectives]
// Consecutive collectives of one kind, op, group and dtype whose slots add up to at most `max_bytes` (a DDP bucket's
// cap) are merged into one call on a packed slot when none of them reads a slot written by another between the first and the last of them, and
// no node between them reads or writes their slots. The merged group becomes: op "pack" (reads the inputs,
// writes the packed slot), the one collective, op "unpack" (reads the packed result, writes the outputs), placed
// where the last of them was; pack and unpack carry kernels (copies), so an executable graph stays executable.
// Only in-place all_reduce is coalesced (what DDP buckets are); the count of calls drops from k to 1, the bytes stay
// the same.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/capture/step_graph.h"

namespace shardkit::capture {

struct PassReport {
  int removed = 0;  // collectives removed (dedup) or merged away (coalesce: k merged into 1 counts k - 1)
};

// Note [dedup collectives]. Slots of removed outputs stay in the graph (unused).
PassReport dedup_collectives(StepGraph& graph);

// Note [coalesce collectives]. Adds one packed slot per merged group, named "coalesced.<i>".
PassReport coalesce_collectives(StepGraph& graph, std::int64_t max_bytes);

// Replaces the placeholder node named `name` with `replacement` (nodes over the graph's slots; they may use new
// slots added to the graph first). NotFound naming it when there is no such placeholder; InvalidArgument when
// the graph with the replacement does not validate (e.g. the replacement reads a slot nothing writes).
absl::Status expand_placeholder(StepGraph& graph, const std::string& name, std::vector<Node> replacement);

}  // namespace shardkit::capture
