// The per-rank ledger (DESIGN.md section 6) and the bytes sent per step, measured on GPT-tiny.
#include <algorithm>
#include <cstdio>
#include <memory>

#include "common/comm/testing/run_ranks.h"
#include "oss/oss.h"
#include "sddp/data_parallel.h"
#include "tests/sddp/sddp_test_util.h"

namespace shardkit::sddp {
namespace {

using test_util::Batch;
using test_util::kBatch;
using test_util::TinyConfig;

enum class Kind { ddp, greedy, flat, flat_owner };
const char* KindName(Kind k) {
  switch (k) {
    case Kind::ddp: return "ddp";
    case Kind::greedy: return "sddp_greedy";
    case Kind::flat: return "sddp_flat";
    case Kind::flat_owner: return "sddp_flat_owner";
  }
  return "?";
}

struct Measured {
  std::int64_t psi = 0;            // parameter elements
  std::int64_t padded_psi = 0;     // flat: parameter elements with each chunk padded to world · shard size
  std::int64_t owned = 0;          // gradient elements this rank keeps
  std::int64_t largest = 0;        // largest parameter (elements)
  std::int64_t max_bucket = 0;     // largest bucket (elements)
  std::int64_t grad_after = 0;     // gradient bytes after backward
  std::int64_t grad_after_step = 0;       // gradient bytes after step()
  std::int64_t grad_after_zero_grad = 0;  // gradient bytes after the optimizer's zero_grad()
  std::int64_t grad_peak = 0;      // gradient bytes peak during backward
  std::int64_t comm_after = 0;     // communication-buffer bytes after backward
  std::int64_t comm_peak = 0;      // communication-buffer bytes peak during backward
  std::int64_t model_state = 0;    // parameter + gradient + optimizer state bytes after backward (all held)
  std::int64_t flags_sent = 0;     // bytes of the "used" flags' all_reduce (Note [parameters no rank used])
  std::int64_t grad_sent = 0;      // bytes sent by gradient collectives in one step
  std::int64_t total_sent = 0;     // bytes sent in one step (gradients + parameter sync)
  double overlap = 0;
  std::int64_t buckets = 0;
};

constexpr std::int64_t kBucket = 600;
constexpr int kInFlight = 2;

std::vector<Measured> Measure(Kind kind, int world) {
  std::vector<Measured> out(static_cast<std::size_t>(world));
  absl::Status st = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    MemoryTracker& mem = *env.context.memory;
    nn::GPT model(TinyConfig(), 1);
    std::vector<optim::ParamGroup> groups{{model.parameters(), optim::AdamW::default_hyper()}};
    std::unique_ptr<optim::Optimizer> plain;
    std::unique_ptr<oss::Oss> oss;
    std::unique_ptr<DataParallel> dp;
    const DataParallelOptions o{.reduce_buffer_size = kBucket,
                                .max_buckets_in_flight = kInFlight,
                                .flat_reduce_scatter = kind == Kind::flat};
    if (kind == Kind::ddp) {
      plain = std::move(*optim::AdamW::factory()(groups));
      dp = std::move(*DistributedDataParallel::create(model, env.group_ptr, o));
    } else {
      auto created = oss::Oss::create(groups, optim::AdamW::factory(), env.group_ptr,
                                      {.policy = kind == Kind::greedy ? oss::PartitionPolicy::greedy : oss::PartitionPolicy::flat,
                                       .flat_chunk_numel = kBucket});
      if (!created.ok()) return created.status();
      oss = std::move(*created);
      auto d = ShardedDataParallel::create(model, {oss.get()}, env.group_ptr, o);
      if (!d.ok()) return d.status();
      dp = std::move(*d);
    }
    Measured& m = out[static_cast<std::size_t>(env.rank)];
    const int rows = kBatch / world;
    for (int step = 0; step < 3; ++step) {
      auto [x, y] = Batch(step, env.rank * rows, rows);
      if (plain) plain->zero_grad();
      if (oss) oss->zero_grad();
      Tensor loss = model.loss(x, y);
      mem.reset_peaks();
      const auto before = env.group.counters();
      if (absl::Status s = autograd::try_backward(loss); !s.ok()) return s;
      const auto after_backward = env.group.counters();
      m.grad_after = mem.current(MemoryCategory::gradient);
      m.grad_peak = mem.peak(MemoryCategory::gradient);
      m.comm_after = mem.current(MemoryCategory::communication_buffer);
      m.comm_peak = mem.peak(MemoryCategory::communication_buffer);
      m.owned = 0;
      for (const Tensor& g : dp->held_gradients()) m.owned += g.numel();
      // The optimizer state exists from the first step on, so from step 1 this is the ZeRO formula's point.
      m.model_state = mem.current(MemoryCategory::parameter) + mem.current(MemoryCategory::gradient) +
                      mem.current(MemoryCategory::optimizer_state);
      if (absl::Status s = plain ? plain->step() : oss->step(); !s.ok()) return s;
      m.grad_after_step = mem.current(MemoryCategory::gradient);
      m.grad_sent = after_backward.since(before).total_sent();
      m.flags_sent = 2 * (world - 1) * static_cast<std::int64_t>(model.parameters().size()) * 4 / world;
      m.total_sent = env.group.counters().since(before).total_sent();
    }
    // Note [training step contract]: the optimizer's zero_grad() is the one call that drops every gradient,
    // the slices ShardedDataParallel delivered included.
    if (plain) plain->zero_grad();
    if (oss) oss->zero_grad();
    m.grad_after_zero_grad = mem.current(MemoryCategory::gradient);
    m.psi = model.num_parameters();
    m.padded_psi = m.psi;
    if (oss && kind != Kind::greedy) {
      m.padded_psi = 0;
      for (const oss::FlatChunk& c : oss->flat_partition().chunks) m.padded_psi += c.shard_size * world;
    }
    for (const Tensor& p : model.parameters()) m.largest = std::max(m.largest, p.numel());
    for (const auto b : dp->bucket_numels()) m.max_bucket = std::max(m.max_bucket, b);
    m.overlap = dp->last_backward_stats().overlap_frac();
    m.buckets = dp->last_backward_stats().buckets;
    return absl::OkStatus();
  });
  EXPECT_TRUE(st.ok()) << st;
  return out;
}

