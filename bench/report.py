#!/usr/bin/env python3
"""Turns gradcomp_bench JSON output into the tables of docs/performance.md and the plot's data.

usage: bench/report.py RESULT.json            markdown tables and the targets, to stdout
       bench/report.py RESULT.json --dat DIR  also one gnuplot data file per series in DIR

Times are the best (minimum) of the repetitions when the run has a `min` aggregate (the
suite registers one), else the median, else the single run. GB/s = n * 4 bytes / time, 1 GB
= 1e9 bytes: the gradient's size over the time, so GB/s compare like inverse times.
"""
import json
import math
import os
import re
import sys

NAME = re.compile(r"^(?P<family>[^/]+/[^/]+)/n:(?P<n>\d+)(?:/ppm:(?P<ppm>\d+))?$")
LOCAL = re.compile(r"^exchange_local/(?P<exchange>[^/]+)/n:(?P<n>\d+)/ppm:(?P<ppm>\d+)/ranks:(?P<ranks>\d+)$")
PPMS = (100, 1000, 10000)
HEAVY = ("_laplace", "_t3")
# The step benchmarks' own stopwatch (compress_stats), ms per call.
STEP_PARTS = ("select_ms", "encode_ms")


def load_local(path):
    """exchange_local runs: (exchange, n, ppm, ranks) -> best seconds (min, else median)."""
    with open(path) as f:
        doc = json.load(f)
    runs = {}
    for b in doc["benchmarks"]:
        m = LOCAL.match(b["run_name"])
        if not m or b.get("error_occurred"):
            continue
        agg = b.get("aggregate_name", "")
        if b.get("run_type") == "aggregate" and agg not in ("min", "median"):
            continue
        scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
        key = (m["exchange"], int(m["n"]), int(m["ppm"]), int(m["ranks"]))
        rank = {"min": 0, "median": 1}.get(agg, 2)
        if key not in runs or rank < runs[key][0]:
            runs[key] = (rank, b["real_time"] * scale)
    return {k: v[1] for k, v in runs.items()}


def load(path):
    with open(path) as f:
        doc = json.load(f)
    runs = {}
    for b in doc["benchmarks"]:
        if b.get("error_occurred"):
            continue
        m = NAME.match(b["run_name"])
        if not m:
            continue
        agg = b.get("aggregate_name", "")
        if b.get("run_type") == "aggregate" and agg not in ("min", "median"):
            continue
        scale = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}[b["time_unit"]]
        key = (m["family"], int(m["n"]), int(m["ppm"]) if m["ppm"] else None)
        rank = {"min": 0, "median": 1}.get(agg, 2)
        if key not in runs or rank < runs[key][0]:
            parts = {c: b[c] for c in STEP_PARTS if c in b}
            runs[key] = (rank, b["real_time"] * scale, b.get("in_band"), parts)
    return (doc.get("context", {}), {k: v[1] for k, v in runs.items()},
            {k: v[2] for k, v in runs.items() if v[2] is not None},
            {k: v[3] for k, v in runs.items() if v[3]})


def seconds(runs, family, n, ppm):
    return runs.get((family, n, ppm), runs.get((family, n, None)))


def cell(t, n):
    if t is None:
        return "-"
    return f"{t * 1e3:.2f} ms ({n * 4 / t / 1e9:.1f} GB/s)"


