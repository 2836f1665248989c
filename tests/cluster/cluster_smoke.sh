#!/usr/bin/env bash
# ctest cluster_smoke: scripts/cluster.sh makes 2 shaped hosts, runs an MPI job with one rank on
# each, and removes everything, also when the job fails. Skips (exit 77) without the rights.
#   tests/cluster/cluster_smoke.sh <mpi_quickstart executable>
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cluster="$here/scripts/cluster.sh"
quickstart="$1"

# The rights, tried for real: root, a namespace, a bridge and a tbf qdisc (a root container
# without CAP_NET_ADMIN lists namespaces but cannot make them).
can_make_hosts() {
  [ "$(id -u)" -eq 0 ] && command -v ip >/dev/null && command -v tc >/dev/null || return 1
  local ok=0
  ip netns add gcsmoke-probe 2>/dev/null || return 1
  ip netns del gcsmoke-probe 2>/dev/null
  if ip link add gcsmokeprobe type bridge 2>/dev/null; then
    tc qdisc replace dev gcsmokeprobe root tbf rate 100mbit burst 16384 latency 200ms 2>/dev/null || ok=1
    ip link del gcsmokeprobe 2>/dev/null
  else
    ok=1
  fi
  return "$ok"
}
if ! can_make_hosts; then
  echo "SKIPPED: cluster_smoke needs root and the rights to make network namespaces, bridges and tbf qdiscs (iproute2)"
  exit 77
fi

# Names and a subnet of its own, so that a cluster a developer has up is left alone.
export GRADCOMP_CLUSTER_NAME=gcsmoke GRADCOMP_CLUSTER_NET=10.231.9
unset GRADCOMP_CLUSTER_STATE
fail() {
  echo "cluster_smoke: FAILED: $*" >&2
  exit 1
}
# Whatever happens (a failure, a timeout's SIGTERM), nothing is left behind.
trap '"$cluster" down >/dev/null 2>&1' EXIT
leftovers() {
  local a b
  a="$(ip netns list | grep -c '^gcsmoke-h')"
  b="$(ip -o link show | grep -c 'gcsmoke')"
  echo $((a + b))
}
"$cluster" down >/dev/null 2>&1

# Refusals name what is wrong and make nothing.
out="$("$cluster" up 0 100mbit 2>&1)" && fail "up 0 hosts was accepted"
grep -q "hosts must be between 1 and" <<<"$out" || fail "up 0: unclear refusal: $out"
out="$("$cluster" up 2 fast 2>&1)" && fail "a rate without a number was accepted"
grep -q "rate 'fast'" <<<"$out" || fail "up 2 fast: unclear refusal: $out"
out="$("$cluster" up 2 0mbit 2>&1)" && fail "a rate of 0 was accepted"
grep -q "at least 1kbit" <<<"$out" || fail "up 2 0mbit: unclear refusal: $out"
out="$("$cluster" mpirun -np 2 true 2>&1)" && fail "mpirun without a cluster was accepted"
grep -q "no cluster is up" <<<"$out" || fail "mpirun without a cluster: unclear refusal: $out"
[ "$(leftovers)" -eq 0 ] || fail "a refused command left namespaces or links behind"

"$cluster" up 2 100mbit || fail "up 2 100mbit"
# Each host's link is shaped both ways, and each rank runs on its own host.
for h in 0 1; do
  "$cluster" exec "$h" tc qdisc show dev eth0 | grep -q "tbf.*rate 100Mbit" ||
    fail "host $h's eth0 is not shaped to 100Mbit"
  # Loss-based TCP on the hosts (docs/cluster.md), whatever the machine's own is.
  cc="$("$cluster" exec "$h" sysctl -n net.ipv4.tcp_congestion_control)"
  case "$cc" in cubic | reno) ;; *) fail "host $h's TCP congestion control is '$cc', not cubic or reno" ;; esac
done
tc qdisc show dev gcsmokev0 | grep -q "tbf.*rate 100Mbit" || fail "the bridge side of host 0 is not shaped"
out="$("$cluster" mpirun -np 2 sh -c 'ip -4 -o addr show dev eth0' 2>&1)" || fail "mpirun: $out"
for a in 10.231.9.1 10.231.9.2; do
  grep -q "inet $a/24" <<<"$out" || fail "no rank ran on host $a: $out"
done
"$cluster" up 2 100mbit >/dev/null 2>&1 && fail "a second up was accepted"

# An exchange over the shaped link, a few steps.
out="$("$cluster" mpirun -np 2 "$quickstart" 20 2>&1)" || fail "mpi_quickstart on 2 hosts: $out"
echo "$out"
grep -q "2 ranks" <<<"$out" || fail "mpi_quickstart did not run on 2 ranks"
grep -q "sparse_allgather .*ran: sparse_allgather" <<<"$out" || fail "no sparse_allgather row"
"$cluster" down || fail "down"
[ "$(leftovers)" -eq 0 ] || fail "down left namespaces or links behind"

# A failing job: `run` still removes everything.
"$cluster" run 2 1gbit -np 2 false >/dev/null 2>&1 && fail "a failing job reported success"
[ "$(leftovers)" -eq 0 ] || fail "a failing run left namespaces or links behind"
echo "cluster_smoke: passed"
