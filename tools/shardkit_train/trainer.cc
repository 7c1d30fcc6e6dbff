#include "tools/shardkit_train/trainer.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <exception>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/autograd/engine.h"
#include "common/autograd/grad_mode.h"
#include "common/capture/compile.h"
#include "common/comm/run_ranks.h"
#include "common/comm/init_from_env.h"
#include "common/comm/mpi_process_group.h"
#include "common/nn/checkpoint.h"
#include "common/nn/gpt.h"
#include "common/nn/mixed_precision.h"
#include "common/optim/adam.h"
#include "common/optim/finite.h"
#include "common/optim/lr_schedule.h"
#include "common/tensor/rank_context.h"
#include "oss/oss.h"
#include "tools/shardkit_train/model_files.h"
#include "tools/shardkit_train/report.h"
#ifdef SHARDKIT_TRAIN_HAS_SDDP
#include "sddp/data_parallel.h"
#include "sddp/replicate_mode.h"
#endif
#ifdef SHARDKIT_TRAIN_HAS_FSDP
#include "fsdp/fully_shard.h"
#include "fsdp/fully_shard_mode.h"
#include "fsdp/safetensors_export.h"
#include "fsdp/state_dict.h"
#endif

namespace shardkit::train {
namespace {

#define SKT_RETURN_IF_ERROR(expr)              \
  do {                                         \
    if (absl::Status _st = (expr); !_st.ok()) return _st; \
  } while (0)

// --precision bf16 (Note [mixed precision on f32 ops] in common/nn/mixed_precision.h): parameters with bf16 values
// in forward and backward, gradients reduced in bf16, f32 master parameters and AdamW state.
nn::MixedPrecisionPolicy mixed_precision(const Options& o) {
  if (o.precision == Precision::fp32) return {};
  return {.param_dtype = DType::bf16, .reduce_dtype = DType::bf16};
}

optim::HyperParams hyper(const Options& o) {
  optim::HyperParams h = optim::AdamW::default_hyper();
  h.lr = o.lr;
  h.beta2 = 0.99;
  h.weight_decay = 0.0;
  return h;
}

// Averages every gradient over the ranks, one all_reduce per gradient (in bf16 when asked).
absl::Status all_reduce_grads(comm::ProcessGroup& pg, const std::vector<Tensor>& params, Precision precision) {
  for (const Tensor& p : params) {
    const Tensor g = p.grad();
    if (!g.defined()) continue;
    if (precision == Precision::bf16) {
      Tensor h = g.to(DType::bf16, MemoryCategory::communication_buffer);
      SKT_RETURN_IF_ERROR(pg.all_reduce(h, {.op = comm::ReduceOp::avg(), .tag = "grad"})->wait());
      g.copy_(h);
    } else {
      SKT_RETURN_IF_ERROR(pg.all_reduce(g, {.op = comm::ReduceOp::avg(), .tag = "grad"})->wait());
    }
  }
  return absl::OkStatus();
}

// One rank's strategy: how gradients are synchronised and who steps what. See Note [strategies in
// shardkit-train] in trainer.h.
class Runner {
 public:
  virtual ~Runner() = default;
  virtual absl::Status backward(const Tensor& loss) = 0;
  virtual absl::Status step() = 0;
  virtual void zero_grad() = 0;
  virtual void set_lr(double lr) = 0;
  // Collective: the full optimizer state on rank 0, nullopt elsewhere.
  virtual absl::StatusOr<std::optional<optim::OptimizerStateDict>> full_state() = 0;
  virtual absl::Status load_state(const optim::OptimizerStateDict& full) = 0;
  virtual std::int64_t owned_numel() const = 0;
  // The module's full parameters, readable and writable between gather_model() (collective) and
  // release_model() (fsdp: unshard / reshard; the others hold them all the time).
  virtual absl::Status gather_model() { return absl::OkStatus(); }
  virtual void release_model() {}
  // What this rank holds of the state, for a sharded checkpoint (Note [checkpoint format] in checkpoint.h).
  virtual CheckpointSource checkpoint_source(nn::GPT& model) = 0;
  // --compile: the whole step (forward, backward, update) on (x, y), returning the loss.
  virtual absl::StatusOr<Tensor> compiled_step(const Tensor& x, const Tensor& y) {
    return absl::UnimplementedError("this strategy runs eagerly");
  }
  // --compile: a summary of the replayed graph (empty otherwise).
  virtual std::string graph_summary() const { return ""; }
};

class DdpRunner : public Runner {
 public:
  static absl::StatusOr<std::unique_ptr<Runner>> create(nn::GPT& model, std::shared_ptr<comm::ProcessGroup> pg,
                                                        const Options& o) {
    auto opt = optim::AdamW::make({{model.parameters(), hyper(o)}}, hyper(o));
    if (!opt.ok()) return opt.status();
    std::unique_ptr<DdpRunner> r(new DdpRunner(model, *pg, o, std::move(*opt)));
#ifdef SHARDKIT_TRAIN_HAS_SDDP
    auto dp = sddp::DistributedDataParallel::create(model, pg, {.mixed_precision = mixed_precision(o)});
    if (!dp.ok()) return dp.status();
    r->dp_ = std::move(*dp);
#else
    if (o.precision == Precision::bf16) r->mp_ = std::make_unique<nn::MixedPrecisionHooks>(model, mixed_precision(o));
#endif
    return std::unique_ptr<Runner>(std::move(r));
  }
  absl::Status backward(const Tensor& loss) override {
#ifdef SHARDKIT_TRAIN_HAS_SDDP
    if (dp_) return autograd::try_backward(loss);  // the wrapper all-reduces buckets during backward
#endif
    autograd::backward(loss);
    return all_reduce_grads(pg_, params_, precision_);
  }
  absl::Status step() override { return opt_->step(); }
  void zero_grad() override { opt_->zero_grad(); }
  void set_lr(double lr) override { opt_->mutable_hyper(0).lr = lr; }
  absl::StatusOr<std::optional<optim::OptimizerStateDict>> full_state() override {
    if (pg_.rank() != 0) return std::nullopt;
    return opt_->state_dict();
  }
  absl::Status load_state(const optim::OptimizerStateDict& full) override { return opt_->load_state_dict(full); }
  std::int64_t owned_numel() const override {
    std::int64_t n = 0;
    for (const Tensor& p : params_) n += p.numel();
    return n;
  }
  CheckpointSource checkpoint_source(nn::GPT& model) override { return {.model = &model, .optimizer = opt_.get()}; }

