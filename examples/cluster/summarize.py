#!/usr/bin/env python3
"""Tables from the emulated cluster's logs (scripts/cluster_measure.sh), as Markdown.

    python3 examples/cluster/summarize.py [--dir results/cluster] [--target 0.85] [--check]
    python3 examples/cluster/summarize.py --dir results/cluster --across RATE P N DENSITY [--check]

--check: exit 1 unless DIR/summary.md (with --across: DIR/across_RATE_pP_N_DENSITY.md) is what
the logs give (ctest cluster_summarize, cluster_across).

--across: one cell (link, P, n, density) in every re-run kept under DIR (DIR/rerun_*, in the
order of their logs' dates): each exchange's measured milliseconds, the model's pick, the
fastest measured and the pick against it, so that a reader sees how far the measurements move
from run to run and whether any one pick could be within 10% in all of them.

calibration: alpha, beta and the burst measured at each configured rate, next to the rate and
the token bucket scripts/cluster.sh configures; exchanges: the cost model
(+local) against the measurement for every exchange, P, n and density, and whether the
model's pick was the fastest (or within 10% of it); time to accuracy: for each method the
training seconds (the eval lines' clock, which leaves the evaluations out), steps and bytes
per worker until the test accuracy first reached the target, the speedup over dense, and the
training seconds of the whole run. Any python3 runs it (no torch needed).
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import io
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

RATE_BITS = {"100mbit": 1e8, "1gbit": 1e9, "10gbit": 1e10}
# exchange_model's lines: a row of the model against the measurement, and the pick after a cell.
ROW = re.compile(r"^\s*(\d+)\s+([0-9.e-]+)\s+(\S+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s+([0-9.]+)\s*$")
PICK = re.compile(r"picks (\S+); fastest measured: (\S+); the pick measured ([0-9.]+)x the fastest")
# The token bucket scripts/cluster.sh gives each shaped port at that rate.
BUCKET_BYTES = {"100mbit": 3028, "1gbit": 16384, "10gbit": 32768}


def calibration(d: str) -> List[str]:
    rows = ["| configured rate | alpha (us) | beta (ns/byte) | measured rate (Mbit/s) | measured / configured "
            "| burst (bytes) | bucket (bytes) |",
            "|---|---|---|---|---|---|---|"]
    pat = re.compile(r"alpha = ([0-9.e+-]+) us, beta = ([0-9.e+-]+) ns/byte")
    burst_pat = re.compile(r"burst = ([0-9.e+-]+) bytes")
    for rate in ("100mbit", "1gbit", "10gbit"):
        path = os.path.join(d, f"calibrate_{rate}.txt")
        if not os.path.exists(path):
            continue
        text = open(path).read()
        m = pat.search(text)
        if not m:
            raise SystemExit(f"summarize.py: no alpha/beta line in {path}")
        alpha, beta = float(m.group(1)), float(m.group(2))
        mbit = 8e3 / beta if beta > 0 else float("inf")  # bytes/ns -> Mbit/s
        b = burst_pat.search(text)  # logs before the burst was measured have none
        burst = f"{float(b.group(1)):.0f}" if b else "-"
        rows.append(f"| {rate} | {alpha:.3g} | {beta:.4g} | {mbit:.4g} | {mbit * 1e6 / RATE_BITS[rate]:.2f} "
                    f"| {burst} | {BUCKET_BYTES[rate]} |")
    return rows


@dataclass
class Cell:
    """One (n, density) of an exchanges log: each exchange's row as printed (name, model ms,
    measured ms) and the pick line's (model picks, fastest measured, pick / fastest)."""
    n: str
    rho: str
    rows: List[Tuple[str, str, str]] = field(default_factory=list)
    pick: Optional[Tuple[str, str, str]] = None


def cells(path: str) -> List[Cell]:
    """The cells of one exchanges log, in its order."""
    out: List[Cell] = []
    for line in open(path):
        m = ROW.match(line)
        if m:
            n, rho, name, _net, model, measured, _ratio = m.groups()
            if not out or out[-1].pick is not None or (out[-1].n, out[-1].rho) != (n, rho):
                out.append(Cell(n, rho))
            out[-1].rows.append((name, model, measured))
            continue
        m = PICK.search(line)
        if m and out and out[-1].pick is None:
            out[-1].pick = (m.group(1), m.group(2), m.group(3))
    return out


