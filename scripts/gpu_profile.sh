#!/usr/bin/env bash
# scripts/gpu_profile.sh [BIN_DIR] [OUT_DIR]: on a machine with a CUDA GPU and Nsight Compute,
# profiles every kernel of the device top-k, Gaussian-k, threshold and the encoders, one
# benchmark case at a time (gradcomp_cuda_bench with --benchmark_min_time=0: the direct warm-up
# call, the graph's warm-up launch and one timed launch), and cub::DeviceTopK's kernels
# (gradcomp_cub_topk_bench) at the same case. Per case: OUT_DIR/ncu_<case>.csv and a summary
# per kernel (bench/ncu_summary.py: launches, duration, DRAM bytes, DRAM and SM throughput as a
# share of peak), all summaries in OUT_DIR/profile.txt. Clocks are left as the card runs them
# (--clock-control none). BIN_DIR as for scripts/gpu_check.sh (a build tree or a flat folder).
set -uo pipefail

bin=${1:-build/default}
out=${2:-gpu-profile}
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
[[ -n $ncu ]] || { echo "gpu_profile.sh: ncu not found" | tee "$out/profile.txt"; exit 1; }
find_exe() {
  local p
  for p in "$bin/$1" "$bin/bench/$1"; do [[ -x $p ]] && { echo "$p"; return 0; }; done
  return 1
}
metrics=gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum
metrics+=,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__throughput.avg.pct_of_peak_sustained_elapsed

# case name, program, benchmark (an exact name), calls of the pipeline profiled
cases=(
  "topk_1M_100 gradcomp_cuda_bench cuda/select/topk/n:1048576/ppm:100 3"
  "topk_1M_10000 gradcomp_cuda_bench cuda/select/topk/n:1048576/ppm:10000 3"
  "topk_25M_100 gradcomp_cuda_bench cuda/select/topk/n:25557032/ppm:100 3"
  "topk_25M_1000 gradcomp_cuda_bench cuda/select/topk/n:25557032/ppm:1000 3"
  "topk_25M_10000 gradcomp_cuda_bench cuda/select/topk/n:25557032/ppm:10000 3"
  "topk_residual_25M_1000 gradcomp_cuda_bench cuda/step/topk_residual/n:25557032/ppm:1000 3"
  "gaussiank_25M_1000 gradcomp_cuda_bench cuda/select/gaussiank/n:25557032/ppm:1000 3"
  "threshold_25M_1000 gradcomp_cuda_bench cuda/select/threshold/n:25557032/ppm:1000 3"
  "fp16_25M gradcomp_cuda_bench cuda/quantize/fp16/n:25557032 2"
  "qsgd4_25M gradcomp_cuda_bench cuda/quantize/qsgd4/n:25557032 2"
  "terngrad_25M gradcomp_cuda_bench cuda/quantize/terngrad/n:25557032 2"
  "scaled_sign_25M gradcomp_cuda_bench cuda/quantize/scaled_sign/n:25557032 2"
  "cub_topk_25M_1000 gradcomp_cub_topk_bench cuda/baseline/cub_topk/n:25557032/ppm:1000 3"
  "cub_topk_1M_100 gradcomp_cub_topk_bench cuda/baseline/cub_topk/n:1048576/ppm:100 3"
)
filter=${GPU_PROFILE_FILTER:-.}
: > "$out/profile.txt"
for c in "${cases[@]}"; do
  read -r name prog bench calls <<< "$c"
  [[ $name =~ $filter ]] || continue
  exe=$(find_exe "$prog") || { echo "== $name: $prog not built" >> "$out/profile.txt"; continue; }
  start=$SECONDS
  timeout 120 "$ncu" --csv --clock-control none --metrics "$metrics" --launch-count 200 \
    "$exe" "--benchmark_filter=^${bench}(/manual_time)?\$" --benchmark_min_time=0 --benchmark_repetitions=1 \
    > "$out/ncu_$name.csv" 2> "$out/ncu_$name.err"
  rc=$?
  {
    echo "== $name ($bench): ncu rc $rc, $((SECONDS - start)) s"
    python3 "$here/bench/ncu_summary.py" "$out/ncu_$name.csv" --calls "$calls"
  } >> "$out/profile.txt" 2>&1
done
cat "$out/profile.txt"
