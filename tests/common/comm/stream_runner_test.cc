// StreamRunner (stream_runner.h) over a transport that is not TCP: an in-memory Pair (a bounded byte pipe each
// way, no poll_fd) between rank threads. The ring plans run over it unchanged, which is the point of the
// rendezvous / transport / algorithm split; also the runner's errors (a lost connection names the peer, a
// disagreeing header names both calls, a silent peer hits the deadline).
#include "common/comm/stream_runner.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "common/comm/ring_plan.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;

// One direction: a byte queue holding at most `capacity` bytes (so large sends go in pieces).
struct Pipe {
  std::mutex mu;
  std::deque<char> bytes;
  bool closed = false;
  std::size_t capacity = 64;
};

class MemoryPair final : public Pair {
 public:
  MemoryPair(std::shared_ptr<Pipe> out, std::shared_ptr<Pipe> in) : out_(std::move(out)), in_(std::move(in)) {}

  absl::StatusOr<std::size_t> try_send(const void* data, std::size_t n) override {
    std::lock_guard<std::mutex> lock(out_->mu);
    if (out_->closed) return absl::UnavailableError("closed by the peer");
    const std::size_t k = std::min(n, out_->capacity - out_->bytes.size());
    const char* p = static_cast<const char*>(data);
    out_->bytes.insert(out_->bytes.end(), p, p + k);
    return k;
  }
  absl::StatusOr<std::size_t> try_recv(void* data, std::size_t n) override {
    std::lock_guard<std::mutex> lock(in_->mu);
    const std::size_t k = std::min(n, in_->bytes.size());
    if (k == 0 && in_->closed) return absl::UnavailableError("closed by the peer");
    std::copy_n(in_->bytes.begin(), k, static_cast<char*>(data));
    in_->bytes.erase(in_->bytes.begin(), in_->bytes.begin() + static_cast<std::ptrdiff_t>(k));
    return k;
  }
  int poll_fd() const override { return -1; }
  void shutdown() override {
    for (Pipe* p : {out_.get(), in_.get()}) {
      std::lock_guard<std::mutex> lock(p->mu);
      p->closed = true;
    }
  }

 private:
  std::shared_ptr<Pipe> out_, in_;
};

// pairs[a][b]: rank a's end of its connection to rank b.
std::vector<std::vector<std::unique_ptr<Pair>>> memory_mesh(int n) {
  std::vector<std::vector<std::unique_ptr<Pair>>> pairs(static_cast<std::size_t>(n));
  for (auto& row : pairs) row.resize(static_cast<std::size_t>(n));
  for (int a = 0; a < n; ++a)
    for (int b = a + 1; b < n; ++b) {
      auto ab = std::make_shared<Pipe>(), ba = std::make_shared<Pipe>();
      pairs[static_cast<std::size_t>(a)][static_cast<std::size_t>(b)] = std::make_unique<MemoryPair>(ab, ba);
      pairs[static_cast<std::size_t>(b)][static_cast<std::size_t>(a)] = std::make_unique<MemoryPair>(ba, ab);
    }
  return pairs;
}

CallHeader header(std::int64_t numel) {
  CallHeader h;
  h.kind = static_cast<std::uint8_t>(CollectiveKind::all_reduce);
  h.numel = numel;
  return h;
}

// Runs one rank's all_reduce (sum, or avg when divide) of `data` over `pairs`.
absl::Status run_all_reduce(int r, int n, std::vector<float>& data, std::vector<std::unique_ptr<Pair>>& pairs,
                            const CallHeader& out_h, absl::Duration timeout, bool divide = false) {
  const std::int64_t numel = static_cast<std::int64_t>(data.size());
  const ChunkPlan plan = plan_ring_all_reduce(r, n, numel, /*chunk_elems=*/5);
  const CallHeader expected = header(numel);
  CallHeader in_h;
  const Streams streams = streams_for_plan(plan, reinterpret_cast<char*>(data.data()), sizeof(float), &out_h, &in_h);
  std::vector<float> scratch(5);
  StreamRunner runner;
  for (auto& p : pairs) runner.all_pairs.push_back(p.get());
  runner.send_peer = plan.send_peer;
  runner.recv_peer = plan.recv_peer;
  runner.send_pair = pairs[static_cast<std::size_t>(plan.send_peer)].get();
  runner.recv_pair = pairs[static_cast<std::size_t>(plan.recv_peer)].get();
  runner.divide_by = divide ? n : 0;
  runner.scratch = reinterpret_cast<char*>(scratch.data());
  runner.expected = &expected;
  runner.deadline = absl::Now() + timeout;
  runner.spin = absl::Microseconds(10);
  runner.what = "all_reduce #0 on rank " + std::to_string(r);
  return runner.run(streams);
}

