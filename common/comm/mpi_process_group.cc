// The MPI backend (mpi_process_group.h). Compiled into shardkit::comm_mpi when CMake finds MPI.
#include "common/comm/mpi_process_group.h"

// MPI's C API only (Open MPI's mpi.h otherwise pulls in its deprecated C++ bindings, which need libmpi_cxx).
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>

#include <array>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <future>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "common/base/logging.h"
#include "common/comm/completion_work.h"
#include "common/comm/reduce_kernels.h"

// Note [mpi progress engine]
// MPI's state belongs to the process, and Open MPI makes progress only inside MPI calls. So one thread per
// process (the engine) makes every MPI call, from MPI_Init_thread(MPI_THREAD_FUNNELED) to MPI_Finalize. Groups
// hand it their calls through a queue per group (a mutex and a condition variable; calls return at once). The
// engine runs a group's calls one at a time in issue order, each as a nonblocking MPI operation, and polls the
// current operation of every group with MPI_Test, so a slow group never holds up another and the order of calls
// across groups does not matter (a rank may issue group A's call before group B's while its peer does the
// opposite, as with the other backends). While operations are in flight it polls without sleeping for
// MpiOptions::spin after the last progress, then sleeps 50 us between polls; when idle it waits on the condition
// variable, waking every 2 ms to look for abort notices.
//
// Each group has two communicators: `data` for its calls and `notices` for abort notices (one posted
// MPI_Irecv from any rank). A failure (deadline, abort(), an MPI error, a destroyed handle with calls pending)
// is recorded under the engine's mutex by whichever thread finds it; the engine then fails the queued calls,
// sends the notice to every peer, and moves the started operation, with its tensors, to `orphans_`, polled until
// MPI completes it (MPI cannot cancel a collective).
//
// Note [mpi reductions]
// MPI's reductions combine values in an order of the implementation's choosing, and Open MPI's differs with the
// message size and the rank count. The reducing calls here do not use them: each rank receives every rank's copy
// of the segment it owns (MPI_Ialltoall / MPI_Ialltoallv: (n-1)/n of the tensor sent and received per rank, what
// a ring reduce-scatter moves), reduces those copies in rank order with reduce_into (reduce_kernels.h: f32
// accumulation, bf16 / f16 rounded once), and for all_reduce and reduce sends the reduced segments back out
// (MPI_Iallgatherv / MPI_Igatherv). The arithmetic is the in-process backend's, so results are bit-identical to
// it on every rank, at any size, for every op and dtype.
//
// Note [one engine per process]
// The registry below (a weak reference to the live engine) is shardkit's one process-wide variable. It mirrors
// MPI's own process-wide state: two engines would call MPI from two threads, which MPI_THREAD_FUNNELED forbids.
// Simulated ranks (threads) never use this backend.

