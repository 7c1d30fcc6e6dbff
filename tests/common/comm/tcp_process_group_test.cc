// TcpProcessGroup with ranks as threads of this process, over real loopback sockets and a real TcpStore:
// every collective x op x dtype against a scalar reference (n = 2, 3, 4; sizes 0, 1, 7 and 1,000,003; a tiny
// chunk size so the multi-chunk pipeline runs on small tensors), asynchrony, disagreement between ranks and
// the fault cases (a peer that disconnects, a rank that stops calling), each bounded in time.
// The same matrix runs with ranks as processes through shardrun in tcp_multiprocess_test.cc.
#include "common/comm/tcp_process_group.h"

#include <atomic>
#include <barrier>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <thread>

#include "absl/strings/match.h"
#include "common/comm/hash_store.h"
#include "common/comm/tcp_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/comm/tcp_test_ranks.h"
#include "tests/common/comm/tcp_test_util.h"

namespace shardkit::comm {
namespace {

using ::testing::AnyOf;
using ::testing::HasSubstr;
using ::testing::Not;
using tcp_testing::run_collective_matrix;
using tcp_testing::run_tcp_ranks;

TcpProcessGroupOptions small_chunks() {
  TcpProcessGroupOptions o;
  o.chunk_bytes = 24;  // 6 f32 / 12 bf16 / 3 i64 elements: multi-chunk and ragged last chunks
  o.transport = "tcp";  // on one host "auto" would pick shared memory (shm_transport_test.cc tests that)
  o.default_timeout = absl::Seconds(60);
  return o;
}

class TcpCollectives : public ::testing::TestWithParam<int> {};

TEST_P(TcpCollectives, EveryCollectiveOpAndDtypeMatchesTheReference) {
  const int n = GetParam();
  run_tcp_ranks(n, small_chunks(), [&](int, std::shared_ptr<TcpProcessGroup>& pg) {
    auto errors = run_collective_matrix(*pg, {0, 1, 7, 61}, {DType::f32, DType::bf16, DType::f16, DType::i64});
    EXPECT_THAT(errors, ::testing::IsEmpty());
  });
}

TEST_P(TcpCollectives, LargeTensorsWithTheDefaultChunk) {
  const int n = GetParam();
  TcpProcessGroupOptions o;
  o.default_timeout = absl::Seconds(60);
  run_tcp_ranks(n, o, [&](int, std::shared_ptr<TcpProcessGroup>& pg) {
    auto errors = run_collective_matrix(*pg, {1000003}, {DType::f32}, /*all_ops=*/false);
    EXPECT_THAT(errors, ::testing::IsEmpty());
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, TcpCollectives, ::testing::Values(2, 3, 4));


TEST(TcpProcessGroup, OneRankGroupIsLocal) {
  run_tcp_ranks(1, {}, [&](int, std::shared_ptr<TcpProcessGroup>& pg) {
    auto errors = run_collective_matrix(*pg, {0, 7}, {DType::f32, DType::i64});
    EXPECT_THAT(errors, ::testing::IsEmpty());
  });
}

TEST(TcpProcessGroup, CallsAreAsynchronousAndCompleteInOrder) {
  run_tcp_ranks(3, small_chunks(), [&](int r, std::shared_ptr<TcpProcessGroup>& pg) {
    std::vector<Tensor> ts;
    std::vector<std::shared_ptr<Work>> works;
    for (int k = 0; k < 8; ++k) {
      ts.push_back(Tensor::full({1000}, r + k, {}));
      works.push_back(pg->all_reduce(ts.back()));  // issued without waiting
    }
    for (int k = 0; k < 8; ++k) {
      ASSERT_TRUE(works[static_cast<std::size_t>(k)]->wait(absl::Seconds(30)).ok());
      EXPECT_TRUE(works[static_cast<std::size_t>(k)]->is_completed());
      EXPECT_EQ(ts[static_cast<std::size_t>(k)].item_at(999), 0 + 1 + 2 + 3 * k);
    }
    // Counters follow the ring-equivalent definition (comm_counters.h).
    const auto c = pg->counters().of(CollectiveKind::all_reduce);
    EXPECT_EQ(c.calls, 8);
    EXPECT_EQ(c.bytes_sent, 8 * (2 * 2 * 4000 / 3));
  });
}

TEST(TcpProcessGroup, SubGroupsFromRankLists) {
  run_tcp_ranks(4, small_chunks(), [&](int r, std::shared_ptr<TcpProcessGroup>& pg) {
    auto sub = pg->new_group(std::vector<int>{1, 3});
    ASSERT_TRUE(sub.ok()) << sub.status();
    if (r == 1 || r == 3) {
      ASSERT_NE(*sub, nullptr);
      EXPECT_EQ((*sub)->size(), 2);
      Tensor t = Tensor::full({5}, r, {});
      ASSERT_TRUE((*sub)->all_reduce(t)->wait().ok());
      EXPECT_EQ(t.item_at(4), 4);
    } else {
      EXPECT_EQ(*sub, nullptr);
    }
    ASSERT_TRUE(pg->barrier()->wait().ok());
  });
}

TEST(TcpProcessGroup, RanksThatDisagreeFailWithBothCalls) {
  run_tcp_ranks(2, small_chunks(), [&](int r, std::shared_ptr<TcpProcessGroup>& pg) {
    Tensor t = Tensor::zeros({r == 0 ? 10 : 12}, {});
    absl::Status st = pg->all_reduce(t, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(10)))->wait();
    ASSERT_FALSE(st.ok());
    EXPECT_THAT(std::string(st.message()), AnyOf(HasSubstr("ranks disagree"), HasSubstr("the group failed")));
    EXPECT_THAT(std::string(st.message()), HasSubstr("numel 1"));
    // Later calls fail at once, quoting the origin.
    absl::Status later = pg->barrier()->wait(absl::Seconds(10));
    EXPECT_FALSE(later.ok());
  });
}

TEST(TcpProcessGroup, APeerThatDisconnectsFailsEveryRankNamingIt) {
  const absl::Time start = absl::Now();
  run_tcp_ranks(4, small_chunks(), [&](int r, std::shared_ptr<TcpProcessGroup>& pg) {
    if (r == 2) {
      pg.reset();  // rank 2 goes away: its connections close
      return;
    }
    Tensor t = Tensor::full({100000}, 1, {});
    absl::Status st = pg->all_reduce(t, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(20)))->wait();
    ASSERT_FALSE(st.ok());
    EXPECT_THAT(std::string(st.message()), HasSubstr("rank 2")) << "rank " << r << ": " << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("all_reduce"));
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(15));
}

TEST(TcpProcessGroup, ARankThatStopsCallingFailsTheOthersAtTheDeadline) {
  const absl::Time start = absl::Now();
  std::atomic<int> done{0};
  run_tcp_ranks(3, small_chunks(), [&](int r, std::shared_ptr<TcpProcessGroup>& pg) {
    if (r == 2) {
      // Stays connected but never calls; leaves once the others have their errors.
      while (done.load() < 2) std::this_thread::yield();
      return;
    }
    Tensor t = Tensor::full({1000}, 1, {});
    absl::Status st = pg->all_reduce(t, tcp_testing::ar_opts(ReduceOp::sum(), absl::Milliseconds(500)))->wait();
    ++done;
    ASSERT_FALSE(st.ok());
    EXPECT_THAT(st.code(), AnyOf(absl::StatusCode::kDeadlineExceeded, absl::StatusCode::kAborted,
                                 absl::StatusCode::kUnavailable));
    if (r == 0) {
      EXPECT_THAT(std::string(st.message()), HasSubstr("rank 2"));  // rank 0 receives from rank 2
    }
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(10));
}

TEST(TcpProcessGroup, AbortFailsPendingAndLaterCallsWithTheReason) {
  run_tcp_ranks(2, small_chunks(), [&](int r, std::shared_ptr<TcpProcessGroup>& pg) {
    if (r == 0) pg->abort(absl::CancelledError("user stopped rank 0"));
    Tensor t = Tensor::full({10}, 1, {});
    absl::Status st = pg->all_reduce(t, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(10)))->wait();
    ASSERT_FALSE(st.ok());
    if (r == 0) {
      EXPECT_THAT(std::string(st.message()), HasSubstr("user stopped rank 0"));
    }
  });
}

// Two ranks over small_chunks(): rank 0 runs `rank0`; rank 1 connects and never calls, and leaves once rank 0's
// part has returned (also when an assertion ended it early).
void run_with_silent_rank1(const std::function<void(std::shared_ptr<TcpProcessGroup>&)>& rank0) {
  std::atomic<bool> rank0_done{false};
  run_tcp_ranks(2, small_chunks(), [&](int r, std::shared_ptr<TcpProcessGroup>& pg) {
    if (r == 1) {
      while (!rank0_done.load()) std::this_thread::yield();
      return;
    }
    struct Done {
      std::atomic<bool>& flag;
      ~Done() { flag = true; }
    } done{rank0_done};
    rank0(pg);
  });
}

TEST(TcpProcessGroup, DestroyingTheGroupWhileACallIsBetweenQueueAndStartIsPrompt) {
  // Rank 0's comm thread holds its all_reduce between taking it off the queue and starting it until the
  // destructor has begun; rank 1 never issues the call. The destructor must fail the call and return at once
  // instead of waiting for the call's deadline.
  std::promise<void> held;
  run_with_silent_rank1([&](std::shared_ptr<TcpProcessGroup>& pg) {
    pg->set_testing_after_dequeue([&](const std::function<void()>& wait_for_destruction) {
      held.set_value();
      wait_for_destruction();
    });
    Tensor t = Tensor::full({1000}, 1, {});
    std::shared_ptr<Work> work = pg->all_reduce(t, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(30)));
    held.get_future().wait();
    const absl::Time start = absl::Now();
    pg.reset();
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    absl::Status st = work->wait(absl::Seconds(1));
    EXPECT_EQ(st.code(), absl::StatusCode::kAborted) << st;
    EXPECT_THAT(std::string(st.message()), HasSubstr("destroyed"));
  });
}

// Every failed call's error starts with the call itself, also when the group had already failed for another
// call: the first failure follows as the cause (as over MPI, MpiFaults.ACallFailingAfterItsGroupFailedNamesItselfFirst).
TEST(TcpProcessGroup, ACallWhoseDeadlinePassesAfterItsGroupFailedNamesItselfFirst) {
  // Rank 0's comm thread holds its first call between queue and start; rank 1 never calls. Call #0's deadline
  // (1 s) fails the group, then call #1's (2 s) passes while the comm thread still holds #0.
  run_with_silent_rank1([&](std::shared_ptr<TcpProcessGroup>& pg) {
    pg->set_testing_after_dequeue([](const std::function<void()>& wait_for_destruction) { wait_for_destruction(); });
    Tensor a = Tensor::full({10}, 1, {}), b = Tensor::full({10}, 1, {});
    std::shared_ptr<Work> first = pg->all_reduce(a, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(1)));
    std::shared_ptr<Work> second = pg->all_reduce(b, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(2)));
    const absl::Status first_st = first->wait();
    const absl::Status second_st = second->wait();
    EXPECT_THAT(std::string(first_st.message()), ::testing::StartsWith("all_reduce #0")) << first_st;
    EXPECT_THAT(std::string(second_st.message()), ::testing::StartsWith("all_reduce #1")) << second_st;
    EXPECT_THAT(std::string(second_st.message()), HasSubstr("all_reduce #0")) << second_st;  // the cause
    pg.reset();  // releases the held comm thread
  });
}

