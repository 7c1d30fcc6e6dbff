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
// Collectives of one kind, op, group and dtype whose sizes (the larger of a call's two slots: the unsharded size of
// an all_gather / reduce_scatter) add up to at most `max_bytes` (a DDP bucket's cap, an FSDP unit) are merged into
// one call on packed slots when they follow each other in the node list with nothing in between that reads or
// writes their slots (other nodes may lie between them; a call of another kind or size ends the group). The
// merged group becomes: op "pack" (reads the inputs, writes the packed input), the one collective, op "unpack"
// (reads the packed result, writes the outputs). Pack and the call go where the last member was, so earlier members
// are delayed to it; unpack, which is where the replay waits for the call, goes right after an all_reduce (its packed
// copy of the gradients is freed at once), and for all_gather / reduce_scatter before the first later node that
// reads or writes one of the members' outputs (or at the end), so the call overlaps the nodes in between (Note
// [collective overlap] in executor.h). Packing follows the ranks' blocks: for members with r_1, r_2, ... rows per
// rank, an all_gather's packed input is [m_1 | m_2 | ...] and its result is one such block per rank, which unpack
// copies to rows [r * r_m, (r + 1) * r_m) of each member's output (as FSDP's flat unit); a reduce_scatter's packed
// input is those per-rank blocks, cut from each member's input. The values are the members' own, bit for bit (the
// reductions are elementwise, in rank order). Pack and unpack carry kernels (copies; unpack reallocates an output
// whose storage a reshard released), so an executable graph stays executable. The count of calls drops from k to 1,
// the bytes stay the same.
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

// Note [coalesce collectives]. Adds one packed slot per merged all_reduce group, named "coalesced.<i>", and two per
// merged all_gather / reduce_scatter group, "coalesced.<i>" (input) and "coalesced.<i>.out".
PassReport coalesce_collectives(StepGraph& graph, std::int64_t max_bytes);

// Replaces the placeholder node named `name` with `replacement` (nodes over the graph's slots; they may use new
// slots added to the graph first). NotFound naming it when there is no such placeholder; InvalidArgument when
// the graph with the replacement does not validate (e.g. the replacement reads a slot nothing writes).
absl::Status expand_placeholder(StepGraph& graph, const std::string& name, std::vector<Node> replacement);

}  // namespace shardkit::capture
