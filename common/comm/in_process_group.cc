#include "common/comm/in_process_group.h"

#include <atomic>
#include <deque>
#include <map>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/base/check.h"
#include "common/base/copy_bytes.h"
#include "common/comm/completion_work.h"
#include "common/comm/reduce_kernels.h"
#include "common/tensor/device_memory.h"

namespace shardkit::comm {
namespace {

// Note [in-process spin]
// A rendezvous waiter first spins on the group's generation counter for up to 50 us, then blocks on the
// world mutex (absl::Mutex::AwaitWithDeadline). Blocking costs ~50 us per wake-up in this VM (DESIGN.md
// section 9), which would dominate small collectives; spinning only pays when every rank has a core, so
// groups larger than the hardware thread count never spin (they would steal the core of the rank they
// wait for). The spinning thread is the rank's worker (Note [in-process progress engine]), which may also take
// the core of its own rank's compute thread. Measured and left (stop 28, Zen 4, 2 cores, train_bench
// compiled_fully_shard/gpt-10m/n2, 3 alternated rounds): without the spin eager fsdp's step took 170-192 ms
// against 152-170 ms with it; spinning only while the rank's caller waits in Work::wait gave 189-207 ms.
//
// Note [in-process leave]
// Once the enter point has completed, every rank's buffers are published and each rank's data phase reads
// and writes its peers' buffers. The leave point is therefore not a rendezvous that may give up: a rank that
// returned early (at its deadline, or because the world failed meanwhile: an abort from another thread, a
// failure of another sub-group) would hand its buffers back to its caller while peers still copy into them.
// So the leave point waits for every rank of the group with no deadline and ignores failures. It cannot
// hang: each rank that passed the enter point runs its data phase (a bounded copy or reduction of its share,
// nothing it waits for) and then reaches the leave point. A deadline therefore bounds the wait for peers to
// join; a call whose peers all joined in time completes, and may return after its deadline by the length of
// its data phase. Likewise the outcome of the enter point is decided once, by the last rank to arrive
// (GroupState::enter_failed): a rank that wakes up after the rendezvous completed and finds the world failed
// by someone else still runs its data phase, because its peers are running theirs in its buffers.
//
// Note [in-process progress engine]
// A collective on a group of more than one rank is queued to the handle's worker thread (started by the
// handle's first such call) and returns at once; the worker runs the queued calls one at a time, in issue
// order (enter, data phase, leave), and completes each Work once its leave point has passed. So a rank's
// compute overlaps its communication as over TCP or NCCL, and the caller may drop its Work and tensors at
// once: the queued CollectiveCall holds the Tensor handles until every peer has finished with the buffers
// (the leave point), and releases them before the Work completes, so storage the caller dropped is freed by
// the time wait() returns. Calls on different groups progress independently (one worker per handle).
// A group of one rank runs in the calling thread (nothing to overlap).
// The failure contract is unchanged: each call's enter point still waits until the call's own deadline (a
// call that waited in the queue past it fails at once, naming the ranks that had not joined), so a Work
// completes within its deadline plus the data phases of the calls queued before it; the Work itself has
// no deadline of its own, because only the worker knows whether peers are still writing its buffers.
// A departed rank (InProcessWorld::mark_departed) is only treated as gone for a group once it has no call
// queued there that has not yet reached its enter point (GroupState::queued): a rank may issue calls and
// return without waiting for them; its worker still joins them.
// Destroying a handle fails the calls it had queued but not started (the world aborts: peers would wait for
// them) and joins the worker after the call in progress.
//
// Note [in-process p2p]
// A send and its recv meet in the (src, dst) queue of the group; whoever comes second copies the bytes
// under the world mutex and completes both Works. Copying under the lock keeps the deadline path simple
// (an entry is either still queued, and its deadline may fail it, or done); p2p is rare and small in the
// sharding layers (state consolidation), so the serialisation does not matter.

// What a rank publishes at a collective's enter point (see Note [in-process collectives]).
struct CallDesc {
  const CollectiveCall* call = nullptr;  // valid while its rank waits at the enter point
  char* in = nullptr;
  char* out = nullptr;
};

struct P2PEntry {
  Tensor tensor;
  std::shared_ptr<CompletionWork> work;
  std::string what;  // for error messages
  std::uint32_t fingerprint = 0;  // the call's (process_group.h, THE CONTRACT)
};

struct GroupState {
  int id = 0;
  std::string name;
  std::vector<int> global;  // world rank of each group rank
  int n = 0;

