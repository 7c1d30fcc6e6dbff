// Test helper: runs n ranks as threads of this process over a TcpStore server on an ephemeral port; each
// thread has its own store client and its own TcpProcessGroup (real loopback sockets).
#pragma once

#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "common/comm/tcp_process_group.h"
#include "common/comm/tcp_store.h"
#include "gtest/gtest.h"

namespace shardkit::comm::tcp_testing {

// Runs fn(rank, group) on n threads, each with its own store client and TCP group.
// The transport is TCP unless options.transport says otherwise (on one host "auto" would pick shared memory).
inline void run_tcp_ranks(int n, TcpProcessGroupOptions options, const std::function<void(int, std::shared_ptr<TcpProcessGroup>&)>& fn) {
  if (options.transport.empty()) options.transport = "tcp";
  TcpStoreOptions so;
  so.is_server = true;
  auto server = TcpStore::create(so);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::uint16_t port = (*server)->port();
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      TcpStoreOptions co;
      co.port = port;
      auto store = TcpStore::create(co);
      ASSERT_TRUE(store.ok()) << store.status();
      auto pg = TcpProcessGroup::create(std::shared_ptr<Store>(std::move(*store)), r, n, options);
      ASSERT_TRUE(pg.ok()) << pg.status();
      fn(r, *pg);
    });
  }
  for (auto& t : threads) t.join();
}

}  // namespace shardkit::comm::tcp_testing
