#include "tools/shardkit_train/report.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace shardkit::train {
namespace {

constexpr MemoryCategory kCategories[] = {MemoryCategory::parameter, MemoryCategory::gradient,
                                         MemoryCategory::optimizer_state, MemoryCategory::activation,
                                         MemoryCategory::communication_buffer, MemoryCategory::other};
constexpr const char* kShortName[] = {"param", "grad", "optim", "activ", "comm", "other"};

// A byte count in the unit that keeps it short at every model size: KiB below 10 MiB, MiB below 10 GiB, GiB
// above (tables stay aligned from 35 k to 124 M parameters). Exact comparisons use the raw counts.
struct ByteUnit {
  const char* name;
  double size;
};
ByteUnit unit_for(std::int64_t bytes) {
  if (bytes < (std::int64_t{10} << 20)) return {"KiB", 1024.0};
  if (bytes < (std::int64_t{10} << 30)) return {"MiB", 1024.0 * 1024.0};
  return {"GiB", 1024.0 * 1024.0 * 1024.0};
}

std::string human_bytes(std::int64_t bytes) {
  if (bytes < 0) return "-";
  const ByteUnit u = unit_for(bytes);
  return absl::StrFormat("%.1f %s", static_cast<double>(bytes) / u.size, u.name);
}

std::string printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s) out.push_back(c == '\n' ? '\n' : (c >= 32 && c < 127) ? static_cast<char>(c) : '.');
  return out;
}

std::int64_t peak_of(const RankStats& s, MemoryCategory c) { return s.peak[static_cast<std::size_t>(c)]; }

// Expected bytes sent per rank per step by the strategy's collectives (Note [ring-equivalent volume]). Under bf16
// gradients are reduced in bf16 (2 bytes), and fsdp also all-gathers bf16; oss / sddp all-gather the updated
// parameters in f32 (4 bytes), because those are the owners' masters (trainer.h).
std::string expected_comm(const Options& o, const RunResult& r) {
  const std::int64_t n = r.world, psi = r.num_params;
  const bool bf16 = o.precision == Precision::bf16;
  const std::int64_t grad_bytes = bf16 ? 2 : 4;
  const std::int64_t ar = 2 * (n - 1) * psi * grad_bytes / n;
  switch (r.strategy) {
    case Strategy::ddp:
      return absl::StrCat("all_reduce of gradients 2(N-1)/N x ", grad_bytes, "Psi = ", with_commas(ar));
    case Strategy::oss:
    case Strategy::sddp:
      return absl::StrCat("reduce_scatter of gradients (N-1) x ", grad_bytes,
                          "Psi/N + all_gather of parameters (N-1) x 4Psi/N = ",
                          with_commas((n - 1) * ((psi + n - 1) / n) * (grad_bytes + 4)), " (with padding to N x ceil(Psi/N)",
                          bf16 ? "; the parameters are all-gathered in f32: they are the owners' masters)" : ")");
    case Strategy::fsdp:
      return absl::StrCat("about 3(N-1)/N x ", grad_bytes, "Psi = ", with_commas(3 * (n - 1) * psi * grad_bytes / n),
                          ": each block all-gathered", bf16 ? " (in bf16)" : "",
                          " before its forward and again before its backward, its gradients reduce-scattered",
                          bf16 ? " (in bf16)" : "", "; the root unit (embeddings, final norm) is gathered once per step");
  }
  return "";
}

