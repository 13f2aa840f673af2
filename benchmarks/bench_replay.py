"""Replay speed: `fastrecord replay` on its defaults (and labelled variants) vs ManiSkill's `replay_trajectory -n N`.

The case of issues 10 and 19: PickCube-v1 episodes (random actions, truncated at --steps), replayed state -> rgb,
trajectory only (no videos), with the same number of envs for every tool, wall time of the whole command
(interpreter, imports and env creation included). Each repeat runs the commands back to back and prints
their ratios, measured in that repeat. ``--policy pick`` records the input with fastrecord's scripted PickCube
policy instead: episodes that end at their success (12-20 steps) or are truncated at --steps (the failures), so
the replay's envs end their episodes at different steps, as a policy's evaluation leaves them:

    python benchmarks/bench_replay.py                                  # 96 episodes x 50 steps, one env per core
    python benchmarks/bench_replay.py --workers auto,16,8,4,1          # fastrecord's default layout and others
    python benchmarks/bench_replay.py --num-envs 16 --batched-render auto,off --floor     # issue 19, on a GPU machine
    python benchmarks/bench_replay.py --episodes 8 --num-envs 2 --repeat 2 --sensor-size 64   # a 2-core machine
    python benchmarks/bench_replay.py --traj demos/trajectory.h5 --num-envs 16
    python benchmarks/bench_replay.py --num-envs 16 --src before=../main/src   # another tree's defaults, same run
    python benchmarks/bench_replay.py --num-envs 16 --policy pick --steps 80    # episodes ending at different steps
    python benchmarks/bench_replay.py --num-envs 16 --busy 8     # a busy machine: 8 other processes spin meanwhile

``--floor`` (CUDA) measures what one ``RenderSystemGroup`` of N of the input's sensor cameras takes a camera
and prints each fastrecord replay loop (its workers' first start of replaying to their last end, start-up
excluded) against the frames it drew times that per-camera time.

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
if str(SRC.parent) not in sys.path:  # run as a script: `benchmarks.*` importable
    sys.path.insert(0, str(SRC.parent))
from benchmarks.load import CpuLoad  # noqa: E402


def child_env(src: Path = SRC) -> dict[str, str]:
    """The environment of the measured commands: this checkout's fastrecord first (or that of ``src``)."""
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{path}" if path else str(src)}


# what --policy records the input with: `fastrecord record`'s flags
POLICIES = {
    "random": [],  # random actions: every episode truncated at --steps
    # the scripted PickCube policy: 13 of seeds 0-19 succeed, each at its own step (12-20 on seeds 0-15), the others
    # run to --steps
    "pick": ["--policy", "fastrecord.policies:pick_cube_policy", "--control-mode", "pd_ee_delta_pos"],
}


