// Shared by the tests that run CUDA code (kernels, optimizers): skip, with the reason, when no CUDA device is usable
// at run time (a build without CUDA, no GPU, or a driver too old).
#pragma once

#include "common/tensor/device_memory.h"
#include "gtest/gtest.h"

// `what`: what the skipped test would have exercised, e.g. "CUDA kernels".
#define SK_REQUIRE_CUDA_DEVICE(what)                                                                 \
  if (shardkit::detail::cuda_device_count() == 0) {                                                 \
    GTEST_SKIP() << "no usable CUDA device (build without CUDA, no GPU, or CUDA driver too old): " \
                 << (what) << " not exercised";                                                     \
  }