def exchanges(d: str) -> Tuple[List[str], List[str], float, int, int]:
    """The model-against-measurement rows, the pick rows, the worst ratio, picks good, picks."""
    table = ["| link | P | n | density | exchange | model (ms) | measured (ms) | measured / model |",
             "|---|---|---|---|---|---|---|---|"]
    picks = ["| link | P | n | density | model picks | fastest measured | pick / fastest |",
             "|---|---|---|---|---|---|---|"]
    worst, good, total = 1.0, 0, 0
    for rate in ("100mbit", "1gbit"):
        for p in (2, 4):
            path = os.path.join(d, f"exchanges_{rate}_p{p}.txt")
            if not os.path.exists(path):
                continue
            for c in cells(path):
                for name, model, measured in c.rows:
                    r = float(measured) / float(model) if float(model) > 0 else float("inf")
                    worst = max(worst, r, 1.0 / r if r > 0 else float("inf"))
                    table.append(f"| {rate} | {p} | {c.n} | {c.rho} | {name} | {float(model):.3f} | "
                                 f"{float(measured):.3f} | {r:.2f} |")
                if c.pick:
                    chosen, fastest, ratio = c.pick
                    total += 1
                    good += float(ratio) <= 1.10
                    picks.append(f"| {rate} | {p} | {c.n} | {c.rho} | {chosen} | {fastest} | "
                                 f"{float(ratio):.2f} |")
    return table, picks, worst, good, total


def tta(d: str, target: float) -> List[str]:
    evals = re.compile(r"^eval step (\d+)\s+train_seconds ([0-9.]+)\s+test_acc ([0-9.]+)\s+bytes_sent ([0-9.]+)")
    results: List[Tuple[str, Optional[Tuple[int, float, float]], float, Dict]] = []
    for path in sorted(glob.glob(os.path.join(d, "tta_*.txt"))):
        name = os.path.basename(path)[4:-4]
        reached = None
        best = 0.0
        last_sec = float("nan")  # training seconds at the last evaluation: the whole run
        summary: Dict = {}
        for line in open(path):
            m = evals.match(line)
            if m:
                step, sec, acc, sent = int(m.group(1)), float(m.group(2)), float(m.group(3)), float(m.group(4))
                best = max(best, acc)
                last_sec = sec
                if reached is None and acc >= target:
                    reached = (step, sec, sent)
            elif line.startswith("{"):
                summary = json.loads(line)
        summary["train_seconds"] = last_sec
        results.append((name, reached, best, summary))
    dense = next((r for r in results if r[0] == "dense"), None)
    dense_sec = dense[1][1] if dense and dense[1] else None
    rows = [f"| method | seconds to {target:.0%} | steps | MB sent per worker | speedup over dense | "
            f"best test accuracy | seconds for all {results[0][3].get('epochs', '?') if results else '?'} epochs |",
            "|---|---|---|---|---|---|---|"]
    for name, reached, best, summary in results:
        total = f"{summary['train_seconds']:.1f}"
        if reached:
            step, sec, sent = reached
            speed = f"{dense_sec / sec:.2f}x" if dense_sec else "-"
            rows.append(f"| {name} | {sec:.1f} | {step} | {sent / 1e6:.2f} | {speed} | {best:.4f} | {total} |")
        else:
            rows.append(f"| {name} | not reached | - | - | - | {best:.4f} | {total} |")
    return rows