// Note [mixed-precision memory in shardkit-train]
// DESIGN.md section 6's mixed-precision column counts bf16 parameters (2Psi) and gradients (2Psi) and puts the f32
// master with AdamW's m and v (12Psi, sharded like the optimizer state). This CPU library stores things otherwise,
// so under --precision bf16 the table compares each peak with this implementation's formula, and prints DESIGN's
// next to it:
//   parameter  the f32 parameters ARE the masters (4Psi; fsdp: 4Psi/N shards at rest), and during a step ddp / oss /
//              sddp also hold f32 copies holding bf16 values (4Psi more, Note [rounded parameters in forward] in
//              common/nn/mixed_precision.h): the ops compute in f32 only, so a copy cannot be 2-byte bf16 here.
//              fsdp's gathered units are f32 buffers of bf16 values for the same reason (its peak is above the
//              at-rest formula in fp32 too).
//   gradient   gradients land f32 (4Psi, or 4Psi/N owned): backward computes in f32; the bf16 copy of a gradient
//              lives only in the reduction's communication buffer.
//   optimizer  AdamW's m and v (8Psi, or 8Psi/N): the master is not optimizer state here, it is the parameter.
// So ddp's 16Psi in DESIGN's column is 8Psi + 4Psi + 8Psi = 20Psi here, and sharding moves 8Psi/N-style terms
// exactly as in fp32 (the parameter terms do not shrink with N except in fsdp).
const char* design_mixed_formula(Strategy s) {
  switch (s) {
    case Strategy::ddp: return "2Psi + 2Psi + 12Psi = 16Psi";
    case Strategy::oss: return "2Psi + 2Psi + 12Psi/N";
    case Strategy::sddp: return "2Psi + 2Psi/N + 12Psi/N";
    case Strategy::fsdp: return "16Psi/N + unsharded units in flight";
  }
  return "";
}

}  // namespace

std::string with_commas(std::int64_t v) {
  std::string s = std::to_string(v < 0 ? -v : v), out;
  for (std::size_t i = 0; i < s.size(); ++i) {
    if (i > 0 && (s.size() - i) % 3 == 0) out.push_back(',');
    out.push_back(s[i]);
  }
  return v < 0 ? absl::StrCat("-", out) : out;
}

std::string progress_line(std::int64_t step, std::int64_t total, double loss, double tokens_per_s, double eta_s, bool bar) {
  std::string b;
  if (bar) {
    constexpr int kWidth = 24;
    const int filled = static_cast<int>(kWidth * step / std::max<std::int64_t>(1, total));
    b = absl::StrCat("[", std::string(static_cast<std::size_t>(filled), '#'),
                     std::string(static_cast<std::size_t>(kWidth - filled), '.'), "] ");
  }
  const int width = static_cast<int>(std::to_string(total).size());
  return absl::StrFormat("step %*d/%d %sloss %.4f  %.1fk tok/s  ETA %.0fs", width, step, total, b, loss,
                         tokens_per_s / 1000.0, eta_s);
}

std::string run_header(const Options& o, Strategy strategy, const ModelSize& model, const Corpus& corpus, int world,
                       const std::string& backend) {
  const nn::GPTConfig& c = model.config;
  return absl::StrCat(
      "shardkit-train: model ", model.name, " (byte-level GPT, ", with_commas(c.num_parameters()), " parameters: ",
      c.num_layers, " layers, width ", c.width, ", ", c.num_heads, " heads, context ", c.context, "; fp32 AdamW model state ",
      human_bytes(16 * c.num_parameters()), " unsharded)\n",
      "  strategy ", strategy_name(strategy), " on ", world, " ranks (", backend, "), ",
      o.precision == Precision::bf16 ? "bf16 mixed precision (f32 masters)" : "fp32", ", AdamW lr ", absl::StrFormat("%g", o.lr),
      " (warmup + cosine), seed ", o.seed, "\n",
      "  data ", corpus.source == "embedded" ? std::string("embedded corpus (the project's documentation)") : absl::StrCat("'", corpus.source, "'"),
      ", ", with_commas(static_cast<std::int64_t>(corpus.bytes.size())), " bytes; ", o.batch, " sequences x ", c.context,
      " bytes per rank per step = ", with_commas(o.batch * c.context * world), " tokens per step; ", o.steps, " steps\n");
}

