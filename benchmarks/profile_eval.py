"""Where a `fastrecord.make_eval_envs` evaluation's loop and close spend their seconds (issue 27: the eval's "loop
with close" >= 800 env-steps/s).

    python -m benchmarks.profile_eval --num-envs 16 --size 512 --steps 200 --variants default,per_process_1,no_video

Each variant runs in a fresh process: the diffusion-policy baseline's loop of `benchmarks.whole_children` (reset
once, ``steps`` random actions, close) over ``make_eval_envs`` (CPU simulation, every env's video, the batched
render where there is a GPU), with wall-clock timers around the layers a step passes through (the frame stacking
and same-step reset, the recorder, the batched render, the sub-env processes) and around the close's parts.
Prints, per variant, each timer's calls, mean and total, the loop's steps split into steps where envs reset and
the others (the 8 slowest of the others with their timers: the mean's tail), and the close's parts; Python's garbage
collections are timed too (``gc.gen0/1/2``). Variants:
``default``; ``per_process_N`` (``envs_per_process=N``);
``video_workers_N`` (N encoder processes);
``no_video`` (no recorder: the sub-envs and the stacking alone); ``sync`` (the default, with
``torch.cuda.synchronize()`` timed after each batched render: the GPU's drawing, seen from the host).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any

TIMED = {  # module: {class: [methods]}
    "fastrecord.make_env": {"EvalVectorEnv": ["step", "_reset", "reset"]},
    "fastrecord.record": {"RecordVectorEpisode": ["step", "close", "reset"]},
    "fastrecord.recorder": {"EpisodeRecorder": ["before_step", "on_step", "on_reset", "finalize", "_collect", "close"]},
    "fastrecord.render.group": {"GroupRenderer": ["set_poses", "take_pictures", "read_sensor_data", "_ensure",
                                                  "_camera_group", "warm"]},
    "fastrecord.packed": {"PackedVectorEnv": ["step", "reset", "close", "close_extras"]},
    # in the sub-env processes too (forked from this process's forkserver after the patches): their timers are
    # written at their close (`_dump_subprocess`) and printed as ``sub.*``
    "fastrecord.render.vector": {"GroupRenderedVectorEnv": ["render", "reset", "_take", "_sync", "close"],
                                 "PoseReporter": ["_report"]},
    "mani_skill.envs.sapien_env": {"BaseEnv": ["_reconfigure", "reset", "step", "close"]},
}
MAIN_PID = os.getpid()


def _wrap(timers: dict[str, list[float]], sync: bool) -> None:
    import importlib

    for mod_name, classes in TIMED.items():
        mod = importlib.import_module(mod_name)
        for cls_name, methods in classes.items():
            cls = getattr(mod, cls_name)
            for name in methods:
                orig = getattr(cls, name, None)
                if orig is None:  # another source tree's (--src before=...): not there
                    continue
                key = f"{cls_name}.{name}"

                def timed(*a: Any, _orig: Any = orig, _key: str = key, **k: Any) -> Any:
                    t0 = time.perf_counter()
                    try:
                        return _orig(*a, **k)
                    finally:
                        timers[_key].append(time.perf_counter() - t0)
                        if sync and _key == "GroupRenderedVectorEnv.render":
                            import torch

                            t1 = time.perf_counter()
                            torch.cuda.synchronize()
                            timers["render_gpu_wait"].append(time.perf_counter() - t1)

                setattr(cls, name, timed)
    try:
        from fastrecord import packed_process
    except ImportError:  # another source tree's (--src before=...): the sub-env side still in fastrecord.packed
        from fastrecord import packed as packed_process  # type: ignore[no-redef]

    run = packed_process._SubEnvs.run

    def run_timed(self: Any, command: str, data: Any) -> list[Any]:  # a sub-env process's commands, by name
        t0 = time.perf_counter()
        try:
            return run(self, command, data)
        finally:
            timers[f"SubEnvs.{command}"].append(time.perf_counter() - t0)
            if command == "close":
                _dump_subprocess(timers)

    packed_process._SubEnvs.run = run_timed


def _dump_subprocess(timers: dict[str, list[float]]) -> None:
    """A sub-env process's timers, to ``$PROFILE_SUBDIR/<pid>.json`` (read by the caller after its close)."""
    folder = os.environ.get("PROFILE_SUBDIR")
    if folder and os.getpid() != MAIN_PID:
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump(timers, f)


FULL_COLLECTIONS: list[tuple[str, int, int, int, float]] = []  # (thread, frozen, walked after, collected, ms)


