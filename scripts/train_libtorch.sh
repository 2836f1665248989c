#!/usr/bin/env bash
# Trains the LibTorch example (examples/libtorch/train_libtorch.cpp: the CNN on Fashion-MNIST
# with torch::nn and gradcomp/torch/module.hpp) with the arguments given, e.g.
# `scripts/train_libtorch.sh --compressor topk --density 0.01`. Installs what is missing and
# builds only the example (build/default). Under mpirun, run the binary itself:
# build/default/examples/libtorch/train_libtorch.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/deps.sh
cmake --preset default >/dev/null
cmake --build --preset default --target train_libtorch --parallel "$(nproc)" >/dev/null
bin=build/default/examples/libtorch/train_libtorch
if [ ! -x "$bin" ]; then
  echo "train_libtorch.sh: the example was not built: CMake did not find LibTorch (run cmake --preset default to see why)" >&2
  exit 1
fi
exec "$bin" "$@"
