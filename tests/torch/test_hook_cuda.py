"""gradcomp.torch's DDP hook on CUDA buckets (label cuda; exits 77, skipped, where there is no
GPU or gradcomp.torch was built without its CUDA path):

- the CUDA hook equals the CPU hook bit for bit (top-k with residual feedback, or with DGC's
  momentum correction, with and without its clipping, over allgather: the device selects the
  host's index set and sums in rank order), results and feedback, at P = 2 over gloo with CUDA
  tensors, for sizes 1, odd and 2^20 + 7, float32 and float16 buckets, with and without
  overlap (with clipping, of gradients in multiples of 1/8, whose squares add up exactly in
  any order: the device sums the bucket's norm in another order than the host); with the
  values sent as fp16 or bf16 codes (both feedbacks, clipped too, float32 and float16 buckets:
  the codes and what the feedback keeps of the rounding are the host's); threshold (floats and
  fp16 codes), whose picks are the host's too; Random-k (the host's draw; floats, bf16
  codes); and every coordinate over allreduce (selector 'dense': floats, fp16 and bf16 codes,
  added in rank order on the device as the CPU path's process group adds them);
- DDP on CUDA: a checkpoint taken at step 3 resumes bit for bit; what was applied plus what is
  left in the residuals equals the sum of the gradients (conservation), across DDP's rebuild;
- a step that fails in its last bucket changes no state, and the retried step is the
  unfaulted one;
- a non-finite gradient on one rank is refused on every rank naming the parameter, or (skip)
  skipped on every rank, with either feedback, clipping and codes, and with Gaussian-k,
  threshold, Random-k and dense over allreduce;
- configurations the CUDA path does not run, and a bucket on another device, are refused with
  errors that say what is allowed;
- Gaussian-k (both forms; fp32, fp16 and bf16 codes; float32 and float16 buckets) at P = 2:
  the feedback keeps e + g but at the picks (there what the code lost), the picks are the
  largest |e + g|, in the band, counted in stats(), and the result is the rank-order mean of
  the ranks' decoded picks bit for bit (its threshold comes from sums in another order than
  the CPU's, so its picks are not compared with the CPU hook's);
- over NCCL at P = 1 the hook sends the top-k of the gradient (as floats, fp16 or bf16 codes)
  and keeps the rest.
"""

import io
import sys
import unittest
from typing import Any, Dict, List

import torch
import torch.distributed as dist

import gradcomp.torch as gct
from gradcomp import _torch_ext
from support import FakeBucket, failed_step, fresh, grad_for, restore, same_state, spawn, straight, train

SIZES = [1, 4099, (1 << 20) + 7]


# The feedbacks the CUDA path runs, by a name for the messages: DGC clipped at a norm that the
# larger buckets exceed (about 64 on rank 0 at n = 4099, more on rank 1) and n = 1 does not.
FEEDBACKS = {"residual": dict(feedback="residual"), "dgc": dict(feedback="dgc"),
             "dgc+clip": dict(feedback="dgc", dgc_clip_norm=20.0)}


def _eighths(g: torch.Tensor) -> torch.Tensor:
    """g in multiples of 1/8 within [-64, 64]: exact in float16, and their squares add up
    exactly in double in any order (clipping's norm, summed in another order on the device)."""
    return (g * 8).round().clamp(-512, 512) / 8


# The selectors whose device form picks the host's index set (Random-k's: the host's draw),
# and 'dense' over 'allreduce' (every coordinate, its codes added in rank order on the device as
# the host's process_group_comm adds them).
SELECTORS = {"topk": dict(selector="topk"), "threshold": dict(selector="threshold", threshold=1.5),
             "randomk": dict(selector="randomk"), "dense": dict(selector="dense", exchange="allreduce")}
# (bucket dtype, feedback, quantizer, selector) compared with the CPU hook at every size.
MATCH_CONFIGS = ([(d, f, "fp32", "topk") for d in (torch.float32, torch.float16) for f in FEEDBACKS] +
                 [(torch.float32, f, q, "topk") for f in ("residual", "dgc") for q in ("fp16", "bf16")] +
                 [(torch.float16, "residual", "bf16", "topk"), (torch.float16, "dgc+clip", "fp16", "topk"),
                  (torch.float32, "residual", "fp32", "threshold"),
                  (torch.float16, "residual", "fp16", "threshold"),
                  (torch.float32, "residual", "fp32", "randomk"),
                  (torch.float16, "residual", "bf16", "randomk")] +
                 [(torch.float32, "residual", q, "dense") for q in ("fp32", "fp16", "bf16")] +
                 [(torch.float16, "residual", "fp16", "dense")])
