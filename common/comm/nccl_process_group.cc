// The NCCL backend (see nccl_process_group.h). Part of shardkit::cuda (Note [cuda component]).
#include "common/comm/nccl_process_group.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/base/check.h"

namespace shardkit::comm {
namespace {

constexpr absl::Duration kPoll = absl::Microseconds(50);
constexpr absl::Duration kStoreCheckEvery = absl::Milliseconds(100);

ncclDataType_t nccl_dtype(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i64: return ncclInt64;
  }
  return ncclFloat32;
}

std::string nccl_error(ncclResult_t r, ncclComm_t comm) {
  std::string s = ncclGetErrorString(r);
  if (comm != nullptr) {
    const char* last = ncclGetLastError(comm);
    if (last != nullptr && *last != '\0') absl::StrAppend(&s, " (", last, ")");
  }
  return s;
}

// Everything one rank's group handle and its Works share.
struct NcclShared {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  float* barrier_buf = nullptr;
  int device = 0;
  std::shared_ptr<Store> store;
  std::string prefix;
  std::string name;
  int rank = 0;

  absl::Mutex mu;
  absl::Status failure ABSL_GUARDED_BY(mu);
  bool comm_aborted ABSL_GUARDED_BY(mu) = false;
  absl::Time next_store_check ABSL_GUARDED_BY(mu) = absl::InfinitePast();

  ~NcclShared() {
    cudaSetDevice(device);
    if (comm != nullptr) {
      bool aborted;
      {
        absl::MutexLock lock(&mu);
        aborted = comm_aborted;
      }
      if (!aborted) ncclCommDestroy(comm);
    }
    if (barrier_buf != nullptr) cudaFree(barrier_buf);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  absl::Status status() {
    absl::MutexLock lock(&mu);
    return failure;
  }

  // Records the first failure, aborts the communicator and tells the other ranks through the store.
  void fail(const absl::Status& reason, bool publish = true) {
    {
      absl::MutexLock lock(&mu);
      if (!failure.ok()) return;
      failure = reason;
      if (comm != nullptr && !comm_aborted) {
        ncclCommAbort(comm);
        comm_aborted = true;
      }
    }
    if (publish && store != nullptr) (void)store->set(prefix + "/failed", std::string(reason.message()));
  }

  // Every kStoreCheckEvery: adopts a failure another rank published.
  void check_remote() {
    {
      absl::MutexLock lock(&mu);
      const absl::Time now = absl::Now();
      if (now < next_store_check || !failure.ok()) return;
      next_store_check = now + kStoreCheckEvery;
    }
    auto present = store->check({prefix + "/failed"});
    if (!present.ok() || !*present) return;
    auto msg = store->get(prefix + "/failed", absl::Seconds(1));
    fail(absl::AbortedError(absl::StrCat("another rank failed: ", msg.ok() ? *msg : msg.status().ToString())), false);
  }

  // Polls the communicator after a non-blocking NCCL call until it leaves ncclInProgress.
  absl::Status settle(ncclResult_t r, absl::Time deadline, const std::string& what) {
    while (r == ncclInProgress) {
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(what, ": NCCL still in progress at the deadline"));
      }
      absl::SleepFor(kPoll);
      ncclCommGetAsyncError(comm, &r);
    }
    if (r != ncclSuccess) return absl::InternalError(absl::StrCat(what, ": NCCL error: ", nccl_error(r, comm)));
    return absl::OkStatus();
  }
};

class NcclWork final : public Work {
 public:
  NcclWork(std::shared_ptr<NcclShared> shared, cudaEvent_t done, CollectiveCall call, std::string where)
      : shared_(std::move(shared)), done_(done), call_(std::move(call)), where_(std::move(where)) {}
  ~NcclWork() override {
    if (done_ == nullptr) return;
    // A Work dropped before its collective finished: the call's tensors (released with this object) must outlive
    // it (Note [device memory from the stream-ordered pool] in common/tensor/device_memory_cuda.cu).
    bool finished = false;
    {
      absl::MutexLock lock(&mu_);
      finished = finished_;
    }
    if (!finished) (void)wait(absl::InfiniteDuration());  // bounded by the call's deadline; a failure aborts
    cudaEventDestroy(done_);
  }

