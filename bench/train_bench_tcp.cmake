# train_bench_tcp: train_bench's cases with the ranks as processes over the TCP backend (this binary is rank 0
# and starts the others as copies of itself); the per-rank step is train_step.cc, shared with train_bench.
if(TARGET shardkit_sddp AND TARGET shardkit_fsdp AND TARGET shardkit_comm)
  shardkit_bench(train_bench_tcp
                 SOURCES ${CMAKE_CURRENT_LIST_DIR}/train_bench_tcp.cc ${CMAKE_CURRENT_LIST_DIR}/train_step.cc
                 DEPS shardkit::sddp shardkit::oss shardkit::fsdp shardkit::nn shardkit::comm)
endif()
