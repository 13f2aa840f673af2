"""What the GPU's RGB -> yuv420p conversion (`fastrecord.video.yuv.rgb_to_yuv420p`) costs a gather, and, in a tree
that still has the Triton kernel (before 2026-12-06's change), each of its kernels and what loading Triton's costs.

A ring buffer of real shape (``[steps + 1, envs, H, W, 3]`` uint8 on the GPU, random values) is read as a gather
reads it (``[envs, steps + 1, H, W, 3]``, strided); each variant converts all its envs into a preallocated output.
Prints and writes (``--json``) per variant and batch size: the calling thread's time to launch (host ms) and the
GPU's time (device ms, CUDA events), the mean of ``--reps`` calls after one warm call, and the most GPU memory its
temporaries held at once; with Triton, its first call
in this process (import, kernel load or compile) and the longest gap a 1 ms ticker thread saw meanwhile (how long
the GIL was held). Needs CUDA. Run it once with each tree on ``PYTHONPATH`` to compare them in one call:

    python -m benchmarks.probe_yuv --json out.json
    PYTHONPATH=build/before/src:$PYTHONPATH python -m benchmarks.probe_yuv --json before.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import threading
import time
from typing import Any


class GilWatch:
    """A thread that wakes every millisecond and keeps the longest gap between two wakes (the GIL held elsewhere)."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now

    def __enter__(self) -> GilWatch:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--envs", type=int, nargs="+", default=[128, 16])
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json")
    a = ap.parse_args()
    import torch

    from fastrecord.video import yuv

    dev = torch.device("cuda")
    n, s = max(a.envs), a.size
    ring = torch.randint(0, 256, (a.steps + 1, n, s, s, 3), dtype=torch.uint8, device=dev)
    res: dict[str, Any] = {"tree": yuv.__file__}
    kernels = "kernel" in inspect.signature(yuv.rgb_to_yuv420p).parameters  # the tree before: torch and Triton

    def timed(fn: Any) -> tuple[float, float]:
        fn()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        host = 0.0
        e0.record()
        for _ in range(a.reps):
            t0 = time.perf_counter()
            fn()
            host += time.perf_counter() - t0
        e1.record()
        torch.cuda.synchronize()
        return 1000 * host / a.reps, e0.elapsed_time(e1) / a.reps

    def variant(name: str, **kw: Any) -> None:
        for envs in a.envs:
            episode = ring[:, :envs].transpose(0, 1)
            out = torch.empty((envs, a.steps + 1, s * 3 // 2, s), dtype=torch.uint8, device=dev)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            host, device = timed(lambda e=episode, o=out: yuv.rgb_to_yuv420p(e, out=o, **kw))
            temp = (torch.cuda.max_memory_allocated() - base) / 2**20
            res[f"{name}_{envs}_host_ms"], res[f"{name}_{envs}_device_ms"] = host, device
            res[f"{name}_{envs}_temporaries_mib"] = temp
            print(f"{name}: {envs} envs x {a.steps + 1} frames {s}x{s}: host {host:.1f} ms, device {device:.1f} ms, "
                  f"temporaries {temp:.0f} MiB at most", flush=True)

    if not kernels:
        variant("conversion")
    else:
        variant("torch", kernel="torch")
        episode = ring[:, :1].transpose(0, 1)
        t0 = time.perf_counter()
        with GilWatch() as watch:
            ok = yuv.triton_kernel() is not None
            if ok:
                yuv.rgb_to_yuv420p(episode, kernel="triton")
                torch.cuda.synchronize()
        res["triton_first_call_s"] = time.perf_counter() - t0
        res["triton_first_call_longest_gil_gap_s"] = watch.longest
        print(f"triton first call (import, kernel load): {res['triton_first_call_s']:.2f} s, the GIL held up to "
              f"{watch.longest:.2f} s at once", flush=True)
        if ok:
            variant("triton", kernel="triton")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
