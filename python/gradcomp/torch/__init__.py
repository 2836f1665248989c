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

The package, shaped like PyTorch's ``ddp_comm_hooks``: ``config`` (GradcompConfig, the
configuration), ``state`` (GradcompState), ``hook`` (gradcomp_hook), ``buckets`` (feedback
that follows DDP's buckets) and ``checkpoint`` (state_dict and its checks).
"""

from .config import EXCHANGES, FEEDBACKS, QUANTIZERS, SELECTORS, GradcompConfig
from .hook import gradcomp_hook
from .state import GradcompState

__all__ = [
    "GradcompConfig",
    "GradcompState",
    "gradcomp_hook",
    "SELECTORS",
    "QUANTIZERS",
    "FEEDBACKS",
    "EXCHANGES",
]
