#!/usr/bin/env python3
"""The PyTorch results table from the runs examples/torch/results.sh keeps.

    examples/torch/summarize.py results/torch            > results/torch/table.md
    examples/torch/summarize.py results/torch --curves   (for examples/torch/plot.sh)

Each row is the mean over the seeds found (<row>_seed<S>.txt; the last line of each is the
example's JSON). Bytes are per worker, as a share of what the allreduce of the same model
sends (4 bytes per parameter per step); accuracy and step time are compared with the
allreduce row of the same model.
"""

import json
import os
import re
import statistics
import sys
from typing import Any, Dict, List

LABELS = {
    "allreduce": "PyTorch allreduce (fp32)",
    "fp16": "PyTorch fp16_compress_hook",
    "powersgd1": "PyTorch PowerSGD, rank 1",
    "powersgd4": "PyTorch PowerSGD, rank 4",
    "topk_0.01": "gradcomp top-k 0.01",
    "topk_0.001": "gradcomp top-k 0.001",
    "dgc_0.001": "gradcomp DGC 0.001",
    "gaussiank_0.001": "gradcomp Gaussian-k 0.001",
    "qsgd_4bit": "gradcomp QSGD 4-bit (dense)",
    "topk_0.01_dgcfb": "gradcomp top-k 0.01, DGC momentum correction",
    "dgc_0.001_warmup": "gradcomp DGC 0.001, 1-epoch warm-up",
}


MODELS = {"cnn": "CNN", "cnnsplit": "CNN, 0.05 MB buckets", "mlp": "MLP"}


FAILED: Dict[str, List[int]] = {}  # row -> seeds whose run ended without its JSON line


def load(folder: str) -> Dict[str, List[Dict[str, Any]]]:
    rows: Dict[str, List[Dict[str, Any]]] = {}
    for name in sorted(os.listdir(folder)):
        m = re.fullmatch(r"(.+)_seed(\d+)\.txt", name)
        if not m:
            continue
        with open(os.path.join(folder, name)) as f:
            lines = [line for line in f.read().splitlines() if line.startswith("{")]
        if not lines:
            FAILED.setdefault(m.group(1), []).append(int(m.group(2)))
            continue
        rows.setdefault(m.group(1), []).append(json.loads(lines[-1]))
    return rows


def curves(folder: str) -> None:
    """Per row and epoch, the seed means of test accuracy and MB sent per worker: the
    example's epoch lines, "epoch E loss L test_accuracy A bytes_sent B (...)"."""
    per: Dict[str, Dict[int, List[tuple]]] = {}
    for name in sorted(os.listdir(folder)):
        m = re.fullmatch(r"(.+)_seed(\d+)\.txt", name)
        if not m:
            continue
        with open(os.path.join(folder, name)) as f:
            for line in f:
                w = line.split()
                if len(w) >= 8 and w[0] == "epoch":
                    per.setdefault(m.group(1), {}).setdefault(int(w[1]), []).append((float(w[5]), float(w[7])))
    for row, epochs in per.items():
        print(f"# {row}")
        for e in sorted(epochs):
            acc = statistics.mean(a for a, _ in epochs[e])
            mb = statistics.mean(b for _, b in epochs[e]) / 1e6
            print(f"{row} {e} {acc:.4f} {mb:.4f}")
        print()
        print()


def main() -> int:
    folder = sys.argv[1] if len(sys.argv) > 1 else "results/torch"
    if "--curves" in sys.argv[2:]:
        curves(folder)
        return 0
    rows = load(folder)
    summary = {}
    for row, runs in rows.items():
        model, _, method = row.partition("_")
        summary[row] = {
            "model": model,
            "method": method,
            "seeds": sorted(r["seed"] for r in runs),
            "accuracy": statistics.mean(r["test_accuracy"] for r in runs),
            "accuracies": [r["test_accuracy"] for r in sorted(runs, key=lambda r: r["seed"])],
            "bytes": statistics.mean(r["bytes_sent_per_worker"] for r in runs),
            "dense": statistics.mean(r["dense_bytes_per_worker"] for r in runs),
            "step_ms": statistics.mean(r["step_ms_median"] for r in runs),
            "hidden": statistics.mean(r.get("comm_hidden_mean") or 0.0 for r in runs),
            "hook": runs[0]["hook"],
        }
    print("| model | method | `--hook` | test accuracy (seeds 1, 2, 3) | mean | vs allreduce | bytes per worker | of allreduce's | median step | vs allreduce | communication hidden |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row, s in summary.items():
        base = summary.get(f"{s['model']}_allreduce")
        d_acc = f"{100 * (s['accuracy'] - base['accuracy']):+.2f} pt" if base else ""
        d_step = f"{s['step_ms'] / base['step_ms']:.2f}x" if base else ""
        accs = ", ".join(f"{a:.4f}" for a in s["accuracies"])
        if row in FAILED:
            accs += "; seed " + ", ".join(map(str, FAILED[row])) + ": diverged (stopped at a non-finite gradient)"
        print(
            f"| {MODELS.get(s['model'], s['model'])} | {LABELS.get(s['method'], s['method'])} | `{s['hook']}` | {accs} | "
            f"{s['accuracy']:.4f} | {d_acc} | {s['bytes'] / 1e6:.2f} MB | {100 * s['bytes'] / s['dense']:.2f}% | "
            f"{s['step_ms']:.1f} ms | {d_step} | {100 * s['hidden']:.0f}% |"
        )
    for row, seeds in FAILED.items():
        if row not in summary:
            print(f"| {row} | every run diverged (seeds {', '.join(map(str, seeds))}) | | | | | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
