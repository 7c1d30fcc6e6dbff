// shardkit-train: trains a byte-level GPT on N ranks with DDP, OSS or ShardedDDP and shows, per rank, what
// each strategy costs in memory (by ledger category, next to the ZeRO formula) and communication (issue 7).
//
//   build/tools/shardkit-train                                 # defaults: oss, 4 threads, model small
//   build/tools/shardkit-train --strategy ddp --ranks 2 --steps 50
//   build/tools/shardkit-train --compare                       # every strategy, one table + SVG chart
//   build/tools/shardrun --nproc 2 -- build/tools/shardkit-train --strategy oss --steps 20   # over TCP
//
// Bad input (unknown option or value, missing/empty data file, unwritable checkpoint directory or --export
// path, a checkpoint directory in use by another run or holding a checkpoint without --resume / --overwrite,
// a checkpoint of another model, an --init-from file of another shape) prints one line
// "shardkit-train: error: ..." on stderr and exits 1.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/kernels/gemm.h"
#include "tools/shardkit_train/checkpoint.h"
#include "tools/shardkit_train/corpus.h"
#include "tools/shardkit_train/model_files.h"
#include "tools/shardkit_train/options.h"
#include "tools/shardkit_train/report.h"
#include "tools/shardkit_train/trainer.h"

namespace st = shardkit::train;

namespace {

int fail(const absl::Status& s) {
  std::string msg(s.message());
  for (char& c : msg) {
    if (c == '\n') c = ' ';
  }
  std::fprintf(stderr, "shardkit-train: error: %s\n", msg.c_str());
  return 1;
}

// Rank 0's view of each step: the progress line (a bar on a terminal, ~15 lines otherwise) and, with --log, a
// line of the metrics log.
st::StepObserver make_observer(bool tty, std::int64_t steps, st::MetricsLog* log) {
  const std::int64_t every = std::max<std::int64_t>(1, steps / 15);
  return [tty, every, log](const st::StepRecord& r) -> absl::Status {
    const std::string line = st::progress_line(r.step, r.steps, r.loss, r.mean_tokens_per_s, r.eta_seconds, tty);
    if (tty) {
      std::printf("\r%s\033[K%s", line.c_str(), r.step == r.steps ? "\n" : "");
      std::fflush(stdout);
    } else if (r.step % every == 0 || r.step == r.steps || r.step == 1) {
      std::printf("%s\n", line.c_str());
      std::fflush(stdout);
    }
    return log != nullptr ? log->write(r) : absl::OkStatus();
  };
}

}  // namespace