def across(d: str, rate: str, p: int, n: int, rho: float) -> List[str]:
    date = re.compile(r"^# (\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ), git (\S+)")
    names = ("dense_allreduce", "sparse_allgather", "topk_a2a", "gtopk")
    runs = []
    for path in glob.glob(os.path.join(d, "rerun_*", f"exchanges_{rate}_p{p}.txt")):
        dated = [date.match(line) for line in open(path)]
        when = next((f"{m.group(1)} ({m.group(2)})" for m in dated if m), "")
        cell = next((c for c in cells(path) if int(c.n) == n and float(c.rho) == rho), None)
        measured = {name: float(ms) for name, _model, ms in cell.rows} if cell else {}
        chosen = (cell.pick[0], cell.pick[1], float(cell.pick[2])) if cell and cell.pick else None
        if chosen is None or set(measured) != set(names):
            raise SystemExit(f"summarize.py: {path} has no complete cell n = {n}, density {rho:g}")
        if not when:
            raise SystemExit(f"summarize.py: {path} has no '# <date>, git <commit>' line")
        runs.append((when, os.path.basename(os.path.dirname(path)), measured, chosen))
    if not runs:
        raise SystemExit(f"summarize.py: no {d}/rerun_*/exchanges_{rate}_p{p}.txt")
    runs.sort()
    rows = ["| run | " + " | ".join(f"{x} (ms)" for x in names) + " | model picks | fastest measured | pick / fastest |",
            "|---|" + "---|" * (len(names) + 3)]
    for when, name, measured, (chosen, fastest, ratio) in runs:
        rows.append(f"| {name} | " + " | ".join(f"{measured[x]:.3f}" for x in names) +
                    f" | {chosen} | {fastest} | {ratio:.2f} |")
    # The best any one fixed pick could have done: for each exchange, its worst ratio to the
    # fastest over the runs.
    worst = {x: max(r[2][x] / min(r[2].values()) for r in runs) for x in names}
    best = min(worst, key=lambda x: worst[x])
    rows.append("")
    rows.append(f"{rate}, P = {p}, n = {n}, density {rho:g}, {len(runs)} runs. Any one exchange picked in "
                f"every run measured, in its worst run, this much of that run's fastest: " +
                ", ".join(f"{x} {worst[x]:.2f}x" for x in names) + f"; the best fixed pick is {best}.")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default="results/cluster")
    ap.add_argument("--target", type=float, default=0.85)
    ap.add_argument("--check", action="store_true", help="compare with DIR/summary.md")
    ap.add_argument("--across", nargs=4, metavar=("RATE", "P", "N", "DENSITY"),
                    help="one cell in every DIR/rerun_* (e.g. 1gbit 4 1048576 0.001)")
    a = ap.parse_args()
    if not os.path.isdir(a.dir):
        print(f"summarize.py: no directory {a.dir}", file=sys.stderr)
        return 2
    if a.across:
        rate, p, n, rho_text = a.across
        try:
            rho = float(rho_text)
        except ValueError:
            rho = -1.0
        if rate not in RATE_BITS or not p.isdigit() or not n.isdigit() or not 0.0 < rho <= 1.0:
            print(f"summarize.py: --across wants RATE (one of {', '.join(RATE_BITS)}), P, N and a DENSITY "
                  f"in (0, 1], not {' '.join(a.across)}", file=sys.stderr)
            return 2
        kept_name = f"across_{rate}_p{int(p)}_{int(n)}_{rho:g}.md"
        make = lambda: print("\n".join(across(a.dir, rate, int(p), int(n), rho)))  # noqa: E731
    else:
        kept_name = "summary.md"
        make = lambda: summarize(a.dir, a.target)  # noqa: E731
    if a.check:
        made = io.StringIO()
        with contextlib.redirect_stdout(made):
            make()
        kept_path = os.path.join(a.dir, kept_name)
        if not os.path.exists(kept_path):
            print(f"summarize.py: no {kept_path} to check; write it with the same command without --check",
                  file=sys.stderr)
            return 1
        with open(kept_path) as f:
            kept = f.read()
        if made.getvalue() != kept:
            print(f"summarize.py: {a.dir}/{kept_name} is not what its logs give; rerun summarize.py",
                  file=sys.stderr)
            return 1
        return 0
    make()
    return 0


def summarize(d: str, target: float) -> None:
    print("## Calibration\n")
    print("\n".join(calibration(d)))
    table, picks, worst, good, total = exchanges(d)
    print("\n## Exchanges: the model against the measurement\n")
    print("\n".join(table))
    print(f"\nWorst ratio either way: {worst:.2f}x.\n")
    print("\n".join(picks))
    print(f"\nThe model's pick was the fastest measured or within 10% of it in {good} of {total} cases.")
    print("\n## Time to accuracy\n")
    print("\n".join(tta(d, target)))


if __name__ == "__main__":
    sys.exit(main())