namespace shardkit::comm {
namespace {

constexpr int kNoticeTag = 7;
constexpr int kP2PTag = 1;
constexpr int kNoticeBytes = 1024;

// The description of a collective that the ranks exchange before it (MpiOptions::verify_calls).
struct CallDesc {
  std::uint8_t kind = 0;
  std::uint8_t dtype = 0;
  std::uint8_t op = 0;
  std::uint8_t pad = 0;
  std::int32_t root = 0;
  std::int64_t seq = 0;
  std::int64_t numel = 0;  // per rank
  double factor = 0;
  std::uint32_t fingerprint = 0;  // the options' (THE CONTRACT in process_group.h)
  std::uint32_t pad2 = 0;
};
static_assert(sizeof(CallDesc) == 40);

bool same_call(const CallDesc& a, const CallDesc& b) { return std::memcmp(&a, &b, sizeof(CallDesc)) == 0; }

bool reduces(CollectiveKind k) {
  return k == CollectiveKind::all_reduce || k == CollectiveKind::reduce || k == CollectiveKind::reduce_scatter;
}

// Elements each rank contributes to the call (MPI's count).
std::int64_t per_rank_numel(const CollectiveCall& c) {
  switch (c.kind) {
    case CollectiveKind::all_gather: return c.input.numel();
    case CollectiveKind::reduce_scatter: return c.output.numel();
    case CollectiveKind::barrier: return 0;
    default: return c.input.numel();
  }
}

CallDesc describe_call(const CollectiveCall& c) {
  CallDesc d;
  d.kind = static_cast<std::uint8_t>(c.kind);
  d.dtype = c.kind == CollectiveKind::barrier ? 0 : static_cast<std::uint8_t>(c.input.dtype());
  d.op = reduces(c.kind) ? static_cast<std::uint8_t>(c.op.kind) : 0;
  d.root = c.kind == CollectiveKind::broadcast || c.kind == CollectiveKind::reduce ? c.root : 0;
  d.seq = c.seq;
  d.numel = per_rank_numel(c);
  d.factor = reduces(c.kind) && c.op.kind == ReduceKind::premul_sum ? c.op.factor : 0;
  d.fingerprint = c.fingerprint;
  return d;
}

std::string describe_desc(const CallDesc& d) {
  const auto kind = static_cast<CollectiveKind>(d.kind);
  std::string s = absl::StrCat(std::string(collective_kind_name(kind)), " #", d.seq);
  if (kind == CollectiveKind::barrier) {
    return d.fingerprint == 0 ? s : absl::StrCat(s, " (fingerprint ", fingerprint_str(d.fingerprint), ")");
  }
  absl::StrAppend(&s, " (", std::string(dtype_name(static_cast<DType>(d.dtype))), "[", d.numel, "] per rank");
  if (reduces(kind)) {
    absl::StrAppend(&s, ", ", std::string(reduce_kind_name(static_cast<ReduceKind>(d.op))));
    if (static_cast<ReduceKind>(d.op) == ReduceKind::premul_sum) absl::StrAppend(&s, "(", d.factor, ")");
  }
  if (kind == CollectiveKind::broadcast || kind == CollectiveKind::reduce) absl::StrAppend(&s, ", root ", d.root);
  if (d.fingerprint != 0) absl::StrAppend(&s, ", fingerprint ", fingerprint_str(d.fingerprint));
  return absl::StrCat(s, ")");
}

std::string mpi_message(int code) {
  char buf[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, buf, &len) != MPI_SUCCESS) return absl::StrCat("MPI error code ", code);
  return std::string(buf, static_cast<std::size_t>(len));
}

// Segment q of an all_reduce / reduce of `count` elements over n ranks: [q·seg, min(count, (q+1)·seg)), seg =
// ceil(count / n) (trailing segments may be empty).
struct Segments {
  std::vector<int> counts, displs;  // per rank, in elements
};
Segments segments_of(std::int64_t count, int n) {
  const std::int64_t seg = (count + n - 1) / n;
  Segments s;
  for (int q = 0; q < n; ++q) {
    const std::int64_t lo = std::min(count, q * seg), hi = std::min(count, (q + 1) * seg);
    s.counts.push_back(static_cast<int>(hi - lo));
    s.displs.push_back(static_cast<int>(lo));
  }
  return s;
}

// FNV-1a of a sub-group key: the same tag on every member (std::hash and absl::Hash are not guaranteed to be).
int tag_for(const std::string& key) {
  std::uint32_t h = 2166136261u;
  for (unsigned char c : key) h = (h ^ c) * 16777619u;
  return static_cast<int>(h % 30000u) + 100;
}

struct Pending {
  CollectiveCall call;
  std::shared_ptr<CompletionWork> work;
};

// A started call (engine thread only). A call runs as up to three MPI operations, one after the other (Note
// [mpi reductions]): the call description exchange, then the data movement, then for all_reduce / reduce the
// redistribution of the reduced segments.
struct Running {
  Pending p;
  enum class Phase { verify, exchange, redistribute } phase = Phase::exchange;
  MPI_Request req = MPI_REQUEST_NULL;
  CallDesc mine;
  std::vector<CallDesc> all;
  Tensor gathered;  // reducing calls: every rank's copy of this rank's segment, rank after rank
  Segments seg;     // all_reduce / reduce
};

}  // namespace

// One group's state, shared by its handle and the engine.
struct MpiGroupState {
  int rank = 0;
  int size = 1;
  std::string name;
  std::vector<int> global_ranks;
  MpiOptions options;
  MPI_Comm data = MPI_COMM_NULL;
  MPI_Comm notices = MPI_COMM_NULL;

  // Guarded by MpiEngine::mu_.
  std::deque<Pending> queue;
  absl::Status failure;       // the first failure; OK while the group is usable
  bool notify_peers = false;  // `failure` is still to be sent to the other ranks
  bool retired = false;       // the handle is gone

  // Engine thread only.
  std::optional<Running> running;
  MPI_Request notice_recv = MPI_REQUEST_NULL;
  std::array<char, kNoticeBytes> notice_in{};
  std::string notice_out;
  std::vector<MPI_Request> notice_sends;

