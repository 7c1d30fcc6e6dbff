#include "common/comm/shm_transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>

#include "absl/strings/str_cat.h"
#include "common/base/check.h"

namespace shardkit::comm {

// Note [shm rings]
// A ring is single-producer single-consumer: `head` counts the bytes the writer (the peer) has put in, `tail`
// the bytes the reader (the segment's rank) has taken out; both only grow (64-bit: never wrap). The writer
// copies into data[head % cap ...] only where head - tail < cap, then publishes head with release order; the
// reader copies (or reduces) out of data[tail % cap ...] up to the head it read with acquire order, then
// publishes tail with release order, which hands the bytes back. `writer_closed` / `reader_closed` end the
// stream (shutdown); a reader drains what is in the ring before it reports the writer closed. No message
// boundaries are kept, as the Pair contract says. The control words sit on cache lines of their own, and
// std::atomic<std::uint64_t> is lock-free and address-free, so it works between processes.
//
// Note [shm doorbells]
// Every segment has one doorbell: a 32-bit futex word `bell` that counts rings, and `sleepers`. Whoever
// changes something a rank may be waiting for (a writer that published bytes, a reader that freed space, a
// shutdown) rings that rank's doorbell: bell.fetch_add(1), then FUTEX_WAKE only if sleepers > 0 (a wake-up
// costs a system call, ~50 us when the sleeper is descheduled: DESIGN.md section 9). A waiter reads bell
// (wake_seq) before it tries its pairs; when they moved nothing and its spin is over, it increments sleepers
// and calls FUTEX_WAIT(bell, seen, timeout), which returns at once if bell changed since it was read: a ring
// between the read and the wait is never lost (both sides use sequentially consistent read-modify-writes, so
// either the ringer sees the sleeper or the waiter's futex sees the new bell). The futex is a shared one (not
// FUTEX_PRIVATE_FLAG): the word is in memory of several processes. The timeout is the call's deadline, but at
// most kLivenessPoll, after which the runner asks check_peer() whether the peer's process still lives
// (its TCP connection closed): a SIGKILLed process rings nothing.

namespace {

constexpr std::uint32_t kMagic = 0x4d48534b;  // "KSHM"
constexpr std::uint32_t kVersion = 1;
constexpr std::size_t kLine = 64;

std::size_t round_up(std::size_t x, std::size_t a) { return (x + a - 1) / a * a; }

long futex(std::atomic<std::uint32_t>* word, int op, std::uint32_t val, const timespec* timeout) {
  return ::syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(word), op, val, timeout, nullptr, 0);
}

}  // namespace

struct ShmSegment::Header {
  std::uint32_t magic;
  std::uint32_t version;
  std::uint64_t nonce;
  std::int64_t pid;
  std::uint64_t rings;
  std::uint64_t ring_bytes;
  alignas(kLine) std::atomic<std::uint32_t> bell;
  std::atomic<std::uint32_t> sleepers;
};

struct ShmSegment::Ring {
  alignas(kLine) std::atomic<std::uint64_t> head;  // writer
  alignas(kLine) std::atomic<std::uint64_t> tail;  // reader
  alignas(kLine) std::atomic<std::uint32_t> writer_closed;
  std::atomic<std::uint32_t> reader_closed;
};

static_assert(std::atomic<std::uint64_t>::is_always_lock_free && std::atomic<std::uint32_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<std::uint32_t>) == sizeof(std::uint32_t));

namespace {
std::size_t header_bytes() { return round_up(sizeof(ShmSegment::Header), kLine); }
std::size_t rings_bytes(int rings) { return round_up(static_cast<std::size_t>(rings) * sizeof(ShmSegment::Ring), 4096); }
}  // namespace

std::size_t ShmSegment::size_for(int rings, std::size_t ring_bytes) {
  return round_up(header_bytes(), 4096) + rings_bytes(rings) + static_cast<std::size_t>(rings) * round_up(ring_bytes, 4096);
}

ShmSegment::Header* ShmSegment::header() const { return static_cast<Header*>(base_); }
ShmSegment::Ring* ShmSegment::ring(int i) const {
  return reinterpret_cast<Ring*>(static_cast<char*>(base_) + round_up(header_bytes(), 4096)) + i;
}
char* ShmSegment::ring_data(int i) const {
  return static_cast<char*>(base_) + round_up(header_bytes(), 4096) + rings_bytes(rings_) +
         static_cast<std::size_t>(i) * round_up(ring_bytes_, 4096);
}

