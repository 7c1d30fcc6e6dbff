// StepGraph and its passes on hand-built graphs (issue 16: "a test per pass asserting the resulting node list"):
// dedup of a unit's all_gather used twice, coalescing of small all_reduces, all_gathers and reduce_scatters (with
// their packing, run on values), expansion of an Override's
// placeholder, and the graph's checks and printing.
#include <string>
#include <vector>

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

// Runs an executable node's kernel on `reads`, with `writes` as the current values of its outputs.
std::vector<Tensor> RunKernel(const Node& n, std::vector<Tensor> reads, std::vector<Tensor> writes) {
  trace::KernelArgs args{reads, writes, nullptr};
  n.kernel(args);
  return writes;
}

Tensor Floats(std::vector<float> v) { return Tensor::from_vector(v, {static_cast<std::int64_t>(v.size())}); }

// Two parameters' shards on a group of 2 (rows 2 and 3 per rank), gathered back to back, used later.
struct TwoGathers {
  StepGraph g;
  SlotId a, b, full_a, full_b, x, h;
  TwoGathers() {
    a = g.add_slot("a.shard", DType::f32, {2});
    b = g.add_slot("b.shard", DType::f32, {3});
    full_a = g.add_slot("a.full", DType::f32, {4});
    full_b = g.add_slot("b.full", DType::f32, {6});
    x = g.add_slot("x", DType::f32, {4});
    h = g.add_slot("h", DType::f32, {4});
    g.add_input(a, "param");
    g.add_input(b, "param");
    g.add_input(x, "batch");
    g.add_collective(CollectiveKind::all_gather, {a}, {full_a}, "world");
    g.add_collective(CollectiveKind::all_gather, {b}, {full_b}, "world");
    g.add_op("layernorm", {x}, {h});  // touches neither gather: runs while they are in flight
    g.add_op("linear", {h, full_a, full_b}, {h});
    g.add_output(h, "loss");
  }
};

TEST(CoalesceCollectives, GathersIssuedTogetherBecomeOneCallUnpackedBeforeTheirFirstUse) {
  TwoGathers u;
  EXPECT_EQ(coalesce_collectives(u.g, /*max_bytes=*/64).removed, 1);
  EXPECT_EQ(u.g.to_text(),
            "0: input param writes [a.shard]\n"
            "1: input param writes [b.shard]\n"
            "2: input batch writes [x]\n"
            "3: op pack reads [a.shard, b.shard] writes [coalesced.0]\n"
            "4: collective all_gather @world reads [coalesced.0] writes [coalesced.0.out]\n"
            "5: op layernorm reads [x] writes [h]\n"
            "6: op unpack reads [coalesced.0.out] writes [a.full, b.full]\n"
            "7: op linear reads [h, a.full, b.full] writes [h]\n"
            "8: output loss reads [h]\n");
  EXPECT_TRUE(u.g.validate().ok());
  EXPECT_EQ(u.g.slot(u.g.nodes()[4].writes[0]).numel(), 10);
}

TEST(CoalesceCollectives, AGatherOverTheBoundStaysAlone) {
  TwoGathers u;
  const std::string before = u.g.to_text();
  // a.full is 16 bytes, b.full 24: together over 32.
  EXPECT_EQ(coalesce_collectives(u.g, /*max_bytes=*/32).removed, 0);
  EXPECT_EQ(u.g.to_text(), before);
}

