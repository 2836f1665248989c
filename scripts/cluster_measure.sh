#!/usr/bin/env bash
# The emulated cluster's measurements (docs/cluster.md), each run on hosts made for it by
# scripts/cluster.sh and removed afterwards. Logs go to results/cluster/ (or $OUT).
#
#   scripts/cluster_measure.sh [calibrate] [exchanges] [lags] [tta]     (default: all four)
#
#   calibrate  alpha and beta by ping-pong between 2 hosts at 100 Mbit/s, 1 and 10 Gbit/s
#   exchanges  every exchange at P = 2 and 4, n = 1M and 25.6M, density 0.001 and 0.01, against
#              the cost model, on 100 Mbit/s and 1 Gbit/s links (tools/exchange_model; the
#              link measured 3 times, each cost the median; the exchanges timed in turns)
#   lags       LAGS-SGD on Fashion-MNIST, 4 hosts at 100 Mbit/s: planned and measured overlap
#   tta        time to accuracy on Fashion-MNIST, 4 hosts at 100 Mbit/s: dense, top-k 0.01,
#              DGC 0.001, LAGS, PQASGD, with the test accuracy 4 times per epoch
#
# Needs root (scripts/cluster.sh) and a build of the default preset (cmake --preset default &&
# cmake --build --preset default). examples/cluster/summarize.py makes the tables from the logs,
# examples/cluster/plot.sh the time-to-accuracy plot.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

out="${OUT:-results/cluster}"
build=build/default
epochs="${GRADCOMP_TTA_EPOCHS:-5}"
mkdir -p "$out"
for exe in "$build/tools/exchange_model" "$build/examples/train_fashion_mnist"; do
  [ -x "$exe" ] || { echo "cluster_measure.sh: $exe is missing; build the default preset first" >&2; exit 2; }
done

parts=("$@")
[ "${#parts[@]}" -gt 0 ] || parts=(calibrate exchanges lags tta)

# run <log> <hosts> <rate> <command...>: one job on fresh hosts, its output kept with a header.
run() {
  local log="$1" hosts="$2" rate="$3"
  shift 3
  {
    echo "# scripts/cluster.sh run $hosts $rate -np $hosts $*"
    echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ), git $(git rev-parse --short HEAD)"
    scripts/cluster.sh run "$hosts" "$rate" -np "$hosts" "$@" 2>&1 | grep -v '^cluster: '
  } >"$out/$log"
  echo "cluster_measure.sh: $out/$log"
}

for part in "${parts[@]}"; do
  case "$part" in
    calibrate)
      for rate in 100mbit 1gbit 10gbit; do
        run "calibrate_$rate.txt" 2 "$rate" "$build/tools/exchange_model" --no-tables --link-only
      done
      ;;
    exchanges)
      for rate in 100mbit 1gbit; do
        for p in 2 4; do
          run "exchanges_${rate}_p$p.txt" "$p" "$rate" "$build/tools/exchange_model" --no-tables \
            --sizes 1048576,25600000 --repeats 3 --calibrations 3
        done
      done
      ;;
    lags)
      run lags_100mbit.txt 4 100mbit "$build/examples/train_fashion_mnist" --schedule lags \
        --compressor topk --density 0.001 --epochs 1
      ;;
    tta)
      common=(--epochs "$epochs" --evals-per-epoch 4)
      run tta_dense.txt 4 100mbit "$build/examples/train_fashion_mnist" "${common[@]}"
      run tta_topk_0.01.txt 4 100mbit "$build/examples/train_fashion_mnist" "${common[@]}" \
        --compressor topk --density 0.01
      run tta_dgc_0.001.txt 4 100mbit "$build/examples/train_fashion_mnist" "${common[@]}" \
        --compressor dgc --density 0.001
      run tta_lags_0.001.txt 4 100mbit "$build/examples/train_fashion_mnist" "${common[@]}" \
        --schedule lags --compressor topk --density 0.001
      run tta_pqasgd_p4_qsgd_2bit.txt 4 100mbit "$build/examples/train_fashion_mnist" "${common[@]}" \
        --schedule pqasgd --compressor qsgd --bits 2 --period 4
      ;;
    *)
      echo "cluster_measure.sh: unknown part '$part' (calibrate, exchanges, lags, tta)" >&2
      exit 2
      ;;
  esac
done
