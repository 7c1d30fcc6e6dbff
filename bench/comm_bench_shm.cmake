# comm_bench, shared-memory cases (comm_bench_shm.cc): added to comm_bench when comm_bench.cmake (included first,
# the files are globbed in order) made it; otherwise comm_bench is created here.
if(TARGET shardkit_comm)
  if(TARGET comm_bench)
    target_sources(comm_bench PRIVATE ${CMAKE_CURRENT_LIST_DIR}/comm_bench_shm.cc)
  else()
    shardkit_bench(comm_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/comm_bench_shm.cc DEPS shardkit::comm)
    target_link_libraries(comm_bench PRIVATE benchmark::benchmark_main)
  endif()
endif()
