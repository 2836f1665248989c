#!/usr/bin/env bash
# Trains examples/torch/train_ddp.py (Fashion-MNIST, DDP over gloo) with the arguments given,
# e.g. `scripts/train_ddp.sh --hook gradcomp:topk:0.01`. Installs what is missing, builds only
# the gradcomp.torch extension, and runs the example with the interpreter that imports torch
# (scripts/torch_python.sh).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec scripts/torch_python.sh examples/torch/train_ddp.py "$@"
