# optim_bench: fused AdamW / SGD steps against a trivial kernel with the same memory streams.
if(TARGET shardkit_optim)
  shardkit_bench(optim_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/optim_bench.cc DEPS shardkit::optim)
endif()
