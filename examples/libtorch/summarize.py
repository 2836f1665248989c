#!/usr/bin/env python3
"""The LibTorch example's results table, from the logs examples/libtorch/results.sh keeps.

usage: examples/libtorch/summarize.py DIR > DIR/table.md
       examples/libtorch/summarize.py DIR --curves   "row epoch accuracy MB" per seeded row
                                                     and epoch, means over the seeds (plot.sh)
       examples/libtorch/summarize.py DIR --check    exit 1 unless DIR/table.md is the table
                                                     these logs give (ctest)

Each DIR/<row>_seed<S>.txt ends with train_libtorch's JSON line; rows are grouped over their
seeds (mean test accuracy, and the difference to dense's mean), bytes per worker are the
mean over seeds, relative to dense's. Runs without seeds (<row>.txt) get a line each, with
the overlap LAGS measured. Plain Python 3, no third-party modules.
"""
import contextlib
import io
import json
import os
import re
import sys
from typing import Dict, List, Tuple

LABELS = {
    "dense": "dense (fp32 allreduce)",
    "topk_0.01": "top-k 0.01 + residual",
    "dgc_0.001": "DGC 0.001 (1-epoch warm-up)",
    "lags_0.001": "LAGS, rho_min 0.001, measured link",
    "lags_0.001_1gbit": "LAGS, rho_min 0.001, planned for 1 Gbit/s",
    "pqasgd_p4_qsgd_2bit": "PQASGD p = 4, QSGD 2-bit",
    "lags_0.001_1gbit_2workers": "LAGS, rho_min 0.001, planned for 1 Gbit/s, 2 gloo processes",
    "lags_0.001_1gbit_2workers_threads": "LAGS, rho_min 0.001, planned for 1 Gbit/s, 2 threads",
    "lags_0.001_1gbit_2workers_mpi": "LAGS, rho_min 0.001, planned for 1 Gbit/s, 2 MPI ranks",
    "lags_0.001_2workers": "LAGS, rho_min 0.001, measured link, 2 gloo processes",
}


EPOCH = re.compile(r"^epoch (\d+)/\d+ .* test_acc ([0-9.]+)\s+bytes_sent (\d+)")


def epochs(path: str) -> List[Tuple[int, float, float]]:
    """(epoch, test accuracy, bytes sent per worker) per epoch line of a log."""
    out = []
    with open(path) as f:
        for line in f:
            m = EPOCH.match(line)
            if m:
                out.append((int(m.group(1)), float(m.group(2)), float(m.group(3))))
    return out


def curves(folder: str) -> int:
    rows: Dict[str, Dict[int, List[Tuple[float, float]]]] = {}
    for name in sorted(os.listdir(folder)):
        m = re.fullmatch(r"(.+)_seed(\d+)\.txt", name)
        if not m:
            continue
        for epoch, acc, sent in epochs(os.path.join(folder, name)):
            rows.setdefault(m.group(1), {}).setdefault(epoch, []).append((acc, sent))
    for row in sorted(rows):
        for epoch in sorted(rows[row]):
            pts = rows[row][epoch]
            acc = sum(a for a, _ in pts) / len(pts)
            sent = sum(b for _, b in pts) / len(pts)
            print(f"{row} {epoch} {acc:.4f} {sent / 1e6:.4f}")
    return 0


def load(path: str) -> Tuple[str, dict]:
    with open(path) as f:
        lines = f.read().splitlines()
    command = lines[0].lstrip("# ") if lines and lines[0].startswith("#") else ""
    for line in reversed(lines):
        if line.startswith("{"):
            return command, json.loads(line)
    raise SystemExit(f"summarize.py: {path} has no JSON line (did the run fail?)")


def main(argv: List[str]) -> int:
    if len(argv) == 3 and argv[2] == "--curves":
        return curves(argv[1])
    if len(argv) == 3 and argv[2] == "--check":
        made = io.StringIO()
        with contextlib.redirect_stdout(made):
            table(argv[1])
        with open(os.path.join(argv[1], "table.md")) as f:
            kept = f.read()
        if made.getvalue() != kept:
            print(f"summarize.py: {argv[1]}/table.md is not the table its logs give; rerun summarize.py",
                  file=sys.stderr)
            return 1
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    return table(argv[1])


def table(folder: str) -> int:
    seeded: Dict[str, List[Tuple[int, str, dict]]] = {}
    single: Dict[str, Tuple[str, dict]] = {}
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".txt"):
            continue
        command, result = load(os.path.join(folder, name))
        if "train_libtorch" not in command:
            continue  # not a training run (step_bench.txt)
        m = re.fullmatch(r"(.+)_seed(\d+)\.txt", name)
        if m:
            seeded.setdefault(m.group(1), []).append((int(m.group(2)), command, result))
        else:
            single[name[:-4]] = (command, result)
    if "dense" not in seeded:
        raise SystemExit("summarize.py: no dense_seed*.txt to compare with")

    def mean(xs: List[float]) -> float:
        return sum(xs) / len(xs)

    dense_acc = mean([r["test_accuracy"] for _, _, r in seeded["dense"]])
    dense_bytes = mean([r["bytes_sent_per_worker"] for _, _, r in seeded["dense"]])
    print("| method | command (seed 1) | test accuracy (seeds) | mean | vs dense | bytes per worker | of dense's | overlap |")
    print("|---|---|---|---|---|---|---|---|")
    order = [k for k in LABELS if k in seeded] + sorted(k for k in seeded if k not in LABELS)
    for row in order:
        runs = sorted(seeded[row])
        accs = [r["test_accuracy"] for _, _, r in runs]
        sent = mean([r["bytes_sent_per_worker"] for _, _, r in runs])
        overlaps = [r["overlap"] for _, _, r in runs if "overlap" in r]
        print(f"| {LABELS.get(row, row)} | `{runs[0][1]}` | {', '.join(f'{a:.4f}' for a in accs)} "
              f"| {mean(accs):.4f} | {100 * (mean(accs) - dense_acc):+.2f} pt | {sent / 1e6:.2f} MB "
              f"| {100 * sent / dense_bytes:.2f}% | {f'{100 * mean(overlaps):.0f}%' if overlaps else '-'} |")
    for row, (command, r) in sorted(single.items(), key=lambda kv: list(LABELS).index(kv[0]) if kv[0] in LABELS else len(LABELS)):
        overlap = f"{100 * r['overlap']:.0f}%" if "overlap" in r else "-"
        share = r["bytes_sent_per_worker"] / r["dense_bytes_per_worker"]
        print(f"| {LABELS.get(row, row)} | `{command}` | {r['test_accuracy']:.4f} | - | - "
              f"| {r['bytes_sent_per_worker'] / 1e6:.2f} MB | {100 * share:.2f}% of its own dense | {overlap} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
