// The harness of the compile() combination audits (compile_combo_test.cc, compile_state_combo_test.cc): one GPT-tiny
// training run, described by a Scenario, done three ways on every rank of a world of N:
//   * eagerly (N = 1: the plain step; N > 1: under eager sddp::DistributedDataParallel, no_sync around every
//     micro-batch but the last);
//   * compiled with capture::compile (N = 1: no parallel mode; else sddp::ReplicateMode or fsdp::FullyShardMode);
//   * and once, on one rank, on every rank's rows (the mean of their losses), with each rank's Generator swapped in
//     for its rows (so dropout draws each rank's masks): single-rank training.
// The compiled run must equal the eager one bit for bit where the docs promise it (one rank: compile.h; replicate:
// DDP's bits, replicate_mode.h), within float rounding otherwise (fully shard against eager DDP), and single-rank
// training within float rounding.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/autograd/engine.h"
#include "common/autograd/ops.h"
#include "common/capture/compile.h"
#include "common/comm/testing/run_ranks.h"
#include "common/nn/gpt.h"
#include "common/optim/adam.h"
#include "common/tensor/rank_context.h"
#include "fsdp/fully_shard_mode.h"
#include "gtest/gtest.h"
#include "sddp/data_parallel.h"
#include "sddp/replicate_mode.h"
#include "tests/testing/gpt_tiny_data.h"

