"""Replay speed: `fastrecord replay --workers N` vs `--workers 1` vs ManiSkill's `replay_trajectory -n N`.

The case of issue 10: PickCube-v1 episodes (random actions, truncated at --steps), replayed state -> rgb,
trajectory only (no videos), with the same number of envs for every tool, wall time of the whole command
(interpreter, imports and env creation included). Each repeat runs the three commands back to back and
prints their ratios, measured in that repeat:

    python benchmarks/bench_replay.py                                  # 96 episodes x 50 steps, one env per core
    python benchmarks/bench_replay.py --workers auto,16,8,4            # fastrecord's default layout and others
    python benchmarks/bench_replay.py --episodes 8 --num-envs 2 --repeat 2 --sensor-size 64   # a 2-core machine
    python benchmarks/bench_replay.py --traj demos/trajectory.h5 --num-envs 16

fastrecord replays by env states (its default) and ManiSkill's tool with --use-env-states, so that both
do the same work per step (set the recorded state, compute the observation); --by actions compares both
by actions. Each tool writes into its own folder under --work-dir (ManiSkill's tool writes next to its
input, so it gets its own copy of the input); the episode counts of the outputs are checked.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def child_env() -> dict[str, str]:
    """The environment of the measured commands: this checkout's fastrecord first."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{path}" if path else str(SRC)}


def record_input(folder: Path, episodes: int, steps: int, sensor_size: int | None) -> Path:
    """PickCube-v1, state observations, random actions, ``episodes`` x ``steps`` (fastrecord record)."""
    folder.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "fastrecord", "record", "PickCube-v1", "--episodes", str(episodes), "--no-video",
            "--max-episode-steps", str(steps), "--output-dir", str(folder), "--trajectory-name", "pickcube"]
    if sensor_size is not None:  # kept in the file's env_kwargs: both tools replay with these cameras
        config = folder / "record.yaml"
        config.write_text(json.dumps({"env_kwargs": {"sensor_configs": {"width": sensor_size, "height": sensor_size}}}))
        argv += ["--config", str(config)]
    r = subprocess.run(argv, env=child_env(), capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"recording the input failed:\n{r.stderr[-3000:]}")
    return folder / "pickcube.h5"


def timed(argv: list[str], label: str) -> float:
    """The command's wall time; fastrecord's own timeline lines (workers up / replaying / done, merge,
    start-up) are printed under its label."""
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=child_env(), capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{label} failed ({' '.join(argv)}):\n{r.stderr[-3000:]}")
    for line in r.stdout.splitlines():
        if line.startswith(("workers (", "start-up", "speed:")):
            print(f"  {label}: {line}", flush=True)
    return seconds


def episodes_in(json_path: Path) -> int:
    return len(json.loads(json_path.read_text())["episodes"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traj", help="the NAME.h5 to replay (default: record PickCube-v1 episodes first)")
    p.add_argument("--episodes", type=int, default=96, help="episodes to record when --traj is not given")
    p.add_argument("--steps", type=int, default=50, help="steps per recorded episode")
    p.add_argument("--sensor-size", type=int, help="record with square sensor cameras of this size (default: the task's)")
    p.add_argument("--num-envs", type=int, default=os.cpu_count() or 1, help="envs for every tool (default: one per core)")
    p.add_argument("--workers", default="auto",
                   help="fastrecord's workers: a number, several separated by commas (each is run), or auto "
                        "(fastrecord's own default, see `fastrecord replay --help`)")
    p.add_argument("--by", choices=("states", "actions"), default="states")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--work-dir", help="where inputs and outputs go (default: a temporary folder, removed)")
    args = p.parse_args()
    n = args.num_envs
    layouts = [w.strip() for w in str(args.workers).split(",") if w.strip()]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_replay_"))
    try:
        src = Path(args.traj) if args.traj else record_input(work / "input", args.episodes, args.steps, args.sensor_size)
        total = episodes_in(src.with_suffix(".json"))
        print(f"input: {src} ({total} episodes, {json.loads(src.with_suffix('.json').read_text())['env_info']['env_id']}); "
              f"{n} envs, state -> rgb, trajectory only, by {args.by}; {os.cpu_count()} cores; wall time of each "
              f"command, start-up included", flush=True)
        fr = [sys.executable, "-m", "fastrecord", "replay", str(src), "--obs-mode", "rgb", "--no-video", "--quiet",
              "--overwrite", "--num-envs", str(n), "--by", args.by, "--trajectory-name", "replayed"]
        ms_dir = work / "maniskill"
        ms_dir.mkdir(parents=True, exist_ok=True)
        ms_src = ms_dir / src.name
        shutil.copy(src, ms_src)
        shutil.copy(src.with_suffix(".json"), ms_src.with_suffix(".json"))
        ms = [sys.executable, "-m", "mani_skill.trajectory.replay_trajectory", "--traj-path", str(ms_src), "-o", "rgb",
              "--save-traj", "--allow-failure", "-n", str(n)] + (["--use-env-states"] if args.by == "states" else [])
        runs, outputs = {}, {}
        for w in dict.fromkeys(layouts + ["1"]):  # each layout asked for, and one process
            label = "fastrecord (its default --workers)" if w == "auto" else f"fastrecord --workers {w}"
            runs[label] = fr + ([] if w == "auto" else ["--workers", w]) + ["--output-dir", str(work / f"fr_{w}")]
            outputs[label] = work / f"fr_{w}" / "replayed.json"
        runs[f"ManiSkill -n {n}"] = ms
        seconds: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.repeat):
            for label, argv in runs.items():
                seconds[label].append(timed(argv, label))
            for label, path in outputs.items():
                if episodes_in(path) != total:
                    sys.exit(f"{label} wrote {episodes_in(path)} episodes, not {total}")
            ms_out = [q for q in ms_dir.glob("*.json") if q.name != ms_src.with_suffix(".json").name]
            if len(ms_out) != 1 or episodes_in(ms_out[0]) != total:
                sys.exit(f"ManiSkill's tool wrote {[str(q) for q in ms_out]}, not one file of {total} episodes")
            ms_s = seconds[f"ManiSkill -n {n}"][-1]
            line = " | ".join(f"{label}: {s[-1]:.1f} s" for label, s in seconds.items())
            ratios = ", ".join(f"{label}: {ms_s / s[-1]:.2f}x" for label, s in seconds.items() if label.startswith("fastrecord"))
            print(f"run {r + 1}: {line}; ManiSkill's time / fastrecord's: {ratios}", flush=True)
            for q in ms_out:  # ManiSkill's tool replaces its output itself; start each repeat alike
                q.unlink()
                q.with_suffix(".h5").unlink(missing_ok=True)
        if args.repeat > 1:
            medians = {label: statistics.median(s) for label, s in seconds.items()}
            ms_m = medians[f"ManiSkill -n {n}"]
            print("medians: " + " | ".join(f"{label}: {m:.1f} s" for label, m in medians.items())
                  + "; ratio of medians: " + ", ".join(f"{label}: {ms_m / m:.2f}x" for label, m in medians.items()
                                                        if label.startswith("fastrecord")))
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
