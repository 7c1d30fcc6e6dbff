# model_bench_cuda: a GPT-2 small training step on a CUDA device (issue 14), compared with PyTorch eager by
# bench/gpt2_vs_torch.py; built with the cuda component, skips every case without a GPU.
if(TARGET shardkit::cuda)
  shardkit_bench(model_bench_cuda SOURCES ${CMAKE_CURRENT_LIST_DIR}/model_bench_cuda.cc
                 DEPS shardkit::nn shardkit::optim shardkit::kernels shardkit::cuda)
endif()
