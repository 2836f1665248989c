#!/usr/bin/env bash
# Draws docs/fashion_mnist.png from the runs that examples/fashion_mnist_results.sh kept in
# results/: test accuracy against epoch, and against the bytes each worker sent.
# Needs gnuplot (Debian: gnuplot-nox). Not part of CI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

results=results
png=docs/fashion_mnist.png
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# row | legend
rows=(
  "dense|dense S-SGD"
  "topk_0.01|top-k 0.01 + residual"
  "topk_0.001|top-k 0.001 + residual"
  "gaussiank_0.001|Gaussian-k 0.001 + residual"
  "gaussiank_published_0.001|Gaussian-k 0.001 (paper corrections)"
  "randomk_0.01_no_momentum|random-k 0.01 + residual, momentum 0"
  "dgc_0.001|DGC 0.001 (warm-up)"
  "qsgd_4bit|QSGD 4-bit"
  "pqasgd_p4_qsgd_2bit|PQASGD p=4, QSGD 2-bit"
  "pqasgd_p4_terngrad|PQASGD p=4, TernGrad + EF"
  "lags_0.001|LAGS (measured link)"
  "lags_0.001_1gbit|LAGS (1 Gbit/s model)"
)

# One colour and point type per row (gnuplot's default palette repeats after eight).
colours=("#000000" "#e41a1c" "#ff7f00" "#a65628" "#999999" "#377eb8" "#4daf4a" "#984ea3" "#f781bf" "#17becf" "#bcbd22" "#666666")
plot_epoch=()
plot_bytes=()
i=0
for row in "${rows[@]}"; do
  name=${row%%|*}
  title=${row#*|}
  file="$results/$name.txt"
  [ -f "$file" ] || { echo "plot_results.sh: skipping $name (no $file)" >&2; continue; }
  # "epoch 2/3  loss ..  train_acc ..  test_acc A  bytes_sent B (...)" -> "2 A B"
  awk '$1 == "epoch" { split($2, e, "/"); for (i = 3; i < NF; ++i) { if ($i == "test_acc") a = $(i + 1); if ($i == "bytes_sent") b = $(i + 1) } print e[1], a, b }' \
    "$file" >"$work/$name.dat"
  style="linespoints lw 2 pt $((i % 13 + 1)) ps 1.3 lc rgb '${colours[i % ${#colours[@]}]}'"
  plot_epoch+=("'$work/$name.dat' using 1:2 with $style notitle")
  plot_bytes+=("'$work/$name.dat' using (\$3/1e6):2 with $style title '$title'")
  i=$((i + 1))
done
[ "${#plot_epoch[@]}" -gt 0 ] || { echo "plot_results.sh: no results in $results" >&2; exit 1; }

join() { local IFS=','; echo "$*"; }

gnuplot <<EOF
set terminal pngcairo size 1500,620 font 'DejaVu Sans,11'
set output '$png'
set multiplot layout 1,2 title 'MLP 784-256-128-10 on Fashion-MNIST, 4 workers, batch 32 per worker, lr 0.05, momentum 0.9'
set grid
set ylabel 'test accuracy'
set yrange [0.65:0.88]
set xlabel 'epoch'
set xtics 1
set xrange [0.9:3.1]
plot $(join "${plot_epoch[@]}")
set xlabel 'MB sent per worker (log scale)'
set logscale x
set xtics auto
set xrange [0.5:5000]
set key bottom right font ',10'
plot $(join "${plot_bytes[@]}")
unset multiplot
EOF
echo "wrote $png"