absl::StatusOr<std::shared_ptr<ShmSegment>> ShmSegment::create(const std::string& name, int rings,
                                                               std::size_t ring_bytes, std::uint64_t nonce) {
  const std::size_t size = size_for(rings, ring_bytes);
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("cannot create the shared-memory segment '", name,
                                               "' (shm_open): ", std::strerror(errno)));
  }
  auto fail = [&](absl::StatusCode code, const std::string& what, int err) {
    ::close(fd);
    ::shm_unlink(name.c_str());
    return absl::Status(code, absl::StrCat("cannot create the shared-memory segment '", name, "' of ", size,
                                           " bytes (", what, "): ", std::strerror(err)));
  };
  // posix_fallocate, not ftruncate alone: a /dev/shm without room is an error now, not a SIGBUS on first touch.
  if (const int e = ::posix_fallocate(fd, 0, static_cast<off_t>(size)); e != 0) {
    return fail(e == ENOSPC ? absl::StatusCode::kResourceExhausted : absl::StatusCode::kUnavailable,
                "posix_fallocate; is /dev/shm large enough?", e);
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) return fail(absl::StatusCode::kUnavailable, "mmap", errno);
  ::close(fd);
  auto* h = new (base) Header{};
  h->magic = kMagic;
  h->version = kVersion;
  h->nonce = nonce;
  h->pid = ::getpid();
  h->rings = static_cast<std::uint64_t>(rings);
  h->ring_bytes = ring_bytes;
  std::shared_ptr<ShmSegment> seg(new ShmSegment(name, base, size, rings, ring_bytes));
  for (int i = 0; i < rings; ++i) new (seg->ring(i)) Ring{};
  return seg;
}

absl::StatusOr<std::shared_ptr<ShmSegment>> ShmSegment::open(const std::string& name, int rings,
                                                             std::size_t ring_bytes, std::uint64_t nonce) {
  const std::size_t size = size_for(rings, ring_bytes);
  const int fd = ::shm_open(name.c_str(), O_RDWR | O_CLOEXEC, 0);
  if (fd < 0) {
    const int e = errno;
    return absl::Status(e == ENOENT ? absl::StatusCode::kNotFound : absl::StatusCode::kUnavailable,
                        absl::StrCat("cannot open the shared-memory segment '", name, "' (shm_open): ",
                                     std::strerror(e)));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != size) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("shared-memory segment '", name, "': expected ", size,
                                                   " bytes, found ", st.st_size));
  }
  void* base = ::mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  const int e = errno;
  ::close(fd);
  if (base == MAP_FAILED) {
    return absl::UnavailableError(absl::StrCat("cannot map the shared-memory segment '", name, "': ", std::strerror(e)));
  }
  std::shared_ptr<ShmSegment> seg(new ShmSegment(name, base, size, rings, ring_bytes));
  const Header* h = seg->header();
  if (h->magic != kMagic || h->version != kVersion || h->nonce != nonce || h->rings != static_cast<std::uint64_t>(rings) ||
      h->ring_bytes != ring_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "shared-memory segment '", name, "' is not the one expected: expected magic ", kMagic, " version ", kVersion,
        " nonce ", nonce, ", found ", h->magic, " ", h->version, " ", h->nonce));
  }
  return seg;
}

ShmSegment::~ShmSegment() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

absl::Status ShmSegment::unlink() const {
  if (::shm_unlink(name_.c_str()) == 0 || errno == ENOENT) return absl::OkStatus();
  return absl::UnavailableError(absl::StrCat("shm_unlink('", name_, "'): ", std::strerror(errno)));
}

void ring_doorbell(ShmSegment& segment) {
  ShmSegment::Header* h = segment.header();
  h->bell.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) > 0) futex(&h->bell, FUTEX_WAKE, INT_MAX, nullptr);
}

ShmPair::ShmPair(std::shared_ptr<ShmSegment> self, int from_peer, std::shared_ptr<ShmSegment> peer, int to_peer,
                 tcp::Socket liveness)
    : self_(std::move(self)),
      peer_(std::move(peer)),
      in_(self_->ring(from_peer)),
      in_data_(self_->ring_data(from_peer)),
      out_(peer_->ring(to_peer)),
      out_data_(peer_->ring_data(to_peer)),
      cap_(self_->ring_bytes()),
      out_cap_(peer_->ring_bytes()),
      liveness_(std::move(liveness)) {}

ShmPair::~ShmPair() { shutdown(); }

