// A rank program for the MPI backend's tests, launched by mpirun (mpi_test.cc). Each mode prints one line per
// rank that the test reads:
//   mpi_worker matrix    every collective x op x dtype against the reference (tcp_test_util.h) on the world and
//                        on a split sub-group, in-place all_gather / reduce_scatter, a ring of send / recv, and
//                        all_reduce / reduce_scatter bitwise equal to the in-process arithmetic; prints
//                        "MPI MATRIX OK"
//   mpi_worker disagree  rank 0 all-reduces 10 elements, the others 11; prints "ERROR: <status>"
//   mpi_worker fingerprint  every rank all-reduces 10 elements, rank 0 with fingerprint 7, the others 9; prints
//                        "ERROR: <status>"
//   mpi_worker abort     rank n-1 aborts the world while the others wait in an all_reduce; prints
//                        "ERROR <ms> ms: <status>" (rank n-1: "ABORTED")
//   mpi_worker late FILE (2 ranks) rank 0 prints "FIRST <status>" and "SECOND <status>": two calls that failed at
//                        their deadlines while its communication thread was held in a blocking MPI call
//   mpi_worker stall     rank 1 never joins an all_reduce with a 2 s timeout; the others print
//                        "ERROR <ms> ms: <status>", rank 1 "STALLED"
//   mpi_worker kill V K T  all_reduces of 1 MiB with a T-second timeout in a loop; rank V SIGKILLs itself right
//                          after issuing call K (mid-all_reduce); the others print "ERROR <ms> ms: <status>" (ms
//                          since the call that failed was issued), meet on a group of the survivors and exit 3
//   mpi_worker stop V K T  the same with SIGSTOP: rank V stays stopped until mpirun ends the job
// After a failure each rank prints its line, then the ranks meet on a second world group (a fresh communicator:
// MPI is still usable), so no rank exits (and makes mpirun end the job: a process that exits without MPI_Finalize
// ends it) before every rank has printed.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/comm/mpi_process_group.h"
#include "common/comm/reduce_kernels.h"
#include "tests/common/comm/tcp_test_util.h"

// No leak check in this program (sanitizer builds): Open MPI leaves allocations behind and unloads its plugins in
// MPI_Finalize, so LeakSanitizer reports them from "<unknown module>" and no suppression by library can match
// them. AddressSanitizer's other checks stay on.
extern "C" const char* __asan_default_options() { return "detect_leaks=0"; }

using namespace shardkit;
using namespace shardkit::comm;

