#!/usr/bin/env bash
# Draws docs/contraction.png from the Fashion-MNIST runs kept in results/: the top-k
# contraction delta = ||acc on the selection||^2 / ||acc||^2 per step (rank 0; running mean
# over 25 steps) for top-k 0.01 and 0.001, Gaussian-k 0.001 in both forms and random-k 0.01,
# with k/n as dashed lines. examples/contraction.py extracts the series (and prints the table
# in docs/training.md). Needs gnuplot (Debian: gnuplot-nox). Not part of CI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

png=docs/contraction.png
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Any Python 3 will do (standard library only).
python=$(command -v python3)
"$python" examples/contraction.py --dat "$work" >/dev/null

# row | legend | colour
rows=(
  "topk_0.01|top-k 0.01|#e41a1c"
  "topk_0.001|top-k 0.001|#ff7f00"
  "gaussiank_0.001|Gaussian-k 0.001|#a65628"
  "gaussiank_published_0.001|Gaussian-k 0.001, paper's corrections|#984ea3"
  "randomk_0.01_no_momentum|random-k 0.01, momentum 0|#377eb8"
)
plots=()
for row in "${rows[@]}"; do
  IFS='|' read -r name title colour <<<"$row"
  [ -f "$work/$name.dat" ] || { echo "plot_contraction.sh: skipping $name (no contraction in its log)" >&2; continue; }
  plots+=("'$work/$name.dat' using 1:4 with lines lw 2 lc rgb '$colour' title \"$title\"")
done
[ "${#plots[@]}" -gt 0 ] || { echo "plot_contraction.sh: no runs with a contraction" >&2; exit 1; }
plots+=("0.01 with lines dt 2 lw 1.5 lc rgb '#444444' title 'k/n = 0.01'")
plots+=("0.001 with lines dt 3 lw 1.5 lc rgb '#444444' title 'k/n = 0.001'")

join() { local IFS=','; echo "$*"; }

gnuplot <<GP
set terminal pngcairo size 1000,620 font 'DejaVu Sans,11'
set output '$png'
set title 'Top-k contraction over training: MLP on Fashion-MNIST, 4 workers, rank 0 (running mean of 25 steps)'
set grid
set logscale y
set yrange [0.0005:4]
set xrange [0:1404]
set xlabel 'step'
set ylabel '||acc on the selection||^2 / ||acc||^2 (log scale)'
set key inside top right font ',10' maxrows 4
plot $(join "${plots[@]}")
GP
echo "wrote $png"
