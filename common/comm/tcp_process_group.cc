#include "common/comm/tcp_process_group.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/base/check.h"
#include "common/comm/call_header.h"
#include "common/comm/ring_plan.h"
#include "common/comm/stream_runner.h"
#include "common/comm/tcp_reduce.h"
#include "common/comm/tcp_rendezvous.h"
#include "common/comm/shm_rendezvous.h"
#include "common/comm/tcp_transport.h"

namespace shardkit::comm {

struct TcpProcessGroup::Impl {
  // One chunk, for receive-then-reduce; charged to the creating rank's ledger as communication_buffer.
  Tensor scratch;
  std::vector<char> barrier;  // one byte per rank (contents unused)
};

TcpProcessGroup::TcpProcessGroup(std::shared_ptr<Store> store, int rank, int size, std::vector<int> global_ranks,
                                 TcpProcessGroupOptions options)
    : ProcessGroup(rank, size, options.name, std::move(global_ranks), options.default_timeout),
      store_(std::move(store)),
      options_(std::move(options)),
      peers_(static_cast<std::size_t>(size)),
      sends_to_(static_cast<std::size_t>(size), 0),
      recvs_from_(static_cast<std::size_t>(size), 0),
      impl_(std::make_unique<Impl>()) {}

absl::StatusOr<TcpProcessGroupOptions> resolve_tcp_group_options(TcpProcessGroupOptions options) {
  if (options.token.empty()) {
    if (const char* env = std::getenv("SHARDKIT_STORE_TOKEN"); env != nullptr) options.token = env;
  }
  if (options.transport.empty()) {
    if (const char* env = std::getenv("SHARDKIT_TRANSPORT"); env != nullptr) options.transport = env;
  }
  if (!options.shm_single_copy.has_value()) {
    if (const char* env = std::getenv("SHARDKIT_SHM_SINGLE_COPY"); env != nullptr && *env != '\0') {
      const std::string v = absl::AsciiStrToLower(env);
      if (v == "1" || v == "on" || v == "true") {
        options.shm_single_copy = true;
      } else if (v == "0" || v == "off" || v == "false") {
        options.shm_single_copy = false;
      } else {
        return absl::InvalidArgumentError(
            absl::StrCat("expected SHARDKIT_SHM_SINGLE_COPY to be 1, on, true, 0, off or false, found '", env, "'"));
      }
    } else {
      options.shm_single_copy = false;  // Note [shm single copy]: off unless asked for
    }
  }
  if (options.chunk_bytes == 0) return absl::InvalidArgumentError("expected chunk_bytes > 0, found 0");
  if (options.shm_ring_bytes < 16) {
    return absl::InvalidArgumentError(absl::StrCat("expected shm_ring_bytes >= 16, found ", options.shm_ring_bytes));
  }
  const absl::StatusOr<TransportChoice> choice =
      parse_transport_choice(options.transport, "the transport (TcpProcessGroupOptions::transport, else SHARDKIT_TRANSPORT)");
  if (!choice.ok()) return choice.status();
  return options;
}

absl::StatusOr<std::shared_ptr<TcpProcessGroup>> TcpProcessGroup::create(std::shared_ptr<Store> store, int rank,
                                                                         int size, TcpProcessGroupOptions options) {
  if (!store) return absl::InvalidArgumentError("TcpProcessGroup: expected a store, found null");
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("TcpProcessGroup: expected 0 <= rank < size, found rank ", rank, " and size ", size));
  }
  auto resolved = resolve_tcp_group_options(options);
  if (!resolved.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("TcpProcessGroup '", options.name, "' rank ", rank, " of ", size,
                                                   ": ", resolved.status().message()));
  }
  options = *std::move(resolved);
  std::vector<int> global(static_cast<std::size_t>(size));
  for (int i = 0; i < size; ++i) global[static_cast<std::size_t>(i)] = i;
  std::shared_ptr<TcpProcessGroup> pg(new TcpProcessGroup(std::move(store), rank, size, std::move(global), options));
  if (auto st = pg->connect_mesh(absl::Now() + options.connect_timeout); !st.ok()) return st;
  pg->thread_ = std::thread([p = pg.get()] {
    pthread_setname_np(pthread_self(), "sk-tcp-comm");
    p->comm_loop();
  });
  return pg;
}

