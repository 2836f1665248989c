"""gradcomp.torch's DDP hook over gloo ranks (processes):

- the hook's averaged bucket equals gradcomp's own in-process reference bit for bit, for
  every exchange, at P = 2 and 4, over several steps (feedback carried);
- a model split over several buckets, across DDP's rebuild: for every parameter, what was
  applied plus what is left in the residuals equals the sum of its gradients;
- a checkpoint taken at step s and loaded into a fresh model, optimizer and state continues
  bit for bit as the uninterrupted run; pickling keeps the state;
- bad input is refused with a clear error and changes nothing;
- a rank that raises inside the hook makes the others fail within the group's timeout.
"""

import copy
import io
import pickle
import time
import unittest
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp.torch as gct
import gradcomp_oracle
from support import (FakeBucket, Net, batch, failed_step, fresh, grad_for, restore, same_state, spawn,
                     straight, train)


CONFIGS = [
    dict(selector="topk", quantizer="fp32", exchange="allgather"),
    dict(selector="topk", quantizer="fp32", exchange="gtopk"),
    dict(selector="topk", quantizer="fp32", exchange="a2a"),
    dict(selector="topk", quantizer="fp32", exchange="auto"),
    dict(selector="randomk", quantizer="fp16", exchange="allreduce"),
    dict(selector="dense", quantizer="fp32", feedback="none", exchange="allreduce"),
    dict(selector="dense", quantizer="qsgd", feedback="none", exchange="allgather", bits=4),
    dict(selector="gaussiank", quantizer="bf16", exchange="allgather"),
    dict(selector="dgc", quantizer="fp32", exchange="gtopk"),
    dict(selector="threshold", quantizer="sign", exchange="a2a", threshold=1.5),
]


def _reference_worker(rank: int, world: int) -> int:
    n, steps, density = 4099, 3, 0.02
    param = torch.nn.Parameter(torch.zeros(n))
    checked = 0
    for i, cfg in enumerate(CONFIGS):
        state = gct.GradcompState(density=density, seed=11, overlap=bool(i % 2), **cfg)
        outs = []
        for s in range(steps):
            buf = grad_for(rank, s, n).clone()
            outs.append(gct.gradcomp_hook(state, FakeBucket(0, buf, [param])).wait().clone())
        state.close()
        grads = [[grad_for(r, s, n) for r in range(world)] for s in range(steps)]
        reference = state.config.as_dict()
        if cfg["exchange"] == "auto":
            # 'auto' picks from the link it measured (broadcast from rank 0, so every rank of
            # the hook picks alike), but the oracle would measure its own threads' link and
            # could pick gtopk (a global top-k, another result) where the hook did not, or the
            # reverse: the reference is what the hook ran. Top-k payloads cannot be summed, so
            # any other pick gives sparse_allgather's result bit for bit (exchange/auto.hpp).
            # The shape is the same at every step, and so is the pick.
            ran = state.stats()["buckets"][0]["exchange"]
            assert ran in ("sparse_allgather", "topk_a2a", "dense_allreduce", "gtopk"), (cfg, ran)
            reference["exchange"] = "gtopk" if ran == "gtopk" else "allgather"
        want = [[torch.from_numpy(a) for a in step] for step in gradcomp_oracle.reference(
            reference, 0, [[g.numpy() for g in step] for step in grads], 0, density)]
        for s in range(steps):
            if not torch.equal(outs[s], want[s][rank]):
                diff = (outs[s] - want[s][rank]).abs().max().item()
                raise AssertionError(f"{cfg} step {s}: hook differs from the in-process reference by {diff}")
            checked += 1
        assert state.stats()["totals"]["steps"] == steps
        # The contraction: in [0, 1], 1 when every coordinate is sent, at least about k/n for
        # top-k (the largest values keep at least their share); measured for every
        # configuration (DGC's from its momentum feedback's accumulation).
        for b in state.stats()["buckets"]:
            c = b["contraction"]
            if cfg["selector"] == "dense":
                assert c == 1.0, (cfg, c)
            else:
                assert 0.0 <= c <= 1.0, (cfg, c)
                if cfg["selector"] == "topk":
                    assert c >= 0.9 * b["selected"] / b["n"], (cfg, c)
    return checked


class ReferenceTest(unittest.TestCase):
    def test_every_exchange_matches_in_process_reference_p2(self) -> None:
        out = spawn(_reference_worker, 2)
        self.assertEqual(out[0], len(CONFIGS) * 3)

    def test_every_exchange_matches_in_process_reference_p4(self) -> None:
        out = spawn(_reference_worker, 4)
        self.assertEqual(out[3], len(CONFIGS) * 3)


# ---- DDP: several buckets, the rebuild, conservation ---------------------------------------


def _conservation_worker(rank: int, world: int) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    start = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    lr = 0.25
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    state = gct.GradcompState(selector="topk", density=0.05, module=model)
    grads: Dict[str, torch.Tensor] = {}
    train(rank, world, 8, 4096, state, model, opt, record=grads)
    feedback = state.state_dict()["feedback"]
    buckets = len(state.stats()["buckets"])
    worst = 0.0
    for name, p in model.named_parameters():
        applied = (start[name] - p.detach().double()) / lr  # sum over steps of the averaged update
        left = feedback[name][0].double().reshape(p.shape).clone()
        total = grads[name].clone()
        dist.all_reduce(left)
        dist.all_reduce(total)
        err = (applied + left / world - total / world).abs().max().item()
        scale = total.abs().max().item() / world + 1e-12
        worst = max(worst, err / scale)
    state.close()
    return {"worst": worst, "buckets": buckets, "rebuilds": state.rebuilds}