int main(int argc, char** argv) {
  auto opts = st::parse_options(std::vector<std::string>(argv + 1, argv + argc));
  if (!opts.ok()) return fail(opts.status());
  st::Options o = *opts;
  if (o.help) {
    std::fputs(st::usage().c_str(), stdout);
    return 0;
  }
  // A launcher's rank variables (Note [launchers] in common/comm/init_from_env.cc); Slurm's only inside a step.
  const auto [rank_var, size_var] =
      std::getenv("RANK") != nullptr && std::getenv("WORLD_SIZE") != nullptr ? std::pair{"RANK", "WORLD_SIZE"}
      : std::getenv("OMPI_COMM_WORLD_RANK") != nullptr ? std::pair{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"}
      : std::getenv("SLURM_PROCID") != nullptr && std::getenv("SLURM_STEP_ID") != nullptr
          ? std::pair{"SLURM_PROCID", "SLURM_NTASKS"}
          : std::pair<const char*, const char*>{nullptr, nullptr};
  const bool under_launcher = rank_var != nullptr;
  // The rank as the process group reads it (a number: "00" and "+0" are rank 0 too, so that process keeps rank 0's
  // duties, the checkpoint directory's lock among them; a value that is not a number fails at init below).
  int launcher_rank = -1;
  const bool is_rank0 = !under_launcher || (absl::SimpleAtoi(std::getenv(rank_var), &launcher_rank) && launcher_rank == 0);
  if (o.compare && under_launcher) return fail(absl::InvalidArgumentError("--compare runs ranks as threads; start it without a launcher"));
  if (o.backend == st::Backend::mpi && std::getenv("OMPI_COMM_WORLD_RANK") == nullptr) {
    return fail(absl::InvalidArgumentError(
        "--backend mpi: expected to be started by mpirun (mpirun -np 4 shardkit-train --backend mpi), found "
        "OMPI_COMM_WORLD_RANK unset"));
  }
  if (o.compare && (!o.checkpoint_dir.empty() || o.resume || o.overwrite || !o.export_path.empty())) {
    return fail(absl::InvalidArgumentError("--compare does not take --checkpoint-dir, --resume, --overwrite or --export"));
  }
  if (under_launcher) {
    // Range-checked (std::atoi of an out-of-range value is undefined): batch x context x ranks must not overflow.
    const char* size = std::getenv(size_var);
    if (size == nullptr || !absl::SimpleAtoi(size, &o.ranks) || o.ranks < 1) {
      return fail(absl::InvalidArgumentError(absl::StrCat("expected ", size_var, " a number of ranks in [1, 2147483647], found ",
                                                          size == nullptr ? std::string("it unset") : absl::StrCat("'", size, "'"))));
    }
  }

  auto model = st::model_size(o.model, o.shape);
  if (!model.ok()) return fail(model.status());
  auto corpus = st::load_corpus(o.data, model->config.context);
  if (!corpus.ok()) return fail(corpus.status());
  std::optional<st::Checkpoint> resume;
  // Rank 0 holds the directory's lock until it exits (Note [checkpoint format] in checkpoint.h); the other
  // processes of the run write their rank files into the directory rank 0 prepared.
  std::optional<shardkit::io::DirectoryLock> checkpoint_lock;
  if (!o.checkpoint_dir.empty() && is_rank0) {
    auto lock = st::open_dir(o);
    if (!lock.ok()) return fail(lock.status());
    checkpoint_lock.emplace(std::move(*lock));
  }
  if (o.resume) {
    auto ck = st::read_checkpoint(o.checkpoint_dir);
    if (!ck.ok()) return fail(ck.status());
    if (absl::Status s = st::check_resumable(*ck, o, *model, *corpus); !s.ok()) return fail(s);
    resume = std::move(*ck);
  }
  if (!o.export_path.empty()) {
    if (absl::Status s = st::check_export_target(o.export_path); !s.ok()) return fail(s);
  }
  std::optional<shardkit::nn::StateDict> init;  // --init-from: read and checked before any rank starts
  if (!o.init_from.empty()) {
    auto weights = st::read_init_weights(o.init_from, *model);
    if (!weights.ok()) return fail(weights.status());
    init = std::move(*weights);
  }
  std::optional<st::MetricsLog> log;
  if (!o.log.empty() && is_rank0) {
    auto l = st::MetricsLog::open(o.log);
    if (!l.ok()) return fail(l.status());
    log.emplace(std::move(*l));
  }
  const bool tty = ::isatty(1) == 1;
  // Note [BLAS kernel choice] in common/kernels/gemm.h: said once, under the first run header.
  const std::string blas_note = shardkit::kernels::blas_kernel_advice(shardkit::kernels::blas_core_name(),
                                                                      shardkit::kernels::cpu_runs_avx512_blas());
  auto print_blas_note = [&] {
    if (!blas_note.empty()) std::printf("  note: %s\n", blas_note.c_str());
  };
  const st::StepObserver progress = is_rank0 ? make_observer(tty, o.steps, log ? &*log : nullptr) : st::StepObserver();

  if (o.compare) {
    std::vector<st::RunResult> results;
    for (st::Strategy s : st::available_strategies()) {
      std::printf("%s", st::run_header(o, s, *model, *corpus, o.ranks, "threads").c_str());
      if (results.empty()) print_blas_note();
      auto r = st::run_threads(o, s, *corpus, nullptr, progress, init ? &*init : nullptr);
      if (!r.ok()) return fail(r.status());
      results.push_back(std::move(*r));
    }
    std::printf("%s", st::compare_table(results).c_str());
    if (absl::Status s = st::write_compare_svg(o.svg, results); !s.ok()) return fail(s);
    std::printf("chart: %s\n", o.svg.c_str());
    return 0;
  }

  if (is_rank0) {
    std::printf("%s", st::run_header(o, o.strategy, *model, *corpus, o.ranks, st::backend_label(o.backend, under_launcher)).c_str());
    if (resume) std::printf("  resuming from %s at step %s\n", st::checkpoint_path(o.checkpoint_dir).c_str(), resume->meta["step"].c_str());
    if (init) std::printf("  initialised from %s (GPT-2 names)\n", o.init_from.c_str());
    print_blas_note();
    std::fflush(stdout);
  }
  std::optional<st::RunResult> result;
  if (under_launcher) {
    auto r = st::run_process(o, o.strategy, *corpus, resume ? &*resume : nullptr, progress, init ? &*init : nullptr);
    if (!r.ok()) return fail(r.status());
    result = std::move(*r);
  } else {
    auto r = st::run_threads(o, o.strategy, *corpus, resume ? &*resume : nullptr, progress, init ? &*init : nullptr);
    if (!r.ok()) return fail(r.status());
    result = std::move(*r);
  }
  if (result) std::printf("%s", st::run_report(o, *result).c_str());
  if (result && !o.export_path.empty()) {
    std::printf("exported: %s (GPT-2 names, %s)\n", o.export_path.c_str(),
                st::export_is_one_file(o.export_path) ? "one file" : "one part per rank and model.safetensors.index.json");
  }
  return 0;
}