CODE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def _matches_cpu_worker(rank: int, world: int) -> int:
    checked = 0
    for i, n in enumerate(SIZES):
        for dtype, feedback, quantizer, selector in MATCH_CONFIGS:
            overlap = bool((i + (dtype == torch.float16) + (quantizer == "bf16")) % 2)
            clipped = "dgc_clip_norm" in FEEDBACKS[feedback]
            states = {dev: gct.GradcompState(density=0.01, seed=3, overlap=overlap, quantizer=quantizer,
                                             **SELECTORS[selector], **FEEDBACKS[feedback])
                      for dev in ("cpu", "cuda")}
            params = {dev: [torch.nn.Parameter(torch.zeros(n, device=dev))] for dev in states}
            for step in range(3):
                g = grad_for(rank, step, n)
                g = (_eighths(g) if clipped else g).to(dtype)
                outs = {}
                for dev, state in states.items():
                    buf = g.to(dev).clone()
                    outs[dev] = gct.gradcomp_hook(state, FakeBucket(0, buf, params[dev])).wait()
                got = outs["cuda"].cpu()
                if got.dtype != dtype or not torch.equal(got, outs["cpu"]):
                    diff = (got.double() - outs["cpu"].double()).abs().max().item()
                    raise AssertionError(f"n={n} {dtype} {feedback} {quantizer} {selector} step "
                                         f"{step}: CUDA hook differs from the CPU hook by {diff}")
                checked += 1
            a, b = (states[d].state_dict() for d in ("cpu", "cuda"))
            # The same feedback bit for bit and the same counts; the bytes differ by design
            # (the host sends gradcomp's wire format, the device (index, value or code) pairs of
            # 8 or 6 bytes; dense: the host counts its agreement's header too, the device its
            # reduced buffer alone).
            bytes_cuda = b["totals"].pop("bytes_sent"), b["totals"].pop("bytes_received")
            for key in ("bytes_sent", "bytes_received"):
                a["totals"].pop(key)
            if not same_state(a, b):
                raise AssertionError(f"n={n} {dtype} {feedback} {quantizer} {selector}: the CUDA "
                                     "state differs from the CPU state")
            # Picks over the 3 steps, this rank's and every rank's (threshold's vary).
            mine = b["totals"]["selected"]
            every = torch.tensor([float(mine)], dtype=torch.float64)
            dist.all_reduce(every)
            pick = 4 + CODE_BYTES[quantizer]
            want = (pick * mine, pick * (int(every.item()) - mine))
            if selector == "dense":  # this rank's reduced buffer each way, every step
                want = (CODE_BYTES[quantizer] * mine, CODE_BYTES[quantizer] * mine)
            if (selector == "dense" and mine != 3 * n) or bytes_cuda != want:
                raise AssertionError(f"n={n} {quantizer} {selector}: CUDA picks {mine}, bytes "
                                     f"sent, received {bytes_cuda}; want {want}")
            s_cpu, s_cuda = (states[d].stats()["buckets"][0] for d in ("cpu", "cuda"))
            for key in ("n", "selected", "threshold"):
                if s_cpu[key] != s_cuda[key]:
                    raise AssertionError(f"n={n}: stats {key} {s_cuda[key]} on CUDA, {s_cpu[key]} on CPU")
            # The host sums ||e + g||^2 in float lanes over chunks (then the chunks in double),
            # the device in double: relative differences of about 1e-8 at these sizes.
            if abs(s_cpu["contraction"] - s_cuda["contraction"]) > 1e-6 * abs(s_cpu["contraction"]):
                raise AssertionError(f"n={n}: contraction {s_cuda['contraction']} vs {s_cpu['contraction']}")
            for state in states.values():
                state.close()
    return checked


