// A rank program for the stall tests (stall_test.cc), launched by shardrun with --heartbeat-window:
//   stall_worker V K        all_reduce of 64 KiB in a loop; rank V SIGSTOPs itself right after issuing call K (it
//                           stays stopped until shardrun kills it); the others print "ERROR <ms> ms: <status>" (ms
//                           since the call that failed was issued) and exit 3.
//   stall_worker V K abort  after K calls rank V fails on its own (aborts its group with "rank V: its input is bad"),
//                           prints "ABORTED" and exits 3; the others do 2 s of other work first (so rank V's program
//                           has long ended), then call again and print "ERROR ..." as above.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/comm/init_from_env.h"

using namespace shardkit;
using namespace shardkit::comm;

int main(int argc, char** argv) {
  if (argc < 3) return 64;
  const int victim = std::atoi(argv[1]);
  const int at = std::atoi(argv[2]);
  const bool abort = argc > 3 && std::string(argv[3]) == "abort";
  ::signal(SIGTERM, SIG_IGN);  // report our error even though shardrun starts stopping us
  auto pg = init_from_env();
  if (!pg.ok()) {
    std::printf("INIT FAILED: %s\n", pg.status().ToString().c_str());
    return 2;
  }
  Tensor t = Tensor::full({1 << 14}, 1.0, {});
  for (int i = 0; i < at + 1000000; ++i) {
    if (abort && i == at) {
      if ((*pg)->rank() == victim) {
        (*pg)->abort(absl::AbortedError(absl::StrCat("rank ", victim, ": its input is bad")));
        std::printf("ABORTED\n");
        std::fflush(stdout);
        return 3;
      }
      absl::SleepFor(absl::Seconds(2));  // a slower survivor: it reaches its next call long after rank V is done
    }
    const absl::Time start = absl::Now();
    auto work = (*pg)->all_reduce(t);
    if ((*pg)->rank() == victim && i == at) ::raise(SIGSTOP);
    if (absl::Status st = work->wait(); !st.ok()) {
      std::printf("ERROR %lld ms: %s\n", static_cast<long long>(absl::ToInt64Milliseconds(absl::Now() - start)),
                  st.ToString().c_str());
      std::fflush(stdout);
      return 3;
    }
    t.fill_(1.0);
  }
  std::printf("NO ERROR\n");
  return 0;
}
