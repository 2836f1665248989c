#!/usr/bin/env python3
"""The DDP hook's local work on one bucket, gradcomp.torch against a hand-written
torch.topk hook body, in the same process on one thread, interleaved rep by rep.

    scripts/torch_bench.sh                       # n = 25,557,032 (ResNet-50), density 0.001 and 0.01
    scripts/torch_bench.sh --n 100000 --reps 1   # a smoke run

Both sides do what a top-k + residual hook does on one rank (P = 1 gloo group, so the
exchange moves nothing): e += g, select the k largest |e|, take their values, clear them in e,
and write the dense result (zeros but the k values) over the bucket. gradcomp's side is
Engine.run (accumulate fused with exact top-k, encode, decode, feedback update, the exchange's
decode); the baseline is torch.topk(e.abs(), k) with index_fill_ and a scatter. Also timed: a
copy of the bucket (memory speed). Reported: the median of --reps, and the ratio; the first
step's index sets are compared (the same top-k).
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Callable, Dict, List

import torch
import torch.distributed as dist

from gradcomp import _torch_ext as ext


def torch_topk_hook_body(residual: torch.Tensor, grad: torch.Tensor, k: int) -> torch.Tensor:
    """What researchers hand-write on torch.topk: top-k of the residual-corrected gradient."""
    residual.add_(grad)
    _, idx = torch.topk(residual.abs(), k, sorted=False)
    values = residual[idx]
    residual.index_fill_(0, idx, 0.0)
    grad.zero_()
    grad[idx] = values
    return idx


def median_ms(samples: List[float]) -> float:
    return 1000.0 * statistics.median(samples)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=25_557_032)
    p.add_argument("--density", type=float, nargs="+", default=[0.001, 0.01])
    p.add_argument("--dist", choices=["normal", "student_t3"], nargs="+", default=["normal", "student_t3"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default="", help="also write the results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        results: List[Dict[str, object]] = []
        gen = torch.Generator().manual_seed(1)
        for d in args.dist:
            if d == "normal":
                g0 = torch.randn(args.n, generator=gen)
            else:
                g0 = torch.distributions.StudentT(torch.tensor(3.0)).sample((args.n,))
            for density in args.density:
                k = max(1, round(density * args.n))
                config = ext.EngineConfig()  # topk, fp32, residual, allgather
                engine = ext.Engine(dist.group.WORLD, config)
                residual = torch.zeros(args.n)
                times: Dict[str, List[float]] = {"gradcomp": [], "torch_topk": [], "copy": []}
                same_indices = None
                for rep in range(args.reps):
                    for side in ("gradcomp", "torch_topk", "copy"):
                        buf = g0.clone()
                        t0 = time.perf_counter()
                        if side == "gradcomp":
                            engine.run(0, buf, rep, density)
                            engine.commit()  # what the hook does at the end of an iteration
                        elif side == "torch_topk":
                            idx = torch_topk_hook_body(residual, buf, k)
                        else:
                            buf.copy_(g0)
                        times[side].append(time.perf_counter() - t0)
                        if rep == 0 and side == "gradcomp":
                            ours = set(torch.nonzero(buf).flatten().tolist())
                        if rep == 0 and side == "torch_topk":
                            same_indices = ours == set(idx.tolist())
                row = {
                    "n": args.n,
                    "density": density,
                    "k": k,
                    "input": d,
                    "gradcomp_ms": round(median_ms(times["gradcomp"]), 3),
                    "torch_topk_ms": round(median_ms(times["torch_topk"]), 3),
                    "copy_ms": round(median_ms(times["copy"]), 3),
                    "speedup": round(statistics.median(times["torch_topk"]) / statistics.median(times["gradcomp"]), 1),
                    "gradcomp_vs_copy": round(statistics.median(times["gradcomp"]) / statistics.median(times["copy"]), 2),
                    "same_first_topk": same_indices,
                    "reps": args.reps,
                }
                results.append(row)
                print(
                    f"n={args.n} {d:10s} density={density:<6} gradcomp {row['gradcomp_ms']:9.2f} ms  "
                    f"torch.topk body {row['torch_topk_ms']:9.2f} ms  copy {row['copy_ms']:7.2f} ms  "
                    f"speedup {row['speedup']:6.1f}x  gradcomp/copy {row['gradcomp_vs_copy']:.2f}  "
                    f"same top-k: {same_indices}",
                    flush=True,
                )
        dist.destroy_process_group()
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "torch": torch.__version__, "results": results}, f, indent=1)
    print(json.dumps(results))
    if not all(r["same_first_topk"] for r in results):
        print("torch_hook_bench: the two sides selected different index sets", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
