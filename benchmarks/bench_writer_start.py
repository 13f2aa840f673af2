"""A trajectory writer's start (issue 20): what `fastrecord.sinks.maniskill_h5.TrajectoryWriter` costs
before and around a short recording, by writer count.

Each repeat constructs a writer in a fresh folder (its helper processes start and the empty index pair is
written), submits one small batch (one 11-frame 64x64 rgb episode), closes it (consolidated), and
prints medians of: construction seconds (the recorder's set-up), construction + batch + close seconds,
and the CPU seconds its helper processes used (``RUSAGE_CHILDREN``; each spends about 0.2 s importing
numpy and h5py). One writer is also the index process; more get an index process beside them:

    python benchmarks/bench_writer_start.py --writers 1 2 --repeats 10
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

import numpy as np

from fastrecord.episode import EpisodeData
from fastrecord.sinks.maniskill_h5 import TrajectoryWriter


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_start(writers: int) -> tuple[float, float, float, int]:
    """(construction s, construction + one batch + close s, helper CPU s, helper processes) of one writer."""
    episode = EpisodeData(episode_id=0, env_idx=0, elapsed_steps=10, meta={"episode_seed": 0},
                          datasets={"actions": np.zeros((10, 4), np.float32),
                                    "obs/sensor_data/base_camera/rgb": np.zeros((11, 64, 64, 3), np.uint8)})
    with tempfile.TemporaryDirectory() as d:
        cpu0, t0 = children_cpu(), time.perf_counter()
        w = TrajectoryWriter(Path(d) / "run.h5", {"env_info": {"env_id": "bench"}}, num_writers=writers)
        t1 = time.perf_counter()
        processes = len(w.pids)
        w.submit([episode])
        w.close()
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0, children_cpu() - cpu0, processes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--writers", type=int, nargs="+", default=[1, 2], help="writer counts, measured alternately")
    p.add_argument("--repeats", type=int, default=10, help="writers started per count")
    args = p.parse_args()
    if any(n < 1 for n in args.writers) or args.repeats < 1:
        p.error(f"--writers {args.writers} --repeats {args.repeats}: pass counts >= 1")
    rows: dict[int, list[tuple[float, float, float, int]]] = {n: [] for n in args.writers}
    for _ in range(args.repeats):
        for n in args.writers:  # alternating: a shared machine's load changes meanwhile
            rows[n].append(one_start(n))
    print("| writers | helper processes | construction s | + one batch + close s | helper CPU s |")
    print("| --- | --- | --- | --- | --- |")
    for n, r in rows.items():
        a = np.array([x[:3] for x in r])
        print(f"| {n} | {r[0][3]} | {np.median(a[:, 0]):.3f} | {np.median(a[:, 1]):.3f} | {np.median(a[:, 2]):.3f} |")


if __name__ == "__main__":
    main()
