// A process group that moves only tensors on one CUDA device, as NCCL does, for the layers' tests with several
// simulated ranks on one GPU (or on the CUDA emulator): NCCL takes one rank per GPU, so a one-GPU machine cannot
// run a layer's NCCL path with more than one rank. DeviceOnlyGroup wraps a rank's in-process group handle (which
// moves CUDA tensors between the ranks' buffers, Note [in-process CUDA tensors]), says scratch_device() == cuda:0,
// and refuses any call with a tensor elsewhere, naming it, as NCCL does: a layer that hands such a group a host
// tensor of its own fails the test instead of working by accident (Note [host tensors over device-only groups]
// in common/comm/host_staged.h).
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/comm/process_group.h"

namespace shardkit::comm::testing {

class DeviceOnlyGroup : public ProcessGroup {
 public:
  explicit DeviceOnlyGroup(std::shared_ptr<ProcessGroup> inner, Device device = Device::cuda(0))
      : ProcessGroup(inner->rank(), inner->size(), inner->name(), inner->global_ranks(), inner->default_timeout()),
        inner_(std::move(inner)),
        device_(device) {}

  std::string backend_name() const override { return "device-only(" + inner_->backend_name() + ")"; }
  Device scratch_device() const override { return device_; }
  void abort(const absl::Status& reason) override { inner_->abort(reason); }

 protected:
  std::shared_ptr<Work> run(CollectiveCall call) override {
    for (const Tensor* t : {&call.input, &call.output}) {
      if (t->defined() && t->device() != device_) {
        return make_completed_work(absl::InvalidArgumentError(
            absl::StrCat(call.describe(), ": a device-only group on ", device_.str(), " got a tensor on ",
                         t->device().str(), " (", t->describe(), ")")));
      }
    }
    switch (call.kind) {
      case CollectiveKind::broadcast:
        return inner_->broadcast(call.input, {.root = call.root, .timeout = call.timeout, .tag = call.tag});
      case CollectiveKind::all_reduce:
        return inner_->all_reduce(call.input, {.op = call.op, .timeout = call.timeout, .tag = call.tag});
      case CollectiveKind::reduce:
        return inner_->reduce(call.input,
                              {.root = call.root, .op = call.op, .timeout = call.timeout, .tag = call.tag});
      case CollectiveKind::all_gather:
        return inner_->all_gather(call.output, call.input, {.timeout = call.timeout, .tag = call.tag});
      case CollectiveKind::reduce_scatter:
        return inner_->reduce_scatter(call.output, call.input,
                                      {.op = call.op, .timeout = call.timeout, .tag = call.tag});
      case CollectiveKind::barrier: return inner_->barrier({.timeout = call.timeout, .tag = call.tag});
      case CollectiveKind::send: return inner_->send(call.input, call.peer, {.timeout = call.timeout, .tag = call.tag});
      case CollectiveKind::recv: return inner_->recv(call.input, call.peer, {.timeout = call.timeout, .tag = call.tag});
    }
    return make_completed_work(absl::InternalError("device-only group: unknown collective"));
  }

  absl::StatusOr<std::shared_ptr<ProcessGroup>> make_subgroup(std::vector<int>, const std::string&,
                                                              const std::string&, absl::Duration,
                                                              absl::Time) override {
    return absl::UnimplementedError("device-only group: no sub-groups");
  }

 private:
  std::shared_ptr<ProcessGroup> inner_;
  Device device_;
};

}  // namespace shardkit::comm::testing
