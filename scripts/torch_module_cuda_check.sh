#!/usr/bin/env bash
# scripts/torch_module_cuda_check.sh [OUT_DIR]: builds tests/torch/module_sgd_cuda.cpp (LibTorch's
# device_module_sgd, device_module_averaging and device_module_lags on a CUDA module) against the torch that PYTHON imports (else
# the first of python3 and /usr/bin/python3 that imports torch), and runs it. On the GPU machine that is the pip torch with CUDA, which the CMake build here does
# not use: Debian's torch has no CUDA, so there the test only checks its refusals and exits 77.
# The drivers (module_sgd_cuda_drivers.cu) are compiled by nvcc for GPU_ARCH (default 90), and
# the test by the host compiler (nvcc 13 in C++20 mode refuses LibTorch's headers), both with
# torch's _GLIBCXX_USE_CXX11_ABI, since std::function and std::string cross between them.
# doctest: the system's, or DOCTEST_INCLUDE (a folder with doctest/doctest.h; gpu_bundle.sh
# puts one in its folder's include/). Logs and the program go to OUT_DIR (default
# torch-module-cuda). Exits with the test's code (77: skipped, no GPU or no CUDA torch), or 2
# when it could not be built.
set -uo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
out=${1:-torch-module-cuda}
mkdir -p "$out"
# The interpreter: PYTHON, else the first of python3 and /usr/bin/python3 that imports torch
# (the first python3 on PATH may not be the one that does).
py=${PYTHON:-}
if [[ -z $py ]]; then
  for candidate in python3 /usr/bin/python3; do
    if "$candidate" -c 'import torch' 2> /dev/null; then py=$candidate; break; fi
  done
  py=${py:-python3}
fi
nvcc=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
# The toolkit's headers and libraries, for the host compiler: where nvcc itself finds them
# (its dry run's TOP), not beside the nvcc named, which may be a wrapper elsewhere (as
# /usr/local/bin/nvcc is on these machines, when /usr/local/cuda/bin is not on PATH).
cuda_home=$("$nvcc" --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -1)
if [[ -z $cuda_home || ! -d $cuda_home ]]; then
  echo "torch_module_cuda_check.sh: $nvcc --dryrun names no toolkit folder (TOP=)" >&2
  exit 2
fi
cuda_home=$(cd "$cuda_home" && pwd -P)
arch=${GPU_ARCH:-90}
cxx=${CXX:-c++}

# The torch python3 imports: its include folders, its library folder, its C++ ABI, and whether
# it has CUDA (libtorch_cuda).
if ! info=$("$py" - 2> "$out/torch_query.log" <<'EOF'
import os
import torch
from torch.utils import cpp_extension
print(" ".join("-isystem " + p for p in cpp_extension.include_paths()))
lib = cpp_extension.library_paths()[0]
print(lib)
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
print(int(os.path.exists(os.path.join(lib, "libtorch_cuda.so"))))
EOF
); then
  echo "torch_module_cuda_check.sh: $py cannot import torch ($out/torch_query.log)" >&2
  exit 2
fi
torch_includes=$(sed -n 1p <<< "$info")
torch_lib=$(sed -n 2p <<< "$info")
abi=$(sed -n 3p <<< "$info")
torch_cuda=$(sed -n 4p <<< "$info")
doctest_flags=()
[[ -n ${DOCTEST_INCLUDE:-} ]] && doctest_flags=(-I"$DOCTEST_INCLUDE")

start=$SECONDS
"$nvcc" -std=c++20 --expt-relaxed-constexpr -O2 \
  "--generate-code=arch=compute_$arch,code=[compute_$arch,sm_$arch]" \
  -D_GLIBCXX_USE_CXX11_ABI="$abi" -I"$here/include" -I"$here/tests" \
  -c "$here/tests/torch/module_sgd_cuda_drivers.cu" -o "$out/drivers.o" > "$out/build.log" 2>&1 &&
# shellcheck disable=SC2086  # torch_includes is a list of -isystem flags
"$cxx" -std=c++20 -O1 -Wall -Wextra -D_GLIBCXX_USE_CXX11_ABI="$abi" -I"$here/include" \
  -I"$here/tests" $torch_includes -I"$cuda_home/include" "${doctest_flags[@]}" \
  -c "$here/tests/torch/module_sgd_cuda.cpp" -o "$out/test.o" >> "$out/build.log" 2>&1 &&
"$cxx" "$out/test.o" "$out/drivers.o" -o "$out/torch_module_sgd_cuda" \
  -L"$torch_lib" -Wl,-rpath,"$torch_lib" -Wl,--no-as-needed -ltorch -ltorch_cpu -lc10 \
  $([[ $torch_cuda == 1 ]] && echo "-ltorch_cuda -lc10_cuda") -Wl,--as-needed \
  -L"$cuda_home/lib64" -Wl,-rpath,"$cuda_home/lib64" -lcudart -pthread >> "$out/build.log" 2>&1
rc=$?
if [[ $rc -ne 0 ]]; then
  echo "torch_module_cuda_check.sh: the build failed ($out/build.log)" >&2
  tail -20 "$out/build.log" >&2
  exit 2
fi
echo "torch_module_cuda_check.sh: built in $((SECONDS - start)) s (torch with CUDA: $torch_cuda)"
timeout 300 "$out/torch_module_sgd_cuda" > "$out/torch_module_sgd_cuda.log" 2>&1
rc=$?
tail -3 "$out/torch_module_sgd_cuda.log"
exit $rc