  std::string rank_str(int r) const {
    if (global_ranks.empty() || global_ranks[static_cast<std::size_t>(r)] == r) return absl::StrCat("rank ", r);
    return absl::StrCat("rank ", r, " (global rank ", global_ranks[static_cast<std::size_t>(r)], ")");
  }
  std::string where(const CollectiveCall& c) const {
    return absl::StrCat(c.describe(), " on group '", name, "' (mpi, ", rank_str(rank), ")");
  }
  // The status a call fails with once the group failed with `failure` (as it is when it is about this call).
  absl::Status call_failure(const CollectiveCall& c, const absl::Status& failure) const {
    return failure_naming(where(c), failure);
  }
  // `failure` as the error of the call described by `what` (where(call)): prefixed with it unless it is already
  // about that call, so every failed call names itself first, whichever failure of the group it reports.
  static absl::Status failure_naming(const std::string& what, const absl::Status& failure) {
    if (absl::StartsWith(failure.message(), what)) return failure;
    return absl::Status(failure.code(), absl::StrCat(what, ": ", failure.message()));
  }
};

class MpiEngine {
 public:
  static absl::StatusOr<std::shared_ptr<MpiEngine>> acquire();
  ~MpiEngine();

  // Runs `fn` on the engine thread and returns its status (blocks the caller).
  absl::Status call_on_thread(std::function<absl::Status()> fn);
  void submit(MpiGroupState& g, Pending p);
  // Records the group's failure (the first wins) and returns the group's failure. Any thread.
  absl::Status fail(MpiGroupState& g, absl::Status status, bool notify_peers);
  void record(MpiGroupState& g, absl::Status status, bool notify_peers) { (void)fail(g, std::move(status), notify_peers); }
  void retire(MpiGroupState& g);
  // Engine thread only (inside call_on_thread): sets the group's communicators up and starts serving it.
  absl::Status adopt(const std::shared_ptr<MpiGroupState>& g, MPI_Comm parent, const MPI_Group* members, int tag);

 private:
  MpiEngine() = default;
  void loop(std::promise<absl::Status>& started);
  absl::Status init_mpi();
  void shutdown_mpi();
  bool progress(MpiGroupState& g);
  bool progress_orphans();
  void start(MpiGroupState& g, Pending p);
  void start_operation(MpiGroupState& g, Running& r);
  void start_redistribution(MpiGroupState& g, Running& r);
  void finish(MpiGroupState& g, Running& r, const MPI_Status& st);
  void send_notices(MpiGroupState& g, const absl::Status& failure);
  void release(MpiGroupState& g);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;  // guarded by mu_
  bool kick_ = false;                        // guarded by mu_: a submission or failure since the last pass
  bool stop_ = false;                        // guarded by mu_
  bool any_failure_ = false;                 // guarded by mu_

  // Engine thread only.
  std::vector<std::shared_ptr<MpiGroupState>> groups_;
  std::vector<Running> orphans_;
  bool owns_mpi_ = false;
  ReduceScratch reduce_scratch_{64 << 10};
  std::thread thread_;
};

namespace {

struct Registry {
  std::mutex mu;
  std::weak_ptr<MpiEngine> engine;
};
Registry& registry() {
  static Registry r;  // Note [one engine per process]
  return r;
}

}  // namespace

absl::StatusOr<std::shared_ptr<MpiEngine>> MpiEngine::acquire() {
  Registry& reg = registry();
  std::shared_ptr<MpiEngine> e;
  absl::Status s;
  {
    std::lock_guard l(reg.mu);
    if (auto live = reg.engine.lock()) return live;
    e.reset(new MpiEngine());
    std::promise<absl::Status> started;
    std::future<absl::Status> ready = started.get_future();
    e->thread_ = std::thread([raw = e.get(), &started] { raw->loop(started); });
    s = ready.get();
    if (s.ok()) {
      reg.engine = e;
      return e;
    }
    e->thread_.join();
  }
  return s;  // `e` is destroyed here, after the registry's lock is released (its destructor takes it)
}

MpiEngine::~MpiEngine() {
  // Under the registry's lock, so that a new engine is not created while this one is still finalizing MPI.
  std::lock_guard reg(registry().mu);
  {
    std::lock_guard l(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

absl::Status MpiEngine::init_mpi() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) {
    return absl::FailedPreconditionError(
        "create_mpi_world: MPI was already finalized in this process (shardkit finalizes it when the last MPI group "
        "is destroyed, and MPI cannot be initialised twice): keep the world group for the life of the program");
  }
  int provided = 0;
  if (!initialized) {
    if (int rc = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided); rc != MPI_SUCCESS) {
      return absl::InternalError(absl::StrCat("create_mpi_world: MPI_Init_thread failed: ", mpi_message(rc)));
    }
    owns_mpi_ = true;
  } else {
    MPI_Query_thread(&provided);
    if (provided < MPI_THREAD_MULTIPLE) {
      return absl::FailedPreconditionError(absl::StrCat(
          "create_mpi_world: the program initialised MPI with thread level ", provided,
          "; shardkit calls MPI from its communication thread and needs MPI_THREAD_MULTIPLE (",
          static_cast<int>(MPI_THREAD_MULTIPLE), "), or leave MPI's initialisation to shardkit"));
    }
  }
  return absl::OkStatus();
}

