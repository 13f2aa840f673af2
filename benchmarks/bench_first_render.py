"""What SAPIEN's BRDF lookup table costs a process on a CPU renderer, and what handing it one saves
(fastrecord.render.lut; ``FASTRECORD_BRDF_LUT=0`` is the way before it), side by side in one run.

Two jobs, each a fresh process, launch to exit, alternating the two ways ``--repeats`` times:
- ``readme``: the README's main job, ``python -m fastrecord record PickCube-v1`` (its embedded default: CPU
  simulation, CPU rendering, 4 episodes, video and trajectories), in a fresh output folder;
- ``first_picture``: in a process of fastrecord's (``claim_process``, as its CLI, workers and sub-envs), ``gym.make``
  of PickCube-v1 with rgb observations (its sensor renders in the make) and a 128x128 human camera, a reset and
  one ``render()``.

    python -m benchmarks.bench_first_render --repeats 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

FIRST_PICTURE = """
import gymnasium as gym, mani_skill.envs
from fastrecord.workers import claim_process
claim_process()
env = gym.make("PickCube-v1", obs_mode="rgb", render_mode="rgb_array", sim_backend="physx_cpu",
               human_render_camera_configs=dict(width=128, height=128))
env.reset(seed=0)
env.render()
"""


def _timed(cmd: list[str], table: bool, cwd: str) -> float:
    env = dict(os.environ, FASTRECORD_BRDF_LUT="1" if table else "0")
    env.setdefault("PYTHONPATH", str(Path(__file__).resolve().parents[1] / "src"))
    t0 = time.perf_counter()
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode:
        raise RuntimeError(f"{cmd} failed:\n{out.stderr[-2000:]}")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--jobs", nargs="+", default=["readme", "first_picture"], choices=["readme", "first_picture"])
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    from fastrecord.system import use_lavapipe_if_no_gpu

    use_lavapipe_if_no_gpu()  # the children inherit the driver choice the CLI would make
    results: dict[str, dict[str, list[float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for job in a.jobs:
            times: dict[str, list[float]] = {"SAPIEN's table": [], "fastrecord's table": []}
            for r in range(a.repeats):
                for label, table in (("SAPIEN's table", False), ("fastrecord's table", True)):
                    if job == "readme":
                        out = Path(tmp) / f"readme-{r}-{int(table)}"
                        cmd = [sys.executable, "-m", "fastrecord", "record", "PickCube-v1", "--output-dir", str(out)]
                    else:
                        cmd = [sys.executable, "-c", FIRST_PICTURE]
                    times[label].append(_timed(cmd, table, tmp))
                    print(f"{job:14s} {label:19s} run {r + 1}: {times[label][-1]:6.1f} s", flush=True)
            results[job] = times
    print(f"\n{'job':14s} {'SAPIEN table (median)':>22s} {'fastrecord table':>17s} {'ratio':>6s}")
    for job, times in results.items():
        before, after = (statistics.median(times[k]) for k in ("SAPIEN's table", "fastrecord's table"))
        print(f"{job:14s} {before:20.1f} s {after:15.1f} s {after / before:6.2f}")
    load = os.getloadavg()
    print(f"machine: {os.cpu_count()} cores, load average {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    if a.json:
        a.json.write_text(json.dumps({"results": results, "cores": os.cpu_count(), "load": load}, indent=1))


if __name__ == "__main__":
    main()
