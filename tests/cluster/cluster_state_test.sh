#!/usr/bin/env bash
# ctest cluster_state_test: scripts/cluster.sh removes only what its own `up` made.
#   (a) a GRADCOMP_CLUSTER_STATE that is a system directory or not spelled plainly (/etc, /var,
#       /., /tmp/x/../etc, /, //etc, /run) makes `down` and `up` fail with a message naming it,
#       and removes and makes nothing;
#   (b) `down` removes nothing from a directory without up's marker, or with a marker that up
#       did not write;
#   (c) a failed or interrupted `up` removes what it made and leaves a namespace or link of the
#       cluster's names that it did not make;
#   (d) `up` of 2 hosts then `down` removes exactly what `up` made.
# Needs root and the rights to make namespaces, links and tbf qdiscs; skips (exit 77) without
# them. (a) runs each case in private mount and network namespaces in which /etc, /var, /run
# and /tmp are copy-on-write overlays, so that even a cluster.sh that does not refuse cannot
# remove a real file there; without unshare and overlayfs (a) is skipped and so is the test.
# No traffic leaves the machine: the cluster's subnet is the test's own, on its own bridge.
#   tests/cluster/cluster_state_test.sh
#   GRADCOMP_CLUSTER_SH=/path/to/cluster.sh tests/cluster/cluster_state_test.sh  (another copy)
set -uo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cluster="${GRADCOMP_CLUSTER_SH:-$here/scripts/cluster.sh}"
self="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"

# Names and a subnet of the test's own (cluster_smoke uses gcsmoke and 10.231.9).
export GRADCOMP_CLUSTER_NAME=gcstate GRADCOMP_CLUSTER_NET=10.231.10
unset GRADCOMP_CLUSTER_STATE
failed=0
fail() {
  echo "cluster_state_test: FAILED: $*" >&2
  failed=1
}
cluster() { bash "$cluster" "$@"; }  # also a copy without the execute bit
netns_exists() {  # (the list first: grep -q in a pipe would end ip early, a failure under pipefail)
  local all
  all="$(ip netns list | awk '{print $1}')"
  grep -qxF -- "$1" <<<"$all"
}
link_exists() { ip -o link show dev "$1" >/dev/null 2>&1; }

# (a), one case, inside the sandbox: tests/cluster/cluster_state_test.sh --sandboxed <value> <dir>
# (run by unshare --mount --net; <dir> is an empty directory for the overlays' upper layers).
if [ "${1:-}" = --sandboxed ]; then
  value="$2" dir="$3"
  mount -t tmpfs gcstate-sandbox "$dir" || exit 1
  for d in etc var run tmp; do
    mkdir "$dir/upper-$d" "$dir/work-$d" &&
      mount -t overlay "gcstate-$d" -o "lowerdir=/$d,upperdir=$dir/upper-$d,workdir=$dir/work-$d" "/$d" ||
      exit 1
  done
  # What `down` of the old script removed: $state/hosts and $state/tmp. The sentinels stand
  # where those would be, in the overlays only (for / that is /tmp; nothing is written to /).
  mkdir -p /tmp/x
  real="$(realpath -m -- "$value")"
  base="${real%/}"
  sentinels=("$base/tmp/gcstate-sentinel")
  mkdir -p "$base/tmp" && echo sentinel >"$base/tmp/gcstate-sentinel" || exit 1
  if [ "$real" != / ]; then
    echo "gcstate-h0 10.231.10.1" >"$base/hosts" || exit 1
    sentinels+=("$base/hosts")
  fi
  # The cluster's subnet in use and a bridge of its name, in this network namespace: a cluster.sh
  # that took the value would stop at them before writing a file (for / or /., one outside the
  # overlays); anything it made would stay in the sandbox. The old script's down removed the
  # bridge, so it is made again before each command.
  ip addr add 10.231.10.253/24 dev lo || exit 1
  for cmd in down up; do
    link_exists gcstate-br || ip link add gcstate-br type bridge || exit 1
    if [ "$cmd" = up ]; then set -- up 2 100mbit; else set -- down; fi
    out="$(GRADCOMP_CLUSTER_STATE="$value" cluster "$@" 2>&1)" && fail "GRADCOMP_CLUSTER_STATE=$value: '$*' was accepted: $out"
    grep -qF "GRADCOMP_CLUSTER_STATE='$value'" <<<"$out" ||
      fail "GRADCOMP_CLUSTER_STATE=$value: '$*' did not name the variable and its value: $out"
    for s in "${sentinels[@]}"; do
      [ -f "$s" ] || fail "GRADCOMP_CLUSTER_STATE=$value: '$*' removed $s"
    done
    for f in hosts.tmp hostfile rate agent made-by-cluster-up; do
      [ ! -e "$base/$f" ] || fail "GRADCOMP_CLUSTER_STATE=$value: '$*' made $base/$f"
    done
    ! netns_exists gcstate-h0 || fail "GRADCOMP_CLUSTER_STATE=$value: '$*' made a namespace"
  done
  exit "$failed"
