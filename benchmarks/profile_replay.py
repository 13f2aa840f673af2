"""Where a replay's step goes, in one process: `fastrecord.replay_trajectories` of PickCube-v1 episodes state -> rgb
(trajectory only, by states), with wall-clock timers around each layer a step passes through, each variant in a
fresh process (``--variants``):

    python -m benchmarks.profile_replay --episodes 96 --num-envs 16                  # mirrored (async) and sync
    python -m benchmarks.profile_replay --traj demos/pickcube.h5 --variants async,async_per1

Variants: ``async`` (`--workers 1 --vector async`: sub-env processes, four envs each, drawn in this process by
`fastrecord.replay.mirrored`), ``async_per1`` / ``async_per2`` (the same, one / two envs a sub-env process), ``sync``
(`--workers 1 --vector sync`: every env in this process, drawn in one group). Layers (mean and p50 ms a call, and
seconds in all): ``batch.step`` (the replay loop's step: the vector env and the recorder), ``subenvs.step`` (the
sub-env processes' answer, `PackedVectorEnv.step` / ``step_ahead``), ``draw`` (the group's sensor pictures to the
host, `MirroredReplayVectorEnv._with_sensors`), ``grouped.step`` (`GroupedSyncVectorEnv.step`, sync),
``recorder.on_step`` (the recorder's work for the step's envs), ``batch.start`` (resets), ``flush`` (an ended
episode checked and handed to the writers; ``recorder.finalize`` inside it), ``plan`` (an episode's actions and states
read from the input), ``batch.close`` (the writers drained, the envs closed; inside the loop's time). A GPU machine's
figures; on the CPU the batched render does not run.
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
from collections import defaultdict
from pathlib import Path

VARIANTS = {
    "async": dict(workers=1, vector="async"),
    "async_per1": dict(workers=1, vector="async"),
    "async_per2": dict(workers=1, vector="async"),
    "sync": dict(workers=1, vector="sync"),
}


def _timers(variant: str) -> dict[str, list[float]]:
    from fastrecord import packed, recorder
    from fastrecord.replay import drive, envs, grouped, mirrored

    times: dict[str, list[float]] = defaultdict(list)

    def wrap(owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                times[label].append(time.perf_counter() - t0)

        setattr(owner, name, timed)

    wrap(envs.VectorBatch, "step", "batch.step")
    wrap(envs.VectorBatch, "start", "batch.start")
    wrap(packed.PackedVectorEnv, "step", "subenvs.step")
    wrap(packed.PackedVectorEnv, "step_ahead", "subenvs.step")
    wrap(mirrored.MirroredReplayVectorEnv, "_with_sensors", "draw")
    wrap(grouped.GroupedSyncVectorEnv, "step", "grouped.step")
    wrap(recorder.EpisodeRecorder, "on_step", "recorder.on_step")
    wrap(drive._Tally, "write", "flush")  # an ended episode checked and handed to the writers
    wrap(recorder.EpisodeRecorder, "finalize", "recorder.finalize")
    wrap(drive._Slots, "_plan", "plan")  # an episode's actions and states read from the input file
    wrap(envs.VectorBatch, "close", "batch.close")
    if variant in ("async_per1", "async_per2"):
        from fastrecord.replay import layout

        layout.SUBENVS_PER_PROCESS = int(variant[-1])  # what mirrored_replay_env packs its sub-envs by
    return times


def child(traj: str, variant: str, num_envs: int, out: str) -> dict:
    import fastrecord

    times = _timers(variant)
    t0 = time.perf_counter()
    s = fastrecord.replay_trajectories(traj, out, trajectory_name="replayed", obs_mode="rgb", save_video=False,
                                       num_envs=num_envs, progress=False, **VARIANTS[variant])
    whole = time.perf_counter() - t0
    layers = {k: dict(calls=len(v), seconds=round(sum(v), 3), mean_ms=round(1e3 * statistics.mean(v), 2),
                      p50_ms=round(1e3 * statistics.median(v), 2)) for k, v in times.items() if v}
    return dict(variant=variant, episodes=s.episodes, env_steps=s.env_steps, loop_s=round(s.seconds, 2),
                startup_s=round(s.startup_seconds, 2), call_s=round(whole, 2), layers=layers)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traj", help="the NAME.h5 to replay (default: record PickCube-v1 episodes first)")
    p.add_argument("--episodes", type=int, default=96)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--variants", default="async,async_per1,sync")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--child", nargs=3, metavar=("TRAJ", "VARIANT", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child[0], args.child[1], args.num_envs, args.child[2])), flush=True)
        os._exit(0)
    work = Path(tempfile.mkdtemp(prefix="profile_replay_"))
    traj = args.traj
    if traj is None:
        argv = [sys.executable, "-m", "fastrecord", "record", "PickCube-v1", "--episodes", str(args.episodes),
                "--no-video", "--max-episode-steps", str(args.steps), "--output-dir", str(work / "input"),
                "--trajectory-name", "pickcube", "--num-envs", str(min(args.num_envs, 16))]
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0:
            sys.exit(f"recording the input failed ({' '.join(argv)}):\n{r.stderr[-3000:]}")
        traj = str(work / "input" / "pickcube.h5")
    results = []
    for variant in [v.strip() for v in args.variants.split(",") if v.strip()]:
        if variant not in VARIANTS:
            sys.exit(f"--variants: {variant!r} is not one of {sorted(VARIANTS)}")
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "benchmarks.profile_replay", "--num-envs", str(args.num_envs),
                            "--child", traj, variant, str(work / variant)], capture_output=True, text=True)
        wall = time.perf_counter() - t0
        line = next((x for x in r.stdout.splitlines() if x.startswith("RESULT ")), None)
        if r.returncode != 0 or line is None:
            print(f"{variant}: failed\n{r.stderr[-3000:]}", flush=True)
            continue
        res = json.loads(line[len("RESULT "):])
        res["process_s"] = round(wall, 2)
        results.append(res)
        print(f"{variant}: whole process {wall:.1f} s, replay call {res['call_s']} s (start-up {res['startup_s']} s, "
              f"loop {res['loop_s']} s = {res['env_steps'] / res['loop_s']:.0f} env-steps/s)", flush=True)
        for k, v in res["layers"].items():
            print(f"  {k:18s} {v['calls']:5d} calls  {v['seconds']:7.2f} s  mean {v['mean_ms']:7.2f} ms  "
                  f"p50 {v['p50_ms']:7.2f} ms", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