Expected expected_bytes(Strategy s, MemoryCategory c, std::int64_t psi, int n, std::int64_t owned, Precision precision) {
  const bool sharded_grad = s == Strategy::sddp || s == Strategy::fsdp, sharded_opt = s != Strategy::ddp;
  switch (c) {
    case MemoryCategory::parameter:
      // fsdp: at rest; during a step the root unit and one block are gathered on top (the peak is larger).
      if (s == Strategy::fsdp) return {4 * owned, absl::StrCat("4Psi/N at rest (owned ", with_commas(owned), ")")};
      // bf16: the f32 masters and, during a step, their f32 copies of bf16 values (Note [mixed-precision memory in
      // shardkit-train]).
      if (precision == Precision::bf16) return {8 * psi, "4Psi + 4Psi"};
      return {4 * psi, "4Psi"};
    case MemoryCategory::gradient:
      if (sharded_grad) return {4 * owned, absl::StrCat("4Psi/N (owned ", with_commas(owned), ")")};
      return {4 * psi, "4Psi"};
    case MemoryCategory::optimizer_state:
      if (sharded_opt) return {8 * owned, absl::StrCat("8Psi/N (owned ", with_commas(owned), ")")};
      return {8 * psi, "8Psi"};
    default: return {};
  }
  (void)n;
}