namespace shardkit::compile_combo {

enum class Kind { one_rank, replicate, fully_shard };

struct Where {
  Kind kind = Kind::one_rank;
  int world = 1;
};

inline std::string Name(const Where& w) {
  switch (w.kind) {
    case Kind::one_rank:
      return "one_rank";
    case Kind::replicate:
      return absl::StrCat("replicate_n", w.world);
    case Kind::fully_shard:
      return absl::StrCat("fully_shard_n", w.world);
  }
  return "?";
}

inline std::vector<Where> AllWheres() {
  return {{Kind::one_rank, 1},    {Kind::replicate, 2},   {Kind::replicate, 3},
          {Kind::fully_shard, 2}, {Kind::fully_shard, 3}};
}

// Which copy of the run a Scenario callback is called for.
enum class Copy { eager, compiled, reference };

struct Scenario {
  nn::GPTConfig config = gpt_tiny::TinyConfig();
  int steps = 4;
  int micro = 1;               // micro-batches per step (each its own backward), gradients accumulated
  bool set_to_none = true;     // the step's zero_grad(set_to_none)
  bool zero_first = false;     // zero_grad at the start of the step (else at its end)
  std::function<int(int step)> total_rows = [](int) { return gpt_tiny::kBatch; };  // the step's rows, all ranks
  std::function<std::unique_ptr<optim::Optimizer>(nn::GPT&)> make_opt = [](nn::GPT& m) {
    return std::make_unique<optim::AdamW>(m.parameters());
  };
  // After the model and its optimizer are built (checkpointing, freezing), on every copy.
  std::function<absl::Status(nn::GPT&, optim::Optimizer&)> prepare = nullptr;
  // Before step `step`, on every copy (lr changes, freezing, train / eval). The compiled copy is given its mode
  // (nullptr on one rank) when it is the fully-shard one.
  std::function<absl::Status(int step, nn::GPT&, optim::Optimizer&, Copy, fsdp::FullyShardMode*)> before = nullptr;
};

struct RankRun {
  std::vector<float> losses;
  std::vector<std::vector<float>> values;
};

struct Result {
  std::vector<RankRun> eager, compiled;
  RankRun reference;
  std::vector<int> captures;
  std::vector<std::string> reasons;  // rank 0's capture reasons, one per call
  std::vector<std::string> graphs;   // rank 0's replayed graph after the last call, as text
  int expanded_collectives = 0;      // rank 0's, after the last capture (CompiledStep::expanded_collectives)
  comm::CommCounters last_call;      // rank 0's calls in the last compiled call
  absl::Status status;               // the RunRanks status (a compiled call's error)
};

// Micro-batch m of rank r of step s.
inline std::pair<Tensor, Tensor> MicroBatch(const Scenario& sc, int world, int step, int rank, int m) {
  const int rows = sc.total_rows(step) / world;
  const int per = rows / sc.micro;
  return gpt_tiny::Batch(step, rank * rows + m * per, per);
}

inline std::vector<Tensor> RankBatch(const Scenario& sc, int world, int step, int rank) {
  std::vector<Tensor> b;
  for (int m = 0; m < sc.micro; ++m) {
    auto [x, y] = MicroBatch(sc, world, step, rank, m);
    b.push_back(x);
    b.push_back(y);
  }
  return b;
}

// The single-rank step: micro-batches each with their backward, the update, the zeroing.
inline Tensor StepBody(const Scenario& sc, nn::GPT& model, optim::Optimizer& opt, const std::vector<Tensor>& b,
                       sddp::DistributedDataParallel* ddp) {
  if (sc.zero_first) opt.zero_grad(sc.set_to_none);
  Tensor first;
  for (int m = 0; m < sc.micro; ++m) {
    std::optional<sddp::DataParallel::NoSync> no_sync;
    if (ddp != nullptr && m + 1 < sc.micro) no_sync.emplace(ddp->no_sync());
    Tensor loss = model.loss(b[static_cast<std::size_t>(2 * m)], b[static_cast<std::size_t>(2 * m + 1)]);
    if (sc.micro > 1) loss = autograd::scale(loss, 1.f / static_cast<float>(sc.micro));
    autograd::backward(loss);
    if (m == 0) first = loss;
  }
  EXPECT_TRUE(opt.step().ok());
  if (!sc.zero_first) opt.zero_grad(sc.set_to_none);
  return first;
}

// Runs the scenario at `where`: eager and compiled on every rank, then the single-rank reference.
inline Result RunScenario(const Scenario& sc, const Where& where) {
  const int world = where.world;
  Result res;
  res.eager.resize(static_cast<std::size_t>(world));
  res.compiled.resize(static_cast<std::size_t>(world));
  res.captures.resize(static_cast<std::size_t>(world));
  std::vector<Generator> start(static_cast<std::size_t>(world));
  res.status = comm::RunRanks(world, [&](comm::RankEnv& env) -> absl::Status {
    const auto r = static_cast<std::size_t>(env.rank);
    const Generator g0 = env.context.generator;
    start[r] = g0;
    {
      nn::GPT model(sc.config, 1);
      std::unique_ptr<optim::Optimizer> opt = sc.make_opt(model);
      if (sc.prepare) {
        if (absl::Status s = sc.prepare(model, *opt); !s.ok()) return s;
      }
      std::unique_ptr<sddp::DistributedDataParallel> ddp;
      if (world > 1) {
        auto made = sddp::DistributedDataParallel::create(model, env.group_ptr, {.reduce_buffer_size = 0});
        if (!made.ok()) return made.status();
        ddp = *std::move(made);
      }
      for (int s = 0; s < sc.steps; ++s) {
        if (sc.before) {
          if (absl::Status st = sc.before(s, model, *opt, Copy::eager, nullptr); !st.ok()) return st;
        }
        Tensor loss = StepBody(sc, model, *opt, RankBatch(sc, world, s, env.rank), ddp.get());
        res.eager[r].losses.push_back(static_cast<float>(loss.item()));
      }
      res.eager[r].values = gpt_tiny::Values(model);
    }
    env.context.generator = g0;
    nn::GPT model(sc.config, 1);
    std::unique_ptr<optim::Optimizer> opt = sc.make_opt(model);
    if (sc.prepare) {
      if (absl::Status s = sc.prepare(model, *opt); !s.ok()) return s;
    }
    std::shared_ptr<capture::ParallelMode> mode;
    std::shared_ptr<fsdp::FullyShardMode> shard_mode;
    if (where.kind == Kind::replicate) mode = std::make_shared<sddp::ReplicateMode>(env.group_ptr);
    if (where.kind == Kind::fully_shard) {
      shard_mode = std::make_shared<fsdp::FullyShardMode>(env.group_ptr);
      mode = shard_mode;
    }
    capture::CompiledStep compiled = capture::compile(
        [&](const std::vector<Tensor>& b) { return StepBody(sc, model, *opt, b, nullptr); }, model, *opt,
        {.parallel_mode = mode});
    for (int s = 0; s < sc.steps; ++s) {
      if (sc.before) {
        if (absl::Status st = sc.before(s, model, *opt, Copy::compiled, shard_mode.get()); !st.ok()) return st;
      }
      const comm::CommCounters before_call = env.group_ptr->counters();
      absl::StatusOr<Tensor> loss = compiled(RankBatch(sc, world, s, env.rank));
      if (!loss.ok()) return loss.status();
      if (env.rank == 0) res.last_call = env.group_ptr->counters().since(before_call);
      res.compiled[r].losses.push_back(static_cast<float>(loss->item()));
      if (env.rank == 0) res.reasons.push_back(compiled.last_capture_reason());
    }
    res.captures[r] = compiled.captures();
    if (env.rank == 0) {
      res.graphs.push_back(compiled.graph()->to_text());
      res.expanded_collectives = compiled.expanded_collectives();
    }
    if (shard_mode) {
      if (absl::Status s = shard_mode->unshard_parameters(); !s.ok()) return s;
    }
    res.compiled[r].values = gpt_tiny::Values(model);
    return absl::OkStatus();
  });
  if (!res.status.ok()) return res;
  // One rank on every rank's rows.
  RankContext ctx;
  RankContextScope scope(ctx);
  nn::GPT model(sc.config, 1);
  std::unique_ptr<optim::Optimizer> opt = sc.make_opt(model);
  if (sc.prepare) {
    if (absl::Status s = sc.prepare(model, *opt); !s.ok()) {
      res.status = s;
      return res;
    }
  }
  for (int s = 0; s < sc.steps; ++s) {
    if (sc.before) {
      if (absl::Status st = sc.before(s, model, *opt, Copy::reference, nullptr); !st.ok()) {
        res.status = st;
        return res;
      }
    }
    opt->zero_grad(sc.set_to_none);
    double total = 0;
    for (int r = 0; r < world; ++r) {
      ctx.generator = start[static_cast<std::size_t>(r)];
      for (int m = 0; m < sc.micro; ++m) {
        auto [x, y] = MicroBatch(sc, world, s, r, m);
        Tensor loss = model.loss(x, y);
        total += loss.item();
        autograd::backward(autograd::scale(loss, 1.f / static_cast<float>(world * sc.micro)));
      }
      start[static_cast<std::size_t>(r)] = ctx.generator;
    }
    res.reference.losses.push_back(static_cast<float>(total / (world * sc.micro)));
    EXPECT_TRUE(opt->step().ok());
  }
  res.reference.values = gpt_tiny::Values(model);
  return res;
}

inline bool Near(const std::vector<std::vector<float>>& got, const std::vector<std::vector<float>>& want, double tol,
                 std::string* where) {
  if (got.size() != want.size()) {
    *where = absl::StrCat(got.size(), " parameters, expected ", want.size());
    return false;
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (got[i].size() != want[i].size()) {
      *where = absl::StrCat("parameter ", i, " has ", got[i].size(), " values, expected ", want[i].size());
      return false;
    }
    for (std::size_t k = 0; k < got[i].size(); ++k) {
      if (!(std::abs(got[i][k] - want[i][k]) <= tol + tol * std::abs(want[i][k]))) {
        *where = absl::StrCat("parameter ", i, "[", k, "]: ", got[i][k], ", expected ", want[i][k]);
        return false;
      }
    }
  }
  return true;
}

// The compiled run equals the eager one (bitwise for one rank and replicate; within `tol` for fully shard) and the
// single-rank reference within `reference_tol`, on every rank; the ranks agree exactly.
inline void ExpectAgrees(const Result& res, const Where& where, double tol = 2e-5, double reference_tol = 2e-5) {
  ASSERT_TRUE(res.status.ok()) << res.status;
  const bool bitwise = where.kind != Kind::fully_shard;
  for (std::size_t r = 0; r < res.compiled.size(); ++r) {
    SCOPED_TRACE(absl::StrCat("rank ", r));
    const RankRun& c = res.compiled[r];
    const RankRun& e = res.eager[r];
    std::string at;
    if (bitwise) {
      EXPECT_EQ(c.losses, e.losses) << "compiled losses differ from eager's";
      EXPECT_TRUE(Near(c.values, e.values, 0.0, &at)) << "compiled vs eager, bitwise: " << at;
    } else {
      ASSERT_EQ(c.losses.size(), e.losses.size());
      for (std::size_t s = 0; s < c.losses.size(); ++s) {
        EXPECT_NEAR(c.losses[s], e.losses[s], tol + tol * std::abs(e.losses[s])) << "step " << s;
      }
      EXPECT_TRUE(Near(c.values, e.values, tol, &at)) << "compiled vs eager: " << at;
    }
    EXPECT_TRUE(Near(c.values, res.reference.values, reference_tol, &at)) << "compiled vs single-rank reference: " << at;
    EXPECT_TRUE(Near(e.values, res.reference.values, reference_tol, &at)) << "eager vs single-rank reference: " << at;
    if (r > 0) {
      EXPECT_TRUE(c.values == res.compiled[0].values) << "compiled rank " << r << " differs from rank 0";
    }
  }
}

// The parameter index of `name` in parameters() order.
inline std::size_t IndexOf(nn::Module& m, const std::string& name) {
  std::size_t i = 0;
  for (const auto& [n, p] : m.named_parameters()) {
    if (n == name) return i;
    ++i;
  }
  ADD_FAILURE() << "no parameter " << name;
  return 0;
}

}  // namespace shardkit::compile_combo
