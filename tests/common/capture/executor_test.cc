// The executor's replay schedule (Note [replay schedule] in executor.h) on hand-built executable graphs, with ranks
// as threads: a value whose last use was a collective is given back as soon as the call is done.
#include "common/capture/executor.h"

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "common/capture/step_graph.h"
#include "common/comm/testing/run_ranks.h"
#include "gtest/gtest.h"

namespace shardkit::capture {
namespace {

using comm::CollectiveKind;

Node Op(std::string name, std::vector<SlotId> reads, std::vector<SlotId> writes, trace::Kernel kernel) {
  return Node{.kind = NodeKind::op, .name = std::move(name), .reads = std::move(reads), .writes = std::move(writes),
              .kernel = std::move(kernel)};
}

// A gradient made by the step, reduce-scattered (its last use), then a small all_reduce issued after it and waited;
// a probe after that sees whether the gradient's bytes are still held. The in-process group runs a rank's calls in
// issue order, so the all_reduce being done means the reduce_scatter is done too.
Tensor Copy(const Tensor& t) {
  Tensor c = Tensor::empty(t.shape());
  c.copy_(t);
  return c;
}

TEST(Executor, AValueWhoseLastUseWasADoneCollectiveIsFreedBeforeTheStepEnds) {
  absl::Status st = comm::RunRanks(2, [&](comm::RankEnv& env) -> absl::Status {
    const std::string group = env.group_ptr->name();
    StepGraph g;
    const SlotId x = g.add_slot("x", DType::f32, {4}), grad = g.add_slot("grad", DType::f32, {1024}),
                 shard = g.add_slot("grad.shard", DType::f32, {512}), small = g.add_slot("small", DType::f32, {8}),
                 copy = g.add_slot("small.copy", DType::f32, {8}), probe = g.add_slot("probe", DType::f32, {1}),
                 out = g.add_slot("out", DType::f32, {512});
    g.mutable_slot(x).value = Tensor::zeros({4});
    auto grad_storage = std::make_shared<std::weak_ptr<Storage>>();
    bool grad_alive_at_probe = true;
    g.add_input(x, "x");
    g.add(Op("make_grad", {x}, {grad}, [grad_storage](trace::KernelArgs& a) {
      a.writes[0] = Tensor::full({1024}, 1.0);
      *grad_storage = a.writes[0].storage();
    }));
    g.add_collective(CollectiveKind::reduce_scatter, {grad}, {shard}, group, comm::ReduceOp::avg());
    g.add(Op("make_small", {x}, {small}, [](trace::KernelArgs& a) { a.writes[0] = Tensor::full({8}, 2.0); }));
    g.add_collective(CollectiveKind::all_reduce, {small}, {small}, group);
    g.add(Op("use_small", {small}, {copy}, [](trace::KernelArgs& a) { a.writes[0] = Copy(a.reads[0]); }));
    g.add(Op("probe", {x}, {probe}, [grad_storage, &grad_alive_at_probe](trace::KernelArgs& a) {
      grad_alive_at_probe = !grad_storage->expired();
      a.writes[0] = Tensor::zeros({1});
    }));
    g.add(Op("use_shard", {shard, probe}, {out}, [](trace::KernelArgs& a) { a.writes[0] = Copy(a.reads[0]); }));
    g.add_output(out, "out");
    g.add_output(copy, "copy");
    absl::StatusOr<Executor> ex = Executor::create(std::move(g), {.groups = {{group, env.group_ptr}}});
    if (!ex.ok()) return ex.status();
    for (int replay = 0; replay < 2; ++replay) {
      if (absl::Status s = ex->run(); !s.ok()) return s;
      EXPECT_FALSE(grad_alive_at_probe) << "replay " << replay;
      EXPECT_EQ(ex->value(out).to_vector(), std::vector<float>(512, 1.0f));
      EXPECT_EQ(ex->value(copy).to_vector(), std::vector<float>(8, 4.0f));
    }
    return absl::OkStatus();
  });
  ASSERT_TRUE(st.ok()) << st;
}

// Per-op kernel time of a replay: every op node's time is counted under its name, the totals add up to the replay's
// kernel time, and the op that spins longest comes first (it spins 20 ms a call on the clock, the others return).
TEST(Executor, KernelTimeByOpCountsEveryOpNodeUnderItsName) {
  StepGraph g;
  const SlotId x = g.add_slot("x", DType::f32, {4}), a = g.add_slot("a", DType::f32, {4}),
               b = g.add_slot("b", DType::f32, {4}), c = g.add_slot("c", DType::f32, {4});
  g.mutable_slot(x).value = Tensor::zeros({4});
  g.add_input(x, "x");
  auto spin = [](trace::KernelArgs& k) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(20);
    while (std::chrono::steady_clock::now() < until) {
    }
    k.writes[0] = Copy(k.reads[0]);
  };
  auto copy = [](trace::KernelArgs& k) { k.writes[0] = Copy(k.reads[0]); };
  g.add(Op("spin", {x}, {a}, spin));
  g.add(Op("copy", {a}, {b}, copy));
  g.add(Op("spin", {b}, {c}, spin));
  g.add_output(c, "c");
  absl::StatusOr<Executor> ex = Executor::create(std::move(g));
  ASSERT_TRUE(ex.ok()) << ex.status();
  for (int replay = 0; replay < 2; ++replay) {
    ASSERT_TRUE(ex->run().ok());
    const ReplayStats& stats = ex->last_stats();
    ASSERT_EQ(stats.node_seconds.size(), ex->graph().nodes().size());
    EXPECT_EQ(stats.node_seconds.front(), 0.0);  // the input node runs no kernel
    const std::vector<OpTime> by_op = kernel_time_by_op(ex->graph(), stats);
    ASSERT_EQ(by_op.size(), 2u);
    EXPECT_EQ(by_op[0].op, "spin");
    EXPECT_EQ(by_op[0].calls, 2);
    EXPECT_GE(by_op[0].seconds, 0.040);
    EXPECT_EQ(by_op[1].op, "copy");
    EXPECT_EQ(by_op[1].calls, 1);
    EXPECT_NEAR(by_op[0].seconds + by_op[1].seconds, stats.kernel_seconds, 1e-9);
  }
}

}  // namespace
}  // namespace shardkit::capture