void MpiEngine::shutdown_mpi() {
  bool failed;
  {
    std::lock_guard l(mu_);
    failed = any_failure_;
  }
  if (!orphans_.empty() || failed) {
    SK_LOG(kWarning, "mpi: not calling MPI_Finalize: a group failed",
           orphans_.empty() ? "" : " with MPI operations still in flight",
           "; the process should exit (Note [mpi failure] in mpi_process_group.h)");
    return;
  }
  if (owns_mpi_) MPI_Finalize();
}

MPI_Datatype mpi_type(DType dt) {
  switch (dt) {
    case DType::f32: return MPI_FLOAT;
    case DType::i64: return MPI_INT64_T;
    case DType::bf16:
    case DType::f16: return MPI_UINT16_T;
  }
  return MPI_BYTE;
}

absl::Status MpiEngine::call_on_thread(std::function<absl::Status()> fn) {
  std::promise<absl::Status> done;
  std::future<absl::Status> result = done.get_future();
  {
    std::lock_guard l(mu_);
    tasks_.push_back([&] { done.set_value(fn()); });
  }
  cv_.notify_one();
  return result.get();
}

void MpiEngine::submit(MpiGroupState& g, Pending p) {
  {
    std::lock_guard l(mu_);
    if (!g.failure.ok()) {
      p.work->complete(g.call_failure(p.call, g.failure));
      return;
    }
    g.queue.push_back(std::move(p));
    kick_ = true;
  }
  cv_.notify_one();
}

absl::Status MpiEngine::fail(MpiGroupState& g, absl::Status status, bool notify_peers) {
  absl::Status first;
  {
    std::lock_guard l(mu_);
    if (!g.failure.ok()) return g.failure;
    g.failure = std::move(status);
    g.notify_peers = notify_peers && g.size > 1;
    any_failure_ = true;
    kick_ = true;
    first = g.failure;
  }
  cv_.notify_one();
  return first;
}

void MpiEngine::retire(MpiGroupState& g) {
  {
    std::lock_guard l(mu_);
    g.retired = true;
    kick_ = true;
  }
  cv_.notify_one();
}

absl::Status MpiEngine::adopt(const std::shared_ptr<MpiGroupState>& g, MPI_Comm parent, const MPI_Group* members,
                              int tag) {
  for (MPI_Comm* c : {&g->data, &g->notices}) {
    const int rc = members == nullptr ? MPI_Comm_dup(parent, c) : MPI_Comm_create_group(parent, *members, tag, c);
    if (rc != MPI_SUCCESS) {
      return absl::InternalError(absl::StrCat("mpi group '", g->name, "': creating its communicator failed: ",
                                              mpi_message(rc)));
    }
    MPI_Comm_set_errhandler(*c, MPI_ERRORS_RETURN);
  }
  MPI_Comm_rank(g->data, &g->rank);
  MPI_Comm_size(g->data, &g->size);
  MPI_Irecv(g->notice_in.data(), kNoticeBytes, MPI_CHAR, MPI_ANY_SOURCE, kNoticeTag, g->notices, &g->notice_recv);
  groups_.push_back(g);
  return absl::OkStatus();
}

void MpiEngine::loop(std::promise<absl::Status>& started) {
  if (absl::Status s = init_mpi(); !s.ok()) {
    started.set_value(s);
    return;
  }
  started.set_value(absl::OkStatus());
  absl::Time last_progress = absl::Now();
  bool busy = false;
  for (;;) {
    std::deque<std::function<void()>> tasks;
    bool stop = false;
    {
      std::unique_lock l(mu_);
      if (!busy && tasks_.empty() && !kick_ && !stop_) {
        cv_.wait_for(l, std::chrono::milliseconds(2), [&] { return !tasks_.empty() || kick_ || stop_; });
      }
      tasks.swap(tasks_);
      stop = stop_;
      kick_ = false;
    }
    // Progress before the tasks: a failure recorded before a task was queued (abort(), then creating a group)
    // has sent its notices before the task's blocking MPI call starts.
    bool progressed = false;
    for (auto& g : groups_) progressed |= progress(*g);
    progressed |= progress_orphans();
    for (auto& t : tasks) t();
    // Release retired groups once nothing of theirs is in flight.
    busy = !orphans_.empty();
    for (auto it = groups_.begin(); it != groups_.end();) {
      bool retired, queued;
      {
        std::lock_guard l(mu_);
        retired = (*it)->retired;
        queued = !(*it)->queue.empty();
      }
      if (retired && !queued && !(*it)->running) {
        release(**it);
        it = groups_.erase(it);
        continue;
      }
      busy |= queued || (*it)->running.has_value();
      ++it;
    }
    if (stop && groups_.empty()) break;
    const absl::Time now = absl::Now();
    if (progressed) {
      last_progress = now;
    } else if (busy) {
      if (now - last_progress > (groups_.empty() ? absl::ZeroDuration() : groups_.front()->options.spin)) {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      } else {
        std::this_thread::yield();
      }
    }
  }
  // Orphans may still complete: give MPI a last chance before deciding about MPI_Finalize.
  progress_orphans();
  shutdown_mpi();
}

