// Elementwise reduction kernels of the process backends' ring / chain algorithms (stream_runner.cc,
// tcp_process_group.cc).
//
// combine(out, a, b): out[i] = a[i] (op) b[i] (out may alias a) for sum / min / max, computed in f32 for bf16 / f16 (and
// rounded back, round-to-nearest-even), exactly for i64. When divide_by > 0 the result is then divided by it
// (avg's final step; i64 truncates toward zero). scale(): data[i] *= factor (premul_sum's first step;
// i64 multiplies by the factor as an integer). Pure functions on raw buffers, thread-compatible.
#pragma once

#include <cstddef>

#include "common/comm/process_group.h"
#include "common/tensor/dtype.h"

namespace shardkit::comm::tcp_reduce {

void combine(void* out, const void* a, const void* b, std::size_t count, DType dtype, ReduceKind kind, int divide_by);
void scale(void* data, std::size_t count, DType dtype, double factor);

}  // namespace shardkit::comm::tcp_reduce