  bool is_completed() const override {
    absl::MutexLock lock(&mu_);
    if (finished_) return true;
    return cudaEventQuery(done_) == cudaSuccess || !shared_->status().ok();
  }

  absl::Status wait(absl::Duration timeout) override {
    {
      absl::MutexLock lock(&mu_);
      if (finished_) return result_;
    }
    const absl::Time wait_until =
        timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
    cudaSetDevice(shared_->device);
    for (;;) {
      const cudaError_t q = cudaEventQuery(done_);
      if (q == cudaSuccess) {
        cudaStreamWaitEvent(cudaStreamPerThread, done_, 0);  // later work on the caller's stream sees the result
        return finish(absl::OkStatus());
      }
      if (q != cudaErrorNotReady) {
        absl::Status st = absl::InternalError(absl::StrCat(where_, ": CUDA error: ", cudaGetErrorString(q)));
        shared_->fail(st);
        return finish(st);
      }
      ncclResult_t async = ncclSuccess;
      ncclCommGetAsyncError(shared_->comm, &async);
      if (async != ncclSuccess && async != ncclInProgress) {
        absl::Status st =
            absl::InternalError(absl::StrCat(where_, ": NCCL error: ", nccl_error(async, shared_->comm)));
        shared_->fail(st);
        return finish(st);
      }
      shared_->check_remote();
      if (absl::Status f = shared_->status(); !f.ok()) {
        return finish(absl::AbortedError(absl::StrCat(where_, ": aborted because: ", f.message())));
      }
      const absl::Time now = absl::Now();
      if (now >= call_.deadline) {
        absl::Status st = absl::DeadlineExceededError(
            absl::StrCat(where_, ": did not complete within ", absl::FormatDuration(call_.timeout),
                         " (a rank did not join, or is too slow)"));
        shared_->fail(st);
        return finish(st);
      }
      if (now >= wait_until) {
        return absl::DeadlineExceededError(absl::StrCat("Work::wait timed out after ", absl::FormatDuration(timeout),
                                                        "; ", where_, " is still pending"));
      }
      absl::SleepFor(kPoll);
    }
  }

 private:
  absl::Status finish(absl::Status st) {
    absl::MutexLock lock(&mu_);
    if (!finished_) {
      finished_ = true;
      result_ = std::move(st);
    }
    return result_;
  }

  std::shared_ptr<NcclShared> shared_;
  cudaEvent_t done_;
  CollectiveCall call_;  // keeps the tensors alive until completion
  std::string where_;
  mutable absl::Mutex mu_;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  absl::Status result_ ABSL_GUARDED_BY(mu_);
};

class NcclGroup final : public ProcessGroup {
 public:
  static absl::StatusOr<std::shared_ptr<ProcessGroup>> create(std::shared_ptr<Store> store, std::string prefix,
                                                              int rank, int size, std::vector<int> global,
                                                              int device, std::string name,
                                                              absl::Duration default_timeout, absl::Time deadline);

  NcclGroup(std::shared_ptr<NcclShared> shared, int rank, int size, std::string name, std::vector<int> global,
            absl::Duration default_timeout)
      : ProcessGroup(rank, size, std::move(name), std::move(global), default_timeout), shared_(std::move(shared)) {}

  std::string backend_name() const override { return "nccl"; }
  Device scratch_device() const override { return Device::cuda(shared_->device); }
  void abort(const absl::Status& reason) override { shared_->fail(reason); }

 protected:
  std::shared_ptr<Work> run(CollectiveCall call) override;
  absl::StatusOr<std::shared_ptr<ProcessGroup>> make_subgroup(std::vector<int> members, const std::string& key,
                                                              const std::string& name,
                                                              absl::Duration default_timeout,
                                                              absl::Time deadline) override {
    std::vector<int> global;
    int me = -1;
    for (std::size_t i = 0; i < members.size(); ++i) {
      global.push_back(global_ranks()[members[i]]);
      if (members[i] == rank()) me = static_cast<int>(i);
    }
    SK_CHECK_GE(me, 0);
    return create(shared_->store, absl::StrCat(shared_->prefix, "/", key), me, static_cast<int>(members.size()),
                  std::move(global), shared_->device, name, default_timeout, deadline);
  }

 private:
  std::shared_ptr<Work> enqueue_locked(CollectiveCall& call, const std::string& where, absl::Status& error);

  std::shared_ptr<NcclShared> shared_;
};