fi

# The rights, tried for real, as cluster_smoke does: root, a namespace, a bridge, a tbf qdisc.
can_make_hosts() {
  [ "$(id -u)" -eq 0 ] && command -v ip >/dev/null && command -v tc >/dev/null || return 1
  local ok=0
  ip netns add gcstateprobe 2>/dev/null || return 1
  ip netns del gcstateprobe 2>/dev/null
  if ip link add gcstateprobe type bridge 2>/dev/null; then
    tc qdisc replace dev gcstateprobe root tbf rate 100mbit burst 16384 latency 200ms 2>/dev/null || ok=1
    ip link del gcstateprobe 2>/dev/null
  else
    ok=1
  fi
  return "$ok"
}
if ! can_make_hosts; then
  echo "SKIPPED: cluster_state_test needs root and the rights to make network namespaces, bridges and tbf qdiscs (iproute2)"
  exit 77
fi
ours_ns() { ip netns list | awk '{print $1}' | grep '^gcstate-' || true; }
ours_links() { ip -o link show | awk -F': ' '{print $2}' | sed 's/@.*//' | grep '^gcstate' || true; }
# Everything named gcstate* is the test's (made by it or by the cluster.sh it runs) from here
# on; so that its cleanup removes nothing of anyone else's, it refuses to start beside any.
if [ -n "$(ours_ns)$(ours_links)" ]; then
  echo "cluster_state_test: FAILED: namespaces or links named gcstate* exist already ($(ours_ns) $(ours_links)); remove them (an interrupted run of this test?) and run it again" >&2
  exit 1
fi
work="$(mktemp -d /tmp/gcstate.XXXXXX)" || exit 1
cleanup() {
  local ns dev
  for ns in $(ours_ns); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null
    ip netns del "$ns" 2>/dev/null
  done
  for dev in $(ours_links); do ip link del "$dev" 2>/dev/null; done
  rm -rf -- "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# (a) Bad state directories, each in its own sandbox.
can_sandbox() {
  command -v unshare >/dev/null || return 1
  mkdir "$work/probe" || return 1
  # shellcheck disable=SC2016 # $1 is the inner shell's
  unshare --mount --net --propagation private -- bash -c '
    mount -t tmpfs gcstate-probe "$1" && mkdir "$1/u" "$1/w" &&
      mount -t overlay gcstate-probe -o "lowerdir=/etc,upperdir=$1/u,workdir=$1/w" /etc' _ "$work/probe" 2>/dev/null
}
sandbox_ok=0
if can_sandbox; then sandbox_ok=1; fi
if [ "$sandbox_ok" -eq 1 ]; then
  for value in /etc /var /. /tmp/x/../etc / //etc /run; do
    case "$value" in
      / | /.)
        # The only paths a cluster.sh taking / could touch outside the overlays.
        for f in hosts hosts.tmp hostfile rate agent made-by-cluster-up; do
          [ ! -e "/$f" ] || { fail "/$f exists on this machine; the case $value is not run"; continue 2; }
        done
        ;;
    esac
    mkdir "$work/sandbox"
    unshare --mount --net --propagation private -- bash "$self" --sandboxed "$value" "$work/sandbox" ||
      fail "GRADCOMP_CLUSTER_STATE=$value (above)"
    rmdir "$work/sandbox"
  done
else
  echo "cluster_state_test: part (a) not run: it needs unshare and overlayfs (private mount namespaces)" >&2
fi

