// Shared-memory transport: the Pair (transport.h) between two process ranks on one host, over POSIX shared
// memory (DESIGN.md section 2; issue 15 item 2). shm_rendezvous.h decides which pairs use it and builds them.
//
// Every rank of a group creates one segment (ShmSegment::create, shm_open + posix_fallocate + mmap) holding its
// doorbell and one inbound ring per other rank on its host; every other local rank maps it
// (ShmSegment::open). The ring from rank p to rank r lives in r's segment (Note [shm rings] in shm_transport.cc):
// p copies into it (try_send), r copies out of it (try_recv) or reduces straight out of it (peek / consume).
// Once every local rank has mapped the segments, their names are unlinked (shm_rendezvous.cc), so a crash leaks
// nothing: the memory goes away with the last mapping.
//
// Waiting (Note [shm doorbells]): the writer of a ring and the reader who frees space ring the other rank's
// doorbell, a futex word in that rank's segment; a rank's pairs share its doorbell (wake_key), so the runner
// waits for its send and receive pairs at once, after a bounded spin, until the call's deadline.
// Liveness: each ShmPair keeps the pair's TCP connection from the rendezvous, unused for data; a peer process
// that dies closes it (hangup_fd, check_peer), so a dead peer is an error naming it, as over TCP. shutdown()
// marks both rings closed, rings both doorbells and shuts the connection down.
//
// Thread-safety: as Pair. ShmSegment: immutable after creation (the mapped memory is shared by design).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/statusor.h"
#include "common/comm/tcp_socket.h"
#include "common/comm/transport.h"

namespace shardkit::comm {

// One rank's mapped segment: a header (magic, the creator's nonce and pid, the doorbell) and `rings` inbound
// rings of `ring_bytes` each.
class ShmSegment {
 public:
  // Creates a new segment named `name` ("/..."; refused when the name exists: O_EXCL, mode 0600) and maps it.
  // ResourceExhausted when /dev/shm has no room for it (posix_fallocate, so a full /dev/shm is an error here,
  // not SIGBUS later).
  static absl::StatusOr<std::shared_ptr<ShmSegment>> create(const std::string& name, int rings, std::size_t ring_bytes,
                                                            std::uint64_t nonce);
  // Maps an existing segment; InvalidArgument / NotFound when it is not the one expected (size, magic, nonce).
  static absl::StatusOr<std::shared_ptr<ShmSegment>> open(const std::string& name, int rings, std::size_t ring_bytes,
                                                          std::uint64_t nonce);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  // shm_unlink(name()) (the mapping stays); NotFound is fine (already unlinked).
  absl::Status unlink() const;
  const std::string& name() const { return name_; }
  int rings() const { return rings_; }
  std::size_t ring_bytes() const { return ring_bytes_; }
  // Bytes of a segment with these dimensions.
  static std::size_t size_for(int rings, std::size_t ring_bytes);

  struct Header;
  struct Ring;
  Header* header() const;
  Ring* ring(int i) const;
  char* ring_data(int i) const;

 private:
  ShmSegment(std::string name, void* base, std::size_t size, int rings, std::size_t ring_bytes)
      : name_(std::move(name)), base_(base), size_(size), rings_(rings), ring_bytes_(ring_bytes) {}
  std::string name_;
  void* base_ = nullptr;
  std::size_t size_ = 0;
  int rings_ = 0;
  std::size_t ring_bytes_ = 0;
};

class ShmPair final : public Pair {
 public:
  // This rank's end towards one local peer: `self` is this rank's segment (its ring `from_peer` is the
  // inbound ring from the peer), `peer` the peer's segment (its ring `to_peer` is this rank's outbound ring).
  // `liveness`: the pair's TCP connection from the rendezvous (closed when the peer's process dies).
  ShmPair(std::shared_ptr<ShmSegment> self, int from_peer, std::shared_ptr<ShmSegment> peer, int to_peer,
          tcp::Socket liveness);
  ~ShmPair() override;

  absl::StatusOr<std::size_t> try_send(const void* data, std::size_t n) override;
  absl::StatusOr<std::size_t> try_recv(void* data, std::size_t n) override;
  int poll_fd() const override { return -1; }
  void shutdown() override;

  const void* wake_key() const override { return self_.get(); }
  std::uint32_t wake_seq() const override;
  bool wait_wake(std::uint32_t seen, absl::Time until) override;
  void check_peer() override;
  int hangup_fd() const override { return liveness_.fd(); }
  bool peekable() const override { return true; }
  absl::StatusOr<std::pair<const char*, std::size_t>> peek(std::size_t n) override;
  void consume(std::size_t n) override;

 private:
  absl::Status recv_closed() const;

  std::shared_ptr<ShmSegment> self_, peer_;
  ShmSegment::Ring* in_;   // in self_: the peer writes, this rank reads
  char* in_data_;
  ShmSegment::Ring* out_;  // in peer_: this rank writes, the peer reads
  char* out_data_;
  std::size_t cap_;        // in_ capacity
  std::size_t out_cap_;
  tcp::Socket liveness_;
  std::atomic<bool> shut_{false};
  std::atomic<bool> peer_gone_{false};
};

// Rings a segment's doorbell (wakes its rank if it sleeps on it). For ShmPair and tests.
void ring_doorbell(ShmSegment& segment);

}  // namespace shardkit::comm