 private:
  DdpRunner(nn::GPT& model, comm::ProcessGroup& pg, const Options& o, std::unique_ptr<optim::Optimizer> opt)
      : pg_(pg), params_(model.parameters()), precision_(o.precision), opt_(std::move(opt)) {}
  comm::ProcessGroup& pg_;
  std::vector<Tensor> params_;
  Precision precision_;
  std::unique_ptr<optim::Optimizer> opt_;
#ifdef SHARDKIT_TRAIN_HAS_SDDP
  std::unique_ptr<sddp::DistributedDataParallel> dp_;
#else
  std::unique_ptr<nn::MixedPrecisionHooks> mp_;  // bf16: the forward on rounded parameters
#endif
};

class OssRunner : public Runner {
 public:
  static absl::StatusOr<std::unique_ptr<Runner>> create(nn::GPT& model, std::shared_ptr<comm::ProcessGroup> pg,
                                                        const Options& o, bool sharded) {
    // No broadcast_dtype under bf16: it would round the owners' parameters too, and they are the f32 masters
    // (the updated parameters are all-gathered in f32).
    oss::OssOptions oo{.policy = oss::PartitionPolicy::flat};
    auto opt = oss::Oss::create({{model.parameters(), hyper(o)}}, optim::AdamW::factory(hyper(o)), pg, oo);
    if (!opt.ok()) return opt.status();
    std::unique_ptr<OssRunner> r(new OssRunner(model, pg, o, std::move(*opt)));
#ifdef SHARDKIT_TRAIN_HAS_SDDP
    if (sharded) {
      auto dp = sddp::ShardedDataParallel::create(model, {r->opt_.get()}, pg, {.mixed_precision = mixed_precision(o)});
      if (!dp.ok()) return dp.status();
      r->dp_ = std::move(*dp);
    }
#else
    if (sharded) return absl::UnimplementedError("strategy sddp is not built into this shardkit-train");
#endif
    // oss reduces by hand after backward (reduce_scatter_grads, in bf16 under bf16): only the forward needs hooks.
    if (!sharded && o.precision == Precision::bf16) {
      r->mp_ = std::make_unique<nn::MixedPrecisionHooks>(model, mixed_precision(o));
    }
    return std::unique_ptr<Runner>(std::move(r));
  }
  absl::Status backward(const Tensor& loss) override {
#ifdef SHARDKIT_TRAIN_HAS_SDDP
    if (dp_) return autograd::try_backward(loss);  // the wrapper reduces buckets during backward
#endif
    autograd::backward(loss);
    return reduce_scatter_grads();
  }
  absl::Status step() override { return opt_->step(); }
  // With or without ShardedDataParallel: the Oss drops every gradient, the delivered slices included.
  void zero_grad() override { opt_->zero_grad(); }
  void set_lr(double lr) override { opt_->mutable_hyper(0).lr = lr; }
  absl::StatusOr<std::optional<optim::OptimizerStateDict>> full_state() override {
    SKT_RETURN_IF_ERROR(opt_->consolidate_state_dict(0));
    if (pg_->rank() != 0) return std::nullopt;
    auto sd = opt_->state_dict();
    if (!sd.ok()) return sd.status();
    return std::optional<optim::OptimizerStateDict>(std::move(*sd));
  }
  absl::Status load_state(const optim::OptimizerStateDict& full) override { return opt_->load_state_dict(full); }
  std::int64_t owned_numel() const override { return opt_->owned_numel(); }
  CheckpointSource checkpoint_source(nn::GPT& model) override { return {.model = &model, .oss = opt_.get()}; }

 private:
  OssRunner(nn::GPT& model, std::shared_ptr<comm::ProcessGroup> pg, const Options& o, std::unique_ptr<oss::Oss> opt)
      : pg_(std::move(pg)), params_(model.parameters()), precision_(o.precision), opt_(std::move(opt)) {}
  std::shared_ptr<comm::ProcessGroup> pg_;
  std::vector<Tensor> params_;
  Precision precision_;
  // ZeRO-1's gradient reduction (Note [strategies in shardkit-train]): per chunk of the flat partition
  // (Note [flat chunks]), the full gradients are copied into a buffer laid out as the chunk (padded to
  // world x shard_size), reduce-scattered (averaged) so this rank receives exactly its range, and each
  // owned piece reads its gradient from there (Oss::set_piece_grad). Sends (N-1)/N of the gradient bytes,
  // against 2(N-1)/N for an all_reduce.
  absl::Status reduce_scatter_grads() {
    const oss::FlatPartition& part = opt_->flat_partition();
    const int n = pg_->size(), r = pg_->rank();
    const DType dt = precision_ == Precision::bf16 ? DType::bf16 : DType::f32;
    std::vector<std::int64_t> start;  // flat offset of each parameter (one param group)
    std::int64_t off = 0;
    for (const Tensor& p : params_) {
      start.push_back(off);
      off += p.numel();
    }
    std::vector<Tensor> mine(part.chunks.size());  // this rank's reduced range of each chunk
    for (std::size_t c = 0; c < part.chunks.size(); ++c) {
      const oss::FlatChunk& chunk = part.chunks[c];
      if (chunk.total == 0) continue;
      Tensor flat = Tensor::zeros({chunk.shard_size * n}, TensorOptions{}.with_dtype(dt).with_category(MemoryCategory::communication_buffer));
      for (std::size_t i = 0; i < params_.size(); ++i) {
        const Tensor& g = params_[i].grad();
        if (g.defined() && start[i] >= chunk.base && start[i] < chunk.base + chunk.total) {
          flat.view(start[i] - chunk.base, {g.numel()}).copy_(g.flatten());
        }
      }
      mine[c] = flat.view(r * chunk.shard_size, {chunk.shard_size});  // in place: slice r of the input
      SKT_RETURN_IF_ERROR(pg_->reduce_scatter(mine[c], flat, {.op = comm::ReduceOp::avg(), .tag = "grads"})->wait());
    }
    const auto& pieces = opt_->owned_pieces();
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const oss::OwnedPiece& piece = pieces[k];
      const std::int64_t flat = start.at(static_cast<std::size_t>(piece.param)) + piece.offset;
      const auto c = static_cast<std::size_t>(part.chunk_of(0, flat));
      opt_->set_piece_grad(k, mine[c].view(flat - part.chunks[c].begin(r), {piece.length}));
    }
    return absl::OkStatus();
  }

