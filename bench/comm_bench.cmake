# comm_bench: collective bus bandwidth (nccl-tests definitions) against a memcpy measured in the same
# binary. In-process cases here (comm_bench.cc); TCP cases are added by comm_bench_tcp.cmake.
if(TARGET shardkit_comm)
  shardkit_bench(comm_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_bench.cc DEPS shardkit::comm)
  target_link_libraries(comm_bench PRIVATE benchmark::benchmark_main)
endif()
