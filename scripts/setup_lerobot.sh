#!/usr/bin/env bash
# Builds the Python environment that tests/test_lerobot_interop.py loads fastrecord's datasets and trains a policy
# in: LeRobot 0.4.4 as its users install it, in a venv of its own (LeRobot pins torch < 2.11, the project's
# .venv has torch 2.13).
#   system: FFmpeg's libraries (Debian's `ffmpeg`, ~240 MB), which torchcodec loads at run time
#   python: lerobot 0.4.4, torch 2.10.0 + torchvision 0.25.0 (the newest LeRobot allows; no CPU build of them is
#           on PyPI, so this is the CUDA build: ~8 GB installed, runs on the CPU too), torchcodec 0.10.0 (the
#           one built for torch 2.10), PyAV (LeRobot's other video backend)
# Where: a cache outside the clone, so that CI (a fresh clone each run, on the same machine) builds it once:
#   $FASTRECORD_CACHE (default /var/cache/fastrecord if writable, else ~/.cache/fastrecord)/lerobot-KEY/, KEY a
#   hash of what makes the venv (REQS, BUILD below, the interpreter's version): other edits of this script
#   reuse it. `.venv-lerobot` in the repository root (git-ignored) links to it; the tests run
#   `.venv-lerobot/bin/python` (FASTRECORD_LEROBOT_PYTHON overrides). Venvs of other keys unused for 7 days
#   are removed.
# Usage: bash scripts/setup_lerobot.sh    (idempotent: about a second when the cached venv is there; a build
#        takes 5-10 min on a 2-core machine, mostly downloading and unpacking; run as root or with sudo for apt)
#        PYTHON=python3.12 bash scripts/setup_lerobot.sh   (the interpreter that creates the venv; default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
REQS=(lerobot==0.4.4 torch==2.10.0 torchvision==0.25.0 torchcodec==0.10.0)
BUILD=1  # bump when the build steps below change what the venv holds (a new KEY: a fresh build)

# torchcodec dlopens FFmpeg's libraries (major versions 4-8; Debian 12 has 5.1, 13 has 7.1)
have_ffmpeg_libs() {
  local lib libs
  libs=$(PATH=$PATH:/sbin:/usr/sbin ldconfig -p)
  for lib in avutil avcodec avformat avdevice avfilter swscale swresample; do
    grep -q "lib$lib\.so\." <<<"$libs" || return 1
  done
}
if ! have_ffmpeg_libs; then
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq ffmpeg >/dev/null
fi

PY=${PYTHON:-python3}
key=$( { echo "${REQS[*]} $BUILD"; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -c1-12)
CACHE=${FASTRECORD_CACHE:-/var/cache/fastrecord}
if ! mkdir -p "$CACHE" 2>/dev/null || [ ! -w "$CACHE" ]; then
  if [ -n "${FASTRECORD_CACHE:-}" ]; then
    echo "setup_lerobot.sh: FASTRECORD_CACHE=$CACHE is not writable; pick another folder" >&2
    exit 1
  fi
  CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/fastrecord
  mkdir -p "$CACHE"
fi
VENV=$CACHE/lerobot-$key
versions() {
  "$VENV/bin/python" -c 'from importlib.metadata import version as v
print(" ".join(f"{d} {v(d)}" for d in ("lerobot", "torch", "torchcodec", "av")))'
}

exec 9>"$VENV.lock"
flock 9  # one build at a time per key (two CI runs starting together: the second waits, then reuses)
if [ ! -f "$VENV/.setup-stamp" ] || ! v=$(versions 2>/dev/null); then
  echo "setup_lerobot.sh: building $VENV (${REQS[*]}; ~8 GB, several minutes)"
  start=$(date +%s)
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
  # --no-cache-dir: the venv is the cache; pip's own copy of the wheels would take another ~4 GB. The grep drops
  # pip's warning for each package a configured local index does not hold (hundreds of lines on our machines).
  "$VENV/bin/python" -m pip install -q --no-cache-dir "${REQS[@]}" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
  # The loaders the tests use, loaded for real: torchcodec finds FFmpeg, PyAV and LeRobot's dataset class import.
  "$VENV/bin/python" -c 'import torchcodec.decoders, av, lerobot.datasets.lerobot_dataset'
  v=$(versions)
  echo "$key" >"$VENV/.setup-stamp"
  echo "setup_lerobot.sh: built in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"
fi
touch "$VENV/.setup-stamp"  # last use, for the clean-up below
flock -u 9
ln -sfn "$VENV" .venv-lerobot

# Remove the venvs of other keys (made by another version of this script) that no run has used for 7 days,
# unless one is being built right now (its lock is held).
for old in "$CACHE"/lerobot-*/; do
  old=${old%/}
  [ "$old" = "$VENV" ] && continue
  used=$old/.setup-stamp; [ -f "$used" ] || used=$old  # a build that never finished: its folder's age
  [ -n "$(find "$used" -maxdepth 0 -mtime +7)" ] || continue
  ( flock -n 9 && rm -rf "$old" "$old.lock" ) 9>"$old.lock" || true
done
echo "setup_lerobot done (.venv-lerobot -> $VENV): $v"
