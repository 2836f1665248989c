#!/usr/bin/env bash
# scripts/gpu_torch_check.sh [OUT_DIR]: on a machine with a CUDA GPU and a torch with CUDA,
# builds gradcomp.torch's extension with its CUDA path in place (setup.py build_ext, for the
# GPU it sees unless TORCH_CUDA_ARCH_LIST says otherwise), then runs the hook's tests on CUDA
# buckets (tests/torch/test_hook_cuda.py) and the CUDA hook's benchmark
# (bench/torch_cuda_hook_bench.py; GPU_TORCH_BENCH=0 leaves it out). Logs and JSON go to
# OUT_DIR (default gpu-torch-check); prints a summary last. Exits 1 when the build or a test
# failed, 77 when there is no GPU or torch has no CUDA.
set -uo pipefail

out=${1:-gpu-torch-check}
mkdir -p "$out"
py=${PYTHON:-python3}
if ! "$py" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  echo "no GPU, or $py's torch has no CUDA: nothing to check" | tee "$out/summary.txt"
  exit 77
fi
# The compiler: the system's g++, which built the extension that imported and passed there.
# On the GPU machine of 2026-11-27 CC and CXX named /opt/gcc's wrapper, and the extension it
# built segfaulted at import, in the module's first std::ostringstream (as a second copy of
# libstdc++ would: at m.attr("version") = concat(...), the first use of std::ostringstream);
# GRADCOMP_KEEP_CXX=1 keeps CC and CXX as they are.
if [[ ${GRADCOMP_KEEP_CXX:-0} != 1 && -x /usr/bin/g++ ]]; then
  export CC=/usr/bin/gcc CXX=/usr/bin/g++
fi
status=0
summary=()
start=$SECONDS
MAX_JOBS=${MAX_JOBS:-16} "$py" setup.py build_ext --inplace > "$out/build.log" 2>&1
rc=$?
summary+=("build_ext (CUDA): rc $rc, $((SECONDS - start)) s")
if [[ $rc -ne 0 ]]; then
  tail -40 "$out/build.log"
  printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
  exit 1
fi
export PYTHONPATH="$PWD/python:$PWD/tests/torch${PYTHONPATH:+:$PYTHONPATH}"
export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-lo} OMP_NUM_THREADS=1
start=$SECONDS
timeout 600 "$py" tests/torch/test_hook_cuda.py -v > "$out/test_hook_cuda.log" 2>&1
rc=$?
summary+=("test_hook_cuda.py: rc $rc, $((SECONDS - start)) s, $(grep -E '^(Ran|OK|FAILED)' "$out/test_hook_cuda.log" | tr '\n' ' ')")
[[ $rc -ne 0 ]] && status=1
if [[ ${GPU_TORCH_BENCH:-1} != 0 ]]; then
  start=$SECONDS
  timeout 300 "$py" bench/torch_cuda_hook_bench.py --out "$out/torch_cuda_hook_bench.json" \
    > "$out/torch_cuda_hook_bench.log" 2>&1
  rc=$?
  summary+=("torch_cuda_hook_bench.py: rc $rc, $((SECONDS - start)) s")
  [[ $rc -ne 0 ]] && status=1
  cat "$out/torch_cuda_hook_bench.log"
fi
printf '%s\n' "${summary[@]}" | tee "$out/summary.txt"
exit $status
