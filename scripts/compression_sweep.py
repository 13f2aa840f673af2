"""Size and speed of the HDF5 layouts and compressions for image observations (docs/format.md "Image observations
on disk"): PickCube-v1 sensor frames under random actions, written with h5py as fastrecord's writer does.

    python scripts/compression_sweep.py                    # 64x64 and 128x128, 2 episodes of 41 frames
    python scripts/compression_sweep.py --sizes 128 --episodes 4

Prints one row per layout and compression: frames/s of CPU time writing (best of --repeats), the stored
share of the raw bytes, frames/s reading whole episodes. CPU seconds, so a shared machine still gives
comparable figures.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import h5py
import numpy as np

from fastrecord.sinks.maniskill_h5 import COMPRESSIONS, image_chunks, parse_compression
from fastrecord.testing import sensor_clips


def sweep(frames: np.ndarray, episodes: int, repeats: int, path: str) -> list[tuple[str, float, float, float]]:
    """``frames`` [E, T, H, W, 3]; returns (label, write frames/s, stored share, read frames/s)."""
    layouts = [
        ("one frame a chunk, gzip:5", "gzip:5", "frame"),
        ("h5py automatic chunks, gzip:5 (ManiSkill)", "gzip:5", "auto"),
    ]
    layouts += [(f"frames x row bands, {c}", c, "band") for c in COMPRESSIONS]
    eps = [frames[i % len(frames)] for i in range(episodes)]
    n = sum(len(e) for e in eps)
    raw = sum(e.nbytes for e in eps)
    rows = []
    for label, comp, layout in layouts:
        method, level = parse_compression(comp)
        best = float("inf")
        for _ in range(repeats):
            t0 = time.process_time()
            with h5py.File(path, "w") as f:
                for i, e in enumerate(eps):
                    if method is None:
                        f.create_dataset(f"e{i}", data=e)
                    else:
                        chunks = {
                            "frame": (1, *e.shape[1:]),
                            "auto": True,
                            "band": image_chunks(e.shape, e.dtype.itemsize),
                        }[layout]
                        f.create_dataset(f"e{i}", data=e, chunks=chunks, compression=method, compression_opts=level)
            best = min(best, time.process_time() - t0)
        size = os.path.getsize(path)
        t0 = time.process_time()
        with h5py.File(path, "r") as f:
            for k in f:
                f[k][:]
        rows.append((label, n / best, size / raw, n / (time.process_time() - t0)))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--env", default="PickCube-v1")
    p.add_argument("--sizes", default="64,128", help="comma-separated square sensor sizes")
    p.add_argument("--clips", type=int, default=2, help="rendered episodes (seeds 0..clips-1)")
    p.add_argument("--frames", type=int, default=41, help="frames per rendered episode")
    p.add_argument("--episodes", type=int, default=8, help="episodes written per setting (rendered ones repeated)")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for size in (int(s) for s in a.sizes.split(",")):
            frames = sensor_clips(a.env, a.clips, a.frames, size, "cpu")
            print(f"\n{a.env} sensor frames {size}x{size}, {a.episodes} episodes x {a.frames} frames")
            print(
                "| layout, compression | write frames/s (CPU) | size | read frames/s (CPU) |\n| --- | --- | --- | --- |"
            )
            for label, w, share, r in sweep(frames, a.episodes, a.repeats, os.path.join(tmp, "sweep.h5")):
                print(f"| {label} | {w:,.0f} | {share:.1%} | {r:,.0f} |")


if __name__ == "__main__":
    main()
