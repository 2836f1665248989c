#!/usr/bin/env bash
# Runs the Fashion-MNIST example once per row of the results table in docs/training.md, one run after
# the other (they share the machine's cores), and keeps each run's output in
# results/<row>.txt; then examples/plot_results.sh draws docs/fashion_mnist.png.
# Usage: examples/fashion_mnist_results.sh [row...]   (default: every row)
# Needs a Release build: cmake --preset default && cmake --build --preset default
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

bin=${TRAIN_FASHION_MNIST:-build/default/examples/train_fashion_mnist}
out=results
mkdir -p "$out"

# row name | arguments (4 workers, 3 epochs, batch 32, lr 0.05, momentum 0.9 are the defaults)
rows=(
  "dense|--compressor dense"
  "topk_0.01|--compressor topk --density 0.01"
  "topk_0.001|--compressor topk --density 0.001"
  "gaussiank_0.001|--compressor gaussiank --density 0.001"
  "gaussiank_published_0.001|--compressor gaussiank_published --density 0.001"
  "randomk_0.01|--compressor randomk --density 0.01"
  "randomk_0.01_no_momentum|--compressor randomk --density 0.01 --momentum 0"
  "dgc_0.001|--compressor dgc --density 0.001"
  "qsgd_4bit|--compressor qsgd --bits 4"
  "pqasgd_p4_qsgd_2bit|--schedule pqasgd --period 4 --compressor qsgd --bits 2"
  "pqasgd_p4_terngrad|--schedule pqasgd --period 4 --compressor terngrad"
  "lags_0.001|--schedule lags --compressor topk --density 0.001"
  "lags_0.001_1gbit|--schedule lags --compressor topk --density 0.001 --link-gbit 1 --link-latency-us 50"
  "topk_0.01_per_layer|--compressor topk --density 0.01 --tensors layer"
  "dgc_0.001_per_layer|--compressor dgc --density 0.001 --tensors layer"
  # the three rows with targets, on two more seeds (initialisation and data order)
  "dense_seed2|--compressor dense --seed 2"
  "topk_0.01_seed2|--compressor topk --density 0.01 --seed 2"
  "dgc_0.001_seed2|--compressor dgc --density 0.001 --seed 2"
  "dense_seed3|--compressor dense --seed 3"
  "topk_0.01_seed3|--compressor topk --density 0.01 --seed 3"
  "dgc_0.001_seed3|--compressor dgc --density 0.001 --seed 3"
)

want=("$@")
for row in "${rows[@]}"; do
  name=${row%%|*}
  args=${row#*|}
  if [ "${#want[@]}" -gt 0 ] && [[ ! " ${want[*]} " == *" $name "* ]]; then
    continue
  fi
  echo "=== $name: train_fashion_mnist $args"
  # shellcheck disable=SC2086  # the arguments are meant to be split
  { echo "# train_fashion_mnist $args"; "$bin" $args; } | tee "$out/$name.txt"
done
