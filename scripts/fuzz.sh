#!/usr/bin/env bash
# Builds the libFuzzer targets with clang++ (build/fuzz) and runs each for a bounded time over
# a copy of its seed corpus (fuzz/corpus/<target>/). Fails if any target crashes, leaks or
# violates a property; the input that did it is left in build/fuzz/artifacts/<target>/.
# Usage: scripts/fuzz.sh [target...]   (default: all seven)
# GRADCOMP_FUZZ_SECONDS: seconds per target (default 60).
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
cmake --build "$build" --parallel "$(nproc)" --target "${targets[@]}"

failed=()
for target in "${targets[@]}"; do
  echo "=== ${target}: ${seconds} s ==="
  # libFuzzer adds what it finds to the first corpus directory: a copy keeps the repository's
  # seeds as they are.
  corpus="$build/corpus/$target"
  artifacts="$build/artifacts/$target"
  rm -rf "$corpus" "$artifacts"
  mkdir -p "$corpus" "$artifacts"
  cp -r "fuzz/corpus/$target/." "$corpus/"
  if ! "$build/fuzz/$target" "$corpus" \
      -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
      -artifact_prefix="$artifacts/" -print_final_stats=1; then
    failed+=("$target")
  fi
done

if [ "${#failed[@]}" -ne 0 ]; then
  echo "=== fuzzing FAILED: ${failed[*]} (inputs in $build/artifacts/) ===" >&2
  exit 1
fi
echo "=== fuzzing passed: ${targets[*]} (${seconds} s each) ==="
