#!/usr/bin/env python3
"""torch.topk on the GPU, the other baseline of gradcomp's device top-k: the sizes and
densities of gradcomp_cuda_bench's cuda/select/* families, keys |g| precomputed (as
gradcomp_cub_topk_bench gives cub::DeviceTopK), sorted=False, timed with CUDA events (the
median of --reps after --warmup calls), with a device copy of g timed the same way in the same
run. Inputs: standard normal values from torch's CUDA generator (seed 12345), the same
distribution as the C++ benchmarks' hashed normals but not the same values.

    python3 bench/cuda_cub/torch_topk_bench.py --out torch_topk.json
"""

import argparse
import json
import statistics
import sys
from typing import Callable, Dict, List

import torch

SIZES = [1 << 20, 6_553_600, 25_557_032, 1 << 27]
PPMS = [100, 1000, 10000]


def k_for_density(n: int, ppm: int) -> int:
    """gradcomp::k_for_density: round(n * density), at least 1 when n > 0."""
    return max(1, round(n * ppm * 1e-6)) if n > 0 else 0


def median_us(fn: Callable[[], object], warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times: List[float] = []
    for _ in range(reps):
        start = torch.cuda.Event(enable_timing=True)
        stop = torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(1000.0 * start.elapsed_time(stop))
    return statistics.median(times)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--out", default="", help="also write the results as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("SKIPPED: torch has no CUDA device")
        return 77
    gen = torch.Generator(device="cuda").manual_seed(12345)
    rows: List[Dict[str, object]] = []
    for n in SIZES:
        g = torch.randn(n, device="cuda", generator=gen)
        keys = g.abs()
        out = torch.empty_like(g)
        copy_us = median_us(lambda: out.copy_(g), args.warmup, args.reps)
        rows.append({"name": f"torch/copy/n:{n}", "n": n, "us": copy_us})
        for ppm in PPMS:
            k = k_for_density(n, ppm)
            us = median_us(lambda: torch.topk(keys, k, sorted=False), args.warmup, args.reps)
            rows.append({"name": f"torch/topk/n:{n}/ppm:{ppm}", "n": n, "ppm": ppm, "k": k, "us": us})
        del g, keys, out
    print(f"{'benchmark':40s} {'us':>10s}")
    for r in rows:
        print(f"{r['name']:40s} {r['us']:10.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