class SddpMemory : public ::testing::TestWithParam<std::tuple<int, Kind>> {};

// Steady state after backward: gradient bytes = this rank's owned share (DDP: everything), no bucket
// buffer left; peak during backward <= owned share + the largest parameter's gradient (+ the gradient the
// engine is accumulating), buckets in flight bounded by max_buckets_in_flight; model state after backward
// against the ZeRO formula (fp32 + Adam: DDP 16Ψ, ZeRO-2 4Ψ + 12Ψ/N; padding and the uneven greedy split
// make the measured figure differ by at most the largest parameter's 12 bytes per element). After step():
// no gradient left where the Oss owned delivered slices; after the optimizer's zero_grad(): none at all.
TEST_P(SddpMemory, GradientLedgerAndModelStateMatchZeroFormula) {
  const auto [world, kind] = GetParam();
  const auto ms = Measure(kind, world);
  for (int r = 0; r < world; ++r) {
    const Measured& m = ms[static_cast<std::size_t>(r)];
    const double psi = static_cast<double>(m.psi);
    const double formula = kind == Kind::ddp ? 16 * psi : 4 * psi + 12 * psi / world;
    std::printf("%s n=%d rank %d: grad after backward %lld B (owned %lld el = %lld B), grad peak %lld B, "
                "comm peak %lld B (max bucket %lld el x %d in flight), model state %lld B vs formula %.0f B "
                "(%.3f), sent %lld B/step (gradients %lld) vs 2(n-1)/n*4Ψ = %.0f, overlap_frac %.2f, buckets %lld\n",
                KindName(kind), world, r, static_cast<long long>(m.grad_after), static_cast<long long>(m.owned),
                static_cast<long long>(m.owned * 4), static_cast<long long>(m.grad_peak),
                static_cast<long long>(m.comm_peak), static_cast<long long>(m.max_bucket), kInFlight,
                static_cast<long long>(m.model_state), formula, static_cast<double>(m.model_state) / formula,
                static_cast<long long>(m.total_sent), static_cast<long long>(m.grad_sent),
                2.0 * (world - 1) / world * 4 * psi, m.overlap, static_cast<long long>(m.buckets));
    EXPECT_EQ(m.grad_after, m.owned * 4) << "rank " << r;
    // The delivered slices (flat) have one owner, the Oss: its step releases them. Whole gradients (DDP,
    // greedy) stay until zero_grad(), as with a plain optimizer.
    const bool slices = kind == Kind::flat || kind == Kind::flat_owner;
    EXPECT_EQ(m.grad_after_step, slices ? 0 : m.owned * 4) << "rank " << r;
    EXPECT_EQ(m.grad_after_zero_grad, 0) << "rank " << r;
    EXPECT_EQ(m.comm_after, 0) << "rank " << r;
    if (kind == Kind::ddp) {
      EXPECT_EQ(m.owned, m.psi);
    }
    EXPECT_LE(m.grad_peak, (m.owned + 2 * m.largest) * 4) << "rank " << r;
    if (kind == Kind::greedy || kind == Kind::flat_owner) {
      // Buckets are per owner: up to one filling per owner rank, plus those in flight.
      EXPECT_LE(m.comm_peak, (kInFlight + world) * m.max_bucket * 4) << "rank " << r;
    } else {
      // One bucket filling (flat: a chunk's columns, chunk = bucket, Note [flat chunks]) plus those in
      // flight, each with its reduce-scatter output.
      EXPECT_LE(m.comm_peak, (kInFlight + 1) * (m.max_bucket + m.max_bucket / std::max(1, world)) * 4) << "rank " << r;
    }
    EXPECT_NEAR(static_cast<double>(m.model_state), formula, 12.0 * static_cast<double>(m.largest) + 64) << "rank " << r;
  }
}