# (b) No marker, or one that up did not write: down removes nothing.
mkdir -p "$work/b1/tmp/gcstate-h0"
echo "gcstate-h0 10.231.10.1" >"$work/b1/hosts"
echo session >"$work/b1/tmp/gcstate-h0/file"
out="$(GRADCOMP_CLUSTER_STATE="$work/b1" cluster down 2>&1)" && fail "down without a marker succeeded: $out"
grep -q "marker" <<<"$out" || fail "down without a marker: unclear refusal: $out"
[ -f "$work/b1/hosts" ] && [ -f "$work/b1/tmp/gcstate-h0/file" ] || fail "down without a marker removed files"

mkdir "$work/b2"
echo "gcstate-h0 10.231.10.1" >"$work/b2/hosts"
echo "a marker of something else" >"$work/b2/made-by-cluster-up"
out="$(GRADCOMP_CLUSTER_STATE="$work/b2" cluster down 2>&1)" && fail "down with a foreign marker succeeded: $out"
[ -f "$work/b2/hosts" ] && [ -f "$work/b2/made-by-cluster-up" ] || fail "down with a foreign marker removed files"

# A marker with up's first line that lists a file outside the state directory.
mkdir "$work/b3"
echo victim >"$work/victim"
echo "gcstate-h0 10.231.10.1" >"$work/b3/hosts"
{
  echo "# scripts/cluster.sh up: what it made, in order; down removes exactly these"
  echo "file $work/victim"
  echo "file $work/b3/hosts"
} >"$work/b3/made-by-cluster-up"
out="$(GRADCOMP_CLUSTER_STATE="$work/b3" cluster down 2>&1)" && fail "down with a marker listing $work/victim succeeded: $out"
[ -f "$work/victim" ] || fail "down removed $work/victim, which a marker listed outside the state directory"
[ -f "$work/b3/hosts" ] || fail "down with a bad marker removed $work/b3/hosts"

# (c) Decoys: a namespace and a link of the cluster's names that no up made.
ip netns add gcstate-h7 && ip link add gcstatev7 type bridge || { fail "could not make the decoys"; exit 1; }
decoys_left() {  # decoys_left <when>
  netns_exists gcstate-h7 || fail "$1 removed the namespace gcstate-h7, which it did not make"
  link_exists gcstatev7 || fail "$1 removed the link gcstatev7, which it did not make"
}
nothing_of_up_left() {  # nothing_of_up_left <when>
  local x
  for x in gcstate-h0 gcstate-h1; do ! netns_exists "$x" || fail "$1 left the namespace $x"; done
  for x in gcstate-br gcstatev0 gcstatev1; do ! link_exists "$x" || fail "$1 left the link $x"; done
}

# c1: a host's name is taken: up fails and leaves that namespace (the old up made host 0, failed
# at host 1, and its cleanup removed every gcstate-h* namespace).
ip netns add gcstate-h1 || { fail "could not make the decoy gcstate-h1"; exit 1; }
out="$(GRADCOMP_CLUSTER_STATE="$work/c1" cluster up 2 100mbit 2>&1)" && fail "up with gcstate-h1 taken succeeded: $out"
netns_exists gcstate-h1 || fail "a failed up removed the namespace gcstate-h1, which it did not make: $out"
decoys_left "a failed up (gcstate-h1 taken)"
ip netns del gcstate-h1 2>/dev/null
nothing_of_up_left "a failed up (gcstate-h1 taken)"
[ ! -e "$work/c1" ] || [ -z "$(ls -A "$work/c1")" ] || fail "a failed up left files in $work/c1: $(ls -A "$work/c1")"

# c2: up fails partway, after both hosts were made: tc (a shim first in PATH) refuses to shape
# host 1's bridge side. The state directory exists beforehand with a file of its owner's.
mkdir -p "$work/bin" "$work/c2"
echo "the owner's" >"$work/c2/notes"
# A tc first in PATH that logs its arguments and, asked to shape host 1's bridge side
# (gcstatev1), first runs the shell command $1: refuse, or interrupt up.
tc_shim() {
  cat >"$work/bin/tc" <<EOF
#!/bin/sh
echo "\$*" >>"$work/tc.log"
case " \$* " in
  *" gcstatev1 "*) $1 ;;
