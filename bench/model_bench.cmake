# model_bench: GPT forward + backward throughput and the share of the step spent in GEMM.
if(TARGET shardkit_nn)
  shardkit_bench(model_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/model_bench.cc DEPS shardkit::nn)
  target_link_libraries(model_bench PRIVATE benchmark::benchmark_main)
endif()
