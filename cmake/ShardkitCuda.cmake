# Decides SHARDKIT_WITH_CUDA from SHARDKIT_CUDA (AUTO / ON / OFF).
# AUTO builds the CUDA parts when nvcc, cuBLAS and NCCL are all found; ON fails clearly when one is missing.
# Defines CUDA::* (FindCUDAToolkit) and NCCL::nccl (cmake/FindNCCL.cmake) for common/cuda.
set(SHARDKIT_WITH_CUDA OFF)
if(NOT SHARDKIT_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  set(_why "")
  if(CMAKE_CUDA_COMPILER)
    enable_language(CUDA)
    find_package(CUDAToolkit)
    find_package(NCCL)  # cmake/FindNCCL.cmake: NCCL::nccl, by name
    if(NOT CUDAToolkit_FOUND OR NOT TARGET CUDA::cublas)
      set(_why "cuBLAS not found")
    elseif(NOT NCCL_FOUND)
      set(_why "NCCL (nccl.h / libnccl) not found")
    else()
      set(SHARDKIT_WITH_CUDA ON)
    endif()
  else()
    set(_why "no CUDA compiler (nvcc) found")
  endif()
  if(NOT SHARDKIT_WITH_CUDA)
    if(SHARDKIT_CUDA STREQUAL "ON")
      message(FATAL_ERROR "SHARDKIT_CUDA=ON but ${_why}. Install the CUDA toolkit with cuBLAS and NCCL, "
                          "or configure with -DSHARDKIT_CUDA=AUTO or OFF.")
    endif()
    message(STATUS "shardkit: CUDA parts skipped: ${_why}")
  endif()
endif()
if(SHARDKIT_WITH_CUDA)
  # Note [nvcc C++20]: CMake 3.25 predates nvcc's C++20 support (CUDA >= 12), so it refuses cuda_std_20
  # (and cxx_std_20 on targets with .cu sources). Tell it the flag when nvcc is new enough.
  if(CMAKE_CUDA_COMPILER_VERSION VERSION_GREATER_EQUAL 12.0 AND NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
    set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    set(CMAKE_CUDA20_COMPILE_FEATURES cuda_std_20)
    list(APPEND CMAKE_CUDA_COMPILE_FEATURES cuda_std_20)
  endif()
  set(CMAKE_CUDA_STANDARD 20)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  # One CUDA runtime per process: the shared libcudart that CUDA::cudart names. (The default, Static, made
  # every program that links CUDA objects link libcudart_static too.)
  set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
endif()
# What the CUDA parts build into: shardkit::cuda only (common/cuda; Note [cuda component] in
# common/cuda/cuda_component.h). The CPU libraries link no CUDA library whatever SHARDKIT_WITH_CUDA is.
