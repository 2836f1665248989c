#!/usr/bin/env bash
# Plots GB/s against density for every selector, the fused top-k step and the baselines, at
# the largest-but-one size of a gradcomp_bench JSON result (n = 25557032 for the run in docs/performance.md).
# Needs python3 and gnuplot (Debian: gnuplot-nox); CI does not run it.
# usage: bench/plot.sh RESULT.json OUT.png
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
json="$1"
png="$2"
dat="$(mktemp -d)"
trap 'rm -rf "$dat"' EXIT

python3 "$here/report.py" "$json" --dat "$dat" >/dev/null
n="$(python3 -c 'import json,re,sys
names=[b["run_name"] for b in json.load(open(sys.argv[1]))["benchmarks"]]
sizes=sorted({int(m.group(1)) for s in names for m in [re.search(r"/n:(\d+)", s)] if m})
print(25557032 if 25557032 in sizes else sizes[-1])' "$json")"

series=()
for f in "$dat"/*.dat; do
  name="$(basename "$f" .dat)"
  name="${name//__//}"
  case "$name" in
    select/*|baseline/*|step/topk_residual) series+=("$name") ;;
  esac
done

{
  echo "set terminal pngcairo size 1100,700 font 'Sans,11'"
  echo "set output '$png'"
  echo "set title 'Selectors and baselines, n = $n floats (normal input), one core: GB/s of the gradient'"
  echo "set xlabel 'density (parts per million, k = n x ppm / 10^6)'"
  echo "set ylabel 'GB/s  (n x 4 bytes / time)'"
  echo "set logscale xy"
  echo "set xrange [70:14000]"
  echo "set xtics (100, 1000, 10000)"
  echo "set grid xtics ytics mytics"
  echo "set key outside right top noenhanced"
  echo "set termoption noenhanced"
  # The targets' series stand out: top-k black, Gaussian-k red, the fused step green.
  others=('#1f77b4' '#9467bd' '#ff7f0e' '#17becf' '#8c564b' '#e377c2' '#bcbd22' '#7f7f7f')
  plot="plot"
  sep=""
  i=0
  for s in "${series[@]}"; do
    case "$s" in
      select/topk) style="linespoints lw 3 pt 7 ps 1.3 lc rgb '#000000'" ;;
      select/gaussiank) style="linespoints lw 3 pt 7 ps 1.3 lc rgb '#d62728'" ;;
      step/topk_residual) style="linespoints lw 3 dt 4 pt 5 ps 1.3 lc rgb '#2ca02c'" ;;
      baseline/*) style="linespoints lw 2 dt 2 pt 6 ps 1.2 lc rgb '${others[i % ${#others[@]}]}'"
                  i=$((i + 1)) ;;
      *) style="linespoints lw 2 pt 7 ps 1.0 lc rgb '${others[i % ${#others[@]}]}'"
         i=$((i + 1)) ;;
    esac
    plot+="$sep '$dat/${s//\//__}.dat' using 1:2 with $style title '$s'"
    sep=","
  done
  echo "$plot"
} | gnuplot
echo "wrote $png"
