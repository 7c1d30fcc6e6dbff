// A rank program for the multi-process TCP tests, launched by shardrun (tcp_multiprocess_test.cc).
//   tcp_worker matrix          every collective x op x dtype against the reference; prints "MATRIX OK"
//   tcp_worker latency         200 one-element all_reduces; prints the average and worst latency
//   tcp_worker external        init_from_env against a standalone store (host_store = false); one all_reduce;
//                              prints "EXTERNAL OK"
//   tcp_worker kill V K        all_reduce of 4 MiB in a loop; rank V SIGKILLs itself right after issuing
//                              call K (mid-all_reduce); the others print "ERROR <ms> ms: <status>" and exit 3
#include <signal.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "common/comm/init_from_env.h"
#include "common/comm/tcp_store.h"
#include "tests/common/comm/tcp_test_util.h"

using namespace shardkit;
using namespace shardkit::comm;

int main(int argc, char** argv) {
  if (argc < 2) return 64;
  const std::string mode = argv[1];
  InitFromEnvOptions options;
  options.group.default_timeout = absl::Seconds(30);
  if (mode == "matrix") options.group.chunk_bytes = 24;
  if (const char* sp = std::getenv("TCP_WORKER_SPIN_US")) options.group.spin = absl::Microseconds(std::atoi(sp));
  if (mode == "external") {
    options.host_store = false;
    options.store_connect_timeout = absl::Seconds(5);
  }
  if (mode == "kill") {
    ::signal(SIGTERM, SIG_IGN);  // report our error even though shardrun starts stopping us
    options.group.default_timeout = absl::Seconds(10);
  }
  if (mode == "matrix") {
    // Two groups on one store: 24-byte chunks (multi-chunk paths on small tensors) and the default chunk
    // for 1,000,003 elements. Built from the same environment init_from_env reads.
    auto env = read_rank_env();
    if (!env.ok()) {
      std::printf("INIT FAILED: %s\n", env.status().ToString().c_str());
      return 2;
    }
    TcpStoreOptions so;
    so.host = env->master_addr;
    so.port = env->master_port;
    so.is_server = env->rank == 0;
    auto store = TcpStore::create(so);
    if (!store.ok()) {
      std::printf("INIT FAILED: %s\n", store.status().ToString().c_str());
      return 2;
    }
    std::shared_ptr<Store> shared(std::move(*store));
    TcpProcessGroupOptions small = options.group, large = options.group;
    small.listen_host = large.listen_host = "127.0.0.1";
    small.store_prefix = "small";
    large.store_prefix = "large";
    large.chunk_bytes = TcpProcessGroupOptions{}.chunk_bytes;
    auto g_small = TcpProcessGroup::create(shared, env->rank, env->world_size, small);
    auto g_large = TcpProcessGroup::create(shared, env->rank, env->world_size, large);
    if (!g_small.ok() || !g_large.ok()) {
      std::printf("INIT FAILED: %s\n", (g_small.ok() ? g_large.status() : g_small.status()).ToString().c_str());
      return 2;
    }
    auto errors = tcp_testing::run_collective_matrix(**g_small, {0, 1, 7, 61},
                                                     {DType::f32, DType::bf16, DType::f16, DType::i64});
    auto big = tcp_testing::run_collective_matrix(**g_large, {1000003}, {DType::f32}, /*all_ops=*/false);
    errors.insert(errors.end(), big.begin(), big.end());
    for (const auto& e : errors) std::printf("MISMATCH %s\n", e.c_str());
    if (!errors.empty()) return 1;
    std::printf("MATRIX OK rank %d of %d\n", (*g_small)->rank(), (*g_small)->size());
    return 0;
  }
  auto pg = init_from_env(options);
  if (!pg.ok()) {
    std::printf("INIT FAILED: %s\n", pg.status().ToString().c_str());
    return 2;
  }
  ProcessGroup& g = **pg;
  if (mode == "latency") {  // diagnostics: 200 one-element all_reduces
    Tensor t = Tensor::full({1}, 1.0, {});
    double worst = 0;
    const absl::Time start = absl::Now();
    for (int i = 0; i < 200; ++i) {
      const absl::Time t0 = absl::Now();
      if (!g.all_reduce(t)->wait().ok()) return 1;
      worst = std::max(worst, absl::ToDoubleMicroseconds(absl::Now() - t0));
    }
    std::printf("latency avg %.1f us, worst %.1f us\n", absl::ToDoubleMicroseconds(absl::Now() - start) / 200, worst);
    return 0;
  }
  if (mode == "external") {
    Tensor t = Tensor::full({1000}, g.rank() + 1, {});
    absl::Status st = g.all_reduce(t)->wait();
    const double want = g.size() * (g.size() + 1) / 2.0;
    if (!st.ok() || t.item_at(999) != want) {
      std::printf("EXTERNAL FAILED: %s %g\n", st.ToString().c_str(), t.item_at(999));
      return 1;
    }
    std::printf("EXTERNAL OK\n");
    return 0;
  }
  if (mode == "kill" && argc >= 4) {
    const int victim = std::atoi(argv[2]);
    const int at = std::atoi(argv[3]);
    Tensor t = Tensor::full({1 << 20}, 1.0, {});
    for (int i = 0; i < at + 50; ++i) {
      const absl::Time start = absl::Now();
      auto work = g.all_reduce(t);
      if (g.rank() == victim && i == at) ::raise(SIGKILL);
      absl::Status st = work->wait();
      if (!st.ok()) {
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
  return 64;
}
