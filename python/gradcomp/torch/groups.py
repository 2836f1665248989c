"""The process groups of a GradcompState: the group it was given, and the group its exchanges
run over.

DDP issues collectives of its own on its group (find_unused_parameters' allreduce right after
the last bucket, buffer broadcasts), from the autograd thread, while the state's thread may
still exchange buckets: gloo matches collectives by the order in which they are issued, so the
two threads would interleave differently on different ranks. So with the default group (None,
or dist.group.WORLD as PowerSGD's convention passes it) the exchanges run on a gloo group of
the state's own over the same ranks. Any other group passed as process_group is used as it is:
it must not be DDP's.
"""

from typing import Optional

import torch
import torch.distributed as dist


def check(process_group: object) -> None:
    """Refuses a process_group argument that is neither None nor a ProcessGroup (a backend
    name, say), naming what is allowed."""
    if process_group is not None and not isinstance(process_group, dist.ProcessGroup):
        raise TypeError(
            f"gradcomp: process_group = {process_group!r} is a "
            f"{type(process_group).__name__}; allowed: a torch.distributed ProcessGroup "
            "(e.g. dist.new_group(...)), or None for the default group")


def group_of(process_group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """The group a state was given (None: the default group)."""
    return process_group if process_group is not None else dist.group.WORLD


def is_default_group(process_group: Optional[dist.ProcessGroup]) -> bool:
    try:
        return process_group in (None, dist.distributed_c10d._get_default_group())
    except Exception:
        return process_group is None


def check_module(process_group: Optional[dist.ProcessGroup], module: object) -> None:
    """Refuses the default group for a DDP model on a subgroup: the state's own group spans
    every rank of the default group, and the ranks outside DDP's group would never join it
    (new_group would wait out the store's timeout, 30 minutes by default)."""
    if not isinstance(module, torch.nn.parallel.DistributedDataParallel):
        return
    ranks, world = dist.get_world_size(module.process_group), dist.get_world_size()
    if ranks != world:
        raise ValueError(
            f"gradcomp: module is a DistributedDataParallel on a group of {ranks} of the "
            f"{world} ranks, with process_group = {process_group!r} (the default group, whose "
            f"other {world - ranks} rank(s) would never join the state's exchanges); allowed: "
            f"process_group = a group of the same {ranks} ranks, made with "
            "dist.new_group(ranks) on every rank (not DDP's own group), or, to average over "
            f"all {world} ranks, dist.new_group(list(range({world}))) made on every rank")


def make_own_group(process_group: Optional[dist.ProcessGroup],
                   module: object = None) -> Optional[dist.ProcessGroup]:
    """With the default group, a gloo group of the state's own over the same ranks (collective:
    every rank of the default group calls it); None for another group. A DDP `module` on a
    subgroup is refused first (check_module)."""
    if not is_default_group(process_group):
        return None
    check_module(process_group, module)
    try:
        timeout = dist.distributed_c10d._get_default_store().timeout
    except Exception:
        timeout = dist.default_pg_timeout
    return dist.new_group(ranks=list(range(dist.get_world_size())), timeout=timeout, backend="gloo")
