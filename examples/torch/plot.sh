#!/usr/bin/env bash
# Draws docs/torch_ddp.png from the runs examples/torch/results.sh kept in results/torch:
# test accuracy against the MB each worker sent, after each epoch (means over seeds 1, 2, 3),
# one curve per hook (Gaussian-k 0.001, which diverged, is left out); CNN left, MLP right.
# Needs gnuplot (Debian: gnuplot-nox). Not part of CI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

results=results/torch
png=docs/torch_ddp.png
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python="$(sed -n 's/^GRADCOMP_TORCH_PYTHON:FILEPATH=//p' build/default/CMakeCache.txt 2>/dev/null || true)"
"${python:-/usr/bin/python3}" examples/torch/summarize.py "$results" --curves >"$work/curves.dat"

# row | legend
rows=(
  "allreduce|PyTorch allreduce"
  "fp16|PyTorch fp16"
  "powersgd1|PyTorch PowerSGD r=1"
  "powersgd4|PyTorch PowerSGD r=4"
  "topk_0.01|gradcomp top-k 0.01"
  "topk_0.001|gradcomp top-k 0.001"
  "dgc_0.001|gradcomp DGC 0.001"
  "qsgd_4bit|gradcomp QSGD 4-bit"
  "topk_0.01_dgcfb|gradcomp top-k 0.01, DGC momentum"
  "dgc_0.001_warmup|gradcomp DGC 0.001, warm-up"
)
colours=("#000000" "#999999" "#984ea3" "#f781bf" "#e41a1c" "#ff7f00" "#377eb8" "#a65628" "#4daf4a" "#17becf" "#bcbd22")

plots() {  # $1: model
  local out=() i=0
  for row in "${rows[@]}"; do
    local name=${row%%|*} title=${row#*|}
    awk -v r="$1_$name" '$1 == r { print $2, $3, $4 }' "$work/curves.dat" >"$work/$1_$name.dat"
    if [ -s "$work/$1_$name.dat" ]; then
      out+=("'$work/$1_$name.dat' using 3:2 with linespoints lw 2 pt $((i % 13 + 1)) ps 1.3 lc rgb '${colours[i]}' title '$title'")
    fi
    i=$((i + 1))
  done
  local IFS=','
  echo "${out[*]}"
}

gnuplot <<GNUPLOT
set terminal pngcairo size 1400,560 font 'sans,11'
set output '$png'
set multiplot layout 1,2 title 'Fashion-MNIST, 4 gloo workers, DDP with PyTorch hooks and gradcomp.torch (mean of seeds 1, 2, 3; points: epochs 1-3)'
set logscale x
set grid
set xlabel 'MB sent per worker (log scale)'
set ylabel 'test accuracy'
set key bottom right
set title 'CNN (80,202 parameters)'
plot $(plots cnn)
set title 'MLP 784-256-128-10 (235,146 parameters)'
plot $(plots mlp)
unset multiplot
GNUPLOT
echo "wrote $png"