esac
exec $(command -v tc) "\$@"
EOF
  chmod +x "$work/bin/tc"
}
tc_shim 'echo "cluster_state_test: tc refuses to shape gcstatev1" >&2; exit 1'
out="$(PATH="$work/bin:$PATH" GRADCOMP_CLUSTER_STATE="$work/c2" cluster up 2 100mbit 2>&1)" &&
  fail "up with a failing tc succeeded: $out"
grep -q "gcstatev1" "$work/tc.log" 2>/dev/null || fail "up did not get to host 1 before failing: $out"
decoys_left "an up that failed partway"
nothing_of_up_left "an up that failed partway"
[ "$(ls -A "$work/c2")" = notes ] || fail "an up that failed partway left $work/c2 with: $(ls -A "$work/c2")"

# c3: the same, interrupted (SIGTERM, as ctest's timeout sends) while shaping host 1.
rm -f "$work/tc.log"
tc_shim 'kill -TERM "$PPID"'
out="$(PATH="$work/bin:$PATH" GRADCOMP_CLUSTER_STATE="$work/c3" cluster up 2 100mbit 2>&1)" &&
  fail "an interrupted up succeeded: $out"
grep -q "gcstatev1" "$work/tc.log" 2>/dev/null || fail "up was not interrupted at host 1: $out"
decoys_left "an interrupted up"
nothing_of_up_left "an interrupted up"
[ ! -e "$work/c3" ] || fail "an interrupted up left $work/c3: $(ls -A "$work/c3")"
rm -f "$work/bin/tc"

# (d) up, then down: exactly what up made goes, the decoys stay.
if GRADCOMP_CLUSTER_STATE="$work/d" cluster up 2 100mbit; then
  for x in gcstate-h0 gcstate-h1; do netns_exists "$x" || fail "up 2 did not make the namespace $x"; done
  for x in gcstate-br gcstatev0 gcstatev1; do link_exists "$x" || fail "up 2 did not make the link $x"; done
  marker="$work/d/made-by-cluster-up"
  listed="$(tail -n +2 "$marker" 2>/dev/null | sort | tr '\n' ' ')"
  expected="$(printf '%s\n' "dir $work/d" "tree $work/d/tmp" "link gcstate-br" "netns gcstate-h0" \
    "link gcstatev0" "netns gcstate-h1" "link gcstatev1" "file $work/d/hosts.tmp" "file $work/d/rate" \
    "file $work/d/hostfile" "file $work/d/agent" "file $work/d/hosts" | sort | tr '\n' ' ')"
  [ "$listed" = "$expected" ] || fail "the marker lists '$listed', not '$expected'"
  # A host's session files (what the agent writes there) go with the state directory.
  mkdir -p "$work/d/tmp/gcstate-h0" && echo session >"$work/d/tmp/gcstate-h0/file"
  out="$(GRADCOMP_CLUSTER_STATE="$work/d" cluster down 2>&1)" || fail "down after up: $out"
  nothing_of_up_left "down"
  decoys_left "down"
  [ ! -e "$work/d" ] || fail "down left $work/d: $(ls -A "$work/d")"
else
  fail "up 2 100mbit"
fi

# The same in a directory that was there before: down leaves it, with its owner's file.
mkdir "$work/d2"
echo "the owner's" >"$work/d2/notes"
if GRADCOMP_CLUSTER_STATE="$work/d2" cluster up 2 100mbit >/dev/null; then
  out="$(GRADCOMP_CLUSTER_STATE="$work/d2" cluster down 2>&1)" || fail "down after up in $work/d2: $out"
  nothing_of_up_left "down in a directory that was there before"
  [ "$(ls -A "$work/d2")" = notes ] || fail "down left $work/d2 with: $(ls -A "$work/d2")"
else
  fail "up 2 100mbit in $work/d2"
fi
decoys_left "the test"

if [ "$failed" -ne 0 ]; then
  echo "cluster_state_test: FAILED ($cluster)" >&2
  exit 1
fi
if [ "$sandbox_ok" -eq 0 ]; then
  echo "SKIPPED: cluster_state_test's parts (b) to (d) passed; part (a) needs unshare and overlayfs"
  exit 77
fi
echo "cluster_state_test: passed ($cluster)"
