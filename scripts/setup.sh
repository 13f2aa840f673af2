#!/usr/bin/env bash
# Installs everything fastrecord and its tests need on a fresh Debian 12/13 machine (CPU only):
#   system: a Vulkan loader and Mesa's lavapipe driver (>= 24.3, which SAPIEN needs), python3-venv, and
#           chromium (the tests render `fastrecord gallery`'s page in it, headless)
#   python: a project virtual environment .venv/ (stock Debian refuses pip installs into the system
#           Python), holding torch (CPU build), ManiSkill, SAPIEN, PyAV, h5py and fastrecord (editable) + tests
#           (the test extra includes the lerobot extra's pyarrow and pandas, which lerobot=True needs)
# Usage: bash scripts/setup.sh        (idempotent, fast when done; run as root or with sudo available)
#        PYTHON=python3.12 bash scripts/setup.sh   (the interpreter that creates .venv; default python3)
# Then: .venv/bin/fastrecord ..., .venv/bin/python -m pytest tests -q (or source .venv/bin/activate)
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
# Debian's chromium (a headless browser for the gallery test); skipped when installed
if ! dpkg-query -W -f='${Status}' chromium 2>/dev/null | grep -q 'install ok installed'; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq chromium >/dev/null
fi

PY=${PYTHON:-python3}
VENV=.venv
# (Re)create the venv when it is missing or broken (no pip: half made, or its interpreter is gone), or
# when PYTHON names another interpreter than the one that made it.
base='import sys; print(sys.base_prefix, sys.version)'
if [ ! -x "$VENV/bin/pip" ] || { [ -n "${PYTHON:-}" ] && [ "$("$VENV/bin/python" -c "$base")" != "$("$PY" -c "$base")" ]; }; then
  if ! "$PY" -c 'import ensurepip, venv' 2>/dev/null; then
    # Debian's Python ships venv/ensurepip apart: python3-venv (python3.X-venv for a given version)
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq "python$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')-venv" >/dev/null
  fi
  "$PY" -m venv --clear "$VENV"
fi
# The Python packages: skipped when this pyproject.toml and this script were installed already and the
# distributions are there (metadata only: importing them takes seconds, and fastrecord's own import is
# the tests' business).
versions() {
  "$VENV/bin/python" -c 'from importlib.metadata import version as v; print(" ".join(f"{d} {v(d)}" for d in ("torch", "mani_skill", "sapien", "av", "h5py", "fastrecord")))'
}
stamp=$(cat pyproject.toml scripts/setup.sh | sha256sum)
if [ "$(cat "$VENV/.setup-stamp" 2>/dev/null)" != "$stamp" ] || ! v=$(versions 2>/dev/null); then
  rm -f "$VENV/.setup-stamp"
  # torch first and pinned: this version is a CPU build available offline on our machines; an unpinned
  # torch would pull several GB of CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".[test]"
  v=$(versions)
  echo "$stamp" >"$VENV/.setup-stamp"
fi
echo "setup done ($VENV): $v"