def _world_group_worker(rank: int, world: int) -> Dict[str, Any]:
    """process_group=dist.group.WORLD (PowerSGD's convention) with find_unused_parameters=True
    and overlap: the state exchanges on a group of its own, so DDP's own allreduce on WORLD
    cannot interleave with the buckets' exchanges (before: a hang until the group's timeout).
    close() destroys that group."""
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, find_unused_parameters=True)
    state = gct.GradcompState(process_group=dist.group.WORLD, selector="topk", density=0.05)
    own = state._own_group
    assert own is not None and own != dist.group.WORLD
    ddp.register_comm_hook(state, gct.gradcomp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = time.perf_counter()
    for s in range(4):
        x, y = batch(rank, s)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    seconds = time.perf_counter() - start
    steps = state.stats()["totals"]["steps"]
    state.close()
    assert state._own_group is None
    destroyed = own not in dist.distributed_c10d._pg_map  # torch's table of live groups
    return {"seconds": seconds, "steps": steps, "destroyed": destroyed}


def _subgroup_worker(rank: int, world: int) -> Dict[str, Any]:
    """DDP on a subgroup (ranks 0 and 1 of 3) with the state on another group of the same ranks,
    as docs/torch.md says: every rank of the default group creates both groups (new_group is
    collective over it), only the subgroup's ranks train, and their replicas stay equal."""
    ddp_group = dist.new_group(ranks=[0, 1], backend="gloo")
    ours = dist.new_group(ranks=[0, 1], backend="gloo")
    if rank == 2:
        return {"trained": False}
    torch.manual_seed(0)
    model = Net()
    ddp = DDP(model, process_group=ddp_group, bucket_cap_mb=0.005)
    state = gct.GradcompState(process_group=ours, selector="topk", density=0.05)
    assert state._own_group is None  # a group passed is used as it is
    ddp.register_comm_hook(state, gct.gradcomp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(4):
        x, y = batch(rank, s)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    steps = state.stats()["totals"]["steps"]
    state.close()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(2)]
    dist.all_gather(gathered, flat, group=ddp_group)
    return {"trained": True, "steps": steps, "equal": torch.equal(gathered[0], gathered[1])}


def _subgroup_default_worker(rank: int, world: int) -> Dict[str, Any]:
    """DDP on a subgroup (ranks 0 and 1 of 3) with process_group=None and module=the DDP model:
    the state's own group would span rank 2, which never joins, so it is refused at once,
    naming the fix, instead of waiting out the store's timeout. DDP on a group of every rank
    that is not the default group is not refused: every rank makes its state."""
    ddp_group = dist.new_group(ranks=[0, 1], backend="gloo")
    every = dist.new_group(ranks=[0, 1, 2], backend="gloo")
    torch.manual_seed(0)
    message, seconds = None, 0.0
    if rank != 2:
        ddp = DDP(Net(), process_group=ddp_group)
        t0 = time.monotonic()
        try:
            gct.GradcompState(module=ddp, selector="topk", density=0.05)
            message = ""
        except ValueError as e:
            message = str(e)
        seconds = time.monotonic() - t0
    state = gct.GradcompState(module=DDP(Net(), process_group=every), selector="topk")
    made = state._own_group is not None
    state.close()
    return {"refused": message, "seconds": seconds, "every_rank_group_accepted": made}


class DDPTest(unittest.TestCase):
    def test_ddp_on_a_subgroup_with_a_group_of_the_same_ranks(self) -> None:
        out = spawn(_subgroup_worker, 3, timeout_s=30.0)
        self.assertFalse(out[2]["trained"])
        for rank in (0, 1):
            self.assertEqual(out[rank]["steps"], 4)
            self.assertTrue(out[rank]["equal"], "the subgroup's replicas drifted apart")

    def test_ddp_on_a_subgroup_with_the_default_group_is_refused_at_once(self) -> None:
        out = spawn(_subgroup_default_worker, 3, timeout_s=30.0)
        for rank in (0, 1):
            self.assertIn("a group of 2 of the 3 ranks", out[rank]["refused"])
            self.assertIn("process_group = a group of the same 2 ranks", out[rank]["refused"])
            self.assertLess(out[rank]["seconds"], 5.0)
        for rank in range(3):
            self.assertTrue(out[rank]["every_rank_group_accepted"])

    def test_world_group_with_unused_parameters_does_not_deadlock(self) -> None:
        out = spawn(_world_group_worker, 2, timeout_s=30.0)
        for rank in (0, 1):
            self.assertEqual(out[rank]["steps"], 4)
            self.assertLess(out[rank]["seconds"], 20.0)
            self.assertTrue(out[rank]["destroyed"])

    def test_applied_plus_residual_is_the_sum_of_gradients_across_the_rebuild(self) -> None:
        out = spawn(_conservation_worker, 2)
        for rank in (0, 1):
            self.assertGreater(out[rank]["buckets"], 1, "the model must span several buckets")
            # DDP 1.13 puts every parameter in one bucket for the first iteration and rebuilds
            # after it: the feedback had to follow its parameters into the new buckets.
            self.assertGreaterEqual(out[rank]["rebuilds"], 1)
            self.assertLess(out[rank]["worst"], 1e-5)


def _checkpoint_worker(rank: int, world: int) -> int:
    cap = 4096  # several buckets after the rebuild; DDP's first iteration has one

    def make() -> tuple:
        return fresh(momentum=0.9, selector="topk")

    uninterrupted, buckets = straight(rank, world, make, 6, cap)

    model, opt, state = make()
    train(rank, world, 3, cap, state, model, opt)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gradcomp": state.state_dict()}, saved)
    pickled = pickle.dumps(state)
    state.close()
    saved.seek(0)
    ckpt = torch.load(saved)

    model, opt, state = restore(make, ckpt)
    train(rank, world, 3, cap, state, model, opt, first_step=3)
    resumed = [p.detach().clone() for p in model.parameters()]
    state.close()
    for a, b in zip(uninterrupted, resumed):
        if not torch.equal(a, b):
            raise AssertionError(f"resumed run differs by {(a - b).abs().max().item()}")

    # The same resume from the pickled state (the module is attached after unpickling).
    unpickled = pickle.loads(pickled)
    again = unpickled.state_dict()
    model, opt, _ = make()
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    unpickled.attach_module(model)
    train(rank, world, 3, cap, unpickled, model, opt, first_step=3)
    unpickled.close()
    for a, b in zip(uninterrupted, model.parameters()):
        if not torch.equal(a, b.detach()):
            raise AssertionError(f"run resumed from the pickled state differs by {(a - b).abs().max().item()}")
    want = ckpt["gradcomp"]
    assert again["iteration"] == want["iteration"] == 3
    assert again["config"] == want["config"]
    assert set(again["feedback"]) == set(want["feedback"])
    for k in want["feedback"]:
        assert all(torch.equal(x, y) for x, y in zip(again["feedback"][k], want["feedback"][k]))
    return buckets


def _failed_step_worker(rank: int, world: int, overlap: bool) -> int:
    return failed_step(rank, world, overlap)


class FailedStepTest(unittest.TestCase):
    def test_a_failed_step_changes_nothing_and_its_retry_is_the_unfaulted_step(self) -> None:
        for overlap in (False, True):
            out = spawn(_failed_step_worker, 2, overlap)
            self.assertGreater(out[0], 0)


def _one_bucket_resume_worker(rank: int, world: int, selector: str, quantizer: str) -> Dict[str, Any]:
    """A model that fits in one bucket (DDP's default 25 MB cap) with a policy whose result
    depends on each element's position in the bucket: the saved bucket is in the rebuilt
    (gradient) order, the resumed run's first bucket in registration order. 5 + 5 steps must
    equal 10 straight."""
    cap = 25 * 1024 * 1024

    def make() -> tuple:
        return fresh(momentum=0.0, selector=selector, quantizer=quantizer)

    uninterrupted, buckets = straight(rank, world, make, 10, cap)

    model, opt, state = make()
    train(rank, world, 5, cap, state, model, opt)
    ckpt = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
            "gradcomp": state.state_dict()}
    state.close()
    model, opt, state = restore(make, ckpt)
    train(rank, world, 5, cap, state, model, opt, first_step=5)
    rebuilds = state.rebuilds
    state.close()
    worst = max((a - b.detach()).abs().max().item() for a, b in zip(uninterrupted, model.parameters()))
    return {"buckets": buckets, "worst": worst, "rebuilds": rebuilds}


