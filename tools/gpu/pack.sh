#!/usr/bin/env bash
# Prepares a run on a lent GPU machine (DEVELOPERS guide, "A GPU, when one is lent"): builds the CUDA tests and
# benchmarks here for a generic x86-64 CPU and Hopper GPUs (sm_90: H100 / H200), and gathers them with the
# shared libraries they load that the GPU machine lacks (our Debian dependencies, the CUDA runtime) into
# gpu-pack/ (git-ignored, at most 64 MiB, so the device tool can carry it). Left out on purpose: the driver
# (libcuda), NCCL and cuBLAS, each far over the limit; gpu-pack/run.sh finds them in PyTorch's `nvidia` pip
# packages on that machine. cuBLAS is dlopen'ed by soname (Note [cuBLAS loaded on first use] in
# common/kernels/cuda/gemm.cu): this build asks for libcublas.so.<its CUDA major>; if the machine's PyTorch
# carries another major, GEMM tests fail saying so, and the rest still runs.
#
# Usage: bash tools/gpu/pack.sh   then, with the device tool (each binary runs under its own 120-150 s timeout):
#        run(command="bash gpu-pack/run.sh", carry=["gpu-pack"])
set -euo pipefail
cd "$(dirname "$0")/../.."
targets=(tensor_test kernels_test autograd_cuda_ops_test comm_in_process_cuda_test sddp_gpt_test fsdp_cuda_test optim_test oss_test comm_nccl_test fsdp_combo4_test sddp_combo4_test fsdp_combo7_cuda_test optim_bench_cuda model_bench_cuda)
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DSHARDKIT_NATIVE=OFF -DSHARDKIT_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90 > /dev/null
cmake --build build-gpu -j"$(nproc)" --target "${targets[@]}"
rm -rf gpu-pack
mkdir -p gpu-pack/bin gpu-pack/lib
for t in "${targets[@]}"; do
  bin=$(find build-gpu -type f -name "$t" -perm -u+x | head -1)
  [[ -n "$bin" ]] || { echo "pack: $t was not built"; exit 1; }
  cp "$bin" gpu-pack/bin/
  strip --strip-unneeded "gpu-pack/bin/$t"  # symbol tables: about a fifth of each binary
  # Every library the loader resolves to a file, but the C runtime (present everywhere) and the GPU-side
  # libraries listed above.
  ldd "$bin" | awk '$3 ~ /^\// {print $3}' |
    grep -vE '/(libc|libm|libdl|libpthread|librt|ld-linux-x86-64)\.so|/lib(cuda|nccl|cublas|cublasLt)\.so' |
    while read -r lib; do cp -Ln "$lib" gpu-pack/lib/ 2>/dev/null || true; done
done
cp tools/gpu/run.sh tools/gpu/kernel_times.py bench/gpt2_vs_torch.py gpu-pack/
# The libraries go compressed (OpenBLAS alone is 36 MiB, a fifth of that gzipped); run.sh unpacks them.
tar -C gpu-pack -czf gpu-pack/lib.tar.gz lib
rm -rf gpu-pack/lib
size=$(du -sm gpu-pack | cut -f1)
echo "pack: gpu-pack/ holds ${size} MiB: $(ls gpu-pack/bin | tr '\n' ' ')"
if ((size > 64)); then echo "pack: over the device tool's 64 MiB"; exit 1; fi