void MpiEngine::send_notices(MpiGroupState& g, const absl::Status& failure) {
  g.notice_out = std::string(failure.message().substr(0, kNoticeBytes));
  for (int r = 0; r < g.size; ++r) {
    if (r == g.rank) continue;
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Isend(g.notice_out.data(), static_cast<int>(g.notice_out.size()), MPI_CHAR, r, kNoticeTag, g.notices,
                  &req) == MPI_SUCCESS) {
      g.notice_sends.push_back(req);
    }
  }
}

bool MpiEngine::progress(MpiGroupState& g) {
  bool progressed = false;
  // An abort notice from a peer.
  if (g.notice_recv != MPI_REQUEST_NULL) {
    int flag = 0;
    MPI_Status st;
    if (MPI_Test(&g.notice_recv, &flag, &st) == MPI_SUCCESS && flag) {
      int len = 0;
      MPI_Get_count(&st, MPI_CHAR, &len);
      record(g,
           absl::AbortedError(absl::StrCat("group '", g.name, "' aborted by ", g.rank_str(st.MPI_SOURCE), ": ",
                                           std::string(g.notice_in.data(), static_cast<std::size_t>(len)))),
           /*notify_peers=*/false);
      progressed = true;
    }
  }
  // Sent notices that MPI has finished with.
  for (auto it = g.notice_sends.begin(); it != g.notice_sends.end();) {
    int flag = 0;
    MPI_Test(&*it, &flag, MPI_STATUS_IGNORE);
    it = flag ? g.notice_sends.erase(it) : it + 1;
  }
  absl::Status failure;
  bool notify = false;
  std::deque<Pending> drained;
  {
    std::lock_guard l(mu_);
    if (!g.failure.ok() || g.retired) {
      if (g.failure.ok()) {
        // A destroyed handle fails what it left behind (and tells the peers when a call was under way).
        const bool pending = !g.queue.empty() || g.running.has_value();
        g.failure = absl::AbortedError(absl::StrCat("group '", g.name, "' was destroyed on ", g.rank_str(g.rank),
                                                    pending ? " with calls pending" : ""));
        g.notify_peers = pending && g.size > 1;
        if (pending) any_failure_ = true;
      }
      failure = g.failure;
      notify = g.notify_peers;
      g.notify_peers = false;
      drained.swap(g.queue);
    }
  }
  if (!failure.ok()) {
    for (Pending& p : drained) p.work->complete(g.call_failure(p.call, failure));
    if (g.running) {
      g.running->p.work->complete(g.call_failure(g.running->p.call, failure));
      orphans_.push_back(std::move(*g.running));
      g.running.reset();
    }
    if (notify) send_notices(g, failure);
    return progressed || !drained.empty() || notify;
  }
  // The call under way.
  if (g.running) {
    Running& r = *g.running;
    int flag = 0;
    MPI_Status st;
    if (int rc = MPI_Test(&r.req, &flag, &st); rc != MPI_SUCCESS) {
      record(g, absl::InternalError(absl::StrCat(g.where(r.p.call), ": MPI failed: ", mpi_message(rc))), true);
      return true;
    }
    if (!flag) {
      if (absl::Now() > r.p.call.deadline) {
        record(g,
             absl::DeadlineExceededError(absl::StrCat(
                 g.where(r.p.call), ": not complete after its timeout of ", absl::FormatDuration(r.p.call.timeout),
                 " (MPI cannot tell which ranks did not join)")),
             true);
        return true;
      }
      return progressed;
    }
    progressed = true;
    switch (r.phase) {
      case Running::Phase::verify:
        for (int i = 1; i < g.size; ++i) {
          if (!same_call(r.all[0], r.all[static_cast<std::size_t>(i)])) {
            // Every rank sees the same descriptions, so every rank fails with this message.
            record(g,
                   absl::InvalidArgumentError(absl::StrCat(
                       g.where(r.p.call), ": ranks disagree: ", g.rank_str(0), " issued ", describe_desc(r.all[0]),
                       ", ", g.rank_str(i), " issued ", describe_desc(r.all[static_cast<std::size_t>(i)]))),
                   /*notify_peers=*/false);
            return true;
          }
        }
        start_operation(g, r);
        break;
      case Running::Phase::exchange:
        if (r.p.call.kind == CollectiveKind::all_reduce || r.p.call.kind == CollectiveKind::reduce) {
          start_redistribution(g, r);
          break;
        }
        [[fallthrough]];
      case Running::Phase::redistribute:
        finish(g, r, st);
        g.running.reset();
        break;
    }
  }
  // The next call.
  while (!g.running) {
    Pending p;
    {
      std::lock_guard l(mu_);
      if (g.queue.empty() || !g.failure.ok()) break;
      p = std::move(g.queue.front());
      g.queue.pop_front();
    }
    start(g, std::move(p));
    progressed = true;
  }
  return progressed;
}

