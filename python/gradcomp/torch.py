"""gradcomp as a DistributedDataParallel communication hook.

Usage, in the convention of PyTorch's PowerSGD hook::

    import gradcomp.torch
    state = gradcomp.torch.GradcompState(process_group=None, selector="topk", density=0.01)
    ddp.register_comm_hook(state, gradcomp.torch.gradcomp_hook)

Every bucket DDP hands to the hook is compressed by gradcomp's C++ policies (selector,
quantizer, error feedback), exchanged over the process group (gloo) by one of gradcomp's
exchanges, and replaced by the mean over ranks of what every rank sent. The work runs on a
thread of the state's own, with the GIL released, so DDP's backward pass goes on meanwhile,
as it does with the default allreduce.

Feedback state (residuals, DGC's momentum) is kept per bucket, and follows its parameters when
DDP rebuilds its buckets after the first iteration. ``state.state_dict()`` and
``state.load_state_dict()`` (and pickling) make a checkpoint from which a run continues
exactly as if it had not stopped.
"""

import concurrent.futures
import threading
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from . import _torch_ext as _ext

__all__ = [
    "GradcompState",
    "gradcomp_hook",
    "SELECTORS",
    "QUANTIZERS",
    "FEEDBACKS",
    "EXCHANGES",
]

SELECTORS: Tuple[str, ...] = (
    "topk", "gaussiank", "gaussiank_published", "randomk", "threshold", "dgc", "dense")
QUANTIZERS: Tuple[str, ...] = ("fp32", "fp16", "bf16", "qsgd", "terngrad", "sign")
FEEDBACKS: Tuple[str, ...] = ("residual", "none", "dgc")
EXCHANGES: Tuple[str, ...] = ("allreduce", "allgather", "gtopk", "a2a", "auto")

# Bucket dtypes compressed through float32 staging (the feedback state is float32).
_STAGED_DTYPES = (torch.float16, torch.bfloat16, torch.float64)

_STATE_DICT_VERSION = 1


def _check_choice(what: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        listed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"gradcomp.torch: unknown {what} {value!r}; allowed: one of {listed}")


