#!/usr/bin/env bash
# Draws docs/libtorch.png from the runs examples/libtorch/results.sh kept in
# results/libtorch: test accuracy against the MB each worker sent, after each epoch
# (means over seeds 1, 2, 3), one curve per row. Needs gnuplot (Debian: gnuplot-nox). Not
# part of CI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

results=results/libtorch
png=docs/libtorch.png
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# The interpreter CMake found (the one that imports torch; summarize.py needs only the standard library).
python="$(sed -n 's/^GRADCOMP_TORCH_PYTHON:FILEPATH=//p' build/default/CMakeCache.txt 2>/dev/null || true)"
"${python:-/usr/bin/python3}" examples/libtorch/summarize.py "$results" --curves >"$work/curves.dat"

# row | legend
rows=(
  "dense|dense (fp32 allreduce)"
  "topk_0.01|top-k 0.01"
  "dgc_0.001|DGC 0.001"
  "lags_0.001|LAGS 0.001, measured link"
  "lags_0.001_1gbit|LAGS 0.001, 1 Gbit/s plan"
  "pqasgd_p4_qsgd_2bit|PQASGD p=4, QSGD 2-bit"
)
colours=("#000000" "#e41a1c" "#377eb8" "#4daf4a" "#984ea3" "#ff7f00")
plots=()
i=0
for row in "${rows[@]}"; do
  name=${row%%|*}
  title=${row#*|}
  awk -v r="$name" '$1 == r { print $2, $3, $4 }' "$work/curves.dat" >"$work/$name.dat"
  if [ -s "$work/$name.dat" ]; then
    plots+=("'$work/$name.dat' using 3:2 with linespoints lw 2 pt $((i + 1)) ps 1.3 lc rgb '${colours[i]}' title '$title'")
  fi
  i=$((i + 1))
done
IFS=','
gnuplot <<GNUPLOT
set terminal pngcairo size 900,560 font 'sans,11'
set output '$png'
set title "LibTorch CNN (80,202 parameters) on Fashion-MNIST, 4 gloo processes\nmean of seeds 1, 2, 3; points: epochs 1-3"
set logscale x
set grid
set xlabel 'MB sent per worker (log scale)'
set ylabel 'test accuracy'
set key bottom right
plot ${plots[*]}
GNUPLOT
echo "wrote $png"
