#!/usr/bin/env bash
# Trains examples/torch/train_ddp.py (Fashion-MNIST, DDP over gloo) with the arguments given,
# e.g. `scripts/train_ddp.sh --hook gradcomp:topk:0.01`. Installs what is missing, builds only
# the gradcomp.torch extension, and runs the example with the interpreter that imports torch
# (found by CMake; the first python3 on PATH may not be that one).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target gradcomp_python --parallel "$(nproc)"
python="$(sed -n 's/^GRADCOMP_TORCH_PYTHON:FILEPATH=//p' build/default/CMakeCache.txt)"
if [ -z "$python" ]; then
  echo "train_ddp.sh: CMake found no Python interpreter that imports torch (see the configure output)" >&2
  exit 1
fi
PYTHONPATH="$PWD/build/default/python${PYTHONPATH:+:$PYTHONPATH}" exec "$python" examples/torch/train_ddp.py "$@"
