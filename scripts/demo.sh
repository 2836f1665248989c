#!/usr/bin/env bash
# Builds and runs the quickstart example, nothing else.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/deps.sh
cmake --preset default
cmake --build --preset default --target quickstart --parallel "$(nproc)"
build/default/examples/quickstart
