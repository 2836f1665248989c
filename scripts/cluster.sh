#!/usr/bin/env bash
# An emulated cluster on one machine: test hosts as Linux network namespaces, joined by veth
# pairs to a bridge, each host's link shaped to a rate with tc (tbf) in both directions, like a
# switch port of that speed. Latency cannot be added (no netem here), only bandwidth limited.
#
#   scripts/cluster.sh up <hosts> <rate>       make the hosts (rate: 100mbit, 1gbit, 10gbit, ...)
#   scripts/cluster.sh mpirun <mpirun args>    an MPI job, one rank per host, TCP on the hosts
#   scripts/cluster.sh spawn <command> [args]  the command once per host, with RANK, WORLD_SIZE,
#                                              MASTER_ADDR, MASTER_PORT set (PyTorch gloo)
#   scripts/cluster.sh exec <host> <command>   one command on host 0, 1, ...
#   scripts/cluster.sh status                  the hosts, their addresses and qdiscs
#   scripts/cluster.sh down                    removes everything `up` made
#   scripts/cluster.sh run <hosts> <rate> <mpirun args>
#                                              up, mpirun, down (down also when the job fails)
#
# Hosts are namespaces gradcomp-h0, gradcomp-h1, ... (the prefix is ${GRADCOMP_CLUSTER_NAME},
# default gradcomp) with addresses ${GRADCOMP_CLUSTER_NET}.1, .2, ... (default net 10.231.7, a
# /24); the bridge gradcomp-br holds .254 in the root namespace
# so that mpirun reaches the daemons it starts on the hosts. Traffic of these jobs goes only
# to those addresses. Open MPI is told to use TCP on that subnet only (btl tcp,self;
# btl_tcp_if_include and oob_tcp_if_include), and starts its daemons through a small agent that
# runs them under `ip netns exec` (ranks started by `ip netns exec` inside one mpirun fail in
# MPI_Init: PMIx cannot reach its server across namespaces). The hostfile names the hosts by
# address, so no name file is changed. Ranks yield when idle (mpi_yield_when_idle 1): Open MPI's
# busy polling otherwise starves the kernel's packet processing on a small machine, and every
# message waited for a scheduler tick (alpha about 4 ms instead of 16 us on these 2 cores).
# The daemons' hwloc topology sharing is off (rtc ^hwloc): a daemon in a namespace sometimes
# crashed writing it (Open MPI 4.1.4, a segfault in hwloc_shmem_topology_write).
#
# Needs root and `ip netns` (iproute2); refuses clearly otherwise. State lives in
# ${GRADCOMP_CLUSTER_STATE:-/run/gradcomp-cluster}. A failed `up` removes what it made.
set -Eeuo pipefail  # -E: the ERR trap of a failed `up` also fires inside functions

net="${GRADCOMP_CLUSTER_NET:-10.231.7}"
[[ "$net" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || {
  echo "cluster.sh: GRADCOMP_CLUSTER_NET must be the first three parts of an address, e.g. 10.231.7" >&2
  exit 2
}
name="${GRADCOMP_CLUSTER_NAME:-gradcomp}"
[[ "$name" =~ ^[a-z][a-z0-9]{0,9}$ ]] || {
  echo "cluster.sh: GRADCOMP_CLUSTER_NAME must be 1 to 10 lowercase letters and digits" >&2
  exit 2
}
bridge="${name}-br"
ns_prefix="${name}-h"
veth_prefix="${name}v"
state="${GRADCOMP_CLUSTER_STATE:-/run/${name}-cluster}"
[[ "$state" =~ ^/[A-Za-z0-9._/-]+$ ]] || {
  echo "cluster.sh: GRADCOMP_CLUSTER_STATE must be an absolute path of letters, digits and . _ - /" >&2
  exit 2
}
max_hosts=64

die() {
  echo "cluster.sh: $*" >&2
  exit 2
}

usage() {
  sed -n '2,14p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

need_rights() {
  [ "$(id -u)" -eq 0 ] || die "needs root (network namespaces, a bridge and tc); run it as root"
  command -v ip >/dev/null || die "needs 'ip' from iproute2 (apt-get install iproute2)"
  command -v tc >/dev/null || die "needs 'tc' from iproute2 (apt-get install iproute2)"
  ip netns list >/dev/null 2>&1 || die "'ip netns' does not work here (no network namespaces?)"
}

# Bits per second of a tc-style rate: 100mbit, 1gbit, 10gbit, 500kbit, 1000000 (bit/s).
rate_bits() {
  local r="$1" num unit
  num="${r%%[a-zA-Z]*}"
  unit="${r#"$num"}"
  [[ "$num" =~ ^[0-9]+([.][0-9]+)?$ ]] || die "rate '$r': expected a number and a unit, e.g. 100mbit, 1gbit"
  case "$unit" in
    "" | bit) awk -v n="$num" 'BEGIN { printf "%.0f", n }' ;;
    kbit) awk -v n="$num" 'BEGIN { printf "%.0f", n * 1e3 }' ;;
    mbit) awk -v n="$num" 'BEGIN { printf "%.0f", n * 1e6 }' ;;
    gbit) awk -v n="$num" 'BEGIN { printf "%.0f", n * 1e9 }' ;;
    *) die "rate '$r': unit must be bit, kbit, mbit or gbit" ;;
  esac
}

