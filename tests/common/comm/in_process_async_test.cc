// The in-process backend's progress engine (Note [in-process progress engine]): calls return at once and
// complete in the background, hold their tensors until every peer is done, and keep the failure contract.
#include <memory>
#include <vector>

#include "absl/strings/match.h"
#include "absl/synchronization/notification.h"
#include "common/comm/in_process_group.h"
#include "common/comm/testing/run_ranks.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::comm {
namespace {

using ::testing::HasSubstr;

std::vector<float> Values(const Tensor& t) {
  const float* p = t.data<float>();
  return std::vector<float>(p, p + t.numel());
}

// Rank 1 issues its all_reduce only after rank 0's call has returned: with collectives run in the calling
// thread, rank 0 would block in all_reduce until its deadline and rank 1 would never be told to go.
TEST(InProcessAsyncTest, CallsReturnBeforeThePeersJoin) {
  absl::Notification rank0_issued;
  absl::Status st = RunRanks(2, [&](RankEnv& env) -> absl::Status {
    Tensor t = Tensor::full({1000}, static_cast<float>(env.rank + 1));
    if (env.rank == 1 && !rank0_issued.WaitForNotificationWithTimeout(absl::Seconds(30))) {
      return absl::DeadlineExceededError("rank 0's all_reduce did not return before rank 1 joined it");
    }
    std::shared_ptr<Work> w = env.group.all_reduce(t);
    if (env.rank == 0) rank0_issued.Notify();
    if (absl::Status s = w->wait(); !s.ok()) return s;
    EXPECT_EQ(Values(t), std::vector<float>(1000, 3.0f));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// The caller drops its Work and input at once; the queued call keeps the input alive until the peers have
// read it (AddressSanitizer would report a read of freed memory otherwise), and the output is complete once
// a later call on the same group has completed (calls run in issue order).
TEST(InProcessAsyncTest, CallerMayDropItsWorkAndInputAtOnce) {
  absl::Status st = RunRanks(3, [&](RankEnv& env) -> absl::Status {
    Tensor out = Tensor::zeros({3 * 4096});
    {
      Tensor in = Tensor::full({4096}, static_cast<float>(10 * env.rank));
      env.group.all_gather(out, in);  // Work and input dropped here
    }
    if (absl::Status s = env.group.barrier()->wait(); !s.ok()) return s;
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(out.data<float>()[r * 4096], 10.0f * r);
      EXPECT_EQ(out.data<float>()[r * 4096 + 4095], 10.0f * r);
    }
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

// A rank may issue calls and depart without waiting for them: its worker still joins them, so the peer's
// call succeeds instead of failing at once with "returned from its function without joining it".
TEST(InProcessAsyncTest, CallsIssuedBeforeDepartingStillRun) {
  auto world = InProcessWorld::create(2, {.default_timeout = absl::Seconds(30)});
  std::shared_ptr<ProcessGroup> g0 = world->group(0), g1 = world->group(1);
  Tensor t0 = Tensor::full({64}, 1.0f), t1 = Tensor::full({64}, 2.0f);
  std::shared_ptr<Work> w1 = g1->all_reduce(t1);
  world->mark_departed(1);
  ASSERT_TRUE(g0->all_reduce(t0)->wait().ok()) << world->status();
  ASSERT_TRUE(w1->wait().ok());
  EXPECT_EQ(Values(t0), std::vector<float>(64, 3.0f));
  EXPECT_EQ(Values(t1), std::vector<float>(64, 3.0f));
  // Once its queue is empty, the departed rank is gone: a new call fails at once, naming it.
  absl::Status late = g0->barrier({.tag = "after departure"})->wait();
  EXPECT_EQ(late.code(), absl::StatusCode::kAborted) << late;
  EXPECT_THAT(late.message(), HasSubstr("rank 1 returned from its function without joining it"));
}

// Destroying a handle with calls queued behind one in progress fails the queued ones, naming the handle, and
// aborts the world (the peers would wait for them); the call in progress runs to its own deadline.
TEST(InProcessAsyncTest, DestroyingAHandleFailsItsQueuedCallsAndTheWorld) {
  auto world = InProcessWorld::create(2, {.default_timeout = absl::Milliseconds(300)});
  std::shared_ptr<ProcessGroup> g0 = world->group(0), g1 = world->group(1);
  Tensor a = Tensor::zeros({16}), b = Tensor::zeros({16});
  std::shared_ptr<Work> first = g1->all_reduce(a, {.tag = "first"});
  std::shared_ptr<Work> second = g1->all_reduce(b, {.tag = "second"});
  g1.reset();
  const absl::Status s1 = first->wait(), s2 = second->wait();
  EXPECT_FALSE(s1.ok());
  EXPECT_EQ(s2.code(), absl::StatusCode::kAborted) << s2;
  // The destructor took "second" (and maybe "first", if the worker had not started it yet) from the queue,
  // or the worker started "second" after "first" failed.
  const bool destroyed = absl::StrContains(s2.message(), "the group handle was destroyed with") &&
                         absl::StrContains(s2.message(), "queued and not started");
  const bool aborted_after_first = absl::StrContains(s2.message(), "aborted because");
  EXPECT_TRUE(destroyed || aborted_after_first) << s2;
  EXPECT_FALSE(world->status().ok());
  EXPECT_EQ(g0->barrier()->wait().code(), absl::StatusCode::kAborted);
}

// Calls on different groups progress independently: rank 0 issues on the sub-group first, rank 1 on the
// world first, and both complete (with one thread per rank issuing both, in the calling thread this order
// would deadlock until the deadline).
TEST(InProcessAsyncTest, GroupsProgressIndependently) {
  absl::Status st = RunRanks(2, [&](RankEnv& env) -> absl::Status {
    absl::StatusOr<std::shared_ptr<ProcessGroup>> sub = env.group.split(0, env.rank);
    if (!sub.ok()) return sub.status();
    Tensor a = Tensor::full({8}, 1.0f), b = Tensor::full({8}, 2.0f);
    std::shared_ptr<Work> wa, wb;
    if (env.rank == 0) {
      wb = (*sub)->all_reduce(b);
      wa = env.group.all_reduce(a);
    } else {
      wa = env.group.all_reduce(a);
      wb = (*sub)->all_reduce(b);
    }
    if (absl::Status s = wa->wait(); !s.ok()) return s;
    if (absl::Status s = wb->wait(); !s.ok()) return s;
    EXPECT_EQ(Values(a), std::vector<float>(8, 2.0f));
    EXPECT_EQ(Values(b), std::vector<float>(8, 4.0f));
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
}

}  // namespace
}  // namespace shardkit::comm
