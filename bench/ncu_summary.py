#!/usr/bin/env python3
"""Summarises an Nsight Compute CSV (ncu --csv --metrics ...) per kernel name: launches, mean
duration, DRAM bytes and the share of peak DRAM and SM throughput, and each kernel's grid and
block. Used by scripts/gpu_profile.sh; the bound of a kernel is read off these columns (near
peak DRAM: memory-bound; both low with a short duration: latency or launch-bound).

    python3 bench/ncu_summary.py profile.csv [--calls N]

--calls N divides the total (less the input generators) by N, the profiled calls of the
pipeline, for a per-call line.
"""

import argparse
import csv
import sys
from collections import OrderedDict
from typing import Dict, List

METRICS = {
    "gpu__time_duration.sum": "us",
    "dram__bytes_read.sum": "rd_MB",
    "dram__bytes_write.sum": "wr_MB",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "dram%",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed": "sm%",
}
# The benchmarks' input generators, left out of the per-call total.
INPUT_KERNELS = {"normal_kernel", "fill_normal", "abs_index_kernel", "key_index_kernel"}
SCALE = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3,
         "s": 1e6, "second": 1e6, "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3, "%": 1.0}


def short(name: str) -> str:
    base = name.replace("(anonymous namespace)::", "").replace("<unnamed>::", "").split("(")[0].split("<")[0].strip()
    return base.replace("void ", "").split("::")[-1][:44]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("csv")
    p.add_argument("--calls", type=int, default=0)
    args = p.parse_args()
    kernels: "OrderedDict[str, Dict[str, object]]" = OrderedDict()
    with open(args.csv, newline="") as f:
        lines = [line for line in f if line.startswith('"')]
    for row in csv.DictReader(lines):
        metric = row.get("Metric Name", "")
        if metric not in METRICS:
            continue
        name = short(row["Kernel Name"])
        k = kernels.setdefault(name, {"ids": set(), "grid": row.get("Grid Size", ""),
                                      "block": row.get("Block Size", ""),
                                      **{v: 0.0 for v in METRICS.values()}})
        k["ids"].add(row["ID"])  # type: ignore[union-attr]
        value = float(row["Metric Value"].replace(",", "")) * SCALE.get(row.get("Metric Unit", ""), 1.0)
        k[METRICS[metric]] = float(k[METRICS[metric]]) + value  # type: ignore[arg-type]
    header = f"{'kernel':44s} {'n':>4s} {'us/launch':>10s} {'rd MB':>8s} {'wr MB':>8s} {'dram%':>6s} {'sm%':>6s}  grid / block"
    print(header)
    total_us = 0.0
    for name, k in kernels.items():
        cnt = len(k["ids"])  # type: ignore[arg-type]
        if name not in INPUT_KERNELS:
            total_us += float(k["us"])  # type: ignore[arg-type]
        print(f"{name:44s} {cnt:4d} {float(k['us']) / cnt:10.2f} {float(k['rd_MB']) / cnt:8.2f} "
              f"{float(k['wr_MB']) / cnt:8.2f} {float(k['dram%']) / cnt:6.1f} {float(k['sm%']) / cnt:6.1f}  "
              f"{k['grid']} / {k['block']}")
    if args.calls:
        print(f"kernel time per call: {total_us / args.calls:.1f} us ({args.calls} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
