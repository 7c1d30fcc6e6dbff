#!/usr/bin/env bash
# Installs every Debian package shardkit needs to build, test and benchmark.
# Idempotent: safe to run again; used by the README quick start and by .ci/run.
set -euo pipefail
PKGS=(
  build-essential cmake ninja-build ccache pkg-config
  libabsl-dev libboost-dev libboost-system-dev libopenblas-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "install-deps: all packages present"
