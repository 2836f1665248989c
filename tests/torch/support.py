"""Helpers shared by the gradcomp.torch tests: spawning gloo ranks, making models and data."""

import os
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, store: str, fn: Callable[..., Any], timeout_s: float,
           results: Any, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    try:
        out = fn(rank, world, *args)
        results.put((rank, "ok", out))
    except BaseException as e:  # reported to the parent, which fails the test
        results.put((rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 60.0,
          allow_failure: bool = False) -> Dict[int, Any]:
    """Runs fn(rank, world, *args) on `world` gloo ranks (processes); returns {rank: result}.
    Raises AssertionError naming the rank and its traceback when one fails (unless
    allow_failure, then the failures come back as ("error", text))."""
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="gradcomp_test_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, world, store, fn, timeout_s, results, args))
                 for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=timeout_s * 4 + 60)
            if p.is_alive():
                for q in procs:
                    q.kill()
                raise AssertionError(f"a rank did not finish within {timeout_s * 4 + 60:.0f} s (hang)")
        out: Dict[int, Any] = {}
        while not results.empty():
            rank, status, value = results.get()
            out[rank] = value if status == "ok" else ("error", value)
    if not allow_failure:
        for rank in range(world):
            if rank not in out:
                raise AssertionError(f"rank {rank} exited without a result (exit code {procs[rank].exitcode})")
            if isinstance(out[rank], tuple) and out[rank][:1] == ("error",):
                raise AssertionError(f"rank {rank} failed:\n{out[rank][1]}")
    return out


class Net(torch.nn.Module):
    """Five parameter tensors of different sizes, so that a small bucket_cap_mb splits them
    (after DDP's first iteration, which has one bucket). The layers are registered in the
    reverse of their use, so that registration order and gradient order differ too."""

    def __init__(self) -> None:
        super().__init__()
        self.c = torch.nn.Linear(48, 5, bias=False)
        self.b = torch.nn.Linear(64, 48)
        self.a = torch.nn.Linear(20, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(torch.relu(self.a(x)))))


def batch(rank: int, step: int, n: int = 16) -> List[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(n, 20, generator=g)
    # Heavy-tailed targets: gradients that are not Gaussian.
    y = torch.randn(n, 5, generator=g) ** 3
    return [x, y]
