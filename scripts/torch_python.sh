#!/usr/bin/env bash
# Runs a Python script of gradcomp's with the interpreter that imports torch and with
# gradcomp.torch importable: installs what is missing, builds only the gradcomp.torch extension
# (build/default), and finds the interpreter as CMake did (the first python3 on PATH may not be
# the one that imports torch). Usage: scripts/torch_python.sh SCRIPT.py [args...]
# GRADCOMP_TORCH_PYTHON_NO_BUILD=1 skips the install and the build (for several processes started
# at once, e.g. by scripts/cluster.sh spawn, after one run has built the extension).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if [ "${GRADCOMP_TORCH_PYTHON_NO_BUILD:-0}" != 1 ]; then
  scripts/deps.sh
  cmake --preset default >/dev/null
  cmake --build --preset default --target gradcomp_python --parallel "$(nproc)" >/dev/null
fi
python="$(sed -n 's/^GRADCOMP_TORCH_PYTHON:FILEPATH=//p' build/default/CMakeCache.txt)"
if [ -z "$python" ]; then
  echo "torch_python.sh: CMake found no Python interpreter that imports torch (run cmake --preset default to see why)" >&2
  exit 1
fi
PYTHONPATH="$PWD/build/default/python${PYTHONPATH:+:$PYTHONPATH}" exec "$python" "$@"
