# train_bench: a training step of a sharded strategy against the DDP step at the same N, same binary; and the
# compiled_* cases (train_bench_compiled.cc): a replayed step against the eager strategy it replaces.
if(TARGET shardkit_sddp AND TARGET shardkit_fsdp)
  shardkit_bench(train_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/train_bench.cc ${CMAKE_CURRENT_LIST_DIR}/train_bench_compiled.cc
                 ${CMAKE_CURRENT_LIST_DIR}/train_step.cc
                 DEPS shardkit::sddp shardkit::oss shardkit::fsdp shardkit::nn shardkit::comm_testing)
  target_link_libraries(train_bench PRIVATE benchmark::benchmark_main)
endif()