def _time_collections(timers: dict[str, list[float]]) -> None:
    """Python's garbage collections in this process, timed like the layers (``gc.gen0/1/2``): a full one walks
    the heap of torch and ManiSkill (0.1-0.3 s), and a step that holds one is among the slowest. Each full one is
    also noted in `FULL_COLLECTIONS` with its thread, how many objects were frozen (``gc.freeze``: out of its
    walk) as it started and how many it would walk after it: whether `fastrecord.render.vector.scenes_built` kept the
    mirrors' builds' collections short, and whether a long one walked much (else its finalizers took the time)."""
    import gc
    import threading

    started: list[tuple[float, int]] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append((time.perf_counter(), gc.get_freeze_count()))
        elif started:
            t0, frozen = started.pop()
            took = time.perf_counter() - t0
            timers[f"gc.gen{info['generation']}"].append(took)
            if info["generation"] == 2:
                walked = len(gc.get_objects())  # after the timing: what a full collection walks now
                FULL_COLLECTIONS.append((threading.current_thread().name, frozen, walked, info["collected"], 1e3 * took))

    gc.callbacks.append(on_gc)


def child(a: dict[str, Any]) -> None:
    import numpy as np

    from benchmarks.whole_children import _eval_kwargs

    timers: dict[str, list[float]] = defaultdict(list)
    if not a.get("light"):
        _wrap(timers, a["variant"] == "sync")
        _time_collections(timers)
    from fastrecord import make_eval_envs

    extra: dict[str, Any] = {}
    if a["variant"].startswith("per_process_"):
        extra["envs_per_process"] = int(a["variant"].rsplit("_", 1)[1])
    if a["variant"].startswith("video_workers_"):
        extra["record_kwargs"] = dict(video_workers=int(a["variant"].rsplit("_", 1)[1]))
    video = None if a["variant"] == "no_video" else a["out"]
    t0 = time.perf_counter()
    envs = make_eval_envs(a["env_id"], a["num_envs"], "physx_cpu", _eval_kwargs(a), dict(obs_horizon=2),
                          video_dir=video, **extra)
    made = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    actions = rng.uniform(-1, 1, size=(a["steps"], *envs.action_space.shape)).astype(np.float32)
    t0 = time.perf_counter()
    envs.reset(seed=0)
    reset_s = time.perf_counter() - t0
    reset_timers = {k: list(v) for k, v in timers.items()}
    timers.clear()
    steps: list[tuple[float, bool]] = []
    t_loop = time.perf_counter()
    parts: list[dict[str, float]] = []  # each step's time in each timer (the slowest steps are printed)
    for i in range(a["steps"]):
        before = {k: len(v) for k, v in timers.items()}
        t0 = time.perf_counter()
        envs.step(actions[i])
        resets = (i + 1) % a["episode_steps"] == 0 if a.get("light") else len(
            timers.get("EvalVectorEnv._reset", [])) > before.get("EvalVectorEnv._reset", 0)
        steps.append((time.perf_counter() - t0, resets))
        parts.append({k: sum(v[before.get(k, 0):]) for k, v in timers.items() if len(v) > before.get(k, 0)})
    loop = time.perf_counter() - t_loop
    loop_timers = {k: list(v) for k, v in timers.items()}
    timers.clear()
    t0 = time.perf_counter()
    envs.close()
    close = time.perf_counter() - t0
    from fastrecord.video.pool import started_encoder_pool

    pool = started_encoder_pool()  # the process-wide encoders (closed at exit): what each video cost them
    encoders = dataclasses.asdict(pool.stats) if pool is not None else {}
    stamps: dict[str, float] = {}
    if os.path.exists(a["timeline"]):
        with open(a["timeline"]) as f:
            stamps = {k: v - a["t0"] for k, v in json.load(f).items()}
    sub: dict[str, list[float]] = defaultdict(list)  # the sub-env processes' timers, all processes together
    folder = os.environ.get("PROFILE_SUBDIR", "")
    for name in sorted(os.listdir(folder)) if folder else []:
        with open(os.path.join(folder, name)) as f:
            for k, v in json.load(f).items():
                sub[k] += v
    slowest = sorted((i for i, (_, reset) in enumerate(steps) if not reset), key=lambda i: -steps[i][0])[:8]
    out = dict(variant=a["variant"], made=made, reset=reset_s, loop=loop, close=close, steps=steps, stamps=stamps,
               slowest=[(i, steps[i][0], parts[i]) for i in sorted(slowest)],
               reset_steps=[(i, t, parts[i]) for i, (t, reset) in enumerate(steps) if reset], subprocess_timers=sub,
               reset_timers=reset_timers, loop_timers=loop_timers, close_timers={k: list(v) for k, v in timers.items()},
               full_collections=FULL_COLLECTIONS, encoders=encoders)
    with open(a["json"], "w") as f:
        json.dump(out, f)
    os._exit(0)  # as fastrecord's CLI leaves: the interpreter's teardown is not what this measures