absl::StatusOr<std::size_t> ShmPair::try_send(const void* data, std::size_t n) {
  if (shut_.load(std::memory_order_acquire)) return absl::UnavailableError("shut down on this rank");
  if (out_->reader_closed.load(std::memory_order_acquire) != 0) return absl::UnavailableError("closed by the peer");
  if (peer_gone_.load(std::memory_order_acquire)) {
    return absl::UnavailableError("the peer's process has gone (its connection closed)");
  }
  const std::uint64_t head = out_->head.load(std::memory_order_relaxed);
  const std::uint64_t tail = out_->tail.load(std::memory_order_acquire);
  const std::size_t room = out_cap_ - static_cast<std::size_t>(head - tail);
  const std::size_t k = std::min(n, room);
  if (k == 0) return std::size_t{0};
  const std::size_t at = static_cast<std::size_t>(head % out_cap_);
  const std::size_t first = std::min(k, out_cap_ - at);
  std::memcpy(out_data_ + at, data, first);
  if (k > first) std::memcpy(out_data_, static_cast<const char*>(data) + first, k - first);
  out_->head.store(head + k, std::memory_order_release);
  ring_doorbell(*peer_);
  return k;
}

absl::Status ShmPair::recv_closed() const {
  if (shut_.load(std::memory_order_acquire)) return absl::UnavailableError("shut down on this rank");
  if (in_->writer_closed.load(std::memory_order_acquire) != 0) return absl::UnavailableError("closed by the peer");
  if (peer_gone_.load(std::memory_order_acquire)) {
    return absl::UnavailableError("the peer's process has gone (its connection closed)");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::pair<const char*, std::size_t>> ShmPair::peek(std::size_t n) {
  // The closed flags are read before head: bytes published before a close are drained first.
  const absl::Status closed = recv_closed();
  const std::uint64_t tail = in_->tail.load(std::memory_order_relaxed);
  const std::uint64_t head = in_->head.load(std::memory_order_acquire);
  const std::size_t avail = static_cast<std::size_t>(head - tail);
  if (avail == 0) {
    if (!closed.ok()) return closed;
    return std::pair<const char*, std::size_t>{in_data_, 0};
  }
  const std::size_t at = static_cast<std::size_t>(tail % cap_);
  return std::pair<const char*, std::size_t>{in_data_ + at, std::min({n, avail, cap_ - at})};
}

void ShmPair::consume(std::size_t n) {
  if (n == 0) return;
  in_->tail.store(in_->tail.load(std::memory_order_relaxed) + n, std::memory_order_release);
  ring_doorbell(*peer_);  // the peer may wait for room
}

absl::StatusOr<std::size_t> ShmPair::try_recv(void* data, std::size_t n) {
  std::size_t done = 0;
  for (int piece = 0; piece < 2 && done < n; ++piece) {  // at most two pieces: up to the ring's end, then from its start
    auto p = peek(n - done);
    if (!p.ok()) {
      if (done > 0) break;
      return p.status();
    }
    if (p->second == 0) break;
    std::memcpy(static_cast<char*>(data) + done, p->first, p->second);
    in_->tail.store(in_->tail.load(std::memory_order_relaxed) + p->second, std::memory_order_release);
    done += p->second;
  }
  if (done > 0) ring_doorbell(*peer_);
  return done;
}

void ShmPair::shutdown() {
  if (shut_.exchange(true)) return;
  out_->writer_closed.store(1, std::memory_order_release);
  in_->reader_closed.store(1, std::memory_order_release);
  ring_doorbell(*peer_);
  ring_doorbell(*self_);  // this rank's own comm thread may sleep on it
  if (liveness_.valid()) ::shutdown(liveness_.fd(), SHUT_RDWR);
}

std::uint32_t ShmPair::wake_seq() const { return self_->header()->bell.load(std::memory_order_seq_cst); }

bool ShmPair::wait_wake(std::uint32_t seen, absl::Time until) {
  ShmSegment::Header* h = self_->header();
  const absl::Duration left = until - absl::Now();
  if (left <= absl::ZeroDuration()) return h->bell.load() != seen;
  const timespec ts = absl::ToTimespec(left);
  h->sleepers.fetch_add(1, std::memory_order_seq_cst);
  futex(&h->bell, FUTEX_WAIT, seen, &ts);
  h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  return h->bell.load(std::memory_order_seq_cst) != seen;
}

void ShmPair::check_peer() {
  if (!liveness_.valid() || peer_gone_.load()) return;
  pollfd p{liveness_.fd(), POLLRDHUP, 0};
  if (::poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR))) {
    peer_gone_.store(true, std::memory_order_release);
  }
}

}  // namespace shardkit::comm
