#!/usr/bin/env python3
"""Fashion-MNIST with PyTorch DistributedDataParallel over gloo, with PyTorch's own
communication hooks or gradcomp's, from one command line so that the comparison is honest.

    scripts/train_ddp.sh --hook gradcomp:topk:0.01
    scripts/train_ddp.sh --hook powersgd:4 --model mlp --seed 2

--hook:
    allreduce                 PyTorch's default (fp32 allreduce, averaged)
    fp16                      PyTorch's fp16_compress_hook
    powersgd:R                PyTorch's PowerSGD hook, rank R (start_powerSGD_iter 2)
    gradcomp:SEL[:DENSITY][,KEY=VALUE...]
                              gradcomp.torch.gradcomp_hook with selector SEL, e.g.
                              gradcomp:topk:0.01, gradcomp:dgc:0.001,
                              gradcomp:dense,quantizer=qsgd,bits=4,feedback=none
                              (keys: any GradcompState keyword)

Started with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment (one process per
rank, e.g. `scripts/cluster.sh spawn /usr/bin/python3 examples/torch/train_ddp.py ...` on the
emulated cluster), it runs that one rank instead of spawning --workers processes.

One line per epoch on rank 0, then one JSON line with test_accuracy, bytes_sent_per_worker
(gradcomp's own statistics; for PyTorch's hooks the bytes of the tensors their collectives
were given, the same convention), dense_bytes_per_worker (4 bytes per parameter per step),
step_ms_median and comm_hidden_mean: the mean over steps of the share of the hook's
communication (from each bucket's hand-over to its future's completion) that ran before the
last bucket was handed over, i.e. behind the backward pass.
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

DEFAULT_DATA = "/usr/share/datasets/fashion-mnist"


# ---- data ----------------------------------------------------------------------------------


def read_idx(path: str) -> torch.Tensor:
    """An IDX file (gzip or plain) as a uint8 tensor of its shape."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes")
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims)]
    data = torch.frombuffer(bytearray(raw[4 + 4 * dims :]), dtype=torch.uint8)
    expected = 1
    for d in shape:
        expected *= d
    if data.numel() != expected:
        raise ValueError(f"{path}: holds {data.numel()} bytes of data, its header says {expected}")
    return data.reshape(shape)


def find_file(folder: str, stem: str) -> str:
    for name in (stem + ".gz", stem):
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(
        f"{stem}(.gz) not found in {folder}; install Debian's dataset-fashion-mnist or pass --data"
    )