absl::Status TcpProcessGroup::connect_mesh(absl::Time deadline) {
  // The options were checked by resolve_tcp_group_options (create(); a subgroup inherits them).
  const TransportChoice choice = *parse_transport_choice(options_.transport, "the transport");
  impl_->scratch = Tensor::empty({static_cast<std::int64_t>(options_.chunk_bytes / 8 + 1)},
                                 TensorOptions{}.with_dtype(DType::i64).with_category(MemoryCategory::communication_buffer));
  TcpRendezvousOptions ro;
  ro.listen_host = options_.listen_host;
  ro.store_prefix = options_.store_prefix;
  ro.group_name = name();
  ro.socket_buffer_bytes = options_.socket_buffer_bytes;
  ro.token = options_.token;
  absl::StatusOr<TcpMesh> mesh = tcp_rendezvous(*store_, rank(), size(), ro, deadline);
  if (!mesh.ok()) return mesh.status();
  keys_ = mesh->keys;
  ShmRendezvousOptions so;
  so.group_name = name();
  so.choice = choice;
  so.ring_bytes = options_.shm_ring_bytes;
  so.host_id = options_.host_id;
  so.pair.single_copy = options_.shm_single_copy.value_or(false);
  so.pair.single_copy_min_bytes = options_.shm_single_copy_min_bytes;
  absl::StatusOr<TransportMesh> pairs = make_pairs(*store_, rank(), size(), std::move(*mesh), so, deadline);
  if (!pairs.ok()) return pairs.status();
  peers_ = std::move(pairs->pairs);
  kinds_ = std::move(pairs->kinds);
  return absl::OkStatus();
}

TcpProcessGroup::~TcpProcessGroup() {
  bool busy = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    // A call still running (a contract violation) must not keep the destructor waiting until its deadline.
    // running_ is set under this lock as the call leaves the queue, so no call is between the two unseen.
    busy = !queue_.empty() || running_;
    if (busy && failure_.ok()) {
      failure_ = absl::AbortedError(absl::StrCat("group '", name(), "' destroyed on rank ", rank()));
    }
  }
  if (busy) shutdown_pairs();
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  std::deque<Item> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(queue_);
  }
  for (auto& item : left) {
    item.work->complete(absl::AbortedError(absl::StrCat(item.call.describe(), ": the group was destroyed")));
  }
}

void TcpProcessGroup::shutdown_pairs() {
  for (auto& p : peers_)
    if (p) p->shutdown();
}

absl::Status TcpProcessGroup::fail_group(const absl::Status& reason, bool post) {
  absl::Status first;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (failure_.ok()) failure_ = reason;
    first = failure_;
  }
  if (post && first == reason) {
    // Best effort: ranks further away quote this instead of "my neighbour closed".
    const std::string key = failure_key();
    if (!store_unreachable_.load()) {
      auto present = store_->check({key});
      if (!present.ok()) {
        store_unreachable_ = true;  // e.g. the rank hosting it died: do not wait on it again
      } else if (!*present) {
        if (!store_->set(key, std::string(reason.message())).ok()) store_unreachable_ = true;
      }
    }
  }
  shutdown_pairs();
  cv_.notify_all();
  return first;
}

std::string TcpProcessGroup::failure_key() const { return absl::StrCat(keys_, "/abort"); }

std::string TcpProcessGroup::backend_name() const {
  const bool shm = std::find(kinds_.begin(), kinds_.end(), "shm") != kinds_.end();
  const bool tcp = std::find(kinds_.begin(), kinds_.end(), "tcp") != kinds_.end();
  return shm ? (tcp ? "tcp+shm" : "shm") : "tcp";
}

void TcpProcessGroup::abort(const absl::Status& reason) {
  fail_group(reason.ok() ? absl::AbortedError("aborted") : reason, true).IgnoreError();
}

void TcpProcessGroup::set_testing_after_dequeue(AfterDequeueHook hook) {
  std::lock_guard<std::mutex> lock(mu_);
  after_dequeue_ = std::move(hook);
}

std::string TcpProcessGroup::progress_note() const {
  std::lock_guard<std::mutex> lock(mu_);
  return current_;
}

