"""Helpers shared by the gradcomp.torch tests: spawning gloo ranks, making models and data."""

import os
import tempfile
import traceback
from datetime import timedelta
from typing import Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, world: int, store: str, fn: Callable[..., Any], timeout_s: float,
           results: Any, args: tuple, backend: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world,
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


# Ranks are forked from multiprocessing's fork server, which imports torch and the test module
# (the __main__ that calls spawn) once, rather than started with "spawn", which imports them
# again for every rank of every test: most of test_hook.py's time on a 2-core machine. The
# server only imports: it starts no thread and touches no device, so the ranks may use CUDA as
# under "spawn", and each rank still makes its own process group.
_PRELOAD = ["__main__", "torch", "torch.distributed"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the server starts, at the first spawn
    return ctx


def spawn(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float = 60.0,
          allow_failure: bool = False, backend: str = "gloo") -> Dict[int, Any]:
    """Runs fn(rank, world, *args) on `world` ranks (processes) of a `backend` group; returns
    {rank: result}.
    Raises AssertionError naming the rank and its traceback when one fails (unless
    allow_failure, then the failures come back as ("error", text))."""
    ctx = _context()
    results = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory(prefix="gradcomp_test_") as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(r, world, store, fn, timeout_s, results, args, backend))
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


class FakeBucket:
    """What DDP hands a hook (index, buffer, parameters, is_last), for driving the hook
    directly with gradients the test chooses."""

    def __init__(self, index: int, buffer: torch.Tensor, params: List[torch.Tensor], last: bool = True):
        self._index, self._buffer, self._params, self._last = index, buffer, params, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def parameters(self) -> List[torch.Tensor]:
        return self._params

    def gradients(self) -> List[torch.Tensor]:
        return [self._buffer]

    def is_last(self) -> bool:
        return self._last


def grad_for(rank: int, step: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + rank)
    if rank % 2:  # heavy tails on odd ranks, normal on even ones
        return torch.randn(n, generator=g) ** 3
    return torch.randn(n, generator=g)


def same_state(a: Dict[str, Any], b: Dict[str, Any]) -> bool:
    """Whether two GradcompState.state_dict()s are equal, feedback bit for bit."""
    if a["iteration"] != b["iteration"] or a["totals"] != b["totals"] or set(a["feedback"]) != set(b["feedback"]):
        return False
    return all(len(a["feedback"][k]) == len(b["feedback"][k]) and
               all(torch.equal(x, y) for x, y in zip(a["feedback"][k], b["feedback"][k]))
               for k in a["feedback"])


def train(rank: int, world: int, steps: int, cap_bytes: int, state: Any, model: torch.nn.Module,
          opt: torch.optim.Optimizer, first_step: int = 0,
          record: Dict[str, torch.Tensor] = None, device: str = "cpu") -> Any:
    """`steps` DDP steps of `model` (on `device`) with gradcomp's hook and `state`, on batch()
    data; `record` (optional) sums each parameter's local gradients. Returns the DDP model."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcomp.torch as gct

    dist._DEFAULT_FIRST_BUCKET_BYTES = cap_bytes  # DDP caps its rebuilt first bucket by this
    # device_ids=None: the module's own device (CPU, or the one GPU it is on).
    ddp = DDP(model, bucket_cap_mb=cap_bytes / (1024 * 1024))
    names = {id(p): n for n, p in model.named_parameters()}

    def hook(st: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:  # DDP reads it
        if record is not None:
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                record[names[id(p)]] = record.get(names[id(p)], 0) + g.detach().double().cpu()
        return gct.gradcomp_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    for s in range(first_step, first_step + steps):
        x, y = (t.to(device) for t in batch(rank, s))
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return ddp


def fresh(momentum: float, device: str = "cpu", **config: Any) -> Tuple[Any, Any, Any]:
    """The same start every time: Net with seed 0 on `device`, SGD (lr 0.1) and a state at
    density 0.1 keyed by parameter name, with `config` for the rest."""
    import gradcomp.torch as gct

    torch.manual_seed(0)
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum)
    state = gct.GradcompState(density=0.1, module=model, **config)
    return model, opt, state


def straight(rank: int, world: int, make: Callable[[], Tuple[Any, Any, Any]], steps: int, cap: int,
             device: str = "cpu") -> Tuple[List[torch.Tensor], int]:
    """`steps` steps from make(), uninterrupted: the parameters they end with, and how many
    buckets the state saw."""
    model, opt, state = make()
    train(rank, world, steps, cap, state, model, opt, device=device)
    params = [p.detach().clone() for p in model.parameters()]
    buckets = len(state.state_dict()["buckets"])
    state.close()
    return params, buckets


def restore(make: Callable[[], Tuple[Any, Any, Any]], ckpt: Dict[str, Any]) -> Tuple[Any, Any, Any]:
    """make()'s model, optimizer and state with a checkpoint's "model", "opt" and "gradcomp"
    loaded into them, ready to train on."""
    model, opt, state = make()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["gradcomp"])
    return model, opt, state


def failed_step(rank: int, world: int, overlap: bool, device: str = "cpu") -> int:
    """Four steps straight, against three steps and a fourth whose last bucket fails inside
    gradcomp on every rank (as a failed exchange would; on every rank, so that no rank waits
    for another) after the step's other buckets went through: the failed step leaves the
    hook's state as it was, and the retried step, from a checkpoint, is the unfaulted one.
    Returns how many buckets went through before the failure."""
    import copy

    cap = 4096  # several buckets after DDP's first iteration

    def make() -> Tuple[Any, Any, Any]:
        return fresh(0.9, device=device, selector="topk", overlap=overlap)

    unfaulted, _ = straight(rank, world, make, 4, cap, device=device)

    model, opt, state = make()
    ddp = train(rank, world, 3, cap, state, model, opt, device=device)
    before = state.state_dict()
    saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
             "opt": copy.deepcopy(opt.state_dict()), "gradcomp": before}
    run_bucket = state._run_bucket
    exchanged: List[int] = []

    def failing(index: int, buffer: torch.Tensor, params: Any, step: int, is_last: bool) -> torch.Tensor:
        if is_last:
            raise RuntimeError("injected failure of the last bucket's exchange")
        exchanged.append(index)
        return run_bucket(index, buffer, params, step, is_last)

    state._run_bucket = failing
    x, y = (t.to(device) for t in batch(rank, 3))
    opt.zero_grad(set_to_none=True)
    try:
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        raise AssertionError("the step did not fail")
    except RuntimeError as e:
        if "injected failure" not in str(e):
            raise
    if not exchanged:
        raise AssertionError("no bucket went through before the failure: nothing was tested")
    if not same_state(before, state.state_dict()):
        raise AssertionError("the failed step changed the hook's state")
    state.close()

    # The caller checkpoints and retries: the retried step is the unfaulted one.
    model, opt, state = restore(make, saved)
    train(rank, world, 1, cap, state, model, opt, first_step=3, device=device)
    state.close()
    for a, b in zip(unfaulted, model.parameters()):
        if not torch.equal(a, b.detach()):
            raise AssertionError(f"the retried step differs by {(a - b).abs().max().item()}")
    return len(exchanged)
