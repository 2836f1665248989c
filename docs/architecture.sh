#!/usr/bin/env bash
# Renders docs/architecture.dot to docs/architecture.png and docs/architecture.svg.
# Needs graphviz (Debian: apt-get install graphviz); not part of CI.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
if ! command -v dot > /dev/null; then
  echo "architecture.sh: needs graphviz's dot (Debian: apt-get install graphviz)" >&2
  exit 1
fi
dot -Tpng -Gdpi=110 architecture.dot -o architecture.png
dot -Tsvg architecture.dot -o architecture.svg
echo "wrote docs/architecture.png and docs/architecture.svg"
