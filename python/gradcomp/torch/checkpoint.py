"""The hook's checkpoints: what GradcompState.state_dict() holds, and the whole check of one
before load_state_dict() changes anything.

A checkpoint is a dict of plain values and CPU tensors, so ``torch.save`` writes it and
``torch.load(path, weights_only=True)`` reads it back without running code, on every torch
this package supports: the configuration's floats are stored as 0-d float64 tensors, since the
weights-only reader of torch 1.13 refuses Python floats. (Pickling the
state object itself also works, as PyTorch's PowerSGD state does, but unpickling runs code, as
pickle always does: load such files only from sources you trust.)
"""

import numbers
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

import torch

from .config import RESULT_FIELDS, GradcompConfig

VERSION = 1
TOTALS = ("steps", "bytes_sent", "bytes_received", "selected", "elements")


def _bad(field: str, why: str) -> ValueError:
    return ValueError(f"gradcomp: checkpoint field {field!r} {why}; the state is unchanged")


@dataclass
class Loaded:
    """A checkpoint that passed every check, in the state's own types."""

    iteration: int
    world_size: Optional[int]
    feedback: Dict[str, List[torch.Tensor]]
    buckets: Dict[int, List[str]]
    totals: Dict[str, int]


def make(config: GradcompConfig, iteration: int, world_size: Optional[int],
         feedback: Dict[str, List[torch.Tensor]], buckets: Dict[int, List[str]],
         totals: Mapping[str, int]) -> Dict[str, Any]:
    return {
        "version": VERSION,
        "config": {k: torch.tensor(v, dtype=torch.float64) if isinstance(v, float) else v
                   for k, v in config.as_dict().items()},
        "iteration": iteration,
        "world_size": world_size,
        "feedback": feedback,
        "buckets": buckets,
        "totals": dict(totals),
    }


def _field(state: Mapping[str, Any], field: str) -> Any:
    if field not in state:
        raise _bad(field, "is missing")
    return state[field]


