#!/usr/bin/env bash
# Installs every Debian package shardkit needs to build, test and benchmark.
# Idempotent: safe to run again; used by the README quick start and by .ci/run.
set -euo pipefail
PKGS=(
  build-essential cmake ninja-build ccache pkg-config
  libabsl-dev libboost-dev libboost-system-dev libopenblas-dev
  libgtest-dev libgmock-dev googletest libbenchmark-dev
  nlohmann-json3-dev libxxhash-dev
  libopenmpi-dev openmpi-bin
  clang libclang-rt-dev
)
# pip, for the interop tests' Python packages below, when the python3 on PATH has none.
if command -v python3 >/dev/null 2>&1 && ! python3 -m pip --version >/dev/null 2>&1; then PKGS+=(python3-pip); fi
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
# Python packages for the interop tests (tests/common/io, label `interop`): safetensors and numpy from PyPI.
# PyTorch, which the GPT-2 logits tests also use, is not installed here (too big); those tests skip without it.
# A failed install is reported but does not stop the build: the interop tests then skip with a message.
if command -v python3 >/dev/null 2>&1 && ! python3 -c 'import safetensors, numpy' >/dev/null 2>&1; then
  pip_install() { python3 -m pip install --quiet --disable-pip-version-check "$@" safetensors numpy; }
  pip_install 2>/dev/null || pip_install --break-system-packages ||
    echo "install-deps: WARNING: pip could not install safetensors and numpy; the interop tests will skip"
fi
echo "install-deps: all packages present"