  // Rendezvous (guarded by the world mutex; generation also read without it while spinning).
  std::atomic<std::uint64_t> generation{0};
  int arrived = 0;
  std::vector<std::uint64_t> arrived_for;  // generation + 1 of the rendezvous a rank last joined
  bool enter_failed = false;  // the last completed enter point failed its agreement check (Note [in-process leave])
  // Per group rank: calls issued and not yet arrived at their enter point (Note [in-process progress engine]).
  std::vector<int> queued;
  std::vector<CallDesc> desc;

  // p2p queues indexed src * n + dst (group ranks).
  std::vector<std::deque<P2PEntry>> sends, recvs;

  std::string rank_str(int r) const {
    if (global[r] == r) return absl::StrCat("rank ", r);
    return absl::StrCat("rank ", r, " (global rank ", global[r], ")");
  }
};

}  // namespace

class InProcessWorldState {
 public:
  InProcessWorldState(int size, InProcessOptions options) : size_(size), options_(std::move(options)) {
    departed_.assign(static_cast<std::size_t>(size), false);
    handed_.assign(static_cast<std::size_t>(size), false);
    std::vector<int> ids;
    for (int r = 0; r < size; ++r) ids.push_back(r);
    absl::MutexLock lock(&mu_);
    world_ = new_group_locked(options_.name, ids);
  }

  std::shared_ptr<GroupState> new_group_locked(const std::string& name, std::vector<int> global)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto g = std::make_shared<GroupState>();
    g->id = static_cast<int>(groups_.size());
    g->name = name;
    g->n = static_cast<int>(global.size());
    g->global = std::move(global);
    g->arrived_for.assign(static_cast<std::size_t>(g->n), 0);
    g->queued.assign(static_cast<std::size_t>(g->n), 0);
    g->desc.resize(static_cast<std::size_t>(g->n));
    g->sends.resize(static_cast<std::size_t>(g->n) * g->n);
    g->recvs.resize(static_cast<std::size_t>(g->n) * g->n);
    groups_.push_back(g);
    return g;
  }

  // Records the first failure and fails every pending p2p Work.
  void fail_locked(const absl::Status& reason) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (failed_.load(std::memory_order_relaxed)) return;
    failure_ = reason;
    failed_.store(true, std::memory_order_release);
    for (auto& g : groups_) {
      for (auto* queues : {&g->sends, &g->recvs}) {
        for (auto& q : *queues) {
          for (auto& e : q) {
            e.work->complete(absl::AbortedError(absl::StrCat(e.what, ": aborted because: ", reason.message())));
          }
          q.clear();
        }
      }
    }
  }

  absl::Mutex mu_;
  const int size_;
  const InProcessOptions options_;
  std::atomic<bool> failed_{false};
  absl::Status failure_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> departed_ ABSL_GUARDED_BY(mu_);
  std::vector<bool> handed_ ABSL_GUARDED_BY(mu_);
  std::vector<std::shared_ptr<GroupState>> groups_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<GroupState>> subgroups_ ABSL_GUARDED_BY(mu_);
  std::shared_ptr<GroupState> world_;
};

