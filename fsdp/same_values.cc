#include "fsdp/same_values.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/comm/host_staged.h"
#include "common/io/checksum.h"

namespace shardkit::fsdp {

// Note [same values on every rank]
// fully_shard keeps, on each rank, that rank's dim-0 rows of its *own* copy of every parameter; ranks that built
// the model with other values (another seed) trained a silently mixed model (a helper's audit:
// tests/fsdp/fsdp_misuse_test.cc). DDP broadcasts rank 0's values at construction (sddp/model_sync.h), FSDP1 had
// sync_module_states. Here:
//   * hash: while ParamGroup's constructor has each parameter whole on the rank (built eagerly, or materialised
//     right there under deferred init, Note [deferred init under fully_shard]: deferred init is covered with no
//     extra materialisation), it takes value_hash() of it: XXH3-64 of its bytes (common/io/checksum.h, tens of
//     GB/s, read in place on the CPU). A CUDA parameter is copied to the host first, one parameter at a time (a
//     host buffer the size of that parameter, MemoryCategory::other, freed at once: about one device-to-host
//     transfer of the model per rank, once, e.g. ~50 ms for 500 MB), because the repository has no device hash or
//     checksum kernel (a float sum or norm would miss permuted values). The call's ignored_params stay whole and
//     replicated, and FSDP never synchronises them: they are hashed and compared too. Over a group of one rank
//     (and no replicate group) nothing is hashed.
//   * compare, in the same fully_shard call: compare_values all_gathers [this rank's global rank, one hash per
//     parameter] over the unit's group (8 bytes per parameter plus 8, once per call), then, under HSDP (a 2-D
//     mesh), those rows again across the replicate group: the replicas of a shard hold the same rows, so the shard
//     group alone would not see a replica built from another seed. Every rank then holds every rank's hashes and
//     reaches the same result, kept in the unit's state: the parameters that differ, each with the lowest rank
//     whose hash differs from the lowest rank's. The collectives carry the unit's timeout, so a rank that never
//     makes the call fails the others' fully_shard with DeadlineExceeded, as every FSDP collective does, and ranks
//     that make other calls (models of another depth) fail it with "ranks disagree on collective". This makes
//     fully_shard a collective (as DDP's constructor and FSDP1's sync_module_states are); the comparison was first
//     placed at the root's first forward, which kept fully_shard local, but then its bytes counted in the first
//     training step, and the step's communication volume is what tests and shardkit-train's report prove (bf16
//     halving fsdp's traffic exactly: tests/tools/shardkit_train_test.cc).
//   * tell: the root's first forward (right after the root's own all-gather, before any unit computes),
//     summon_full_params (so full_state_dict), FSDPModule::unshard, sharded_state_dict and the safetensors exports
//     refuse with values_differ's InvalidArgument, on every rank alike (the result is the same everywhere; no
//     collective), naming the first differing parameter in the model's named_parameters() order by its fully
//     qualified name, known only there (a unit does not know the path to itself at fully_shard, which is why
//     fully_shard itself does not fail), e.g. "fsdp: parameter 'blocks.0.attn.qkv.weight' on rank 1 differs from
//     rank 0's before sharding: ...". Every later forward, summon or unshard refuses again, so a caller that goes
//     on after the error cannot train, read or save the mixed model. The root's all-gather goes first so that
//     ranks whose models differ in shape are still told by it ("ranks disagree on collective"), as before.
// Frozen parameters are sharded like the others and checked like them; mixed precision and cpu offload do not
// change what is hashed (the f32 values fully_shard takes).
// Loads: fsdp::load_full_state_dict, load_sharded_state_dict and load_safetensors_rows write the values of one
// checkpoint, the same on every rank, so the parameters they write are no longer held against the model (the
// mismatches found for them are dropped): building from any seed and loading a checkpoint before the first step
// works, and so does a load after the error. A load by hand (summon_full_params, Module::load_state_dict, reshard)
// is refused at the summon: build from the same seed, load before fully_shard, or use the loaders above.
// The compiled fully-shard mode (fsdp/fully_shard_mode.h) shards in its own expand(), not through fully_shard, and
// checks there: expand() is where the mode takes each parameter whole (the graph's input value, the module's own
// tensor) and cuts this rank's rows from it, and it runs on every rank at the capture (the first call of the
// compiled step, and every recapture). It was local (no collective), so the check adds one: before anything is
// sharded it hashes every parameter it shards (trainable and frozen) and every parameter it leaves whole (requires
// grad, not the optimizer's: each rank's own values, like ignored_params here), compares them with compare_values
// over the mode's group (one all_gather of 8 bytes per parameter plus 8, with the group's default timeout), and, when
// any differs, fails the capture on every rank alike with differing_value_error, naming the first differing
// parameter in the order the step first reads them, by its module name, with both ranks. Nothing is sharded then:
// the module keeps its whole tensors. A recapture (after unshard_parameters, whose whole values come from one
// all_gather and so agree) checks again, so values loaded by hand between captures are held to the rule too.
// The check comes before the mode's own refusals (fp32 master weights, a full-gradient use), all of them the same
// on every rank; a rank whose capture fails before expand() leaves the others' comparison to fail after the group's
// timeout (DeadlineExceeded), as any collective of the step would. The mode has one group (no HSDP) and no ignored
// parameters. The optimizer's state tensors the mode also shards are not compared.
// Not covered: parameters left to an ancestor (leave_to_ancestor) that no ancestor took (whole, like ignored ones,
// but named by no call's ignored_params).

namespace {

// Every rank's [global rank, hashes...] over `group`, then across `replicate`, in global rank order.
absl::StatusOr<std::vector<std::vector<std::int64_t>>> gather(const std::vector<std::int64_t>& hashes,
                                                              comm::ProcessGroup& group, comm::ProcessGroup* replicate,
                                                              absl::Duration timeout) {
  const std::int64_t n = static_cast<std::int64_t>(hashes.size()) + 1;
  std::vector<std::int64_t> mine = {group.global_ranks()[static_cast<std::size_t>(group.rank())]};
  mine.insert(mine.end(), hashes.begin(), hashes.end());
  const TensorOptions i64 = TensorOptions{}.with_dtype(DType::i64).with_category(MemoryCategory::other);
  Tensor rows = Tensor::from_int64(mine, {n}, i64);
  for (comm::ProcessGroup* g : {&group, replicate}) {
    if (g == nullptr || g->size() == 1) continue;
    Tensor all = Tensor::empty({rows.numel() * g->size()}, i64);
    if (absl::Status s = comm::all_gather_host(*g, all, rows, {.timeout = timeout, .tag = "fsdp same values"});
        !s.ok()) {
      return s;
    }
    rows = all;
  }
  std::vector<std::vector<std::int64_t>> out;
  const std::int64_t* a = rows.data<std::int64_t>();
  for (std::int64_t r = 0; r < rows.numel() / n; ++r) out.emplace_back(a + r * n, a + (r + 1) * n);
  std::sort(out.begin(), out.end());  // by global rank
  return out;
}

std::string join_name(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : absl::StrCat(prefix, ".", name);
}

}  // namespace

std::uint64_t value_hash(const Tensor& whole) {
  if (whole.nbytes() == 0) return io::checksum64(nullptr, 0);
  if (whole.device().is_cpu()) return io::checksum64(whole.raw_data(), whole.nbytes());
  const Tensor host = whole.to(Device::cpu(), MemoryCategory::other);
  return io::checksum64(host.raw_data(), host.nbytes());
}

absl::StatusOr<std::vector<ValueMismatch>> compare_values(const std::vector<std::uint64_t>& hashes,
                                                          const std::vector<Tensor>& ignored, comm::ProcessGroup& group,
                                                          comm::ProcessGroup* replicate, absl::Duration timeout) {
  std::vector<ValueMismatch> out;
  if (group.size() == 1 && (replicate == nullptr || replicate->size() == 1)) return out;  // alone
  if (hashes.empty() && ignored.empty()) return out;
  std::vector<std::int64_t> mine;
  for (std::uint64_t h : hashes) mine.push_back(static_cast<std::int64_t>(h));
  for (const Tensor& t : ignored) mine.push_back(static_cast<std::int64_t>(value_hash(t)));
  auto rows = gather(mine, group, replicate, timeout);
  if (!rows.ok()) return rows.status();
  const std::vector<std::int64_t>& ref = rows->front();
  for (std::size_t i = 0; i < mine.size(); ++i) {
    for (std::size_t r = 1; r < rows->size(); ++r) {
      if ((*rows)[r][i + 1] == ref[i + 1]) continue;
      ValueMismatch m;
      if (i < hashes.size()) {
        m.param = i;
      } else {
        m.ignored = ignored[i - hashes.size()];
      }
      m.rank = static_cast<int>((*rows)[r][0]);
      m.reference = static_cast<int>(ref[0]);
      out.push_back(std::move(m));
      break;
    }
  }
  return out;
}

absl::Status values_differ(nn::Module& top, const std::vector<FSDPState*>& states) {
  const FSDPState* first_state = nullptr;
  for (const FSDPState* s : states) {
    if (!s->value_mismatches().empty()) first_state = s;
  }
  if (first_state == nullptr) return absl::OkStatus();  // (the common case: nothing to name)
  // Each parameter's first name under `top` and its place in top.named_parameters(), by either tensor of it.
  std::map<const TensorImpl*, std::pair<std::string, std::size_t>> named;
  for (const auto& [name, t] : top.named_parameters()) named.emplace(t.id(), std::pair(name, named.size()));
  std::map<const nn::Module*, std::string> prefix;
  for (const auto& [name, m] : top.named_modules()) prefix.emplace(m, name);
  std::optional<std::pair<std::string, std::size_t>> best;  // (name, place) of the first differing parameter
  const ValueMismatch* which = nullptr;
  for (const FSDPState* s : states) {
    const auto p = prefix.find(&s->module());
    const std::string unit_prefix = p == prefix.end() ? "" : p->second;
    for (const ValueMismatch& m : s->value_mismatches()) {
      std::vector<Tensor> held = {m.ignored};
      std::string fallback = join_name(unit_prefix, "(an ignored parameter)");
      if (!m.ignored.defined()) {
        const FSDPParam& fp = s->param_group()->params()[m.param];
        held = {fp.sharded, fp.unsharded};
        fallback = join_name(unit_prefix, fp.names.front());
      }
      std::pair<std::string, std::size_t> here(fallback, named.size());  // (not under top: after the others)
      for (const Tensor& t : held) {
        if (auto n = named.find(t.id()); t.defined() && n != named.end()) {
          here = n->second;
          break;
        }
      }
      if (!best || here.second < best->second) {
        best = here;
        which = &m;
      }
    }
  }
  const bool ignored = which->ignored.defined();
  return differing_value_error(
      ignored ? "ignored parameter" : "parameter", best->first, which->rank, which->reference,
      ignored ? "(FSDP never synchronises ignored_params)" : "before sharding",
      "fully_shard (or load the same checkpoint with fsdp::load_full_state_dict / load_sharded_state_dict; Note "
      "[same values on every rank] in fsdp/same_values.cc)");
}

absl::Status differing_value_error(const std::string& what, const std::string& name, int rank, int reference,
                                   const std::string& why, const std::string& before) {
  return absl::InvalidArgumentError(absl::StrCat("fsdp: ", what, " '", name, "' on rank ", rank, " differs from rank ",
                                                 reference, "'s ", why,
                                                 ": every rank must build the same model (same seed) before ", before));
}

}  // namespace shardkit::fsdp