# (selector, quantizer, bucket dtype) of the Gaussian-k test.
GAUSSIANK_CONFIGS = [("gaussiank", "fp32", torch.float32), ("gaussiank_published", "fp32", torch.float32),
                     ("gaussiank", "fp16", torch.float32), ("gaussiank", "bf16", torch.float16)]
TORCH_CODE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _gaussiank_worker(rank: int, world: int) -> int:
    """Gaussian-k on CUDA buckets. Its threshold comes from statistics the device sums in another
    order than the host, so its picks are not the CPU hook's (near a band's edge they can differ
    by many): checked by what must hold whatever the threshold, at every step: the feedback
    keeps e + g everywhere but at the picks, and there what the code lost (0 for fp32); every
    pick's |e + g| is at least every other's; the default form picks within its band (2k/3 to
    4k/3); stats() counts the picks; and the result is the rank-order mean of every rank's
    decoded picks (0 + rank 0's + rank 1's, divided by P, cast to the bucket's dtype) bit for
    bit. torch rounds to the 16-bit types to nearest, ties to even, as gradcomp's codes do, and
    no value here is near their overflow."""
    checked = 0
    for c, (selector, quantizer, dtype) in enumerate(GAUSSIANK_CONFIGS):
        for i, n in enumerate(SIZES):
            k = max(1, round(0.01 * n))
            state = gct.GradcompState(selector=selector, density=0.01, seed=3, quantizer=quantizer,
                                      overlap=bool((c + i) % 2))
            params = [torch.nn.Parameter(torch.zeros(n, device="cuda"))]
            e = torch.zeros(n)
            for step in range(3):
                g = grad_for(rank, step, n).to(dtype)
                out = gct.gradcomp_hook(state, FakeBucket(0, g.cuda(), params)).wait().cpu()
                left = state.state_dict()["feedback"]["bucket0.param0"][0]
                acc = e + g.float()  # float32, as on the device
                what = f"{selector} {quantizer} {dtype} n={n} step {step}"
                picked = left != acc
                count = int(picked.sum())
                sent = torch.zeros(n)
                sent[picked] = acc[picked].to(TORCH_CODE[quantizer]).float()
                if not torch.equal(left[picked], acc[picked] - sent[picked]):
                    raise AssertionError(f"{what}: the feedback at the picks is not what the code lost")
                if count != state.stats()["buckets"][0]["selected"]:
                    raise AssertionError(f"{what}: {count} picks, stats() says "
                                         f"{state.stats()['buckets'][0]['selected']}")
                if 0 < count < n and acc[picked].abs().min() < acc[~picked].abs().max():
                    raise AssertionError(f"{what}: a pick is smaller than a coordinate left out")
                if selector == "gaussiank" and not 2 * k <= 3 * count <= 4 * k:
                    raise AssertionError(f"{what}: {count} picks, outside the band around k = {k}")
                sents = [torch.zeros(n) for _ in range(world)]
                dist.all_gather(sents, sent)
                total = torch.zeros(n)
                for x in sents:
                    total = total + x
                want = (total / world).to(dtype)
                if out.dtype != dtype or not torch.equal(out, want):
                    raise AssertionError(f"{what}: not the rank-order mean of the picks, off by "
                                         f"{(out.double() - want.double()).abs().max().item()}")
                e = left
                checked += 1
            state.close()
    return checked


