"""A LeRobot v3.0 dataset written while recording vs HDF5 + MP4, and vs ManiSkill's record-then-convert route.

Whole commands, timed from start to exit (env creation included), on the same episodes (PickCube-v1, a
seeded random policy, rgb observations: the sensor camera is what a LeRobot dataset's video holds):

  A. ``fastrecord record --obs-mode rgb``                              HDF5 + one MP4 per episode (render camera)
  B. ``fastrecord record --obs-mode rgb --lerobot``                    A + NAME.lerobot/ in the same run
  C. ``fastrecord record --obs-mode rgb --lerobot --no-trajectory --no-video``   the LeRobot dataset only
  D. ``fastrecord record --obs-mode rgb --no-video`` then ``python -m mani_skill.trajectory.convert_to_lerobot``
     (ManiSkill's route: HDF5 first, then a second pass writing mp4v videos no browser plays)

It prints each command's seconds, B's cost over A, and C against D; then checks that B, C and D hold the
same number of LeRobot episodes and frames.

    python benchmarks/bench_lerobot.py --episodes 8 --num-envs 2        # a small run (2-core machine: ~3 min)
    python benchmarks/bench_lerobot.py --episodes 64 --num-envs 16 --repeat 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def timed(argv: list[str], env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0


def lerobot_totals(root: Path) -> tuple[int, int]:
    info = json.loads((root / "meta" / "info.json").read_text())
    return info["total_episodes"], info["total_frames"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--env-id", default="PickCube-v1")
    p.add_argument("--episodes", type=int, default=8)
    p.add_argument("--num-envs", type=int, default=2)
    p.add_argument("--max-episode-steps", type=int, default=50)
    p.add_argument("--size", type=int, default=128, help="render camera side (the MP4s of A and B)")
    p.add_argument("--repeat", type=int, default=1, help="run every command this many times; the best time counts")
    p.add_argument("--keep", action="store_true", help="keep the output folders (printed)")
    args = p.parse_args()

    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    base = [
        sys.executable,
        "-m",
        "fastrecord",
        "record",
        args.env_id,
        "--obs-mode",
        "rgb",
        "--episodes",
        str(args.episodes),
        "--num-envs",
        str(args.num_envs),
        "--max-episode-steps",
        str(args.max_episode_steps),
        "--width",
        str(args.size),
        "--height",
        str(args.size),
    ]
    tmp = Path(tempfile.mkdtemp(prefix="bench_lerobot_"))
    cases = {
        "A": [["--output-dir", "{out}"]],
        "B": [["--output-dir", "{out}", "--lerobot"]],
        "C": [["--output-dir", "{out}", "--lerobot", "--no-trajectory", "--no-video"]],
        "D": [["--output-dir", "{out}", "--no-video"]],
    }
    best: dict[str, float] = {}
    for k in range(args.repeat):
        for name, runs in cases.items():
            out = tmp / f"{name}{k}"
            seconds = timed(base + [a.format(out=out) for a in runs[0]], env)
            if name == "D":
                fps = "20"  # PickCube's control frequency (the converter assumes 30 otherwise)
                seconds += timed([sys.executable, "-m", "mani_skill.trajectory.convert_to_lerobot", "--traj-path",
                                  str(out / "trajectory.h5"), "--output-dir", str(out / "converted"), "--fps", fps,
                                  "--image-size", "128x128", "--robot-type", "panda"], env)
            best[name] = min(best.get(name, float("inf")), seconds)
            print(f"run {k}: {name} {seconds:.1f} s", flush=True)
    last = args.repeat - 1
    totals = {
        n: lerobot_totals(tmp / f"{n}{last}" / ("converted" if n == "D" else "trajectory.lerobot")) for n in "BCD"
    }
    assert len(set(totals.values())) == 1, f"the LeRobot datasets differ: {totals}"
    steps = args.episodes * args.max_episode_steps
    print(
        f"\n{args.env_id}, {args.episodes} episodes x {args.max_episode_steps} steps, {args.num_envs} envs, rgb observations "
        f"(128x128 sensor camera), {args.size}x{args.size} render videos; {os.cpu_count()} cores; best of {args.repeat}"
    )
    labels = {
        "A": "HDF5 + MP4",
        "B": "HDF5 + MP4 + LeRobot",
        "C": "LeRobot only",
        "D": "HDF5, then ManiSkill's converter",
    }
    for n, label in labels.items():
        print(f"  {n}. {label:34s} {best[n]:7.1f} s   {steps / best[n]:7.1f} env-steps/s")
    print(f"  LeRobot in the same run costs {best['B'] - best['A']:+.1f} s ({best['B'] / best['A']:.2f}x A); "
          f"LeRobot only takes {best['C'] / best['D']:.2f}x the record-then-convert route's time")
    print(f"  LeRobot datasets: {totals['B'][0]} episodes, {totals['B'][1]} frames each (B, C, D)")
    if args.keep:
        print(f"outputs: {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
