#!/usr/bin/env bash
# Configures, builds and tests every preset (default: Release; asan: Debug with
# AddressSanitizer + UBSan; tsan: Debug with ThreadSanitizer, only the tests labelled
# `threads`). Stops at the first failure with a non-zero status. Tests run one per core
# (ctest --parallel): the tests that start MPI ranks or other processes declare them (the
# PROCESSORS property, at most 2 for the 4-rank Python tests), so on 2 cores they run with
# nothing beside them; the emulated-cluster tests share one lock (RESOURCE_LOCK
# gradcomp_cluster), and the CUDA and NCCL tests another (gpu), so that on a GPU machine they
# take the device one at a time. Tests whose ranks are threads in one process run beside
# another test; the few time limits they check are several times what they take alone.
# Usage: scripts/test.sh [preset...]   (default: default asan tsan)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/deps.sh

# mpirun refuses to run as root (CI containers are root) and refuses more
# ranks than cores (CI machines are small) unless told otherwise.
export OMPI_ALLOW_RUN_AS_ROOT=1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_rmaps_base_oversubscribe=1

presets=("$@")
if [ "${#presets[@]}" -eq 0 ]; then
  presets=(default asan tsan)
fi

# Each phase's wall time, printed as it ends and again in a table at the end (the CI log's
# record of where its time goes).
phase_times=()
timed() {  # timed <label> <command...>
  local label="$1" start=$SECONDS
  shift
  "$@"
  local took=$((SECONDS - start))
  phase_times+=("$(printf '%-20s %4d s' "$label" "$took")")
  echo "=== ${label}: ${took} s ==="
}

for preset in "${presets[@]}"; do
  echo "=== preset ${preset} ==="
  timed "${preset} configure" cmake --preset "$preset"
  timed "${preset} build" cmake --build --preset "$preset" --parallel "$(nproc)"
  timed "${preset} tests" ctest --preset "$preset" --parallel "$(nproc)"
done
echo "=== phase times ==="
printf '%s\n' "${phase_times[@]}"
echo "=== all presets passed: ${presets[*]} ==="