std::shared_ptr<Work> TcpProcessGroup::run(CollectiveCall call) {
  if (call.input.defined() && !call.input.device().is_cpu()) {
    auto st = absl::InvalidArgumentError(absl::StrCat(call.describe(), ": the tcp backend expected CPU tensors, found ",
                                                      call.input.describe()));
    abort(st);  // the other ranks would otherwise wait for this call until their deadline
    return make_completed_work(st);
  }
  std::weak_ptr<ProcessGroup> weak = weak_from_this();
  const std::string what = call.describe();
  const absl::Duration timeout = call.timeout;
  const int r = rank();
  auto work = std::make_shared<CompletionWork>(call.deadline, [weak, what, timeout, r]() -> absl::Status {
    auto self = std::static_pointer_cast<TcpProcessGroup>(weak.lock());
    std::string note = self ? self->progress_note() : std::string();
    absl::Status st = absl::DeadlineExceededError(absl::StrCat(what, " on rank ", r, " did not complete within ",
                                                               absl::FormatDuration(timeout),
                                                               note.empty() ? "" : ": ", note));
    if (!self) return st;
    const absl::Status first = self->fail_group(st, true);
    if (first == st) return st;
    // The group had failed already (another call's deadline, an abort): name this call first, that as the cause.
    return absl::Status(first.code(), absl::StrCat(what, " on rank ", r, ": the group had failed: ", first.message()));
  });
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!failure_.ok()) {
      const absl::Status f = failure_;
      work->complete(absl::Status(f.code(), absl::StrCat(what, " on rank ", r, ": the group had failed: ", f.message())));
      return work;
    }
    queue_.push_back({std::move(call), work});
    queued_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_all();
  return work;
}

void TcpProcessGroup::comm_loop() {
  for (;;) {
    Item item;
    AfterDequeueHook after_dequeue;
    {
      // The next call usually follows right after the caller saw the previous one complete: poll for it
      // briefly before sleeping (a condition-variable wake-up costs ~50 us here, DESIGN.md section 9).
      const absl::Time spin_end = absl::Now() + options_.spin;
      while (queued_.load(std::memory_order_acquire) == 0 && absl::Now() < spin_end) sched_yield();
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping with nothing left
      item = std::move(queue_.front());
      queue_.pop_front();
      queued_.fetch_sub(1, std::memory_order_release);
      running_ = true;
      after_dequeue = after_dequeue_;
    }
    if (after_dequeue) {
      after_dequeue([this] {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return stopping_; });
      });
    }
    absl::Status failure;
    {
      std::lock_guard<std::mutex> lock(mu_);
      failure = failure_;
    }
    absl::Status st;
    if (!failure.ok()) {
      st = absl::Status(failure.code(), absl::StrCat(item.call.describe(), " on rank ", rank(),
                                                     ": the group had failed: ", failure.message()));
    } else {
      st = execute(item.call);
      if (!st.ok()) {
        const absl::Status first = fail_group(st, true);
        if (!(first == st)) {
          // Another failure (abort, deadline seen by a waiter) came first: report that origin.
          st = absl::Status(first.code(), absl::StrCat(item.call.describe(), " on rank ", rank(),
                                                       ": the group had failed: ", first.message()));
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      current_.clear();
      running_ = false;
    }
    item.work->complete(st);
  }
}

