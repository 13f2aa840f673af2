#!/usr/bin/env bash
# Runs `fastrecord bench` on the lent GPU machine (device tool), from the project root there:
#   carry: [".gpukit", ".whl"]   command: bash benchmarks/bench_gpu.sh [config] [extra bench flags...]
# .gpukit comes from `bash ../shared/gpu/build-kit.sh`; .whl may hold py-spy's wheel for --profile
# (python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux1_x86_64 -d .whl py-spy).
# Results: $OUT/bench.json, $OUT/bench.txt (table), $OUT/bench.log, $OUT/pyspy_raw.txt.
set -uo pipefail
cfg=${1:-configs/bench_h200.yaml}; shift || true
source .gpukit/setup.sh
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/benchsite .whl/*.whl && export PATH=/tmp/benchsite/bin:$PATH
fi
OUT=${OUT:-/tmp/bench-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.used,memory.total,encoder.stats.sessionCount --format=csv 2>&1 | tee "$OUT/gpu.txt"
timeout 560 python3 -m fastrecord bench --config "$cfg" --json "$OUT/bench.json" --output-dir /tmp/bench-videos "$@" \
  2> >(tee "$OUT/bench.log" >&2) | tee "$OUT/bench.txt"
[ -f /tmp/bench-videos/pyspy_raw.txt ] && cp /tmp/bench-videos/pyspy_raw.txt "$OUT/"
exit 0
