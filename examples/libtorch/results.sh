#!/usr/bin/env bash
# Runs the LibTorch example once per row of docs/libtorch.md's results, one run after the
# other (they share the machine's cores), keeps each run's output in
# results/libtorch/<row>.txt, and writes the table (examples/libtorch/summarize.py) to
# results/libtorch/table.md.
# Usage: examples/libtorch/results.sh [row...]   (default: every row)
# Needs a Release build: cmake --preset default && cmake --build --preset default
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

bin=${TRAIN_LIBTORCH:-build/default/examples/libtorch/train_libtorch}
out=results/libtorch
mkdir -p "$out"

# row name | arguments (4 workers, 3 epochs, batch 32, lr 0.05, momentum 0.9 are the defaults);
# every 4-worker row on seeds 1, 2 and 3, over 4 gloo processes.
rows=()
for seed in 1 2 3; do
  rows+=(
    "dense_seed$seed|--comm gloo --seed $seed --compressor dense"
    "topk_0.01_seed$seed|--comm gloo --seed $seed --compressor topk --density 0.01"
    "dgc_0.001_seed$seed|--comm gloo --seed $seed --compressor dgc --density 0.001"
    "lags_0.001_seed$seed|--comm gloo --seed $seed --schedule lags --compressor topk --density 0.001"
    "lags_0.001_1gbit_seed$seed|--comm gloo --seed $seed --schedule lags --compressor topk --density 0.001 --link-gbit 1 --link-latency-us 50"
    "pqasgd_p4_qsgd_2bit_seed$seed|--comm gloo --seed $seed --schedule pqasgd --period 4 --compressor qsgd --bits 2"
  )
done
# LAGS's overlap on the real backward pass, 2 workers (the machine's 2 cores), over each
# communicator; "mpirun" rows run under mpirun -np 2.
lags_1gbit="--schedule lags --compressor topk --density 0.001 --link-gbit 1 --link-latency-us 50"
rows+=(
  "lags_0.001_1gbit_2workers|--comm gloo --workers 2 $lags_1gbit"
  "lags_0.001_1gbit_2workers_threads|--comm threads --workers 2 $lags_1gbit"
  "lags_0.001_1gbit_2workers_mpi|mpirun --comm mpi $lags_1gbit"
  "lags_0.001_2workers|--comm gloo --workers 2 --schedule lags --compressor topk --density 0.001"
)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1

want=("$@")
for row in "${rows[@]}"; do
  name=${row%%|*}
  args=${row#*|}
  if [ "${#want[@]}" -gt 0 ] && [[ ! " ${want[*]} " == *" $name "* ]]; then
    continue
  fi
  launcher=()
  if [[ $args == mpirun* ]]; then
    launcher=(mpirun -np 2)
    args=${args#mpirun }
  fi
  echo "=== $name: ${launcher[*]} train_libtorch $args"
  # shellcheck disable=SC2086  # the arguments are meant to be split
  { echo "# ${launcher[*]}${launcher[*]:+ }train_libtorch $args"; "${launcher[@]}" "$bin" $args; } | tee "$out/$name.txt"
done
# The interpreter CMake found (the one that imports torch; summarize.py needs only the standard library).
python="$(sed -n 's/^GRADCOMP_TORCH_PYTHON:FILEPATH=//p' build/default/CMakeCache.txt 2>/dev/null || true)"
"${python:-/usr/bin/python3}" examples/libtorch/summarize.py "$out" > "$out/table.md"
cat "$out/table.md"
