#!/usr/bin/env python3
"""What a gradcomp hook selects, step by step: the CNN of train_ddp.py on 2 gloo workers,
printing every --every steps the loss, the coordinates selected (of n), and the threshold
the selector used, until --steps or the first failure (a diverged run stops at its first
non-finite gradient).

    scripts/torch_python.sh examples/torch/trace_selection.py --hook gradcomp:gaussiank:0.001
"""

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_ddp as T  # noqa: E402


def worker(rank: int, args: argparse.Namespace, store: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.manual_seed(args.seed)
    model = T.CNN()
    ddp = DDP(model)
    state, hook, info = T.make_hook(args.hook, model, 1)
    ddp.register_comm_hook(state, hook)
    momentum = 0.0 if state.feedback == "dgc" else 0.9
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=momentum)
    x, y = T.load(args.data, "train")
    for s in range(args.steps):
        idx = torch.arange(s * 64 + rank * 32, s * 64 + rank * 32 + 32) % x.shape[0]
        opt.zero_grad()
        loss = F.cross_entropy(ddp(x[idx]), y[idx])
        try:
            loss.backward()
        except RuntimeError as e:
            if rank == 0:
                print(f"step {s}: failed: {e}", flush=True)
            raise SystemExit(1)
        opt.step()
        st = state.stats()
        if rank == 0 and s % args.every == 0:
            print(f"step {s} loss {loss.item():.3f} selected {st['selected']} of {st['n']} "
                  f"(k = {round(state.density * st['n'])}) threshold {st['buckets'][0]['threshold']:.4g}",
                  flush=True)
    state.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hook", default="gradcomp:gaussiank:0.001")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--data", default=os.environ.get("GRADCOMP_FASHION_MNIST_DIR", T.DEFAULT_DATA))
    args = p.parse_args()
    if not args.hook.startswith("gradcomp:"):
        p.error("--hook must be a gradcomp hook (gradcomp:SEL[:DENSITY][,KEY=VALUE...])")
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(worker, args=(args, os.path.join(tmp, "store")), nprocs=2)
        except mp.ProcessExitedException:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