namespace {

// Note [in-process CUDA tensors]: the ranks are threads of one process, but a CUDA tensor's bytes cannot be read
// by the CPU algorithms below. A call on CUDA tensors therefore runs on host copies: the calling rank first waits
// for the kernels it queued (run(), so the bytes are final whichever thread copies them), the worker copies the
// byte range the call's tensors cover in each storage to host memory, runs the collective there, and copies the
// output back before the Work completes. p2p copies go device to device. Correct for simulated ranks on one GPU
// (the equivalence tests), not fast: every call crosses PCIe twice. Real multi-GPU training uses NCCL.
bool OnDevice(const Tensor& t) { return t.defined() && t.device().is_cuda(); }

// Host copies of the bytes [lo, hi) that a call's tensors cover in each storage, so tensors that share a storage
// (an in-place all_gather whose input is a slice of its output) share the copy.
class HostMirror {
 public:
  HostMirror(const Tensor& a, const Tensor& b) {
    for (const Tensor* t : {&a, &b}) {
      if (!t->defined()) continue;
      Range& r = ranges_[t->storage().get()];
      r.lo = std::min(r.lo, t->offset_bytes());
      r.hi = std::max(r.hi, t->offset_bytes() + t->nbytes());
      r.device = t->device();
    }
    for (auto& [storage, r] : ranges_) {
      r.host = Storage::allocate(r.hi - r.lo, Device::cpu(), MemoryCategory::communication_buffer);
      if (r.hi > r.lo) {
        // Every dtype is a whole number of 2-byte units: copied as bf16, which is a byte copy.
        const auto n = static_cast<std::int64_t>((r.hi - r.lo) / 2);
        detail::cuda_copy(static_cast<const char*>(storage->data()) + r.lo, DType::bf16, r.device, r.host->data(),
                          DType::bf16, Device::cpu(), n);
      }
    }
  }
  // `t` over the host copy (undefined stays undefined).
  Tensor of(const Tensor& t) const {
    if (!t.defined()) return t;
    const Range& r = ranges_.at(t.storage().get());
    return Tensor::over(r.host, t.offset_bytes() - r.lo, t.shape(), t.dtype());
  }

 private:
  struct Range {
    std::size_t lo = SIZE_MAX, hi = 0;
    Device device;
    std::shared_ptr<Storage> host;
  };
  std::map<const Storage*, Range> ranges_;
};

class InProcessGroup final : public ProcessGroup {
 public:
  InProcessGroup(std::shared_ptr<InProcessWorldState> world, std::shared_ptr<GroupState> g, int me,
                 absl::Duration default_timeout)
      : ProcessGroup(me, g->n, g->name, g->global, default_timeout),
        world_(std::move(world)),
        g_(std::move(g)),
        me_(me),
        scratch_(world_->options_.chunk_bytes),
        spin_(g_->n <= static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))) {}
  ~InProcessGroup() override;

  std::string backend_name() const override { return "in_process"; }

  void abort(const absl::Status& reason) override {
    absl::MutexLock lock(&world_->mu_);
    world_->fail_locked(reason);
  }

 protected:
  std::shared_ptr<Work> run(CollectiveCall call) override;
  absl::StatusOr<std::shared_ptr<ProcessGroup>> make_subgroup(std::vector<int> members, const std::string& key,
                                                              const std::string& name,
                                                              absl::Duration default_timeout,
                                                              absl::Time deadline) override;

 private:
  std::string where(const CollectiveCall& call) const {
    return absl::StrCat(call.describe(), " on group '", g_->name, "', ", g_->rank_str(me_));
  }
  absl::Status aborted_locked(const CollectiveCall& call) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(world_->mu_) {
    return absl::AbortedError(absl::StrCat(where(call), ": aborted because: ", world_->failure_.message()));
  }
  // The enter point: publishes `desc` and waits (until the call's deadline) for every rank of the group.
  absl::Status enter(const CollectiveCall& call, const CallDesc& desc);
  // True when group rank r has not joined rendezvous `gen` and never will: it departed with no call of
  // this group still queued (Note [in-process progress engine]).
  bool gone_locked(const GroupState& g, int r, std::uint64_t gen) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(world_->mu_) {
    return g.arrived_for[r] != gen + 1 && world_->departed_[g.global[r]] && g.queued[r] == 0;
  }
  // The leave point: waits for every rank of the group, with no deadline (Note [in-process leave]).
  void leave();
  // Spins briefly while the group's generation is still `gen` (Note [in-process spin]).
  void spin_while_generation_is(std::uint64_t gen) const;
  absl::Status validate_locked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(world_->mu_);
  void data_phase(const CollectiveCall& call);
  // Runs one collective to completion: enter, data phase, leave (through host copies for CUDA tensors, Note
  // [in-process CUDA tensors]).
  absl::Status execute(const CollectiveCall& call);
  absl::Status execute_on_host(const CollectiveCall& call);
  // The worker thread's loop (Note [in-process progress engine]).
  void work_queue();
  std::shared_ptr<Work> run_p2p(CollectiveCall call);

  struct Queued {
    CollectiveCall call;
    std::shared_ptr<CompletionWork> work;
  };

  std::shared_ptr<InProcessWorldState> world_;
  std::shared_ptr<GroupState> g_;
  int me_;
  ReduceScratch scratch_;
  bool spin_;
  std::vector<const void*> srcs_;  // data_phase scratch (worker thread)
  std::vector<void*> dsts_;

  absl::Mutex queue_mu_;
  std::deque<Queued> queue_ ABSL_GUARDED_BY(queue_mu_);
  bool stopping_ ABSL_GUARDED_BY(queue_mu_) = false;
  std::thread worker_;  // started by the first queued call; joined by the destructor
};