  std::unique_ptr<oss::Oss> opt_;
#ifdef SHARDKIT_TRAIN_HAS_SDDP
  std::unique_ptr<sddp::DataParallel> dp_;  // declared after opt_: destroyed first (it refers to opt_)
#endif
  std::unique_ptr<nn::MixedPrecisionHooks> mp_;  // oss under bf16: the forward on rounded parameters
};

#ifdef SHARDKIT_TRAIN_HAS_FSDP
// ZeRO-3: fsdp::fully_shard on every transformer block, then the model (the root); AdamW over model.parameters(),
// which are this rank's shards at rest.
class FsdpRunner : public Runner {
 public:
  static absl::StatusOr<std::unique_ptr<Runner>> create(nn::GPT& model, std::shared_ptr<comm::ProcessGroup> pg,
                                                        const Options& o) {
    const fsdp::FullyShardOptions fo{.mp_policy = mixed_precision(o)};
    for (nn::Module* block : fsdp::modules_of_type(model, "TransformerBlock")) {
      if (auto unit = fsdp::fully_shard(*block, pg, fo); !unit.ok()) return unit.status();
    }
    auto root = fsdp::fully_shard(model, pg, fo);
    if (!root.ok()) return root.status();
    auto opt = optim::AdamW::make({{model.parameters(), hyper(o)}}, hyper(o));
    if (!opt.ok()) return opt.status();
    return std::unique_ptr<Runner>(new FsdpRunner(model, *root, *pg, std::move(*opt)));
  }
  absl::Status backward(const Tensor& loss) override { return autograd::try_backward(loss); }
  absl::Status step() override { return opt_->step(); }
  void zero_grad() override { opt_->zero_grad(); }
  void set_lr(double lr) override { opt_->mutable_hyper(0).lr = lr; }
  absl::StatusOr<std::optional<optim::OptimizerStateDict>> full_state() override {
    auto full = fsdp::full_optimizer_state(model_, *opt_);
    if (!full.ok()) return full.status();
    if (pg_.rank() != 0) return std::optional<optim::OptimizerStateDict>();
    return std::optional<optim::OptimizerStateDict>(std::move(*full));
  }
  absl::Status load_state(const optim::OptimizerStateDict& full) override {
    return fsdp::load_full_optimizer_state(model_, *opt_, full);
  }
  std::int64_t owned_numel() const override {
    std::int64_t n = 0;
    for (const fsdp::ShardedTensor& t : fsdp::sharded_parameters(model_)) n += t.local.numel();
    return n;
  }
  absl::Status gather_model() override { return root_.summon_full_params(); }
  void release_model() override { (void)root_.reshard(/*recurse=*/true); }
  CheckpointSource checkpoint_source(nn::GPT&) override {
    return {.model = &model_, .optimizer = opt_.get(), .fsdp = true};
  }

 private:
  FsdpRunner(nn::GPT& model, fsdp::FSDPModule root, comm::ProcessGroup& pg, std::unique_ptr<optim::Optimizer> opt)
      : model_(model), root_(root), pg_(pg), opt_(std::move(opt)) {}
  nn::GPT& model_;
  fsdp::FSDPModule root_;
  comm::ProcessGroup& pg_;
  std::unique_ptr<optim::Optimizer> opt_;
};
#endif

#if defined(SHARDKIT_TRAIN_HAS_SDDP) && defined(SHARDKIT_TRAIN_HAS_FSDP)
// Note [--compile]
// The step function is the single-rank loop body (forward, backward, AdamW step, zero_grad), written once; the parallel
// mode makes it data-parallel: ddp -> sddp::ReplicateMode (DDP's bucketed all_reduce, bit for bit), fsdp ->
// fsdp::FullyShardMode (per-parameter shards, bit for bit eager fully_shard's results). The first step captures
// (a dry run: nothing is updated while recording) and replays; every later step replays. --checkpoint-activations
// is captured too (the recompute is recorded inside the backward, Note [capturing activation checkpointing] in
// common/nn/checkpoint.cc). What it does not cover yet is refused by parse_options: bf16 (master weights), and for
// fsdp checkpoints and --export (the shards live in the graph). The loss is seen after the step, so a non-finite loss stops the run after
// that step's update (eager strategies stop before it; a checkpoint is still never written with it).
class CompiledRunner : public Runner {
  // fsdp: gather buckets of 4 MiB issued one bucket ahead, the last forward bucket kept for backward, and calls up to
  // 128 KiB coalesced (Note [gather buckets] in fsdp/fully_shard_mode.h): train_bench's compiled_fully_shard
  // configuration, its fastest measured (bench/train_bench_compiled.cc). Buckets move calls, never values.
  static constexpr fsdp::FullyShardModeOptions kFullyShardModeOptions{
      .bucket_bytes = 4 << 20, .prefetch = 1, .reshard_last_bucket_after_forward = false};
  static constexpr std::int64_t kFullyShardCoalesceBytes = 128 << 10;

