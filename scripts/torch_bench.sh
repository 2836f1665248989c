#!/usr/bin/env bash
# The DDP hook's local work, gradcomp.torch against a hand-written torch.topk hook body, in one
# run (bench/torch_hook_bench.py; arguments go to it). Run it on a quiet machine.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec scripts/torch_python.sh bench/torch_hook_bench.py "$@"