TEST(StreamRunner, RingAllReduceRunsOverAnInMemoryTransport) {
  for (int n : {2, 3, 4}) {
    for (bool divide : {false, true}) {
      auto pairs = memory_mesh(n);
      const std::int64_t numel = 103;  // segments and chunks of uneven sizes
      std::vector<std::vector<float>> data(static_cast<std::size_t>(n));
      std::vector<absl::Status> status(static_cast<std::size_t>(n));
      std::vector<std::thread> threads;
      for (int r = 0; r < n; ++r) {
        auto& d = data[static_cast<std::size_t>(r)];
        for (std::int64_t i = 0; i < numel; ++i) d.push_back(static_cast<float>(r * 1000 + i));
        threads.emplace_back([&, r] {
          status[static_cast<std::size_t>(r)] = run_all_reduce(r, n, data[static_cast<std::size_t>(r)],
                                                              pairs[static_cast<std::size_t>(r)], header(numel),
                                                              absl::Seconds(60), divide);
        });
      }
      for (auto& t : threads) t.join();
      for (int r = 0; r < n; ++r) {
        ASSERT_TRUE(status[static_cast<std::size_t>(r)].ok()) << status[static_cast<std::size_t>(r)];
        for (std::int64_t i = 0; i < numel; ++i) {
          float want = 0;
          for (int q = 0; q < n; ++q) want += static_cast<float>(q * 1000 + i);
          if (divide) want /= static_cast<float>(n);
          ASSERT_EQ(data[static_cast<std::size_t>(r)][static_cast<std::size_t>(i)], want)
              << "n " << n << " rank " << r << " element " << i;
        }
      }
    }
  }
}

TEST(StreamRunner, ALostConnectionNamesThePeer) {
  auto pairs = memory_mesh(2);
  pairs[1][0]->shutdown();  // rank 1 goes away before rank 0 runs
  std::vector<float> d(50, 1.0f);
  const absl::Status st = run_all_reduce(0, 2, d, pairs[0], header(50), absl::Seconds(60));
  EXPECT_EQ(st.code(), absl::StatusCode::kUnavailable) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("all_reduce #0 on rank 0: connection to rank 1 lost while"));
  EXPECT_THAT(std::string(st.message()), HasSubstr("closed by the peer"));
}

TEST(StreamRunner, ADisagreeingHeaderNamesBothCalls) {
  auto pairs = memory_mesh(2);
  std::vector<float> d0(10, 1.0f), d1(12, 1.0f);
  absl::Status s0, s1;
  std::thread t([&] { s1 = run_all_reduce(1, 2, d1, pairs[1], header(12), absl::Seconds(60)); });
  s0 = run_all_reduce(0, 2, d0, pairs[0], header(10), absl::Seconds(60));
  pairs[0][1]->shutdown();  // rank 1 may still wait for data rank 0 will not send
  t.join();
  EXPECT_EQ(s0.code(), absl::StatusCode::kInvalidArgument) << s0;
  EXPECT_THAT(std::string(s0.message()), HasSubstr("ranks disagree: expected rank 1 to issue all_reduce (#0, dtype f32, numel 10"));
  EXPECT_THAT(std::string(s0.message()), HasSubstr("found all_reduce (#0, dtype f32, numel 12"));
  EXPECT_FALSE(s1.ok());
}

TEST(StreamRunner, ASilentPeerFailsAtTheDeadlineNamingIt) {
  auto pairs = memory_mesh(2);
  std::vector<float> d(10, 1.0f);
  const absl::Time start = absl::Now();
  const absl::Status st = run_all_reduce(0, 2, d, pairs[0], header(10), absl::Milliseconds(200));
  EXPECT_EQ(st.code(), absl::StatusCode::kDeadlineExceeded) << st;
  EXPECT_THAT(std::string(st.message()), HasSubstr("deadline exceeded waiting for rank 1 (received 0 of"));
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
}

}  // namespace
}  // namespace shardkit::comm