bool MpiEngine::progress_orphans() {
  bool progressed = false;
  for (auto it = orphans_.begin(); it != orphans_.end();) {
    int flag = 0;
    if (it->req == MPI_REQUEST_NULL || MPI_Test(&it->req, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) {
      it = orphans_.erase(it);
      progressed = true;
    } else {
      ++it;
    }
  }
  return progressed;
}

void MpiEngine::start(MpiGroupState& g, Pending p) {
  g.running.emplace();
  Running& r = *g.running;
  r.p = std::move(p);
  const bool p2p = r.p.call.kind == CollectiveKind::send || r.p.call.kind == CollectiveKind::recv;
  if (g.options.verify_calls && !p2p && g.size > 1) {
    r.phase = Running::Phase::verify;
    r.mine = describe_call(r.p.call);
    r.all.resize(static_cast<std::size_t>(g.size));
    if (int rc = MPI_Iallgather(&r.mine, sizeof(CallDesc), MPI_BYTE, r.all.data(), sizeof(CallDesc), MPI_BYTE,
                                g.data, &r.req);
        rc != MPI_SUCCESS) {
      r.req = MPI_REQUEST_NULL;
      record(g, absl::InternalError(absl::StrCat(g.where(r.p.call), ": MPI failed: ", mpi_message(rc))), true);
    }
    return;
  }
  start_operation(g, r);
}

// This rank's copy of each rank's segment, reduced in rank order into `dst` (Note [mpi reductions]).
void reduce_gathered(const Running& r, int n, std::int64_t count, void* dst, ReduceScratch& scratch) {
  const CollectiveCall& c = r.p.call;
  const auto* base = static_cast<const char*>(r.gathered.raw_data());
  const std::size_t stride = static_cast<std::size_t>(count) * c.input.element_size();
  std::vector<const void*> srcs;
  for (int q = 0; q < n; ++q) srcs.push_back(base + static_cast<std::size_t>(q) * stride);
  void* const dsts[] = {dst};
  reduce_into(c.input.dtype(), c.op, srcs, dsts, count, scratch);
}

void MpiEngine::start_operation(MpiGroupState& g, Running& r) {
  r.phase = Running::Phase::exchange;
  const CollectiveCall& c = r.p.call;
  const MPI_Datatype type = c.kind == CollectiveKind::barrier ? MPI_BYTE : mpi_type(c.input.dtype());
  const int count = static_cast<int>(per_rank_numel(c));  // bounded by MpiProcessGroup::run
  const TensorOptions same_dtype =
      TensorOptions{}.with_dtype(c.kind == CollectiveKind::barrier ? DType::f32 : c.input.dtype());
  int rc = MPI_SUCCESS;
  switch (c.kind) {
    case CollectiveKind::broadcast:
      rc = MPI_Ibcast(c.input.raw_data(), count, type, c.root, g.data, &r.req);
      break;
    case CollectiveKind::all_reduce:
    case CollectiveKind::reduce: {
      // Every rank's copy of this rank's segment: send segment q to rank q.
      r.seg = segments_of(count, g.size);
      const int mine = r.seg.counts[static_cast<std::size_t>(g.rank)];
      r.gathered = Tensor::empty({std::int64_t{mine} * g.size}, same_dtype);
      std::vector<int> recv_counts(static_cast<std::size_t>(g.size), mine), recv_displs;
      for (int q = 0; q < g.size; ++q) recv_displs.push_back(q * mine);
      rc = MPI_Ialltoallv(c.input.raw_data(), r.seg.counts.data(), r.seg.displs.data(), type, r.gathered.raw_data(),
                          recv_counts.data(), recv_displs.data(), type, g.data, &r.req);
      break;
    }
    case CollectiveKind::reduce_scatter:
      r.gathered = Tensor::empty({std::int64_t{count} * g.size}, same_dtype);
      rc = MPI_Ialltoall(c.input.raw_data(), count, type, r.gathered.raw_data(), count, type, g.data, &r.req);
      break;
    case CollectiveKind::all_gather: {
      const char* slot = static_cast<const char*>(c.output.raw_data()) +
                         static_cast<std::size_t>(g.rank) * static_cast<std::size_t>(count) * c.input.element_size();
      const void* send = c.input.raw_data() == slot && count > 0 ? MPI_IN_PLACE : c.input.raw_data();
      rc = MPI_Iallgather(send, count, type, c.output.raw_data(), count, type, g.data, &r.req);
      break;
    }
    case CollectiveKind::barrier:
      rc = MPI_Ibarrier(g.data, &r.req);
      break;
    case CollectiveKind::send:
      rc = MPI_Isend(c.input.raw_data(), count, type, c.peer, kP2PTag, g.data, &r.req);
      break;
    case CollectiveKind::recv:
      rc = MPI_Irecv(c.input.raw_data(), count, type, c.peer, kP2PTag, g.data, &r.req);
      break;
  }
  if (rc != MPI_SUCCESS) {
    r.req = MPI_REQUEST_NULL;
    record(g, absl::InternalError(absl::StrCat(g.where(c), ": MPI failed: ", mpi_message(rc))), true);
  }
}

void MpiEngine::start_redistribution(MpiGroupState& g, Running& r) {
  r.phase = Running::Phase::redistribute;
  const CollectiveCall& c = r.p.call;
  const MPI_Datatype type = mpi_type(c.input.dtype());
  const std::size_t me = static_cast<std::size_t>(g.rank);
  char* segment = static_cast<char*>(c.input.raw_data()) +
                  static_cast<std::size_t>(r.seg.displs[me]) * c.input.element_size();
  reduce_gathered(r, g.size, r.seg.counts[me], segment, reduce_scratch_);
  r.gathered = Tensor();
  int rc;
  if (c.kind == CollectiveKind::all_reduce) {
    rc = MPI_Iallgatherv(MPI_IN_PLACE, 0, type, c.input.raw_data(), r.seg.counts.data(), r.seg.displs.data(), type,
                         g.data, &r.req);
  } else if (g.rank == c.root) {
    rc = MPI_Igatherv(MPI_IN_PLACE, 0, type, c.input.raw_data(), r.seg.counts.data(), r.seg.displs.data(), type,
                      c.root, g.data, &r.req);
  } else {
    rc = MPI_Igatherv(segment, r.seg.counts[me], type, nullptr, nullptr, nullptr, type, c.root, g.data, &r.req);
  }
  if (rc != MPI_SUCCESS) {
    r.req = MPI_REQUEST_NULL;
    record(g, absl::InternalError(absl::StrCat(g.where(c), ": MPI failed: ", mpi_message(rc))), true);
  }
}

void MpiEngine::finish(MpiGroupState& g, Running& r, const MPI_Status& st) {
  const CollectiveCall& c = r.p.call;
  if (c.kind == CollectiveKind::recv) {
    int got = 0;
    MPI_Get_count(&st, mpi_type(c.input.dtype()), &got);
    if (got != c.input.numel()) {
      record(g,
             absl::InvalidArgumentError(absl::StrCat(g.where(c), ": expected ", c.input.numel(), " elements from ",
                                                     g.rank_str(c.peer), ", found ", got)),
             true);
      return;
    }
  }
  if (c.kind == CollectiveKind::reduce_scatter) {
    reduce_gathered(r, g.size, c.output.numel(), c.output.raw_data(), reduce_scratch_);
  }
  r.p.work->complete(absl::OkStatus());
}

void MpiEngine::release(MpiGroupState& g) {
  if (g.notice_recv != MPI_REQUEST_NULL) {
    MPI_Cancel(&g.notice_recv);
    MPI_Wait(&g.notice_recv, MPI_STATUS_IGNORE);
  }
  for (MPI_Request& req : g.notice_sends) MPI_Request_free(&req);
  g.notice_sends.clear();
  for (MPI_Comm* c : {&g.data, &g.notices}) {
    if (*c != MPI_COMM_NULL) MPI_Comm_free(c);
  }
}

namespace {

class MpiProcessGroup final : public ProcessGroup {
 public:
  MpiProcessGroup(std::shared_ptr<MpiEngine> engine, std::shared_ptr<MpiGroupState> state, absl::Duration timeout)
      : ProcessGroup(state->rank, state->size, state->name, state->global_ranks, timeout),
        engine_(std::move(engine)),
        state_(std::move(state)) {}
  ~MpiProcessGroup() override { engine_->retire(*state_); }

  std::string backend_name() const override { return "mpi"; }

  void abort(const absl::Status& reason) override {
    engine_->record(*state_,
                  absl::AbortedError(absl::StrCat(state_->rank_str(rank()), " aborted: ", reason.message())),
                  /*notify_peers=*/true);
  }

 protected:
  std::shared_ptr<Work> run(CollectiveCall call) override {
    if (call.kind != CollectiveKind::barrier) {
      for (const Tensor* t : {&call.input, &call.output}) {
        if (t->defined() && !t->device().is_cpu()) {
          return make_completed_work(absl::InvalidArgumentError(
              absl::StrCat(state_->where(call), ": the mpi backend expected CPU tensors, found ", t->device().str())));
        }
      }
      if (per_rank_numel(call) > std::numeric_limits<int>::max()) {
        return make_completed_work(absl::InvalidArgumentError(
            absl::StrCat(state_->where(call), ": the mpi backend expected at most ", std::numeric_limits<int>::max(),
                         " elements per rank (MPI's int counts), found ", per_rank_numel(call))));
      }
    }
    std::weak_ptr<MpiGroupState> weak_state = state_;
    std::weak_ptr<MpiEngine> weak_engine = engine_;
    const std::string what = state_->where(call);
    const absl::Duration timeout = call.timeout;
    auto work = std::make_shared<CompletionWork>(call.deadline, [weak_state, weak_engine, what, timeout]() -> absl::Status {
      auto s = weak_state.lock();
      auto engine = weak_engine.lock();
      if (!s || !engine) return absl::AbortedError(absl::StrCat(what, ": the group was destroyed"));
      // The group may have failed before this deadline (a peer's notice, an earlier call's deadline) without the
      // engine thread having failed this call yet (it is inside a blocking MPI call, or the process was stopped):
      // fail() then returns that first failure, which must still name this call.
      return MpiGroupState::failure_naming(
          what, engine->fail(*s,
                             absl::DeadlineExceededError(absl::StrCat(what, ": not complete after its timeout of ",
                                                                      absl::FormatDuration(timeout),
                                                                      " (MPI cannot tell which ranks did not join)")),
                             /*notify_peers=*/true));
    });
    engine_->submit(*state_, Pending{std::move(call), work});
    return work;
  }

  absl::StatusOr<std::shared_ptr<ProcessGroup>> make_subgroup(std::vector<int> members, const std::string& key,
                                                              const std::string& name, absl::Duration default_timeout,
                                                              absl::Time /*deadline: not enforced, see header*/) override {
    auto sub = std::make_shared<MpiGroupState>();
    sub->name = name;
    sub->options = state_->options;
    for (int m : members) sub->global_ranks.push_back(global_ranks()[static_cast<std::size_t>(m)]);
    absl::Status s = engine_->call_on_thread([&]() -> absl::Status {
      MPI_Group parent_group, group;
      MPI_Comm_group(state_->data, &parent_group);
      MPI_Group_incl(parent_group, static_cast<int>(members.size()), members.data(), &group);
      absl::Status st = engine_->adopt(sub, state_->data, &group, tag_for(key));
      MPI_Group_free(&group);
      MPI_Group_free(&parent_group);
      return st;
    });
    if (!s.ok()) return s;
    return std::shared_ptr<ProcessGroup>(std::make_shared<MpiProcessGroup>(engine_, sub, default_timeout));
  }

 private:
  std::shared_ptr<MpiEngine> engine_;  // destroyed after the state is retired (member order)
  std::shared_ptr<MpiGroupState> state_;
};

}  // namespace

bool mpi_backend_built() { return true; }

absl::StatusOr<std::shared_ptr<ProcessGroup>> create_mpi_world(const MpiOptions& options) {
  auto engine = MpiEngine::acquire();
  if (!engine.ok()) return engine.status();
  auto state = std::make_shared<MpiGroupState>();
  state->name = options.name;
  state->options = options;
  MpiEngine* e = engine->get();
  if (absl::Status s = e->call_on_thread([&] { return e->adopt(state, MPI_COMM_WORLD, nullptr, 0); }); !s.ok()) {
    return s;
  }
  for (int r = 0; r < state->size; ++r) state->global_ranks.push_back(r);
  return std::shared_ptr<ProcessGroup>(
      std::make_shared<MpiProcessGroup>(*std::move(engine), state, options.default_timeout));
}

}  // namespace shardkit::comm
