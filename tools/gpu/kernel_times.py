#!/usr/bin/env python3
"""Sums an Nsight Compute CSV (--metrics gpu__time_duration.sum --csv) by kernel name: total time, count and share,
largest first. Used by tools/gpu/run.sh on the GPU machine.

  python3 tools/gpu/kernel_times.py ncu.csv
"""
import collections
import csv
import sys


def main():
    rows = [r for r in csv.reader(open(sys.argv[1], errors="replace")) if len(r) > 5]
    header = next((r for r in rows if "Kernel Name" in r and "Metric Value" in r), None)
    if header is None:
        raise SystemExit("no ncu table in " + sys.argv[1])
    name_col, unit_col, value_col = header.index("Kernel Name"), header.index("Metric Unit"), header.index("Metric Value")
    scale = {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3, "ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}
    total, count = collections.Counter(), collections.Counter()
    for r in rows:
        if r is header or r[value_col] in ("", "Metric Value"):
            continue
        try:
            ms = float(r[value_col].replace(",", "")) * scale.get(r[unit_col], 1e-6)
        except ValueError:
            continue
        name = r[name_col][:110]
        total[name] += ms
        count[name] += 1
    all_ms = sum(total.values())
    print(f"{sum(count.values())} kernels, {all_ms:.2f} ms")
    for name, ms in total.most_common():
        print(f"{ms:9.3f} ms {100 * ms / all_ms:5.1f}% {count[name]:6d}x  {name}")


if __name__ == "__main__":
    main()
