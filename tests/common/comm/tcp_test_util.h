// Shared by the TCP process-group tests (threads as ranks) and the multi-process worker: deterministic
// per-rank inputs and a scalar reference for every collective and reduce op.
#pragma once

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/comm/process_group.h"
#include "common/tensor/tensor.h"

namespace shardkit::comm::tcp_testing {

// Small integers (exact in bf16 / f16 sums for n <= 8): in [-5, 5].
inline double input_value(int rank, std::int64_t i) { return static_cast<double>((rank * 7 + i * 3) % 11) - 5.0; }

inline Tensor make_input(int rank, std::int64_t numel, DType dtype, std::int64_t index_offset = 0) {
  std::vector<float> v(static_cast<std::size_t>(numel));
  for (std::int64_t i = 0; i < numel; ++i) v[static_cast<std::size_t>(i)] = static_cast<float>(input_value(rank, i + index_offset));
  Tensor f = Tensor::from_vector(v, {numel});
  return dtype == DType::f32 ? f : f.to(dtype);
}

// The reduction over ranks of element i (index into the per-rank input).
inline double reference(const ReduceOp& op, DType dtype, int n, std::int64_t i) {
  double acc = 0;
  std::int64_t iacc = 0;
  for (int r = 0; r < n; ++r) {
    double x = input_value(r, i);
    if (op.kind == ReduceKind::premul_sum) x *= op.factor;
    if (r == 0) {
      acc = x;
    } else if (op.kind == ReduceKind::min) {
      acc = std::min(acc, x);
    } else if (op.kind == ReduceKind::max) {
      acc = std::max(acc, x);
    } else {
      acc += x;
    }
    iacc = static_cast<std::int64_t>(acc);
  }
  if (op.kind == ReduceKind::avg) {
    if (dtype == DType::i64) return static_cast<double>(iacc / n);
    return acc / n;
  }
  return acc;
}

inline double tolerance(DType dtype, double expected) {
  switch (dtype) {
    case DType::f32: return 1e-5 * (1 + std::abs(expected));
    case DType::bf16: return 1e-2 * (1 + std::abs(expected));
    case DType::f16: return 2e-3 * (1 + std::abs(expected));
    case DType::i64: return 0;
  }
  return 0;
}

// Returns "" when t[j] == expected(j) within tolerance for all j, else a description of the first mismatch.
template <typename F>
std::string compare(const Tensor& t, DType dtype, F expected) {
  for (std::int64_t j = 0; j < t.numel(); ++j) {
    const double got = t.item_at(j), want = expected(j);
    if (std::abs(got - want) > tolerance(dtype, want)) {
      return absl::StrCat("element ", j, " of ", t.numel(), ": expected ", want, ", found ", got);
    }
  }
  return "";
}

inline std::vector<ReduceOp> ops_for(DType dtype) {
  return {ReduceOp::sum(), ReduceOp::avg(), ReduceOp::min(), ReduceOp::max(),
          ReduceOp::premul_sum(dtype == DType::i64 ? 3.0 : 0.5)};
}

// Options builders (designated initializers trip -Wmissing-field-initializers).
inline AllReduceOptions ar_opts(ReduceOp op, std::optional<absl::Duration> timeout = std::nullopt) {
  AllReduceOptions o;
  o.op = op;
  o.timeout = timeout;
  return o;
}
inline ReduceOptions reduce_opts(int root, ReduceOp op) {
  ReduceOptions o;
  o.root = root;
  o.op = op;
  return o;
}
inline ReduceScatterOptions rs_opts(ReduceOp op) {
  ReduceScatterOptions o;
  o.op = op;
  return o;
}
inline BroadcastOptions bc_opts(int root) {
  BroadcastOptions o;
  o.root = root;
  return o;
}

// Runs every collective x op x dtype x size on `pg` and returns the mismatches (empty: all good). Every rank
// must call it (it issues the same sequence on every rank).
inline std::vector<std::string> run_collective_matrix(ProcessGroup& pg, const std::vector<std::int64_t>& sizes,
                                                      const std::vector<DType>& dtypes, bool all_ops = true) {
  std::vector<std::string> errors;
  const int n = pg.size(), r = pg.rank();
  auto check = [&](const std::string& what, const absl::Status& st, const std::string& mismatch) {
    if (!st.ok()) {
      errors.push_back(absl::StrCat(what, ": ", st.ToString()));
    } else if (!mismatch.empty()) {
      errors.push_back(absl::StrCat(what, ": ", mismatch));
    }
  };
  for (DType dtype : dtypes) {
    std::vector<ReduceOp> ops = all_ops ? ops_for(dtype) : std::vector<ReduceOp>{ReduceOp::sum()};
    for (std::int64_t m : sizes) {
      const std::string where = absl::StrCat("n=", n, " rank ", r, " ", std::string(dtype_name(dtype)), " numel ", m);
      for (const ReduceOp& op : ops) {
        {  // all_reduce
          Tensor t = make_input(r, m, dtype);
          absl::Status st = pg.all_reduce(t, ar_opts(op))->wait();
          check(absl::StrCat("all_reduce ", op.to_string(), " ", where), st,
                compare(t, dtype, [&](std::int64_t j) { return reference(op, dtype, n, j); }));
        }
        for (int root : {0, n - 1}) {  // reduce
          Tensor t = make_input(r, m, dtype);
          absl::Status st = pg.reduce(t, reduce_opts(root, op))->wait();
          check(absl::StrCat("reduce root ", root, " ", op.to_string(), " ", where), st,
                r == root ? compare(t, dtype, [&](std::int64_t j) { return reference(op, dtype, n, j); }) : "");
        }
        {  // reduce_scatter: input n*m, rank r gets slice r
          Tensor in = make_input(r, n * m, dtype);
          Tensor out = Tensor::zeros({m}, TensorOptions{}.with_dtype(dtype));
          absl::Status st = pg.reduce_scatter(out, in, rs_opts(op))->wait();
          check(absl::StrCat("reduce_scatter ", op.to_string(), " ", where), st,
                compare(out, dtype, [&](std::int64_t j) { return reference(op, dtype, n, r * m + j); }));
        }
      }
      for (int root : {0, n - 1}) {  // broadcast
        Tensor t = r == root ? make_input(root, m, dtype) : Tensor::full({m}, 99, TensorOptions{}.with_dtype(dtype));
        absl::Status st = pg.broadcast(t, bc_opts(root))->wait();
        check(absl::StrCat("broadcast root ", root, " ", where), st,
              compare(t, dtype, [&](std::int64_t j) { return input_value(root, j); }));
      }
      {  // all_gather
        Tensor in = make_input(r, m, dtype);
        Tensor out = Tensor::zeros({n * m}, TensorOptions{}.with_dtype(dtype));
        absl::Status st = pg.all_gather(out, in)->wait();
        check(absl::StrCat("all_gather ", where), st,
              compare(out, dtype, [&](std::int64_t j) { return input_value(static_cast<int>(j / std::max<std::int64_t>(m, 1)), j % std::max<std::int64_t>(m, 1)); }));
      }
      if (n > 1) {  // send / recv around the ring (even ranks send first, odd ranks receive first)
        Tensor out = make_input(r, m, dtype);
        Tensor in = Tensor::zeros({m}, TensorOptions{}.with_dtype(dtype));
        const int next = (r + 1) % n, prev = (r + n - 1) % n;
        std::shared_ptr<Work> a, b;
        if (r % 2 == 0) {
          a = pg.send(out, next);
          b = pg.recv(in, prev);
        } else {
          b = pg.recv(in, prev);
          a = pg.send(out, next);
        }
        absl::Status st = a->wait();
        if (st.ok()) st = b->wait();
        check(absl::StrCat("send/recv ", where), st, compare(in, dtype, [&](std::int64_t j) { return input_value(prev, j); }));
      }
    }
  }
  if (absl::Status st = pg.barrier()->wait(); !st.ok()) errors.push_back(absl::StrCat("barrier: ", st.ToString()));
  return errors;
}

}  // namespace shardkit::comm::tcp_testing
