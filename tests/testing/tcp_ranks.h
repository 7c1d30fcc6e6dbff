// Ranks as threads of this process, each with its own rank context, over a TcpProcessGroup with `transport`
// ("tcp" or "shm", checked on every pair) in small chunks and rings, so messages split into many pieces: fn(group)
// on each; the first failure is returned. For the combination tests over process backends.
#pragma once

#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/comm/hash_store.h"
#include "common/comm/tcp_process_group.h"
#include "common/tensor/rank_context.h"

namespace shardkit::tcp_ranks {

template <typename Fn>
absl::Status RunTcpRanks(int world, const std::string& transport, const std::string& prefix, Fn fn) {
  auto store = std::make_shared<comm::HashStore>();
  std::vector<absl::Status> status(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      RankContext ctx;
      ctx.rank = r;
      ctx.world_size = world;
      RankContextScope scope(ctx);
      auto pg = comm::TcpProcessGroup::create(store, r, world,
                                              {.store_prefix = prefix,
                                               .default_timeout = absl::Seconds(60),
                                               .chunk_bytes = 64,
                                               .transport = transport,
                                               .shm_ring_bytes = 256});
      if (!pg.ok()) {
        status[static_cast<std::size_t>(r)] = pg.status();
        return;
      }
      for (int p = 0; p < world; ++p) {
        if (p != r && (*pg)->transport_to(p) != transport) {
          status[static_cast<std::size_t>(r)] =
              absl::InternalError(absl::StrCat("rank ", r, " to ", p, ": transport ", (*pg)->transport_to(p)));
          return;
        }
      }
      status[static_cast<std::size_t>(r)] = fn(std::shared_ptr<comm::ProcessGroup>(*pg));
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) {
    if (!status[static_cast<std::size_t>(r)].ok()) return status[static_cast<std::size_t>(r)];
  }
  return absl::OkStatus();
}

}  // namespace shardkit::tcp_ranks
