#!/usr/bin/env bash
# Builds the libFuzzer targets with clang++ (build/fuzz) and runs each for a bounded time over
# a copy of its seed corpus (fuzz/corpus/<target>/). Fails if any target crashes, leaks or
# violates a property; the input that did it is left in build/fuzz/artifacts/<target>/.
# Usage: scripts/fuzz.sh [target...]   (default: all seven)
# GRADCOMP_FUZZ_SECONDS: seconds of one core per target (default 60); GRADCOMP_FUZZ_JOBS:
# targets at a time (default: all of them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

scripts/deps.sh

seconds="${GRADCOMP_FUZZ_SECONDS:-60}"
build=build/fuzz
targets=("$@")
if [ "${#targets[@]}" -eq 0 ]; then
  targets=(fuzz_wire_decode fuzz_decode_identity fuzz_decode_fp16 fuzz_decode_bf16
           fuzz_decode_qsgd fuzz_decode_terngrad fuzz_decode_scaled_sign)
fi

cmake -S . -B "$build" -DCMAKE_CXX_COMPILER=clang++ -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DGRADCOMP_BUILD_FUZZERS=ON -DGRADCOMP_BUILD_TESTS=OFF -DGRADCOMP_BUILD_EXAMPLES=OFF \
  -DGRADCOMP_BUILD_BENCHMARKS=OFF -DGRADCOMP_BUILD_TOOLS=OFF
# One build of all the targets asked for: with Makefiles, several --target names are built one
# after another, each on its own, so the seven become one target (gradcomp_fuzzers) when all
# are asked for.
if [ "$#" -eq 0 ]; then
  cmake --build "$build" --parallel "$(nproc)" --target gradcomp_fuzzers
else
  cmake --build "$build" --parallel "$(nproc)" --target "${targets[@]}"
fi

# Targets run side by side, GRADCOMP_FUZZ_JOBS at a time (default: all at once); each writes a
# log of its own, printed when it ends. Each target gets GRADCOMP_FUZZ_SECONDS of one core:
# when more run at once than there are cores, each runs for seconds x running / cores of wall
# time (libFuzzer's -max_total_time is wall time). All seven at once on 2 cores take 210 s;
# two at a time they took 4 rounds of 60 s, the last with one core idle.
cores="$(nproc)"
jobs="${GRADCOMP_FUZZ_JOBS:-${#targets[@]}}"
if [ "$jobs" -gt "${#targets[@]}" ]; then jobs="${#targets[@]}"; fi
wall="$seconds"
if [ "$jobs" -gt "$cores" ]; then wall=$(( (seconds * jobs + cores - 1) / cores )); fi
run_one() {
  local target="$1"
  # libFuzzer adds what it finds to the first corpus directory: a copy keeps the repository's
  # seeds as they are.
  local corpus="$build/corpus/$target" artifacts="$build/artifacts/$target"
  rm -rf "$corpus" "$artifacts"
  mkdir -p "$corpus" "$artifacts"
  cp -r "fuzz/corpus/$target/." "$corpus/"
  "$build/fuzz/$target" "$corpus" \
    -max_total_time="$wall" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$artifacts/" -print_final_stats=1 >"$build/$target.log" 2>&1
}

failed=()
declare -A pids=()
finish() {  # waits for one running target, prints its log, records a failure
  local target="$1"
  local rc=0
  wait "${pids[$target]}" || rc=$?
  unset "pids[$target]"
  echo "=== ${target}: ${wall} s (${seconds} s of one core), exit ${rc} ==="
  if [ "$rc" -ne 0 ]; then
    cat "$build/$target.log"
    failed+=("$target")
  else
    grep -E '^(Done |stat::number_of_executed_units|stat::peak_rss)' "$build/$target.log" || true
  fi
}
queue=("${targets[@]}")
running=()
while [ "${#queue[@]}" -gt 0 ] || [ "${#running[@]}" -gt 0 ]; do
  while [ "${#queue[@]}" -gt 0 ] && [ "${#running[@]}" -lt "$jobs" ]; do
    target="${queue[0]}"
    queue=("${queue[@]:1}")
    run_one "$target" &
    pids[$target]=$!
    running+=("$target")
  done
  # Oldest first: they all run for the same time.
  finish "${running[0]}"
  running=("${running[@]:1}")
done

if [ "${#failed[@]}" -ne 0 ]; then
  echo "=== fuzzing FAILED: ${failed[*]} (inputs in $build/artifacts/) ===" >&2
  exit 1
fi
echo "=== fuzzing passed: ${targets[*]} (${seconds} s of one core each, ${jobs} at a time) ==="