std::string run_report(const Options& o, const RunResult& r) {
  std::string out;
  if (!r.losses.empty()) {
    const double first = r.losses.front(), last = r.losses.back();
    absl::StrAppend(&out, absl::StrFormat("\nloss: first %.4f (step %d), last %.4f (step %d): %.0f%% of the first\n", first,
                                          r.start_step + 1, last, r.start_step + static_cast<std::int64_t>(r.losses.size()),
                                          100.0 * last / first));
    absl::StrAppend(&out, absl::StrFormat("time: %.1f s for %d steps (%.3f s/step, %.1fk tokens/s)\n", r.total_seconds,
                                          r.losses.size(), r.seconds_per_step,
                                          static_cast<double>(r.tokens_per_step) / r.seconds_per_step / 1000.0));
  } else {
    absl::StrAppend(&out, "\nnothing to train: the checkpoint is already at step ", r.start_step, "\n");
  }
  const std::int64_t psi = r.num_params;
  const int n = r.world;
  const bool bf16 = o.precision == Precision::bf16;
  absl::StrAppend(&out, "\nmemory per rank: peak bytes during a step, by ledger category (Psi = ", with_commas(psi),
                  " parameters, N = ", n, bf16 ? ", bf16 mixed precision, f32 masters, AdamW" : ", fp32 AdamW",
                  "; ZeRO formula for ", strategy_name(r.strategy), ": ");
  if (bf16) {
    absl::StrAppend(&out, "DESIGN.md's mixed-precision column ", design_mixed_formula(r.strategy),
                    " with bf16 parameters and gradients and the f32 master in the optimizer state; this implementation: ");
  }
  const std::string param = bf16 ? "(4Psi + 4Psi)" : "4Psi";
  switch (r.strategy) {
    case Strategy::ddp: absl::StrAppend(&out, param, " + 4Psi + 8Psi = ", bf16 ? "20Psi" : "16Psi"); break;
    case Strategy::oss: absl::StrAppend(&out, param, " + 4Psi + 8Psi/N"); break;
    case Strategy::sddp: absl::StrAppend(&out, param, " + 4Psi/N + 8Psi/N"); break;
    case Strategy::fsdp:
      absl::StrAppend(&out, "4Psi/N + 4Psi/N + 8Psi/N = 16Psi/N at rest; a step also holds the gathered units and "
                            "their full gradients");
      break;
  }
  absl::StrAppend(&out, ")\n");
  // --checkpoint-activations: one more column, the activation peak without checkpointing (Note [activation peak
  // without checkpointing] in trainer.cc).
  const bool ckpt = o.checkpoint_activations;
  absl::StrAppend(&out, absl::StrFormat("%-5s %-26s %-26s %-26s %12s %12s %12s", "rank", "parameter (formula)",
                                        "gradient (formula)", "optimizer (formula)", ckpt ? "activ (ckpt)" : "activation",
                                        "comm buffer", "other"));
  absl::StrAppend(&out, ckpt ? absl::StrFormat(" %14s\n", "activ w/o ckpt") : "\n");
  for (int rk = 0; rk < n; ++rk) {
    const RankStats& s = r.ranks[static_cast<std::size_t>(rk)];
    std::string cells[3];
    for (int c = 0; c < 3; ++c) {
      const Expected e = expected_bytes(r.strategy, kCategories[c], psi, n, s.owned_numel, o.precision);
      const std::int64_t got = peak_of(s, kCategories[c]);
      cells[c] = absl::StrCat(human_bytes(got), " (", human_bytes(e.bytes), got == e.bytes ? " =" : "", ")");
    }
    absl::StrAppend(&out, absl::StrFormat("%-5d %-26s %-26s %-26s %12s %12s %12s", rk, cells[0], cells[1], cells[2],
                                          human_bytes(peak_of(s, MemoryCategory::activation)),
                                          human_bytes(peak_of(s, MemoryCategory::communication_buffer)),
                                          human_bytes(peak_of(s, MemoryCategory::other))));
    absl::StrAppend(&out, ckpt ? absl::StrFormat(" %14s\n", human_bytes(s.activation_peak_without_checkpointing)) : "\n");
  }
  absl::StrAppend(&out, "  (x (y =): measured x, formula y, exactly equal; owned = elements of optimizer state on the rank)\n");
  if (bf16) {
    // Note [mixed-precision memory in shardkit-train].
    absl::StrAppend(&out, "  bf16: the f32 parameters are the masters (DESIGN counts the master in the optimizer state), ",
                    r.strategy == Strategy::fsdp ? "gathered units hold bf16 values in f32 buffers"
                                                 : "a step adds f32 copies holding bf16 values (4Psi)",
                    ", gradients land f32: the CPU ops compute in f32 only, so bf16 values are stored 4 bytes wide\n");
  }
  if (ckpt && !r.ranks.empty() && r.ranks[0].activation_peak_without_checkpointing >= 0) {
    // --compile: the replayed steps' peak; the capture (the first step) holds every value of the step while it
    // records, the recompute's too (Note [capturing activation checkpointing] in common/nn/checkpoint.cc).
    const std::int64_t replayed = r.ranks[0].activation_peak_replayed;
    const std::int64_t with = replayed >= 0 ? replayed : peak_of(r.ranks[0], MemoryCategory::activation);
    const std::int64_t without = r.ranks[0].activation_peak_without_checkpointing;
    absl::StrAppend(&out, "activation checkpointing (every transformer block recomputed in backward): rank 0's activation "
                          "peak ", with_commas(with), " bytes with, ", with_commas(without), " bytes without",
                    without > 0 ? absl::StrFormat(" (%.0f%%)", 100.0 * static_cast<double>(with) / static_cast<double>(without)) : "",
                    replayed >= 0 ? absl::StrCat("; with: the replayed steps (the capture in the first step held ",
                                                 with_commas(peak_of(r.ranks[0], MemoryCategory::activation)), ")")
                                  : "",
                    "\n");
  }
  absl::StrAppend(&out, "\ncommunication per step (bytes sent per rank, ProcessGroup counters):");
  for (int rk = 0; rk < n; ++rk) absl::StrAppend(&out, rk == 0 ? " " : ", ", with_commas(r.ranks[static_cast<std::size_t>(rk)].bytes_sent_per_step));
  absl::StrAppend(&out, absl::StrFormat("  (= %.2f x 4Psi)\n", static_cast<double>(r.ranks[0].bytes_sent_per_step) / (4.0 * static_cast<double>(psi))));
  absl::StrAppend(&out, "  expected: ", expected_comm(o, r), "\n");
  if (!r.compiled_graph.empty()) absl::StrAppend(&out, "\ncompiled step (--compile):\n", r.compiled_graph);
  if (!r.sample.empty()) absl::StrAppend(&out, "\nsample (temperature 0.8):\n", printable(r.sample), "\n");
  if (!r.losses.empty()) absl::StrAppend(&out, absl::StrFormat("\nfinal loss: %.9g\n", r.losses.back()));
  absl::StrAppend(&out, absl::StrFormat("parameter digest: %016x\n", r.param_digest));
  return out;
}

