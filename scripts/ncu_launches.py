"""Per-launch durations and DRAM bytes from `ncu --csv --metrics
gpu__time_duration.sum,dram__bytes_read.sum` output (see `scripts/gpu.sh ceilings`).

  python3 scripts/ncu_launches.py kernels FILE  each kernel and grid: mean µs, MB read, GB/s
"""
import collections
import csv
import sys

UNITS = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "Gbyte": 1e9, "B": 1, "KB": 1e3, "MB": 1e6,
         "GB": 1e9, "nsecond": 1e-3, "usecond": 1, "msecond": 1e3, "ns": 1e-3, "us": 1, "ms": 1e3}


def launches(path):
    """{(id, kernel, grid): {metric: value in bytes or µs}} in launch order."""
    out = collections.OrderedDict()
    with open(path) as f:
        for row in csv.reader(f):
            if len(row) < 15 or not row[0].isdigit():
                continue
            key = (int(row[0]), row[4].split("(")[0], row[8])
            out.setdefault(key, {})[row[-3]] = float(row[-1].replace(",", "")) * UNITS[row[-2]]
    return out


def main():
    mode, path = sys.argv[1], sys.argv[2]
    if mode != "kernels":
        sys.exit(f"unknown mode {mode}")
    by_kernel = collections.defaultdict(list)
    for (_, kernel, grid), m in launches(path).items():
        by_kernel[(kernel, grid)].append((m["gpu__time_duration.sum"], m["dram__bytes_read.sum"]))
    for (kernel, grid), v in by_kernel.items():
        us = sum(t for t, _ in v) / len(v)
        b = sum(b for _, b in v) / len(v)
        print(f"{kernel:28} {grid:>14} {len(v):3} launches {us:8.2f} µs {b / 1e6:8.2f} MB {b / 1e3 / us:6.0f} GB/s")


if __name__ == "__main__":
    main()
