#!/usr/bin/env python3
"""Prints the median real time (us) of every benchmark in one or more Google Benchmark JSON
files (run with --benchmark_repetitions and --benchmark_report_aggregates_only), one column a
file, rows by benchmark name; --filter keeps the names that contain one of its words.

    python3 bench/cuda_medians.py before.json after.json --filter select/topk/ baseline/copy
"""

import argparse
import json
import os
import sys
from typing import Dict, List


def medians(path: str) -> Dict[str, float]:
    with open(path) as f:
        data = json.load(f)
    out: Dict[str, float] = {}
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}
    for b in data.get("benchmarks", []):
        if b.get("aggregate_name", "median") != "median":
            continue
        name = b["run_name"].replace("/manual_time", "")
        out[name] = b["real_time"] * scale.get(b.get("time_unit", "ns"), 1.0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+")
    p.add_argument("--filter", nargs="*", default=[])
    args = p.parse_args()
    cols: List[Dict[str, float]] = [medians(f) for f in args.files]
    names: List[str] = []
    for c in cols:
        names += [n for n in c if n not in names]
    if args.filter:
        names = [n for n in names if any(w in n for w in args.filter)]
    width = max([len(n) for n in names] + [10])
    heads = [os.path.basename(f).removesuffix(".json") for f in args.files]
    cw = max([len(h) for h in heads] + [8])
    print(" ".join([f"{'benchmark (median us)':{width}s}"] + [f"{h:>{cw}s}" for h in heads]))
    for n in names:
        print(" ".join([f"{n:{width}s}"] + [f"{c[n]:{cw}.1f}" if n in c else f"{'-':>{cw}s}" for c in cols]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