 public:
  static absl::StatusOr<std::unique_ptr<Runner>> create(Strategy s, nn::GPT& model,
                                                        std::shared_ptr<comm::ProcessGroup> pg, const Options& o) {
    auto opt = optim::AdamW::make({{model.parameters(), hyper(o)}}, hyper(o));
    if (!opt.ok()) return opt.status();
    std::unique_ptr<CompiledRunner> r(new CompiledRunner(model, *pg, std::move(*opt)));
    std::shared_ptr<capture::ParallelMode> mode;
    if (s == Strategy::ddp) {
      mode = std::make_shared<sddp::ReplicateMode>(pg);
    } else {
      r->fsdp_mode_ = std::make_shared<fsdp::FullyShardMode>(pg, kFullyShardModeOptions);
      mode = r->fsdp_mode_;
    }
    CompiledRunner* self = r.get();
    r->compiled_.emplace(capture::compile(
        [self](const std::vector<Tensor>& b) {
          Tensor loss = self->model_.loss(b[0], b[1]);
          autograd::backward(loss);
          if (absl::Status st = self->opt_->step(); !st.ok() && self->step_status_.ok()) self->step_status_ = st;
          self->opt_->zero_grad();
          return loss;
        },
        model, *r->opt_,
        {.parallel_mode = std::move(mode), .coalesce_bytes = s == Strategy::fsdp ? kFullyShardCoalesceBytes : 0}));
    return std::unique_ptr<Runner>(std::move(r));
  }
  absl::StatusOr<Tensor> compiled_step(const Tensor& x, const Tensor& y) override {
    step_status_ = absl::OkStatus();
    absl::StatusOr<Tensor> loss = (*compiled_)({x, y});
    if (!step_status_.ok()) return step_status_;
    return loss;
  }
  absl::Status backward(const Tensor&) override { return absl::InternalError("--compile: backward is in the step"); }
  absl::Status step() override { return absl::InternalError("--compile: the update is in the step"); }
  void zero_grad() override {}
  void set_lr(double lr) override { opt_->mutable_hyper(0).lr = lr; }
  absl::StatusOr<std::optional<optim::OptimizerStateDict>> full_state() override {
    if (fsdp_mode_) return absl::UnimplementedError("--compile --strategy fsdp: the optimizer state is sharded in the graph");
    if (pg_.rank() != 0) return std::nullopt;
    return opt_->state_dict();
  }
  absl::Status load_state(const optim::OptimizerStateDict& full) override { return opt_->load_state_dict(full); }
  std::int64_t owned_numel() const override {
    std::int64_t n = 0;
    for (const Tensor& p : model_.parameters()) n += fsdp_mode_ ? (p.numel() + pg_.size() - 1) / pg_.size() : p.numel();
    return n;
  }
  // fsdp: the module's parameters whole again (they stay allocated; the shards remain the truth for later steps).
  absl::Status gather_model() override { return fsdp_mode_ ? fsdp_mode_->unshard_parameters() : absl::OkStatus(); }
  CheckpointSource checkpoint_source(nn::GPT& model) override { return {.model = &model, .optimizer = opt_.get()}; }
  std::string graph_summary() const override {
    const capture::StepGraph* g = compiled_->graph();
    if (g == nullptr) return "";
    auto join = [](const std::map<std::string, int>& counts) {
      std::string out;
      for (const auto& [kind, n] : counts) absl::StrAppend(&out, out.empty() ? "" : ", ", kind, " ", n);
      return out;
    };
    std::string out = absl::StrCat("captured (one rank's step, before the parallel mode): ",
                                   join(compiled_->captured_counts()), "\n");
    absl::StrAppend(&out, "replayed (", fsdp_mode_ ? "fully_shard" : "replicate", " mode, after dedup and buckets): ",
                    join(g->counts()), "\n");
    const std::map<std::string, int> counts = g->counts();
    const int left = counts.count("collective") ? counts.at("collective") : 0;
    absl::StrAppend(&out, "collectives: ", compiled_->expanded_collectives(), " from the mode",
                    fsdp_mode_ ? "" : " (gradients already in buckets)", ", ", compiled_->deduplicated(),
                    " removed by dedup, ", left, " per step; captures: ", compiled_->captures(), "\n");
    if (const capture::MemoryPlan* plan = compiled_->memory_plan()) {
      const capture::StepArena::Stats arena = compiled_->arena_stats();
      absl::StrAppend(&out, "memory plan: ", plan->temporary_slots, " step values, peak ", with_commas(plan->peak_bytes),
                      " bytes; step arena ", with_commas(arena.arena_bytes), " bytes, the last replay's allocations ",
                      arena.from_arena, " from it and ", arena.from_heap, " from the heap\n");
    }
    if (const capture::ReplayStats* stats = compiled_->last_stats(); stats != nullptr && stats->total_seconds > 0) {
      // Where the last replay's time went: the ops that took the most kernel time, then the rest of the step.
      const std::vector<capture::OpTime> ops = capture::kernel_time_by_op(*g, *stats);
      absl::StrAppend(&out, "last replay: ", absl::StrFormat("%.1f", 1e3 * stats->total_seconds), " ms; kernels by op:");
      constexpr std::size_t kShown = 6;
      for (std::size_t k = 0; k < ops.size() && k < kShown; ++k) {
        absl::StrAppend(&out, k == 0 ? " " : ", ", ops[k].op, " ", absl::StrFormat("%.1f", 1e3 * ops[k].seconds),
                        " ms (", ops[k].calls, ")");
      }
      double rest = 0;
      for (std::size_t k = kShown; k < ops.size(); ++k) rest += ops[k].seconds;
      absl::StrAppend(&out, ops.size() > kShown ? absl::StrFormat(", %d more %.1f ms", ops.size() - kShown, 1e3 * rest) : "",
                      absl::StrFormat("; collectives %.1f ms, host %.1f ms\n", 1e3 * stats->collective_seconds,
                                      1e3 * (stats->total_seconds - stats->kernel_seconds - stats->collective_seconds)));
    }
    return out;
  }