absl::StatusOr<std::shared_ptr<ProcessGroup>> NcclGroup::create(std::shared_ptr<Store> store, std::string prefix,
                                                                int rank, int size, std::vector<int> global,
                                                                int device, std::string name,
                                                                absl::Duration default_timeout,
                                                                absl::Time deadline) {
  const std::string what = absl::StrCat("creating NCCL group '", name, "' (rank ", rank, " of ", size, ")");
  if (cudaError_t e = cudaSetDevice(device); e != cudaSuccess) {
    return absl::FailedPreconditionError(
        absl::StrCat(what, ": expected a usable CUDA device ", device, ", found: ", cudaGetErrorString(e)));
  }
  ncclUniqueId id;
  const std::string id_key = prefix + "/id";
  if (rank == 0) {
    if (ncclResult_t r = ncclGetUniqueId(&id); r != ncclSuccess) {
      return absl::InternalError(absl::StrCat(what, ": ncclGetUniqueId: ", ncclGetErrorString(r)));
    }
    if (absl::Status s = store->set(id_key, std::string(id.internal, sizeof(id.internal))); !s.ok()) return s;
  } else {
    auto got = store->get(id_key, std::max(absl::ZeroDuration(), deadline - absl::Now()));
    if (!got.ok()) return absl::Status(got.status().code(), absl::StrCat(what, ": ", got.status().message()));
    if (got->size() != sizeof(id.internal)) {
      return absl::InvalidArgumentError(absl::StrCat(what, ": expected a ", sizeof(id.internal),
                                                     "-byte NCCL unique id in the store, found ", got->size(),
                                                     " bytes"));
    }
    std::memcpy(id.internal, got->data(), sizeof(id.internal));
  }
  auto shared = std::make_shared<NcclShared>();
  shared->device = device;
  shared->store = store;
  shared->prefix = prefix;
  shared->name = name;
  shared->rank = rank;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = shared->name.c_str();
  ncclResult_t r = ncclCommInitRankConfig(&shared->comm, size, id, rank, &config);
  if (absl::Status s = shared->settle(r, deadline, what); !s.ok()) {
    shared->fail(s, false);
    return s;
  }
  if (cudaError_t e = cudaStreamCreateWithFlags(&shared->stream, cudaStreamNonBlocking); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat(what, ": cudaStreamCreate: ", cudaGetErrorString(e)));
  }
  if (cudaError_t e = cudaMalloc(&shared->barrier_buf, sizeof(float)); e != cudaSuccess) {
    return absl::InternalError(absl::StrCat(what, ": cudaMalloc: ", cudaGetErrorString(e)));
  }
  return std::shared_ptr<ProcessGroup>(
      std::make_shared<NcclGroup>(shared, rank, size, std::move(name), std::move(global), default_timeout));
}

std::shared_ptr<Work> NcclGroup::run(CollectiveCall call) {
  const std::string where = absl::StrCat(call.describe(), " on group '", name(), "', ", describe_rank(rank()));
  for (const Tensor* t : {&call.input, &call.output}) {
    if (t->defined() && !(t->device() == Device::cuda(shared_->device))) {
      absl::Status st = absl::InvalidArgumentError(absl::StrCat(where, ": expected tensors on cuda:", shared_->device,
                                                                " (NCCL backend), found ", t->describe()));
      abort(st);
      return make_completed_work(st);
    }
  }
  absl::Status enqueue_error;
  std::shared_ptr<Work> work;
  {
    absl::MutexLock lock(&shared_->mu);
    work = enqueue_locked(call, where, enqueue_error);
  }
  if (!enqueue_error.ok()) shared_->fail(enqueue_error);
  return work;
}

