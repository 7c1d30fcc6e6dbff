#!/usr/bin/env bash
# Runs on the lent GPU machine, from the pack tools/gpu/pack.sh made: the CUDA tests (every test whose name says
# Cuda / Nccl / DeviceOnly; without a GPU they skip, here they must pass), optim_bench_cuda, model_bench_cuda at
# medium with the materialised (default) and the fused attention, bench/gpt2_vs_torch.py (GPT-2 small against PyTorch eager),
# then Nsight Compute's per-kernel times of one medium-precision step. Results go to $OUT (the device tool brings
# them back): summary.txt with each exit status, and results.tar.gz with one file per binary, the kernel times and
# the machine's description.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${OUT:-/tmp/gpu-out}
mkdir -p "$out"
# PyTorch's pip packages hold NCCL, cuBLAS and the rest under site-packages/nvidia/<name>/lib.
nv=$(python3 -c 'import nvidia, os; print(os.path.dirname(list(nvidia.__path__)[0]) + "/nvidia")' 2>/dev/null || true)
# pack.sh ships the libraries as lib.tar.gz (the carried folder's 64 MiB); unpacked next to the results' scratch.
libdir="$here/lib"
if [[ -f "$here/lib.tar.gz" ]]; then
  libdir=$(mktemp -d)
  tar -xzf "$here/lib.tar.gz" -C "$libdir" --strip-components=1
fi
libs="$libdir"
for d in "$nv"/*/lib; do [[ -d "$d" ]] && libs="$libs:$d"; done
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  nvidia-smi
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  ls "$nv" 2>/dev/null
  for b in "$here"/bin/*; do echo "== ldd $(basename "$b")"; ldd "$b" | grep -E 'not found|nccl|cublas|cudart'; done
} > "$out/machine.txt" 2>&1
: > "$out/summary.txt"
# The device call's limit is 600 s: every step gets at most its own limit and what is left of 560 s (SHARDKIT_GPU_RUN_S
# overrides it), so a hang in one step still leaves the results of the others (a step with nothing left is
# recorded as not run).
deadline=$((SECONDS + ${SHARDKIT_GPU_RUN_S:-560}))
limit() { local left=$((deadline - SECONDS)); (( left < $1 )) && echo "$left" || echo "$1"; }
for t in tensor_test kernels_test autograd_cuda_ops_test comm_in_process_cuda_test sddp_gpt_test fsdp_cuda_test optim_test oss_test comm_nccl_test fsdp_combo4_test sddp_combo4_test fsdp_combo7_cuda_test; do
  (( $(limit 120) > 0 )) || { echo "$t not run: out of time" >> "$out/summary.txt"; continue; }
  started=$SECONDS
  timeout "$(limit 120)" "$here/bin/$t" --gtest_filter='*Cuda*:*cuda*:*Nccl*:*DeviceOnly*' > "$out/$t.txt" 2>&1
  rc=$?
  echo "$t exit $rc in $((SECONDS - started)) s: $(grep -E '^\[  (PASSED  |FAILED  |SKIPPED )\] [0-9]+ test' "$out/$t.txt" | tr '\n' ' ')" >> "$out/summary.txt"
done
# The materialised attention (the default) against the fused one (Note [flash attention]), both at matmul precision
# medium.
if (( $(limit 120) > 0 )); then
  timeout "$(limit 120)" "$here/bin/model_bench_cuda" --benchmark_filter='gpt2-small/medium' \
    > "$out/model_bench_cuda_medium.txt" 2>&1
  echo "model_bench_cuda medium, materialised / fused attention exit $?: $(grep -oE 'tokens_per_s=[0-9.]+k?' \
    "$out/model_bench_cuda_medium.txt" | tr '\n' ' ')" >> "$out/summary.txt"
else
  echo "model_bench_cuda medium not run: out of time" >> "$out/summary.txt"
fi
if (( $(limit 120) > 0 )); then
  timeout "$(limit 120)" "$here/bin/optim_bench_cuda" > "$out/optim_bench_cuda.txt" 2>&1
  echo "optim_bench_cuda exit $?" >> "$out/summary.txt"
else
  echo "optim_bench_cuda not run: out of time" >> "$out/summary.txt"
fi
# GPT-2 small step against PyTorch eager (fp32 both; shardkit at matmul precision medium against PyTorch under bf16
# autocast, the issue's goal line, and against PyTorch fp32 at matmul precision medium, the same GEMM semantics).
for dtype in bf16 fp32-medium fp32; do  # the issue's goal line first: the later ones may run out of time
  (( $(limit 150) > 0 )) || { echo "gpt2_vs_torch $dtype not run: out of time" >> "$out/summary.txt"; continue; }
  profile=()
  [[ $dtype == bf16 ]] && profile=(--profile)  # PyTorch's kernel table, beside ncu's of shardkit below
  timeout "$(limit 150)" python3 "$here/gpt2_vs_torch.py" --shardkit "$here/bin/model_bench_cuda" --dtype "$dtype" \
    "${profile[@]}" > "$out/gpt2_vs_torch_$dtype.txt" 2>&1
  echo "gpt2_vs_torch $dtype exit $?: $(tail -1 "$out/gpt2_vs_torch_$dtype.txt")" >> "$out/summary.txt"
done
# Where the medium-precision step's device time goes, by kernel: Nsight Compute times 1500 consecutive kernels
# (about two steps, after the warm-up), one pass each, with the clocks left alone; summed by name.
if command -v ncu > /dev/null && (( $(limit 150) > 60 )); then
  timeout "$(limit 150)" ncu --clock-control none --metrics gpu__time_duration.sum --csv --launch-skip 3000 \
    --launch-count 1500 "$here/bin/model_bench_cuda" --benchmark_filter=gpt2-small/medium/ > "$out/ncu.csv" 2> "$out/ncu.err"
  echo "ncu exit $?" >> "$out/summary.txt"
  python3 "$here/kernel_times.py" "$out/ncu.csv" > "$out/kernel_times.txt" 2>&1
  head -40 "$out/kernel_times.txt"
fi
echo "run.sh: $SECONDS s in all" >> "$out/summary.txt"
cat "$out/summary.txt"
grep -hE '^\[  FAILED  \]|^BM_' "$out"/*.txt | head -60
# The device tool brings back at most 8 files: everything but the summary travels as one archive.
tar -C "$out" -czf /tmp/results.tar.gz --exclude=summary.txt . && mv /tmp/results.tar.gz "$out/results.tar.gz"
find "$out" -maxdepth 1 -type f ! -name summary.txt ! -name results.tar.gz -delete