 private:
  CompiledRunner(nn::GPT& model, comm::ProcessGroup& pg, std::unique_ptr<optim::Optimizer> opt)
      : model_(model), pg_(pg), opt_(std::move(opt)) {}
  nn::GPT& model_;
  comm::ProcessGroup& pg_;
  std::unique_ptr<optim::Optimizer> opt_;
  std::shared_ptr<fsdp::FullyShardMode> fsdp_mode_;
  std::optional<capture::CompiledStep> compiled_;
  absl::Status step_status_;
};
#endif

absl::StatusOr<std::unique_ptr<Runner>> make_runner(Strategy s, nn::GPT& model, std::shared_ptr<comm::ProcessGroup> pg,
                                                    const Options& o) {
  if (o.compile) {
#if defined(SHARDKIT_TRAIN_HAS_SDDP) && defined(SHARDKIT_TRAIN_HAS_FSDP)
    return CompiledRunner::create(s, model, std::move(pg), o);
#else
    return absl::UnimplementedError("--compile needs the sddp and fsdp layers, which this shardkit-train lacks");
#endif
  }
  switch (s) {
    case Strategy::ddp: return DdpRunner::create(model, std::move(pg), o);
    case Strategy::oss: return OssRunner::create(model, std::move(pg), o, false);
    case Strategy::sddp: return OssRunner::create(model, std::move(pg), o, true);
    case Strategy::fsdp:
#ifdef SHARDKIT_TRAIN_HAS_FSDP
      return FsdpRunner::create(model, std::move(pg), o);
#else
      return absl::UnimplementedError("strategy fsdp is not built into this shardkit-train");
#endif
  }
  return absl::InternalError("unknown strategy");
}

std::int64_t total_sent(const comm::CommCounters& c) {
  std::int64_t n = 0;
  for (const auto& k : c.by_kind) n += k.bytes_sent;
  return n;
}

std::uint64_t digest(const nn::GPT& model) {
  std::uint64_t h = fnv1a64(nullptr, 0);
  for (const Tensor& p : model.parameters()) h = fnv1a64(p.raw_data(), p.nbytes(), h);
  return h;
}

std::string generate(nn::GPT& model, const std::string& prompt, std::int64_t n, std::uint64_t seed) {
  autograd::NoGradGuard no_grad;
  model.eval();
  const std::int64_t ctx = model.config().context, vocab = model.config().vocab_size;
  std::vector<std::int64_t> tokens;
  for (unsigned char c : prompt) tokens.push_back(c);
  Generator gen(seed, 7);
  for (std::int64_t i = 0; i < n; ++i) {
    const std::int64_t t = std::min<std::int64_t>(ctx, static_cast<std::int64_t>(tokens.size()));
    std::vector<std::int64_t> window(tokens.end() - t, tokens.end());
    Tensor logits = model(Tensor::from_int64(window, {1, t}));
    std::vector<float> all = logits.to_vector();
    const float* last = all.data() + (t - 1) * vocab;
    // Temperature 0.8 sampling.
    float mx = last[0];
    for (std::int64_t v = 1; v < vocab; ++v) mx = std::max(mx, last[v]);
    std::vector<double> pr(static_cast<std::size_t>(vocab));
    double sum = 0;
    for (std::int64_t v = 0; v < vocab; ++v) sum += pr[static_cast<std::size_t>(v)] = std::exp((last[v] - mx) / 0.8);
    double u = static_cast<double>(gen.next_below(1u << 30)) / static_cast<double>(1u << 30) * sum;
    std::int64_t pick = vocab - 1;
    for (std::int64_t v = 0; v < vocab; ++v) {
      if ((u -= pr[static_cast<std::size_t>(v)]) <= 0) { pick = v; break; }
    }
    tokens.push_back(pick);
  }
  model.train();
  std::string out;
  for (std::int64_t tok : tokens) out.push_back(static_cast<char>(tok));
  return out;
}

// Note [non-finite loss]
// A run whose loss becomes inf or NaN has diverged: every later step trains on garbage, and a checkpoint
// written then would replace the last good one with NaN. So:
//   - Each step, right after the forward, every rank checks its local loss (optim::all_finite) and the
//     ranks agree in the loss all_reduce they do anyway for display: it carries [loss, non-finite flag]
//     and averages both. The averaged flag is > 0 exactly when some rank's loss was non-finite, in any
//     summation order, so every rank stops at the same step, before backward, with the same error (no
//     rank is left waiting in a collective the others never issue). Stopping before backward and step()
//     leaves the parameters of the previous step. The error quotes the mean loss (NaN or inf when any
//     rank's was) and how many ranks saw a non-finite one.
//   - A step's update can still make parameters non-finite with a finite loss (a step's loss is computed
//     before its update). Before writing a checkpoint, rank 0 checks every value it is about to write
//     (check_finite, checkpoint.h) and the ranks agree on the outcome with one all_reduce(max) of a flag;
//     a non-finite checkpoint is never written, and the run stops on every rank.
// The display all_reduce runs between forward and backward; its bytes and time are left out of the step's
// figures (RankStats, seconds_per_step).

std::string last_checkpoint_clause(const Options& o, std::int64_t last_checkpoint_step) {
  if (o.checkpoint_dir.empty()) return "";
  if (last_checkpoint_step < 0) return absl::StrCat("; no checkpoint was written to '", o.checkpoint_dir, "'");
  return absl::StrCat("; the last checkpoint is step ", last_checkpoint_step, " in '", o.checkpoint_dir, "'");
}

// --export (Note [--export and --init-from] in model_files.h): every rank calls it after the last step.
absl::Status export_model(Strategy strategy, nn::GPT& model, comm::ProcessGroup& pg, const std::string& path) {
  const io::ModelExportOptions gpt2 = export_options(model.config());
  MemoryCategoryScope other(MemoryCategory::other);
#ifdef SHARDKIT_TRAIN_HAS_FSDP
  if (strategy == Strategy::fsdp) {  // both end with a barrier
    return export_is_one_file(path) ? fsdp::export_single_safetensors(model, path, gpt2)
                                    : fsdp::export_sharded_safetensors(model, path, gpt2);
  }
#endif
  // ddp / oss / sddp: every rank holds the whole model after step().
  if (!export_is_one_file(path)) {
    SKT_RETURN_IF_ERROR(io::export_sharded_safetensors(model.state_dict(), path, pg.rank(), pg.size(), gpt2));
  } else if (pg.rank() == 0) {
    SKT_RETURN_IF_ERROR(io::export_safetensors(model, path, gpt2));
  }
  return pg.barrier({.tag = "export written"})->wait();
}

// Note [activation peak without checkpointing]
// With --checkpoint-activations the report puts the activation peak of the run next to the one the same run
// would have had without checkpointing. That one is measured after the last step, on every rank: checkpointing
// off, one forward and backward of the last step's batch (with the strategy's reductions, which every rank runs
// alike), no optimizer step, gradients zeroed, checkpointing back on. Parameters, losses and the digest are
// those of the checkpointed run, which equal the run without it (the recompute is the same computation).
// --compile: the compiled step's backward is inside the step, so that forward and backward run eagerly on the
// module, its parameters whole first (fsdp: gathered from the shards, which stay the truth), without reductions
// (they allocate no activations), and the gradients are dropped after. A replayed step keeps the activations the
// eager one keeps (Note [capturing activation checkpointing] in common/nn/checkpoint.cc; compile_checkpoint_test
// measures both), so the two columns compare the same thing.
absl::StatusOr<std::int64_t> activation_peak_without_checkpointing(nn::GPT& model, Runner& runner, MemoryTracker& ledger,
                                                                   const Corpus& corpus, const Options& o, int rank,
                                                                   int world) {
  nn::remove_checkpoint_blocks(model);
  auto [x, y] = batch(corpus, o.seed, o.steps - 1, rank, world, o.batch, model.config().context);
  if (o.compile) {
    absl::Status st = runner.gather_model();
    ledger.reset_peaks();
    if (st.ok()) st = autograd::try_backward(model.loss(x, y));
    const std::int64_t peak = ledger.peak(MemoryCategory::activation);
    for (const Tensor& p : model.parameters()) p.set_grad(Tensor());
    SKT_RETURN_IF_ERROR(nn::checkpoint_blocks(model));
    if (!st.ok()) return st;
    return peak;
  }
  runner.zero_grad();
  ledger.reset_peaks();
  absl::Status st = runner.backward(model.loss(x, y));
  const std::int64_t peak = ledger.peak(MemoryCategory::activation);
  runner.zero_grad();
  SKT_RETURN_IF_ERROR(nn::checkpoint_blocks(model));
  if (!st.ok()) return st;
  return peak;
}

// The per-rank loop (same code for threads and processes).
absl::StatusOr<std::optional<RunResult>> train_rank(const Options& o, Strategy strategy, const Corpus& corpus,
                                                    const Checkpoint* resume, const StepObserver& observe,
                                                    const nn::StateDict* init, std::shared_ptr<comm::ProcessGroup> pg) {
  const int rank = pg->rank(), world = pg->size();
  auto size = model_size(o.model, o.shape);
  if (!size.ok()) return size.status();
  const nn::GPTConfig cfg = size->config;
  MemoryTracker& ledger = *current_rank_context().memory;

  nn::GPT model(cfg, o.seed);
  const std::int64_t num_params = model.num_parameters();  // (under fsdp, parameters() are shards afterwards)
  if (init != nullptr) SKT_RETURN_IF_ERROR(model.load_state_dict(*init));  // before sharding: every rank the same
  if (o.checkpoint_activations) SKT_RETURN_IF_ERROR(nn::checkpoint_blocks(model));
  auto runner = make_runner(strategy, model, pg, o);
  if (!runner.ok()) return runner.status();
  std::int64_t start = 0;
  if (resume != nullptr) {
    MemoryCategoryScope other(MemoryCategory::other);
    SKT_RETURN_IF_ERROR((*runner)->gather_model());
    SKT_RETURN_IF_ERROR(model.load_state_dict(resume->model));
    (*runner)->release_model();
    SKT_RETURN_IF_ERROR((*runner)->load_state(resume->optimizer));
    start = std::stoll(resume->meta.at("step"));
  }

  RunResult res;
  res.strategy = strategy;
  res.world = world;
  res.num_params = num_params;
  res.start_step = start;
  res.tokens_per_step = o.batch * cfg.context * world;
  res.backend = pg->backend_name();

  std::array<std::int64_t, kNumMemoryCategories> peak{};
  std::int64_t replayed_activation_peak = -1;  // --compile: the steps after the capture
  std::int64_t sent = 0, counted_steps = 0;
  bool checkpointed = false;
  std::int64_t last_checkpoint_step = resume != nullptr ? start : -1;
  double step_seconds_sum = 0;
  const auto t_start = std::chrono::steady_clock::now();
  const std::int64_t warmup = std::max<std::int64_t>(1, std::min<std::int64_t>(20, o.steps / 10));
  Tensor loss_buf = Tensor::zeros({2});  // [loss, non-finite flag] (Note [non-finite loss])

  for (std::int64_t step = start; step < o.steps; ++step) {
    const auto t0 = std::chrono::steady_clock::now();
    const double lr = o.lr * optim::warmup_cosine_factor(step, warmup, o.steps, 0.1);
    (*runner)->set_lr(lr);
    ledger.reset_peaks();
    const comm::CommCounters c0 = pg->counters();
    auto [x, y] = batch(corpus, o.seed, step, rank, world, o.batch, cfg.context);
    Tensor loss;
    if (o.compile) {  // Note [--compile]: forward, backward and update in one call
      absl::StatusOr<Tensor> compiled = (*runner)->compiled_step(x, y);
      if (!compiled.ok()) return compiled.status();
      loss = *std::move(compiled);
    } else {
      (*runner)->zero_grad();
      loss = model.loss(x, y);
    }

    // Note [non-finite loss]: agree on the loss (and whether any rank's is non-finite) before backward.
    const auto t_display = std::chrono::steady_clock::now();
    const comm::CommCounters display0 = pg->counters();
    float* lb = loss_buf.data<float>();
    lb[0] = static_cast<float>(loss.item());
    lb[1] = optim::all_finite({loss}) ? 0.f : 1.f;
    SKT_RETURN_IF_ERROR(pg->all_reduce(loss_buf, {.op = comm::ReduceOp::avg(), .tag = "loss (display)"})->wait());
    const std::int64_t display_sent = total_sent(pg->counters()) - total_sent(display0);
    const double display_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_display).count();
    const double mean_loss = lb[0];
    if (lb[1] > 0.f) {
      const long non_finite_ranks = std::max(1L, std::lround(static_cast<double>(lb[1]) * world));
      return absl::FailedPreconditionError(absl::StrCat(
          "training diverged: the loss at step ", step + 1, " is ", value_str(mean_loss), " (non-finite on ",
          non_finite_ranks, " of ", world, " ranks); stopped ", o.compile ? "after" : "before", " step ", step + 1,
          " updated the parameters", last_checkpoint_clause(o, last_checkpoint_step)));
    }

    if (!o.compile) {
      SKT_RETURN_IF_ERROR((*runner)->backward(loss));
      SKT_RETURN_IF_ERROR((*runner)->step());
    }
    const MemorySnapshot snap = ledger.snapshot();
    sent += total_sent(pg->counters()) - total_sent(c0) - display_sent;
    ++counted_steps;
    if (!checkpointed) {
      for (int c = 0; c < kNumMemoryCategories; ++c) peak[static_cast<std::size_t>(c)] = std::max(peak[static_cast<std::size_t>(c)], snap.peak[static_cast<std::size_t>(c)]);
      if (o.compile && counted_steps > 1) {
        replayed_activation_peak = std::max(
            replayed_activation_peak, snap.peak[static_cast<std::size_t>(MemoryCategory::activation)]);
      }
    }
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() - display_seconds;
    if (step > start || o.steps - start == 1) step_seconds_sum += dt;

    res.losses.push_back(mean_loss);
    if (rank == 0 && observe) {
      const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
      const double done = static_cast<double>(step + 1 - start);
      StepRecord rec{.strategy = strategy, .ranks = world, .step = step + 1, .steps = o.steps, .loss = mean_loss, .lr = lr,
                     .tokens = res.tokens_per_step, .step_seconds = dt, .elapsed_seconds = elapsed,
                     .mean_tokens_per_s = done * static_cast<double>(res.tokens_per_step) / elapsed,
                     .eta_seconds = elapsed / done * static_cast<double>(o.steps - step - 1), .memory_peak = snap.peak};
      SKT_RETURN_IF_ERROR(observe(rec));
    }
    if (!o.checkpoint_dir.empty() && ((step + 1) % o.checkpoint_every == 0 || step + 1 == o.steps)) {
      // Note [checkpoint format] in checkpoint.h: each rank writes what it holds, rank 0 commits.
      std::optional<std::optional<optim::OptimizerStateDict>> full;  // --test-checkpoint-consolidated only
      if (o.checkpoint_consolidated) {
        auto state = (*runner)->full_state();
        if (!state.ok()) return state.status();
        full = std::move(*state);
        SKT_RETURN_IF_ERROR((*runner)->gather_model());
      }
      auto contents = full ? consolidated_contents(model, *full ? &**full : nullptr, rank)
                           : sharded_contents((*runner)->checkpoint_source(model), rank);
      if (!contents.ok()) return contents.status();
      const std::map<std::string, std::string> meta = {
          {"model", size->name},
          {"model.vocab", std::to_string(cfg.vocab_size)},
          {"model.context", std::to_string(cfg.context)},
          {"model.width", std::to_string(cfg.width)},
          {"model.layers", std::to_string(cfg.num_layers)},
          {"model.heads", std::to_string(cfg.num_heads)},
          {"model.parameters", std::to_string(res.num_params)},
          {"step", std::to_string(step + 1)},
          {"seed", std::to_string(o.seed)},
          {"data.bytes", std::to_string(corpus.bytes.size())},
          {"data.fingerprint", std::to_string(corpus.fingerprint)},
          {"strategy", strategy_name(strategy)},
          {"world", std::to_string(world)}};
      const absl::Status saved = save_checkpoint(o, step + 1, meta, *contents, *pg);
      if (full) (*runner)->release_model();
      if (!saved.ok()) {
        return absl::Status(saved.code(), absl::StrCat(saved.message(), last_checkpoint_clause(o, last_checkpoint_step)));
      }
      checkpointed = true;
      last_checkpoint_step = step + 1;
    }
    if (o.stop_after_step == step + 1 && rank == 0) ::kill(::getpid(), SIGKILL);  // test-only: a kill between steps
  }
  res.total_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_start).count();
  res.compiled_graph = (*runner)->graph_summary();
  std::int64_t activation_without = -1;
  if (o.checkpoint_activations && counted_steps > 0) {
    auto peak_without = activation_peak_without_checkpointing(model, **runner, ledger, corpus, o, rank, world);
    if (!peak_without.ok()) return peak_without.status();
    activation_without = *peak_without;
  }
  if (!o.export_path.empty()) SKT_RETURN_IF_ERROR(export_model(strategy, model, *pg, o.export_path));
  const std::int64_t timed = std::max<std::int64_t>(1, counted_steps - 1);
  res.seconds_per_step = counted_steps == 0 ? 0 : step_seconds_sum / static_cast<double>(counted_steps == 1 ? 1 : timed);

  // Gather every rank's figures on every rank (after the counted steps).
  constexpr int kFields = kNumMemoryCategories + 4;
  Tensor mine = Tensor::zeros({kFields}, TensorOptions{}.with_dtype(DType::i64));
  auto* m = static_cast<std::int64_t*>(mine.raw_data());
  for (int c = 0; c < kNumMemoryCategories; ++c) m[c] = peak[static_cast<std::size_t>(c)];
  m[kNumMemoryCategories] = counted_steps == 0 ? 0 : sent / counted_steps;
  m[kNumMemoryCategories + 1] = (*runner)->owned_numel();
  m[kNumMemoryCategories + 2] = activation_without;
  m[kNumMemoryCategories + 3] = replayed_activation_peak;
  Tensor all = Tensor::zeros({kFields * world}, TensorOptions{}.with_dtype(DType::i64));
  SKT_RETURN_IF_ERROR(pg->all_gather(all, mine, {.tag = "stats"})->wait());
  SKT_RETURN_IF_ERROR((*runner)->gather_model());  // for the digest and the sample (rank 0 only)
  if (rank != 0) {
    (*runner)->release_model();
    return std::nullopt;
  }
  const auto* a = static_cast<const std::int64_t*>(all.raw_data());
  for (int r = 0; r < world; ++r) {
    RankStats s;
    for (int c = 0; c < kNumMemoryCategories; ++c) s.peak[static_cast<std::size_t>(c)] = a[r * kFields + c];
    s.bytes_sent_per_step = a[r * kFields + kNumMemoryCategories];
    s.owned_numel = a[r * kFields + kNumMemoryCategories + 1];
    s.activation_peak_without_checkpointing = a[r * kFields + kNumMemoryCategories + 2];
    s.activation_peak_replayed = a[r * kFields + kNumMemoryCategories + 3];
    res.ranks.push_back(s);
  }
  res.param_digest = digest(model);
  if (o.sample_bytes > 0) res.sample = generate(model, "shardkit ", o.sample_bytes, o.seed);
  (*runner)->release_model();
  return std::optional<RunResult>(std::move(res));
}

