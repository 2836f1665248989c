#!/usr/bin/env bash
# scripts/gpu_topk_check.sh BIN_DIR OUT_DIR: the device top-k's check on a GPU machine, in one
# run: the selection and feedback tests (and memcheck of the selection test), then the top-k
# families of gradcomp_cuda_bench from BIN_DIR and, where BIN_DIR holds one, of
# gradcomp_cuda_bench_before (a build of the previous version, for a baseline on the same card
# in the same run), cub::DeviceTopK (gradcomp_cub_topk_bench), then Nsight Compute on the
# top-k's kernels (scripts/gpu_profile.sh, cases topk*). Prints a table of medians last.
set -uo pipefail
bin=$1
out=$2
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
for t in cuda_select_test cuda_feedback_test; do
  timeout 120 "$bin/$t" > "$out/$t.log" 2>&1
  echo "$t: rc $? $(grep -E '^\[doctest\] (test cases|assertions)' "$out/$t.log" | tr -s ' ' | tr '\n' ' ')"
done | tee "$out/tests.txt"
families='cuda/(select/topk|step/topk_residual|baseline/copy|baseline/axpy)/'
jsons=()
for b in $(cd "$bin" && ls gradcomp_cuda_bench*); do
  [[ -x $bin/$b ]] || continue
  timeout 150 "$bin/$b" "--benchmark_filter=$families" --benchmark_repetitions=3 \
    --benchmark_min_time=0.05 --benchmark_report_aggregates_only=true \
    --benchmark_out="$out/$b.json" --benchmark_out_format=json > "$out/$b.log" 2>&1
  echo "$b: rc $?"
  jsons+=("$out/$b.json")
done
if [[ -x $bin/gradcomp_cub_topk_bench ]]; then
  timeout 150 "$bin/gradcomp_cub_topk_bench" "--benchmark_filter=cuda/baseline/(cub_topk|cub_copy)/" \
    --benchmark_repetitions=3 --benchmark_min_time=0.05 \
    --benchmark_report_aggregates_only=true --benchmark_out="$out/cub_topk_bench.json" \
    --benchmark_out_format=json > "$out/cub_topk_bench.log" 2>&1
  echo "gradcomp_cub_topk_bench: rc $?"
  jsons+=("$out/cub_topk_bench.json")
fi
GPU_PROFILE_FILTER=${GPU_PROFILE_FILTER:-^topk} timeout 200 "$here/scripts/gpu_profile.sh" "$bin" \
  "$out/profile" > /dev/null 2>&1
echo "gpu_profile.sh: rc $?"
if [[ ${GPU_TOPK_MEMCHECK:-1} != 0 ]] && command -v compute-sanitizer > /dev/null; then
  timeout 120 compute-sanitizer --tool memcheck --error-exitcode 99 "$bin/cuda_select_test" \
    > "$out/memcheck_select.log" 2>&1
  echo "memcheck cuda_select_test: rc $? $(grep 'ERROR SUMMARY' "$out/memcheck_select.log" | tail -1)"
fi | tee -a "$out/tests.txt"
python3 "$here/bench/cuda_medians.py" "${jsons[@]}" | tee "$out/medians.txt"