absl::Status InProcessGroup::validate_locked() const {
  const CollectiveCall& a = *g_->desc[0].call;
  for (int r = 1; r < g_->n; ++r) {
    const CollectiveCall& b = *g_->desc[r].call;
    bool same = a.kind == b.kind && a.seq == b.seq && a.root == b.root && a.fingerprint == b.fingerprint;
    if (same && a.kind != CollectiveKind::barrier) {
      same = a.input.dtype() == b.input.dtype() && a.input.numel() == b.input.numel() &&
             a.output.numel() == b.output.numel();
    }
    if (same && (a.kind == CollectiveKind::all_reduce || a.kind == CollectiveKind::reduce ||
                 a.kind == CollectiveKind::reduce_scatter)) {
      same = a.op.kind == b.op.kind && a.op.factor == b.op.factor;
    }
    if (!same) {
      return absl::InvalidArgumentError(absl::StrCat("ranks disagree on collective #", a.seq, " of group '", g_->name,
                                                     "': expected ", a.describe(), " (as ", g_->rank_str(0),
                                                     "), found ", b.describe(), " on ", g_->rank_str(r)));
    }
  }
  return absl::OkStatus();
}

void InProcessGroup::spin_while_generation_is(std::uint64_t gen) const {
  if (!spin_) return;
  const absl::Time spin_until = absl::Now() + absl::Microseconds(50);
  for (int i = 0;; ++i) {
    if (g_->generation.load(std::memory_order_acquire) != gen) return;
    if ((i & 63) == 63 && absl::Now() > spin_until) return;
#if defined(__x86_64__)
    __builtin_ia32_pause();
#endif
  }
}

absl::Status InProcessGroup::enter(const CollectiveCall& call, const CallDesc& desc) {
  GroupState& g = *g_;
  std::uint64_t gen;
  {
    absl::MutexLock lock(&world_->mu_);
    --g.queued[me_];  // issued by run(); arrived now, or failing (Note [in-process progress engine])
    if (world_->failed_.load(std::memory_order_relaxed)) return aborted_locked(call);
    gen = g.generation.load(std::memory_order_relaxed);
    g.desc[me_] = desc;
    g.arrived_for[me_] = gen + 1;
    if (++g.arrived == g.n) {
      g.arrived = 0;
      absl::Status st;
      if (g.n > 1) st = validate_locked();
      if (!st.ok()) world_->fail_locked(st);
      g.enter_failed = !st.ok();
      g.generation.store(gen + 1, std::memory_order_release);
      return st;
    }
  }
  // Others are still coming. Spin briefly when every rank has a core (Note [in-process spin]), then block.
  spin_while_generation_is(gen);
  absl::MutexLock lock(&world_->mu_);
  auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(world_->mu_) {
    if (g.generation.load(std::memory_order_relaxed) != gen) return true;
    if (world_->failed_.load(std::memory_order_relaxed)) return true;
    for (int r = 0; r < g.n; ++r) {
      if (gone_locked(g, r, gen)) return true;
    }
    return false;
  };
  world_->mu_.AwaitWithDeadline(absl::Condition(&ready), call.deadline);
  if (g.generation.load(std::memory_order_relaxed) != gen) {
    // The rendezvous completed: its outcome was decided by the last rank to arrive, whatever failed since
    // (Note [in-process leave]).
    return g.enter_failed ? aborted_locked(call) : absl::OkStatus();
  }
  if (world_->failed_.load(std::memory_order_relaxed)) return aborted_locked(call);
  std::vector<std::string> departed, missing;
  for (int r = 0; r < g.n; ++r) {
    if (g.arrived_for[r] == gen + 1) continue;
    missing.push_back(g.rank_str(r));
    if (gone_locked(g, r, gen)) departed.push_back(g.rank_str(r));
  }
  absl::Status st;
  if (!departed.empty()) {
    st = absl::AbortedError(absl::StrCat(where(call), ": ", absl::StrJoin(departed, ", "),
                                         " returned from its function without joining it"));
  } else {
    st = absl::DeadlineExceededError(absl::StrCat(where(call), ": ", absl::StrJoin(missing, ", "),
                                                  " did not join within ", absl::FormatDuration(call.timeout)));
  }
  world_->fail_locked(st);
  return st;
}

