"""What the GPU's RGB -> yuv420p conversion costs a gather, with torch's kernels and with the Triton kernel, and
what loading the Triton kernel costs the process (issue 27: a fresh process loses ~0.8 s to it).

A ring buffer of real shape (``[steps + 1, envs, H, W, 3]`` uint8 on the GPU, random values) is read as a gather
reads it (``[envs, steps + 1, H, W, 3]``, strided); each kernel converts all its envs into a preallocated output.
Prints and writes (``--json``) per kernel and batch size: the calling thread's time to launch (host ms) and the
GPU's time (device ms, CUDA events), the mean of ``--reps`` calls after one warm call; and for Triton the first
call in this process (import, kernel load or compile) with the longest gap a 1 ms ticker thread saw meanwhile
(how long the GIL was held). Needs CUDA.

    python -m benchmarks.probe_yuv --json out.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time


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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    res: dict[str, float] = {}

    def timed(fn) -> tuple[float, float]:  # type: ignore[no-untyped-def]
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

    for envs in a.envs:
        episode = ring[:, :envs].transpose(0, 1)
        out = torch.empty((envs, a.steps + 1, s * 3 // 2, s), dtype=torch.uint8, device=dev)
        res[f"torch_{envs}_host_ms"], res[f"torch_{envs}_device_ms"] = timed(
            lambda e=episode, o=out: yuv.rgb_to_yuv420p(e, out=o, kernel="torch"))
        print(f"torch,  {envs} envs x {a.steps + 1} frames {s}x{s}: host {res[f'torch_{envs}_host_ms']:.1f} ms, "
              f"device {res[f'torch_{envs}_device_ms']:.1f} ms", flush=True)
    episode = ring[:, :1].transpose(0, 1)
    t0 = time.perf_counter()
    with GilWatch() as watch:
        kernel = yuv.triton_kernel()
        if kernel is not None:
            yuv.rgb_to_yuv420p(episode, kernel="triton")
            torch.cuda.synchronize()
    res["triton_first_call_s"] = time.perf_counter() - t0
    res["triton_first_call_longest_gil_gap_s"] = watch.longest
    print(f"triton first call (import, kernel load): {res['triton_first_call_s']:.2f} s, the GIL held up to "
          f"{watch.longest:.2f} s at once", flush=True)
    if kernel is not None:
        for envs in a.envs:
            episode = ring[:, :envs].transpose(0, 1)
            out = torch.empty((envs, a.steps + 1, s * 3 // 2, s), dtype=torch.uint8, device=dev)
            res[f"triton_{envs}_host_ms"], res[f"triton_{envs}_device_ms"] = timed(
                lambda e=episode, o=out: yuv.rgb_to_yuv420p(e, out=o, kernel="triton"))
            ref = yuv.rgb_to_yuv420p(episode[:2], kernel="torch")
            res[f"triton_{envs}_max_diff_vs_torch"] = float(
                (yuv.rgb_to_yuv420p(episode[:2], kernel="triton").int() - ref.int()).abs().max())
            print(f"triton, {envs} envs: host {res[f'triton_{envs}_host_ms']:.1f} ms, device "
                  f"{res[f'triton_{envs}_device_ms']:.1f} ms", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