absl::Status TcpProcessGroup::execute(const CollectiveCall& call) {
  const int n = size(), r = rank();
  const std::string what = absl::StrCat(call.describe(), " on group '", name(), "' rank ", r);
  const absl::Time now = absl::Now();
  if (now >= call.deadline) {
    return absl::DeadlineExceededError(absl::StrCat(what, ": its deadline passed while earlier calls ran"));
  }
  const bool is_p2p = call.kind == CollectiveKind::send || call.kind == CollectiveKind::recv;
  const bool reduces = call.kind == CollectiveKind::all_reduce || call.kind == CollectiveKind::reduce ||
                       call.kind == CollectiveKind::reduce_scatter;
  Tensor main = call.kind == CollectiveKind::all_gather ? call.output : call.input;
  const DType dtype = main.defined() ? main.dtype() : DType::f32;
  const std::size_t elem = dtype_size(dtype);
  const std::int64_t chunk_elems = std::max<std::int64_t>(1, static_cast<std::int64_t>(options_.chunk_bytes / elem));
  char* base = main.defined() ? static_cast<char*>(main.raw_data()) : nullptr;

  // premul_sum: scale this rank's contribution first (the tensor is in/out or scratch by contract).
  if (reduces && call.op.kind == ReduceKind::premul_sum) {
    tcp_reduce::scale(base, static_cast<std::size_t>(main.numel()), dtype, call.op.factor);
  }
  // all_gather: this rank's slice is sent straight from the input and copied into the output while the
  // sockets are busy; reduce_scatter: the last step reduces straight into the output (see below).
  char* own_slot = nullptr;
  const char* own_input = nullptr;
  std::size_t own_bytes = 0;
  if (call.kind == CollectiveKind::all_gather) {
    own_slot = base + static_cast<std::size_t>(r) * call.input.nbytes();
    own_input = static_cast<const char*>(call.input.raw_data());
    own_bytes = call.input.nbytes();
    if (own_slot == own_input) own_bytes = 0;
  }
  // The kernel-level kind used for partial results: avg and premul_sum are sums until the end.
  ReduceKind kind = call.op.kind;
  if (kind == ReduceKind::avg || kind == ReduceKind::premul_sum) kind = ReduceKind::sum;

  auto finish_reduce_scatter = [&] {
    if (call.kind != CollectiveKind::reduce_scatter) return;
    const char* src = base + static_cast<std::size_t>(r) * call.output.nbytes();
    if (src != call.output.raw_data() && call.output.nbytes() > 0) {
      std::memmove(call.output.raw_data(), src, call.output.nbytes());
    }
  };

  if (n == 1 && !is_p2p) {
    if (own_bytes > 0) std::memmove(own_slot, own_input, own_bytes);
    finish_reduce_scatter();
    return absl::OkStatus();
  }

  // The plan (ring_plan.h): which chunks go to whom and come from whom on this rank.
  ChunkPlan plan;
  std::size_t plan_elem = elem;
  std::int64_t header_numel = main.defined() ? main.numel() : 0;
  std::int64_t header_seq = call.seq;
  CollectiveKind header_kind = call.kind;
  switch (call.kind) {
    case CollectiveKind::all_reduce:
      plan = plan_ring_all_reduce(r, n, main.numel(), chunk_elems);
      break;
    case CollectiveKind::reduce_scatter:
      plan = plan_ring_reduce_scatter(r, n, main.numel(), chunk_elems);
      break;
    case CollectiveKind::all_gather:
      plan = plan_ring_all_gather(r, n, main.numel(), chunk_elems);
      break;
    case CollectiveKind::barrier:
      // A 1-byte-per-rank ring all-gather.
      impl_->barrier.resize(static_cast<std::size_t>(n));
      base = impl_->barrier.data();
      plan_elem = 1;
      header_numel = n;
      plan = plan_ring_all_gather(r, n, n, chunk_elems);
      break;
    case CollectiveKind::broadcast:
      plan = plan_chain_broadcast(r, n, call.root, main.numel(), chunk_elems);
      break;
    case CollectiveKind::reduce:
      plan = plan_chain_reduce(r, n, call.root, main.numel(), chunk_elems);
      break;
    case CollectiveKind::send:
      header_seq = sends_to_[static_cast<std::size_t>(call.peer)]++;
      header_kind = CollectiveKind::send;
      plan = plan_send(call.peer, main.numel(), chunk_elems);
      break;
    case CollectiveKind::recv:
      header_seq = recvs_from_[static_cast<std::size_t>(call.peer)]++;
      header_kind = CollectiveKind::send;
      plan = plan_recv(call.peer, main.numel(), chunk_elems);
      break;
  }
  const CallHeader out_h = make_call_header(call, header_seq, header_numel, header_kind);
  const CallHeader expected = out_h;
  CallHeader in_h;
  Streams streams = streams_for_plan(plan, base, plan_elem, &out_h, &in_h);

  StreamRunner runner;
  for (const auto& p : peers_) runner.all_pairs.push_back(p.get());
  runner.send_peer = plan.send_peer;
  runner.recv_peer = plan.recv_peer;
  runner.send_pair = plan.send_peer >= 0 ? peers_[static_cast<std::size_t>(plan.send_peer)].get() : nullptr;
  runner.recv_pair = plan.recv_peer >= 0 ? peers_[static_cast<std::size_t>(plan.recv_peer)].get() : nullptr;
  runner.dtype = dtype;
  runner.kind = kind;
  runner.divide_by = call.op.kind == ReduceKind::avg ? n : 0;
  runner.scratch = static_cast<char*>(impl_->scratch.raw_data());
  runner.expected = &expected;
  runner.deadline = call.deadline;
  runner.spin = options_.spin;
  runner.what = what;
  runner.streaming_copies = main.defined() && main.nbytes() >= options_.streaming_copy_min_bytes;
  if (own_bytes > 0) {
    // Step 0 sends this rank's slice: read it from the input, and copy it into place meanwhile.
    for (StreamSend& c : streams.sends) {
      if (c.after_recv == -1 && c.data >= own_slot && c.data < own_slot + own_bytes) c.data = own_input + (c.data - own_slot);
    }
    runner.copy_dst = own_slot;
    runner.copy_src = own_input;
    runner.copy_left = own_bytes;
  }
  bool wrote_output = false;
  if (call.kind == CollectiveKind::reduce_scatter && call.output.nbytes() > 0) {
    char* seg = base + static_cast<std::size_t>(r) * call.output.nbytes();
    char* out = static_cast<char*>(call.output.raw_data());
    for (StreamRecv& c : streams.recvs) {
      if (c.mode == StreamRecvMode::kReduce && c.dst >= seg && c.dst < seg + call.output.nbytes()) c.out = out + (c.dst - seg);
    }
    wrote_output = true;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = absl::StrCat("waiting on ", runner.recv_peer >= 0 ? absl::StrCat("rank ", runner.recv_peer) : "",
                            runner.recv_peer >= 0 && runner.send_peer >= 0 ? " and " : "",
                            runner.send_peer >= 0 ? absl::StrCat("rank ", runner.send_peer) : "");
  }
  absl::Status st = runner.run(streams);
  if (!st.ok()) {
    // Did this rank's group fail (abort() / a waiter's deadline shut the sockets)? Then that failure is the cause:
    // name this call first (comm_loop words it like every call that finds its group failed).
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_.ok()) {
        return absl::Status(failure_.code(), absl::StrCat(what, ": the group had failed: ", failure_.message()));
      }
    }
    if (st.code() == absl::StatusCode::kUnavailable) {
      // A neighbour closing may be the echo of a failure further away: quote the origin when posted.
      absl::StatusOr<std::string> origin = absl::UnavailableError("store unreachable");
      const std::string key = failure_key();
      if (!store_unreachable_.load()) {
        // check() first: it fails fast when the store is gone. A rank that fails posts its reason before
        // shutting its sockets, so an echo finds it at once; the short wait only covers a racing poster.
        auto present = store_->check({key});
        if (!present.ok()) {
          store_unreachable_ = true;
        } else {
          origin = store_->get(key, absl::Milliseconds(50));
        }
      }
      if (origin.ok()) {
        return absl::AbortedError(absl::StrCat(what, ": the group failed: ", *origin, " (seen here as: ",
                                               st.message(), ")"));
      }
    }
    return st;
  }
  if (!wrote_output) finish_reduce_scatter();
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<ProcessGroup>> TcpProcessGroup::make_subgroup(std::vector<int> members,
                                                                             const std::string& key,
                                                                             const std::string& name,
                                                                             absl::Duration default_timeout,
                                                                             absl::Time deadline) {
  int sub_rank = -1;
  std::vector<int> global;
  for (std::size_t i = 0; i < members.size(); ++i) {
    if (members[i] == rank()) sub_rank = static_cast<int>(i);
    global.push_back(global_ranks()[static_cast<std::size_t>(members[i])]);
  }
  SK_CHECK_GE(sub_rank, 0) << "make_subgroup called on a non-member";
  TcpProcessGroupOptions o = options_;
  o.store_prefix = absl::StrCat(keys_, "/sub/", key);
  o.name = name;
  o.default_timeout = default_timeout;
  std::shared_ptr<TcpProcessGroup> pg(
      new TcpProcessGroup(store_, sub_rank, static_cast<int>(members.size()), std::move(global), o));
  if (auto st = pg->connect_mesh(deadline); !st.ok()) return st;
  pg->thread_ = std::thread([p = pg.get()] {
    pthread_setname_np(pthread_self(), "sk-tcp-comm");
    p->comm_loop();
  });
  return std::shared_ptr<ProcessGroup>(std::move(pg));
}

}  // namespace shardkit::comm
