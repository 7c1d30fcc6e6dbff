# optim_bench_cuda: the fused CUDA AdamW against the device's copy bandwidth (issue 14); built with the cuda
# component, skips every case without a GPU.
if(TARGET shardkit::cuda)
  shardkit_bench(optim_bench_cuda SOURCES ${CMAKE_CURRENT_LIST_DIR}/optim_bench_cuda.cc
                 DEPS shardkit::optim shardkit::kernels shardkit::cuda)
endif()
