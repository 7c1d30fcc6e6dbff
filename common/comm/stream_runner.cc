#include "common/comm/stream_runner.h"

#include <poll.h>
#include <sched.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/base/copy_bytes.h"
#include "common/comm/tcp_reduce.h"

namespace shardkit::comm {

// Note [chunk pipeline]
// Every call is described as two byte streams on this rank: what it sends to one peer and what it receives
// from one peer, each a list of chunks (the plan, Note [ring plans] in ring_plan.cc, led by the call header).
// A received chunk is either copied straight into place or received into a chunk-sized scratch buffer and
// reduced into place. A send chunk may depend on a received chunk ("ready once recv chunk k is done"), which
// pipelines the steps of a ring or chain. One loop drives both streams with non-blocking try_send / try_recv;
// when neither can move it does other useful work (the local copy), busy-polls briefly (DESIGN.md section 9:
// a blocking wake-up costs ~50 us in this VM) and then blocks in poll(2) until the call's deadline (or, for
// pairs without a descriptor, on their wake-up counter: transport.h). A transport that lets received bytes be
// read in place (peekable: shared memory) has them reduced straight out of its buffer, without the scratch copy.

Streams streams_for_plan(const ChunkPlan& plan, char* base, std::size_t elem, const CallHeader* out, CallHeader* in) {
  Streams s;
  const bool send_header = plan.send_peer >= 0 && out != nullptr;
  const bool recv_header = plan.recv_peer >= 0 && in != nullptr;
  const std::int64_t shift = recv_header ? 1 : 0;
  s.sends.reserve(plan.sends.size() + 1);
  s.recvs.reserve(plan.recvs.size() + 1);
  if (send_header) s.sends.push_back({reinterpret_cast<const char*>(out), sizeof(CallHeader), -1});
  if (recv_header) {
    s.recvs.push_back({reinterpret_cast<char*>(in), sizeof(CallHeader), StreamRecvMode::kHeader, false, nullptr});
  }
  for (const PlannedSend& c : plan.sends) {
    s.sends.push_back({base + static_cast<std::size_t>(c.offset) * elem, static_cast<std::size_t>(c.count) * elem,
                       c.after_recv < 0 ? -1 : c.after_recv + shift});
  }
  for (const PlannedRecv& c : plan.recvs) {
    s.recvs.push_back({base + static_cast<std::size_t>(c.offset) * elem, static_cast<std::size_t>(c.count) * elem,
                       c.mode == PlanRecvMode::kReduce ? StreamRecvMode::kReduce : StreamRecvMode::kCopy, c.finalize,
                       nullptr});
  }
  return s;
}

// Note [local copy]
// An out-of-place all_gather also copies this rank's input into its slot of the output, the bytes its first send
// step reads (the plan sends them from the input: tcp_process_group.cc). Copied on their own, those bytes are read
// from memory twice; so each piece a send takes from the copy's source at or past the copy's cursor is copied right
// after it is sent, while it is still in cache, and sends from the source go in pieces of at most kLocalCopyPiece
// (a shared-memory send may take a whole ring, more than a core's cache holds next to the ring). What is left, the
// loop copies while the pairs are busy, and run() finishes it. The copy moves a cursor through its source in order,
// so every byte is copied exactly once, whichever of the two gets to it first.
constexpr std::size_t kLocalCopyPiece = std::size_t{128} << 10;

std::size_t StreamRunner::send_piece(const char* data, std::size_t bytes) const {
  if (copy_left == 0 || data + bytes <= copy_src || data >= copy_src + copy_left) return bytes;
  return std::min(bytes, kLocalCopyPiece);
}

void StreamRunner::copy_sent(const char* data, std::size_t bytes) {
  if (copy_left == 0 || data > copy_src || data + bytes <= copy_src) return;
  copy_some(static_cast<std::size_t>(data + bytes - copy_src));
}

// Note [streaming copies]
// A copy into place writes the destination's cache lines, which the core first reads from memory (a write
// allocates the line) unless it uses non-temporal stores, which write whole lines to memory directly. For a call
// whose tensor is larger than the caches (TcpProcessGroupOptions::streaming_copy_min_bytes, 16 MiB) the destination would be evicted
// before anyone reads it anyway, so there the local copy and the chunks received from a shared-memory ring (a
// peekable pair: the runner copies them out itself, peek / consume) are written with non-temporal stores: a third
// less memory traffic per copied byte. Sends are not: the ring should stay in cache for the peer that reads it.
// x86-64 (SSE2) only; elsewhere, and for each copy's unaligned head and short tail, memcpy. The stores are
// weakly ordered, so each copy ends with a store fence: whatever the runner publishes afterwards (a ring's tail,
// the call's completion) is seen after the bytes. Measured on VM B (AMD EPYC, Zen 3, 32 MiB L3) only, comm_bench
// shm all_gather at 64 MiB, N = 2, medians of 5 repetitions per run, runs alternated at load 6-15: frac_of_limit
// 0.61-1.01 (median of 6 runs 0.67) before Note [local copy], 0.72-0.84 with it (4 runs), 0.75-1.25 (median of 6
// runs 0.92) with it and these stores. On the Intel VM streaming stores made the in-process reduction slower
// (reduce_kernels.cc); these copies were not measured there. Tried and left out (stop 27): reduce_scatter's
// reduction into its separate output through non-temporal stores (combine into a 4 KiB block in L1, then streamed
// into place): a quarter less memory traffic on paper, but comm_bench shm reduce_scatter at 64 MiB, N = 2, 5 runs
// alternated with the plain stores, gave median busbw 3.06 GB/s against 3.47 (frac_of_limit 0.99 against 1.08).
// Why was not established: the same reduction of 32 MiB alone is only 6-12% faster streamed on this machine.
static void stream_copy(char* dst, const char* src, std::size_t n) {
#if defined(__SSE2__)
  const std::size_t head = std::min(n, (16 - reinterpret_cast<std::uintptr_t>(dst) % 16) % 16);
  std::memcpy(dst, src, head);
  std::size_t i = head;
  for (; i + 64 <= n; i += 64) {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    const __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, n - i);
  _mm_sfence();
#else
  copy_bytes(dst, src, n);
#endif
}

void StreamRunner::copy_into_place(char* dst, const char* src, std::size_t bytes) const {
  if (streaming_copies) {
    stream_copy(dst, src, bytes);
  } else {
    copy_bytes(dst, src, bytes);
  }
}

bool StreamRunner::copy_some(std::size_t max_bytes) {
  if (copy_left == 0) return false;
  const std::size_t k = std::min(copy_left, max_bytes);
  copy_into_place(copy_dst, copy_src, k);
  copy_dst += k;
  copy_src += k;
  copy_left -= k;
  return true;
}

namespace {

// Note [shm stream alignment]
// Reducing straight out of a shared ring reads the peer's elements in place, so they must sit at addresses
// aligned for their type. A stream through a ring of the default size (a multiple of 8 bytes, page-aligned) keeps
// that when every call's stream is a multiple of 8 bytes long, which it is not by itself (a barrier sends one
// byte per rank; a bf16 tensor of odd length): so over a peekable pair (shared memory) both ends pad each call's
// stream to a multiple of kStreamAlign bytes, the sender with zeros, the receiver into a scratch it ignores.
// Over TCP nothing changes on the wire. An element that still sits misaligned (a ring of odd size, as tests use)
// is copied to the aligned scratch before it is reduced.
constexpr std::size_t kStreamAlign = 8;
constexpr char kZeros[kStreamAlign] = {};

std::size_t pad_for(std::size_t bytes) { return (kStreamAlign - bytes % kStreamAlign) % kStreamAlign; }

}  // namespace

absl::Status StreamRunner::run(const Streams& planned) {
  // Note [shm stream alignment].
  const Streams* use = &planned;
  Streams padded;
  std::size_t send_bytes = 0, recv_bytes = 0;
  for (const auto& c : planned.sends) send_bytes += c.bytes;
  for (const auto& c : planned.recvs) recv_bytes += c.bytes;
  const bool pad_send = send_pair != nullptr && send_pair->peekable() && pad_for(send_bytes) > 0;
  const bool pad_recv = recv_pair != nullptr && recv_pair->peekable() && pad_for(recv_bytes) > 0;
  if (pad_send || pad_recv) {
    padded = planned;
    if (pad_send) padded.sends.push_back({kZeros, pad_for(send_bytes), -1});
    if (pad_recv) padded.recvs.push_back({pad_in_, pad_for(recv_bytes), StreamRecvMode::kCopy, false, nullptr});
    use = &padded;
  }
  const std::vector<StreamSend>& sends = use->sends;
  const std::vector<StreamRecv>& recvs = use->recvs;
  for (const auto& c : sends) send_total_ += c.bytes;
  for (const auto& c : recvs) recv_total_ += c.bytes;
  const int send_fd = send_pair ? send_pair->poll_fd() : -1;
  const int recv_fd = recv_pair ? recv_pair->poll_fd() : -1;
  const bool pollable = (send_pair == nullptr || send_fd >= 0) && (recv_pair == nullptr || recv_fd >= 0);
  const bool peek = recv_pair != nullptr && recv_pair->peekable();
  // Pairs without a poll_fd: wait on their wake-up counter (transport.h), shared by both pairs or not.
  Pair* waker = nullptr;
  bool shared_waker = false;
  if (!pollable) {
    const void* sk = send_pair ? send_pair->wake_key() : nullptr;
    const void* rk = recv_pair ? recv_pair->wake_key() : nullptr;
    waker = sk != nullptr ? send_pair : rk != nullptr ? recv_pair : nullptr;
    const void* key = waker ? waker->wake_key() : nullptr;
    shared_waker = waker != nullptr && (send_pair == nullptr || sk == key) && (recv_pair == nullptr || rk == key);
  }
  std::size_t si = 0, soff = 0, ri = 0, roff = 0;
  std::int64_t recv_done = 0;  // number of completed recv chunks
  absl::Time spin_until = absl::InfiniteFuture();
  while (si < sends.size() || ri < recvs.size()) {
    bool progress = false;
    // Read before trying the pairs, so a wake-up in between is not lost (Note [shm doorbells]).
    const std::uint32_t seen = waker ? waker->wake_seq() : 0;
    // Send as much as the pair takes of ready chunks.
    while (si < sends.size() && sends[si].after_recv < recv_done) {
      const StreamSend& c = sends[si];
      if (c.bytes == 0) {
        ++si;
        continue;
      }
      const absl::StatusOr<std::size_t> k = send_pair->try_send(c.data + soff, send_piece(c.data + soff, c.bytes - soff));
      if (!k.ok()) return lost(send_peer, "sending", k.status());
      if (*k == 0) break;
      copy_sent(c.data + soff, *k);  // Note [local copy]
      progress = true;
      soff += *k;
      sent_bytes_ += *k;
      if (soff == c.bytes) {
        ++si;
        soff = 0;
      }
    }
    // Receive.
    while (ri < recvs.size()) {
      const StreamRecv& c = recvs[ri];
      if (c.bytes == 0) {
        ++ri;
        ++recv_done;
        continue;
      }
      if (c.mode == StreamRecvMode::kReduce && peek) {
        // Reduce straight out of the transport's buffer (Note [chunk pipeline]).
        const absl::StatusOr<std::size_t> k = reduce_from_peek(c, roff);
        if (!k.ok()) return lost(recv_peer, "receiving", k.status());
        if (*k == 0) break;
        progress = true;
        recv_bytes_ += *k;
        if (roff == c.bytes) {
          ++ri;
          ++recv_done;
          roff = 0;
        }
        continue;
      }
      if (c.mode == StreamRecvMode::kCopy && peek && streaming_copies) {
        // Copy out of the transport's buffer with non-temporal stores (Note [streaming copies]).
        const auto p = recv_pair->peek(c.bytes - roff);
        if (!p.ok()) return lost(recv_peer, "receiving", p.status());
        if (p->second == 0) break;
        copy_into_place(c.dst + roff, p->first, p->second);
        recv_pair->consume(p->second);
        progress = true;
        roff += p->second;
        recv_bytes_ += p->second;
        if (roff == c.bytes) {
          ++ri;
          ++recv_done;
          roff = 0;
        }
        continue;
      }
      char* dst = c.mode == StreamRecvMode::kReduce ? scratch : c.dst;
      const absl::StatusOr<std::size_t> k = recv_pair->try_recv(dst + roff, c.bytes - roff);
      if (!k.ok()) return lost(recv_peer, "receiving", k.status());
      if (*k == 0) break;
      progress = true;
      roff += *k;
      recv_bytes_ += *k;
      if (roff == c.bytes) {
        if (c.mode == StreamRecvMode::kReduce) {
          tcp_reduce::combine(c.out ? c.out : c.dst, c.dst, scratch, c.bytes / dtype_size(dtype), dtype, kind,
                              c.finalize ? divide_by : 0);
        } else if (c.mode == StreamRecvMode::kHeader) {
          if (auto st = check_header(*reinterpret_cast<const CallHeader*>(c.dst)); !st.ok()) return st;
        }
        ++ri;
        ++recv_done;
        roff = 0;
      }
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
    if (now < spin_until || (!pollable && waker == nullptr)) {
      // Busy-poll a little before sleeping (DESIGN.md section 9); yield so that, when ranks outnumber
      // cores, the rank we wait for gets the CPU.
      sched_yield();
      continue;
    }
    if (!pollable) {
      // Block on the wake-up counter until the deadline, but at most kLivenessPoll: a peer process that died
      // rings nothing, check_peer() notices it (Note [shm doorbells] in shm_transport.cc). When only one of
      // the pairs has the counter (a TCP and a shared-memory neighbour), the other is tried every millisecond.
      const absl::Time until = std::min(deadline, now + (shared_waker ? kLivenessPoll : absl::Milliseconds(1)));
      if (!waker->wait_wake(seen, until)) {
        if (send_pair) send_pair->check_peer();
        if (recv_pair) recv_pair->check_peer();
      }
      spin_until = absl::InfiniteFuture();
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
    if (rc < 0 && errno != EINTR) {
      return lost(recv_peer >= 0 ? recv_peer : send_peer, "polling", absl::UnavailableError(std::strerror(errno)));
    }
    for (nfds_t i = 0; rc > 0 && i < np; ++i) {
      // A hang-up on the send side only (we are not receiving from it) is an error now; on the recv side
      // try_recv above reports it (after draining what is buffered).
      const bool send_side_only = p[i].fd == send_fd && p[i].fd != recv_fd;
      if (send_side_only && want_send && (p[i].revents & (POLLERR | POLLHUP))) {
        return lost(send_peer, "sending", absl::UnavailableError(std::strerror(ECONNRESET)));
      }
      if (send_side_only && !want_send && si < sends.size() && (p[i].revents & (POLLRDHUP | POLLHUP | POLLERR))) {
        return lost(send_peer, "sending", absl::UnavailableError(std::strerror(ECONNRESET)));
      }
    }
    spin_until = absl::InfiniteFuture();
  }
  copy_some(copy_left);
  return absl::OkStatus();
}

absl::StatusOr<std::size_t> StreamRunner::reduce_from_peek(const StreamRecv& c, std::size_t& roff) {
  const std::size_t elem = dtype_size(dtype);
  char* out = c.out ? c.out : c.dst;
  const int div = c.finalize ? divide_by : 0;
  if (part_len_ == 0) {
    const auto p = recv_pair->peek(c.bytes - roff);
    if (!p.ok()) return p.status();
    const std::size_t whole = p->second / elem * elem;
    if (whole > 0) {
      const char* src = p->first;
      if (reinterpret_cast<std::uintptr_t>(src) % elem != 0) {
        // Misaligned in the ring (Note [shm stream alignment]): copy first; scratch holds a whole chunk.
        copy_bytes(scratch, src, whole);
        src = scratch;
      }
      tcp_reduce::combine(out + roff, c.dst + roff, src, whole / elem, dtype, kind, div);
      recv_pair->consume(whole);
      roff += whole;
      return whole;
    }
    if (p->second == 0) return std::size_t{0};
  }
  // Less than one element readable in place (it wraps around the ring, or has not all arrived): collect it.
  const absl::StatusOr<std::size_t> k = recv_pair->try_recv(part_ + part_len_, elem - part_len_);
  if (!k.ok()) return k.status();
  part_len_ += *k;
  if (part_len_ == elem) {
    tcp_reduce::combine(out + roff, c.dst + roff, part_, 1, dtype, kind, div);
    roff += elem;
    part_len_ = 0;
  }
  return *k;
}

absl::Status StreamRunner::check_header(const CallHeader& got) const {
  if (std::memcmp(&got, expected, sizeof(CallHeader)) == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(what, ": ranks disagree: expected rank ", recv_peer, " to issue ",
                                                 describe_call_header(*expected), " as this rank does, found ",
                                                 describe_call_header(got)));
}

absl::Status StreamRunner::lost(int peer, const char* doing, const absl::Status& why) const {
  return absl::UnavailableError(absl::StrCat(what, ": connection to rank ", peer, " lost while ", doing, " (",
                                             why.message(), "; sent ", sent_bytes_, " of ", send_total_,
                                             " bytes, received ", recv_bytes_, " of ", recv_total_, ")",
                                             closed_peers()));
}

// "; peers whose connections had closed: rank 0, rank 2": the neighbour that closed may only be echoing a failure
// elsewhere (it aborted), so every peer that hung up is named (a dead rank's connections all close).
// Waits up to 50 ms for the hang-ups to arrive: a dead process's sockets close one by one, and the echo
// of an abort can overtake them. Pairs without a poll_fd are not named.
std::string StreamRunner::closed_peers() const {
  std::vector<pollfd> open;
  std::vector<int> open_ranks, closed;
  for (std::size_t i = 0; i < all_pairs.size(); ++i) {
    if (all_pairs[i] == nullptr || all_pairs[i]->hangup_fd() < 0) continue;
    open.push_back(pollfd{all_pairs[i]->hangup_fd(), POLLRDHUP, 0});
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

absl::Status StreamRunner::timed_out(bool sending, bool receiving) const {
  std::string who;
  if (receiving) absl::StrAppend(&who, "rank ", recv_peer, " (received ", recv_bytes_, " of ", recv_total_, " bytes)");
  if (sending) {
    absl::StrAppend(&who, who.empty() ? "" : " and ", "rank ", send_peer, " (sent ", sent_bytes_, " of ", send_total_,
                    " bytes)");
  }
  return absl::DeadlineExceededError(absl::StrCat(what, ": deadline exceeded waiting for ", who));
}

}  // namespace shardkit::comm