def load(folder: str, split: str) -> Tuple[torch.Tensor, torch.Tensor]:
    prefix = "train" if split == "train" else "t10k"
    images = read_idx(find_file(folder, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(find_file(folder, f"{prefix}-labels-idx1-ubyte"))
    x = images.to(torch.float32).div_(255.0).sub_(0.2860).div_(0.3530).unsqueeze(1)
    return x, labels.to(torch.int64)


# ---- models --------------------------------------------------------------------------------


class CNN(nn.Module):
    """conv 1->16 5x5, max-pool 2, conv 16->32 5x5, max-pool 2, fc 512->128, fc 128->10."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(512, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


class MLP(nn.Module):
    """784-256-128-10 with ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(784, 256)
        self.fc2 = nn.Linear(256, 128)
        self.fc3 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.relu(self.fc2(x))
        return self.fc3(x)


MODELS: Dict[str, Callable[[], nn.Module]] = {"cnn": CNN, "mlp": MLP}


# ---- hooks ---------------------------------------------------------------------------------

# Bytes of the tensors PyTorch's hooks hand to all_reduce, counted during backward() only
# (PowerSGD issues its second allreduce from a callback, after the hook has returned).
_counted = {"active": False, "bytes": 0}


def _install_byte_counter() -> None:
    original = dist.all_reduce

    def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if _counted["active"]:
            _counted["bytes"] += tensor.numel() * tensor.element_size()
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting_all_reduce  # type: ignore[assignment]


# When each bucket was handed to the hook and when its future completed, for the step in
# progress: the share of communication that ran before the last bucket was handed over (by
# then the backward pass has computed every gradient) is the share it hid.
_timeline = {"spans": [], "last_ready": 0.0, "hidden": []}


def _instrumented(hook: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    # functools.wraps keeps the hook's signature, which DDP checks.
    @functools.wraps(hook)
    def wrapped(state, bucket):  # type: ignore[no-untyped-def]
        start = time.perf_counter()
        if bucket.is_last():
            _timeline["last_ready"] = start
        fut = hook(state, bucket)
        span = [start, start]
        _timeline["spans"].append(span)

        def done(f: Any) -> None:
            span[1] = time.perf_counter()

        fut.then(done)
        return fut

    return wrapped


def _close_step() -> None:
    spans, last = _timeline["spans"], _timeline["last_ready"]
    total = sum(e - s for s, e in spans)
    if total > 0:
        _timeline["hidden"].append(sum(max(0.0, min(e, last) - s) for s, e in spans) / total)
    _timeline["spans"] = []


def parse_value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def make_hook(spec: str, model: nn.Module, steps_per_epoch: int) -> Tuple[Any, Any, Dict[str, Any]]:
    """(state, hook, info) for a --hook spec; info says how to count bytes and momentum."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD

    if spec == "allreduce":
        return None, _instrumented(default_hooks.allreduce_hook), {"counted": True}
    if spec == "fp16":
        return None, _instrumented(default_hooks.fp16_compress_hook), {"counted": True}
    if spec.startswith("powersgd:"):
        rank = int(spec.split(":", 1)[1])
        state = powerSGD.PowerSGDState(
            process_group=None, matrix_approximation_rank=rank, start_powerSGD_iter=2
        )
        return state, _instrumented(powerSGD.powerSGD_hook), {"counted": True}
    if spec.startswith("gradcomp:"):
        import gradcomp.torch as gct

        head, *options = spec[len("gradcomp:") :].split(",")
        parts = head.split(":")
        kwargs: Dict[str, Any] = {"selector": parts[0], "module": model}
        if len(parts) > 1:
            kwargs["density"] = float(parts[1])
        for option in options:
            key, _, value = option.partition("=")
            kwargs[key] = parse_value(value)
        if kwargs.get("warmup_epochs") and "steps_per_epoch" not in kwargs:
            kwargs["steps_per_epoch"] = steps_per_epoch
        state = gct.GradcompState(**kwargs)
        return state, _instrumented(gct.gradcomp_hook), {"counted": False, "gradcomp": state}
    raise ValueError(
        f"unknown --hook {spec!r}; allowed: allreduce, fp16, powersgd:R, gradcomp:SEL[:DENSITY][,KEY=VALUE...]"
    )


# ---- training ------------------------------------------------------------------------------


def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, rank: int, world: int) -> float:
    """Test accuracy over the whole test set, each rank scoring a shard."""
    model.eval()
    correct = torch.zeros(2, dtype=torch.float64)
    with torch.no_grad():
        for at in range(rank * 1000, x.shape[0], 1000 * world):
            logits = model(x[at : at + 1000])
            correct[0] += (logits.argmax(1) == y[at : at + 1000]).sum().item()
            correct[1] += logits.shape[0]
    dist.all_reduce(correct)
    model.train()
    return float(correct[0] / correct[1])


def worker(rank: int, args: argparse.Namespace, store_path: Optional[str], out_path: str) -> None:
    torch.set_num_threads(1)
    # store_path None: started once per host (scripts/cluster.sh spawn), rendezvous through
    # MASTER_ADDR and MASTER_PORT.
    init_method = "env://" if store_path is None else f"file://{store_path}"
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=args.workers)
    _install_byte_counter()
    world = args.workers
    torch.manual_seed(args.seed)  # the same initial model on every rank
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)  # every worker on this GPU (gloo moves CUDA tensors)
    model = MODELS[args.model]().to(device)
    params = sum(p.numel() for p in model.parameters())
    x_train, y_train = (t.to(device) for t in load(args.data, "train"))
    x_test, y_test = (t.to(device) for t in load(args.data, "test"))
    if args.limit:
        x_train, y_train = x_train[: args.limit], y_train[: args.limit]
        x_test, y_test = x_test[: args.limit], y_test[: args.limit]
    per_worker = x_train.shape[0] // world
    steps_per_epoch = per_worker // args.batch

    # DDP's first bucket (after its rebuild) is capped by a separate 1 MB limit.
    dist._DEFAULT_FIRST_BUCKET_BYTES = min(dist._DEFAULT_FIRST_BUCKET_BYTES, int(args.bucket_cap_mb * 1024 * 1024))
    ddp = DDP(model, bucket_cap_mb=args.bucket_cap_mb)
    state, hook, info = make_hook(args.hook, model, steps_per_epoch)
    ddp.register_comm_hook(state, hook)
    gradcomp_state = info.get("gradcomp")
    # DGC applies momentum before compression: the optimizer's own momentum must then be 0.
    dgc = gradcomp_state is not None and gradcomp_state.feedback == "dgc"
    momentum = 0.0 if dgc else args.momentum
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=momentum)

    step_ms: List[float] = []
    picked: List[int] = []
    steps = 0
    start = time.perf_counter()
    lines: List[str] = []
    accuracy = 0.0
    for epoch in range(args.epochs):
        order = torch.randperm(x_train.shape[0], generator=torch.Generator().manual_seed(args.seed * 1000 + epoch))
        mine = order[rank * per_worker : (rank + 1) * per_worker].to(device)
        loss_sum = 0.0
        for s in range(steps_per_epoch):
            idx = mine[s * args.batch : (s + 1) * args.batch]
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp(x_train[idx]), y_train[idx])
            _counted["active"] = info["counted"]
            loss.backward()
            _counted["active"] = False
            opt.step()
            step_ms.append(1000.0 * (time.perf_counter() - t0))
            _close_step()
            if gradcomp_state is not None:
                picked.append(gradcomp_state.stats()["selected"])
            loss_sum += loss.item()
            steps += 1
        accuracy = evaluate(ddp.module, x_test, y_test, rank, world)
        sent = gradcomp_state.stats()["totals"]["bytes_sent"] if gradcomp_state else _counted["bytes"]
        line = (
            f"epoch {epoch + 1} loss {loss_sum / steps_per_epoch:.4f} test_accuracy {accuracy:.4f} "
            f"bytes_sent {sent} ({100.0 * sent / (4.0 * params * steps):.2f}% of dense) "
            f"elapsed {time.perf_counter() - start:.1f}s"
        )
        if gradcomp_state is not None:  # what the selector picked: mean, min, max per step
            line += f" selected {statistics.mean(picked):.0f} [{min(picked)}, {max(picked)}] of {params}"
            picked.clear()
        lines.append(line)
        if rank == 0:
            print(line, flush=True)

    sent = gradcomp_state.stats()["totals"]["bytes_sent"] if gradcomp_state else _counted["bytes"]
    result: Dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "hook": args.hook,
        "workers": world,
        "epochs": args.epochs,
        "seed": args.seed,
        "parameters": params,
        "steps": steps,
        "test_accuracy": round(accuracy, 4),
        "bytes_sent_per_worker": sent,
        "dense_bytes_per_worker": 4 * params * steps,
        "step_ms_median": round(statistics.median(step_ms), 3),
        "seconds": round(time.perf_counter() - start, 2),
    }
    hidden = _timeline["hidden"]
    result["buckets"] = len(gradcomp_state.stats()["buckets"]) if gradcomp_state else None
    result["comm_hidden_mean"] = round(statistics.mean(hidden), 4) if hidden else None
    if gradcomp_state is not None:
        gradcomp_state.close()
    if rank == 0:
        print(json.dumps(result), flush=True)
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hook", default="allreduce")
    p.add_argument("--model", choices=sorted(MODELS), default="cnn")
    p.add_argument("--device", default="cpu",
                   help="where the workers train: cpu, or cuda / cuda:N (every worker on that GPU, over gloo)")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--batch", type=int, default=32, help="per worker")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="DDP's bucket size (its default: 25)")
    p.add_argument("--data", default=os.environ.get("GRADCOMP_FASHION_MNIST_DIR", DEFAULT_DATA))
    p.add_argument("--limit", type=int, default=0, help="use only this many examples (tests)")
    p.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit with status 1 when the final test accuracy is below this (tests)")
    args = p.parse_args(argv)
    if args.workers < 1 or args.epochs < 1 or args.batch < 1:
        p.error("--workers, --epochs and --batch must be >= 1")
    # Refuse a bad --hook before starting workers.
    if not (args.hook in ("allreduce", "fp16") or args.hook.startswith(("powersgd:", "gradcomp:"))):
        p.error(f"unknown --hook {args.hook!r}")
    launched = all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))
    with tempfile.TemporaryDirectory(prefix="gradcomp_ddp_") as tmp:
        out = os.path.join(tmp, "result.json")
        if launched:
            # One rank in this process, as a launcher started it (scripts/cluster.sh spawn runs
            # one per emulated host): --workers is the launcher's WORLD_SIZE.
            args.workers = int(os.environ["WORLD_SIZE"])
            rank = int(os.environ["RANK"])
            worker(rank, args, None, out)
            if rank != 0:
                return 0
        else:
            mp.spawn(worker, args=(args, os.path.join(tmp, "store"), out), nprocs=args.workers)
        with open(out) as f:
            accuracy = json.load(f)["test_accuracy"]
    if accuracy < args.min_accuracy:
        print(f"train_ddp.py: test accuracy {accuracy} is below --min-accuracy {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