TEST(TcpProcessGroup, ACallRunningWhenALaterCallsDeadlineFailsTheGroupNamesItselfFirst) {
  // Rank 1 never calls. Rank 0's call #0 (30 s) waits for it on the wire when call #1's deadline (1 s) fails the
  // group and shuts the connections: #0's error must name #0, with #1's failure as the cause.
  run_with_silent_rank1([&](std::shared_ptr<TcpProcessGroup>& pg) {
    Tensor a = Tensor::full({10}, 1, {}), b = Tensor::full({10}, 1, {});
    std::shared_ptr<Work> first = pg->all_reduce(a, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(30)));
    std::shared_ptr<Work> second = pg->all_reduce(b, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(1)));
    const absl::Status second_st = second->wait();
    const absl::Status first_st = first->wait();
    EXPECT_THAT(std::string(second_st.message()), ::testing::StartsWith("all_reduce #1")) << second_st;
    EXPECT_THAT(std::string(first_st.message()), ::testing::StartsWith("all_reduce #0")) << first_st;
    EXPECT_THAT(std::string(first_st.message()), HasSubstr("all_reduce #1")) << first_st;
  });
}

// Forwards to a HashStore. Once armed, a set() of rank 0's address (a key ending in "/addr/0") waits until some
// rank has asked for that address: a get() of such a key that found it present has returned, or one that found
// it absent has started waiting. So in a re-created group a reader asks before rank 0 publishes its new address,
// whatever the keys are called.
class AddressGatedStore final : public Store {
 public:
  void arm() {
    std::lock_guard<std::mutex> lock(mu_);
    armed_ = true;
    asked_ = false;
  }
  absl::Status set(const std::string& key, const std::string& value) override {
    if (absl::EndsWith(key, "/addr/0")) {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::seconds(30), [&] { return !armed_ || asked_; });
    }
    return inner_.set(key, value);
  }
  absl::StatusOr<std::string> get(const std::string& key, absl::Duration timeout) override {
    if (!absl::EndsWith(key, "/addr/0")) return inner_.get(key, timeout);
    auto present = inner_.check({key});
    if (!present.ok()) return present.status();
    absl::StatusOr<std::string> value;
    if (*present) value = inner_.get(key, timeout);  // before set() may overwrite it
    {
      std::lock_guard<std::mutex> lock(mu_);
      asked_ = true;
      cv_.notify_all();
    }
    return *present ? value : inner_.get(key, timeout);
  }
  absl::StatusOr<std::int64_t> add(const std::string& key, std::int64_t delta) override {
    return inner_.add(key, delta);
  }
  absl::StatusOr<bool> check(const std::vector<std::string>& keys) override { return inner_.check(keys); }
  absl::StatusOr<bool> delete_key(const std::string& key) override { return inner_.delete_key(key); }
  absl::Status wait(const std::vector<std::string>& keys, absl::Duration timeout) override {
    return inner_.wait(keys, timeout);
  }

 private:
  HashStore inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool armed_ = false;
  bool asked_ = false;
};