def _other_buckets_resume_worker(rank: int, world: int, cap: int, unused: bool,
                                 named: bool = True) -> Dict[str, Any]:
    """Resumed with another bucket_cap_mb, or with find_unused_parameters=True (which changes
    how DDP forms and rebuilds its buckets): the feedback follows its parameters into whatever
    buckets the resumed run has, at most one rebuild happens (DDP's own, after the first
    iteration), and every parameter's feedback is carried: after the resume's first step no
    checkpoint entry is left unclaimed."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = gct.GradcompState(selector="topk", density=0.1, module=model if named else None)
    train(rank, world, 3, 4096, state, model, opt)
    saved = state.state_dict()
    state.close()

    state = gct.GradcompState(selector="topk", density=0.1, module=model if named else None)
    state.load_state_dict(saved)
    dist._DEFAULT_FIRST_BUCKET_BYTES = cap
    ddp = DDP(model, bucket_cap_mb=cap / (1024 * 1024), find_unused_parameters=unused)
    ddp.register_comm_hook(state, gct.gradcomp_hook)
    for s in range(3, 9):
        x, y = batch(rank, s)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    out = {"rebuilds": state.rebuilds, "steps": state.state_dict()["iteration"],
           "pending": len(state._buckets.pending),
           "buckets": len(state.state_dict()["buckets"])}
    state.close()
    return out


def _fake_step(state: Any, rank: int, s: int, layout: List[List[torch.Tensor]],
               sums: Dict[int, torch.Tensor], applied: Dict[int, torch.Tensor], nan_in: Any = None) -> None:
    """One step of the hook over DDP-like buckets `layout` (FakeBucket i holds layout[i]), with
    grad_for() gradients (a NaN at element 3 of `nan_in`'s); adds each parameter's gradient to
    sums and the hook's result to applied."""
    for i, params in enumerate(layout):
        grads = [grad_for(rank, 100 * s + 10 * i + j, p.numel()) for j, p in enumerate(params)]
        for p, g in zip(params, grads):
            if p is nan_in:
                g[3] = float("nan")
        out = gct.gradcomp_hook(state, FakeBucket(i, torch.cat(grads), params,
                                                  last=i == len(layout) - 1)).wait()
        at = 0
        for p, g in zip(params, grads):
            sums[id(p)] += g.double()
            applied[id(p)] += out[at: at + p.numel()].double()
            at += p.numel()


def _mid_step_rebuild_worker(rank: int, world: int) -> Dict[str, Any]:
    """DDP's rebuilt buckets can keep bucket 0 as it was and change a later one: the rebuild is
    then seen at bucket 1, after bucket 0 ran in that step. Bucket 0's new feedback must
    survive it: for every parameter, the updates returned plus the residual left equal the sum
    of its gradients (one rank: the mean is the rank's own)."""
    a, b, c = (torch.nn.Parameter(torch.zeros(n)) for n in (300, 200, 100))
    state = gct.GradcompState(selector="topk", density=0.1, feedback="residual")
    sums = {id(p): torch.zeros(p.numel(), dtype=torch.float64) for p in (a, b, c)}
    applied = {id(p): torch.zeros(p.numel(), dtype=torch.float64) for p in (a, b, c)}

    def step(s: int, layout: List[List[torch.Tensor]]) -> None:
        _fake_step(state, rank, s, layout, sums, applied)

    step(0, [[a], [b, c]])
    step(1, [[a], [c, b]])  # rebuilt: bucket 0 unchanged, bucket 1 in another order
    step(2, [[a], [c, b]])
    feedback = state.state_dict()["feedback"]
    keys = state._buckets.keys
    worst = 0.0
    for p in (a, b, c):
        left = feedback[keys[id(p)]][0].double()
        err = (applied[id(p)] + left - sums[id(p)]).abs().max().item()
        worst = max(worst, err / (sums[id(p)].abs().max().item() + 1e-12))
    out = {"worst": worst, "rebuilds": state.rebuilds}
    state.close()
    return out


def _resume_regrouped_worker(rank: int, world: int, poison: bool = False) -> Any:
    """Saved under buckets [[a], [b], [c, d]], resumed under [[a, b], [c], [d]]: DDP's bucket 0
    is compressed as the saved buckets 0 and 1 were, while its buckets 1 and 2 tile no saved
    bucket and run whole. Neither may take the index (and so the staged feedback) of a saved
    bucket run in the same step: every parameter's updates plus its residual still equal the
    sum of its gradients, and the buckets stop changing after the resume's first step."""
    m = torch.nn.Module()
    for name, n in (("a", 300), ("b", 200), ("c", 100), ("d", 50)):
        setattr(m, name, torch.nn.Parameter(torch.zeros(n)))
    a, b, c, d = m.a, m.b, m.c, m.d
    sums = {id(p): torch.zeros(p.numel(), dtype=torch.float64) for p in (a, b, c, d)}
    applied = {id(p): torch.zeros(p.numel(), dtype=torch.float64) for p in (a, b, c, d)}

    def step(state: Any, s: int, layout: List[List[torch.Tensor]], nan_in: Any = None) -> None:
        _fake_step(state, rank, s, layout, sums, applied, nan_in)

    state = gct.GradcompState(selector="topk", density=0.1, feedback="residual", module=m)
    for s in range(2):
        step(state, s, [[a], [b], [c, d]])
    saved = state.state_dict()
    state.close()
    state = gct.GradcompState(selector="topk", density=0.1, feedback="residual", module=m)
    state.load_state_dict(saved)
    if poison:
        # b is the saved bucket 1 and DDP's bucket 0 now: the error names DDP's.
        try:
            step(state, 2, [[a, b], [c], [d]], nan_in=b)
        except RuntimeError as e:  # as backward() raises it
            return str(e)
        finally:
            state.close()
        return "no error"
    step(state, 2, [[a, b], [c], [d]])
    rebuilds = state.rebuilds
    for s in range(3, 6):
        step(state, s, [[a, b], [c], [d]])
    rebuilds_after_first = state.rebuilds - rebuilds
    # DDP rebuilds into the saved buckets: the statistics are of this step's buckets only.
    # The indices the resume's whole buckets ran at (above the saved 0..2) are no longer used:
    # the engine frees their state once the step commits; the saved indices keep theirs.
    held_before = [i for i in range(8) if state._engine.state(i)]
    step(state, 6, [[a], [b], [c, d]])
    held_after = [i for i in range(8) if state._engine.state(i)]
    n = state.stats()["n"]
    feedback = state.state_dict()["feedback"]
    worst = 0.0
    for name, p in (("a", a), ("b", b), ("c", c), ("d", d)):
        left = feedback[name][0].double()
        err = (applied[id(p)] + left - sums[id(p)]).abs().max().item()
        worst = max(worst, err / (sums[id(p)].abs().max().item() + 1e-12))
    out = {"worst": worst, "rebuilds_after_first": rebuilds_after_first, "n": n,
           "held_before": held_before, "held_after": held_after}
    state.close()
    return out


class RebuildTest(unittest.TestCase):
    def test_a_rebuild_seen_mid_step_keeps_the_feedback_of_buckets_already_run(self) -> None:
        out = spawn(_mid_step_rebuild_worker, 1)
        self.assertEqual(out[0]["rebuilds"], 1)
        self.assertLess(out[0]["worst"], 1e-5)

    def test_a_resume_that_regroups_some_buckets_keeps_every_parameters_feedback(self) -> None:
        out = spawn(_resume_regrouped_worker, 1)
        self.assertLess(out[0]["worst"], 1e-5)
        self.assertEqual(out[0]["rebuilds_after_first"], 0)
        self.assertEqual(out[0]["n"], 650)
        self.assertEqual(out[0]["held_before"], [0, 1, 4, 5])
        self.assertEqual(out[0]["held_after"], [0, 1, 2])

    def test_after_a_resume_errors_name_ddps_bucket(self) -> None:
        text = spawn(_resume_regrouped_worker, 1, True)[0]
        self.assertIn("parameter 'b' (bucket 0) holds nan at element 3", text)


class CheckpointTest(unittest.TestCase):
    def test_resumed_run_is_bit_identical(self) -> None:
        out = spawn(_checkpoint_worker, 2)
        # Several buckets in the saved run, one in the resumed run's first iteration: the
        # resumed first step had to be compressed as the saved buckets were.
        self.assertGreater(out[0], 1)

    def test_one_bucket_model_resumes_bit_identically_with_position_dependent_policies(self) -> None:
        for selector, quantizer in (("topk", "qsgd"), ("randomk", "fp32"), ("randomk", "qsgd")):
            with self.subTest(selector=selector, quantizer=quantizer):
                out = spawn(_one_bucket_resume_worker, 2, selector, quantizer)
                for rank in (0, 1):
                    self.assertEqual(out[rank]["buckets"], 1)
                    self.assertEqual(out[rank]["worst"], 0.0)

    def test_resume_with_other_buckets_rebuilds_at_most_once(self) -> None:
        for cap, unused in ((2048, False), (25 * 1024 * 1024, False), (4096, True), (2048, True)):
            with self.subTest(cap=cap, find_unused_parameters=unused):
                out = spawn(_other_buckets_resume_worker, 2, cap, unused)
                for rank in (0, 1):
                    self.assertLessEqual(out[rank]["rebuilds"], 1)
                    self.assertEqual(out[rank]["steps"], 9)
                    self.assertEqual(out[rank]["pending"], 0)

    def test_positional_checkpoint_under_other_buckets_is_refused_naming_module(self) -> None:
        # Without module=, keys are positions in DDP's first buckets; find_unused_parameters
        # forms them differently, and the resume must say so rather than mix parameters up.
        out = spawn(_other_buckets_resume_worker, 2, 4096, True, False, allow_failure=True)
        for rank in (0, 1):
            self.assertIsInstance(out[rank], tuple)
            self.assertIn("checkpoint keys parameters by their position", out[rank][1])
            self.assertIn("module=model", out[rank][1])


# ---- bad input ------------------------------------------------------------------------------


def _bad_input_worker(rank: int, world: int) -> int:
    checks = 0

    def refuses(kind: type, fragments: List[str], fn: Any, prefix: str = "gradcomp: ") -> None:
        nonlocal checks
        try:
            fn()
        except kind as e:
            text = str(e)
            # One style: gradcomp's prefix, then the caller's names and values (the C++
            # engine's own calls name the C++ function: "gradcomp::gradcomp_hook: ...").
            assert text.startswith(prefix), f"{text!r} does not start with {prefix!r}"
            for f in fragments:
                assert f in text, f"{f!r} not in {text!r}"
            checks += 1
            return
        raise AssertionError(f"expected {kind.__name__} with {fragments}")

    refuses(ValueError, ["selector = 'top_k'", "'topk'", "'gaussiank'", "'redsync'", "'dense'"],
            lambda: gct.GradcompState(selector="top_k"))
    # Arguments of the wrong type are TypeErrors naming the field, not range errors.
    refuses(TypeError, ["density = '0.01'", "str", "a number"], lambda: gct.GradcompState(density="0.01"))
    refuses(TypeError, ["density = True", "bool"], lambda: gct.GradcompState(density=True))
    refuses(TypeError, ["process_group = 'gloo'", "ProcessGroup"], lambda: gct.GradcompState(process_group="gloo"))
    refuses(TypeError, ["seed = 1.5"], lambda: gct.GradcompState(seed=1.5))
    # A threshold selector without a threshold says so, instead of naming a 0 never given.
    refuses(ValueError, ["needs a threshold, and none was given"], lambda: gct.GradcompState(selector="threshold"))
    # A threshold given as 0 is named as given.
    refuses(ValueError, ["threshold = 0 is not allowed", "0 < threshold < inf"],
            lambda: gct.GradcompState(selector="threshold", threshold=0))
    refuses(ValueError, ["quantizer", "'qsgd'", "'sign'"], lambda: gct.GradcompState(quantizer="int8"))
    refuses(ValueError, ["exchange", "'allgather'", "'a2a'"], lambda: gct.GradcompState(exchange="ring"))
    refuses(ValueError, ["feedback", "'residual'"], lambda: gct.GradcompState(feedback="ef21"))
    for bad in (0.0, -0.5, 1.5, float("nan")):
        refuses(ValueError, ["density", "0 < density <= 1"], lambda: gct.GradcompState(density=bad))
    refuses(ValueError, ["'allreduce'", "'allgather'"], lambda: gct.GradcompState(selector="topk", exchange="allreduce"))
    refuses(ValueError, ["'allreduce'"], lambda: gct.GradcompState(selector="randomk", quantizer="qsgd", exchange="allreduce"))
    refuses(ValueError, ["selector 'dgc'", "feedback 'none'"], lambda: gct.GradcompState(selector="dgc", feedback="none"))
    refuses(ValueError, ["bits"], lambda: gct.GradcompState(quantizer="qsgd", bits=1))
    refuses(ValueError, ["threshold"], lambda: gct.GradcompState(selector="threshold"))

    n = 1000
    param = torch.nn.Parameter(torch.zeros(n))
    state = gct.GradcompState(selector="topk", density=0.01, overlap=False)
    gct.gradcomp_hook(state, FakeBucket(0, grad_for(0, 0, n), [param])).wait()
    before = state.state_dict()

    def unchanged() -> None:
        after = state.state_dict()
        assert after["iteration"] == before["iteration"]
        for k, v in before["feedback"].items():
            assert all(torch.equal(a, b) for a, b in zip(v, after["feedback"][k]))

    # A refused bucket fails the hook's future (what DDP raises from backward()), never the
    # hook call itself (which would leave DDP's reducer broken: _refused_bucket_worker).
    refuses(RuntimeError, ["dtype torch.int32", "device cpu"],
            lambda: gct.gradcomp_hook(state, FakeBucket(0, torch.zeros(n, dtype=torch.int32), [param])).wait())
    unchanged()
    strided = torch.zeros(2 * n)[::2]
    refuses(RuntimeError, ["contiguous=False"],
            lambda: gct.gradcomp_hook(state, FakeBucket(0, strided, [param])).wait())
    unchanged()
    refuses(RuntimeError, ["device meta", "allowed devices: cpu, and cuda"],
            lambda: gct.gradcomp_hook(state, FakeBucket(0, torch.zeros(n, device="meta"), [param])).wait())
    unchanged()
    # The C++ view itself names dtype, device and layout.
    engine = state._engine
    refuses(ValueError, ["'bucket'", "dtype Double", "device cpu", "layout Strided"],
            lambda: engine.run(0, torch.zeros(n, dtype=torch.float64), 1, 0.01), prefix="gradcomp::")
    refuses(ValueError, ["not contiguous"], lambda: engine.run(0, torch.zeros(n, 2)[:, 0], 1, 0.01),
            prefix="gradcomp::")
    unchanged()
    # A bucket id that changes size keeps its state and is refused.
    refuses(ValueError, ["bucket size", "1000"], lambda: engine.run(0, torch.zeros(n + 1), 1, 0.01),
            prefix="gradcomp")
    unchanged()

    # A group of another size than the one the state was registered (checkpointed) with.
    other = state.state_dict()
    other["world_size"] = world + 3
    fresh = gct.GradcompState(selector="topk", density=0.01, overlap=False)
    fresh.load_state_dict(other)
    refuses(RuntimeError, [f"has {world} ranks", f"with {world + 3}"],
            lambda: gct.gradcomp_hook(fresh, FakeBucket(0, grad_for(0, 1, n), [param])).wait())
    assert fresh.iteration == other["iteration"]
    refuses(ValueError, [f"made with {world + 3} ranks"], lambda: state.load_state_dict(other))
    unchanged()
    # A checkpoint of another configuration.
    refuses(ValueError, ["selector"], lambda: gct.GradcompState(selector="gaussiank").load_state_dict(before))
    return checks


def _malformed_checkpoint_worker(rank: int, world: int) -> int:
    """Every malformed checkpoint is a ValueError naming the field, and the state is unchanged;
    a good one goes through torch.save / torch.load(weights_only=True)."""
    a = torch.nn.Parameter(torch.zeros(300))
    b = torch.nn.Parameter(torch.zeros(200))
    c = torch.nn.Parameter(torch.zeros(100))
    d = torch.nn.Parameter(torch.zeros(50))
    params = [a, b, c, d]
    n = sum(p.numel() for p in params)
    state = gct.GradcompState(selector="topk", density=0.01, overlap=False, seed=3)
    for s in range(2):
        gct.gradcomp_hook(state, FakeBucket(0, grad_for(0, s, n), params)).wait()
    good = state.state_dict()
    keys = sorted(good["feedback"])
    assert len(keys) == 4 and good["buckets"] == {0: [f"bucket0.param{j}" for j in range(4)]}

    buffer = io.BytesIO()
    torch.save(good, buffer)
    buffer.seek(0)
    # As the docs say to load one, on every torch (1.13's weights-only reader refuses Python
    # floats: the configuration's are 0-d tensors in a checkpoint).
    reloaded = torch.load(buffer, weights_only=True)
    fresh = gct.GradcompState(selector="topk", density=0.01, overlap=False, seed=3)
    fresh.load_state_dict(reloaded)
    assert fresh.iteration == good["iteration"]

    checks = 0

    def refused(fragments: List[str], bad: Any) -> None:
        nonlocal checks
        before = state.state_dict()
        try:
            state.load_state_dict(bad)
        except ValueError as e:
            assert str(e).startswith("gradcomp: "), f"{str(e)!r} does not start with 'gradcomp: '"
            for f in fragments:
                assert f in str(e), f"{f!r} not in {str(e)!r}"
        else:
            raise AssertionError(f"accepted a checkpoint that should fail with {fragments}")
        after = state.state_dict()
        assert after["iteration"] == before["iteration"] and after["buckets"] == before["buckets"]
        for k, v in before["feedback"].items():
            assert all(torch.equal(x, y) for x, y in zip(v, after["feedback"][k]))
        checks += 1

    def edited(**changes: Any) -> Dict[str, Any]:
        out = copy.deepcopy(good)
        for k, v in changes.items():
            if v is None:
                del out[k]
            else:
                out[k] = v
        return out

    # Two buckets that list the same parameters: a and b compressed twice, c and d never.
    refused(["buckets[1]", "bucket0.param0", "bucket 0 lists too"],
            edited(buckets={0: keys[:2], 1: keys[:2]}))
    for field in ("iteration", "feedback", "totals", "config", "version", "world_size", "buckets"):
        refused([repr(field), "is missing"] if field != "version" else ["'version'"], edited(**{field: None}))
    refused(["feedback['bucket0.param0']", "a list of 1 tensors"],
            edited(feedback={**good["feedback"], keys[0]: good["feedback"][keys[0]] * 2}))
    refused(["'iteration'", ">= 0"], edited(iteration=-1))
    refused(["'iteration'"], edited(iteration="7"))
    refused(["buckets[0]", "no entry in 'feedback'"], edited(buckets={0: keys + ["ghost"]}))
    for key, value in (("seed", 4), ("density", 0.02), ("quantizer", "fp16"), ("start_iter", 2),
                       ("warmup_epochs", 1)):
        refused([f"made with {key} = {value!r}"], edited(config={**good["config"], key: value}))
    # The configuration's floats travel as 0-d float64 tensors (weights_only on torch 1.13); a
    # tensor of another shape is refused, naming the field.
    assert isinstance(good["config"]["density"], torch.Tensor) and good["config"]["density"].dim() == 0
    refused(["'config.density'", "shape (2,)", "0-d float64"], edited(config={**good["config"], "density": torch.zeros(2)}))
    refused(["'config.seed'", "not a tensor"],
            edited(config={**good["config"], "seed": torch.tensor(3.0, dtype=torch.float64)}))
    refused(["'buckets'", "2^30"], edited(buckets={1 << 31: keys}))
    # Fields this configuration does not use are not compared: a threshold without selector
    # 'threshold', DGC's momentum without its feedback.
    other = gct.GradcompState(selector="topk", density=0.01, overlap=False, seed=3)
    other.load_state_dict(edited(config={**good["config"], "threshold": 1.0, "dgc_momentum": 0.5}))
    assert other.iteration == good["iteration"]
    # ... and compared where it does: a threshold with selector 'threshold', DGC's settings with
    # its feedback.
    for config, key, value in (({"selector": "threshold", "threshold": 0.5}, "threshold", 0.25),
                               ({"feedback": "dgc"}, "dgc_momentum", 0.5),
                               ({"feedback": "dgc"}, "dgc_clip_norm", 1.0)):
        mine = gct.GradcompState(density=0.01, overlap=False, seed=3, **config)
        theirs = mine.state_dict()
        theirs["config"] = {**theirs["config"], key: value}
        try:
            mine.load_state_dict(theirs)
        except ValueError as e:
            assert str(e).startswith(f"gradcomp: the checkpoint was made with {key} = {value!r}"), str(e)
        else:
            raise AssertionError(f"a checkpoint made with another {key} was accepted")
        mine.close()
        checks += 1
    # The configuration is fixed: writing a field of it is refused, not silently ignored.
    try:
        other.density = 0.5
    except AttributeError as e:
        assert "part of the state's configuration" in str(e)
    else:
        raise AssertionError("state.density = ... was accepted")
    refused(["a checkpoint is a dict"], [good])
    return checks


def _nonfinite_worker(rank: int, world: int) -> str:
    """A NaN in a gradient is refused naming the bucket, the parameter and the element (the
    hook passes the engine each parameter's name: labels), and changes no state."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    state = gct.GradcompState(selector="topk", density=0.25, overlap=False, module=model)
    state._ensure_engine()
    gct.gradcomp_hook(state, FakeBucket(0, grad_for(0, 0, n), params)).wait()
    before = state.state_dict()
    bad = grad_for(0, 1, n).clone()
    bad[params[0].numel() + params[1].numel() + 5] = float("nan")  # element 5 of '1.weight'
    try:
        # The hook returns a failed future (raising out of DDP's autograd hook would break
        # DDP's reducer), which raises when waited on.
        gct.gradcomp_hook(state, FakeBucket(0, bad, params)).wait()
    except (FloatingPointError, RuntimeError) as e:
        text = str(e)
    else:
        raise AssertionError("a NaN gradient was accepted")
    after = state.state_dict()
    assert after["iteration"] == before["iteration"]
    for k, v in before["feedback"].items():
        assert all(torch.equal(a, b) for a, b in zip(v, after["feedback"][k]))
    return text


def _pending_before_commit_worker(rank: int, world: int) -> str:
    """A checkpoint keyed by parameter name, loaded into a state without module=: its entries
    match no parameter, which is found at the step's last bucket and refused before that step
    keeps anything (the step count and the feedback stay as loaded, so a retry after
    attach_module() runs the step once)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    named = gct.GradcompState(selector="topk", density=0.25, overlap=False, module=model)
    gct.gradcomp_hook(named, FakeBucket(0, grad_for(0, 0, n), params)).wait()
    saved = named.state_dict()
    named.close()
    plain = gct.GradcompState(selector="topk", density=0.25, overlap=False)
    plain.load_state_dict(saved)
    before = plain.state_dict()
    try:
        gct.gradcomp_hook(plain, FakeBucket(0, grad_for(0, 1, n), params)).wait()
    except RuntimeError as e:
        text = str(e)
    else:
        raise AssertionError("a step ran with checkpoint entries that matched no parameter")
    after = plain.state_dict()
    # Nothing of the step is kept: the step count, the totals and every loaded entry are as
    # loaded. (The bucket's layout, with fresh zero entries under positional keys, is made by
    # the refused step and stays: it is no result of the step; attach_module re-keys it.)
    assert after["iteration"] == before["iteration"] == saved["iteration"], (after["iteration"], saved["iteration"])
    assert after["totals"] == before["totals"]
    for key, buffers in saved["feedback"].items():
        assert all(torch.equal(a, b) for a, b in zip(buffers, after["feedback"][key])), key
    # With the module attached the same step runs, once, and as it runs in a state that had the
    # module from the start: the loaded feedback is the one used and kept.
    plain.attach_module(model)
    got = gct.gradcomp_hook(plain, FakeBucket(0, grad_for(0, 1, n), params)).wait()
    ref = gct.GradcompState(selector="topk", density=0.25, overlap=False, module=model)
    ref.load_state_dict(saved)
    want = gct.gradcomp_hook(ref, FakeBucket(0, grad_for(0, 1, n), params)).wait()
    assert torch.equal(got, want)
    mine, theirs = plain.state_dict(), ref.state_dict()
    assert mine["iteration"] == saved["iteration"] + 1
    assert same_state(mine, theirs), (sorted(mine["feedback"]), sorted(theirs["feedback"]))
    assert mine["buckets"] == theirs["buckets"], (mine["buckets"], theirs["buckets"])
    plain.close()
    ref.close()
    return text


def _foreign_error_worker(rank: int, world: int) -> List[str]:
    """An error that is not gradcomp's (here a KeyError from inside the bucket's work) fails the
    hook's future with its type's name kept in the text, in both modes, and the future
    completes (DDP waits on it)."""
    param = torch.nn.Parameter(torch.zeros(64))
    texts = []
    for overlap in (False, True):
        state = gct.GradcompState(selector="topk", density=0.25, overlap=overlap)

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise KeyError("no such bucket")

        state._buckets.run = broken  # type: ignore[method-assign]
        fut = gct.gradcomp_hook(state, FakeBucket(0, grad_for(0, 0, 64), [param]))
        try:
            fut.wait()
        except RuntimeError as e:
            texts.append(str(e))
        else:
            raise AssertionError("the failed bucket's future succeeded")
        state.close()
    return texts


def _mixed_precision_worker(rank: int, world: int) -> bool:
    """fp16, bf16 and fp64 buckets are compressed through float32 staging: the result is the
    float32 result of the same values, cast back."""
    n = 3001
    param = torch.nn.Parameter(torch.zeros(n))
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        a = gct.GradcompState(selector="topk", density=0.05, overlap=False)
        b = gct.GradcompState(selector="topk", density=0.05, overlap=False)
        for s in range(2):
            g = grad_for(rank, s, n).to(dtype)
            low = gct.gradcomp_hook(a, FakeBucket(0, g.clone(), [param])).wait()
            high = gct.gradcomp_hook(b, FakeBucket(0, g.float(), [param])).wait()
            assert low.dtype == dtype
            assert torch.equal(low, high.to(dtype)), dtype
    return True


def _refused_bucket_worker(rank: int, world: int, overlap: bool) -> str:
    """A bucket refused before it runs (here: the state was registered with another group
    size) under DDP: backward() raises with the reason on every rank, nothing of the step is
    kept, and the reducer is not broken: once the state is right, the same model trains on."""
    model, opt, state = fresh(0.0, selector="topk", overlap=overlap)
    ddp = train(rank, world, 2, 4096, state, model, opt)
    before = state.state_dict()
    state.world_size = world + 1  # as if registered (or checkpointed) with another group
    x, y = batch(rank, 2)
    opt.zero_grad(set_to_none=True)
    text = ""
    try:
        torch.nn.functional.mse_loss(ddp(x), y).backward()
    except RuntimeError as e:
        text = str(e)
    if "process group has" not in text:
        raise AssertionError(f"the refused bucket did not fail backward(): {text!r}")
    state.world_size = world
    if not same_state(before, state.state_dict()):
        raise AssertionError("the refused step changed the hook's state")
    for s in range(2, 4):  # the reducer still works
        x, y = batch(rank, s)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    if state.iteration != 4:
        raise AssertionError(f"iteration {state.iteration} after the retried steps, not 4")
    state.close()
    return text


class BadInputTest(unittest.TestCase):
    def test_refused_bucket_fails_backward_not_the_reducer(self) -> None:
        for overlap in (False, True):
            out = spawn(_refused_bucket_worker, 2, overlap)
            for rank in (0, 1):
                self.assertTrue(out[rank].startswith("gradcomp: the process group has 2 ranks"), out[rank])

    def test_bad_input_is_refused_and_changes_nothing(self) -> None:
        out = spawn(_bad_input_worker, 1)
        self.assertEqual(out[0], 28)

    def test_malformed_checkpoints_are_refused_by_field(self) -> None:
        out = spawn(_malformed_checkpoint_worker, 1)
        self.assertEqual(out[0], 24)

    def test_a_nonfinite_gradient_names_its_bucket_and_parameter(self) -> None:
        text = spawn(_nonfinite_worker, 1)[0]
        self.assertIn("parameter '1.weight' (bucket 0) holds nan at element 5", text)
        self.assertNotIn("Unable to cast", text)

    def test_unmatched_checkpoint_entries_are_refused_before_the_step_commits(self) -> None:
        text = spawn(_pending_before_commit_worker, 1)[0]
        self.assertTrue(text.startswith("gradcomp: "), text)
        self.assertIn("matched no parameter", text)
        self.assertIn("module=model", text)

    def test_an_error_that_is_not_gradcomps_keeps_its_type_name(self) -> None:
        for text in spawn(_foreign_error_worker, 1)[0]:
            self.assertEqual(text, "KeyError: 'no such bucket'")

    def test_half_precision_buckets_go_through_float32(self) -> None:
        spawn(_mixed_precision_worker, 2)


# ---- a rank that fails ----------------------------------------------------------------------


def _raising_worker(rank: int, world: int) -> str:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = gct.GradcompState(selector="topk", density=0.05)
    ddp = DDP(model)

    def hook(st: gct.GradcompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if rank == 1 and st.iteration == 2:
            raise RuntimeError("injected failure on rank 1")
        return gct.gradcomp_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    for s in range(5):
        x, y = batch(rank, s)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return "finished"


def _one_rank_nonfinite_worker(rank: int, world: int, overlap: bool, policy: str, which: str,
                               delay_last: float = 0.0) -> Dict[str, Any]:
    """Rank 1 alone gets a NaN in one bucket (the first handed over, a middle one or the last) of
    step 2. 'raise': every rank raises within seconds with the real cause, no feedback changes,
    and a caller that catches it and goes on stays in step. 'skip': every rank gets NaN
    gradients for that step, skips its optimizer step, and goes on in step. delay_last: the
    last bucket's hook call of step 2 comes that many seconds late on every rank (with
    overlap, the earlier buckets' work, the failed one's included, is then done long before)."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    state = gct.GradcompState(selector="topk", density=0.1, module=model, overlap=overlap,
                              nonfinite=policy)
    dist._DEFAULT_FIRST_BUCKET_BYTES = 1024
    ddp = DDP(model, bucket_cap_mb=1024 / (1024 * 1024))
    seen: List[int] = []
    at = [0]  # the loop's step (the state's own counter does not advance past a skipped step)

    def hook(st: gct.GradcompState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if at[0] == 2:
            seen.append(bucket.index())
            target = {"first": 1, "middle": 2, "last": None}[which]
            hit = bucket.is_last() if target is None else len(seen) == target
            if rank == 1 and hit:
                bucket.buffer()[3] = float("nan")
            if delay_last and bucket.is_last():
                time.sleep(delay_last)
        return gct.gradcomp_hook(st, bucket)

    ddp.register_comm_hook(state, hook)
    out: Dict[str, Any] = {"errors": [], "skipped": []}
    before = None
    for s in range(6):
        at[0] = s
        x, y = batch(rank, s)
        opt.zero_grad(set_to_none=True)
        if s == 2:
            before = state.state_dict()
        t0 = time.perf_counter()
        try:
            torch.nn.functional.mse_loss(ddp(x), y).backward()
        except Exception as e:  # the caller catches it and goes on with the next batch
            out["errors"].append((s, type(e).__name__, str(e), time.perf_counter() - t0))
            if s == 2:
                out["unchanged"] = same_state(before, state.state_dict())
            continue
        if state.last_step_skipped:
            out["skipped"].append(s)
            out["nan_grads"] = any(not torch.isfinite(p.grad).all() for p in model.parameters())
            out["unchanged"] = same_state(before, state.state_dict())
            continue  # as GradScaler does
        opt.step()
    out["buckets"] = len(set(seen))
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    out["replicas_equal"] = all(torch.equal(gathered[0], g) for g in gathered)
    out["skipped_steps"] = state.skipped_steps
    state.close()
    return out


class OneRankFailsTest(unittest.TestCase):
    def test_a_nonfinite_gradient_on_one_rank_raises_on_every_rank_within_seconds(self) -> None:
        # The six placements, and with overlap a failure in the first or a middle bucket while
        # the last bucket's hook call comes 0.5 s late.
        cases = [(o, w, 0.0) for o in (True, False) for w in ("first", "middle", "last")]
        cases += [(True, "first", 0.5), (True, "middle", 0.5)]
        for overlap, which, delay in cases:
            with self.subTest(overlap=overlap, which=which, delay_last=delay):
                t0 = time.perf_counter()
                out = spawn(_one_rank_nonfinite_worker, 2, overlap, "raise", which, delay, timeout_s=60.0)
                self.assertLess(time.perf_counter() - t0, 45.0)
                for rank in (0, 1):
                    r = out[rank]
                    self.assertGreaterEqual(r["buckets"], 3, "the model must have several buckets")
                    self.assertEqual(len(r["errors"]), 1, r["errors"])
                    step, kind, text, seconds = r["errors"][0]
                    self.assertEqual(step, 2)
                    self.assertLess(seconds, 10.0)
                    # The message as gradcomp wrote it: no "Unable to cast ... to Tensor",
                    # no "Got the following error when running the callback:", no
                    # exception type or Python traceback ("At: ...") added by PyTorch.
                    self.assertEqual(kind, "RuntimeError")
                    self.assertTrue(text.startswith("gradcomp: "), text)
                    for mangled in ("Unable to cast", "Got the following error", "At:", "Error: gradcomp"):
                        self.assertNotIn(mangled, text)
                    self.assertTrue(r["unchanged"], "the failed step changed the hook's state")
                    self.assertTrue(r["replicas_equal"], "the ranks drifted apart after the failure")
                # Both ranks name the parameter, the bucket and the element.
                own = out[1]["errors"][0][2]
                cause = own[own.index("the gradient of parameter '"):]
                self.assertIn("holds nan at element", cause)
                self.assertIn("failed on rank 1", out[0]["errors"][0][2])
                self.assertTrue(out[0]["errors"][0][2].endswith(cause), out[0]["errors"][0][2])

    def test_a_nonfinite_gradient_on_one_rank_skips_the_step_on_every_rank(self) -> None:
        for overlap in (True, False):
            for which in ("first", "middle", "last"):
                with self.subTest(overlap=overlap, which=which):
                    out = spawn(_one_rank_nonfinite_worker, 2, overlap, "skip", which, timeout_s=60.0)
                    for rank in (0, 1):
                        r = out[rank]
                        self.assertEqual(r["errors"], [])
                        self.assertEqual(r["skipped"], [2])
                        self.assertEqual(r["skipped_steps"], 1)
                        self.assertTrue(r["nan_grads"])
                        self.assertTrue(r["unchanged"], "the skipped step changed the hook's state")
                        self.assertTrue(r["replicas_equal"])


class FailureTest(unittest.TestCase):
    def test_a_rank_that_raises_makes_the_others_fail_not_hang(self) -> None:
        # The group's timeout bounds start-up and every collective of the steps before the
        # failure as well, on a machine that may be running other tests: 30 s leaves room for
        # that. Rank 0 learns of the failure when rank 1's process exits and closes its
        # connections, well within it.
        t0 = time.perf_counter()
        out = spawn(_raising_worker, 2, timeout_s=30.0, allow_failure=True)
        elapsed = time.perf_counter() - t0
        self.assertIn("injected failure on rank 1", str(out.get(1)))
        self.assertIsInstance(out.get(0), tuple, f"rank 0 should have failed, got {out.get(0)!r}")
        self.assertIn("gradcomp::process_group_comm", out[0][1])  # failed in gradcomp's exchange
        self.assertLess(elapsed, 60.0)


if __name__ == "__main__":
    unittest.main(verbosity=2)
