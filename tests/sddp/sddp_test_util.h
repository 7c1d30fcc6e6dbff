// Shared helpers of the sddp tests: GPT-tiny batches, a single-rank reference, parameter comparison.
#pragma once

#include <cmath>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "common/autograd/engine.h"
#include "common/autograd/ops.h"
#include "common/nn/gpt.h"
#include "common/tensor/rank_context.h"
#include "common/optim/adam.h"
#include "tests/testing/gpt_tiny_data.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace shardkit::sddp::test_util {

using gpt_tiny::Batch;
using gpt_tiny::kBatch;
using gpt_tiny::TinyConfig;
using gpt_tiny::Values;

using gpt_tiny::ExpectMatches;
using gpt_tiny::FreezeBlock0;
using gpt_tiny::Reference;

}  // namespace shardkit::sddp::test_util