def _ddp_worker(rank: int, world: int) -> Dict[str, Any]:
    cap = 4096  # several buckets after DDP's first iteration
    dev = "cuda"

    def make() -> tuple:
        return fresh(0.9, device=dev, selector="topk")

    # Conservation: plain SGD, recording the gradients.
    model_plain, opt_plain, state_plain = fresh(0.0, device=dev, selector="topk")  # lr 0.1
    start = {n: p.detach().double().cpu().clone() for n, p in model_plain.named_parameters()}
    grads: Dict[str, torch.Tensor] = {}
    train(rank, world, 6, cap, state_plain, model_plain, opt_plain, record=grads, device=dev)
    feedback = state_plain.state_dict()["feedback"]
    worst = 0.0
    for name, p in model_plain.named_parameters():
        applied = (start[name] - p.detach().double().cpu()) / 0.1
        left = feedback[name][0].double().reshape(p.shape).clone()
        total = grads[name].clone()
        dist.all_reduce(left)
        dist.all_reduce(total)
        worst = max(worst, (applied + left / world - total / world).abs().max().item())
    if worst > 1e-4:
        raise AssertionError(f"conservation on CUDA off by {worst}")
    rebuilds = state_plain.rebuilds
    buckets = len(state_plain.stats()["buckets"])
    state_plain.close()

    # A checkpoint at step 3 resumes as the uninterrupted run.
    uninterrupted, _ = straight(rank, world, make, 6, cap, device=dev)

    model, opt, state = make()
    train(rank, world, 3, cap, state, model, opt, device=dev)
    saved = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gradcomp": state.state_dict()}, saved)
    for k, v in state.state_dict()["feedback"].items():
        if any(t.device.type != "cpu" for t in v):
            raise AssertionError(f"state_dict() feedback {k} is not on the CPU")
    state.close()
    saved.seek(0)
    ckpt = torch.load(saved)
    model, opt, state = restore(make, ckpt)
    train(rank, world, 3, cap, state, model, opt, first_step=3, device=dev)
    state.close()
    for a, b in zip(uninterrupted, model.parameters()):
        if not torch.equal(a, b.detach()):
            raise AssertionError(f"resumed CUDA run differs by {(a - b).abs().max().item()}")
    return {"rebuilds": rebuilds, "buckets": buckets, "conservation": worst}


def _failed_step_worker(rank: int, world: int) -> int:
    return failed_step(rank, world, overlap=True, device="cuda")


# The non-finite test's configurations by name: top-k with each feedback (the values as fp16
# codes with clipping: a refusal comes before any encoding), Gaussian-k, threshold, Random-k
# and dense over allreduce.
NONFINITE_CONFIGS = {**{f: dict(selector="topk", quantizer="fp16" if f == "dgc+clip" else "fp32", **kw)
                        for f, kw in FEEDBACKS.items()},
                     "gaussiank": dict(selector="gaussiank", quantizer="bf16"),
                     "threshold": dict(selector="threshold", threshold=1.5),
                     "randomk": dict(selector="randomk", quantizer="fp16"),
                     "dense": dict(selector="dense", exchange="allreduce", quantizer="fp16")}


def _nonfinite_worker(rank: int, world: int) -> Dict[str, Any]:
    n = 1000
    out: Dict[str, Any] = {}
    for feedback, policy in [(f, p) for f in NONFINITE_CONFIGS for p in ("raise", "skip")]:
        state = gct.GradcompState(density=0.05, overlap=False, nonfinite=policy,
                                  **NONFINITE_CONFIGS[feedback])
        p = torch.nn.Parameter(torch.zeros(n, device="cuda"))
        gct.gradcomp_hook(state, FakeBucket(0, grad_for(rank, 0, n).cuda(), [p])).wait()
        before = state.state_dict()
        g = grad_for(rank, 1, n).cuda()
        if rank == 1:
            g[17] = float("nan")
        fut = gct.gradcomp_hook(state, FakeBucket(0, g, [p]))
        if policy == "raise":
            try:
                fut.wait()
                raise AssertionError("a NaN gradient was not refused")
            except (RuntimeError, FloatingPointError) as e:
                out[f"{feedback}:raise"] = str(e)
        else:
            result = fut.wait()
            if not torch.isnan(result).all():
                raise AssertionError("a skipped bucket is not all NaN")
            out[f"{feedback}:skipped"] = state.skipped_steps
        if not same_state(before, state.state_dict()):
            raise AssertionError(f"{feedback}, nonfinite={policy}: the refused step changed the state")
        state.close()
    return out


def _refusal_worker(rank: int, world: int) -> List[str]:
    texts = []
    p = torch.nn.Parameter(torch.zeros(100, device="cuda"))
    for cfg in (dict(selector="redsync"), dict(quantizer="qsgd"), dict(exchange="gtopk")):
        state = gct.GradcompState(density=0.05, overlap=False, **cfg)
        try:
            gct.gradcomp_hook(state, FakeBucket(0, torch.ones(100, device="cuda"), [p])).wait()
            raise AssertionError(f"{cfg} ran on a CUDA bucket")
        except (ValueError, RuntimeError) as e:
            texts.append(str(e))
        state.close()
    state = gct.GradcompState(density=0.05, overlap=False)
    gct.gradcomp_hook(state, FakeBucket(0, torch.ones(100, device="cuda"), [p])).wait()
    try:
        gct.gradcomp_hook(state, FakeBucket(0, torch.ones(100), [torch.nn.Parameter(torch.zeros(100))])).wait()
        raise AssertionError("a CPU bucket ran on a state whose buckets are on CUDA")
    except (ValueError, RuntimeError) as e:
        texts.append(str(e))
    state.close()
    return texts