void InProcessGroup::leave() {
  GroupState& g = *g_;
  std::uint64_t gen;
  {
    absl::MutexLock lock(&world_->mu_);
    gen = g.generation.load(std::memory_order_relaxed);
    if (++g.arrived == g.n) {
      g.arrived = 0;
      g.generation.store(gen + 1, std::memory_order_release);
      return;
    }
  }
  spin_while_generation_is(gen);
  absl::MutexLock lock(&world_->mu_);
  auto done = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(world_->mu_) {
    return g.generation.load(std::memory_order_relaxed) != gen;
  };
  world_->mu_.Await(absl::Condition(&done));
}

void InProcessGroup::data_phase(const CollectiveCall& call) {
  const GroupState& g = *g_;
  const int n = g.n;
  if (call.kind == CollectiveKind::barrier || call.kind == CollectiveKind::send ||
      call.kind == CollectiveKind::recv) {
    return;
  }
  const DType dtype = call.input.dtype();
  const std::size_t es = dtype_size(dtype);
  switch (call.kind) {
    case CollectiveKind::barrier:
    case CollectiveKind::send:
    case CollectiveKind::recv: return;
    case CollectiveKind::broadcast: {
      // Rank r copies slice r of the root's buffer into every other rank's buffer.
      const std::int64_t N = call.input.numel();
      const std::int64_t b = N * me_ / n, e = N * (me_ + 1) / n;
      if (e == b) return;
      const char* src = g.desc[call.root].in + b * es;
      for (int s = 0; s < n; ++s) {
        if (s != call.root) copy_bytes(g.desc[s].in + b * es, src, static_cast<std::size_t>(e - b) * es);
      }
      return;
    }
    case CollectiveKind::all_reduce:
    case CollectiveKind::reduce: {
      const std::int64_t N = call.input.numel();
      const std::int64_t b = N * me_ / n, e = N * (me_ + 1) / n;
      if (e == b) return;
      srcs_.clear();
      dsts_.clear();
      for (int s = 0; s < n; ++s) srcs_.push_back(g.desc[s].in + b * es);
      if (call.kind == CollectiveKind::all_reduce) {
        for (int s = 0; s < n; ++s) dsts_.push_back(g.desc[s].in + b * es);
      } else {
        dsts_.push_back(g.desc[call.root].in + b * es);
      }
      reduce_into(dtype, call.op, srcs_, dsts_, e - b, scratch_);
      return;
    }
    case CollectiveKind::reduce_scatter: {
      const std::int64_t m = call.output.numel();
      if (m == 0) return;
      srcs_.clear();
      dsts_.clear();
      for (int s = 0; s < n; ++s) srcs_.push_back(g.desc[s].in + me_ * m * es);
      dsts_.push_back(g.desc[me_].out);
      reduce_into(dtype, call.op, srcs_, dsts_, m, scratch_);
      return;
    }
    case CollectiveKind::all_gather: {
      // Rank r pushes its input into slice r of every rank's output (it owns slice r everywhere, like
      // the reducing collectives: each rank reads its input once and writes n slices).
      const std::size_t bytes = call.input.nbytes();
      if (bytes == 0) return;
      const char* src = g.desc[me_].in;
      for (int s = 0; s < n; ++s) {
        char* dst = g.desc[s].out + me_ * bytes;
        if (dst != src) copy_bytes(dst, src, bytes);
      }
      return;
    }
  }
}

