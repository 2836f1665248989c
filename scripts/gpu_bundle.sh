#!/usr/bin/env bash
# scripts/gpu_bundle.sh [BUILD_DIR] [DEST]: gathers what scripts/gpu_check.sh runs on a GPU
# machine that lacks this machine's toolchain into one flat folder (default .gpu): the CUDA
# test programs, nccl_comm_local, gradcomp_cuda_bench and (where built) gradcomp_cuda_step_bench
# and gradcomp_cub_topk_bench
# from BUILD_DIR (default build/default), with the shared libraries they load that such a machine may not have
# (libcudart, libbenchmark). Not copied: the C and C++ runtimes (the GPU machine needs a
# libstdc++ at least as new as this machine's), the driver (libcuda, libnvidia-*), and NCCL
# (hundreds of MB): on the GPU machine, put the folder of its own libnccl.so.2 on
# LD_LIBRARY_PATH. There:
#   LD_LIBRARY_PATH=DEST:<folder of libnccl.so.2> scripts/gpu_check.sh DEST <out dir>
set -euo pipefail

build=${1:-build/default}
dest=${2:-.gpu}
mkdir -p "$dest"
programs=()
for exe in "$build"/tests/cuda/cuda_*_test "$build"/tests/cuda/nccl_comm_local \
           "$build"/bench/gradcomp_cuda_bench "$build"/bench/gradcomp_cuda_step_bench \
           "$build"/bench/gradcomp_cub_topk_bench; do
  [[ -x $exe ]] || continue
  cp "$exe" "$dest/"
  programs+=("$dest/$(basename "$exe")")
done
if [[ ${#programs[@]} -eq 0 ]]; then
  echo "gpu_bundle.sh: no CUDA programs in $build (build the default preset where nvcc is found)" >&2
  exit 1
fi
# The libraries the copied programs load, by soname (what the loader looks for).
libs=0
while read -r soname arrow path _; do
  [[ $arrow == "=>" ]] || continue
  if [[ $path == not ]]; then
    echo "gpu_bundle.sh: warning: $soname is not found here; the GPU machine must have it" >&2
    continue
  fi
  case $soname in
    libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libgcc_s.so*|libstdc++.so*) ;;
    libcuda.so*|libnvidia-*|libnccl.so*) ;;
    *) cp -L "$path" "$dest/$soname"; libs=$((libs + 1)) ;;
  esac
done < <(for p in "${programs[@]}"; do ldd "$p" | awk '{print $1, $2, $3}'; done | sort -u -k1,1)
# doctest's header, for tests/torch/module_sgd_cuda.cpp, which scripts/gpu_check.sh builds on
# the GPU machine against its torch (scripts/torch_module_cuda_check.sh).
for h in /usr/include/doctest/doctest.h; do
  [[ -f $h ]] || continue
  mkdir -p "$dest/include/doctest"
  cp "$h" "$dest/include/doctest/"
done
echo "gpu_bundle.sh: ${#programs[@]} programs and $libs libraries in $dest ($(du -sh "$dest" | cut -f1))"