std::string compare_table(const std::vector<RunResult>& results) {
  std::string out = absl::StrFormat("\n%-9s %9s %11s %11s %11s %12s %11s %11s %11s %11s %15s %10s\n", "strategy", "step (s)",
                                    "param", "grad", "optim", "model state", "activ", "comm buf", "other", "sum", "sent/rank/step",
                                    "final loss");
  for (const RunResult& r : results) {
    std::array<std::int64_t, kNumMemoryCategories> mx{};
    std::int64_t sent = 0;
    for (const RankStats& s : r.ranks) {
      for (int c = 0; c < kNumMemoryCategories; ++c) mx[static_cast<std::size_t>(c)] = std::max(mx[static_cast<std::size_t>(c)], s.peak[static_cast<std::size_t>(c)]);
      sent = std::max(sent, s.bytes_sent_per_step);
    }
    std::int64_t total = 0;
    for (std::int64_t v : mx) total += v;
    absl::StrAppend(&out, absl::StrFormat("%-9s %9.3f %11s %11s %11s %12s %11s %11s %11s %11s %15s %10.4f\n", strategy_name(r.strategy),
                                          r.seconds_per_step, human_bytes(mx[0]), human_bytes(mx[1]), human_bytes(mx[2]), human_bytes(mx[0] + mx[1] + mx[2]), human_bytes(mx[3]),
                                          human_bytes(mx[4]), human_bytes(mx[5]), human_bytes(total), with_commas(sent), r.losses.empty() ? 0.0 : r.losses.back()));
  }
  absl::StrAppend(&out, "(memory: the largest per-rank peak of each ledger category during a step; model state = param + grad + optim,\n"
                        " what the ZeRO formulas cover; sum = sum of the category peaks; sent: bytes per rank per step, largest rank)\n");
  return out;
}

