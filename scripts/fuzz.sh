#!/usr/bin/env bash
# Builds the libFuzzer targets with clang++ (build/fuzz) and runs each for a bounded time over
# a copy of its seed corpus (fuzz/corpus/<target>/). Fails if any target crashes, leaks or
# violates a property; the input that did it is left in build/fuzz/artifacts/<target>/.
# Usage: scripts/fuzz.sh [target...]   (default: all seven)
# GRADCOMP_FUZZ_SECONDS: seconds of one core for every target (default: 60 for
# fuzz_wire_decode, 30 for each decoder; see below); GRADCOMP_FUZZ_JOBS: targets at a time
# (default: all of them).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# wait -n -p (below) came with bash 5.1.
if [ "${BASH_VERSINFO[0]}" -lt 5 ] || { [ "${BASH_VERSINFO[0]}" -eq 5 ] && [ "${BASH_VERSINFO[1]}" -lt 1 ]; }; then
  echo "scripts/fuzz.sh needs bash 5.1 or later (this is ${BASH_VERSION})" >&2
  exit 2
fi

scripts/deps.sh

# Seconds of one core per target. The decoders' edge coverage stopped growing within the first
# 15% of 60-second runs (all seven at once, 2026-12-02: the last new edge came at 1,176 to
# 77,388 of 518,258 to 1,016,547 executions), while the wire decoder found new edges until 66%
# of its run (523,408 of 796,549): the wire decoder keeps 60 s, each decoder gets 30.
seconds_of() {
  if [ -n "${GRADCOMP_FUZZ_SECONDS:-}" ]; then
    echo "$GRADCOMP_FUZZ_SECONDS"
  elif [ "$1" = fuzz_wire_decode ]; then
    echo 60
  else
    echo 30
  fi
}
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
# log of its own, printed when it ends. Each target gets its seconds of one core (seconds_of);
# libFuzzer's -max_total_time is wall time, so when more run at once than there are cores the
# wall times are longer. All at once (the default), the cores are shared equally among the
# targets still running: the awk below gives each target the wall time at which it has had its
# seconds (the seven on 2 cores: the decoders 105 s, the wire decoder 135 s, against 210 s
# for all seven at 60 s). A few at a time, each runs for seconds x running / cores.
cores="$(nproc)"
jobs="${GRADCOMP_FUZZ_JOBS:-${#targets[@]}}"
if [ "$jobs" -gt "${#targets[@]}" ]; then jobs="${#targets[@]}"; fi
declare -A wall_of=()
if [ "$jobs" -eq "${#targets[@]}" ]; then
  # Processor sharing: in order of their seconds, each target ends when it has had them; until
  # then each of the m running gets min(1, cores / m) of a core.
  while read -r target wall; do
    wall_of[$target]="$wall"
  done < <(for t in "${targets[@]}"; do echo "$t $(seconds_of "$t")"; done | sort -k2,2n |
           awk -v cores="$cores" '{ name[NR] = $1; secs[NR] = $2 }
             END { t = 0; had = 0
                   for (i = 1; i <= NR; ++i) {
                     m = NR - i + 1; rate = cores / m; if (rate > 1) rate = 1
                     t += (secs[i] - had) / rate; had = secs[i]
                     w = int(t); if (w < t) ++w
                     print name[i], w } }')
else
  for t in "${targets[@]}"; do
    s="$(seconds_of "$t")"
    wall_of[$t]="$s"
    if [ "$jobs" -gt "$cores" ]; then wall_of[$t]=$(( (s * jobs + cores - 1) / cores )); fi
  done
fi
run_one() {
  local target="$1" wall="${wall_of[$1]}"
  # libFuzzer adds what it finds to the first corpus directory: a copy keeps the repository's
  # seeds as they are.
  local corpus="$build/corpus/$target" artifacts="$build/artifacts/$target"
  rm -rf "$corpus" "$artifacts"
  mkdir -p "$corpus" "$artifacts"
  cp -r "fuzz/corpus/$target/." "$corpus/"
  # exec: the job's pid is the fuzzer's own, which the trap below can stop.
  exec "$build/fuzz/$target" "$corpus" \
    -max_total_time="$wall" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
    -artifact_prefix="$artifacts/" -print_final_stats=1 >"$build/$target.log" 2>&1
}

failed=()
declare -A target_of=()  # pid -> target, for the targets running
# A target still running when the script stops (a failure, an interrupt) is stopped too.
trap 'for p in "${!target_of[@]}"; do kill "$p" 2>/dev/null || true; done' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
finish() {  # waits for whichever running target ends first, prints its log, records a failure
  local pid="" rc=0
  wait -n -p pid "${!target_of[@]}" || rc=$?
  if [ -z "$pid" ]; then
    # No job left to reap (one that bash already reported ended by a signal): the first of
    # those no longer alive has failed.
    for p in "${!target_of[@]}"; do
      if ! kill -0 "$p" 2>/dev/null; then pid="$p"; break; fi
    done
    if [ -z "$pid" ]; then sleep 1; return; fi
    rc=1
  fi
  local target="${target_of[$pid]}"
  unset "target_of[$pid]"
  echo "=== ${target}: ${wall_of[$target]} s ($(seconds_of "$target") s of one core), exit ${rc} ==="
  if [ "$rc" -ne 0 ]; then
    cat "$build/$target.log"
    failed+=("$target")
  else
    grep -E '^(Done |stat::number_of_executed_units|stat::peak_rss)' "$build/$target.log" || true
  fi
}
queue=("${targets[@]}")
while [ "${#queue[@]}" -gt 0 ] || [ "${#target_of[@]}" -gt 0 ]; do
  while [ "${#queue[@]}" -gt 0 ] && [ "${#target_of[@]}" -lt "$jobs" ]; do
    target="${queue[0]}"
    queue=("${queue[@]:1}")
    run_one "$target" &
    target_of[$!]="$target"
  done
  finish
done

if [ "${#failed[@]}" -ne 0 ]; then
  echo "=== fuzzing FAILED: ${failed[*]} (inputs in $build/artifacts/) ===" >&2
  exit 1
fi
echo "=== fuzzing passed: ${targets[*]} (${jobs} at a time) ==="
