#!/bin/sh
# Runs the kernels of common/kernels/cuda/flash_attention.cu on the CPU (no GPU needed) and checks them against fp64
# attention and an fp64 emulation of their own steps: every shape of CudaOpsTest.FusedAttentionAtMediumPrecision...,
# each under four thread schedules that must give the same bits (a read not ordered by a barrier shows up), shared
# memory and outputs pre-filled with NaN (an uninitialised read or a missing write shows up), WMMA's alignment and
# leading-dimension rules asserted. include/ holds stand-ins for the CUDA headers: sim.h runs a block's 128 threads
# one at a time, switching only at barriers, shuffles and WMMA calls; every lane of a WMMA fragment holds the whole
# tile. What it cannot tell: tensor-core summation order, __expf's accuracy, speed, and anything the real
# compiler or hardware does differently from this model.
#
# Usage: sh tools/cuda_sim/run.sh [shape index]     (about 5 minutes on 2 cores; QK_SCALE=3 makes large scores)
# The kernels are the file's text before `namespace cuda_impl {`, with the dynamic shared memory declaration
# swapped for the simulator's (the only edit; printed below).
set -e
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
sed -n '1,/^namespace cuda_impl {/p' "$here/../../common/kernels/cuda/flash_attention.cu" | sed '$d' > "$work/orig.inc"
printf '}  // namespace shardkit::kernels::cuda (closed by run.sh)\n' >> "$work/orig.inc"
sed 's|extern __shared__ __align__(128) unsigned char smem\[\];|unsigned char* smem = sim::block_smem();|' \
  "$work/orig.inc" > "$work/flash_attention_kernels.inc"
diff "$work/orig.inc" "$work/flash_attention_kernels.inc" || true
g++ -std=c++20 -O1 -pthread -I"$here/include" -I"$work" -o "$work/flash_attention_sim" "$here/flash_attention_sim.cc"
"$work/flash_attention_sim" 1 1 "$@"