absl::Status status_of_exception(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return absl::InternalError(ex.what());
  } catch (...) {
    return absl::InternalError("unknown exception");
  }
}

}  // namespace

absl::Status check_resumable(const Checkpoint& ck, const Options& o, const ModelSize& model, const Corpus& corpus) {
  auto get = [&](const std::string& k) {
    auto it = ck.meta.find(k);
    return it == ck.meta.end() ? std::string("?") : it->second;
  };
  const std::string path = checkpoint_path(o.checkpoint_dir);
  const nn::GPTConfig& c = model.config;
  if (get("model") != model.name || get("model.vocab") != std::to_string(c.vocab_size) ||
      get("model.context") != std::to_string(c.context) || get("model.width") != std::to_string(c.width) ||
      get("model.layers") != std::to_string(c.num_layers) || get("model.heads") != std::to_string(c.num_heads)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resume from '", path, "': expected a checkpoint of model '",
                                                   model.name, "' (", c.num_parameters(), " parameters), found model '",
                                                   get("model"), "' (", get("model.parameters"), " parameters)"));
  }
  if (get("data.fingerprint") != std::to_string(corpus.fingerprint)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resume from '", path, "': expected a checkpoint trained on ",
                                                   corpus.source, " (", corpus.bytes.size(), " bytes), found one trained on other data (",
                                                   get("data.bytes"), " bytes)"));
  }
  if (get("seed") != std::to_string(o.seed)) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resume from '", path, "': expected --seed ", get("seed"),
                                                   " as the checkpoint was trained with, found --seed ", o.seed));
  }
  std::int64_t step = 0;
  if (!absl::SimpleAtoi(get("step"), &step) || step < 0) {
    return absl::DataLossError(absl::StrCat("checkpoint '", path, "' is corrupt: bad step '", get("step"), "'"));
  }
  if (step > o.steps) {
    return absl::InvalidArgumentError(absl::StrCat("cannot resume from '", path, "': expected --steps >= the checkpoint's step ",
                                                   step, ", found --steps ", o.steps));
  }
  return absl::OkStatus();
}