TEST(TcpProcessGroup, AFailedGroupIsReplacedByCreatingItAgainOnTheSameStoreAndPrefix) {
  // The recovery path of Note [group failure]: after a failure every rank creates a new group on the same
  // store and prefix. The new group must meet at the new addresses (not the failed group's) and report its own
  // failures (not the old one's).
  constexpr int n = 3;
  auto store = std::make_shared<AddressGatedStore>();
  TcpProcessGroupOptions o = small_chunks();
  o.store_prefix = "recover";
  o.connect_timeout = absl::Seconds(10);
  std::barrier failed(n, [&]() noexcept { store->arm(); });
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      {
        auto pg = TcpProcessGroup::create(store, r, n, o);
        ASSERT_TRUE(pg.ok()) << pg.status();
        if (r == 0) (*pg)->abort(absl::CancelledError("first failure"));
        Tensor t = Tensor::full({10}, 1, {});
        EXPECT_FALSE((*pg)->all_reduce(t, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(20)))->wait().ok());
      }
      failed.arrive_and_wait();
      auto pg = TcpProcessGroup::create(store, r, n, o);
      ASSERT_TRUE(pg.ok()) << "rank " << r << ": " << pg.status();
      Tensor t = Tensor::full({100}, r + 1, {});
      absl::Status st = (*pg)->all_reduce(t, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(20)))->wait();
      ASSERT_TRUE(st.ok()) << "rank " << r << ": " << st;
      EXPECT_EQ(t.item_at(99), 1 + 2 + 3);
      // A failure of the new group is reported as its own.
      if (r == 1) (*pg)->abort(absl::CancelledError("second failure"));
      st = (*pg)->all_reduce(t, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(20)))->wait();
      ASSERT_FALSE(st.ok());
      EXPECT_THAT(std::string(st.message()), Not(HasSubstr("first failure"))) << "rank " << r;
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace
}  // namespace shardkit::comm