std::shared_ptr<Work> InProcessGroup::run(CollectiveCall call) {
  if (OnDevice(call.input) || OnDevice(call.output)) {
    if (call.input.defined() && call.output.defined() && call.input.device() != call.output.device()) {
      absl::Status st = absl::InvalidArgumentError(absl::StrCat(
          where(call), ": expected input and output on one device, found ", call.input.describe(), " and ",
          call.output.describe()));
      abort(st);
      return make_completed_work(st);
    }
    // Note [in-process CUDA tensors]: the bytes must be final before another thread copies them.
    detail::cuda_synchronize(OnDevice(call.input) ? call.input.device() : call.output.device());
  }
  if (call.kind == CollectiveKind::send || call.kind == CollectiveKind::recv) return run_p2p(std::move(call));
  {
    absl::MutexLock lock(&world_->mu_);
    ++g_->queued[me_];
  }
  if (g_->n == 1) return make_completed_work(execute(call));  // nothing to overlap
  auto work = std::make_shared<CompletionWork>();
  absl::MutexLock lock(&queue_mu_);
  if (!worker_.joinable()) worker_ = std::thread([this] { work_queue(); });
  queue_.push_back(Queued{std::move(call), work});
  return work;
}

absl::Status InProcessGroup::execute_on_host(const CollectiveCall& call) {
  const HostMirror mirror(call.input, call.output);
  CollectiveCall host = call;
  host.input = mirror.of(call.input);
  host.output = mirror.of(call.output);
  absl::Status st = execute(host);
  if (st.ok() && call.output.defined()) call.output.copy_(host.output);
  return st;
}

absl::Status InProcessGroup::execute(const CollectiveCall& call) {
  if (OnDevice(call.input) || OnDevice(call.output)) {
    // A CUDA error in a copy (a sticky error an earlier kernel left) fails the world: peers waiting in this call
    // hear of it instead of waiting for the deadline, and the worker thread survives.
    try {
      return execute_on_host(call);
    } catch (const std::exception& e) {
      absl::Status st = absl::InternalError(absl::StrCat(where(call), ": ", e.what()));
      abort(st);
      return st;
    }
  }
  CallDesc desc;
  desc.call = &call;
  if (call.input.defined()) desc.in = static_cast<char*>(call.input.raw_data());
  if (call.output.defined()) desc.out = static_cast<char*>(call.output.raw_data());
  if (absl::Status st = enter(call, desc); !st.ok()) return st;
  if (call.kind == CollectiveKind::barrier) return absl::OkStatus();
  data_phase(call);
  if (g_->n > 1) leave();  // Note [in-process leave]: no peer touches this rank's buffers after this
  return absl::OkStatus();
}

