#!/usr/bin/env bash
# Installs everything fastrecord and its tests need on a fresh Debian 12/13 machine (CPU only):
#   system: a Vulkan loader and Mesa's lavapipe driver (>= 24.3, which SAPIEN needs), ffmpeg libs
#   python: torch (CPU build), ManiSkill, SAPIEN, PyAV, h5py and fastrecord itself (editable) + tests
# Usage: bash scripts/setup.sh        (idempotent; run as root or with sudo available)
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive

need_mesa() {  # true when lavapipe is missing or older than 24.3
  local v
  v=$(dpkg-query -W -f='${Version}' mesa-vulkan-drivers 2>/dev/null || true)
  [ -z "$v" ] && return 0
  dpkg --compare-versions "$v" lt 24.3
}
if need_mesa || ! dpkg -s libvulkan1 >/dev/null 2>&1; then
  . /etc/os-release
  $SUDO apt-get update -qq
  if [ "${VERSION_CODENAME:-}" = "bookworm" ]; then
    # Debian 12 ships Mesa 22.3; SAPIEN needs >= 24.3, which bookworm-backports has
    echo "deb http://deb.debian.org/debian bookworm-backports main" | $SUDO tee /etc/apt/sources.list.d/backports.list >/dev/null
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq -t bookworm-backports mesa-vulkan-drivers libvulkan1 >/dev/null
  else
    $SUDO apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
  fi
fi

PY=${PYTHON:-python3}
# torch first and pinned: this version is a CPU build available offline on our machines; an unpinned
# torch would pull several GB of CUDA build.
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[test]"
# pyenv installs console scripts behind shims: make `fastrecord` callable right away
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
echo "setup done: $($PY -c 'import torch, mani_skill, sapien, av, h5py; print("torch", torch.__version__, "mani_skill", mani_skill.__version__, "sapien", sapien.__version__, "av", av.__version__, "h5py", h5py.__version__)')"
