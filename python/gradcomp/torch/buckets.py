"""Feedback state that follows its parameters when DDP forms or rebuilds its buckets.

The engine keeps feedback per bucket index. DDP's first iteration puts the parameters in
buckets of registration order, then rebuilds them in the order the gradients came; a
checkpoint holds feedback per parameter. BucketFeedback maps between the two: it records which
parameters each bucket holds, releases every bucket's feedback to a pool keyed by parameter when
the buckets change, and builds a bucket's state from that pool.
"""

from typing import Any, Dict, List, Optional, Tuple

import torch

from . import checkpoint

Layout = Tuple[Tuple[int, int], ...]  # (id(parameter), numel) in bucket order


def strip_ddp_prefix(name: str) -> str:
    return name[len("module.") :] if name.startswith("module.") else name


class BucketFeedback:
    def __init__(self) -> None:
        self.layouts: Dict[int, Layout] = {}
        self.owner: Dict[int, int] = {}  # id(parameter) -> the bucket index holding it
        self.keys: Dict[int, str] = {}  # id(parameter) -> checkpoint key
        # Feedback loaded from a checkpoint or released by a rebuild, keyed by parameter,
        # waiting for the bucket that now holds the parameter.
        self.pending: Dict[str, List[torch.Tensor]] = {}
        # The buckets (parameter keys by bucket index) of the run a checkpoint came from.
        self.resume_groups: Dict[int, List[str]] = {}
        self.rebuilds = 0  # times DDP re-formed the buckets and the feedback followed
        # Each bucket's labels for the engine (labels()), with the layout they were made for.
        self.label_cache: Dict[int, Tuple[Optional[Layout], List[Tuple[str, int]]]] = {}
        # The bucket indices run in the step in flight (`step`): their layouts are already
        # those of DDP's buckets of this step, so a rebuild seen later in the step keeps them.
        self.ran: set = set()
        self.ran_step: Optional[int] = None
        self.held: set = set()  # the indices the engine holds state for (drop_unused)

    def name_parameters(self, module: torch.nn.Module, engine: Any = None) -> None:
        """Keys the parameters by their names in `module`. When buckets already hold feedback
        under other keys (positions: a step ran before the module was attached), each such
        bucket is given, per parameter, the entry the pending pool holds under its new name (a
        checkpoint's, which wins) or what it held itself; its layout stays. Between steps only
        (the caller waits for the state's thread). Nothing changes when it raises."""
        renamed = {id(p): strip_ddp_prefix(name) for name, p in module.named_parameters()}
        keys = {**self.keys, **renamed}
        if engine is not None and any(keys[pid] != self.keys.get(pid) for pid in self.owner):
            held = self.released_by_parameter(engine)
            pending = dict(self.pending)
            states = {index: self.assemble(engine, [(keys[pid], numel, held.get(pid)) for pid, numel in layout],
                                           pending)
                      for index, layout in self.layouts.items()}
            for index, buffers in states.items():
                if buffers is not None:
                    engine.set_state(index, buffers)
            for pid in self.owner:
                pending.pop(keys[pid], None)
            self.pending = pending
        self.keys = keys
        self.label_cache.clear()  # the keys changed

    def assemble(self, engine: Any, entries: List[Tuple[str, int, Optional[List[torch.Tensor]]]],
                 pending: Dict[str, List[torch.Tensor]]) -> Optional[List[torch.Tensor]]:
        """A bucket's feedback buffers from its parameters' (key, numel, what it held, or
        None): the pending pool's entry for the key where there is one, else what it held,
        else zeros. None when the feedback has no buffers. Raises on a size mismatch."""
        if engine.buffer_count == 0:
            return None
        buffers = []
        for b in range(engine.buffer_count):
            parts = []
            for key, numel, held in entries:
                saved = pending.get(key, held)
                if saved is not None and saved[b].numel() != numel:
                    raise ValueError(checkpoint.size_mismatch(key, saved[b].numel(), numel))
                parts.append(saved[b] if saved is not None else torch.zeros(numel, dtype=torch.float32))
            buffers.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32))
        return buffers

    def key(self, p: torch.Tensor, bucket: int, position: int) -> str:
        key = self.keys.get(id(p))
        if key is None:
            key = f"bucket{bucket}.param{position}"
            self.keys[id(p)] = key
        return key

    def prepare(self, engine: Any, index: int, params: List[torch.Tensor], n: int) -> None:
        """Makes the engine's state for bucket `index` follow its parameters. Everything is
        built and checked first; nothing changes when it raises."""
        layout = tuple((id(p), p.numel()) for p in params)
        if self.layouts.get(index) == layout:
            return
        if sum(numel for _, numel in layout) != n:
            raise ValueError(
                f"gradcomp: bucket {index} holds {n} elements but its parameters "
                f"{sum(numel for _, numel in layout)}"
            )
        # DDP rebuilt its buckets when this index now holds other parameters, or these
        # parameters were in another bucket: then the feedback of every bucket not yet run in
        # this step is released to the pending pool, from which the new buckets take theirs.
        # The buckets already run in this step are DDP's new ones (DDP rebuilds between
        # iterations): they keep their state, staged feedback included.
        rebuild = index in self.layouts or any(self.owner.get(pid, index) != index for pid, _ in layout)
        pending = dict(self.pending)
        if rebuild:
            pending.update(self.released(engine, keep=self.ran))
        keys = [self.key(p, index, j) for j, p in enumerate(params)]
        buffers = self.assemble(engine, [(k, p.numel(), None) for k, p in zip(keys, params)], pending)
        # Commit. The engine's states of the released buckets stay until their indices are
        # set again below or by the buckets still to come; none is read before that.
        if rebuild:
            for old in [i for i in self.layouts if i not in self.ran]:
                for pid, _ in self.layouts.pop(old):
                    if self.owner.get(pid) == old:
                        del self.owner[pid]
            self.rebuilds += 1
        if buffers is not None:
            engine.set_state(index, buffers)
        for k in keys:
            pending.pop(k, None)
        self.pending = pending
        self.layouts[index] = layout
        self.held.add(index)
        for pid, _ in layout:
            self.owner[pid] = index

    def released(self, engine: Any, keep: Optional[set] = None) -> Dict[str, List[torch.Tensor]]:
        """Every bucket's feedback buffers (but the buckets in `keep`), split by parameter and
        keyed by its checkpoint key (nothing changes)."""
        return {self.keys[pid]: buffers for pid, buffers in self.released_by_parameter(engine, keep).items()}

    def released_by_parameter(self, engine: Any, keep: Optional[set] = None) -> Dict[int, List[torch.Tensor]]:
        """released(), keyed by id(parameter)."""
        out: Dict[int, List[torch.Tensor]] = {}
        for index, layout in self.layouts.items():
            if keep is not None and index in keep:
                continue
            state = engine.state(index)
            if not state:
                continue
            at = 0
            for pid, numel in layout:
                out[pid] = [b[at : at + numel].clone() for b in state]
                at += numel
        return out

    def plan(self, params: List[torch.Tensor], index: int) -> Tuple[int, Optional[List[Tuple[int, List[int]]]]]:
        """How DDP's bucket `index` runs on the engine: (the engine index of its first run, its
        groups), groups None to run it whole.

        After a checkpoint was loaded, DDP's first iteration puts every parameter in one bucket
        of registration order, while the run that saved the checkpoint had rebuilt its buckets
        (in the order the gradients came). To continue exactly as it would have, such a bucket
        is compressed as the saved buckets were: groups is a list of (saved bucket index,
        positions of its parameters in this bucket), one entry too when the saved run had one
        bucket of the same parameters in another order (a policy that depends on an element's
        position in the bucket, such as qsgd's buckets or randomk's picks, sees the saved
        order). A bucket that is one of the saved ones as it was (or any bucket, when nothing
        was saved) runs whole at its own index; one that the saved buckets do not tile runs
        whole at an index above every saved one, so that two buckets of one step never share
        an index (and so a staged state) and each keeps its index from step to step."""
        if not self.resume_groups:
            return index, None
        keys = [self.key(p, index, j) for j, p in enumerate(params)]
        if self.resume_groups.get(index) == keys:
            return index, None
        where = {k: j for j, k in enumerate(keys)}
        groups = []
        covered = 0
        for g_index in sorted(self.resume_groups):
            g_keys = self.resume_groups[g_index]
            if g_keys and all(k in where for k in g_keys):
                groups.append((g_index, [where[k] for k in g_keys]))
                covered += len(g_keys)
        if covered != len(keys) or not groups:
            return max(self.resume_groups) + 1 + index, None
        return groups[0][0], groups

    def prepare_or_fail(self, engine: Any, index: int, params: List[torch.Tensor], n: int,
                        step: int) -> None:
        """prepare(); when it raises, this rank's own part of the bucket failed before the
        exchange: engine.fail() first tells the other ranks through the bucket's agreement (they
        raise, carrying the message, instead of waiting), then the error is raised here."""
        try:
            self.prepare(engine, index, params, n)
        except Exception as e:
            try:
                engine.fail(index, step, str(e))
            except Exception:
                pass
            raise

    def run(self, engine: Any, index: int, staged: torch.Tensor, params: List[torch.Tensor],
            step: int, density: float) -> List[Any]:
        """Runs bucket `index` (its float32 values `staged`, written over with the result) on
        the engine, as the saved buckets were after a resume (plan); the statistics of
        each engine run."""
        if step != self.ran_step:
            self.ran, self.ran_step = set(), step
        ddp_index = index
        index, groups = self.plan(params, index)
        if groups is None:
            self.prepare_or_fail(engine, index, params, staged.numel(), step)
            self.ran.add(index)
            return [self.run_as(engine, ddp_index, index, staged, params, step, density)]
        offsets = [0]
        for p in params:
            offsets.append(offsets[-1] + p.numel())
        results = []
        for g_index, positions in groups:
            part = torch.cat([staged[offsets[j] : offsets[j + 1]] for j in positions])
            members = [params[j] for j in positions]
            self.prepare_or_fail(engine, g_index, members, part.numel(), step)
            self.ran.add(g_index)
            results.append(self.run_as(engine, ddp_index, g_index, part, members, step, density))
            if results[-1].get("skipped"):
                staged.fill_(float("nan"))
                return results
            at = 0
            for j in positions:
                n = offsets[j + 1] - offsets[j]
                staged[offsets[j] : offsets[j + 1]].copy_(part[at : at + n])
                at += n
        return results

    def run_as(self, engine: Any, ddp_index: int, index: int, values: torch.Tensor,
               params: List[torch.Tensor], step: int, density: float) -> Any:
        """engine.run() of `values` at the engine's `index`; its errors name DDP's bucket
        (`ddp_index`), which after a resume can differ from the engine's (plan), as every
        rank's does: each maps its own, and the ranks' buckets agree. The error itself is
        raised (its type and traceback), its message mapped."""
        try:
            return engine.run(index, values, step, density, self.labels(index, params))
        except Exception as e:
            if index != ddp_index and e.args and isinstance(e.args[0], str):
                text = e.args[0]
                for old, new in ((f"(bucket {index})", f"(bucket {ddp_index})"),
                                 (f"bucket {index} of step", f"bucket {ddp_index} of step")):
                    text = text.replace(old, new)
                e.args = (text, *e.args[1:])
            raise

    def labels(self, index: int, params: List[torch.Tensor]) -> List[Tuple[str, int]]:
        """Each parameter's key and size, for the engine to name the one whose gradient is not
        finite (called after prepare(), which gave them their keys); made again only when the
        bucket's layout changes."""
        layout = self.layouts.get(index)
        cached = self.label_cache.get(index)
        if cached is None or cached[0] != layout:
            cached = (layout, [(self.key(p, index, j), p.numel()) for j, p in enumerate(params)])
            self.label_cache[index] = cached
        return cached[1]

    def forget_step(self) -> None:
        """The step in flight failed and the engine discarded what it staged: a retry of the
        step (same step number) starts with no bucket run."""
        self.ran, self.ran_step = set(), None

    def drop_unused(self, engine: Any) -> None:
        """Once a step committed: frees the engine's state of each index no bucket uses any more
        (a rebuild released its feedback to the pending pool, or a resume's first step ran it)."""
        for index in sorted(self.held - self.layouts.keys()):
            engine.drop(index)
        self.held = set(self.layouts)

    def check_pending(self) -> None:
        if self.pending:
            names = sorted(self.pending)
            raise ValueError(
                f"gradcomp: {len(names)} checkpoint entries matched no parameter of the "
                f"buckets of a whole step (first: {names[0]!r}); a checkpoint keyed by parameter "
                "name needs module=model (or state.attach_module(model) after unpickling)"
            )

    def feedback(self, engine: Optional[Any]) -> Dict[str, List[torch.Tensor]]:
        """Every parameter's feedback buffers (copies): the buckets' and the pending pool's."""
        out: Dict[str, List[torch.Tensor]] = {k: [b.clone() for b in v] for k, v in self.pending.items()}
        if engine is not None:
            out.update(self.released(engine))
        return out

    def buckets(self) -> Dict[int, List[str]]:
        """The buckets in use, or (nothing run since a checkpoint was loaded) those it had."""
        return ({index: [self.keys[pid] for pid, _ in layout] for index, layout in self.layouts.items()}
                or {i: list(keys) for i, keys in self.resume_groups.items()})

    def load(self, engine: Optional[Any], pending: Dict[str, List[torch.Tensor]],
             resume_groups: Dict[int, List[str]]) -> None:
        if engine is not None:
            engine.clear()
        self.held.clear()
        self.layouts.clear()
        self.owner.clear()
        self.label_cache.clear()
        self.forget_step()
        self.pending = pending
        self.resume_groups = resume_groups
