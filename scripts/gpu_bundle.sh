#!/usr/bin/env bash
# scripts/gpu_bundle.sh [BUILD_DIR] [DEST]: gathers what scripts/gpu_check.sh runs on a GPU
# machine that lacks this machine's toolchain into one flat folder (default .gpu): the CUDA
# test programs, nccl_comm_local and gradcomp_cuda_bench from BUILD_DIR (default
# build/default), with the libraries they need that such a machine may not have (libcudart,
# libbenchmark). NCCL is not copied (hundreds of MB): on the GPU machine, put the folder of its
# own libnccl.so.2 on LD_LIBRARY_PATH. There:
#   LD_LIBRARY_PATH=DEST:<folder of libnccl.so.2> scripts/gpu_check.sh DEST <out dir>
set -euo pipefail

build=${1:-build/default}
dest=${2:-.gpu}
mkdir -p "$dest"
found=0
for exe in "$build"/tests/cuda/cuda_*_test "$build"/tests/cuda/nccl_comm_local \
           "$build"/bench/gradcomp_cuda_bench; do
  [[ -x $exe ]] || continue
  cp "$exe" "$dest/"
  found=$((found + 1))
done
if [[ $found -eq 0 ]]; then
  echo "gpu_bundle.sh: no CUDA programs in $build (build the default preset where nvcc is found)" >&2
  exit 1
fi
# The shared libraries they load, except the C/C++ runtime and NCCL, copied by their
# sonames (what the loader looks for).
for exe in "$dest"/*; do
  [[ -x $exe && ! $exe == *.so* ]] || continue
  ldd "$exe" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r soname path; do
  case $soname in
    libc.so*|libm.so*|libdl.so*|libpthread.so*|librt.so*|libgcc_s.so*|libstdc++.so*|libnccl.so*) ;;
    *) cp -L "$path" "$dest/$soname" ;;
  esac
done
echo "gpu_bundle.sh: $found programs and $(ls "$dest" | grep -c '\.so') libraries in $dest ($(du -sh "$dest" | cut -f1))"