absl::Status write_compare_svg(const std::string& path, const std::vector<RunResult>& results) {
  static const char* kColors[] = {"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948"};
  static const char* kLineColors[] = {"#4e79a7", "#e15759", "#59a14f", "#b07aa1"};
  const double W = 1000, H = 420, top = 50, bottom = 360, lx0 = 60, lx1 = 470, rx0 = 560, rx1 = 960;
  std::string s = absl::StrFormat(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W, H);
  // Left: memory per rank, stacked by category, grouped by strategy.
  std::int64_t max_total = 1;
  int bars = 0;
  for (const RunResult& r : results) {
    for (const RankStats& st : r.ranks) {
      std::int64_t t = 0;
      for (std::int64_t v : st.peak) t += v;
      max_total = std::max(max_total, t);
      ++bars;
    }
  }
  const ByteUnit axis = unit_for(max_total);
  absl::StrAppend(&s, absl::StrFormat("<text x=\"%.0f\" y=\"25\" font-size=\"15\">Peak memory per rank by ledger category (%s)</text>\n", lx0, axis.name));
  const double slot = (lx1 - lx0) / (bars + static_cast<double>(results.size()));
  double x = lx0 + slot / 2;
  for (const RunResult& r : results) {
    const double group_x = x;
    for (std::size_t rk = 0; rk < r.ranks.size(); ++rk) {
      double y = bottom;
      for (int c = 0; c < kNumMemoryCategories; ++c) {
        const double h = (bottom - top) * static_cast<double>(r.ranks[rk].peak[static_cast<std::size_t>(c)]) / static_cast<double>(max_total);
        y -= h;
        absl::StrAppend(&s, absl::StrFormat("<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"%s\"><title>%s rank %d %s: %s</title></rect>\n",
                                            x, y, slot * 0.85, h, kColors[c], strategy_name(r.strategy), rk, kShortName[c],
                                            human_bytes(r.ranks[rk].peak[static_cast<std::size_t>(c)])));
      }
      x += slot;
    }
    absl::StrAppend(&s, absl::StrFormat("<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%s</text>\n", (group_x + x - slot * 0.15) / 2,
                                        bottom + 18, strategy_name(r.strategy)));
    x += slot;
  }
  for (int i = 0; i <= 4; ++i) {
    const double y = bottom - (bottom - top) * i / 4.0;
    absl::StrAppend(&s, absl::StrFormat("<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#ccc\"/><text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%.0f</text>\n",
                                        lx0 - 4, lx1, y, y, lx0 - 6, y + 4, static_cast<double>(max_total) * i / 4.0 / axis.size));
  }
  for (int c = 0; c < kNumMemoryCategories; ++c) {
    absl::StrAppend(&s, absl::StrFormat("<rect x=\"%.0f\" y=\"%.0f\" width=\"10\" height=\"10\" fill=\"%s\"/><text x=\"%.0f\" y=\"%.0f\">%s</text>\n",
                                        lx0 + 70.0 * c, bottom + 35, kColors[c], lx0 + 70.0 * c + 14, bottom + 44, kShortName[c]));
  }
  // Right: loss curves.
  double lo = 1e30, hi = -1e30;
  std::size_t steps = 1;
  for (const RunResult& r : results) {
    for (double l : r.losses) lo = std::min(lo, l), hi = std::max(hi, l);
    steps = std::max(steps, r.losses.size());
  }
  if (!(hi > lo)) hi = lo + 1;
  absl::StrAppend(&s, absl::StrFormat("<text x=\"%.0f\" y=\"25\" font-size=\"15\">Training loss by step</text>\n", rx0));
  for (int i = 0; i <= 4; ++i) {
    const double y = bottom - (bottom - top) * i / 4.0;
    absl::StrAppend(&s, absl::StrFormat("<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"#ccc\"/><text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%.2f</text>\n",
                                        rx0, rx1, y, y, rx0 - 6, y + 4, lo + (hi - lo) * i / 4.0));
  }
  absl::StrAppend(&s, absl::StrFormat("<text x=\"%.0f\" y=\"%.0f\" text-anchor=\"middle\">step (1..%d)</text>\n", (rx0 + rx1) / 2, bottom + 18, steps));
  for (std::size_t k = 0; k < results.size(); ++k) {
    const RunResult& r = results[k];
    std::string pts;
    for (std::size_t i = 0; i < r.losses.size(); ++i) {
      const double px = rx0 + (rx1 - rx0) * (steps == 1 ? 0.0 : static_cast<double>(i) / static_cast<double>(steps - 1));
      const double py = bottom - (bottom - top) * (r.losses[i] - lo) / (hi - lo);
      absl::StrAppend(&pts, absl::StrFormat("%.1f,%.1f ", px, py));
    }
    const char* color = kLineColors[k % 4];
    // Equal runs give equal curves: dashes keep every strategy visible where they overlap.
    static const char* kDash[] = {"none", "7,4", "2,4", "10,3,2,3"};
    absl::StrAppend(&s, absl::StrFormat("<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" stroke-dasharray=\"%s\" points=\"%s\"/>\n",
                                        color, kDash[k % 4], pts));
    absl::StrAppend(&s, absl::StrFormat("<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.0f\" y2=\"%.0f\" stroke=\"%s\" stroke-width=\"3\"/><text x=\"%.0f\" y=\"%.0f\">%s</text>\n",
                                        rx0 + 90.0 * k, rx0 + 90.0 * k + 20, bottom + 40, bottom + 40, color, rx0 + 90.0 * k + 24,
                                        bottom + 44, strategy_name(r.strategy)));
  }
  absl::StrAppend(&s, "</svg>\n");
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  if (!f) return absl::FailedPreconditionError(absl::StrCat("cannot write chart '", path, "'"));
  f << s;
  f.close();
  if (!f) return absl::FailedPreconditionError(absl::StrCat("cannot write chart '", path, "'"));
  return absl::OkStatus();
}

}  // namespace shardkit::train
