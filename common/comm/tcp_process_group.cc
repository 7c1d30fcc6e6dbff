#include "common/comm/tcp_process_group.h"

#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <sys/socket.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "common/base/check.h"
#include "common/base/logging.h"
#include "common/comm/tcp_reduce.h"

namespace shardkit::comm {

// Note [tcp ring pipeline]
// Every call is described as two byte streams on this rank: what it sends to one peer (`send_peer`) and
// what it receives from one peer (`recv_peer`), each a list of chunks. A received chunk is either copied
// straight into place or received into a chunk-sized scratch buffer and reduced into place. A send chunk
// may depend on a received chunk ("ready once recv chunk k is done"): in a ring, what a rank forwards at
// step s+1 is exactly what it received (and reduced) at step s, so chunk j of step s+1 can leave as soon
// as chunk j of step s has arrived. One loop on the comm thread drives both streams with non-blocking
// send/recv; when neither can move it busy-polls briefly and then blocks in poll(2) until the call's
// deadline. Causality makes the in-place buffers safe: a region is only overwritten by data whose
// production required this rank's earlier sends of that region to have been handed to the kernel.
//
// Ring reduce-scatter over segments seg[0..n), rank r ends owning seg[r]:
//   step s = 0..n-2: send seg[r-s-1], receive seg[r-s-2] and reduce (mod n); step n-2 receives seg[r].
// Ring all-gather, rank r starting with seg[r]:
//   step s = 0..n-2: send seg[r-s], receive seg[r-s-1] into place.
// all_reduce is the two back to back (the first all-gather send, seg[r], depends on the last
// reduce-scatter receive). avg divides the owned segment once, before the all-gather.

namespace {

constexpr std::uint32_t kHeaderMagic = 0x5054534b;  // "KSTP"
constexpr std::uint32_t kHelloMagic = 0x4f4c4548;   // "HELO"

// The 32-byte header that starts every call on every connection it uses.
struct CallHeader {
  std::uint32_t magic = kHeaderMagic;
  std::uint8_t kind = 0;
  std::uint8_t dtype = 0;
  std::uint8_t op = 0;
  std::uint8_t pad = 0;
  std::int32_t root = 0;
  std::int32_t pad2 = 0;
  std::int64_t seq = 0;
  std::int64_t numel = 0;
};
static_assert(sizeof(CallHeader) == 32);

std::string describe_header(const CallHeader& h) {
  if (h.magic != kHeaderMagic) return absl::StrCat("bytes that are not a call header (magic ", h.magic, ")");
  return absl::StrCat(std::string(collective_kind_name(static_cast<CollectiveKind>(h.kind))),
                      h.kind == static_cast<int>(CollectiveKind::send) ? " (p2p #" : " (#", h.seq,
                      ", dtype ", std::string(dtype_name(static_cast<DType>(h.dtype))), ", numel ", h.numel, ", op ",
                      std::string(reduce_kind_name(static_cast<ReduceKind>(h.op))), ", root ", h.root, ")");
}

struct SendChunk {
  const char* data;
  std::size_t bytes;
  std::int64_t after_recv;  // ready once recv chunk index after_recv is done (-1: at once)
};

enum class RecvMode : std::uint8_t { kCopy, kReduce, kHeader };

struct RecvChunk {
  char* dst;
  std::size_t bytes;
  RecvMode mode;
  bool finalize;          // divide by n after reducing (avg, owned segment)
  char* out = nullptr;    // kReduce: where dst (op) received goes; null = dst (reduce_scatter's last step
                          // writes straight into the output, saving a copy)
};

struct Segment {
  std::int64_t offset;  // elements
  std::int64_t count;
};

// Elements split into n near-equal segments (the first numel % n get one more).
std::vector<Segment> split_segments(std::int64_t numel, int n) {
  std::vector<Segment> segs(static_cast<std::size_t>(n));
  const std::int64_t base = numel / n, extra = numel % n;
  std::int64_t off = 0;
  for (int i = 0; i < n; ++i) {
    const std::int64_t c = base + (i < extra ? 1 : 0);
    segs[static_cast<std::size_t>(i)] = {off, c};
    off += c;
  }
  return segs;
}

int mod(int a, int n) { return ((a % n) + n) % n; }

// Builds the two streams of one call (Note [tcp ring pipeline]).
class StreamBuilder {
 public:
  StreamBuilder(char* base, std::size_t elem, std::int64_t chunk_elems)
      : base_(base), elem_(elem), chunk_elems_(chunk_elems) {}

