#!/usr/bin/env python3
"""The top-k contraction over training, from the Fashion-MNIST logs in results/.

delta = ||acc on the selection||^2 / ||acc||^2 per step (rank 0, compress_stats::contraction),
as train_fashion_mnist's JSON line reports it in "contraction" (one list per step, one value
per tensor). This script summarises it per epoch next to k/n, and writes the per-step series
for examples/plot_contraction.sh.

usage: examples/contraction.py [--results DIR] [--dat DIR] [--check FILE]
  (default)     the markdown table to stdout
  --dat DIR     also one DIR/<row>.dat per run: step, delta (mean over tensors), k/n, and the
                mean of delta over the last WINDOW (25) steps
  --check FILE  exit 1 unless every row's log has the series and FILE (docs/training.md)
                holds the table exactly
Standard library only.
"""
import json
import math
import os
import sys
from typing import List, Optional, Tuple

WINDOW = 25  # steps in the plot's running mean

# row (results/<row>.txt) and its legend, in table order
ROWS: List[Tuple[str, str]] = [
    ("topk_0.01", "top-k 0.01"),
    ("topk_0.001", "top-k 0.001"),
    ("gaussiank_0.001", "Gaussian-k 0.001"),
    ("gaussiank_published_0.001", "Gaussian-k 0.001, the paper's corrections"),
    ("randomk_0.01_no_momentum", "random-k 0.01, momentum 0"),
    ("topk_0.01_per_layer", "top-k 0.01, per layer (mean of the 3 layers)"),
]


def load(path: str) -> Optional[dict]:
    try:
        with open(path) as f:
            lines = [line for line in f if line.startswith("{")]
    except FileNotFoundError:
        return None
    return json.loads(lines[-1]) if lines else None


def series(doc: dict) -> List[Optional[float]]:
    """Per step, the mean over tensors of the measured values (None where none was)."""
    out: List[Optional[float]] = []
    for step in doc.get("contraction", []):
        vals = [v for v in step if v is not None and math.isfinite(v)]
        out.append(sum(vals) / len(vals) if vals else None)
    return out


def epoch_means(values: List[Optional[float]], epochs: int) -> List[str]:
    per = len(values) // epochs if epochs else 0
    cells = []
    for e in range(epochs):
        chunk = [v for v in values[e * per:(e + 1) * per] if v is not None]
        cells.append(f"{sum(chunk) / len(chunk):.3f}" if chunk else "-")
    return cells


def table(results: str, dat: Optional[str], missing: List[str]) -> str:
    """The markdown table; rows whose log is absent or has no contraction go to `missing`."""
    lines = ["| run | k/n | delta, epoch 1 | epoch 2 | epoch 3 | delta / (k/n), epoch 3 |",
             "|---|---|---|---|---|---|"]
    for row, legend in ROWS:
        doc = load(os.path.join(results, row + ".txt"))
        if doc is None or "contraction" not in doc:
            missing.append(row)
            continue
        values = series(doc)
        epochs = int(doc["epochs"])
        cells = epoch_means(values, epochs)
        density = float(doc["density"])
        last = cells[-1]
        ratio = f"{float(last) / density:.0f}x" if last != "-" else "-"
        lines.append(f"| {legend} | {density:g} | " + " | ".join(cells) + f" | {ratio} |")
        if dat:
            os.makedirs(dat, exist_ok=True)
            with open(os.path.join(dat, row + ".dat"), "w") as f:
                window: List[float] = []
                for i, v in enumerate(values):
                    if v is None:
                        continue
                    window = (window + [v])[-WINDOW:]
                    f.write(f"{i + 1} {v:.6g} {density:g} {sum(window) / len(window):.6g}\n")
    return "\n".join(lines) + "\n"


def main() -> int:
    args = sys.argv[1:]
    here = os.path.dirname(os.path.abspath(__file__))
    results = os.path.join(here, "..", "results")
    dat = None
    check = None
    while args:
        opt = args.pop(0)
        if opt in ("--results", "--dat", "--check") and args:
            value = args.pop(0)
            if opt == "--results":
                results = value
            elif opt == "--dat":
                dat = value
            else:
                check = value
        else:
            print(__doc__, file=sys.stderr)
            return 2
    missing: List[str] = []
    text = table(results, dat, missing)
    if check:
        if missing:
            print(f"contraction.py: no contraction in the logs of {', '.join(missing)} in {results}",
                  file=sys.stderr)
            return 1
        with open(check) as f:
            doc = f.read()
        if text not in doc:
            print(f"contraction.py: {check} does not hold the table the logs give:\n{text}",
                  file=sys.stderr)
            return 1
        print(f"contraction.py: {check} holds the table of {results}")
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
