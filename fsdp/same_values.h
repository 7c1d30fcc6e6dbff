// Every rank sharded the same values: the check of fully_shard's rule "every rank builds the same model (same
// seed) before sharding" (fsdp/fully_shard.h; Note [same values on every rank] in same_values.cc).
//
// ParamGroup hashes each parameter while it is still whole on the rank (value_hash); fully_shard compares the
// hashes of its unit, and its ignored parameters' values, across every rank of the unit's group (and of its
// replicate group under HSDP) with compare_values, and keeps what differs in the unit's state; the first forward of
// the root, summon_full_params and FSDPModule::unshard refuse to go on while anything differs (values_differ),
// naming the parameter by its fully qualified name. The compiled fully-shard mode (fsdp/fully_shard_mode.h), which
// shards in its own expand(), hashes and compares the parameters there with the same functions and fails the capture
// with differing_value_error.
//
// Thread-safety: one rank's thread.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/comm/process_group.h"
#include "common/nn/module.h"
#include "common/tensor/tensor.h"
#include "fsdp/state.h"

namespace shardkit::fsdp {

// XXH3-64 of the bytes of `whole` (any device: a CUDA tensor is copied to the host first, MemoryCategory::other,
// one tensor at a time). Bitwise equal tensors of one dtype hash the same.
std::uint64_t value_hash(const Tensor& whole);

// Compares across ranks, for one fully_shard call: `hashes[i]` (value_hash of the call's managed parameter i, whole)
// and the values of `ignored` (whole, hashed here). Every parameter that differs somewhere, with the lowest (global)
// rank whose values differ from the lowest rank's; empty when every rank holds the same values or the group (with
// the replicate group) is one rank. The same result on every rank. Collective over `group`, then `replicate`
// (HSDP, or nullptr): one all_gather of 8 bytes per parameter plus 8, each waited with `timeout`; every rank calls
// it with the same number of hashes and ignored parameters.
absl::StatusOr<std::vector<ValueMismatch>> compare_values(const std::vector<std::uint64_t>& hashes,
                                                          const std::vector<Tensor>& ignored, comm::ProcessGroup& group,
                                                          comm::ProcessGroup* replicate, absl::Duration timeout);

// The InvalidArgument that names one differing parameter, the same text for every caller: "fsdp: <what> '<name>' on
// rank <rank> differs from rank <reference>'s <why>: every rank must build the same model (same seed) before
// <before>". `what` is e.g. "parameter" or "ignored parameter", `why` e.g. "before sharding", `before` what the
// caller does with the values and how else to get the same ones (fully_shard's: "fully_shard (or load ...)").
absl::Status differing_value_error(const std::string& what, const std::string& name, int rank, int reference,
                                   const std::string& why, const std::string& before);

// OK when no unit of `states` holds a mismatch; otherwise InvalidArgument for the first differing parameter in
// top.named_parameters() order (its fully qualified name under `top`, a module holding every state), e.g. "fsdp:
// parameter 'blocks.0.attn.qkv.weight' on rank 1 differs from rank 0's before sharding: every rank must build the
// same model (same seed) before fully_shard ...". Local (the comparison ran at fully_shard): the same on every rank.
absl::Status values_differ(nn::Module& top, const std::vector<FSDPState*>& states);

}  // namespace shardkit::fsdp