def _integer(value: Any, field: str, low: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        raise _bad(field, f"= {value!r}; allowed: an integer >= {low}")
    return int(value)


def _compared(config: GradcompConfig) -> List[str]:
    """The fields a checkpoint must share with this state: those that change what a step
    computes under this configuration (a threshold only for selector 'threshold', DGC's settings
    only with its feedback, steps_per_epoch only with a warm-up)."""
    skip = set()
    if config.selector != "threshold":
        skip.add("threshold")
    if config.feedback != "dgc":
        skip.update(("dgc_momentum", "dgc_clip_norm"))
    if config.warmup_epochs == 0:
        skip.add("steps_per_epoch")
    return [k for k in RESULT_FIELDS if k not in skip]


def parse(state: Any, config: GradcompConfig, world_size: Optional[int],
          buffer_count: int) -> Loaded:
    """Checks every field of a checkpoint against this state (its configuration, its group's
    size, its feedback's buffer count); ValueError naming the first field that is wrong."""
    if not isinstance(state, Mapping):
        raise ValueError(f"gradcomp: a checkpoint is a dict, not a {type(state).__name__}")
    version = _field(state, "version")
    if version != VERSION:
        raise _bad("version", f"= {version!r}; this build reads version {VERSION}")
    saved = _field(state, "config")
    if not isinstance(saved, Mapping):
        raise _bad("config", f"is a {type(saved).__name__}, not a dict")
    ours = config.as_dict()
    for key in _compared(config):
        if key not in saved:
            raise _bad(f"config.{key}", "is missing")
        value = saved[key]
        if isinstance(value, torch.Tensor):  # a float, as make() stores it
            if not isinstance(ours[key], float) or value.dim() != 0 or value.dtype != torch.float64:
                allowed = "a 0-d float64 tensor" if isinstance(ours[key], float) else "not a tensor"
                raise _bad(f"config.{key}", f"is a tensor of shape {tuple(value.shape)} and dtype "
                           f"{value.dtype}; allowed: {allowed}")
            value = value.item()
        if value != ours[key]:
            raise ValueError(
                f"gradcomp: the checkpoint was made with {key} = {value!r}, this state "
                f"has {ours[key]!r}; the state is unchanged")
    saved_world = _field(state, "world_size")
    if saved_world is not None:
        _integer(saved_world, "world_size", 1)
        if world_size is not None and saved_world != world_size:
            raise ValueError(
                f"gradcomp: the checkpoint was made with {saved_world} ranks, this "
                f"state's group has {world_size}; allowed: a group of the same size")
    iteration = _integer(_field(state, "iteration"), "iteration")

    raw_totals = _field(state, "totals")
    if not isinstance(raw_totals, Mapping):
        raise _bad("totals", f"is a {type(raw_totals).__name__}, not a dict")
    totals = {k: _integer(raw_totals.get(k), f"totals.{k}") for k in TOTALS}

    raw_feedback = _field(state, "feedback")
    if not isinstance(raw_feedback, Mapping):
        raise _bad("feedback", f"is a {type(raw_feedback).__name__}, not a dict")
    feedback: Dict[str, List[torch.Tensor]] = {}
    for key, buffers in raw_feedback.items():
        where = f"feedback[{key!r}]"
        if not isinstance(key, str):
            raise _bad(where, "has a key that is not a parameter name (str)")
        if not isinstance(buffers, (list, tuple)) or len(buffers) != buffer_count:
            raise _bad(where, f"holds {len(buffers) if isinstance(buffers, (list, tuple)) else buffers!r} "
                              f"buffers; allowed: a list of {buffer_count} tensors (this feedback's count)")
        parts = []
        for b in buffers:
            if not isinstance(b, torch.Tensor) or not b.is_floating_point():
                raise _bad(where, f"holds a {type(b).__name__}; allowed: floating-point tensors")
            parts.append(b.detach().to("cpu", torch.float32).flatten().clone())
        if any(p.numel() != parts[0].numel() for p in parts):
            raise _bad(where, "holds buffers of different sizes")
        feedback[key] = parts

    raw_buckets = _field(state, "buckets")
    if not isinstance(raw_buckets, Mapping):
        raise _bad("buckets", f"is a {type(raw_buckets).__name__}, not a dict")
    buckets: Dict[int, List[str]] = {}
    seen: Dict[str, int] = {}
    for index, keys in raw_buckets.items():
        # Below 2^30: a resumed bucket's engine index may be one above the largest saved one
        # plus DDP's, and the engine takes indices below 2^32.
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < 1 << 30:
            raise _bad("buckets", f"has the bucket index {index!r}; allowed: integers 0 <= i < 2^30")
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
            raise _bad(f"buckets[{index}]", "is not a list of parameter names")
        for k in keys:
            if k in seen:
                raise _bad(f"buckets[{index}]", f"lists {k!r}, which bucket {seen[k]} lists too; "
                                                "allowed: each parameter in one bucket, once")
            seen[k] = index
            if buffer_count > 0 and k not in feedback:
                raise _bad(f"buckets[{index}]", f"lists {k!r}, which has no entry in 'feedback'")
        buckets[index] = list(keys)
    return Loaded(iteration, saved_world, feedback, buckets, totals)


def size_mismatch(key: str, saved: int, now: int) -> str:
    """The error for a checkpoint entry whose size is not its parameter's."""
    text = f"gradcomp: checkpoint entry {key!r} has {saved} elements, the parameter has {now}"
    if key.startswith("bucket") and ".param" in key:
        # A positional key: the parameter at that place of DDP's first buckets.
        text += (" (the checkpoint keys parameters by their position in DDP's first buckets, "
                 "as a state without module= does, and this run's DDP formed its first "
                 "buckets differently: another bucket_cap_mb or find_unused_parameters; save "
                 "and load with GradcompState(module=model) to resume under any bucketing)")
    return text