absl::StatusOr<RunResult> run_threads(const Options& o, Strategy strategy, const Corpus& corpus, const Checkpoint* resume,
                                      const StepObserver& observe, const nn::StateDict* init) {
  std::optional<RunResult> result;
  std::vector<absl::Status> per_rank(static_cast<std::size_t>(o.ranks));
  const absl::Status st = comm::run_ranks(
      o.ranks,
      [&](comm::ThreadRankEnv& env) -> absl::Status {
        auto res = train_rank(o, strategy, corpus, resume, observe, init, env.group);
        if (!res.ok()) return per_rank[static_cast<std::size_t>(env.rank)] = res.status();
        if (res->has_value()) result = std::move(*res);
        return absl::OkStatus();
      },
      {.timeout = o.timeout.value_or(absl::Minutes(2)), .seed = o.seed});
  if (!st.ok()) {
    // The lowest rank's own error, not the aborts it caused on the others nor the order in which the ranks
    // failed (every rank may stop with an error of its own at the same step: rank 0's says most).
    for (const absl::Status& s : per_rank) {
      if (!s.ok() && s.code() != absl::StatusCode::kAborted) return s;
    }
    return st;
  }
  if (!result) return absl::InternalError("rank 0 returned no result");
  result->backend = absl::StrCat(o.ranks, " threads (in-process)");
  return std::move(*result);
}

