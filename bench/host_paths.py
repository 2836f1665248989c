#!/usr/bin/env python3
"""The host targets on two paths side by side, from two gradcomp_bench JSON runs.

usage: bench/host_paths.py AVX2.json WIDEST.json   (bench/host_paths.sh makes both)

Times are medians of the repetitions. Each ratio divides by the baseline of the same run
(a copy, a streaming read, accumulate: read e and g, write e), so the two columns compare
paths without trusting two runs to see the same memory speed.
"""
import json
import re
import sys
from typing import Dict, List, Tuple

N = 25557032
NAME = re.compile(r"^(?P<family>[^/]+/[^/]+)/n:(?P<n>\d+)(?:/ppm:(?P<ppm>\d+))?$")

# (benchmark, ppm or None, baseline, bound): at most `bound` times the baseline.
TARGETS: List[Tuple[str, object, str, float]] = [
    ("quantize/terngrad_encode", None, "baseline/copy", 2.0),
    ("quantize/qsgd4_encode", None, "baseline/copy", 2.0),
    ("quantize/fp16_encode", None, "baseline/copy", 0.0),
    ("quantize/scaled_sign_encode", None, "baseline/copy", 0.0),
    ("quantize/draws", None, "baseline/copy", 0.0),
    ("step/topk_residual", 1000, "baseline/accumulate", 1.15),
    ("step/topk_residual", 10000, "baseline/accumulate", 1.15),
    ("step/topk_qsgd_residual", 1000, "baseline/accumulate", 1.4),
    ("step/topk_qsgd_residual", 10000, "baseline/accumulate", 1.4),
    ("step/gaussiank_residual", 1000, "baseline/accumulate", 1.3),
    ("step/gaussiank_residual", 10000, "baseline/accumulate", 1.3),
    ("select/topk", 1000, "baseline/stream_read", 1.3),
    ("select/topk", 10000, "baseline/stream_read", 1.3),
]


def load(path: str) -> Tuple[Dict[Tuple[str, object], dict], str]:
    with open(path) as f:
        doc = json.load(f)
    runs: Dict[Tuple[str, object], dict] = {}
    for b in doc["benchmarks"]:
        m = NAME.match(b["run_name"])
        if not m or int(m["n"]) != N or b.get("error_occurred"):
            continue
        if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
            continue
        scale = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b["time_unit"]]
        ppm = int(m["ppm"]) if m["ppm"] else None
        rec = {"ms": b["real_time"] * scale}
        for part in ("select_ms", "encode_ms"):
            if part in b:
                rec[part] = b[part]
        runs[(m["family"], ppm)] = rec
    return runs, doc.get("context", {}).get("gradcomp_host_isa", "?")


def cell(runs: Dict[Tuple[str, object], dict], name: str, ppm: object, base: str) -> Tuple[str, float]:
    r = runs.get((name, ppm))
    b = runs.get((base, None))
    if r is None or b is None:
        return "-", float("nan")
    ratio = r["ms"] / b["ms"]
    text = f"{r['ms']:.2f} ms ({ratio:.2f}x)"
    if "select_ms" in r:
        text += f" [select {r['select_ms']:.2f}, encode {r['encode_ms']:.2f}]"
    return text, ratio


def main() -> int:
    if len(sys.argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    left, left_isa = load(sys.argv[1])
    right, right_isa = load(sys.argv[2])
    print(f"| benchmark | baseline | target | {left_isa} | {right_isa} |")
    print("|---|---|---|---|---|")
    for base in ("baseline/copy", "baseline/stream_read", "baseline/accumulate"):
        cells = [f"{runs[(base, None)]['ms']:.2f} ms" if (base, None) in runs else "-"
                 for runs in (left, right)]
        print(f"| `{base}` | | | {cells[0]} | {cells[1]} |")
    for name, ppm, base, bound in TARGETS:
        label = f"`{name}`" + (f" ppm {ppm}" if ppm else "")
        texts = []
        for runs in (left, right):
            text, ratio = cell(runs, name, ppm, base)
            if bound > 0 and ratio == ratio:
                text += " met" if ratio <= bound else " **missed**"
            texts.append(text)
        target = f"<= {bound}x" if bound > 0 else ""
        print(f"| {label} | `{base.split('/')[1]}` | {target} | {texts[0]} | {texts[1]} |")
    for ppm in (1000, 10000):
        parts = []
        for runs in (left, right):
            t = runs.get(("select/topk", ppm))
            nth = runs.get(("baseline/nth_element", ppm))
            parts.append(f"{nth['ms'] / t['ms']:.1f}x" if t and nth else "-")
        print(f"| `select/topk` ppm {ppm} faster than `nth_element` by | | >= 20x | "
              f"{parts[0]} | {parts[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