  void header(const CallHeader* out, CallHeader* in) {
    if (out) sends.push_back({reinterpret_cast<const char*>(out), sizeof(CallHeader), -1});
    if (in) recvs.push_back({reinterpret_cast<char*>(in), sizeof(CallHeader), RecvMode::kHeader, false, nullptr});
  }

  // One step: send `send_seg` (when send), receive `recv_seg` (when recv). When `chained`, the sends of this
  // step depend chunk for chunk on the receives of the previous step (same segment by construction).
  void step(const Segment* send_seg, const Segment* recv_seg, RecvMode mode, bool finalize, bool chained) {
    std::vector<std::int64_t> this_recv;
    if (send_seg) {
      std::size_t k = 0;
      for (std::int64_t off = 0; off < send_seg->count; off += chunk_elems_, ++k) {
        const std::int64_t c = std::min(chunk_elems_, send_seg->count - off);
        std::int64_t after = -1;
        if (chained) {
          SK_CHECK_LT(k, prev_recv_.size()) << "ring steps must forward the segment received before";
          after = prev_recv_[k];
        }
        sends.push_back({base_ + static_cast<std::size_t>(send_seg->offset + off) * elem_,
                         static_cast<std::size_t>(c) * elem_, after});
      }
    }
    if (recv_seg) {
      for (std::int64_t off = 0; off < recv_seg->count; off += chunk_elems_) {
        const std::int64_t c = std::min(chunk_elems_, recv_seg->count - off);
        this_recv.push_back(static_cast<std::int64_t>(recvs.size()));
        recvs.push_back({base_ + static_cast<std::size_t>(recv_seg->offset + off) * elem_,
                         static_cast<std::size_t>(c) * elem_, mode, finalize, nullptr});
      }
    }
    prev_recv_ = std::move(this_recv);
  }

  std::vector<SendChunk> sends;
  std::vector<RecvChunk> recvs;