# A rate of at least 1 kbit/s (tbf refuses 0), in bit/s.
checked_rate_bits() {
  local bits
  bits="$(rate_bits "$1")"
  [ "$bits" -ge 1000 ] || die "rate '$1': must be at least 1kbit"
  echo "$bits"
}

is_up() { [ -f "$state/hosts" ]; }

# The token bucket must be small, so that a message runs at the rate from its first bytes and
# not after a burst at memory speed (a real port serialises every byte at its rate; with a
# 16 KiB bucket an 8 KiB sparse payload crossed at memory speed, 0.3x the cost model), and must
# hold the largest packet. It holds two packets. Under 512 Mbit/s segmentation offload is off
# on the host's veth pair (gso_max_segs 1): a packet is a frame, the bucket 3028 bytes (0.24 ms
# at 100 Mbit/s). From 512 Mbit/s, per-frame processing of both directions on these 2 cores
# tops out near 450 Mbit/s, so offload stays on with packets of at most 8 KiB (gso_max_size)
# and a 16 KiB bucket (0.13 ms at 1 Gbit/s); from 4 Gbit/s 16 KiB packets and a 32 KiB bucket
# (26 us at 10 Gbit/s). Found by trying, with the hosts on loss-based TCP (congestion_control
# below): 4 hosts sending at once at 1 Gbit/s ran at 13.4 ns/byte with 8 KiB packets and at
# 20 with 4 KiB ones. The cost model uses the measured beta and the bucket's burst as
# measure_link finds it, and docs/cluster.md gives both next to what is configured.
needs_small_frames() {  # rate in bit/s
  [ "$1" -lt 512000000 ]
}

packet_bytes() {  # rate in bit/s: the largest packet the veth pair sends
  if needs_small_frames "$1"; then
    echo 1514
  elif [ "$1" -lt 4000000000 ]; then
    echo 8192
  else
    echo 16384
  fi
}

burst_bytes() {  # rate in bit/s
  echo $((2 * $(packet_bytes "$1")))
}

# The hosts' TCP congestion control: loss-based, cubic (Linux's usual default) where a namespace
# may use it, else reno. A namespace inherits the machine's, here BBR, and under BBR each
# direction of a two-way exchange waited for ACKs queued behind the other direction's data
# in the shaped port: found by trying, the same dense allreduce (P = 2, 100 Mbit/s, 4 MB)
# took 354 to 490 ms (the least of 5 repeats) from one call to the next, and 354 ms in every
# call under reno.
congestion_control() {  # congestion_control <netns>
  local cc
  for cc in cubic reno; do
    if ip netns exec "$1" sysctl -q -w net.ipv4.tcp_congestion_control="$cc" >/dev/null 2>&1; then
      return 0
    fi
  done
  echo "cluster: $1 keeps the machine's TCP congestion control ($(ip netns exec "$1" sysctl -n net.ipv4.tcp_congestion_control)); timings may vary" >&2
}

shape() {  # shape <netns or ""> <device> <rate>
  local ns="$1" dev="$2" rate="$3" bits burst
  bits="$(rate_bits "$rate")"
  burst="$(burst_bytes "$bits")"
  if [ -n "$ns" ]; then
    ip netns exec "$ns" tc qdisc replace dev "$dev" root tbf rate "$bits" burst "$burst" latency 200ms
  else
    tc qdisc replace dev "$dev" root tbf rate "$bits" burst "$burst" latency 200ms
  fi
}

