#include "common/tensor/trace_hook.h"

#include <utility>


namespace shardkit::trace {
namespace {

thread_local Tracer* tl_tracer = nullptr;

void drop_undefined(std::vector<Tensor>& ts) {
  std::erase_if(ts, [](const Tensor& t) { return !t.defined(); });
}

}  // namespace

Tracer* active_tracer() { return tl_tracer; }

TracerScope::TracerScope(Tracer* tracer) : previous_(tl_tracer) { tl_tracer = tracer; }
TracerScope::~TracerScope() { tl_tracer = previous_; }

OpTraceScope::OpTraceScope() : tracer_(tl_tracer) { tl_tracer = nullptr; }
OpTraceScope::~OpTraceScope() { tl_tracer = tracer_; }

void OpTraceScope::record(std::string_view name, std::vector<Tensor> reads, std::vector<Tensor> writes,
                          Kernel kernel, const void* backward_node) const {
  if (tracer_ == nullptr) return;
  drop_undefined(reads);
  drop_undefined(writes);
  tracer_->on_op(name, std::move(reads), std::move(writes), std::move(kernel), backward_node);
}

void OpTraceScope::record_rebind(std::string_view name, std::vector<Tensor> reads, std::vector<Tensor> writes,
                                 Kernel kernel) const {
  if (tracer_ == nullptr) return;
  tracer_->on_rebind(name, std::move(reads), std::move(writes), std::move(kernel));
}

}  // namespace shardkit::trace
