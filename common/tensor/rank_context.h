// The per-rank context: everything that would be process-global in a one-rank program but must be
// per rank because simulated ranks are threads of one process (DESIGN.md section 2).
//
// A thread runs "as" a rank while a RankContextScope is alive on it. Code that allocates or draws
// random numbers asks current_rank_context(). A thread with no scope installed uses a thread-local
// default context (rank 0 of 1), so single-threaded programs need no setup.
//
// Ownership: the scope does not own the context; the context must outlive every scope and every
// Storage charged to its tracker keeps the tracker alive (shared_ptr).
#pragma once

#include <cstdint>
#include <memory>

#include "common/tensor/matmul_precision.h"
#include "common/tensor/memory_tracker.h"
#include "common/tensor/random.h"

namespace shardkit {

struct RankContext {
  int rank = 0;
  int world_size = 1;
  std::shared_ptr<MemoryTracker> memory = std::make_shared<MemoryTracker>();
  Generator generator;
  // CUDA fp32 GEMMs may round their operands to TF32 / bf16 on tensor cores (Note [matmul precision]).
  MatmulPrecision matmul_precision = MatmulPrecision::highest;
  // true: CUDA causal attention at matmul precision medium runs as one fused kernel each way where the device
  // allows (Note [flash attention] in common/kernels/cuda/flash_attention.cu). Off by default: on an H200 (stop 36,
  // model_bench_cuda gpt2-small/medium against medium-fused) the fused kernels took 35.4 ms a GPT-2 small step
  // against the materialised path's 29.4 ms; they save the T x T scores' memory, not yet time.
  bool fused_attention = false;
};

// Which random stream each rank of a world draws from (dropout, random init, sampling): per_rank gives rank r
// Generator(seed).fork(r), so randomness differs across ranks (the default of comm::run_ranks and
// comm::init_from_env); same_on_every_rank gives every rank Generator(seed) (stream 0), e.g. to reproduce a
// one-rank run's dropout masks on every rank.
enum class RankStreams { per_rank, same_on_every_rank };

// The generator rank `rank` starts with under `streams`.
Generator rank_generator(std::uint64_t seed, int rank, RankStreams streams);

// Makes `ctx` rank `rank` of `world_size`: sets rank, world_size and generator = rank_generator(seed, rank,
// streams); keeps its memory tracker.
void set_rank(RankContext& ctx, int rank, int world_size, std::uint64_t seed, RankStreams streams);

// The context the calling thread runs as.
RankContext& current_rank_context();

// Installs `ctx` as the calling thread's context until destruction (nests; restores the previous one).
class RankContextScope {
 public:
  explicit RankContextScope(RankContext& ctx);
  ~RankContextScope();
  RankContextScope(const RankContextScope&) = delete;
  RankContextScope& operator=(const RankContextScope&) = delete;

 private:
  RankContext* previous_;
};

// The category that new allocations on this thread are charged to (default: other).
MemoryCategory current_memory_category();

// Sets the calling thread's allocation category until destruction (nests).
class MemoryCategoryScope {
 public:
  explicit MemoryCategoryScope(MemoryCategory category);
  ~MemoryCategoryScope();
  MemoryCategoryScope(const MemoryCategoryScope&) = delete;
  MemoryCategoryScope& operator=(const MemoryCategoryScope&) = delete;

 private:
  MemoryCategory previous_;
};

}  // namespace shardkit