// DESIGN.md section 6: DDP, OSS and ShardedDDP send 2Ψ-class volume per rank per step (ring-equivalent
// bytes counted by the ProcessGroup). Summed over ranks, one step sends exactly 2(n-1)·Ψ·4 bytes: DDP in its
// all_reduces; ShardedDDP half in the gradient reductions (greedy: every rank sends the buckets it does not
// own, Ψ - owned; flat: reduce_scatter (n-1)/n·Ψ) and half in OSS's parameter broadcast / all_gather (flat:
// Ψ with each chunk's padding).
TEST_P(SddpMemory, BytesSentPerStepAreTheTwoPsiVolume) {
  const auto [world, kind] = GetParam();
  const auto ms = Measure(kind, world);
  std::int64_t sum = 0, grad_sum = 0;
  for (int r = 0; r < world; ++r) {
    const Measured& m = ms[static_cast<std::size_t>(r)];
    sum += m.total_sent;
    grad_sum += m.grad_sent;
    if (kind == Kind::greedy || kind == Kind::flat_owner) {
      EXPECT_EQ(m.grad_sent, (m.psi - m.owned) * 4 + m.flags_sent) << "rank " << r;
    } else {
      EXPECT_EQ(m.total_sent, 2 * (world - 1) * m.padded_psi * 4 / world + m.flags_sent) << "rank " << r;
    }
  }
  // Besides the 2Ψ volume: one f32 flag per parameter all-reduced each backward (Note [parameters no rank used] in
  // sddp/reducer.cc).
  const std::int64_t flags = world * ms[0].flags_sent;
  // Flat collectives carry each chunk's padding (at most world - 1 elements per chunk): the flat
  // reduce-scatter and the all_gather send the padded Ψ, reduce-to-owner sends no padding.
  const std::int64_t psi = ms[0].psi, padded = ms[0].padded_psi;
  EXPECT_LE(padded - psi, (world - 1) * 64) << "padding";
  const std::int64_t grad_psi = kind == Kind::flat ? padded : psi;
  EXPECT_EQ(sum, (world - 1) * (grad_psi + padded) * 4 + flags);
  if (kind != Kind::ddp) {
    EXPECT_EQ(grad_sum, (world - 1) * grad_psi * 4 + flags);
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, SddpMemory,
                         ::testing::Combine(::testing::Values(2, 4), ::testing::Values(Kind::ddp, Kind::greedy, Kind::flat, Kind::flat_owner)),
                         [](const auto& info) {
                           return std::string(KindName(std::get<1>(info.param))) + "_n" +
                                  std::to_string(std::get<0>(info.param));
                         });

}  // namespace
}  // namespace shardkit::sddp
