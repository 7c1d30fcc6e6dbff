// Safetensors files from and into a fully sharded model, without ever holding the whole model on one rank
// (issue 18). The files are the ones common/io/model_safetensors.h writes for an unsharded model (same names,
// same bytes), so they load into PyTorch / Hugging Face, into single-rank shardkit or into FSDP at any world size.
//
//   fsdp::fully_shard(...)  ...  training  ...
//   io::ModelExportOptions gpt2{.names = io::TensorNames::gpt2(config)};
//   fsdp::export_sharded_safetensors(model, "out/", gpt2);   // every rank: its part; rank 0: the index too
//   ... later, at any world size, after fully_shard:
//   fsdp::load_safetensors_rows(model, "out/", io::TensorNames::gpt2(config));   // each rank: its rows
//
// Note [sharded export without gathering]
// Every rank lists root's full state the same way: the names of Module::state_dict(), each with its global shape
// (a sharded parameter's FSDPParam knows it; whole parameters and buffers have theirs), maps the names
// (io::TensorNames) and plans the parts (io::plan_model_export: whole tensors, balanced by bytes; part r is
// rank r's). No communication is needed to agree on the plan. Then, tensor by tensor in plan order, the rank
// that writes a tensor receives the rows of it the other ranks hold (one send per rank that holds rows of it:
// point to point, not an all_gather, so no other rank ever holds it whole) and keeps it, transposed where the
// map says. A rank therefore holds, beyond its shards, the tensors of its own part plus the one tensor it is
// receiving: about 4Ψ/N bytes (MemoryCategory::other), never the whole model at N >= 2 (tested). It writes its
// part file (atomically), rank 0 also the index, and a barrier ends the call: when it returns OK on any rank,
// every file is complete and may be read. Parameters FSDP does not shard (ignored_params) and
// buffers are whole on every rank: their writer uses its own copy.
//
// Ordering: within one tensor, every sender's rows go to one receiver; ranks go through the tensors in the same
// order, so each tensor's transfers complete before any rank starts the next one's (no cycle, no deadlock).
//
// Loading (load_safetensors_rows) is the reverse without communication: every rank maps the same file(s), checks
// them against root's global shapes (the same checks on every rank: all load or all refuse, with the module
// unchanged), and copies only its own rows of each tensor out of the mapping (for a transposed tensor, rows of
// the model's tensor are columns of the file's), converting dtype as nn::Module::load_state_dict does.
//
// Note [same values on every rank] (fsdp/same_values.cc): the exports refuse (InvalidArgument, before any
// collective, on every rank) a model whose ranks sharded other values; a load's values no longer count as differing.
//
// Collectives (the export functions) follow the group's contract: every rank calls them, in the same order
// relative to its other collectives. A rank whose write fails returns that error without reaching the barrier,
// so the others fail too (the group's deadline, or Aborted when the failing rank aborts the group, as
// comm::run_ranks and shardkit-train do). Thread-safety: one rank's thread; `root` at rest or summoned (it is
// resharded first, keeping values written while summoned; FailedPrecondition inside a forward or backward).
#pragma once

#include <string>

#include "absl/status/status.h"
#include "common/io/model_safetensors.h"
#include "common/nn/module.h"

namespace shardkit::fsdp {

// Writes dir/<stem>-<r+1>-of-<N>.safetensors on each rank r of root's group and dir/<stem>.safetensors.index.json
// on rank 0 (Note [sharded export without gathering]); `dir` must exist. NotFound when `root` is not the module
// fully_shard was called on last; InvalidArgument as io::to_external (a name the map lacks). Collective.
absl::Status export_sharded_safetensors(nn::Module& root, const std::string& dir, const io::ModelExportOptions& options = {});

// One file at `path`, written by rank 0: every tensor is gathered to rank 0 only, one at a time (rank 0 ends up
// holding the whole model, as it must to write one file; the other ranks send their rows and hold nothing
// more than their shards). Collective.
absl::Status export_single_safetensors(nn::Module& root, const std::string& path, const io::ModelExportOptions& options = {});

// Loads a model file (io::SafetensorsModel::open: one file, an index, or a directory) into a fully sharded
// model: each rank copies its own rows (Note [sharded export without gathering]). InvalidArgument (the module
// unchanged) for a file tensor the map does not know, a tensor missing from the file, a model name the map does
// not name (strict), a shape other than the model's global shape, a tied tensor whose values differ from its
// target's; the errors of SafetensorsModel::open. Local: no communication (every rank must read the same file).
absl::Status load_safetensors_rows(nn::Module& root, const std::string& path,
                              const io::TensorNames& names = io::TensorNames::shardkit(), bool strict = true);

}  // namespace shardkit::fsdp
