"""What does asking "does torch see a CUDA device?" cost a fresh process? (issue 27, a replay's plan)

The replay CLI's plan asks ``torch.cuda.is_available()`` (is the render backend "gpu"?), which initialises CUDA's
driver in the CLI's process, before the workers are forked: on the H100 machine the plan took 0.3-0.5 s after the
imports, against 0.02 s on the CPU machine. ``torch.cuda.device_count()`` asks NVML first (no CUDA context; it
honours ``CUDA_VISIBLE_DEVICES``). Each way is timed in fresh interpreters, torch imported first:

    python -m benchmarks.probe_cuda_check --reps 3
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

WAYS = {
    "is_available": "torch.cuda.is_available()",
    "device_count": "torch.cuda.device_count() > 0",
    "nvml_is_available": "torch.cuda.is_available()",  # with PYTORCH_NVML_BASED_CUDA_CHECK=1
}
CHILD = (
    "import time, torch; t = time.perf_counter(); r = {expr}; a = time.perf_counter() - t; "
    "t = time.perf_counter(); torch.empty(1, device='cuda') if r else None; b = time.perf_counter() - t; "
    "print(f'{{r}} {{a:.3f}} {{b:.3f}}')"
)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args()
    for rep in range(a.reps):
        for way, expr in WAYS.items():
            env = dict(os.environ)
            if way.startswith("nvml"):
                env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
            out = subprocess.run([sys.executable, "-c", CHILD.format(expr=expr)], env=env, capture_output=True,
                                 text=True).stdout.split()
            if len(out) != 3:
                print(f"rep {rep} {way}: failed", flush=True)
                continue
            print(f"rep {rep} {way:18s}: answer {out[0]}, {float(out[1]) * 1000:7.1f} ms; a first CUDA tensor "
                  f"after it {float(out[2]) * 1000:7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
