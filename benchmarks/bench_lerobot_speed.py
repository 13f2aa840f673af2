"""LeRobot written while recording, against the same run without it (issue 29: >= 80%).

The `imageobs` source (`benchmarks.imageobs`: rgb observations of ``--size`` square frames, envs finishing at
different steps, frames on the source's device), recorded by fastrecord's defaults with ``lerobot=False``
and ``lerobot=True``, alternating, ``--repeats`` times each, one process; env-steps/s to everything on disk
(``close()`` included) and the ratio of the medians. Frames are gradients (no render needed). Also the
recording process's own CPU seconds per 1,000 env-steps (every thread of it, set-up included: what shares
the stepping thread's GIL; its helper processes not counted), the figure that limits a many-core machine
and that a 2-core one, where every process competes for the same cores, still measures.

    python -m benchmarks.bench_lerobot_speed --num-envs 128 --size 128 --steps 200   # the GPU machine
    python -m benchmarks.bench_lerobot_speed --num-envs 8 --size 64 --steps 60        # a CPU machine
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.imageobs import _measure, imageobs_env
from fastrecord.testing import gradient_clips, make_bank


def run(num_envs: int, size: int, steps: int, episode_steps: int, repeats: int, out: Path) -> dict[str, Any]:
    from fastrecord import RecordEpisode

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bank = make_bank(gradient_clips(8, episode_steps + 1, size, size), 4)
    runs: dict[str, list[dict[str, Any]]] = {"hdf5": [], "hdf5+lerobot": []}
    for rep in range(repeats):
        for name, lerobot in (("hdf5", False), ("hdf5+lerobot", True)):
            d = out / f"{name}_{rep}"
            src = imageobs_env(num_envs, bank, device)

            def make(src: Any = src, d: Path = d, lerobot: bool = lerobot) -> Any:
                return RecordEpisode(src, str(d), save_trajectory=True, trajectory_name="traj", save_video=False,
                                     lerobot=lerobot)

            cpu0 = time.process_time()
            r = _measure(make, src, steps, device)
            r["caller_cpu_ms_per_kstep"] = 1e6 * (time.process_time() - cpu0) / (steps * num_envs)
            if lerobot:
                info = json.loads((d / "traj.lerobot" / "meta" / "info.json").read_text())
                with __import__("h5py").File(d / "traj.h5", "r") as f:
                    r["frames_hdf5"] = sum(f[k]["actions"].shape[0] for k in f)
                r["frames_lerobot"] = info["total_frames"]  # a row per step: nothing dropped
            runs[name].append(r)
            shutil.rmtree(d, ignore_errors=True)
    med = {k: statistics.median(r["env_steps_per_s"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["caller_cpu_ms_per_kstep"] for r in v) for k, v in runs.items()}
    return dict(device=str(device), num_envs=num_envs, size=size, steps=steps, runs=runs, median=med,
                ratio=med["hdf5+lerobot"] / med["hdf5"], caller_cpu_ms_per_kstep=cpu)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-envs", type=int, default=8)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--episode-steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        r = run(a.num_envs, a.size, a.steps, a.episode_steps, a.repeats, Path(tmp))
    for name, v in r["runs"].items():
        for x in v:
            extra = f" (rows: lerobot {x['frames_lerobot']}, hdf5 {x['frames_hdf5']})" if "frames_lerobot" in x else ""
            print(f"{name:14s} {x['env_steps_per_s']:9.0f} env-steps/s  close {x['close_seconds']:.2f} s  caller CPU "
                  f"{x['caller_cpu_ms_per_kstep']:.0f} ms per 1,000 env-steps{extra}")
    print(f"LeRobot alongside / without: {r['ratio']:.2f} ({r['device']}, {r['num_envs']} envs, {r['size']}x{r['size']})")
    cpu = r["caller_cpu_ms_per_kstep"]
    print(f"caller CPU per 1,000 env-steps (medians): {cpu['hdf5']:.0f} ms without LeRobot, {cpu['hdf5+lerobot']:.0f} "
          f"ms with it ({cpu['hdf5+lerobot'] / cpu['hdf5']:.2f}x)")
    if a.json:
        a.json.write_text(json.dumps(r, indent=1, default=str))


if __name__ == "__main__":
    main()
