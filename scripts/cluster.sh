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
# ${GRADCOMP_CLUSTER_STATE:-/run/gradcomp-cluster}, a directory of its own (not /, /etc, /var,
# ...). `up` lists in it, as it goes, every file, directory, namespace and link it made (the
# marker, made-by-cluster-up); `down`, and a failed or interrupted `up`, remove exactly those
# and nothing else, and `down` removes nothing from a directory without that marker.
set -euo pipefail

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

# `down` removes files and a directory below the state directory, so a value such as /etc or
# /var would remove /etc/hosts or /var/tmp. It must name a directory of its own: spelled
# plainly (no . or .. component, no //, no trailing /: the path checked is the path used, and
# /. or //etc cannot pass for another), and neither a system directory itself nor a link to one.
is_system_dir() {
  case "$1" in
    /var/tmp | /var/lib | /usr/local | /usr/lib) return 0 ;;
    /*/*) return 1 ;;  # below a top-level directory (the patterns below would match it too)
    / | /etc | /var | /usr | /bin | /sbin | /lib | /lib[0-9a-z]* | /boot | /dev | /proc | /sys | \
      /run | /tmp | /home | /root | /opt | /srv | /mnt | /media) return 0 ;;
  esac
  return 1
}
state_refused() {
  local why="$1"
  echo "cluster.sh: GRADCOMP_CLUSTER_STATE='$state' is refused: $why. It must name a directory of its own for the cluster's state, below a system directory (e.g. /run/${name}-cluster, the default): an absolute path of letters, digits and . _ - /, without a . or .. component, // or a trailing /, and not /, /etc, /var, /usr, /bin, /sbin, /lib*, /boot, /dev, /proc, /sys, /run, /tmp, /home, /root, /opt, /srv, /mnt, /media, /var/tmp, /var/lib, /usr/local or /usr/lib themselves" >&2
  exit 2
}
[[ "$state" =~ ^/[A-Za-z0-9._/-]*$ ]] || state_refused "it is not an absolute path of letters, digits and . _ - /"
! is_system_dir "$state" || state_refused "it is a system directory"
[[ "$state" != *//* && "$state" != */ ]] || state_refused "it holds // or ends in /"
[[ "$state/" != */./* && "$state/" != */../* ]] || state_refused "it has a . or .. component"
state_real="$(realpath -m -- "$state")"
! is_system_dir "$state_real" || state_refused "it leads to $state_real, a system directory"
marker="$state/made-by-cluster-up"
marker_header="# scripts/cluster.sh up: what it made, in order; down removes exactly these"
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

netns_exists() {  # netns_exists <name>
  local all
  all="$(ip netns list 2>/dev/null | awk '{print $1}')"
  grep -qxF -- "$1" <<<"$all"
}

link_exists() { ip -o link show dev "$1" >/dev/null 2>&1; }

# The marker: its first line is marker_header, then one `<kind> <what>` line per thing `up`
# made, in the order it made them. Only what `up` writes is accepted (the state directory, its
# tmp tree, its five files, namespaces and links under this cluster's names), so that a marker
# written by hand or by something else cannot make `down` remove anything else.
marker_entry_ok() {  # marker_entry_ok <kind> <what>
  case "$1" in
    dir) [ "$2" = "$state" ] ;;
    tree) [ "$2" = "$state/tmp" ] ;;
    file)
      case "$2" in
        "$state/hosts" | "$state/hosts.tmp" | "$state/hostfile" | "$state/rate" | "$state/agent") return 0 ;;
      esac
      return 1
      ;;
    netns) [[ "$2" =~ ^${ns_prefix}[0-9]+$ ]] ;;
    link) [ "$2" = "$bridge" ] || [[ "$2" =~ ^${veth_prefix}[0-9]+$ ]] ;;
    *) return 1 ;;
  esac
}

record() { echo "$1 $2" >>"$marker"; }  # record <kind> <what>: one more thing `up` made

# Reads the marker into made_kind and made_what; a marker that `up` did not write, or a line it
# would not write, is refused with a message (and nothing is removed).
read_marker() {
  made_kind=()
  made_what=()
  if [ -L "$marker" ] || [ ! -f "$marker" ]; then
    echo "cluster.sh: $marker is not a plain file written by 'scripts/cluster.sh up'" >&2
    return 1
  fi
  local lines line kind what
  mapfile -t lines <"$marker"
  if [ "${#lines[@]}" -eq 0 ] || [ "${lines[0]}" != "$marker_header" ]; then
    echo "cluster.sh: $marker was not written by 'scripts/cluster.sh up' (its first line is not '$marker_header')" >&2
    return 1
  fi
  for line in "${lines[@]:1}"; do
    kind="" what=""
    if [[ "$line" =~ ^([a-z]+)\ ([^ ]+)$ ]]; then
      kind="${BASH_REMATCH[1]}" what="${BASH_REMATCH[2]}"
    fi
    if [ -z "$kind" ] || ! marker_entry_ok "$kind" "$what"; then
      echo "cluster.sh: $marker lists '$line', which 'scripts/cluster.sh up' does not make for GRADCOMP_CLUSTER_NAME=$name and GRADCOMP_CLUSTER_STATE=$state" >&2
      return 1
    fi
    made_kind+=("$kind")
    made_what+=("$what")
  done
}

# Removes what read_marker read, last made first (a host's link before its namespace, the
# bridge after the hosts), then the marker and, if `up` made it, the state directory. What
# cannot be removed is named and the marker stays, so that `down` can try again.
remove_recorded() {
  local i kind what kept=() made_dir=0
  for ((i = ${#made_kind[@]} - 1; i >= 0; i--)); do
    kind="${made_kind[i]}" what="${made_what[i]}"
    case "$kind" in
      netns)
        # A process left on a host (a rank, a daemon) would keep its namespace alive.
        ip netns pids "$what" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$what" 2>/dev/null || true
        if netns_exists "$what"; then kept+=("namespace $what"); fi
        ;;
      link)
        # Deleting a host's end of its veth pair also deletes the end inside the host.
        ip link del "$what" 2>/dev/null || true
        if link_exists "$what"; then kept+=("link $what"); fi
        ;;
      file | tree)
        # tree: the directory up made for the hosts' session files (TMPDIR, see the agent), with
        # them. A file is removed only if it still is one.
        if [ "$kind" = tree ]; then
          rm -rf -- "$what" 2>/dev/null || true
        else
          rm -f -- "$what" 2>/dev/null || true
        fi
        if [ -e "$what" ] || [ -L "$what" ]; then kept+=("$what"); fi
        ;;
      dir) made_dir=1 ;;
    esac
  done
  if [ "${#kept[@]}" -gt 0 ]; then
    echo "cluster.sh: could not remove ${kept[*]}; $marker stays, so that 'scripts/cluster.sh down' can try again" >&2
    return 1
  fi
  rm -f -- "$marker"
  if [ "$made_dir" -eq 1 ] && ! rmdir -- "$state" 2>/dev/null; then
    echo "cluster.sh: left $state: it holds files that up did not make" >&2
  fi
  return 0
}

cmd_down() {
  need_rights
  if [ ! -e "$state" ] && [ ! -L "$state" ]; then
    echo "cluster: nothing to remove ($state does not exist)"
    return 0
  fi
  [ -d "$state" ] || die "down: GRADCOMP_CLUSTER_STATE='$state' is not a directory; removed nothing"
  if [ ! -e "$marker" ] && [ ! -L "$marker" ]; then
    # Without the marker nothing here is known to be the cluster's: /etc/hosts looks like a
    # cluster's hosts file too.
    local f found=""
    for f in hosts hosts.tmp hostfile rate agent tmp; do
      if [ -e "$state/$f" ] || [ -L "$state/$f" ]; then found+=" $f"; fi
    done
    if [ -z "$found" ]; then
      echo "cluster: nothing to remove ($state holds no cluster state)"
      return 0
    fi
    die "down: $state holds${found} but no marker ($marker) written by 'scripts/cluster.sh up', so none of it is known to be the cluster's; removed nothing. (A cluster made by a cluster.sh older than the marker is removed by hand: ip netns del ${ns_prefix}0 ..., ip link del $bridge, then those files.)"
  fi
  read_marker || die "down: removed nothing"
  remove_recorded || exit 1
}

# The EXIT trap of `up` until it is done: removes exactly what this `up` made, as its marker
# lists it, and never a namespace or link of the same name that it did not make.
up_failed() {
  local rc=$?
  trap - EXIT INT TERM
  if [ "$up_done" -eq 0 ] && [ "$marker_ours" -eq 1 ]; then
    echo "cluster.sh: up failed; removing what it made (as $marker lists it)" >&2
    if read_marker; then remove_recorded || true; fi
  fi
  [ "$rc" -ne 0 ] || rc=1
  exit "$rc"
}

cmd_up() {
  [ $# -eq 2 ] || die "up: expected <hosts> <rate>, e.g. up 4 100mbit"
  local n="$1" rate="$2"
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$max_hosts" ] ||
    die "up: hosts must be between 1 and $max_hosts (got '$n')"
  checked_rate_bits "$rate" >/dev/null
  need_rights
  is_up && die "a cluster is already up ($(wc -l <"$state/hosts") hosts); run 'scripts/cluster.sh down' first"
  if [ -e "$marker" ] || [ -L "$marker" ]; then
    die "$marker exists: a cluster is up, or an up that failed or was killed left what it lists; run 'scripts/cluster.sh down' first"
  fi
  # The state directory may exist (up then leaves it to its owner), but nothing in it may have
  # a name up writes: up lists every file it makes as its own, for down to remove.
  local f
  if [ -e "$state" ] || [ -L "$state" ]; then
    [ -d "$state" ] || die "GRADCOMP_CLUSTER_STATE='$state' exists and is not a directory"
    for f in hosts.tmp hostfile rate agent tmp; do
      if [ -e "$state/$f" ] || [ -L "$state/$f" ]; then
        die "$state/$f exists, and up would write it; GRADCOMP_CLUSTER_STATE must name a directory of the cluster's own (remove the file if a cluster.sh older than the marker left it)"
      fi
    done
  else
    [ -d "$(dirname -- "$state")" ] ||
      die "the directory above GRADCOMP_CLUSTER_STATE='$state' must exist (up makes the state directory, not the ones above it)"
  fi
  if ip -o link show "$bridge" >/dev/null 2>&1; then
    die "a link named $bridge exists without cluster state; run 'scripts/cluster.sh down' first"
  fi
  # The hosts' names must be free: up must not fail halfway on a name that something else
  # holds, and never removes what it did not make.
  local i
  for ((i = 0; i < n; i++)); do
    if netns_exists "${ns_prefix}${i}"; then
      die "a namespace named ${ns_prefix}${i} exists, which this up did not make; remove it (ip netns del ${ns_prefix}${i}) if an old cluster left it, or set GRADCOMP_CLUSTER_NAME to another prefix"
    fi
    if link_exists "${veth_prefix}${i}"; then
      die "a link named ${veth_prefix}${i} exists, which this up did not make; remove it (ip link del ${veth_prefix}${i}) if an old cluster left it, or set GRADCOMP_CLUSTER_NAME to another prefix"
    fi
  done
  # The subnet must be ours alone: refuse when a route other than the default one covers an
  # address of it, or an interface holds one.
  local routes addrs
  routes="$(ip -4 route show match "${net}.1" 2>/dev/null | grep -v '^default' || true)"
  addrs="$(ip -4 -o addr show 2>/dev/null | grep -F " ${net}." || true)"
  if [ -n "$routes" ] || [ -n "$addrs" ]; then
    die "the subnet ${net}.0/24 is already in use here (${routes:-$addrs}); set GRADCOMP_CLUSTER_NET to a free /24 (e.g. 10.232.7)"
  fi

  # From here on the marker lists each thing as it is made, and a failure, a refusal or an
  # interrupt (up_failed) removes exactly what it lists. Files are listed just before they are
  # made: their names were checked free above, so what they hold is ours. Namespaces and links
  # are listed just after: a name taken meanwhile fails `ip ... add`, and is not ours to remove.
  up_done=0
  marker_ours=0
  trap up_failed EXIT
  trap 'exit 130' INT
  trap 'exit 143' TERM
  local made_dir=0
  if [ ! -d "$state" ]; then
    mkdir -- "$state"
    made_dir=1
  fi
  # noclobber: the marker is made only where none is, so an up racing this one stops here.
  (set -C && echo "$marker_header" >"$marker")
  marker_ours=1
  [ "$made_dir" -eq 0 ] || record dir "$state"
  record file "$state/hosts.tmp"
  : >"$state/hosts.tmp"
  # The hosts' session files (see the agent below).
  record tree "$state/tmp"
  mkdir -- "$state/tmp"
  ip link add "$bridge" type bridge
  record link "$bridge"
  ip addr add "${net}.254/24" dev "$bridge"
  ip link set "$bridge" up
  local ns ip bits
  bits="$(rate_bits "$rate")"
  for ((i = 0; i < n; i++)); do
    ns="${ns_prefix}${i}"
    ip="${net}.$((i + 1))"
    ip netns add "$ns"
    record netns "$ns"
    ip link add "${veth_prefix}${i}" type veth peer name eth0 netns "$ns"
    record link "${veth_prefix}${i}"
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
  record file "$state/rate"
  echo "$rate" >"$state/rate"
  record file "$state/hostfile"
  awk '{print $2 " slots=1"}' "$state/hosts.tmp" >"$state/hostfile"
  # mpirun's agent: `agent <host> <command...>` runs the command on that host.
  record file "$state/agent"
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
  record file "$state/hosts"
  mv "$state/hosts.tmp" "$state/hosts"
  up_done=1
  trap - EXIT INT TERM
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
