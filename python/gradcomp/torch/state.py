"""GradcompState: the hook's configuration, its engine and thread, and what a step leaves.

The configuration is a GradcompConfig (config.py), the feedback's bucket tracking a
BucketFeedback (buckets.py), the statistics a StepStats (stats.py), the process groups in
groups.py; checkpoints are made and checked in checkpoint.py, and the hook function is in
hook.py.
"""

import concurrent.futures
import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from .. import _torch_ext as _ext
from . import checkpoint, errors, groups
from .buckets import BucketFeedback
from .config import GradcompConfig
from .stats import StepStats


class GradcompState:
    """The hook's configuration and state: one per DDP model.

    The arguments are GradcompConfig's (config.py documents each), and:
        process_group: the group to exchange over (None: the default group, every rank of
            which must then run the hook). It must have the same size at every step as at the
            first. DDP on a subgroup needs a group of its ranks (None: refused if module=DDP).
        module: the model (or the DDP wrapper). Names its parameters in checkpoints, so that
            a checkpoint is keyed by parameter name; without it, parameters are keyed by
            their position in the buckets DDP formed first.
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
        nonfinite: str = "raise",
    ) -> None:
        groups.check(process_group)
        self.config = GradcompConfig(
            selector=selector, density=density, quantizer=quantizer, feedback=feedback,
            exchange=exchange, seed=seed, bits=bits, bucket_size=bucket_size, threshold=threshold,
            dgc_momentum=dgc_momentum, dgc_clip_norm=dgc_clip_norm, warmup_epochs=warmup_epochs,
            steps_per_epoch=steps_per_epoch, start_iter=start_iter, overlap=overlap,
            nonfinite=nonfinite)
        self._config = self.config.engine_config()
        self.process_group = process_group
        self._module = module
        self._reset_runtime()
        # The group the exchanges run on, made now where torch.distributed is up (every rank
        # makes its state, so every rank of the default group takes part), else at the first
        # bucket; close() destroys it.
        self._own_group: Optional[dist.ProcessGroup] = None
        # Not when unpickled or copied (__setstate__): new_group is collective, and a copy is
        # made on one rank.
        if dist.is_available() and dist.is_initialized() and not self.__dict__.pop("_restoring", False):
            self._own_group = groups.make_own_group(process_group, module)
        # Progress: survives checkpoints (with the statistics' totals).
        self.iteration = 0  # backward passes seen (counted at the last bucket)
        self.world_size: Optional[int] = None

    def __getattr__(self, name: str) -> Any:
        # The configuration's fields read as the state's own (state.density, state.selector).
        config = self.__dict__.get("config")
        if config is not None and name in GradcompConfig.__dataclass_fields__:
            return getattr(config, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- runtime (not part of a checkpoint) -----------------------------------------

    def _reset_runtime(self) -> None:
        self._engine: Optional[Any] = None
        self._device: Optional[torch.device] = None  # the buckets' device, set with the engine
        self._executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._buckets = BucketFeedback()
        self._stats = StepStats()
        # nonfinite='skip': the step whose buckets come back as NaN (every rank agreed), and
        # how many steps were skipped so.
        self._skipping_step: Optional[int] = None
        # The step of a bucket that failed, while the step's other buckets come in.
        self._failing_step: Optional[int] = None
        self._skipped_steps = 0
        self._last_skipped = False

    @property
    def skipped_steps(self) -> int:
        """Steps skipped on every rank for a non-finite gradient (nonfinite='skip')."""
        return self._skipped_steps

    @property
    def last_step_skipped(self) -> bool:
        """Whether the last backward pass's buckets came back as NaN (nonfinite='skip')."""
        return self._last_skipped

    @property
    def rebuilds(self) -> int:
        """Times DDP re-formed the buckets and the feedback followed."""
        return self._buckets.rebuilds

    def _group(self) -> dist.ProcessGroup:
        return groups.group_of(self.process_group)

    def _ensure_engine(self, device: Optional[torch.device] = None) -> Any:
        """The engine, made at the first bucket for the device the buckets are on (None: CPU);
        every later bucket must be on the same device."""
        device = torch.device("cpu") if device is None else device
        group = self._group()
        size = dist.get_world_size(group)
        if self.world_size is None:
            self.world_size = size
        elif size != self.world_size:
            raise ValueError(
                f"gradcomp: the process group has {size} ranks, but this state was "
                f"registered (or checkpointed) with {self.world_size}; allowed: a group of "
                f"{self.world_size} ranks"
            )
        if self._engine is None:
            if device.type == "cuda":
                self._engine = _ext.CudaEngine(self._exchange_group(), self._config,
                                               torch.cuda.current_device() if device.index is None
                                               else device.index)
            else:
                self._engine = _ext.Engine(self._exchange_group(), self._config)
            self._device = device
            if self._module is not None:
                self._buckets.name_parameters(self._module)
        elif device != self._device:
            raise ValueError(
                f"gradcomp: the bucket is on {device}, but this state's buckets have been on "
                f"{self._device}; allowed: {self._device} (one state per model, on one device)")
        return self._engine

    def _exchange_group(self) -> dist.ProcessGroup:
        """The group the exchanges run over (groups.py says why it is not always DDP's)."""
        if not groups.is_default_group(self.process_group):
            return self._group()
        if self._own_group is None:
            self._own_group = groups.make_own_group(self.process_group, self._module)
        assert self._own_group is not None
        return self._own_group

    # ---- the work of one bucket -------------------------------------------------------

    def _run_bucket(
        self, index: int, buffer: torch.Tensor, params: List[torch.Tensor], step: int, is_last: bool
    ) -> torch.Tensor:
        # Runs on the state's thread (or in the hook): the engine is only touched from here,
        # and from state_dict()/load_state_dict() once the thread is idle.
        start = time.perf_counter()
        engine = self._engine
        staged = buffer if buffer.dtype == torch.float32 else buffer.to(torch.float32)
        if buffer.device.type == "cuda":
            # gradcomp's kernels go on the stream torch's operations use here (the bucket's).
            engine.set_stream(torch.cuda.current_stream(buffer.device).cuda_stream)
        density = self._config.density_at(step)
        if self._failing_step == step:
            # An earlier bucket of this step failed on every rank (the engine's agreement told
            # each of them): the rest of the step fails too, on every rank, without an
            # exchange, and nothing of it is kept.
            if is_last:
                self._failing_step = None
            raise RuntimeError(
                f"gradcomp: bucket {index} of step {step} was not run: an earlier bucket "
                "of this step failed (its error was raised first)")
        if self._skipping_step == step:
            # nonfinite='skip': an earlier bucket of this step was skipped on every rank; so is
            # this one, on every rank, without an exchange.
            staged.fill_(float("nan"))
            results: List[Dict[str, Any]] = []
        else:
            try:
                results = self._buckets.run(engine, index, staged, params, step, density)
            except FloatingPointError as e:  # the engine named the parameter (labels)
                raise FloatingPointError(errors.ours(str(e))) from None
            if any(r.get("skipped") for r in results):
                self._skipping_step = step
                results = []
        if staged is not buffer:
            buffer.copy_(staged)
        end = time.perf_counter()
        if is_last and self._skipping_step == step:
            # The step was skipped on every rank: nothing of it is kept, and the next backward
            # pass runs as this one's step number again.
            self._abandon_iteration(step)
            self._skipping_step = None
            self._skipped_steps += 1
            self._last_skipped = True
            return buffer
        if is_last:
            # Before anything is kept: a checkpoint whose entries matched no parameter.
            self._buckets.check_pending()
        self._stats.stage(results, start, end)
        if is_last:
            # Every bucket of the iteration succeeded: keep their new feedback state and count
            # them. Until now a failure would have changed nothing.
            engine.commit()
            self._last_skipped = False
            self._stats.commit()
            self._buckets.drop_unused(engine)  # frees memory only: the step is kept already
        return buffer

    def _abandon_iteration(self, step: int, is_last: bool = True) -> None:
        # A bucket of iteration `step` failed: its buckets' new feedback state and statistics
        # are forgotten, and a retry runs the iteration again from where it started. The
        # step's later buckets fail as well (_run_bucket), so that none of them commits.
        self.iteration = min(self.iteration, step)
        self._skipping_step = None
        self._failing_step = None if is_last else step
        if self._engine is not None:
            self._engine.discard()
        self._buckets.forget_step()
        self._stats.discard()

    def stats(self) -> Dict[str, Any]:
        """The last step per bucket, and totals since the start (or the checkpoint): "iteration",
        "buckets" (each bucket's engine figures), "selected", "n", "density", "bytes_sent",
        "bytes_received", "overlap" (the share of the bucket work done during the backward
        pass, None before a step) and "totals"."""
        return self._stats.summary(self.iteration)

    # ---- checkpoints ----------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Everything a resumed run needs: iteration, feedback per parameter, totals. Plain
        values and CPU tensors: torch.load(path, weights_only=True) reads it back."""
        self._wait_idle()
        return checkpoint.make(self.config, self.iteration, self.world_size,
                               self._buckets.feedback(self._engine), self._buckets.buckets(),
                               self._stats.totals())

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restores a checkpoint made by state_dict() with the same configuration. Every field
        is checked first (ValueError naming it); nothing changes when it raises."""
        loaded = checkpoint.parse(state, self.config, self.world_size,
                                  _ext.buffer_count(self._config))
        self._wait_idle()
        self._buckets.load(self._engine, loaded.feedback, loaded.buckets)
        self.iteration = loaded.iteration
        self.world_size = loaded.world_size
        self._stats.restore(loaded.totals)

    def attach_module(self, module: torch.nn.Module) -> None:
        """Names the parameters by `module` (as module= does): needed after unpickling a state
        whose checkpoint is keyed by parameter name. Between steps, also after a step refused
        the checkpoint's entries for want of it: the buckets take them at the next step."""
        self._wait_idle()
        self._module = module
        if self._engine is not None:
            self._buckets.name_parameters(module, self._engine)

    def __getstate__(self) -> Dict[str, Any]:
        # As PowerSGD's state: the process group and the threads do not travel.
        return {"config": self.config.as_dict(), "state": self.state_dict()}

    def __setattr__(self, name: str, value: Any) -> None:
        if name in GradcompConfig.__dataclass_fields__ and "config" in self.__dict__:
            raise AttributeError(f"gradcomp: {name} is part of the state's configuration, "
                                 "which is fixed; make a new GradcompState to change it")
        object.__setattr__(self, name, value)

    def __setstate__(self, pickled: Dict[str, Any]) -> None:
        self.__dict__["_restoring"] = True
        self.__init__(process_group=None, **pickled["config"])  # type: ignore[misc]
        self.load_state_dict(pickled["state"])

    def _wait_idle(self) -> None:
        if self._executor is not None:
            self._executor.submit(lambda: None).result()

    def close(self) -> None:
        """Stops the state's thread (also done when the state is garbage-collected) and
        destroys the group the state made. Collective where it made one: every rank closes."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        group = self.__dict__.get("_own_group")
        if group is not None:
            self._engine = None  # the engine holds the group
            self._own_group = None
            if dist.is_initialized():
                dist.destroy_process_group(group)
