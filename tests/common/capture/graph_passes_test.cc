// StepGraph and its passes on hand-built graphs (issue 16: "a test per pass asserting the resulting node list"):
// dedup of a unit's all_gather used twice, coalescing of small all_reduces, expansion of an Override's
// placeholder, and the graph's checks and printing.
#include <string>

#include "common/capture/graph_passes.h"
#include "common/capture/step_graph.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::capture {
namespace {

using ::testing::HasSubstr;
using comm::CollectiveKind;

// An FSDP unit whose parameters are used twice in forward: gather, use, gather again, use.
struct TwiceUsedUnit {
  StepGraph g;
  SlotId shard, full1, full2, x, h1, h2;
  TwiceUsedUnit(bool update_in_between) {
    shard = g.add_slot("w.shard", DType::f32, {4, 8});
    full1 = g.add_slot("w.full", DType::f32, {8, 8});
    full2 = g.add_slot("w.full'", DType::f32, {8, 8});
    x = g.add_slot("x", DType::f32, {2, 8});
    h1 = g.add_slot("h1", DType::f32, {2, 8});
    h2 = g.add_slot("h2", DType::f32, {2, 8});
    g.add_input(shard, "param");
    g.add_input(x, "batch");
    g.add_collective(CollectiveKind::all_gather, {shard}, {full1}, "world");
    g.add_op("matmul", {x, full1}, {h1});
    if (update_in_between) g.add_op("adamw_update", {shard}, {shard});
    g.add_collective(CollectiveKind::all_gather, {shard}, {full2}, "world");
    g.add_op("matmul", {h1, full2}, {h2});
    g.add_output(h2, "loss");
  }
};

TEST(DedupCollectives, TheSecondGatherOfAnUnchangedShardIsRemoved) {
  TwiceUsedUnit u(/*update_in_between=*/false);
  ASSERT_TRUE(u.g.validate().ok());
  EXPECT_EQ(dedup_collectives(u.g).removed, 1);
  EXPECT_EQ(u.g.to_text(),
            "0: input param writes [w.shard]\n"
            "1: input batch writes [x]\n"
            "2: collective all_gather @world reads [w.shard] writes [w.full]\n"
            "3: op matmul reads [x, w.full] writes [h1]\n"
            "4: op matmul reads [h1, w.full] writes [h2]\n"
            "5: output loss reads [h2]\n");
  EXPECT_TRUE(u.g.validate().ok());
  EXPECT_EQ(u.g.counts().at("collective/all_gather"), 1);
}

TEST(DedupCollectives, AShardWrittenInBetweenIsGatheredAgain) {
  TwiceUsedUnit u(/*update_in_between=*/true);
  const std::string before = u.g.to_text();
  EXPECT_EQ(dedup_collectives(u.g).removed, 0);
  EXPECT_EQ(u.g.to_text(), before);
}

TEST(DedupCollectives, InPlaceReductionsAreNeverDuplicates) {
  StepGraph g;
  const SlotId grad = g.add_slot("grad", DType::f32, {16});
  g.add_input(grad, "grad");
  g.add_collective(CollectiveKind::all_reduce, {grad}, {grad}, "world", comm::ReduceOp::avg());
  g.add_collective(CollectiveKind::all_reduce, {grad}, {grad}, "world", comm::ReduceOp::avg());
  EXPECT_EQ(dedup_collectives(g).removed, 0);
  EXPECT_EQ(g.nodes().size(), 3u);
}

TEST(DedupCollectives, OtherGroupsOrOpsAreDifferentCalls) {
  StepGraph g;
  const SlotId in = g.add_slot("g", DType::f32, {8}), a = g.add_slot("a", DType::f32, {4}),
               b = g.add_slot("b", DType::f32, {4});
  g.add_input(in, "grads");
  g.add_collective(CollectiveKind::reduce_scatter, {in}, {a}, "world", comm::ReduceOp::sum());
  g.add_collective(CollectiveKind::reduce_scatter, {in}, {b}, "world", comm::ReduceOp::avg());
  EXPECT_EQ(dedup_collectives(g).removed, 0);
}

TEST(DedupCollectives, AGatherRepeatedIntoItsOwnSlotIsRemovedUntilTheSlotIsWritten) {
  StepGraph g;
  const SlotId shard = g.add_slot("shard", DType::f32, {4}), full = g.add_slot("full", DType::f32, {8}),
               x = g.add_slot("x", DType::f32, {8}), y = g.add_slot("y", DType::f32, {8});
  g.add_input(shard, "shard");
  g.add_input(x, "x");
  g.add_collective(CollectiveKind::all_gather, {shard}, {full}, "world");
  g.add_op("linear", {x, full}, {y});
  g.add_collective(CollectiveKind::all_gather, {shard}, {full}, "world");  // the same again: removed
  g.add_op("linear", {y, full}, {y});
  g.add_op("reshard", {full}, {full});                                      // writes full: the next one stays
  g.add_collective(CollectiveKind::all_gather, {shard}, {full}, "world");
  g.add_op("linear_backward", {y, full}, {x});
  EXPECT_EQ(dedup_collectives(g).removed, 1);
  EXPECT_EQ(g.to_text(),
            "0: input shard writes [shard]\n"
            "1: input x writes [x]\n"
            "2: collective all_gather @world reads [shard] writes [full]\n"
            "3: op linear reads [x, full] writes [y]\n"
            "4: op linear reads [y, full] writes [y]\n"
            "5: op reshard reads [full] writes [full]\n"
            "6: collective all_gather @world reads [shard] writes [full]\n"
            "7: op linear_backward reads [y, full] writes [x]\n");
}

TEST(CoalesceCollectives, SmallAllReducesBecomeOneCallWhereTheLastWas) {
  StepGraph g;
  const SlotId g1 = g.add_slot("g1", DType::f32, {4}), g2 = g.add_slot("g2", DType::f32, {2}),
               big = g.add_slot("big", DType::f32, {1024}), g3 = g.add_slot("g3", DType::f32, {3}),
               h = g.add_slot("h", DType::f32, {4});
  for (SlotId s : {g1, g2, big, g3}) g.add_input(s, "grad");
  g.add_input(h, "act");
  g.add_collective(CollectiveKind::all_reduce, {g1}, {g1}, "world");
  g.add_op("backward_mm", {h}, {h});  // touches none of the gradients
  g.add_collective(CollectiveKind::all_reduce, {g2}, {g2}, "world");
  g.add_collective(CollectiveKind::all_reduce, {big}, {big}, "world");  // over the limit: stays alone
  g.add_collective(CollectiveKind::all_reduce, {g3}, {g3}, "world");
  g.add_op("adamw_update", {g1, g2, g3}, {h});
  EXPECT_EQ(coalesce_collectives(g, /*max_bytes=*/64).removed, 2);
  EXPECT_EQ(g.to_text(),
            "0: input grad writes [g1]\n"
            "1: input grad writes [g2]\n"
            "2: input grad writes [big]\n"
            "3: input grad writes [g3]\n"
            "4: input act writes [h]\n"
            "5: op backward_mm reads [h] writes [h]\n"
            "6: collective all_reduce(sum) @world reads [big] writes [big]\n"
            "7: op pack reads [g1, g2, g3] writes [coalesced.0]\n"
            "8: collective all_reduce(sum) @world reads [coalesced.0] writes [coalesced.0]\n"
            "9: op unpack reads [coalesced.0] writes [g1, g2, g3]\n"
            "10: op adamw_update reads [g1, g2, g3] writes [h]\n");
  EXPECT_EQ(g.slot(g.nodes()[8].reads[0]).numel(), 9);
  EXPECT_TRUE(g.validate().ok());
}

TEST(CoalesceCollectives, ABucketHoldsAtMostMaxBytes) {
  StepGraph g;
  const SlotId g1 = g.add_slot("g1", DType::f32, {4}), g2 = g.add_slot("g2", DType::f32, {2}),
               g3 = g.add_slot("g3", DType::f32, {3});
  for (SlotId s : {g1, g2, g3}) g.add_input(s, "grad");
  for (SlotId s : {g1, g2, g3}) g.add_collective(CollectiveKind::all_reduce, {s}, {s}, "world");
  // 16 + 8 bytes fill a 24-byte bucket; g3's 12 would overflow it and stays alone.
  EXPECT_EQ(coalesce_collectives(g, /*max_bytes=*/24).removed, 1);
  EXPECT_EQ(g.to_text(),
            "0: input grad writes [g1]\n"
            "1: input grad writes [g2]\n"
            "2: input grad writes [g3]\n"
            "3: op pack reads [g1, g2] writes [coalesced.0]\n"
            "4: collective all_reduce(sum) @world reads [coalesced.0] writes [coalesced.0]\n"
            "5: op unpack reads [coalesced.0] writes [g1, g2]\n"
            "6: collective all_reduce(sum) @world reads [g3] writes [g3]\n");
}

TEST(CoalesceCollectives, AReaderInBetweenKeepsTheCallsApart) {
  StepGraph g;
  const SlotId g1 = g.add_slot("g1", DType::f32, {4}), g2 = g.add_slot("g2", DType::f32, {4}),
               n = g.add_slot("norm", DType::f32, {1});
  g.add_input(g1, "grad");
  g.add_input(g2, "grad");
  g.add_collective(CollectiveKind::all_reduce, {g1}, {g1}, "world");
  g.add_op("norm", {g1}, {n});  // needs g1 reduced: g1's call cannot move past it
  g.add_collective(CollectiveKind::all_reduce, {g2}, {g2}, "world");
  const std::string before = g.to_text();
  EXPECT_EQ(coalesce_collectives(g, 64).removed, 0);
  EXPECT_EQ(g.to_text(), before);
}

TEST(ExpandPlaceholder, TheOverridePartReplacesItsPlaceholder) {
  StepGraph g;
  const SlotId x = g.add_slot("x", DType::f32, {2, 8}), y = g.add_slot("y", DType::f32, {2, 8}),
               t = g.add_slot("t", DType::f32, {2, 8});
  g.add_input(x, "batch");
  g.add_placeholder("attn", {x}, {y});
  g.add_output(y, "out");
  ASSERT_TRUE(expand_placeholder(g, "attn",
                                 {Node{.kind = NodeKind::op, .name = "qkv", .reads = {x}, .writes = {t}},
                                  Node{.kind = NodeKind::op, .name = "softmax_av", .reads = {t}, .writes = {y}}})
                  .ok());
  EXPECT_EQ(g.to_text(),
            "0: input batch writes [x]\n"
            "1: op qkv reads [x] writes [t]\n"
            "2: op softmax_av reads [t] writes [y]\n"
            "3: output out reads [y]\n");
  const absl::Status missing = expand_placeholder(g, "mlp", {});
  EXPECT_EQ(missing.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.message(), HasSubstr("expected a placeholder named 'mlp' in the graph, found none"));
}

TEST(ExpandPlaceholder, AReplacementThatReadsNothingWrittenIsRefusedAndTheGraphKept) {
  StepGraph g;
  const SlotId x = g.add_slot("x", DType::f32, {4}), y = g.add_slot("y", DType::f32, {4}),
               stray = g.add_slot("stray", DType::f32, {4});
  g.add_input(x, "batch");
  g.add_placeholder("attn", {x}, {y});
  const std::string before = g.to_text();
  const absl::Status s =
      expand_placeholder(g, "attn", {Node{.kind = NodeKind::op, .name = "bad", .reads = {stray}, .writes = {y}}});
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(s.message(), HasSubstr("reads slot 'stray' before any node writes it"));
  EXPECT_EQ(g.to_text(), before);
}

TEST(StepGraph, ValidateNamesTheNodeAndPrintsDot) {
  StepGraph g;
  const SlotId a = g.add_slot("a", DType::f32, {4}), b = g.add_slot("b", DType::f32, {4});
  g.add_input(a, "p");
  g.add_collective(CollectiveKind::all_reduce, {a}, {b}, "world");
  EXPECT_THAT(g.validate().message(),
              HasSubstr("StepGraph node 1 (collective all_reduce(sum) @world): expected one slot, read and written in place"));
  StepGraph h;
  const SlotId s = h.add_slot("s", DType::f32, {2}), full = h.add_slot("full", DType::f32, {5});
  h.add_input(s, "p");
  h.add_collective(CollectiveKind::all_gather, {s}, {full}, "world");
  EXPECT_THAT(h.validate().message(), HasSubstr("sizes in a group's ratio"));
  const std::string dot = h.to_dot();
  EXPECT_THAT(dot, HasSubstr("n1 [shape=box, style=bold, label=\"collective all_gather @world\"];"));
  EXPECT_THAT(dot, HasSubstr("s0 -> n1;"));
  EXPECT_THAT(dot, HasSubstr("n1 -> s1;"));
}

}  // namespace
}  // namespace shardkit::capture