def _nccl_worker(rank: int, world: int) -> float:
    """Over NCCL at P = 1, for the values as floats, fp16 and bf16 codes: the hook sends the top-k
    of e + g (as torch rounds them to the 16-bit type: to nearest, ties to even, as gradcomp's
    codes, and no value here is near either type's overflow) and keeps the rest, with what the
    rounding lost. Returns the largest difference of the feedback from that."""
    n, density = 100003, 0.01
    k = round(density * n)
    worst = 0.0
    for quantizer, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        state = gct.GradcompState(selector="topk", density=density, overlap=True, quantizer=quantizer)
        p = torch.nn.Parameter(torch.zeros(n, device="cuda"))
        e = torch.zeros(n)
        for step in range(3):
            g = grad_for(0, step, n)
            out = gct.gradcomp_hook(state, FakeBucket(0, g.cuda(), [p])).wait().cpu()
            acc = e + g  # float32, as on the device: the same sums, the same top-k
            top = acc.abs().topk(k).indices
            sent = acc[top].to(dtype).float()
            want = torch.zeros(n)
            want[top] = sent
            acc[top] = acc[top] - sent
            e = acc
            if not torch.equal(out, want):
                raise AssertionError(f"NCCL P=1 {quantizer} step {step}: not the top-k of e + g, off "
                                     f"by {(out - want).abs().max().item()}")
        left = state.state_dict()["feedback"]["bucket0.param0"][0]
        state.close()
        worst = max(worst, (left - e).abs().max().item())
    return worst


class CudaHookTest(unittest.TestCase):
    def test_equals_cpu_hook_p2(self) -> None:
        out = spawn(_matches_cpu_worker, 2, timeout_s=120.0)
        self.assertEqual(out[0], len(SIZES) * len(MATCH_CONFIGS) * 3)

    def test_gaussiank_p2(self) -> None:
        out = spawn(_gaussiank_worker, 2, timeout_s=120.0)
        self.assertEqual(out[0], len(GAUSSIANK_CONFIGS) * len(SIZES) * 3)

    def test_ddp_resume_and_conservation_p2(self) -> None:
        out = spawn(_ddp_worker, 2, timeout_s=120.0)
        print("DDP on CUDA:", out[0])
        self.assertGreaterEqual(out[0]["rebuilds"], 1)
        self.assertGreater(out[0]["buckets"], 1)

    def test_failed_step_changes_nothing_p2(self) -> None:
        out = spawn(_failed_step_worker, 2, timeout_s=120.0)
        self.assertGreater(out[0], 0)

    def test_nonfinite_on_one_rank_p2(self) -> None:
        out = spawn(_nonfinite_worker, 2, timeout_s=60.0)
        for rank in (0, 1):
            for feedback in NONFINITE_CONFIGS:
                self.assertIn("bucket0.param0", out[rank][f"{feedback}:raise"])
                self.assertIn("nan", out[rank][f"{feedback}:raise"])
                self.assertEqual(out[rank][f"{feedback}:skipped"], 1)

    def test_refusals(self) -> None:
        texts = spawn(_refusal_worker, 1)[0]
        for t in texts[:3]:
            self.assertIn("CUDA buckets run selector 'topk'", t)
        self.assertIn("cuda", texts[3])

    def test_nccl_p1(self) -> None:
        worst = spawn(_nccl_worker, 1, backend="nccl", timeout_s=60.0)[0]
        self.assertEqual(worst, 0.0)


if __name__ == "__main__":
    if not getattr(_torch_ext, "HAS_CUDA", False):
        print("skipped: gradcomp.torch was built without its CUDA path (torch without CUDA)")
        sys.exit(77)
    if not torch.cuda.is_available():
        print("skipped: no GPU")
        sys.exit(77)
    unittest.main()
