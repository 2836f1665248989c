"""gradcomp_hook: the DDP communication hook, ``ddp.register_comm_hook(state, gradcomp_hook)``."""

import concurrent.futures
from typing import List

import torch
import torch.distributed as dist

from .. import _torch_ext as _ext
from . import errors
from .state import GradcompState

# Bucket dtypes compressed through float32 staging (the feedback state is float32).
STAGED_DTYPES = (torch.float16, torch.bfloat16, torch.float64)


def _allreduce_mean(group: dist.ProcessGroup, buffer: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    world = dist.get_world_size(group)
    tensor = buffer.div_(world)
    return dist.all_reduce(tensor, group=group, async_op=True).get_future().then(lambda f: f.value()[0])


def _fail(fut: "torch.futures.Future[torch.Tensor]", error: BaseException) -> None:
    # Failed on the future's C++ side (_torch_ext.fail_future says why): backward() and
    # fut.wait() raise RuntimeError(text), the text as errors.for_future makes it.
    text = errors.for_future(error)
    try:
        _ext.fail_future(fut, text.encode("utf-8", "replace").decode("utf-8"))
    except Exception:
        # Whatever happens, the future must complete: DDP waits on it.
        if not fut.done():
            fut.set_exception(error)


def _check_bucket(buffer: torch.Tensor) -> None:
    if buffer.device.type not in ("cpu", "cuda"):
        raise ValueError(
            f"gradcomp: the bucket is dtype {buffer.dtype}, device {buffer.device}, layout "
            f"{buffer.layout}; allowed devices: cpu, and cuda where gradcomp was built against a "
            "torch with CUDA")
    if buffer.device.type == "cuda" and not _ext.HAS_CUDA:
        raise RuntimeError(
            f"gradcomp: the bucket is dtype {buffer.dtype}, device {buffer.device}, layout "
            f"{buffer.layout}; this build of gradcomp.torch has no CUDA path (it was built "
            "against a torch without CUDA). Install gradcomp with 'pip install "
            "--no-build-isolation .' under a torch with CUDA, or train on CPU with gloo.")
    if buffer.layout != torch.strided or not buffer.is_contiguous():
        raise ValueError(
            f"gradcomp: the bucket is dtype {buffer.dtype}, device {buffer.device}, layout "
            f"{buffer.layout}, contiguous={buffer.is_contiguous()}; allowed: a contiguous strided "
            "tensor"
        )
    if buffer.dtype not in (torch.float32,) + STAGED_DTYPES:
        raise ValueError(
            f"gradcomp: the bucket is dtype {buffer.dtype}, device {buffer.device}, layout "
            f"{buffer.layout}; allowed dtypes: float32, and float16, bfloat16, float64 "
            "(compressed through float32)"
        )


def _future_for(buffer: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    # A CUDA bucket's future is CUDA-aware: set_result records an event on the stream current
    # there (the bucket's), and whoever waits on the future waits for that event.
    if buffer.device.type == "cuda":
        return torch.futures.Future(devices=[buffer.device])
    return torch.futures.Future()


def _refused(state: GradcompState, buffer: torch.Tensor, index: int, params: List[torch.Tensor],
             step: int, is_last: bool, error: Exception) -> "torch.futures.Future[torch.Tensor]":
    """A bucket refused before it ran (its dtype, layout or device; the group; the engine):
    a failed future, as a failure inside the bucket's work gives, not an exception out of the
    hook, which would leave DDP's reducer broken. Where the engine exists, the bucket's
    agreement tells the other ranks (engine.fail, on the state's thread, in bucket order), so
    that they raise at once instead of waiting in the exchange; nothing of the step is kept."""
    fut = _future_for(buffer)

    def work() -> None:
        engine = state._engine
        if engine is not None and step >= state.config.start_iter:
            try:
                # Under the engine index the other ranks run the bucket's first part at.
                engine.fail(state._buckets.plan(params, index)[0], step, errors.for_future(error))
            except Exception:
                pass  # fail() raises by design; the error the caller sees is `error`
        state._abandon_iteration(step, is_last)
        _fail(fut, error)

    if state._executor is not None:
        state._executor.submit(work)
    else:
        work()
    return fut


def gradcomp_hook(state: GradcompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook: ``ddp.register_comm_hook(state, gradcomp_hook)``."""
    buffer = bucket.buffer()
    index = bucket.index()
    is_last = bucket.is_last()
    step = state.iteration
    try:
        _check_bucket(buffer)
        state._ensure_engine(buffer.device)
    except Exception as e:
        return _refused(state, buffer, index, list(bucket.parameters()), step, is_last, e)
    if is_last:
        state.iteration += 1
    if step < state.config.start_iter:
        return _allreduce_mean(state._group(), buffer)

    params = list(bucket.parameters())
    if is_last:
        state._stats.mark_last_ready()
    if not state.config.overlap:
        fut: "torch.futures.Future[torch.Tensor]" = _future_for(buffer)
        try:
            fut.set_result(state._run_bucket(index, buffer, params, step, is_last))
        except BaseException as e:
            # A failed future, not an exception out of the hook: raised from DDP's autograd
            # hook it leaves DDP's reducer broken (the next backward pass fails an internal
            # assertion), while a failed future is raised from backward() with the reducer
            # ready for the next pass.
            state._abandon_iteration(step, is_last)  # nothing of the step is kept; a retry runs it again
            _fail(fut, e)
        return fut

    if state._executor is None:
        state._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="gradcomp-hook"
        )
    fut = _future_for(buffer)
    # A CUDA bucket's work goes on the stream the backward pass filled it on.
    stream = torch.cuda.current_stream(buffer.device) if buffer.device.type == "cuda" else None

    def work() -> None:
        try:
            if stream is None:
                fut.set_result(state._run_bucket(index, buffer, params, step, is_last))
            else:
                with torch.cuda.device(buffer.device), torch.cuda.stream(stream):
                    fut.set_result(state._run_bucket(index, buffer, params, step, is_last))
        except BaseException as e:  # the training loop sees it when DDP waits on the future
            state._abandon_iteration(step, is_last)  # nothing of the step is kept; a retry runs it again
            _fail(fut, e)

    state._executor.submit(work)
    return fut