namespace {

int report_error(const absl::Status& st, absl::Time start) {
  std::printf("ERROR %lld ms: %s\n", static_cast<long long>(absl::ToInt64Milliseconds(absl::Now() - start)),
              st.ToString().c_str());
  std::fflush(stdout);
  return 3;
}

// The ranks meet on a fresh world group, so that none exits (and ends the job) before the others printed.
void meet_again() {
  auto fresh = create_mpi_world({.default_timeout = absl::Seconds(60), .name = "fresh"});
  if (fresh.ok()) (void)(*fresh)->barrier()->wait();
}

// A failed rank's exit: its line first (once the ranks met, mpirun may end the others), then the meeting.
int report_and_meet(const absl::Status& st, absl::Time start) {
  const int rc = report_error(st, start);
  meet_again();
  return rc;
}

std::vector<std::string> in_place_and_p2p(ProcessGroup& pg) {
  std::vector<std::string> errors;
  const int n = pg.size(), r = pg.rank();
  const std::int64_t m = 37;
  {  // all_gather in place: this rank's input is its slot of the output
    Tensor out = Tensor::zeros({n * m});
    out.view(r * m, {m}).copy_(tcp_testing::make_input(r, m, DType::f32));
    absl::Status st = pg.all_gather(out, out.view(r * m, {m}))->wait();
    const std::string bad = tcp_testing::compare(out, DType::f32, [&](std::int64_t j) {
      return tcp_testing::input_value(static_cast<int>(j / m), j % m);
    });
    if (!st.ok() || !bad.empty()) errors.push_back(absl::StrCat("all_gather in place: ", st.ToString(), " ", bad));
  }
  {  // reduce_scatter in place: the output is slice r of the input
    Tensor in = tcp_testing::make_input(r, n * m, DType::bf16);
    Tensor out = in.view(r * m, {m});
    absl::Status st = pg.reduce_scatter(out, in, tcp_testing::rs_opts(ReduceOp::avg()))->wait();
    const std::string bad = tcp_testing::compare(out, DType::bf16, [&](std::int64_t j) {
      return tcp_testing::reference(ReduceOp::avg(), DType::bf16, n, r * m + j);
    });
    if (!st.ok() || !bad.empty()) errors.push_back(absl::StrCat("reduce_scatter in place: ", st.ToString(), " ", bad));
  }
  if (n > 1) {  // a ring: send to the next rank, receive from the previous one
    Tensor mine = Tensor::full({m}, r + 1, {}), got = Tensor::zeros({m});
    auto sent = pg.send(mine, (r + 1) % n);
    absl::Status st = pg.recv(got, (r + n - 1) % n)->wait();
    if (st.ok()) st = sent->wait();
    const int from = (r + n - 1) % n;
    if (!st.ok() || got.item_at(m - 1) != from + 1) {
      errors.push_back(absl::StrCat("send/recv: ", st.ToString(), " got ", got.item_at(m - 1)));
    }
  }
  // all_reduce and reduce_scatter equal, bit for bit, the in-process backend's arithmetic (reduce_into over the
  // ranks in order), for values that round, in f32 and bf16.
  auto value = [](int q, std::int64_t j) { return 0.1f * static_cast<float>(q + 1) / static_cast<float>(j + 3); };
  for (DType dt : {DType::f32, DType::bf16}) {
    for (const ReduceOp& op : {ReduceOp::sum(), ReduceOp::avg(), ReduceOp::premul_sum(0.37)}) {
      const std::int64_t count = 4099;  // not a multiple of n: uneven segments
      std::vector<Tensor> inputs;
      for (int q = 0; q < n; ++q) {
        Tensor f = Tensor::zeros({count});
        for (std::int64_t j = 0; j < count; ++j) f.data<float>()[j] = value(q, j);
        inputs.push_back(dt == DType::f32 ? f : f.to(dt));
      }
      Tensor want = Tensor::zeros({count}, TensorOptions{}.with_dtype(dt));
      std::vector<const void*> srcs;
      for (const Tensor& t : inputs) srcs.push_back(t.raw_data());
      void* const dsts[] = {want.raw_data()};
      ReduceScratch scratch(4096);
      reduce_into(dt, op, srcs, dsts, count, scratch);
      Tensor t = inputs[static_cast<std::size_t>(r)].clone();
      absl::Status st = pg.all_reduce(t, tcp_testing::ar_opts(op))->wait();
      if (!st.ok() || std::memcmp(t.raw_data(), want.raw_data(), want.nbytes()) != 0) {
        errors.push_back(absl::StrCat("all_reduce ", op.to_string(), " ", std::string(dtype_name(dt)),
                                      " is not bitwise the in-process result: ", st.ToString()));
      }
      const std::int64_t m = count / n;
      Tensor in = inputs[static_cast<std::size_t>(r)].clone().view(0, {m * n}), out = Tensor::zeros({m}, TensorOptions{}.with_dtype(dt));
      st = pg.reduce_scatter(out, in, tcp_testing::rs_opts(op))->wait();
      if (!st.ok() || std::memcmp(out.raw_data(), want.view(r * m, {m}).raw_data(), out.nbytes()) != 0) {
        errors.push_back(absl::StrCat("reduce_scatter ", op.to_string(), " ", std::string(dtype_name(dt)),
                                      " is not bitwise the in-process result: ", st.ToString()));
      }
    }
  }
  return errors;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return 64;
  const std::string mode = argv[1];
  auto world = create_mpi_world({.default_timeout = absl::Seconds(60)});
  if (!world.ok()) {
    std::printf("INIT FAILED: %s\n", world.status().ToString().c_str());
    return 2;
  }
  ProcessGroup& pg = **world;
  const int n = pg.size(), r = pg.rank();
  if (mode == "matrix") {
    auto errors = tcp_testing::run_collective_matrix(pg, {0, 1, 7, 61}, {DType::f32, DType::bf16, DType::f16, DType::i64});
    auto big = tcp_testing::run_collective_matrix(pg, {1000003}, {DType::f32}, /*all_ops=*/false);
    errors.insert(errors.end(), big.begin(), big.end());
    auto more = in_place_and_p2p(pg);
    errors.insert(errors.end(), more.begin(), more.end());
    // A sub-group: the even and the odd ranks.
    auto sub = pg.split(r % 2, r);
    if (!sub.ok()) {
      errors.push_back(absl::StrCat("split: ", sub.status().ToString()));
    } else {
      auto sub_errors = tcp_testing::run_collective_matrix(**sub, {0, 7}, {DType::f32, DType::bf16, DType::i64});
      errors.insert(errors.end(), sub_errors.begin(), sub_errors.end());
      auto sub_more = in_place_and_p2p(**sub);
      errors.insert(errors.end(), sub_more.begin(), sub_more.end());
    }
    for (const auto& e : errors) std::printf("MISMATCH %s\n", e.c_str());
    if (!errors.empty()) return 1;
    if (absl::Status st = pg.barrier()->wait(); !st.ok()) return report_error(st, absl::Now());
    std::printf("MPI MATRIX OK rank %d of %d\n", r, n);
    return 0;
  }
  const absl::Time start = absl::Now();
  if (mode == "disagree") {
    Tensor t = Tensor::full({r == 0 ? 10 : 11}, 1.0, {});
    absl::Status st = pg.all_reduce(t)->wait();
    if (st.ok()) {
      std::printf("NO ERROR\n");
      return 0;
    }
    return report_and_meet(st, start);
  }
  if (mode == "fingerprint") {
    Tensor t = Tensor::full({10}, 1.0, {});
    absl::Status st = pg.all_reduce(t, {.fingerprint = r == 0 ? 7u : 9u})->wait();
    if (st.ok()) {
      std::printf("NO ERROR\n");
      return 0;
    }
    return report_and_meet(st, start);
  }
  if (mode == "abort") {
    Tensor t = Tensor::full({1 << 16}, 1.0, {});
    if (r == n - 1) {
      // Join once so the others are known to be under way, then abort instead of joining the second call.
      if (!pg.all_reduce(t)->wait().ok()) return 1;
      pg.abort(absl::InternalError("the trainer found a NaN"));
      std::printf("ABORTED\n");
      std::fflush(stdout);
      meet_again();
      return 3;
    }
    absl::Status st = pg.all_reduce(t)->wait();
    if (st.ok()) st = pg.all_reduce(t)->wait();
    if (st.ok()) {
      std::printf("NO ERROR\n");
      return 0;
    }
    return report_and_meet(st, start);
  }
  if (mode == "late" && argc >= 3 && n == 2) {
    // Rank 0's communication thread is held inside a blocking MPI call (creating a fresh world, which waits for
    // rank 1) while two of its calls wait: the first fails at its deadline, the second at its own, later, after
    // the group has already failed. Rank 1 joins the fresh world once rank 0 has printed (the file `argv[2]`).
    const std::string printed = argv[2];
    if (r == 1) {
      const absl::Time until = absl::Now() + absl::Seconds(60);
      while (absl::Now() < until) {
        if (std::FILE* f = std::fopen(printed.c_str(), "r")) {
          std::fclose(f);
          break;
        }
        std::this_thread::yield();
      }
      meet_again();
      return 0;
    }
    std::thread holder(meet_again);
    Tensor a = Tensor::full({1000}, 1.0, {}), b = Tensor::full({1000}, 1.0, {});
    auto first = pg.all_reduce(a, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(1)));
    auto second = pg.all_reduce(b, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(3)));
    const absl::Status s1 = first->wait(), s2 = second->wait();
    std::printf("FIRST %s\nSECOND %s\n", s1.ToString().c_str(), s2.ToString().c_str());
    std::fflush(stdout);
    if (std::FILE* f = std::fopen(printed.c_str(), "w")) std::fclose(f);
    holder.join();
    return 3;
  }
  if (mode == "stall") {
    if (r == 1) {  // never joins the all_reduce; meets the others once they gave up
      std::printf("STALLED\n");
      std::fflush(stdout);
      meet_again();
      return 3;
    }
    Tensor t = Tensor::full({1000}, 1.0, {});
    absl::Status st = pg.all_reduce(t, tcp_testing::ar_opts(ReduceOp::sum(), absl::Seconds(2)))->wait();
    if (st.ok()) {
      std::printf("NO ERROR\n");
      return 0;
    }
    return report_and_meet(st, start);
  }
  if ((mode == "kill" || mode == "stop") && argc >= 5) {
    const int victim = std::atoi(argv[2]);
    const int at = std::atoi(argv[3]);
    const absl::Duration timeout = absl::Seconds(std::atoi(argv[4]));
    // Made before the fault, while every rank still answers: the survivors meet on it once they have printed (a
    // group over members only, so the victim is not waited for).
    auto survivors = pg.split(r == victim ? 1 : 0, r);
    if (!survivors.ok()) return report_error(survivors.status(), absl::Now());
    Tensor t = Tensor::full({1 << 18}, 1.0, {});
    for (int i = 0; i < at + 50; ++i) {
      const absl::Time call_start = absl::Now();
      auto work = pg.all_reduce(t, tcp_testing::ar_opts(ReduceOp::sum(), timeout));
      if (r == victim && i == at) ::raise(mode == "kill" ? SIGKILL : SIGSTOP);
      if (absl::Status st = work->wait(); !st.ok()) {
        const int rc = report_error(st, call_start);
        (void)(*survivors)->barrier()->wait();
        return rc;
      }
      t.fill_(1.0);
    }
    std::printf("NO ERROR\n");
    return 0;
  }
  return 64;
}