class GradcompState:
    """The hook's configuration and state: one per DDP model.

    Args:
        process_group: the group to exchange over (None: the default group). It must have
            the same size at every step as at the first.
        selector: which coordinates are sent: 'topk' (exact top-k of |acc|), 'gaussiank'
            (count in [2k/3, 4k/3], else the exact top-k), 'gaussiank_published' (the
            GaussianK-SGD paper's corrections, count not guaranteed), 'randomk', 'threshold' (needs ``threshold``), 'dgc' (DGC's sampled threshold; its
            feedback is DGC's momentum correction, so the optimizer's momentum must be 0),
            'dense' (every coordinate, e.g. with a quantizer).
        density: fraction of each bucket's coordinates to send, in (0, 1].
        quantizer: 'fp32', 'fp16', 'bf16', 'qsgd' (with ``bits``), 'terngrad', 'sign'.
        feedback: 'residual' (error feedback: what is not sent is added to the next step),
            'none', or 'dgc' (DGC momentum correction with masking; with 'topk' or 'dgc').
            With selector 'dgc' the default 'residual' means 'dgc'.
        exchange: 'allreduce' (dense sum; needs 'dense' or 'randomk' with 'fp32', 'fp16' or
            'bf16'), 'allgather', 'gtopk', 'a2a' (TopKA2A) or 'auto' (the cost model picks).
        seed: seeds the random selectors and stochastic rounding (the same on every rank).
        bits: QSGD's bits per value, 2..16.
        bucket_size: values sharing one scale (qsgd, terngrad, sign).
        threshold: the |value| from which selector 'threshold' sends.
        dgc_momentum, dgc_clip_norm: DGC's momentum and gradient clipping (0: off).
        warmup_epochs, steps_per_epoch: DGC's exponential density warm-up: during epoch
            e < warmup_epochs the density is density ** ((e + 1) / (warmup_epochs + 1)).
        start_iter: iterations that run PyTorch's plain allreduce before compression starts,
            as PowerSGD's ``start_powerSGD_iter``.
        module: the model (or the DDP wrapper). Names its parameters in checkpoints, so that
            a checkpoint is keyed by parameter name; without it, parameters are keyed by
            their position in the buckets DDP formed first.
        overlap: run each bucket on the state's thread (True, default), so that
            communication overlaps the rest of the backward pass; False runs it in the hook.
    """

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        selector: str = "topk",
        density: float = 0.01,
        quantizer: str = "fp32",
        feedback: str = "residual",
        exchange: str = "allgather",
        seed: int = 0,
        *,
        bits: int = 4,
        bucket_size: int = 512,
        threshold: Optional[float] = None,
        dgc_momentum: float = 0.9,
        dgc_clip_norm: float = 0.0,
        warmup_epochs: int = 0,
        steps_per_epoch: Optional[int] = None,
        start_iter: int = 0,
        module: Optional[torch.nn.Module] = None,
        overlap: bool = True,
    ) -> None:
        _check_choice("selector", selector, SELECTORS)
        _check_choice("quantizer", quantizer, QUANTIZERS)
        _check_choice("feedback", feedback, FEEDBACKS)
        _check_choice("exchange", exchange, EXCHANGES)
        if selector == "dgc" and feedback == "residual":
            feedback = "dgc"
        if not isinstance(density, (int, float)) or not (0.0 < float(density) <= 1.0):
            raise ValueError(
                f"gradcomp.torch: density = {density!r} is out of range; allowed: 0 < density <= 1"
            )
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"gradcomp.torch: seed = {seed!r}; allowed: an integer >= 0")
        if warmup_epochs < 0:
            raise ValueError(f"gradcomp.torch: warmup_epochs = {warmup_epochs}; allowed: >= 0")
        if warmup_epochs > 0 and (steps_per_epoch is None or steps_per_epoch < 1):
            raise ValueError(
                "gradcomp.torch: warmup_epochs > 0 needs steps_per_epoch >= 1 "
                f"(got {steps_per_epoch!r})"
            )
        if start_iter < 0:
            raise ValueError(f"gradcomp.torch: start_iter = {start_iter}; allowed: >= 0")

        config = _ext.EngineConfig()
        config.selector = selector
        config.quantizer = quantizer
        config.feedback = feedback
        config.exchange = exchange
        config.bits = int(bits)
        config.bucket_size = int(bucket_size)
        config.threshold = float(threshold) if threshold is not None else 0.0
        config.dgc_momentum = float(dgc_momentum)
        config.dgc_clip_norm = float(dgc_clip_norm)
        config.seed = int(seed)
        _ext.check_config(config)  # ValueError for a bad combination or parameter, now

        self.process_group = process_group
        self.selector = selector
        self.density = float(density)
        self.quantizer = quantizer
        self.feedback = feedback
        self.exchange = exchange
        self.seed = int(seed)
        self.bits = int(bits)
        self.bucket_size = int(bucket_size)
        self.threshold = threshold
        self.dgc_momentum = float(dgc_momentum)
        self.dgc_clip_norm = float(dgc_clip_norm)
        self.warmup_epochs = int(warmup_epochs)
        self.steps_per_epoch = steps_per_epoch
        self.start_iter = int(start_iter)
        self.overlap = bool(overlap)
        self._config = config
        self._module = module
        self._reset_runtime()
        # Progress: survives checkpoints.
        self.iteration = 0  # backward passes seen (counted at the last bucket)
        self.world_size: Optional[int] = None
        self._totals = {"steps": 0, "bytes_sent": 0, "bytes_received": 0, "selected": 0, "elements": 0}
        # Feedback buffers loaded from a checkpoint or left by DDP's rebuild, keyed by
        # parameter, waiting for the bucket that now holds the parameter.
        self._pending: Dict[str, List[torch.Tensor]] = {}
        # The buckets (parameter keys by bucket index) of the run a checkpoint came from.
        self._resume_groups: Dict[int, List[str]] = {}

    # ---- runtime (not part of a checkpoint) -----------------------------------------

    def _reset_runtime(self) -> None:
        self._engine: Optional[Any] = None
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._layouts: Dict[int, Tuple[Tuple[int, int], ...]] = {}
        self._owner: Dict[int, int] = {}  # id(parameter) -> the bucket index holding it
        self._keys: Dict[int, str] = {}  # id(parameter) -> checkpoint key
        self._lock = threading.Lock()
        self._last: Dict[int, Dict[str, Any]] = {}
        self._timeline: List[Tuple[float, float]] = []  # (start, end) of each bucket's work
        # The buckets' statistics of the iteration in flight, counted once it has succeeded.
        self._iteration_stats: List[Dict[str, Any]] = []
        self._last_ready = 0.0  # when DDP handed over the last bucket of the backward pass
        self._last_overlap: Optional[float] = None
        self.rebuilds = 0  # times DDP re-formed the buckets and the feedback followed

    def _group(self) -> dist.ProcessGroup:
        return self.process_group if self.process_group is not None else dist.group.WORLD

    def _ensure_engine(self) -> Any:
        group = self._group()
        size = dist.get_world_size(group)
        if self.world_size is None:
            self.world_size = size
        elif size != self.world_size:
            raise ValueError(
                f"gradcomp.torch: the process group has {size} ranks, but this state was "
                f"registered (or checkpointed) with {self.world_size}; allowed: a group of "
                f"{self.world_size} ranks"
            )
        if self._engine is None:
            self._engine = _ext.Engine(self._exchange_group(group), self._config)
            if self._module is not None:
                for name, p in self._module.named_parameters():
                    self._keys[id(p)] = _strip_ddp_prefix(name)
        return self._engine

    def _exchange_group(self, group: dist.ProcessGroup) -> dist.ProcessGroup:
        """The group the exchanges run over. DDP issues collectives of its own on its group
        (find_unused_parameters' allreduce right after the last bucket, buffer broadcasts),
        from the autograd thread, while the state's thread may still exchange buckets: gloo
        matches collectives by the order in which they are issued, so the two threads would
        interleave differently on different ranks. With the default group, the state makes a
        group of its own over the same ranks (every rank reaches this at its first bucket).
        A group passed as process_group is used as it is: it must not be DDP's."""
        if self.process_group is not None:
            return group
        try:
            timeout = dist.distributed_c10d._get_default_store().timeout
        except Exception:
            timeout = dist.default_pg_timeout
        return dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timeout, backend="gloo")

    def _density_at(self, step: int) -> float:
        if self.warmup_epochs == 0:
            return self.density
        epoch = step // int(self.steps_per_epoch or 1)
        if epoch >= self.warmup_epochs:
            return self.density
        return self.density ** ((epoch + 1) / (self.warmup_epochs + 1))

    # ---- buckets and their parameters ----------------------------------------------

    def _key(self, p: torch.Tensor, bucket: int, position: int) -> str:
        key = self._keys.get(id(p))
        if key is None:
            key = f"bucket{bucket}.param{position}"
            self._keys[id(p)] = key
        return key

    def _prepare_bucket(self, engine: Any, index: int, params: List[torch.Tensor], n: int) -> None:
        """Make the engine's state for bucket `index` follow its parameters. Everything is
        built and checked first; nothing changes when it raises."""
        layout = tuple((id(p), p.numel()) for p in params)
        if self._layouts.get(index) == layout:
            return
        if sum(numel for _, numel in layout) != n:
            raise ValueError(
                f"gradcomp.torch: bucket {index} holds {n} elements but its parameters "
                f"{sum(numel for _, numel in layout)}"
            )
        # DDP rebuilt its buckets when this index now holds other parameters, or these
        # parameters were in another bucket: then every parameter's feedback is released to
        # the pending pool, from which the new buckets take theirs.
        rebuild = index in self._layouts or any(self._owner.get(pid, index) != index for pid, _ in layout)
        pending = dict(self._pending)
        if rebuild:
            pending.update(self._released(engine))
        keys = [self._key(p, index, j) for j, p in enumerate(params)]
        buffers = None
        if engine.buffer_count > 0:
            buffers = []
            for b in range(engine.buffer_count):
                parts = []
                for k, p in zip(keys, params):
                    saved = pending.get(k)
                    if saved is not None and saved[b].numel() != p.numel():
                        raise ValueError(
                            f"gradcomp.torch: checkpoint entry {k!r} has {saved[b].numel()} "
                            f"elements, the parameter has {p.numel()}"
                        )
                    parts.append(saved[b] if saved is not None else torch.zeros(p.numel(), dtype=torch.float32))
                buffers.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32))
        # Commit.
        if rebuild:
            self._layouts.clear()
            self._owner.clear()
            engine.clear()
            self.rebuilds += 1
        if buffers is not None:
            engine.set_state(index, buffers)
        for k in keys:
            pending.pop(k, None)
        self._pending = pending
        self._layouts[index] = layout
        for pid, _ in layout:
            self._owner[pid] = index

    def _released(self, engine: Any) -> Dict[str, List[torch.Tensor]]:
        """Every bucket's feedback buffers, split by parameter (nothing changes)."""
        out: Dict[str, List[torch.Tensor]] = {}
        for index, layout in self._layouts.items():
            state = engine.state(index)
            if not state:
                continue
            at = 0
            for pid, numel in layout:
                out[self._keys[pid]] = [b[at : at + numel].clone() for b in state]
                at += numel
        return out

    # ---- the work of one bucket -------------------------------------------------------

    def _groups_for(self, params: List[torch.Tensor], index: int) -> Optional[List[Tuple[int, List[int]]]]:
        """After a checkpoint was loaded: DDP's first iteration puts every parameter in one
        bucket, while the run that saved the checkpoint had rebuilt buckets. To continue exactly
        as it would have, such a bucket is compressed as the saved buckets were: a list of
        (saved bucket index, positions of its parameters in this bucket). None when this bucket
        is compressed whole (it is one of the saved buckets, or nothing was saved)."""
        if not self._resume_groups:
            return None
        keys = [self._key(p, index, j) for j, p in enumerate(params)]
        if self._resume_groups.get(index) == keys:
            return None
        where = {k: j for j, k in enumerate(keys)}
        groups = []
        covered = 0
        for g_index in sorted(self._resume_groups):
            g_keys = self._resume_groups[g_index]
            if g_keys and all(k in where for k in g_keys):
                groups.append((g_index, [where[k] for k in g_keys]))
                covered += len(g_keys)
        if covered != len(keys) or len(groups) < 2:
            return None
        return groups

    def _run_bucket(
        self, index: int, buffer: torch.Tensor, params: List[torch.Tensor], step: int, is_last: bool
    ) -> torch.Tensor:
        # Runs on the state's thread (or in the hook): the engine is only touched from here,
        # and from state_dict()/load_state_dict() once the thread is idle.
        start = time.perf_counter()
        engine = self._engine
        staged = buffer if buffer.dtype == torch.float32 else buffer.to(torch.float32)
        density = self._density_at(step)
        groups = self._groups_for(params, index)
        if groups is None:
            self._prepare_bucket(engine, index, params, buffer.numel())
            results = [engine.run(index, staged, step, density)]
        else:
            offsets = [0]
            for p in params:
                offsets.append(offsets[-1] + p.numel())
            results = []
            for g_index, positions in groups:
                part = torch.cat([staged[offsets[j] : offsets[j + 1]] for j in positions])
                self._prepare_bucket(engine, g_index, [params[j] for j in positions], part.numel())
                results.append(engine.run(g_index, part, step, density))
                at = 0
                for j in positions:
                    n = offsets[j + 1] - offsets[j]
                    staged[offsets[j] : offsets[j + 1]].copy_(part[at : at + n])
                    at += n
        if staged is not buffer:
            buffer.copy_(staged)
        end = time.perf_counter()
        with self._lock:
            self._iteration_stats.extend(results)
            self._timeline.append((start, end))
            if is_last:
                # Every bucket of the iteration succeeded: keep their new feedback state and
                # count them. Until now a failure would have changed nothing.
                engine.commit()
                for stats in self._iteration_stats:
                    self._last[stats["bucket"]] = stats
                    self._totals["bytes_sent"] += stats["bytes_sent"]
                    self._totals["bytes_received"] += stats["bytes_received"]
                    self._totals["selected"] += stats["selected"]
                    self._totals["elements"] += stats["n"]
                self._iteration_stats = []
                self._finish_iteration()
        if is_last:
            self._check_pending()
        return buffer

    def _abandon_iteration(self, step: int) -> None:
        # A bucket of iteration `step` failed: its buckets' new feedback state and statistics
        # are forgotten, and a retry runs the iteration again from where it started.
        self.iteration = min(self.iteration, step)
        with self._lock:
            if self._engine is not None:
                self._engine.discard()
            self._iteration_stats = []
            self._timeline = []

    def _check_pending(self) -> None:
        if self._pending:
            names = sorted(self._pending)
            raise ValueError(
                f"gradcomp.torch: {len(names)} checkpoint entries matched no parameter of the "
                f"buckets of a whole step (first: {names[0]!r}); a checkpoint keyed by parameter "
                "name needs module=model (or state.attach_module(model) after unpickling)"
            )

    def _finish_iteration(self) -> None:
        # Overlap: the part of the bucket work that ran before DDP handed over the last bucket
        # (by then the backward pass has computed every gradient).
        total = sum(e - s for s, e in self._timeline)
        hidden = sum(max(0.0, min(e, self._last_ready) - s) for s, e in self._timeline)
        self._last_overlap = hidden / total if total > 0 else None
        self._timeline = []
        self._totals["steps"] += 1

    # ---- statistics ---------------------------------------------------------------------

    def stats(self) -> Dict[str, Any]:
        """The last step per bucket, and totals since the start (or the checkpoint)."""
        with self._lock:
            buckets = [dict(self._last[i]) for i in sorted(self._last)]
            totals = dict(self._totals)
            overlap = self._last_overlap
        selected = sum(b["selected"] for b in buckets)
        n = sum(b["n"] for b in buckets)
        return {
            "iteration": self.iteration,
            "buckets": buckets,
            "selected": selected,
            "n": n,
            "density": selected / n if n else 0.0,
            "bytes_sent": sum(b["bytes_sent"] for b in buckets),
            "bytes_received": sum(b["bytes_received"] for b in buckets),
            "overlap": overlap,
            "totals": totals,
        }

    # ---- checkpoints ----------------------------------------------------------------------

    def _config_dict(self) -> Dict[str, Any]:
        return {
            "selector": self.selector,
            "density": self.density,
            "quantizer": self.quantizer,
            "feedback": self.feedback,
            "exchange": self.exchange,
            "seed": self.seed,
            "bits": self.bits,
            "bucket_size": self.bucket_size,
            "threshold": self.threshold,
            "dgc_momentum": self.dgc_momentum,
            "dgc_clip_norm": self.dgc_clip_norm,
            "warmup_epochs": self.warmup_epochs,
            "steps_per_epoch": self.steps_per_epoch,
            "start_iter": self.start_iter,
            "overlap": self.overlap,
        }

    def state_dict(self) -> Dict[str, Any]:
        """Everything a resumed run needs: iteration, feedback per parameter, totals."""
        self._wait_idle()
        feedback: Dict[str, List[torch.Tensor]] = {k: [b.clone() for b in v] for k, v in self._pending.items()}
        if self._engine is not None:
            for index, layout in self._layouts.items():
                state = self._engine.state(index)
                at = 0
                for pid, numel in layout:
                    if state:
                        feedback[self._keys[pid]] = [b[at : at + numel].clone() for b in state]
                    at += numel
        return {
            "version": _STATE_DICT_VERSION,
            "config": self._config_dict(),
            "iteration": self.iteration,
            "world_size": self.world_size,
            "feedback": feedback,
            # The buckets in use, or (nothing run since a checkpoint was loaded) those it had.
            "buckets": {index: [self._keys[pid] for pid, _ in layout] for index, layout in self._layouts.items()}
            or {i: list(keys) for i, keys in self._resume_groups.items()},
            "totals": dict(self._totals),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores a checkpoint made by state_dict() with the same configuration."""
        if state.get("version") != _STATE_DICT_VERSION:
            raise ValueError(
                f"gradcomp.torch: checkpoint version {state.get('version')!r}; this build reads "
                f"version {_STATE_DICT_VERSION}"
            )
        ours = self._config_dict()
        for key in ("selector", "quantizer", "feedback", "exchange", "bits", "bucket_size"):
            if state["config"].get(key) != ours[key]:
                raise ValueError(
                    f"gradcomp.torch: the checkpoint was made with {key} = "
                    f"{state['config'].get(key)!r}, this state has {ours[key]!r}"
                )
        if self.world_size is not None and state["world_size"] not in (None, self.world_size):
            raise ValueError(
                f"gradcomp.torch: the checkpoint was made with {state['world_size']} ranks, this "
                f"state's group has {self.world_size}; allowed: a group of the same size"
            )
        try:
            pending = {
                str(k): [torch.as_tensor(b).detach().to(torch.float32).flatten().clone() for b in v]
                for k, v in state["feedback"].items()
            }
            resume_groups = {int(i): [str(k) for k in keys] for i, keys in state.get("buckets", {}).items()}
            iteration = int(state["iteration"])
            totals = {k: int(state["totals"][k]) for k in self._totals}
            world_size = state["world_size"]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"gradcomp.torch: malformed checkpoint ({type(e).__name__}: {e}); the state is unchanged") from e
        if iteration < 0:
            raise ValueError(f"gradcomp.torch: checkpoint iteration {iteration}; allowed: >= 0")
        self._wait_idle()
        if self._engine is not None:
            self._engine.clear()
        self._layouts.clear()
        self._owner.clear()
        self._pending = pending
        self._resume_groups = resume_groups
        self.iteration = iteration
        self.world_size = world_size
        self._totals = totals
        self._last = {}

    def attach_module(self, module: torch.nn.Module) -> None:
        """Names the parameters by `module` (as module= does): needed after unpickling a state
        whose checkpoint is keyed by parameter name, before its first step."""
        self._module = module
        if self._engine is not None:
            for name, p in module.named_parameters():
                self._keys[id(p)] = _strip_ddp_prefix(name)

    def __getstate__(self) -> Dict[str, Any]:
        # As PowerSGD's state: the process group and the threads do not travel.
        return {"config": self._config_dict(), "state": self.state_dict()}

    def __setstate__(self, pickled: Dict[str, Any]) -> None:
        self.__init__(process_group=None, **pickled["config"])  # type: ignore[misc]
        self.load_state_dict(pickled["state"])

    def _wait_idle(self) -> None:
        if self._executor is not None:
            self._executor.submit(lambda: None).result()

    def close(self) -> None:
        """Stops the state's thread (also done when the state is garbage-collected)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _strip_ddp_prefix(name: str) -> str:
    return name[len("module.") :] if name.startswith("module.") else name


def _allreduce_mean(group: dist.ProcessGroup, buffer: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    world = dist.get_world_size(group)
    tensor = buffer.div_(world)
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def gradcomp_hook(state: GradcompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``ddp.register_comm_hook(state, gradcomp_hook)``."""
    buffer = bucket.buffer()
    if buffer.device.type != "cpu":
        raise RuntimeError(
            f"gradcomp.torch: the bucket is dtype {buffer.dtype}, device {buffer.device}, layout "
            f"{buffer.layout}; this build of gradcomp has no "
            "device path for the hook (CPU tensors only). Train on CPU with gloo, or register "
            "PyTorch's own hooks for CUDA models."
        )
    if buffer.layout != torch.strided or not buffer.is_contiguous():
        raise ValueError(
            f"gradcomp.torch: the bucket is dtype {buffer.dtype}, device {buffer.device}, layout "
            f"{buffer.layout}, contiguous={buffer.is_contiguous()}; allowed: a contiguous strided "
            "CPU tensor"
        )
    if buffer.dtype not in (torch.float32,) + _STAGED_DTYPES:
        raise ValueError(
            f"gradcomp.torch: the bucket is dtype {buffer.dtype}, device {buffer.device}, layout "
            f"{buffer.layout}; allowed dtypes: float32, and float16, bfloat16, float64 "
            "(compressed through float32)"
        )
    index = bucket.index()
    is_last = bucket.is_last()
    state._ensure_engine()
    step = state.iteration
    if is_last:
        state.iteration += 1
    if step < state.start_iter:
        return _allreduce_mean(state._group(), buffer)

    params = list(bucket.parameters())
    if is_last:
        state._last_ready = time.perf_counter()
    if not state.overlap:
        fut: "torch.futures.Future[torch.Tensor]" = torch.futures.Future()
        try:
            fut.set_result(state._run_bucket(index, buffer, params, step, is_last))
        except BaseException:
            state._abandon_iteration(step)  # nothing of the step is kept; a retry runs it again
            raise
        return fut

    if state._executor is None:
        state._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="gradcomp-hook"
        )
    fut = torch.futures.Future()

    def work() -> None:
        try:
            fut.set_result(state._run_bucket(index, buffer, params, step, is_last))
        except BaseException as e:  # the training loop sees it when DDP waits on the future
            state._abandon_iteration(step)  # nothing of the step is kept; a retry runs it again
            fut.set_exception(e)

    state._executor.submit(work)
    return fut