void InProcessGroup::work_queue() {
  for (;;) {
    Queued item;
    {
      absl::MutexLock lock(&queue_mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(queue_mu_) { return stopping_ || !queue_.empty(); };
      queue_mu_.Await(absl::Condition(&ready));
      if (queue_.empty()) return;  // stopping
      item = std::move(queue_.front());
      queue_.pop_front();
    }
    absl::Status st;
    {
      const CollectiveCall call = std::move(item.call);
      st = execute(call);
    }  // the call's tensors are released before its Work completes (Note [in-process progress engine])
    item.work->complete(std::move(st));
  }
}

InProcessGroup::~InProcessGroup() {
  std::deque<Queued> orphaned;
  {
    absl::MutexLock lock(&queue_mu_);
    stopping_ = true;
    orphaned.swap(queue_);
  }
  if (worker_.joinable()) worker_.join();
  if (orphaned.empty()) return;
  absl::Status st = absl::AbortedError(absl::StrCat(
      where(orphaned.front().call), ": the group handle was destroyed with ", orphaned.size(),
      orphaned.size() == 1 ? " call" : " calls", " queued and not started"));
  {
    absl::MutexLock lock(&world_->mu_);
    g_->queued[me_] -= static_cast<int>(orphaned.size());
    world_->fail_locked(st);
  }
  for (Queued& q : orphaned) q.work->complete(st);
}

std::shared_ptr<Work> InProcessGroup::run_p2p(CollectiveCall call) {
  const bool is_send = call.kind == CollectiveKind::send;
  const int src = is_send ? me_ : call.peer, dst = is_send ? call.peer : me_;
  const std::size_t idx = static_cast<std::size_t>(src) * g_->n + dst;
  const std::string what = where(call);
  auto world = world_;
  auto g = g_;
  auto work_holder = std::make_shared<std::weak_ptr<CompletionWork>>();
  const int peer = call.peer;
  const absl::Duration timeout = call.timeout;
  auto on_deadline = [world, g, idx, is_send, what, work_holder, peer, timeout]() -> absl::Status {
    absl::MutexLock lock(&world->mu_);
    auto& q = is_send ? g->sends[idx] : g->recvs[idx];
    auto self = work_holder->lock();
    for (auto it = q.begin(); it != q.end(); ++it) {
      if (it->work == self) {
        q.erase(it);
        absl::Status st = absl::DeadlineExceededError(absl::StrCat(what, ": ", g->rank_str(peer),
                                                                   " did not post the matching ",
                                                                   is_send ? "recv" : "send", " within ",
                                                                   absl::FormatDuration(timeout)));
        world->fail_locked(st);
        return st;
      }
    }
    return absl::OkStatus();  // already matched (or failed): complete() ignores this
  };
  auto work = std::make_shared<CompletionWork>(call.deadline, on_deadline);
  *work_holder = work;

  absl::MutexLock lock(&world_->mu_);
  if (world_->failed_.load(std::memory_order_relaxed)) {
    work->complete(aborted_locked(call));
    return work;
  }
  auto& other = is_send ? g_->recvs[idx] : g_->sends[idx];
  if (other.empty()) {
    if (world_->departed_[g_->global[call.peer]]) {
      absl::Status st = absl::AbortedError(absl::StrCat(what, ": ", g_->rank_str(call.peer),
                                                        " returned from its function without a matching ",
                                                        is_send ? "recv" : "send"));
      world_->fail_locked(st);
      work->complete(st);
      return work;
    }
    auto& mine = is_send ? g_->sends[idx] : g_->recvs[idx];
    mine.push_back(P2PEntry{call.input, work, what, call.fingerprint});
    return work;
  }
  P2PEntry peer_entry = std::move(other.front());
  other.pop_front();
  const Tensor& send_t = is_send ? call.input : peer_entry.tensor;
  const Tensor& recv_t = is_send ? peer_entry.tensor : call.input;
  const std::uint32_t send_fp = is_send ? call.fingerprint : peer_entry.fingerprint;
  const std::uint32_t recv_fp = is_send ? peer_entry.fingerprint : call.fingerprint;
  if (send_t.dtype() != recv_t.dtype() || send_t.numel() != recv_t.numel() || send_fp != recv_fp) {
    const auto with_fp = [](const Tensor& t, std::uint32_t fp) {
      return fp == 0 ? t.describe() : absl::StrCat(t.describe(), " (fingerprint ", fingerprint_str(fp), ")");
    };
    absl::Status st = absl::InvalidArgumentError(
        absl::StrCat("send from ", g_->rank_str(src), " to ", g_->rank_str(dst), " on group '", g_->name,
                     "': expected the recv to match ", with_fp(send_t, send_fp), ", found ",
                     with_fp(recv_t, recv_fp)));
    world_->fail_locked(st);
    peer_entry.work->complete(st);
    work->complete(st);
    return work;
  }
  // Copy under the lock (Note [in-process p2p]); device memory device to device (Note [in-process CUDA tensors]).
  if (OnDevice(send_t) || OnDevice(recv_t)) {
    try {
      recv_t.copy_(send_t);
    } catch (const std::exception& e) {
      absl::Status st = absl::InternalError(absl::StrCat("send from ", g_->rank_str(src), " to ", g_->rank_str(dst),
                                                         " on group '", g_->name, "': ", e.what()));
      world_->fail_locked(st);
      peer_entry.work->complete(st);
      work->complete(st);
      return work;
    }
  } else {
    copy_bytes(recv_t.raw_data(), send_t.raw_data(), send_t.nbytes());
  }
  peer_entry.work->complete(absl::OkStatus());
  work->complete(absl::OkStatus());
  return work;
}

absl::StatusOr<std::shared_ptr<ProcessGroup>> InProcessGroup::make_subgroup(std::vector<int> members,
                                                                            const std::string& key,
                                                                            const std::string& name,
                                                                            absl::Duration default_timeout,
                                                                            absl::Time deadline) {
  std::vector<int> global;
  int my_index = -1;
  for (std::size_t i = 0; i < members.size(); ++i) {
    global.push_back(g_->global[members[i]]);
    if (members[i] == me_) my_index = static_cast<int>(i);
  }
  SK_CHECK_GE(my_index, 0) << "make_subgroup on a non-member";
  std::shared_ptr<GroupState> gs;
  {
    absl::MutexLock lock(&world_->mu_);
    if (world_->failed_.load(std::memory_order_relaxed)) {
      return absl::AbortedError(absl::StrCat("creating sub-group '", name, "' of group '", g_->name,
                                             "': aborted because: ", world_->failure_.message()));
    }
    const std::string full_key = absl::StrCat(g_->id, "/", key);
    auto it = world_->subgroups_.find(full_key);
    if (it == world_->subgroups_.end()) {
      gs = world_->new_group_locked(name, global);
      world_->subgroups_.emplace(full_key, gs);
    } else {
      gs = it->second;
    }
  }
  return std::shared_ptr<ProcessGroup>(std::make_shared<InProcessGroup>(world_, gs, my_index, default_timeout));
}

}  // namespace