 private:
  char* base_;
  std::size_t elem_;
  std::int64_t chunk_elems_;
  std::vector<std::int64_t> prev_recv_;
};

bool would_block(int e) { return e == EAGAIN || e == EWOULDBLOCK || e == EINTR; }

}  // namespace

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

absl::StatusOr<std::shared_ptr<TcpProcessGroup>> TcpProcessGroup::create(std::shared_ptr<Store> store, int rank,
                                                                         int size, TcpProcessGroupOptions options) {
  if (!store) return absl::InvalidArgumentError("TcpProcessGroup: expected a store, found null");
  if (size < 1 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(
        absl::StrCat("TcpProcessGroup: expected 0 <= rank < size, found rank ", rank, " and size ", size));
  }
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

// Note [group generations]
// A failed group is not usable again: the way back is a new group, every rank calling create() again, usually
// with the same store and prefix. The failed group's keys are still in the store (addresses of listeners that
// are closed now, the arrival count, the abort reason), so each creation works under keys of its own:
// "<store_prefix>/<k>/...", where k counts this rank's earlier creations on that prefix (the store counter
// "<store_prefix>/generation/<rank>"). Creating a group is collective, so every rank creates it equally often on
// a prefix and the k-th creations of all ranks meet under the same keys, never reading what an earlier
// generation left. Sub-groups live under their parent's keys. A rank that creates the group more often than
// the others (a create() only some ranks called) waits under keys nobody writes and fails at the deadline,
// naming the generation. A group of one rank uses no keys of its own.

absl::Status TcpProcessGroup::connect_mesh(absl::Time deadline) {
  const int n = size(), r = rank();
  auto where = [&](const std::string& what) {
    return absl::StrCat("TcpProcessGroup '", name(), "' rank ", r, " of ", n, ": ", what);
  };
  if (options_.chunk_bytes == 0) return absl::InvalidArgumentError(where("expected chunk_bytes > 0, found 0"));
  impl_->scratch = Tensor::empty({static_cast<std::int64_t>(options_.chunk_bytes / 8 + 1)},
                                 TensorOptions{}.with_dtype(DType::i64).with_category(MemoryCategory::communication_buffer));
  if (n == 1) {
    keys_ = options_.store_prefix;  // no other rank reads this group's keys
    return absl::OkStatus();
  }
  // Note [group generations].
  auto created = store_->add(absl::StrCat(options_.store_prefix, "/generation/", r), 1);
  if (!created.ok()) {
    return absl::Status(created.status().code(),
                        where(absl::StrCat("counting this rank's groups on the store failed: ", created.status().message())));
  }
  const std::int64_t generation = *created - 1;
  keys_ = absl::StrCat(options_.store_prefix, "/", generation);
  const std::string& prefix = keys_;

  auto listener = tcp::listen_on(options_.listen_host, 0);
  if (!listener.ok()) return absl::Status(listener.status().code(), where(std::string(listener.status().message())));
  auto port = tcp::local_port(*listener);
  if (!port.ok()) return port.status();
  if (auto st = store_->set(absl::StrCat(prefix, "/addr/", r), absl::StrCat(options_.listen_host, ":", *port));
      !st.ok()) {
    return absl::Status(st.code(), where(absl::StrCat("publishing the address failed: ", st.message())));
  }
  // Connect to every lower rank, then accept every higher rank (the backlog holds early connections).
  for (int p = 0; p < r; ++p) {
    auto addr = store_->get(absl::StrCat(prefix, "/addr/", p), std::max(deadline - absl::Now(), absl::ZeroDuration()));
    if (!addr.ok()) {
      return absl::DeadlineExceededError(where(absl::StrCat("rank ", p, " did not publish its address in time (group #",
                                                            generation, " on store prefix '", options_.store_prefix,
                                                            "'): ", addr.status().message())));
    }
    const auto colon = addr->rfind(':');
    int peer_port = 0;
    if (colon == std::string::npos || !absl::SimpleAtoi(addr->substr(colon + 1), &peer_port)) {
      return absl::InvalidArgumentError(where(absl::StrCat("expected 'host:port' for rank ", p, ", found '", *addr, "'")));
    }
    auto s = tcp::connect_with_retry(addr->substr(0, colon), static_cast<std::uint16_t>(peer_port), deadline,
                                     absl::StrCat("rank ", p));
    if (!s.ok()) return absl::Status(s.status().code(), where(std::string(s.status().message())));
    const std::uint32_t hello[2] = {kHelloMagic, static_cast<std::uint32_t>(r)};
    if (auto st = tcp::send_all(*s, hello, sizeof(hello), deadline, absl::StrCat("rank ", p)); !st.ok()) {
      return absl::Status(st.code(), where(std::string(st.message())));
    }
    tcp::tune_socket(s->fd(), options_.socket_buffer_bytes);
    peers_[static_cast<std::size_t>(p)] = std::move(*s);
  }
  for (int k = r + 1; k < n; ++k) {
    auto s = tcp::accept_one(*listener, deadline);
    if (!s.ok()) {
      std::vector<int> missing;
      for (int p = r + 1; p < n; ++p)
        if (!peers_[static_cast<std::size_t>(p)].valid()) missing.push_back(p);
      return absl::DeadlineExceededError(
          where(absl::StrCat("ranks [", absl::StrJoin(missing, ", "), "] did not connect before the deadline")));
    }
    std::uint32_t hello[2] = {0, 0};
    if (auto st = tcp::recv_all(*s, hello, sizeof(hello), deadline, "a connecting rank"); !st.ok()) {
      return absl::Status(st.code(), where(std::string(st.message())));
    }
    const int p = static_cast<int>(hello[1]);
    if (hello[0] != kHelloMagic || p <= r || p >= n || peers_[static_cast<std::size_t>(p)].valid()) {
      return absl::InvalidArgumentError(where(absl::StrCat("expected a hello from a rank in (", r, ", ", n,
                                                           "), found magic ", hello[0], " rank ", p)));
    }
    tcp::tune_socket(s->fd(), options_.socket_buffer_bytes);
    peers_[static_cast<std::size_t>(p)] = std::move(*s);
  }
  // Store barrier: after it no rank needs the store for bootstrapping (rank 0 may host it and leave).
  auto arrived = store_->add(absl::StrCat(prefix, "/connected"), 1);
  if (!arrived.ok()) return arrived.status();
  if (*arrived == n) {
    if (auto st = store_->set(absl::StrCat(prefix, "/all_connected"), "1"); !st.ok()) return st;
  }
  if (auto st = store_->wait({absl::StrCat(prefix, "/all_connected")},
                             std::max(deadline - absl::Now(), absl::ZeroDuration()));
      !st.ok()) {
    return absl::DeadlineExceededError(where(absl::StrCat("not every rank connected in time: ", st.message())));
  }
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
  if (busy) shutdown_sockets();
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

void TcpProcessGroup::shutdown_sockets() {
  for (auto& s : peers_)
    if (s.valid()) ::shutdown(s.fd(), SHUT_RDWR);
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
    const std::string key = absl::StrCat(keys_, "/abort");
    if (!store_unreachable_.load()) {
      auto present = store_->check({key});
      if (!present.ok()) {
        store_unreachable_ = true;  // e.g. the rank hosting it died: do not wait on it again
      } else if (!*present) {
        if (!store_->set(key, std::string(reason.message())).ok()) store_unreachable_ = true;
      }
    }
  }
  shutdown_sockets();
  cv_.notify_all();
  return first;
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
    if (self) st = self->fail_group(st, true);
    return st;
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

// ---- execution -------------------------------------------------------------------------------------

namespace {

// Drives one call's two streams to completion (Note [tcp ring pipeline]).
struct StreamRunner {
  int send_fd = -1;
  int recv_fd = -1;
  int send_peer = -1;
  int recv_peer = -1;
  DType dtype = DType::f32;
  ReduceKind kind = ReduceKind::sum;
  int n = 1;
  char* scratch = nullptr;
  const CallHeader* expected = nullptr;  // what the recv header must say
  absl::Time deadline;
  absl::Duration spin;
  std::string what;  // "all_reduce #3 (...) on rank 1"
  std::vector<int> all_peers;  // fd per group rank (-1: self), for naming every closed peer

  std::size_t sent_bytes = 0, recv_bytes = 0, send_total = 0, recv_total = 0;
  // A local copy done while the sockets are busy (all_gather's own slice), finished before returning.
  char* copy_dst = nullptr;
  const char* copy_src = nullptr;
  std::size_t copy_left = 0;

  bool copy_some(std::size_t max_bytes) {
    if (copy_left == 0) return false;
    const std::size_t k = std::min(copy_left, max_bytes);
    std::memcpy(copy_dst, copy_src, k);
    copy_dst += k;
    copy_src += k;
    copy_left -= k;
    return true;
  }

  absl::Status run(const std::vector<SendChunk>& sends, const std::vector<RecvChunk>& recvs) {
    for (const auto& c : sends) send_total += c.bytes;
    for (const auto& c : recvs) recv_total += c.bytes;
    std::size_t si = 0, soff = 0, ri = 0, roff = 0;
    std::int64_t recv_done = 0;  // number of completed recv chunks
    absl::Time spin_until = absl::InfiniteFuture();
    while (si < sends.size() || ri < recvs.size()) {
      bool progress = false;
      // Send as much as the socket takes of ready chunks.
      while (si < sends.size() && sends[si].after_recv < recv_done) {
        const SendChunk& c = sends[si];
        if (c.bytes == 0) {
          ++si;
          continue;
        }
        const ssize_t k = ::send(send_fd, c.data + soff, c.bytes - soff, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
          progress = true;
          soff += static_cast<std::size_t>(k);
          sent_bytes += static_cast<std::size_t>(k);
          if (soff == c.bytes) {
            ++si;
            soff = 0;
          }
          continue;
        }
        if (k < 0 && would_block(errno)) break;
        return lost(send_peer, "sending", errno);
      }
      // Receive.
      while (ri < recvs.size()) {
        const RecvChunk& c = recvs[ri];
        if (c.bytes == 0) {
          ++ri;
          ++recv_done;
          continue;
        }
        char* dst = c.mode == RecvMode::kReduce ? scratch : c.dst;
        const ssize_t k = ::recv(recv_fd, dst + roff, c.bytes - roff, MSG_DONTWAIT);
        if (k > 0) {
          progress = true;
          roff += static_cast<std::size_t>(k);
          recv_bytes += static_cast<std::size_t>(k);
          if (roff == c.bytes) {
            if (c.mode == RecvMode::kReduce) {
              tcp_reduce::combine(c.out ? c.out : c.dst, c.dst, scratch, c.bytes / dtype_size(dtype), dtype, kind,
                                  c.finalize ? n : 0);
            } else if (c.mode == RecvMode::kHeader) {
              if (auto st = check_header(*reinterpret_cast<const CallHeader*>(c.dst)); !st.ok()) return st;
            }
            ++ri;
            ++recv_done;
            roff = 0;
          }
          continue;
        }
        if (k == 0) return lost(recv_peer, "receiving", 0);
        if (would_block(errno)) break;
        return lost(recv_peer, "receiving", errno);
      }
      if (si >= sends.size() && ri >= recvs.size()) break;
      if (progress) {
        spin_until = absl::InfiniteFuture();
        continue;
      }
      if (copy_some(256 << 10)) continue;  // useful work instead of waiting
      const absl::Time now = absl::Now();
      if (now >= deadline) return timed_out(si < sends.size(), ri < recvs.size());
      if (spin_until == absl::InfiniteFuture()) spin_until = now + spin;
      if (now < spin_until) {
        // Busy-poll a little before sleeping (DESIGN.md section 9); yield so that, when ranks outnumber
        // cores, the rank we wait for gets the CPU.
        sched_yield();
        continue;
      }
      pollfd p[2];
      nfds_t np = 0;
      const bool want_send = si < sends.size() && sends[si].after_recv < recv_done;
      const bool want_recv = ri < recvs.size();
      if (send_fd == recv_fd) {
        p[np++] = pollfd{send_fd, static_cast<short>((want_send ? POLLOUT : 0) | (want_recv ? POLLIN : 0) | POLLRDHUP), 0};
      } else {
        if (send_fd >= 0) p[np++] = pollfd{send_fd, static_cast<short>((want_send ? POLLOUT : 0) | POLLRDHUP), 0};
        if (recv_fd >= 0) p[np++] = pollfd{recv_fd, static_cast<short>((want_recv ? POLLIN : 0) | POLLRDHUP), 0};
      }
      const std::int64_t ms = std::clamp<std::int64_t>(absl::ToInt64Milliseconds(deadline - now) + 1, 0, 100);
      const int rc = ::poll(p, np, static_cast<int>(ms));
      if (rc < 0 && errno != EINTR) return lost(recv_peer >= 0 ? recv_peer : send_peer, "polling", errno);
      for (nfds_t i = 0; rc > 0 && i < np; ++i) {
        // A hang-up on the send side only (we are not receiving from it) is an error now; on the recv side
        // the recv() above reports it (after draining what is buffered).
        if ((p[i].revents & (POLLERR | POLLHUP)) && p[i].fd == send_fd && p[i].fd != recv_fd && want_send) {
          return lost(send_peer, "sending", ECONNRESET);
        }
        if ((p[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) && p[i].fd == send_fd && !want_send &&
            p[i].fd != recv_fd && si < sends.size()) {
          return lost(send_peer, "sending", ECONNRESET);
        }
      }
      spin_until = absl::InfiniteFuture();
    }
    copy_some(copy_left);
    return absl::OkStatus();
  }

  absl::Status check_header(const CallHeader& got) const {
    if (std::memcmp(&got, expected, sizeof(CallHeader)) == 0) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(what, ": ranks disagree: expected rank ", recv_peer, " to issue ",
                                                   describe_header(*expected), " as this rank does, found ",
                                                   describe_header(got)));
  }

  absl::Status lost(int peer, const char* doing, int err) const {
    return absl::UnavailableError(absl::StrCat(what, ": connection to rank ", peer, " lost while ", doing, " (",
                                               err == 0 ? "closed by the peer" : std::strerror(err), "; sent ",
                                               sent_bytes, " of ", send_total, " bytes, received ", recv_bytes, " of ",
                                               recv_total, ")", closed_peers()));
  }

  // "; peers whose connections had closed: rank 0, rank 2": the neighbour that closed may only be echoing a failure
  // elsewhere (it aborted), so every peer that hung up is named (a dead rank's connections all close).
  // Waits up to 50 ms for the hang-ups to arrive: a dead process's sockets close one by one, and the echo
  // of an abort can overtake them.
  std::string closed_peers() const {
    std::vector<pollfd> open;
    std::vector<int> open_ranks, closed;
    for (std::size_t i = 0; i < all_peers.size(); ++i) {
      if (all_peers[i] < 0) continue;
      open.push_back(pollfd{all_peers[i], POLLRDHUP, 0});
      open_ranks.push_back(static_cast<int>(i));
    }
    const absl::Time until = absl::Now() + absl::Milliseconds(50);
    while (!open.empty()) {
      const std::int64_t ms = absl::ToInt64Milliseconds(until - absl::Now());
      if (ms <= 0 || ::poll(open.data(), open.size(), static_cast<int>(ms)) <= 0) break;
      for (std::size_t i = open.size(); i-- > 0;) {
        if (open[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
          closed.push_back(open_ranks[i]);
          open.erase(open.begin() + static_cast<std::ptrdiff_t>(i));
          open_ranks.erase(open_ranks.begin() + static_cast<std::ptrdiff_t>(i));
        } else {
          open[i].revents = 0;
        }
      }
    }
    if (closed.empty()) return "";
    std::sort(closed.begin(), closed.end());
    return absl::StrCat("; peers whose connections had closed: ",
                        absl::StrJoin(closed, ", ", [](std::string* out, int r) { absl::StrAppend(out, "rank ", r); }));
  }

  absl::Status timed_out(bool sending, bool receiving) const {
    std::string who;
    if (receiving) absl::StrAppend(&who, "rank ", recv_peer, " (received ", recv_bytes, " of ", recv_total, " bytes)");
    if (sending) {
      absl::StrAppend(&who, who.empty() ? "" : " and ", "rank ", send_peer, " (sent ", sent_bytes, " of ", send_total,
                      " bytes)");
    }
    return absl::DeadlineExceededError(absl::StrCat(what, ": deadline exceeded waiting for ", who));
  }
};

CallHeader make_header(const CollectiveCall& call, std::int64_t seq, std::int64_t numel, CollectiveKind kind) {
  CallHeader h;
  h.kind = static_cast<std::uint8_t>(kind);
  h.dtype = static_cast<std::uint8_t>(call.input.defined() ? call.input.dtype() : DType::f32);
  h.op = static_cast<std::uint8_t>(call.op.kind);
  h.root = call.root;
  h.seq = seq;
  h.numel = numel;
  return h;
}

}  // namespace

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

  StreamRunner runner;
  for (const auto& p : peers_) runner.all_peers.push_back(p.valid() ? p.fd() : -1);
  runner.dtype = dtype;
  runner.kind = kind;
  runner.n = call.op.kind == ReduceKind::avg ? n : 0;
  runner.scratch = static_cast<char*>(impl_->scratch.raw_data());
  runner.deadline = call.deadline;
  runner.spin = options_.spin;
  runner.what = what;

  CallHeader out_h, in_h, expected;
  StreamBuilder b(base, elem, chunk_elems);
  auto set_peers = [&](int send_peer, int recv_peer) {
    runner.send_peer = send_peer;
    runner.recv_peer = recv_peer;
    runner.send_fd = send_peer >= 0 ? peers_[static_cast<std::size_t>(send_peer)].fd() : -1;
    runner.recv_fd = recv_peer >= 0 ? peers_[static_cast<std::size_t>(recv_peer)].fd() : -1;
    b.header(send_peer >= 0 ? &out_h : nullptr, recv_peer >= 0 ? &in_h : nullptr);
  };

  switch (call.kind) {
    case CollectiveKind::all_reduce:
    case CollectiveKind::reduce_scatter:
    case CollectiveKind::all_gather:
    case CollectiveKind::barrier: {
      std::vector<Segment> segs;
      std::int64_t numel = main.defined() ? main.numel() : 0;
      if (call.kind == CollectiveKind::barrier) {
        impl_->barrier.resize(static_cast<std::size_t>(n));
        base = impl_->barrier.data();
        b = StreamBuilder(base, 1, chunk_elems);
        numel = n;
      }
      segs = split_segments(numel, n);
      out_h = expected = make_header(call, call.seq, numel, call.kind);
      set_peers(mod(r + 1, n), mod(r - 1, n));
      bool chained = false;
      if (call.kind != CollectiveKind::all_gather && call.kind != CollectiveKind::barrier) {
        for (int s = 0; s <= n - 2; ++s) {
          b.step(&segs[static_cast<std::size_t>(mod(r - s - 1, n))], &segs[static_cast<std::size_t>(mod(r - s - 2, n))],
                 RecvMode::kReduce, s == n - 2, chained);
          chained = true;
        }
      }
      if (call.kind != CollectiveKind::reduce_scatter) {
        for (int s = 0; s <= n - 2; ++s) {
          b.step(&segs[static_cast<std::size_t>(mod(r - s, n))], &segs[static_cast<std::size_t>(mod(r - s - 1, n))],
                 RecvMode::kCopy, false, chained);
          chained = true;
        }
      }
      break;
    }
    case CollectiveKind::broadcast: {
      const int pos = mod(r - call.root, n);
      out_h = expected = make_header(call, call.seq, main.numel(), call.kind);
      set_peers(pos < n - 1 ? mod(r + 1, n) : -1, pos > 0 ? mod(r - 1, n) : -1);
      const Segment all{0, main.numel()};
      b.step(nullptr, pos > 0 ? &all : nullptr, RecvMode::kCopy, false, false);
      if (pos < n - 1) b.step(&all, nullptr, RecvMode::kCopy, false, pos > 0);
      break;
    }
    case CollectiveKind::reduce: {
      const int pos = mod(r - call.root - 1, n);  // 0: first of the chain; n-1: the root
      out_h = expected = make_header(call, call.seq, main.numel(), call.kind);
      set_peers(pos < n - 1 ? mod(r + 1, n) : -1, pos > 0 ? mod(r - 1, n) : -1);
      const Segment all{0, main.numel()};
      b.step(nullptr, pos > 0 ? &all : nullptr, RecvMode::kReduce, pos == n - 1, false);
      if (pos < n - 1) b.step(&all, nullptr, RecvMode::kCopy, false, pos > 0);
      break;
    }
    case CollectiveKind::send:
    case CollectiveKind::recv: {
      const int peer = call.peer;
      const bool sending = call.kind == CollectiveKind::send;
      const std::int64_t seq =
          sending ? sends_to_[static_cast<std::size_t>(peer)]++ : recvs_from_[static_cast<std::size_t>(peer)]++;
      out_h = expected = make_header(call, seq, main.numel(), CollectiveKind::send);
      set_peers(sending ? peer : -1, sending ? -1 : peer);
      const Segment all{0, main.numel()};
      b.step(sending ? &all : nullptr, sending ? nullptr : &all, RecvMode::kCopy, false, false);
      break;
    }
  }
  runner.expected = &expected;
  if (own_bytes > 0) {
    // Step 0 sends this rank's slice: read it from the input, and copy it into place meanwhile.
    for (SendChunk& c : b.sends) {
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
    for (RecvChunk& c : b.recvs) {
      if (c.mode == RecvMode::kReduce && c.dst >= seg && c.dst < seg + call.output.nbytes()) c.out = out + (c.dst - seg);
    }
    wrote_output = true;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    current_ = absl::StrCat("waiting on ", runner.recv_peer >= 0 ? absl::StrCat("rank ", runner.recv_peer) : "",
                            runner.recv_peer >= 0 && runner.send_peer >= 0 ? " and " : "",
                            runner.send_peer >= 0 ? absl::StrCat("rank ", runner.send_peer) : "");
  }
  absl::Status st = runner.run(b.sends, b.recvs);
  if (!st.ok()) {
    // Did this rank abort (abort() / a waiter's deadline shut the sockets)? Then report that origin.
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!failure_.ok()) return failure_;
    }
    if (st.code() == absl::StatusCode::kUnavailable) {
      // A neighbour closing may be the echo of a failure further away: quote the origin when posted.
      absl::StatusOr<std::string> origin = absl::UnavailableError("store unreachable");
      const std::string key = absl::StrCat(keys_, "/abort");
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
