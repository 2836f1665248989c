#!/usr/bin/env bash
# Draws docs/cluster_tta.png from the time-to-accuracy logs that scripts/cluster_measure.sh tta
# kept in results/cluster/: test accuracy against training seconds (evaluations not
# counted), one curve per method, 4 emulated hosts at 100 Mbit/s. Needs gnuplot (Debian:
# gnuplot-nox). Not part of CI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

results=results/cluster
png=docs/cluster_tta.png
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# log name | legend
rows=(
  "dense|dense S-SGD"
  "topk_0.01|top-k 0.01 + residual"
  "dgc_0.001|DGC 0.001"
  "lags_0.001|LAGS (rho_min 0.001)"
  "pqasgd_p4_qsgd_2bit|PQASGD p=4, QSGD 2-bit"
)
colours=("#000000" "#e41a1c" "#377eb8" "#17becf" "#984ea3")
plots=()
i=0
for row in "${rows[@]}"; do
  name=${row%%|*}
  title=${row#*|}
  file="$results/tta_$name.txt"
  [ -f "$file" ] || { echo "plot.sh: skipping $name (no $file)" >&2; continue; }
  # "eval step S  train_seconds T  test_acc A  bytes_sent B" -> "T A"
  awk '$1 == "eval" { print $5, $7 }' "$file" >"$work/$name.dat"
  plots+=("'$work/$name.dat' using 1:2 with linespoints lw 2 pt $((i + 5)) ps 1.1 lc rgb '${colours[i]}' title '$title'")
  i=$((i + 1))
done
[ "${#plots[@]}" -gt 0 ] || { echo "plot.sh: no logs in $results" >&2; exit 1; }
join() { local IFS=','; echo "$*"; }

gnuplot <<GP
set terminal pngcairo size 1000,600 font 'DejaVu Sans,11' noenhanced
set output '$png'
set title 'Fashion-MNIST (MLP), 4 emulated hosts at 100 Mbit/s (scripts/cluster_measure.sh tta)'
set grid
set xlabel 'training seconds (wall clock, evaluations not counted; log scale)'
set logscale x
set xrange [1:600]
set ylabel 'test accuracy'
set yrange [0.70:0.90]
set key bottom right
set arrow from graph 0, first 0.85 to graph 1, first 0.85 nohead dt 2 lc rgb '#888888'
plot $(join "${plots[@]}")
GP
echo "wrote $png"