// ---- InProcessWorld ----------------------------------------------------------------------------

std::shared_ptr<InProcessWorld> InProcessWorld::create(int size, const InProcessOptions& options) {
  SK_CHECK_GT(size, 0);
  return std::shared_ptr<InProcessWorld>(new InProcessWorld(std::make_shared<InProcessWorldState>(size, options)));
}

InProcessWorld::InProcessWorld(std::shared_ptr<InProcessWorldState> state) : state_(std::move(state)) {}
InProcessWorld::~InProcessWorld() = default;

int InProcessWorld::size() const { return state_->size_; }

std::shared_ptr<ProcessGroup> InProcessWorld::group(int rank) {
  SK_CHECK(rank >= 0 && rank < state_->size_) << "rank " << rank << " of " << state_->size_;
  {
    absl::MutexLock lock(&state_->mu_);
    SK_CHECK(!state_->handed_[rank]) << "InProcessWorld::group(" << rank << ") called twice";
    state_->handed_[rank] = true;
  }
  return std::make_shared<InProcessGroup>(state_, state_->world_, rank, state_->options_.default_timeout);
}

void InProcessWorld::abort(const absl::Status& reason) {
  absl::MutexLock lock(&state_->mu_);
  state_->fail_locked(reason);
}

void InProcessWorld::mark_departed(int rank) {
  absl::MutexLock lock(&state_->mu_);
  state_->departed_[rank] = true;
  // Pending p2p calls waiting for this rank can never be matched.
  for (auto& g : state_->groups_) {
    for (int r = 0; r < g->n; ++r) {
      if (g->global[r] != rank) continue;
      for (int other = 0; other < g->n; ++other) {
        if (other == r) continue;
        const std::size_t to_r = static_cast<std::size_t>(other) * g->n + r;    // sends waiting for r's recv
        const std::size_t from_r = static_cast<std::size_t>(r) * g->n + other;  // recvs waiting for r's send
        const P2PEntry* e = !g->sends[to_r].empty() ? &g->sends[to_r].front()
                            : !g->recvs[from_r].empty() ? &g->recvs[from_r].front()
                                                       : nullptr;
        if (e != nullptr) {
          state_->fail_locked(absl::AbortedError(
              absl::StrCat(e->what, ": ", g->rank_str(r), " returned from its function without matching it")));
          return;
        }
      }
    }
  }
}

absl::Status InProcessWorld::status() const {
  absl::MutexLock lock(&state_->mu_);
  return state_->failure_;
}

}  // namespace shardkit::comm