def report(r: dict[str, Any], num_envs: int) -> str:
    n = len(r["steps"])
    lines = [f"== {r['variant']}: make {r['made']:.2f} s, first reset {r['reset']:.2f} s, loop {r['loop']:.2f} s "
             f"({n * num_envs / r['loop']:.0f} env-steps/s), close {r['close']:.2f} s; loop with close "
             f"{n * num_envs / (r['reset'] + r['loop'] + r['close']):.0f} env-steps/s (first reset included)"]
    plain = [s for s, reset in r["steps"] if not reset]
    resets = [s for s, reset in r["steps"] if reset]
    if plain:
        lines.append(f"   steps without resets: {len(plain)}, p50 {1e3 * statistics.median(plain):.1f} ms, mean "
                     f"{1e3 * statistics.mean(plain):.1f} ms, max {1e3 * max(plain):.1f} ms, sum {sum(plain):.2f} s")
    after = [s for j, (s, reset) in enumerate(r["steps"]) if not reset and any(
        r["steps"][k][1] for k in range(max(0, j - 10), j))]  # the 10 steps after a reset step: the encoders' busy time
    if plain and after:
        rest = [s for j, (s, reset) in enumerate(r["steps"]) if not reset and not any(
            r["steps"][k][1] for k in range(max(0, j - 10), j))]
        lines.append(f"   of which the 10 after each reset step: {len(after)}, mean {1e3 * statistics.mean(after):.1f} ms"
                     f"; the others mean {1e3 * statistics.mean(rest):.1f} ms, p50 {1e3 * statistics.median(rest):.1f} ms")
    if resets:
        lines.append(f"   steps with resets: {len(resets)}, each {', '.join(f'{1e3 * s:.0f}' for s in resets)} ms, "
                     f"sum {sum(resets):.2f} s")
    enc = r.get("encoders") or {}
    if enc.get("jobs"):
        lines.append(f"   encoders: {enc['jobs']} videos of {enc['frames'] / enc['jobs']:.0f} frames, each "
                     f"{1e3 * enc['encode_seconds'] / enc['jobs']:.0f} ms wall, {1e3 * enc['encode_cpu_seconds'] / enc['jobs']:.0f} "
                     f"ms CPU in an encoder process (in the stepping process while they started: {enc['jobs_here']})")
    for title, key in (("reset step", "reset_steps"), ("slow step", "slowest")):
        for i, t, part in r.get(key, []):
            inner = {k: v for k, v in part.items() if k not in ("EvalVectorEnv.step", "RecordVectorEpisode.step")}
            top = sorted(inner.items(), key=lambda kv: -kv[1])[:6]  # the layers inside the step, longest first
            lines.append(f"   {title} {i}: {1e3 * t:.1f} ms (" + ", ".join(f"{k} {1e3 * v:.1f}" for k, v in top) + ")")
    lines.append("   stamps (s from launch): " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["stamps"].items(),
                                                                                          key=lambda kv: kv[1])))
    full = r.get("full_collections") or []
    if full:
        lines.append(f"   full collections: {len(full)} (thread, objects frozen, walked, collected, ms): " + ", ".join(
            f"({th}, {frozen}, {walked}, {got}, {ms:.0f})" for th, frozen, walked, got, ms in full[:20]))
    for title, key in (("make and first reset", "reset_timers"), ("loop", "loop_timers"), ("close", "close_timers"),
                       ("sub-env processes, all of them (make to close)", "subprocess_timers")):
        lines.append(f"   {title}: timer, calls, mean ms, p50 ms, total s")
        for k, v in sorted(r[key].items(), key=lambda kv: -sum(kv[1])):
            lines.append(f"     {k:40s} {len(v):5d} {1e3 * statistics.mean(v):9.2f} {1e3 * statistics.median(v):9.2f} "
                         f"{sum(v):8.2f}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--episode-steps", type=int, default=50)
    p.add_argument("--render", default="gpu")
    p.add_argument("--variants", default="default,per_process_1,no_video,sync")
    p.add_argument("--json", default=None)
    p.add_argument("--light", action="store_true", help="no timers around the layers or the collections (their "
                   "cost, ~60 ms a reset step, left out): the steps' own times only; a reset step is every "
                   "--episode-steps-th")
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as work:
        for n, v in enumerate(args.variants.split(",")):
            a = dict(env_id="PickCube-v1", num_envs=args.num_envs, size=args.size, render=args.render,
                     episode_steps=args.episode_steps, steps=args.steps, obs_horizon=2, variant=v, light=args.light,
                     out=os.path.join(work, f"{n}_{v}"), json=os.path.join(work, f"{n}_{v}.json"),
                     timeline=os.path.join(work, f"{n}_{v}.timeline.json"), t0=time.time())
            t0 = time.perf_counter()
            subdir = os.path.join(work, f"{n}_{v}.sub")
            os.makedirs(subdir)
            env = {**os.environ, "FASTRECORD_TIMELINE": a["timeline"], "PROFILE_SUBDIR": subdir}
            proc = subprocess.run([sys.executable, "-m", "benchmarks.profile_eval", "--child", json.dumps(a)], env=env)
            if proc.returncode != 0:
                print(f"== {v}: exit {proc.returncode} after {time.perf_counter() - t0:.1f} s", flush=True)
                continue
            with open(a["json"]) as f:
                r = json.load(f)
            r["whole"] = time.perf_counter() - t0
            results.append(r)
            print(report(r, args.num_envs) + f"\n   whole process {r['whole']:.1f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        from fastrecord.system import use_lavapipe_if_no_gpu

        use_lavapipe_if_no_gpu()
        child(json.loads(sys.argv[2]))
    else:
        main()