TEST(CoalesceCollectives, PackedGathersPutEveryRanksRowsWhereTheMembersOwnGathersWould) {
  TwoGathers u;
  ASSERT_EQ(coalesce_collectives(u.g, 64).removed, 1);
  const Node& pack = u.g.nodes()[3];
  const Node& unpack = u.g.nodes()[6];
  // Rank r's shards: a = {10r, 10r + 1}, b = {10r + 5, 10r + 6, 10r + 7}; the all_gather concatenates the ranks'
  // packed inputs.
  std::vector<float> gathered;
  for (float r : {0.f, 1.f}) {
    const Tensor packed = RunKernel(pack, {Floats({10 * r, 10 * r + 1}), Floats({10 * r + 5, 10 * r + 6, 10 * r + 7})},
                                    {Tensor()})[0];
    for (float v : packed.to_vector()) gathered.push_back(v);
  }
  EXPECT_EQ(gathered, (std::vector<float>{0, 1, 5, 6, 7, 10, 11, 15, 16, 17}));
  // An output whose storage a reshard released is filled again in place (saved views of it see the values).
  const Tensor released_a = Tensor::zeros({4});
  released_a.release_storage();
  const std::vector<Tensor> out = RunKernel(unpack, {Floats(gathered)}, {released_a, Tensor()});
  EXPECT_EQ(out[0].storage(), released_a.storage());
  EXPECT_EQ(out[0].to_vector(), (std::vector<float>{0, 1, 10, 11}));
  EXPECT_EQ(out[1].to_vector(), (std::vector<float>{5, 6, 7, 15, 16, 17}));
}

TEST(CoalesceCollectives, ReduceScattersBecomeOneCallOnTheRanksBlocks) {
  StepGraph g;
  const SlotId g1 = g.add_slot("g1", DType::f32, {4}), g2 = g.add_slot("g2", DType::f32, {2}),
               s1 = g.add_slot("g1.shard", DType::f32, {2}), s2 = g.add_slot("g2.shard", DType::f32, {1}),
               h = g.add_slot("h", DType::f32, {4});
  g.add_input(g1, "grad");
  g.add_input(g2, "grad");
  g.add_input(h, "act");
  g.add_collective(CollectiveKind::reduce_scatter, {g1}, {s1}, "world", comm::ReduceOp::avg());
  g.add_op("backward_mm", {h}, {h});
  g.add_collective(CollectiveKind::reduce_scatter, {g2}, {s2}, "world", comm::ReduceOp::avg());
  g.add_op("backward_mm", {h}, {h});
  g.add_op("adamw_update", {s1, s2}, {h});
  EXPECT_EQ(coalesce_collectives(g, /*max_bytes=*/64).removed, 1);
  EXPECT_EQ(g.to_text(),
            "0: input grad writes [g1]\n"
            "1: input grad writes [g2]\n"
            "2: input act writes [h]\n"
            "3: op backward_mm reads [h] writes [h]\n"
            "4: op pack reads [g1, g2] writes [coalesced.0]\n"
            "5: collective reduce_scatter(avg) @world reads [coalesced.0] writes [coalesced.0.out]\n"
            "6: op backward_mm reads [h] writes [h]\n"
            "7: op unpack reads [coalesced.0.out] writes [g1.shard, g2.shard]\n"
            "8: op adamw_update reads [g1.shard, g2.shard] writes [h]\n");
  EXPECT_TRUE(g.validate().ok());
  // Block r of the packed input holds rank r's rows of every member; the result, this rank's rows of each.
  const Tensor packed = RunKernel(g.nodes()[4], {Floats({1, 2, 3, 4}), Floats({8, 9})}, {Tensor()})[0];
  EXPECT_EQ(packed.to_vector(), (std::vector<float>{1, 2, 8, 3, 4, 9}));
  const std::vector<Tensor> out = RunKernel(g.nodes()[7], {Floats({1, 2, 8})}, {Tensor(), Tensor()});
  EXPECT_EQ(out[0].to_vector(), (std::vector<float>{1, 2}));
  EXPECT_EQ(out[1].to_vector(), (std::vector<float>{8}));
}

TEST(CoalesceCollectives, CallsOfAnotherKindOrOpEndAGroup) {
  StepGraph g;
  const SlotId g1 = g.add_slot("g1", DType::f32, {4}), g2 = g.add_slot("g2", DType::f32, {4}),
               s1 = g.add_slot("s1", DType::f32, {2}), s2 = g.add_slot("s2", DType::f32, {2});
  g.add_input(g1, "grad");
  g.add_input(g2, "grad");
  g.add_collective(CollectiveKind::reduce_scatter, {g1}, {s1}, "world", comm::ReduceOp::avg());
  g.add_collective(CollectiveKind::reduce_scatter, {g2}, {s2}, "world", comm::ReduceOp::sum());
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
