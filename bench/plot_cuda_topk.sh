#!/usr/bin/env bash
# Plots the device top-k's time against n, one panel a density, from the JSON files of one
# GPU run: gradcomp's cuda/select/topk before and after a change, cub::DeviceTopK
# (gradcomp_cub_topk_bench), torch.topk (bench/cuda_cub/torch_topk_bench.py) and a device copy.
# Needs python3 and gnuplot (Debian: gnuplot-nox); CI does not run it.
# usage: bench/plot_cuda_topk.sh BEFORE.json AFTER.json CUB.json TORCH.json OUT.png
set -euo pipefail
before=$1; after=$2; cub=$3; torchj=$4; png=$5
dat="$(mktemp -d)"
trap 'rm -rf "$dat"' EXIT
python3 - "$(dirname "$0")" "$before" "$after" "$cub" "$torchj" "$dat" <<'PY'
import json, re, sys
sys.path.insert(0, sys.argv[1])
from cuda_medians import medians  # name (without /manual_time) -> median us
before, after, cub, torchj, out = sys.argv[2:]
def gb(path, family):
    rows = {}
    for name, us in medians(path).items():
        m = re.fullmatch(family + r"/n:(\d+)(?:/ppm:(\d+))?", name)
        if m:
            rows[(int(m.group(1)), int(m.group(2) or 0))] = us
    return rows
series = {
    "gradcomp_before": gb(before, "cuda/select/topk"),
    "gradcomp_after": gb(after, "cuda/select/topk"),
    "cub_DeviceTopK": gb(cub, "cuda/baseline/cub_topk"),
    "copy": gb(after, "cuda/baseline/copy"),
}
series["torch_topk"] = {(r["n"], r["ppm"]): r["us"] for r in json.load(open(torchj))["rows"] if "ppm" in r}
for name, rows in series.items():
    for ppm in (100, 1000, 10000):
        with open(f"{out}/{name}_{ppm}.dat", "w") as f:
            for (n, p), us in sorted(rows.items()):
                if p in (ppm, 0):
                    f.write(f"{n} {us}\n")
PY
{
  echo "set terminal pngcairo size 1500,520 font 'Sans,10'"
  echo "set output '$png'"
  echo "set multiplot layout 1,3 title 'Exact top-k on one H100, 2026-11-27 (normal input; medians, microseconds; torch.topk from an earlier run on the same card type)'"
  echo "set logscale xy"
  echo "set grid"
  echo "set xrange [7e5:2e8]"
  echo "set xlabel 'n (floats)'"
  echo "set ylabel 'time (us)'"
  echo "set key top left noenhanced"
  for ppm in 100 1000 10000; do
    echo "set title 'density $ppm ppm'"
    echo "plot '$dat/gradcomp_before_$ppm.dat' w lp lw 2 dt 2 pt 6 lc rgb '#7f7f7f' t 'gradcomp before', \
'$dat/gradcomp_after_$ppm.dat' w lp lw 3 pt 7 lc rgb '#000000' t 'gradcomp after', \
'$dat/cub_DeviceTopK_$ppm.dat' w lp lw 2 pt 5 lc rgb '#1f77b4' t 'cub::DeviceTopK (CCCL 3.6)', \
'$dat/torch_topk_$ppm.dat' w lp lw 2 pt 9 lc rgb '#d62728' t 'torch.topk (2.11)', \
'$dat/copy_$ppm.dat' w l lw 1 dt 3 lc rgb '#2ca02c' t 'device copy of g'"
  done
  echo "unset multiplot"
} | gnuplot
echo "wrote $png"