def main():
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    context, runs, in_band, parts = load(args[0])
    dat_dir = args[args.index("--dat") + 1] if "--dat" in args else None
    sizes = sorted({n for (_, n, _) in runs})
    n = 25557032 if 25557032 in sizes else sizes[-1]
    families = []
    for (fam, nn, _) in runs:
        if nn == n and fam not in families:
            families.append(fam)
    order = {"baseline": 0, "select": 1, "select_residual": 2, "step": 3, "step_in_place": 4,
             "step_pass": 5, "quantize": 6}
    normal = [f for f in families if not f.endswith(HEAVY)]
    normal.sort(key=lambda f: (order.get(f.split("/")[0], 9), families.index(f)))

    print(f"n = {n}, normal input; best of the repetitions, time (GB/s of the {n * 4 / 1e6:.0f} MB gradient)\n")
    print("| benchmark | ppm 100 | ppm 1000 | ppm 10000 |")
    print("|---|---|---|---|")
    for fam in normal:
        if fam.startswith("quantize/"):
            continue
        if (fam, n, None) in runs:
            t = runs[(fam, n, None)]
            print(f"| `{fam}` | {cell(t, n)} | (same) | (same) |")
        else:
            print(f"| `{fam}` | " + " | ".join(cell(runs.get((fam, n, p)), n) for p in PPMS) + " |")

    quant = [f for f in normal if f.startswith("quantize/")]
    if quant:
        print(f"\nQuantizers on all n = {n} values (encode and decode)\n")
        print("| quantizer | encode | decode |")
        print("|---|---|---|")
        names = sorted({f.rsplit("_", 1)[0] for f in quant}, key=lambda f: families.index(f + "_encode"))
        for q in names:
            print(f"| `{q.split('/')[1]}` | {cell(runs.get((q + '_encode', n, None)), n)} | "
                  f"{cell(runs.get((q + '_decode', n, None)), n)} |")

    heavy_rows = [f for f in normal if (f + HEAVY[0], n, 1000) in runs or (f + HEAVY[1], n, 1000) in runs]
    if heavy_rows:
        print(f"\nHeavy-tailed inputs, n = {n}, ppm = 1000: time and ratio to the normal input\n")
        print("| benchmark | normal | Laplace | Student-t (3) |")
        print("|---|---|---|---|")
        for fam in heavy_rows:
            t0 = runs.get((fam, n, 1000))
            cells = []
            for suf in HEAVY:
                t = runs.get((fam + suf, n, 1000))
                cells.append("-" if t is None or t0 is None else f"{t * 1e3:.2f} ms ({t / t0:.2f}x)")
            print(f"| `{fam}` | {t0 * 1e3:.2f} ms | " + " | ".join(cells) + " |")

    local = load_local(args[0])
    base = seconds(runs, "baseline/output_pass", n, None)
    local_rows = sorted({(x, p) for (x, nn, p, _) in local if nn == n})
    if local_rows and base:
        ranks = sorted({r for (_, nn, _, r) in local if nn == n})
        print(f"\nExchanges' local work, n = {n}: time and ratio to `baseline/output_pass` "
              f"({base * 1e3:.2f} ms, one write of the dense output)\n")
        print("| exchange | ppm | " + " | ".join(f"P = {r}" for r in ranks) + " |")
        print("|---|---|" + "---|" * len(ranks))
        for x, p in local_rows:
            cells = []
            for r in ranks:
                t = local.get((x, n, p, r))
                cells.append("-" if t is None else f"{t * 1e3:.2f} ms ({t / base:.2f}x)")
            print(f"| `{x}` | {p} | " + " | ".join(cells) + " |")

    def ratio(a, b, ppm=1000):
        ta, tb = seconds(runs, a, n, ppm), seconds(runs, b, n, ppm)
        return None if ta is None or tb is None else ta / tb

    floor = seconds(runs, "baseline/accumulate", n, None)
    steps = [f for f in normal if f.split("/")[0] in ("step", "step_in_place", "step_pass")]
    if floor and steps:
        print(f"\nSteps against their memory traffic, n = {n}, ppm = 1000: `baseline/accumulate` "
              f"(e + g streamed into a second buffer, {floor * 1e3:.2f} ms) is "
              f"{ratio('baseline/accumulate', 'baseline/stream_read', None):.2f}x "
              f"`baseline/stream_read` and {ratio('baseline/accumulate', 'baseline/copy', None):.2f}x "
              f"`baseline/copy`\n")
        print("| step | time | ratio to `baseline/accumulate` |")
        print("|---|---|---|")
        for fam in steps:
            t = seconds(runs, fam, n, 1000)
            if t is not None:
                print(f"| `{fam}` | {t * 1e3:.2f} ms | {t / floor:.2f}x |")

    # Where the staged top-k step's time goes: its stopwatch's parts (the counters' values in
    # the same aggregate as the time) beside the fused pass timed alone and the floor.
    step = seconds(runs, "step/topk_residual", n, 1000)
    step_parts = parts.get(("step/topk_residual", n, 1000), {})
    pass_alone = seconds(runs, "step_pass/topk_residual", n, 1000)
    if floor and step and pass_alone and len(step_parts) == len(STEP_PARTS):
        select_s = step_parts["select_ms"] * 1e-3
        encode_s = step_parts["encode_ms"] * 1e-3
        print(f"\nWhere `step/topk_residual` spends its time, n = {n}, ppm = 1000 (its own stopwatch; "
              f"counters of the same aggregate as the times)\n")
        print("| part | time | ratio to `baseline/accumulate` |")
        print("|---|---|---|")
        for text, t in (("`baseline/accumulate`: e + g streamed into a second buffer", floor),
                        ("`step_pass/topk_residual`: the fused pass alone", pass_alone),
                        ("`select_ms`: accumulate and select (sample, pass, exact finish)", select_s),
                        ("`encode_ms`: gather, encode, decode, feedback update", encode_s),
                        ("the whole step", step)):
            print(f"| {text} | {t * 1e3:.2f} ms | {t / floor:.2f}x |")

    targets = [
        ("`select/topk` at least 20x faster than `baseline/nth_element`",
         ratio("baseline/nth_element", "select/topk"), lambda r: r >= 20, "{:.1f}x faster"),
        ("`select/topk` within 2x of `baseline/stream_read`",
         ratio("select/topk", "baseline/stream_read"), lambda r: r <= 2, "{:.2f}x"),
        ("`select/gaussiank` within 2.5x of `baseline/stream_read`",
         ratio("select/gaussiank", "baseline/stream_read"), lambda r: r <= 2.5, "{:.2f}x"),
        ("`step/topk_residual` within 2x of `baseline/copy`",
         ratio("step/topk_residual", "baseline/copy"), lambda r: r <= 2, "{:.2f}x"),
        ("`step/topk_residual` within 1.4x of `baseline/copy`",
         ratio("step/topk_residual", "baseline/copy"), lambda r: r <= 1.4, "{:.2f}x"),
        ("`step/topk_qsgd_residual` within 1.6x of `baseline/copy`",
         ratio("step/topk_qsgd_residual", "baseline/copy"), lambda r: r <= 1.6, "{:.2f}x"),
    ]
    # The quantizers against a copy of the gradient (issue 15's bounds).
    for q, enc, dec in (("fp16", 1.5, 1.5), ("bf16", 1.5, 1.5), ("scaled_sign", 1.5, 1.5),
                        ("terngrad", 2, 1.5), ("qsgd4", 3, 2)):
        for side, bound in (("encode", enc), ("decode", dec)):
            fam = f"quantize/{q}_{side}"
            targets.append((f"`{fam}` within {bound:g}x of `baseline/copy`",
                            ratio(fam, "baseline/copy"), lambda r, b=bound: r <= b, "{:.2f}x"))
    # The allgather's local work at P = 16, density 0.001 (issue 15).
    t16 = local.get(("sparse_allgather", n, 1000, 16))
    targets.append(("`exchange_local/sparse_allgather` (P = 16, ppm 1000) within 2x of "
                    "`baseline/output_pass`",
                    None if t16 is None or not base else t16 / base, lambda r: r <= 2, "{:.2f}x"))
    # Gaussian-k on an error-feedback residual: the count in [2k/3, 4k/3] on every call (the
    # in_band counter, the fraction of calls; its minimum over the repetitions), and the time.
    for fam in ("select_residual/gaussiank", "step/gaussiank_residual"):
        band = in_band.get((fam, n, 1000))
        targets.append((f"`{fam}` selects within [2k/3, 4k/3] on every call",
                        band, lambda r: r >= 1.0, "{:.2f} of calls"))
        targets.append((f"`{fam}` within 2x of `baseline/stream_read`",
                        ratio(fam, "baseline/stream_read"), lambda r: r <= 2, "{:.2f}x"))
    for fam in ("select/topk", "select/gaussiank", "step/topk_residual"):
        for suf, label in zip(HEAVY, ("Laplace", "Student-t (3)")):
            targets.append((f"`{fam}` on {label} input within 1.5x of normal",
                            ratio(fam + suf, fam), lambda r: r <= 1.5, "{:.2f}x"))
    print(f"\nTargets (n = {n}, ppm = 1000, normal input unless stated)\n")
    print("| target | measured | met |")
    print("|---|---|---|")
    for text, r, ok, fmt in targets:
        if r is None:
            print(f"| {text} | not run | - |")
        else:
            print(f"| {text} | {fmt.format(r)} | {'yes' if ok(r) else '**no**'} |")

    if dat_dir:
        os.makedirs(dat_dir, exist_ok=True)
        for fam in normal:
            if fam.startswith("quantize/"):
                continue
            path = os.path.join(dat_dir, fam.replace("/", "__") + ".dat")
            with open(path, "w") as f:
                for p in PPMS:
                    t = seconds(runs, fam, n, p)
                    if t is not None:
                        f.write(f"{p} {n * 4 / t / 1e9:.4f}\n")


if __name__ == "__main__":
    main()
