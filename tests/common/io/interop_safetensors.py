#!/usr/bin/env python3
"""The Python side of io_interop_test: files written and read by the `safetensors` package (PyPI).

  interop_safetensors.py write PATH        every dtype through safetensors.serialize_file (BF16 as raw bits)
  interop_safetensors.py write-numpy PATH  F32 / F16 / I64 through safetensors.numpy.save_file
  interop_safetensors.py check PATH        reads shardkit's file; exit 1 on any difference
  interop_safetensors.py check-index PATH  reads shardkit's sharded export (index + parts); exit 1 on any difference

Tensor values are bit patterns that tests/common/io/io_test_util.h (PatternTensor) computes the same way, so
both sides know what the other must have written without trusting each other's reader.
"""
import json
import os
import sys

import numpy as np
import safetensors
import safetensors.numpy

# name, safetensors dtype, shape, seed: the same list as EveryDtype() in the C++ tests.
TENSORS = [
    ("f32.matrix", "F32", [3, 5], 1),
    ("bf16.odd", "BF16", [7], 2),
    ("f16.cube", "F16", [2, 3, 2], 3),
    ("i64.tokens", "I64", [4, 2], 4),
    ("f32.scalar", "F32", [], 5),
    ("bf16.empty", "BF16", [0, 3], 6),
    ("f16.one", "F16", [1], 7),
]
BITS = {"F32": np.uint32, "BF16": np.uint16, "F16": np.uint16, "I64": np.uint64}
NUMPY = {"F32": np.float32, "F16": np.float16, "I64": np.int64}  # numpy has no bfloat16
LONG_NAME = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64"}


def pattern(st_dtype, shape, seed):
    """Raw element bits: low bytes of ((i + 1) * 0x9E3779B97F4A7C15 + seed) >> 17, as PatternTensor."""
    n = int(np.prod(shape, dtype=np.int64)) if shape else 1
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = ((i + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)) >> np.uint64(17)
    return x.astype(BITS[st_dtype]).reshape(shape)


def spec(st_dtype, shape, raw):
    """A serialize_file entry: TensorSpec in safetensors >= 0.8, a dict in older versions."""
    if hasattr(safetensors, "TensorSpec"):
        return safetensors.TensorSpec(dtype=LONG_NAME[st_dtype], shape=list(shape), data_ptr=raw.ctypes.data,
                                      data_len=raw.nbytes)
    return {"dtype": LONG_NAME[st_dtype], "shape": list(shape), "data": raw.tobytes()}


def write(path):
    keep = {name: np.ascontiguousarray(pattern(d, shape, seed)) for name, d, shape, seed in TENSORS}
    specs = {name: spec(d, shape, keep[name]) for name, d, shape, _ in TENSORS}
    # One metadata key: the reference writer keeps metadata in a hash map, so the order of several keys in the
    # header changes from run to run, and the C++ test compares this file's bytes with shardkit's.
    safetensors.serialize_file(specs, path, metadata={"origin": "python"})


def write_numpy(path):
    tensors = {name: pattern(d, shape, seed).view(NUMPY[d]) for name, d, shape, seed in TENSORS if d in NUMPY}
    safetensors.numpy.save_file(tensors, path, metadata={"origin": "numpy", "format": "np"})


def compare(source, raw_by_name, names):
    """raw_by_name: name -> (dtype, shape, bytes). Returns the list of problems."""
    problems = []
    want = {name: (d, shape, seed) for name, d, shape, seed in TENSORS if name in names}
    if set(raw_by_name) != set(want):
        problems.append(f"{source}: expected tensors {sorted(want)}, found {sorted(raw_by_name)}")
    for name, (d, shape, seed) in want.items():
        if name not in raw_by_name:
            continue
        got_d, got_shape, got_bytes = raw_by_name[name]
        if got_d != d or list(got_shape) != list(shape):
            problems.append(f"{source}: {name}: expected {d}{shape}, found {got_d}{list(got_shape)}")
        elif bytes(got_bytes) != pattern(d, shape, seed).tobytes():
            problems.append(f"{source}: {name}: bytes differ")
    return problems


def check(path, expected_metadata):
    with open(path, "rb") as f:
        data = f.read()
    raw = {name: (t["dtype"], t["shape"], t["data"]) for name, t in safetensors.deserialize(data)}
    problems = compare(path, raw, [t[0] for t in TENSORS])
    # The everyday API: safe_open with numpy for the types numpy has, and the metadata.
    with safetensors.safe_open(path, framework="numpy") as f:
        if f.metadata() != expected_metadata:
            problems.append(f"{path}: expected metadata {expected_metadata}, found {f.metadata()}")
        for name, d, shape, seed in TENSORS:
            if d in NUMPY:
                a = f.get_tensor(name)
                if a.dtype != NUMPY[d] or list(a.shape) != shape or a.tobytes() != pattern(d, shape, seed).tobytes():
                    problems.append(f"{path}: {name}: safe_open gives {a.dtype}{list(a.shape)} with other values")
    return problems, len(raw)


def check_index(index_path):
    with open(index_path) as f:
        index = json.load(f)
    problems = []
    total = sum(pattern(d, s, seed).nbytes for _, d, s, seed in TENSORS)
    if index.get("metadata", {}).get("total_size") != total:
        problems.append(f"expected total_size {total}, found {index.get('metadata')}")
    raw = {}
    by_file = {}
    for name, file in index["weight_map"].items():
        by_file.setdefault(file, []).append(name)
    for file, names in sorted(by_file.items()):
        with open(os.path.join(os.path.dirname(index_path), file), "rb") as f:
            tensors = dict(safetensors.deserialize(f.read()))
        if sorted(tensors) != sorted(names):
            problems.append(f"{file}: expected {sorted(names)}, found {sorted(tensors)}")
        for name in names:
            t = tensors[name]
            raw[name] = (t["dtype"], t["shape"], t["data"])
    problems += compare(index_path, raw, [t[0] for t in TENSORS])
    return problems, len(raw), len(by_file)


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "write":
        write(path)
    elif mode == "write-numpy":
        write_numpy(path)
    elif mode == "check":
        problems, n = check(path, {"origin": "shardkit", "format": "pt"})
        for p in problems:
            print("MISMATCH", p)
        if problems:
            return 1
        print(f"safetensors {safetensors.__version__}: checked {n} tensors")
    elif mode == "check-index":
        problems, n, parts = check_index(path)
        for p in problems:
            print("MISMATCH", p)
        if problems:
            return 1
        print(f"checked {n} tensors in {parts} parts")
    else:
        print(f"unknown mode {mode}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
