#!/usr/bin/env python3
"""The DDP hook's local work on one CUDA bucket, in one process (a P = 1 group, so that the
exchange moves nothing): gradcomp's CUDA hook against a hand-written torch.topk + residual
hook body and PowerSGD rank 4's hook, interleaved rep by rep, on the same GPU.

    PYTHONPATH=<where gradcomp is> python3 bench/torch_cuda_hook_bench.py \\
        [--n 25557032] [--density 0.001 0.01] [--reps 20] [--out results.json]

- gradcomp: gradcomp_hook(state, bucket).wait() with overlap=False: e += g fused with the
  exact top-k, the values taken and cleared in e, the bucket's agreement, the rank-order mean
  written over the bucket, the statistics copied to the host (one synchronisation);
- torch.topk: e += g; torch.topk(e.abs(), k, sorted=False); values = e[idx]; e[idx] = 0;
  the bucket zeroed and the values put back (bench/torch_hook_bench.py's body, imported, on
  CUDA);
- PowerSGD: torch's powerSGD_hook (rank 4, error feedback and warm start, past its start
  iteration) on the same bucket seen as 2-D gradients of 512 x 4096 (the rest as one matrix);
- copy: the bucket copied once (memory speed).
Each sample is wall time from a synchronised start to a synchronised end; reported: the
median of --reps per side, and gradcomp's speed-up over each. The first step's results of
gradcomp and the torch.topk body are compared (the same top-k, bit for bit).
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
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

import gradcomp.torch as gct
from torch_hook_bench import torch_topk_hook_body  # the same body as the CPU benchmark's


class Bucket:
    """A GradBucket's methods over a flat buffer; gradients() as 2-D views of it."""

    def __init__(self, buffer: torch.Tensor, param: torch.Tensor) -> None:
        self._buffer, self._param = buffer, param
        rows, cols = 512, 4096
        whole = buffer.numel() // (rows * cols)
        views = [buffer[i * rows * cols:(i + 1) * rows * cols].view(rows, cols) for i in range(whole)]
        rest = buffer.numel() - whole * rows * cols
        if rest:
            views.append(buffer[whole * rows * cols:].view(8, -1) if rest % 8 == 0 else buffer[whole * rows * cols:])
        self._views = views

    def index(self) -> int:
        return 0

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, t: torch.Tensor) -> None:
        self._buffer.copy_(t)

    def gradients(self) -> List[torch.Tensor]:
        return self._views

    def parameters(self) -> List[torch.Tensor]:
        return [self._param]

    def is_last(self) -> bool:
        return True


def timed(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=25_557_032)
    p.add_argument("--density", type=float, nargs="+", default=[0.001, 0.01])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: nothing to measure", file=sys.stderr)
        return 77
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    results: List[Dict[str, object]] = []
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        gen = torch.Generator(device=dev).manual_seed(1)
        grads = [torch.randn(args.n, device=dev, generator=gen) for _ in range(2)]
        grads[1].pow_(3)  # heavy tails on the second
        param = torch.nn.Parameter(torch.zeros(args.n, device=dev))
        buf = torch.empty(args.n, device=dev)
        copy_dst = torch.empty_like(buf)
        for density in args.density:
            k = max(1, round(density * args.n))
            state = gct.GradcompState(selector="topk", density=density, overlap=False)
            residual = torch.zeros(args.n, device=dev)
            ps = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                    start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
            # The first step of each, compared: the same top-k, bit for bit.
            buf.copy_(grads[0])
            ours = gct.gradcomp_hook(state, Bucket(buf, param)).wait().clone()
            theirs = grads[0].clone()
            torch_topk_hook_body(residual, theirs, k)
            same = torch.equal(ours, theirs)
            ok = ok and same
            for _ in range(3):  # PowerSGD past its start iteration, and its buffers made
                buf.copy_(grads[0])
                psgd.powerSGD_hook(ps, Bucket(buf, param)).wait()
            samples: Dict[str, List[float]] = {"gradcomp": [], "torch_topk": [], "powersgd": [], "copy": []}
            for r in range(args.reps):
                g = grads[r % 2]
                buf.copy_(g)
                samples["gradcomp"].append(timed(lambda: gct.gradcomp_hook(state, Bucket(buf, param)).wait()))
                buf.copy_(g)
                samples["torch_topk"].append(timed(lambda: torch_topk_hook_body(residual, buf, k)))
                buf.copy_(g)
                samples["powersgd"].append(timed(lambda: psgd.powerSGD_hook(ps, Bucket(buf, param)).wait()))
                samples["copy"].append(timed(lambda: copy_dst.copy_(g)))
            state.close()
            med = {name: 1000.0 * statistics.median(v) for name, v in samples.items()}
            row = {"n": args.n, "density": density, "k": k, "reps": args.reps, "same_topk": same,
                   "median_ms": med,
                   "speedup_vs_torch_topk": med["torch_topk"] / med["gradcomp"],
                   "speedup_vs_powersgd": med["powersgd"] / med["gradcomp"]}
            results.append(row)
            print(f"n={args.n} density={density}: gradcomp {med['gradcomp']:.3f} ms, torch.topk body "
                  f"{med['torch_topk']:.3f} ms ({row['speedup_vs_torch_topk']:.2f}x), PowerSGD rank 4 "
                  f"{med['powersgd']:.3f} ms ({row['speedup_vs_powersgd']:.2f}x), copy {med['copy']:.3f} ms; "
                  f"same top-k: {same}", flush=True)
        dist.destroy_process_group()
    info = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "results": results}
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
