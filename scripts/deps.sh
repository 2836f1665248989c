#!/usr/bin/env bash
# Installs the Debian packages needed to build and test gradcomp. Does nothing
# (and needs no network or root) when they are all installed already.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# clang and libclang-rt-14-dev (libFuzzer, the sanitizer runtimes): scripts/fuzz.sh.
# zlib1g-dev and dataset-fashion-mnist: examples/train_fashion_mnist.cpp and tests/schedule/.
# python3-torch, libtorch-dev, libgloo-dev (ProcessGroupGloo.hpp includes gloo) and pybind11-dev:
# gradcomp.torch, its extension and tests (Debian's /usr/bin/python3 imports that torch).
# iproute2 (ip, tc): scripts/cluster.sh, the emulated cluster.
packages=(cmake g++ make doctest-dev libbenchmark-dev libopenmpi-dev openmpi-bin
          python3-torch libtorch-dev libgloo-dev pybind11-dev
          clang libclang-rt-14-dev zlib1g-dev dataset-fashion-mnist iproute2)

missing=()
for package in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$package")
  fi
done
if [ "${#missing[@]}" -eq 0 ]; then
  exit 0
fi

as_root=()
if [ "$(id -u)" -ne 0 ]; then
  as_root=(sudo)
fi

echo "deps.sh: installing ${missing[*]}"
# env, not export: sudo would drop an exported DEBIAN_FRONTEND.
# Without the packages these only recommend (39 of 257 on this project's machine: Qt, VA/VDPAU
# drivers, GStreamer, Pillow, Eigen; none is used here), and without dpkg's fsync after every
# file (--force-unsafe-io: should the machine lose power mid-install, reinstall the packages
# with apt-get install --reinstall).
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
  -o Dpkg::Options::=--force-unsafe-io "${missing[@]}" >/dev/null
