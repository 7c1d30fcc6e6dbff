// shardkit::cuda, the package's optional CUDA component: the CUDA implementations of device memory
// (common/tensor/device_memory_cuda.cu), the kernels and cuBLAS GEMM (common/kernels/cuda/*.cu), the fused
// optimizers (common/optim/cuda/fused_optim.cu) and the NCCL backend (common/comm/nccl_process_group.cc), plus cuda_component.cc, which registers them. A program opts in
// by linking shardkit::cuda (find_package(shardkit COMPONENTS cuda)); it calls nothing declared here.
//
// Note [cuda component]: the CPU libraries (shardkit::tensor, ::kernels, ::comm and everything above them)
// reference no CUDA symbol, so a program that links only them links no CUDA library, starts on a machine
// without the CUDA toolkit or driver, and find_package(shardkit) needs no toolkit. Each place where CPU code
// reaches CUDA code is a seam: a dispatching function in the CPU library,
//   - detail::cuda_allocate / cuda_free / cuda_zero / cuda_device_count (common/tensor/device_memory.h),
//   - kernels::cuda::* (common/kernels/cuda/cuda_kernels.h): elementwise, casts, copies, reductions, GEMM,
//   - optim::cuda::adam_step / sgd_step (common/optim/cuda/cuda_optim_kernels.h): the fused optimizers,
//   - comm::create_nccl_group / nccl_backend_built (common/comm/nccl_process_group.h),
// reads a detail::StartupRegistry (common/tensor/startup_registry.h) holding a constant table of pointers to
// the CUDA implementation (declared in the seam header's cuda_impl namespace, defined in shardkit::cuda).
// These four registries are the only process-global mutable state this adds: each is written once, at
// static-init time, by cuda_component.cc's static initialiser, and only read after that. With nothing
// registered (the program does not link shardkit::cuda, or shardkit was built without CUDA) the dispatchers
// behave as a CPU-only build: no CUDA devices; allocation and kernels throw InternalError and
// create_nccl_group() returns Unimplemented, each saying why (detail::cuda_unavailable_reason()).
//
// Linking: shardkit::cuda is a static library and nothing calls into cuda_component.o, so a plain link would
// drop that object and its registration. shardkit::cuda's usage requirements therefore carry
// -Wl,--undefined=shardkit_cuda_component_anchor (below), which pulls the object, and through its tables every
// CUDA implementation, into each program that links shardkit::cuda.
//
// Packaging (cmake/shardkitConfig.cmake.in): the CPU libraries are exported in shardkitTargets.cmake, which
// names no CUDA target; shardkit::cuda alone is in shardkitCudaTargets.cmake, loaded only for
// find_package(shardkit COMPONENTS cuda), which first finds the CUDA toolkit (CUDAToolkit) and NCCL by name
// (cmake/FindNCCL.cmake, installed with the package), so no absolute path is baked into the installed files.
// In-tree, the CUDA tests link shardkit::cuda when the build has it; everything else stays CPU-only.
#pragma once

extern "C" {
// Defined in cuda_component.cc; see Linking above.
void shardkit_cuda_component_anchor();
}