std::shared_ptr<Work> NcclGroup::enqueue_locked(CollectiveCall& call, const std::string& where, absl::Status& error) {
  if (!shared_->failure.ok()) {
    return make_completed_work(
        absl::AbortedError(absl::StrCat(where, ": aborted because: ", shared_->failure.message())));
  }
  cudaSetDevice(shared_->device);
  cudaStream_t s = shared_->stream;
  ncclComm_t comm = shared_->comm;
  // Order after the caller's queued work (Note [nccl streams]).
  cudaEvent_t before = nullptr, done = nullptr;
  cudaEventCreateWithFlags(&before, cudaEventDisableTiming);
  cudaEventRecord(before, cudaStreamPerThread);
  cudaStreamWaitEvent(s, before, 0);
  cudaEventDestroy(before);

  const DType dtype = call.input.defined() ? call.input.dtype() : DType::f32;
  const ncclDataType_t dt = nccl_dtype(dtype);
  ncclRedOp_t op = ncclSum;
  bool custom_op = false;
  ncclResult_t r = ncclSuccess;
  switch (call.op.kind) {
    case ReduceKind::sum: op = ncclSum; break;
    case ReduceKind::avg: op = ncclAvg; break;
    case ReduceKind::min: op = ncclMin; break;
    case ReduceKind::max: op = ncclMax; break;
    case ReduceKind::premul_sum: {
      const bool reducing = call.kind == CollectiveKind::all_reduce || call.kind == CollectiveKind::reduce ||
                            call.kind == CollectiveKind::reduce_scatter;
      if (!reducing) break;
      union {
        float f;
        std::uint16_t h;
        std::int64_t i;
      } scalar{};
      switch (dtype) {
        case DType::f32: scalar.f = static_cast<float>(call.op.factor); break;
        case DType::bf16: scalar.h = f32_to_bf16(static_cast<float>(call.op.factor)).bits; break;
        case DType::f16: scalar.h = f32_to_f16(static_cast<float>(call.op.factor)).bits; break;
        case DType::i64: scalar.i = static_cast<std::int64_t>(call.op.factor); break;
      }
      r = ncclRedOpCreatePreMulSum(&op, &scalar, dt, ncclScalarHostImmediate, comm);
      custom_op = r == ncclSuccess;
      break;
    }
  }
  void* in = call.input.defined() ? call.input.raw_data() : nullptr;
  void* out = call.output.defined() ? call.output.raw_data() : nullptr;
  const auto count = static_cast<std::size_t>(call.input.defined() ? call.input.numel() : 0);
  if (r == ncclSuccess) {
    switch (call.kind) {
      case CollectiveKind::broadcast: r = ncclBroadcast(in, in, count, dt, call.root, comm, s); break;
      case CollectiveKind::all_reduce: r = ncclAllReduce(in, in, count, dt, op, comm, s); break;
      case CollectiveKind::reduce: r = ncclReduce(in, in, count, dt, op, call.root, comm, s); break;
      case CollectiveKind::all_gather: r = ncclAllGather(in, out, count, dt, comm, s); break;
      case CollectiveKind::reduce_scatter:
        r = ncclReduceScatter(in, out, static_cast<std::size_t>(call.output.numel()), dt, op, comm, s);
        break;
      case CollectiveKind::barrier:
        r = ncclAllReduce(shared_->barrier_buf, shared_->barrier_buf, 1, ncclFloat32, ncclSum, comm, s);
        break;
      case CollectiveKind::send: r = ncclSend(in, count, dt, call.peer, comm, s); break;
      case CollectiveKind::recv: r = ncclRecv(in, count, dt, call.peer, comm, s); break;
    }
  }
  absl::Status st = shared_->settle(r, call.deadline, where);
  if (custom_op) ncclRedOpDestroy(op, comm);
  if (!st.ok()) {
    error = st;
    return make_completed_work(st);
  }
  cudaEventCreateWithFlags(&done, cudaEventDisableTiming);
  cudaEventRecord(done, s);
  return std::make_shared<NcclWork>(shared_, done, std::move(call), where);
}

}  // namespace

namespace cuda_impl {

absl::StatusOr<std::shared_ptr<ProcessGroup>> create_nccl_group(std::shared_ptr<Store> store, int rank, int size,
                                                                int device, const NcclOptions& options) {
  SK_CHECK(store != nullptr);
  if (size <= 0 || rank < 0 || rank >= size) {
    return absl::InvalidArgumentError(absl::StrCat("create_nccl_group: expected 0 <= rank < size, found rank ", rank,
                                                   " of ", size));
  }
  std::vector<int> global;
  for (int r = 0; r < size; ++r) global.push_back(r);
  return NcclGroup::create(std::move(store), options.store_prefix + "/" + options.name, rank, size, std::move(global),
                           device, options.name, options.default_timeout, absl::Now() + options.init_timeout);
}

}  // namespace cuda_impl
}  // namespace shardkit::comm
