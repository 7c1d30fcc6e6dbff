# activation_bench: GELU, softmax and cross-entropy (forward + backward) against a kernel with the same memory passes.
if(TARGET shardkit_autograd)
  shardkit_bench(activation_bench SOURCES ${CMAKE_CURRENT_LIST_DIR}/activation_bench.cc DEPS shardkit::autograd)
endif()