absl::StatusOr<std::optional<RunResult>> run_process(const Options& o, Strategy strategy, const Corpus& corpus,
                                                     const Checkpoint* resume, const StepObserver& observe,
                                                     const nn::StateDict* init) {
  comm::InitFromEnvOptions tcp;
  tcp.timeout = o.timeout;
  if (o.backend == Backend::tcp) tcp.group.transport = "tcp";
  if (o.backend == Backend::shm) tcp.group.transport = "shm";
  comm::MpiOptions mpi;
  if (o.timeout) mpi.default_timeout = *o.timeout;
  auto pg = o.backend == Backend::mpi ? comm::create_mpi_world(mpi) : comm::init_from_env(tcp);
  if (!pg.ok()) return pg.status();
  RankContext& ctx = current_rank_context();
  ctx.rank = (*pg)->rank();
  ctx.world_size = (*pg)->size();
  ctx.generator = Generator(o.seed).fork(static_cast<std::uint64_t>(ctx.rank));
  absl::StatusOr<std::optional<RunResult>> res;
  try {
    res = train_rank(o, strategy, corpus, resume, observe, init, *pg);
  } catch (...) {
    res = status_of_exception(std::current_exception());
  }
  if (!res.ok()) {
    (*pg)->abort(res.status());
    return res.status();
  }
  if (res->has_value()) (*res)->backend = absl::StrCat((*pg)->size(), " processes (", (*pg)->backend_name(), ")");
  return res;
}

}  // namespace shardkit::train
