"""The README's PyTorch snippet, run as written: the ```python block under "## PyTorch: a DDP
communication hook" is taken from README.md and executed on 2 gloo ranks with a `model` and its
`ddp` wrapper defined, then the `optimizer` it makes trains a few steps. The replicas must stay
equal and the loss finite, so the snippet cannot drift from the package's API unnoticed."""

import os
import re
import unittest
from typing import Any, Dict, List

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from support import spawn

README = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "README.md")


def readme_snippet() -> str:
    with open(README, encoding="utf-8") as f:
        text = f.read()
    section = text.split("## PyTorch: a DDP communication hook", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    if match is None:
        raise AssertionError("README.md: no ```python block under '## PyTorch: a DDP communication hook'")
    return match.group(1)


def _readme_worker(rank: int, world: int, snippet: str) -> Dict[str, Any]:
    torch.manual_seed(0)  # the same initial model on every rank (DDP also broadcasts it)
    model = torch.nn.Sequential(torch.nn.Linear(20, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    ddp = DDP(model, bucket_cap_mb=0.005)  # a few buckets
    scope: Dict[str, Any] = {"model": model, "ddp": ddp, "torch": torch}
    exec(compile(snippet, "README.md (PyTorch snippet)", "exec"), scope)
    optimizer = scope["optimizer"]
    state = scope["state"]
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    losses: List[float] = []
    for _ in range(6):
        x = torch.randn(32, 20, generator=gen)
        y = torch.randint(0, 4, (32,), generator=gen)
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    gathered = [torch.zeros_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    out = {"losses": losses, "same": all(torch.equal(g, gathered[0]) for g in gathered)}
    state.close()
    return out


class ReadmeTest(unittest.TestCase):
    def test_the_snippet_names_the_hook_and_its_state(self) -> None:
        snippet = readme_snippet()
        self.assertIn("gradcomp.torch.GradcompState(", snippet)
        self.assertIn("ddp.register_comm_hook(state, gradcomp.torch.gradcomp_hook)", snippet)

    def test_the_snippet_trains_two_ranks_in_step(self) -> None:
        out = spawn(_readme_worker, 2, readme_snippet())
        for rank in (0, 1):
            self.assertTrue(out[rank]["same"], f"rank {rank}: the replicas differ")
            self.assertTrue(all(torch.isfinite(torch.tensor(out[rank]["losses"]))))
            self.assertEqual(len(out[rank]["losses"]), 6)


if __name__ == "__main__":
    unittest.main()