cmd_down() {
  need_rights
  local ns
  for ns in $(ip netns list | awk '{print $1}' | grep "^${ns_prefix}[0-9]*$" || true); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  # The host ends of the veth pairs went with their namespaces; the bridge ends follow.
  local dev
  for dev in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep "^${veth_prefix}[0-9]*$" || true); do
    ip link del "$dev" 2>/dev/null || true
  done
  ip link del "$bridge" 2>/dev/null || true
  # Only the files `up` writes and the hosts' session files, then the directory if it is left empty.
  rm -f "$state/hosts" "$state/hosts.tmp" "$state/hostfile" "$state/rate" "$state/agent"
  rm -rf "$state/tmp"
  rmdir "$state" 2>/dev/null || true
}

cmd_up() {
  [ $# -eq 2 ] || die "up: expected <hosts> <rate>, e.g. up 4 100mbit"
  local n="$1" rate="$2"
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$max_hosts" ] ||
    die "up: hosts must be between 1 and $max_hosts (got '$n')"
  checked_rate_bits "$rate" >/dev/null
  need_rights
  is_up && die "a cluster is already up ($(wc -l <"$state/hosts") hosts); run 'scripts/cluster.sh down' first"
  if ip -o link show "$bridge" >/dev/null 2>&1; then
    die "a link named $bridge exists without cluster state; run 'scripts/cluster.sh down' first"
  fi
  # The subnet must be ours alone: refuse when a route other than the default one covers an
  # address of it, or an interface holds one.
  local routes addrs
  routes="$(ip -4 route show match "${net}.1" 2>/dev/null | grep -v '^default' || true)"
  addrs="$(ip -4 -o addr show 2>/dev/null | grep -F " ${net}." || true)"
  if [ -n "$routes" ] || [ -n "$addrs" ]; then
    die "the subnet ${net}.0/24 is already in use here (${routes:-$addrs}); set GRADCOMP_CLUSTER_NET to a free /24 (e.g. 10.232.7)"
  fi

  trap 'echo "cluster.sh: up failed; removing what it made" >&2; cmd_down' ERR
  mkdir -p "$state"
  ip link add "$bridge" type bridge
  ip addr add "${net}.254/24" dev "$bridge"
  ip link set "$bridge" up
  local i ns ip bits
  bits="$(rate_bits "$rate")"
  : >"$state/hosts.tmp"
  for ((i = 0; i < n; i++)); do
    ns="${ns_prefix}${i}"
    ip="${net}.$((i + 1))"
    ip netns add "$ns"
    ip link add "${veth_prefix}${i}" type veth peer name eth0 netns "$ns"
    if needs_small_frames "$bits"; then
      ip link set "${veth_prefix}${i}" gso_max_segs 1
      ip netns exec "$ns" ip link set eth0 gso_max_segs 1
    else
      ip link set "${veth_prefix}${i}" gso_max_size "$(packet_bytes "$bits")"
      ip netns exec "$ns" ip link set eth0 gso_max_size "$(packet_bytes "$bits")"
    fi
    ip link set "${veth_prefix}${i}" master "$bridge"
    ip link set "${veth_prefix}${i}" up
    ip netns exec "$ns" ip link set lo up
    congestion_control "$ns"
    ip netns exec "$ns" ip addr add "${ip}/24" dev eth0
    ip netns exec "$ns" ip link set eth0 up
    shape "$ns" eth0 "$rate"     # what the host sends
    shape "" "${veth_prefix}${i}" "$rate"   # what the host receives
    echo "$ns $ip" >>"$state/hosts.tmp"
  done
  echo "$rate" >"$state/rate"
  awk '{print $2 " slots=1"}' "$state/hosts.tmp" >"$state/hostfile"
  # mpirun's agent: `agent <host> <command...>` runs the command on that host.
  cat >"$state/agent" <<EOF
#!/bin/sh
# Written by scripts/cluster.sh: runs Open MPI's daemon on an emulated host.
host="\$1"; shift
ns=\$(awk -v h="\$host" '\$2 == h { print \$1 }' "$state/hosts")
[ -n "\$ns" ] || { echo "cluster agent: unknown host \$host" >&2; exit 1; }
# Each host's daemon and ranks keep their session files apart (TMPDIR): the hosts share one
# /tmp and one host name, and a daemon once failed to make its session directory there while
# another's was being made or removed.
mkdir -p "$state/tmp/\$ns"
export TMPDIR="$state/tmp/\$ns"
exec ip netns exec "\$ns" /bin/sh -c "\$*"
EOF
  chmod +x "$state/agent"
  mv "$state/hosts.tmp" "$state/hosts"
  trap - ERR
  echo "cluster: $n hosts at $rate each way ($(rate_bits "$rate") bit/s): $(awk '{printf "%s ", $2}' "$state/hosts")"
}

mpi_args() {
  local subnet="${net}.0/24"
  echo --hostfile "$state/hostfile" --map-by node \
    --mca plm_rsh_agent "$state/agent" \
    --mca btl tcp,self --mca btl_tcp_if_include "$subnet" --mca oob_tcp_if_include "$subnet" \
    --mca pml ob1 --mca mpi_yield_when_idle 1 --mca rtc ^hwloc
}

cmd_mpirun() {
  need_rights
  is_up || die "no cluster is up; run 'scripts/cluster.sh up <hosts> <rate>' first"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
  # shellcheck disable=SC2046
  mpirun $(mpi_args) "$@"
}

cmd_exec() {
  [ $# -ge 2 ] || die "exec: expected <host> <command...>"
  need_rights
  is_up || die "no cluster is up"
  local h="$1"
  shift
  [[ "$h" =~ ^[0-9]+$ ]] || die "exec: host must be a number (0, 1, ...), not '$h'"
  local ns
  ns="$(awk -v i="$h" 'NR == i + 1 { print $1 }' "$state/hosts")"
  [ -n "$ns" ] || die "exec: no host $h (hosts: 0 to $(($(wc -l <"$state/hosts") - 1)))"
  ip netns exec "$ns" "$@"
}

cmd_spawn() {
  [ $# -ge 1 ] || die "spawn: expected <command...>"
  need_rights
  is_up || die "no cluster is up"
  local world master port pids=() i=0 ns ip status=0
  world="$(wc -l <"$state/hosts")"
  master="$(awk 'NR == 1 { print $2 }' "$state/hosts")"
  port="${GRADCOMP_CLUSTER_PORT:-29500}"
  while read -r ns ip; do
    RANK="$i" LOCAL_RANK=0 WORLD_SIZE="$world" MASTER_ADDR="$master" MASTER_PORT="$port" \
      GLOO_SOCKET_IFNAME=eth0 ip netns exec "$ns" "$@" &
    pids+=("$!")
    i=$((i + 1))
  done <"$state/hosts"
  # The first failure ends the others: no rank is left waiting for one that is gone; so does an
  # interrupt of this script.
  trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT INT TERM
  local left=${#pids[@]}
  while [ "$left" -gt 0 ]; do
    if ! wait -n; then
      status=1
      kill "${pids[@]}" 2>/dev/null || true
    fi
    left=$((left - 1))
  done
  return "$status"
}

cmd_status() {
  need_rights
  is_up || { echo "no cluster is up"; return 0; }
  echo "rate $(cat "$state/rate") each way"
  local ns ip
  while read -r ns ip; do
    echo "$ns $ip: $(ip netns exec "$ns" tc qdisc show dev eth0 | head -1), tcp $(ip netns exec "$ns" sysctl -n net.ipv4.tcp_congestion_control)"
  done <"$state/hosts"
}

cmd_run() {
  [ $# -ge 3 ] || die "run: expected <hosts> <rate> <mpirun args...>"
  local n="$1" rate="$2"
  shift 2
  cmd_up "$n" "$rate"
  trap 'cmd_down' EXIT
  cmd_mpirun "$@"
}

[ $# -ge 1 ] || usage
sub="$1"
shift
case "$sub" in
  up) cmd_up "$@" ;;
  down) cmd_down ;;
  mpirun) cmd_mpirun "$@" ;;
  spawn) cmd_spawn "$@" ;;
  exec) cmd_exec "$@" ;;
  status) cmd_status ;;
  run) cmd_run "$@" ;;
  -h | --help | help) usage ;;
  *) die "unknown command '$sub' (up, mpirun, spawn, exec, status, down, run)" ;;
esac
