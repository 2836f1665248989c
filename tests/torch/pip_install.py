"""gradcomp.torch installed the way the docs say, and the same as the CMake build.

Makes a fresh virtual environment that sees the system's packages (torch among them), runs
``pip install --no-build-isolation .`` in it on a fresh copy of what the package is built from
(so the extension is compiled from scratch), and checks:
- the package imported there is the installed one (it and its extension lie in the
  environment's site-packages, not in a build tree);
- 2 gloo ranks with DDP and gradcomp's hook train to the same parameters, bit for bit, with the
  installed package and with the CMake-built one (``--reference``, CMake's <build>/python),
  for a policy set that uses the stochastic quantizer and more than one bucket.

Usage: pip_install.py --source DIR --work DIR --reference DIR
(and, run by itself in each environment: pip_install.py --train OUT.json)
"""

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
STEPS = 6


def _train_rank(rank: int, world: int) -> Dict[str, Any]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import gradcomp.torch
    from support import Net, batch

    torch.manual_seed(0)
    model = DDP(Net(), bucket_cap_mb=0.005)
    state = gradcomp.torch.GradcompState(process_group=None, selector="topk", density=0.05,
                                         quantizer="qsgd", bits=4, seed=7)
    model.register_comm_hook(state, gradcomp.torch.gradcomp_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses: List[float] = []
    for step in range(STEPS):
        x, y = batch(rank, step)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    state.close()
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    return {"params": digest.hexdigest(), "losses": losses}


def train(out: Path) -> None:
    """Trains on 2 ranks with whichever gradcomp this interpreter imports; writes what it did."""
    sys.path.insert(0, str(HERE))  # support.py, the tests' helpers
    import gradcomp._torch_ext as ext
    from support import spawn

    import gradcomp.torch as package

    results = spawn(_train_rank, 2)
    out.write_text(json.dumps({"extension": ext.__file__, "package": package.__file__,
                               "ranks": [results[r] for r in range(2)]}), encoding="utf-8")


def run(cmd: List[str], **kwargs: Any) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--train", type=Path)
    parser.add_argument("--source", type=Path)
    parser.add_argument("--work", type=Path)
    parser.add_argument("--reference", type=Path)
    args = parser.parse_args()
    if args.train:
        train(args.train)
        return 0
    if not (args.source and args.work and args.reference):
        parser.error("--source, --work and --reference are needed (or --train)")

    work = args.work.resolve()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # pip builds in the tree it is given, and setuptools keeps what it built there (under
    # build/setuptools): a copy of what the package needs, made fresh here, is compiled from
    # scratch every time, whatever an earlier install left in the checkout.
    source = work / "source"
    source.mkdir()
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy2(args.source / name, source / name)
    for name in ("include", "python"):
        shutil.copytree(args.source / name, source / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    venv = work / "venv"
    run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
    python = str(venv / "bin" / "python")
    # --no-index: nothing is fetched (torch, setuptools and wheel are the system's); the
    # environment without PYTHONPATH, so that nothing but the install provides gradcomp.
    # No PYTHONPATH, no user site and no pip settings from outside.
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("PIP_")}
    clean["PYTHONNOUSERSITE"] = "1"
    run([python, "-m", "pip", "install", "--no-build-isolation", "--no-index", "."],
        cwd=source, env=clean)

    installed, reference = work / "installed.json", work / "reference.json"
    run([python, str(Path(__file__).resolve()), "--train", str(installed)], cwd=work, env=clean)
    run([sys.executable, str(Path(__file__).resolve()), "--train", str(reference)], cwd=work,
        env={**clean, "PYTHONPATH": str(args.reference.resolve())})

    got = json.loads(installed.read_text(encoding="utf-8"))
    want = json.loads(reference.read_text(encoding="utf-8"))
    failures = []
    site = (venv / "lib").resolve()
    for what in ("extension", "package"):
        if not Path(got[what]).resolve().is_relative_to(site):
            failures.append(f"the installed run imported {got[what]}, not the {what} in {site}")
    if not Path(want["extension"]).resolve().is_relative_to(args.reference.resolve()):
        failures.append(f"the reference run imported {want['extension']}, not {args.reference}")
    if got["ranks"][0]["params"] != got["ranks"][1]["params"]:
        failures.append("the installed package's ranks ended with different parameters")
    if got["ranks"] != want["ranks"]:
        failures.append(f"installed and CMake-built packages differ:\n  installed {got['ranks']}\n"
                        f"  CMake     {want['ranks']}")
    for f in failures:
        print("FAILED:", f)
    if not failures:
        print(f"pip install --no-build-isolation: {got['extension']}; {STEPS} steps on 2 ranks "
              f"equal the CMake build's bit for bit (losses {got['ranks'][0]['losses']})")
    shutil.rmtree(venv, ignore_errors=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
