"""The hook's configuration: one frozen dataclass, checked whole when it is made.

The policy names and every rule about them (ranges, combinations) live in C++
(``include/gradcomp/runtime/registry.hpp``); this module checks the Python types of the
arguments, so that ``density="0.01"`` is a TypeError naming the field, then hands the values to
the registry's check, which raises ValueError in the same words as the C++ side.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .. import _torch_ext as _ext

SELECTORS: Tuple[str, ...] = tuple(_ext.SELECTORS)
QUANTIZERS: Tuple[str, ...] = tuple(_ext.QUANTIZERS)
FEEDBACKS: Tuple[str, ...] = tuple(_ext.FEEDBACKS)
EXCHANGES: Tuple[str, ...] = tuple(_ext.EXCHANGES)

# Fields that change what a step computes: a checkpoint must have been made with the same.
# `overlap` only changes where the work runs.
RESULT_FIELDS: Tuple[str, ...] = (
    "selector", "density", "quantizer", "feedback", "exchange", "seed", "bits", "bucket_size",
    "threshold", "dgc_momentum", "dgc_clip_norm", "warmup_epochs", "steps_per_epoch",
    "start_iter")


def _type_error(field: str, value: Any, allowed: str) -> TypeError:
    return TypeError(f"gradcomp: {field} = {value!r} is a {type(value).__name__}; allowed: {allowed}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool))


@dataclass(frozen=True)
class GradcompConfig:
    """What the hook does: GradcompState's arguments but the group and the module.

    Args:
        selector: which coordinates are sent: 'topk' (exact top-k of |acc|), 'gaussiank'
            (count in [2k/3, 4k/3], else the exact top-k), 'gaussiank_published' (the
            GaussianK-SGD paper's corrections, count not guaranteed), 'randomk', 'threshold'
            (needs ``threshold``), 'redsync' (RedSync's threshold bisection), 'dgc' (DGC's
            sampled threshold; its feedback is DGC's momentum correction, so the optimizer's
            momentum must be 0),
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
        overlap: run each bucket on the state's thread (True, default), so that
            communication overlaps the rest of the backward pass; False runs it in the hook.
        nonfinite: what a NaN or Inf gradient on any rank does, agreed by every rank before the
            bucket is exchanged: 'raise' (default: backward() raises RuntimeError on every
            rank, naming the parameter and bucket (and, on the other ranks, the failing rank),
            and no feedback state changes) or 'skip' (every
            rank gets the step's buckets from that one on as NaN, as an allreduce would give
            them, and no feedback state or step count changes: skip the optimizer's step, as
            torch.cuda.amp.GradScaler does on its own; ``state.skipped_steps`` counts them).
    """

    selector: str = "topk"
    density: float = 0.01
    quantizer: str = "fp32"
    feedback: str = "residual"
    exchange: str = "allgather"
    seed: int = 0
    bits: int = 4
    bucket_size: int = 512
    threshold: Optional[float] = None
    dgc_momentum: float = 0.9
    dgc_clip_norm: float = 0.0
    warmup_epochs: int = 0
    steps_per_epoch: Optional[int] = None
    start_iter: int = 0
    overlap: bool = True
    nonfinite: str = "raise"

    def __post_init__(self) -> None:
        for field in ("selector", "quantizer", "feedback", "exchange"):
            value = getattr(self, field)
            if not isinstance(value, str):
                raise _type_error(field, value, "a name (str)")
        for field in ("density", "dgc_momentum", "dgc_clip_norm"):
            value = getattr(self, field)
            if not _is_real(value):
                raise _type_error(field, value, "a number (int or float)")
        if self.threshold is not None and not _is_real(self.threshold):
            raise _type_error("threshold", self.threshold, "a number, or None")
        for field in ("seed", "bits", "bucket_size", "warmup_epochs", "start_iter"):
            value = getattr(self, field)
            if not _is_int(value):
                raise _type_error(field, value, "an integer")
        if self.steps_per_epoch is not None and not _is_int(self.steps_per_epoch):
            raise _type_error("steps_per_epoch", self.steps_per_epoch, "an integer, or None")
        if not isinstance(self.overlap, bool):
            raise _type_error("overlap", self.overlap, "True or False")
        if not isinstance(self.nonfinite, str):
            raise _type_error("nonfinite", self.nonfinite, "'raise' or 'skip'")
        if self.nonfinite not in ("raise", "skip"):
            raise ValueError(f"gradcomp: nonfinite = {self.nonfinite!r} is not allowed; allowed: 'raise', 'skip'")
        # Selector 'dgc' goes with DGC's momentum correction: the default feedback means it.
        if self.selector == "dgc" and self.feedback == "residual":
            object.__setattr__(self, "feedback", "dgc")
        for field in ("seed", "bits", "bucket_size", "warmup_epochs", "start_iter"):
            value = getattr(self, field)
            if value < 0:
                raise ValueError(f"gradcomp: {field} = {value!r} is not allowed; allowed: an integer >= 0")
        if self.warmup_epochs > 0 and (self.steps_per_epoch is None or self.steps_per_epoch < 1):
            raise ValueError(
                f"gradcomp: steps_per_epoch = {self.steps_per_epoch!r} is not allowed; "
                "allowed: an integer >= 1 (warmup_epochs > 0 needs it)")
        _ext.check_config(self.engine_config())  # ValueError in the registry's words

    def engine_config(self) -> Any:
        """The C++ engine's configuration (gradcomp::runtime::engine_config)."""
        c = _ext.EngineConfig()
        c.selector = self.selector
        c.quantizer = self.quantizer
        c.feedback = self.feedback
        c.exchange = self.exchange
        c.bits = self.bits
        c.bucket_size = self.bucket_size
        c.threshold = float(self.threshold) if self.threshold is not None else None
        c.dgc_momentum = float(self.dgc_momentum)
        c.dgc_clip_norm = float(self.dgc_clip_norm)
        c.seed = self.seed
        c.density = float(self.density)
        c.warmup_epochs = self.warmup_epochs
        # steps_per_epoch only matters with a warm-up (and is checked then).
        c.steps_per_epoch = self.steps_per_epoch if self.warmup_epochs > 0 and self.steps_per_epoch else 1
        c.skip_nonfinite = self.nonfinite == "skip"
        return c

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)
