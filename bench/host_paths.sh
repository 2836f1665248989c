#!/bin/sh
# bench/host_paths.sh: the host step's targets on both x86 vector paths, one after the other on
# one machine: gradcomp_bench with GRADCOMP_HOST_ISA=avx2 (the path of CPUs without AVX-512)
# and without it (the widest path this CPU has), then the side-by-side table of
# bench/host_paths.py. On a CPU without AVX-512 both runs take the AVX2 path (the JSON's
# context says which ran: gradcomp_host_isa).
#
# usage: bench/host_paths.sh [BUILD_DIR] [OUT_DIR]   (defaults build/default, results/bench)
set -eu
build=${1:-build/default}
out=${2:-results/bench}
bench="$build/bench/gradcomp_bench"
filter='^(baseline/(copy|stream_read|accumulate)|quantize/(terngrad|qsgd4|fp16|scaled_sign)_encode|quantize/draws|step/(topk|topk_qsgd|gaussiank)_residual|select/topk|baseline/nth_element)/n:25557032(/ppm:(1000|10000))?$'
mkdir -p "$out"
for isa in avx2 widest; do
  if [ "$isa" = avx2 ]; then set -- env GRADCOMP_HOST_ISA=avx2; else set -- env -u GRADCOMP_HOST_ISA; fi
  "$@" "$bench" --benchmark_filter="$filter" --benchmark_enable_random_interleaving=true \
    --benchmark_repetitions=5 --benchmark_min_time=0.1 --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/host_paths_$isa.json" --benchmark_out_format=json >/dev/null
done
/usr/bin/python3 "$(dirname "$0")/host_paths.py" "$out/host_paths_avx2.json" "$out/host_paths_widest.json"