def record_input(folder: Path, episodes: int, steps: int, sensor_size: int | None, num_envs: int = 1,
                 ranks: int = 1, policy: str = "random") -> Path:
    """PickCube-v1, state observations, ``episodes`` of at most ``steps`` steps of ``policy`` (`POLICIES`; random
    actions: all of ``steps``) recorded by fastrecord record. With ``ranks``
    > 1, ``torchrun --standalone`` ranks record their shares side by side (``num_envs`` split among them) and rank 0
    joins them into one self-contained NAME.h5: the same episodes (episode g is seeded g, whoever records it), in a
    fraction of the time (the GPU machine's 480-episode input: 92 s in one process, where the envs step on one core)."""
    if (folder / "pickcube.h5").exists():  # recorded by an earlier run into the same --work-dir
        sys.exit(f"{folder / 'pickcube.h5'} exists (an earlier run's input): replay it with --traj "
                 f"{folder / 'pickcube.h5'}, or remove {folder.parent} or pick another --work-dir")
    folder.mkdir(parents=True, exist_ok=True)
    launcher = [sys.executable, "-m", "fastrecord"]
    if ranks > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
                    "-m", "fastrecord"]
        num_envs = max(1, num_envs // ranks)
    argv = [*launcher, "record", "PickCube-v1", "--episodes", str(episodes), "--no-video",
            "--max-episode-steps", str(steps), "--output-dir", str(folder), "--trajectory-name", "pickcube",
            "--num-envs", str(num_envs), *POLICIES[policy]]
    if sensor_size is not None:  # kept in the file's env_kwargs: both tools replay with these cameras
        config = folder / "record.yaml"
        config.write_text(json.dumps({"env_kwargs": {"sensor_configs": {"width": sensor_size, "height": sensor_size}}}))
        argv += ["--config", str(config)]
    r = subprocess.run(argv, env={**child_env(), "OMP_NUM_THREADS": "1"} if ranks > 1 else child_env(),
                       capture_output=True, text=True)
    if r.returncode != 0 and ranks > 1:  # the measurements do not depend on how the input was made: one process
        print(f"  (the input's {ranks} torchrun ranks failed, recording it in one process:\n"
              f"{r.stderr[-1500:]})", flush=True)
        shutil.rmtree(folder, ignore_errors=True)
        return record_input(folder, episodes, steps, sensor_size, num_envs * ranks, policy=policy)
    if r.returncode != 0:
        sys.exit(f"recording the input failed:\n{r.stderr[-3000:]}")
    return folder / "pickcube.h5"


def timed(argv: list[str], label: str, loop: list[float] | None = None, src: Path = SRC,
          stamps: Path | None = None) -> float:
    """The command's wall time; fastrecord's own timeline lines (workers up / replaying / done, merge,
    start-up) are printed under its label, and the replay loop's seconds (the workers' first start of
    replaying to their last end) appended to ``loop``. With ``stamps`` (a file; fastrecord's commands only) the
    command writes its phases there (``FASTRECORD_TIMELINE``), printed as seconds after the launch."""
    import re

    env = child_env(src)
    if stamps is not None:
        for old in [stamps, *stamps.parent.glob(f"{stamps.name}.*")]:
            old.unlink(missing_ok=True)
        env["FASTRECORD_TIMELINE"] = str(stamps)
    launched = time.time()
    t0 = time.perf_counter()
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{label} failed ({' '.join(argv)}):\n{r.stderr[-3000:]}")
    if stamps is not None and stamps.exists():
        phases = sorted(json.loads(stamps.read_text()).items(), key=lambda kv: kv[1])
        print(f"  {label}: phases (s after launch) " + ", ".join(f"{k} {t - launched:.2f}" for k, t in phases)
              + f", exit {seconds:.2f}", flush=True)
        for child in sorted(stamps.parent.glob(f"{stamps.name}.*")):  # a replay worker's own phases, the server's
            if child.suffix == ".tmp":
                continue
            phases = sorted(json.loads(child.read_text()).items(), key=lambda kv: kv[1])
            print(f"    {child.suffix[1:]}: " + ", ".join(f"{k} {t - launched:.2f}" for k, t in phases), flush=True)
    for line in r.stdout.splitlines():
        if line.startswith(("workers (", "start-up", "speed:")):
            print(f"  {label}: {line}", flush=True)
        m = re.search(r"replaying from ([\d.]+)-[\d.]+ s .*done at [\d.]+-([\d.]+) s", line)
        if m and loop is not None:
            loop.append(float(m.group(2)) - float(m.group(1)))
    return seconds


def frames_in(json_path: Path, count: int) -> int:
    """The frames a replay of the first ``count`` episodes draws: every step of every episode, and its reset."""
    episodes = json.loads(json_path.read_text())["episodes"][:count]
    return sum(int(e["elapsed_steps"]) + 1 for e in episodes)


def measure_floor(n: int, src: Path, reps: int = 50) -> float:
    """Milliseconds a camera of one ``RenderSystemGroup`` of ``n`` envs of the input's task and cameras takes to
    draw its sensor picture (update_render + take_picture + reading the colour texture, nothing else)."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    import torch

    from fastrecord.render.group import GroupRenderer

    info = json.loads(src.with_suffix(".json").read_text())["env_info"]
    kw = {
        k: v
        for k, v in info["env_kwargs"].items()
        if k not in ("num_envs", "sim_backend", "render_backend", "obs_mode")
    }
    envs = [
        gym.make(info["env_id"], obs_mode="rgb", sim_backend="physx_cpu", render_backend="gpu", **kw) for _ in range(n)
    ]
    try:
        for i, e in enumerate(envs):
            e.reset(seed=i)
        group = GroupRenderer(envs)
        name = next(iter(envs[0].unwrapped.scene.sensors))
        group.set_poses_from_envs()
        group.sensor_data(name, ("rgb",))
        cg = group._camera_group(name)

        def draw() -> None:
            group._group.update_render()
            cg.take_picture()
            cg.get_picture_cuda("Color").torch()

        draw()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            draw()
        torch.cuda.synchronize()
        per_camera = (time.perf_counter() - t0) / reps * 1e3 / n
        submit = read = 0.0  # where the host waits: is a submitted picture drawn while the caller goes on?
        for _ in range(reps):
            t0 = time.perf_counter()
            group._group.update_render()
            cg.take_picture()
            t1 = time.perf_counter()
            cg.get_picture_cuda("Color").torch()
            torch.cuda.synchronize()
            submit, read = submit + t1 - t0, read + time.perf_counter() - t1
        print(f"floor, host side: update_render + take_picture {submit / reps * 1e3:.2f} ms, then reading the picture "
              f"{read / reps * 1e3:.2f} ms (a group of {n})", flush=True)
        return per_camera
    finally:
        for e in envs:
            e.close()


def replay_argv(src: Path, n: int, count: int, by: str) -> list[str]:
    """`fastrecord replay` of the first ``count`` episodes of ``src``, state -> rgb, trajectory only, ``n`` envs."""
    return [sys.executable, "-m", "fastrecord", "replay", str(src), "--obs-mode", "rgb", "--no-video", "--quiet",
            "--overwrite", "--num-envs", str(n), "--by", by, "--trajectory-name", "replayed", "--count", str(count)]


def maniskill_replay_argv(src: Path, n: int, count: int, by: str) -> list[str]:
    """ManiSkill's ``replay_trajectory -n N`` doing the work of `replay_argv` (it writes beside ``src``)."""
    return ([sys.executable, "-m", "mani_skill.trajectory.replay_trajectory", "--traj-path", str(src), "-o", "rgb",
             "--save-traj", "--allow-failure", "-n", str(n), "--count", str(count)]
            + (["--use-env-states"] if by == "states" else []))


def count_arg(minimum: int):
    """An argparse type: an integer of at least ``minimum``, else argparse's usage error naming the value."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}: give {minimum} or more")
        return value
    return parse


def episodes_in(json_path: Path) -> int:
    return len(json.loads(json_path.read_text())["episodes"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traj", help="the NAME.h5 to replay (default: record PickCube-v1 episodes first)")
    p.add_argument("--episodes", type=count_arg(1), default=96, help="episodes to record when --traj is not given")
    p.add_argument("--count", type=count_arg(1), help="replay only the first COUNT episodes of the input (both tools' --count)")
    p.add_argument("--steps", type=count_arg(1), default=50, help="steps per recorded episode (--policy pick: at most)")
    p.add_argument("--policy", choices=sorted(POLICIES), default="random",
                   help="what the input is recorded with when --traj is not given: random actions (every episode "
                        "--steps long) or pick, the scripted PickCube policy (episodes end at their success: the envs "
                        "end theirs at different steps)")
    p.add_argument(
        "--sensor-size", type=count_arg(1), help="record with square sensor cameras of this size (default: the task's)"
    )
    p.add_argument(
        "--num-envs", type=count_arg(1), default=os.cpu_count() or 1, help="envs for every tool (default: one per core)"
    )
    p.add_argument("--workers", default="auto",
                   help="fastrecord's workers: a number, several separated by commas (each is run), or auto "
                        "(fastrecord's own default, see `fastrecord replay --help`)")
    p.add_argument(
        "--batched-render",
        default="auto",
        help="fastrecord's --batched-render: auto (its default), on, off, or several separated by commas (each "
        "is run with each --workers layout), e.g. auto,off",
    )
    p.add_argument(
        "--vector",
        default="auto",
        help="fastrecord's --vector: auto (its default), sync, async, or several separated by commas (each is run "
        "with each --workers and --batched-render), e.g. auto,async; async with a batched render is one rendering "
        "process fed by sub-env processes (fastrecord.replay.mirrored)",
    )
    p.add_argument(
        "--floor",
        action="store_true",
        help="also measure the batched-render floor (CUDA): one RenderSystemGroup of --num-envs sensor cameras, "
        "and judge fastrecord's replay loop (workers' first start to last end) against frames x that "
        "per-camera time",
    )
    p.add_argument("--also", action="append", default=[], metavar="FLAGS",
                   help="also run fastrecord with these flags (one string, e.g. '--workers 1 --vector async'), labelled "
                        "by them; may be given several times")
    p.add_argument("--src", action="append", default=[], metavar="LABEL=PATH",
                   help="also run fastrecord's defaults from another source tree (PATH: its src/ folder) in the same "
                        "repeat, e.g. before=../main/src")
    p.add_argument("--by", choices=("states", "actions"), default="states")
    p.add_argument("--repeat", type=count_arg(1), default=1)
    p.add_argument("--stamps", action="store_true",
                   help="print where each fastrecord command's seconds went (its FASTRECORD_TIMELINE phases)")
    p.add_argument("--busy", type=count_arg(0), default=0, metavar="CORES",
                   help="time every command (both tools') while CORES other processes spin (benchmarks.load.CpuLoad: "
                        "a machine shared with a training job or a test suite); the input is recorded before")
    p.add_argument("--work-dir", help="where inputs and outputs go (default: a temporary folder, removed)")
    args = p.parse_args()
    n = args.num_envs
    layouts = [w.strip() for w in str(args.workers).split(",") if w.strip()]
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_replay_"))
    try:
        src = (
            Path(args.traj) if args.traj
            else record_input(work / "input", args.episodes, args.steps, args.sensor_size, num_envs=min(n, 16),
                              policy=args.policy)
        )
        total = episodes_in(src.with_suffix(".json"))
        if args.count is not None:
            total = min(total, args.count)
        lengths = [int(e["elapsed_steps"]) for e in json.loads(src.with_suffix(".json").read_text())["episodes"][:total]]
        print(
            f"input: {src} ({total} episodes of {min(lengths)}-{max(lengths)} steps, mean "
            f"{statistics.mean(lengths):.1f}, {json.loads(src.with_suffix('.json').read_text())['env_info']['env_id']}); "
            f"{n} envs, state -> rgb, trajectory only, by {args.by}; {os.cpu_count()} cores"
            f"{f', {args.busy} of them kept busy by other processes' if args.busy else ''}; wall time of each "
            f"command, start-up included",
            flush=True,
        )
        fr = replay_argv(src, n, total, args.by)
        ms_dir = work / "maniskill"
        ms_dir.mkdir(parents=True, exist_ok=True)
        ms_src = ms_dir / src.name
        shutil.copy(src, ms_src)
        shutil.copy(src.with_suffix(".json"), ms_src.with_suffix(".json"))
        ms = maniskill_replay_argv(ms_src, n, total, args.by)
        runs, outputs = {}, {}
        batched = [b.strip() for b in str(args.batched_render).split(",") if b.strip()]
        vectors = [v.strip() for v in str(args.vector).split(",") if v.strip()]
        for w in layouts:  # each layout asked for (1: one process), with each --batched-render and --vector asked for
            for b in batched:
                for v in vectors:
                    flags = [f for f in ("" if w == "auto" else f"--workers {w}",
                                         "" if b == "auto" else f"--batched-render {b}",
                                         "" if v == "auto" else f"--vector {v}") if f]
                    label = "fastrecord " + " ".join(flags) if flags else "fastrecord (defaults)"
                    folder = work / f"fr_{w}_{b}_{v}"
                    runs[label] = fr + [x for f in flags for x in f.split()] + ["--output-dir", str(folder)]
                    outputs[label] = folder / "replayed.json"
        for k, flags in enumerate(args.also):
            label = f"fastrecord {flags.strip()}"
            folder = work / f"fr_also_{k}"
            runs[label] = fr + flags.split() + ["--output-dir", str(folder)]
            outputs[label] = folder / "replayed.json"
        srcs: dict[str, Path] = {}
        for item in args.src:
            label, _, path = item.partition("=")
            if not path:
                sys.exit(f"--src {item!r}: give LABEL=PATH, e.g. before=../main/src")
            folder = work / f"fr_src_{label}"
            runs[f"fastrecord {label}"] = fr + ["--output-dir", str(folder)]
            outputs[f"fastrecord {label}"] = folder / "replayed.json"
            srcs[f"fastrecord {label}"] = Path(path).resolve()
        runs[f"ManiSkill -n {n}"] = ms
        seconds: dict[str, list[float]] = {k: [] for k in runs}
        floor_ms = measure_floor(n, src) if args.floor else None
        frames = frames_in(src.with_suffix(".json"), total)
        if floor_ms is not None:
            print(
                f"floor: one group of {n} sensor cameras {floor_ms * n:.2f} ms = {floor_ms:.3f} ms a camera; {frames} "
                f"frames (steps + resets) -> {frames * floor_ms / 1e3:.2f} s",
                flush=True,
            )
        for r in range(args.repeat):
            for label, argv in runs.items():
                loop: list[float] = []
                stamps = work / "stamps.json" if args.stamps and label.startswith("fastrecord") else None
                with CpuLoad(args.busy) as load:
                    seconds[label].append(timed(argv, label, loop, srcs.get(label, SRC), stamps))
                if args.busy:
                    print(f"  {label}: beside {args.busy} spinning processes ({load.cores_held:.1f} cores held)",
                          flush=True)
                if floor_ms is not None and loop:
                    print(
                        f"  {label}: replay loop {loop[0]:.2f} s = {loop[0] / (frames * floor_ms / 1e3):.2f}x the floor",
                        flush=True,
                    )
            for label, path in outputs.items():
                if episodes_in(path) != total:
                    sys.exit(f"{label} wrote {episodes_in(path)} episodes, not {total}")
            ms_out = [q for q in ms_dir.glob("*.json") if q.name != ms_src.with_suffix(".json").name]
            if len(ms_out) != 1 or episodes_in(ms_out[0]) != total:
                sys.exit(f"ManiSkill's tool wrote {[str(q) for q in ms_out]}, not one file of {total} episodes")
            ms_s = seconds[f"ManiSkill -n {n}"][-1]
            line = " | ".join(f"{label}: {s[-1]:.1f} s" for label, s in seconds.items())
            ratios = ", ".join(
                f"{label}: {ms_s / s[-1]:.2f}x" for label, s in seconds.items() if label.startswith("fastrecord")
            )
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
