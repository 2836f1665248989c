#!/usr/bin/env bash
# Runs examples/torch/train_ddp.py once per row and seed (1, 2, 3) of the PyTorch results
# table, one run after the other (they share the machine's cores), and keeps each run's output
# in results/torch/<row>_seed<S>.txt; then examples/torch/summarize.py writes the table
# (results/torch/table.md) and examples/torch/plot.sh draws docs/torch_ddp.png.
# Usage: examples/torch/results.sh [row...]   (default: every row)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

out=results/torch
mkdir -p "$out"

# row name | train_ddp.py arguments (4 gloo workers, 3 epochs, batch 32, lr 0.05, momentum 0.9)
rows=(
  "cnn_allreduce|--model cnn --hook allreduce"
  "cnn_fp16|--model cnn --hook fp16"
  "cnn_powersgd1|--model cnn --hook powersgd:1"
  "cnn_powersgd4|--model cnn --hook powersgd:4"
  "cnn_topk_0.01|--model cnn --hook gradcomp:topk:0.01"
  "cnn_topk_0.001|--model cnn --hook gradcomp:topk:0.001"
  "cnn_dgc_0.001|--model cnn --hook gradcomp:dgc:0.001"
  "cnn_gaussiank_0.001|--model cnn --hook gradcomp:gaussiank:0.001"
  "cnn_topk_0.01_dgcfb|--model cnn --hook gradcomp:topk:0.01,feedback=dgc"
  "cnn_dgc_0.001_warmup|--model cnn --hook gradcomp:dgc:0.001,warmup_epochs=1"
  "cnn_qsgd_4bit|--model cnn --hook gradcomp:dense,quantizer=qsgd,bits=4,feedback=none"
  "cnnsplit_allreduce|--model cnn --hook allreduce --bucket-cap-mb 0.05"
  "cnnsplit_topk_0.01|--model cnn --hook gradcomp:topk:0.01 --bucket-cap-mb 0.05"
  "mlp_allreduce|--model mlp --hook allreduce"
  "mlp_topk_0.01|--model mlp --hook gradcomp:topk:0.01"
  "mlp_dgc_0.001|--model mlp --hook gradcomp:dgc:0.001"
)

want=("$@")
for row in "${rows[@]}"; do
  name=${row%%|*}
  args=${row#*|}
  if [ "${#want[@]}" -gt 0 ] && [[ ! " ${want[*]} " == *" ${name} "* ]]; then
    continue
  fi
  for seed in 1 2 3; do
    echo "=== ${name} seed ${seed}: scripts/train_ddp.sh ${args} --seed ${seed}"
    # A run that fails (a diverged one stops at its first non-finite gradient) is kept as it is
    # and reported; the table leaves it out.
    # shellcheck disable=SC2086
    scripts/train_ddp.sh ${args} --seed "${seed}" 2>&1 | tee "${out}/${name}_seed${seed}.txt" ||
      echo "=== ${name} seed ${seed}: FAILED (kept in ${out}/${name}_seed${seed}.txt)"
  done
done
python="$(sed -n 's/^GRADCOMP_TORCH_PYTHON:FILEPATH=//p' build/default/CMakeCache.txt)"
"$python" examples/torch/summarize.py "$out" > "$out/table.md"
cat "$out/table.md"
examples/torch/plot.sh
