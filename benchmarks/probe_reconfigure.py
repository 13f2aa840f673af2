"""What a CPU sub-env's reconfiguring reset spends (issue 27: the eval's steps where every env resets took 300-370 ms
against 16 ms, on the H100 machine, with 2 envs a sub-env process).

    python -m benchmarks.probe_reconfigure --resets 8 --variants gpu,gpu_small_camera,none --together 8x2

Each variant runs in a fresh process (imports frozen, as fastrecord's sub-env processes are): one PickCube-v1 env as
`make_eval_envs`' sub-envs make it (state observations, CPU physics, the render backend, a 512x512 human camera),
then ``resets`` resets with ``reconfigure=True``, with wall-clock timers around the parts of ManiSkill's
``_reconfigure`` (``_clear`` and its garbage collection, the scene, the agent, the task's scene, the lights, the
scene's setup, the sensors and human cameras) and the rest of the reset. Variants: ``gpu`` (the sub-envs' today),
``gpu_small_camera`` (the human camera 8x8: what its render targets cost), ``eval_like`` (the eval's sub-env itself:
its thunk, wrappers and pose reports), ``none`` (``render_backend="none"``: no
render system at all). ``--together PxE`` also runs P processes of E envs resetting at the same moment (a barrier),
as the sub-env processes do at a reset step, and prints each process's time for its E envs.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from typing import Any

PARTS = ["_clear", "_setup_scene", "_load_agent", "_load_scene", "_load_lighting", "_setup_sensors",
         "_initialize_episode", "_reconfigure", "reset", "get_obs"]


def _make(variant: str, size: int) -> Any:
    """One env of ``variant``; ``eval_like``: `make_eval_envs`' batched sub-env itself (its thunk: ManiSkill's
    ``CPUGymWrapper`` under `PoseReporter`, the process claimed), resetting without options as they do."""
    import gymnasium as gym

    if variant == "eval_like":
        from fastrecord.make_env import _CpuThunk

        kw = _kwargs("gpu", size)
        kw.pop("reconfiguration_freq")
        thunk = _CpuThunk("PickCube-v1", 0, kw, [], own_process=True, report_poses=True)
        thunk.made_in = -1  # as made in the caller: this process is the sub-env's
        return thunk()
    from fastrecord.workers import claim_process

    claim_process()
    return gym.make("PickCube-v1", **_kwargs(variant, size))


def _kwargs(variant: str, size: int) -> dict[str, Any]:
    backend = "none" if variant == "none" else "gpu"
    cam = 8 if variant == "gpu_small_camera" else size
    return dict(obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu", render_backend=backend,
                human_render_camera_configs=dict(width=cam, height=cam), control_mode="pd_joint_delta_pos",
                reconfiguration_freq=1)


def _timed(timers: dict[str, list[float]], cls: type) -> None:
    """Timers around ``cls``'s (the task's) methods of `PARTS`, whichever class of its MRO defines them."""
    import gc

    from mani_skill.envs.scene import ManiSkillScene

    for name in PARTS:
        orig = getattr(cls, name)

        def timed(*a: Any, _o: Any = orig, _k: str = name, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _o(*a, **k)
            finally:
                timers[_k].append(time.perf_counter() - t0)

        setattr(cls, name, timed)
    orig_setup = ManiSkillScene._setup

    def setup(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return orig_setup(*a, **k)
        finally:
            timers["scene._setup"].append(time.perf_counter() - t0)

    ManiSkillScene._setup = setup
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            timers[f"gc.gen{info['generation']}"].append(time.perf_counter() - started.pop())

    gc.callbacks.append(on_gc)


def _one(variant: str, size: int, resets: int) -> dict[str, Any]:
    import mani_skill.envs  # noqa: F401

    timers: dict[str, list[float]] = defaultdict(list)
    t0 = time.perf_counter()
    env = _make(variant, size)
    env.reset(seed=0)
    made = time.perf_counter() - t0
    _timed(timers, type(env.unwrapped))
    each = []
    for i in range(resets):
        t0 = time.perf_counter()
        env.reset(seed=i + 1, options=None if variant == "eval_like" else dict(reconfigure=True))
        each.append(time.perf_counter() - t0)
    env.close()
    return dict(variant=variant, made=made, resets=each, timers=dict(timers))


def _together_child(variant: str, size: int, envs: int, resets: int, barrier: Any, out: Any) -> None:
    import mani_skill.envs  # noqa: F401

    barrier.wait()
    t0 = time.perf_counter()
    made = [_make(variant, size) for _ in range(envs)]
    for e in made:
        e.reset(seed=0)
    times = [time.perf_counter() - t0]  # the make and first reset of this process's envs, all processes at once
    for i in range(resets):
        barrier.wait()
        t0 = time.perf_counter()
        for j, e in enumerate(made):
            e.reset(seed=100 * i + j, options=None if variant == "eval_like" else dict(reconfigure=True))
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    for e in made:
        e.close()
    times.append(time.perf_counter() - t0)
    out.put(times)


def _burn(nice: int) -> None:
    import os

    os.nice(nice)
    while True:  # what an encoder does to a core (at fastrecord's background niceness)
        sum(i * i for i in range(10000))


def together(variant: str, size: int, procs: int, envs: int, resets: int, busy: int = 0) -> list[list[float]]:
    import mani_skill.envs  # noqa: F401  - imported before the fork, as the forkserver's children have it

    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    ps = [ctx.Process(target=_together_child, args=(variant, size, envs, resets, barrier, out)) for _ in range(procs)]
    burners = [ctx.Process(target=_burn, args=(10,), daemon=True) for _ in range(busy)]
    for p in ps + burners:
        p.start()
    try:
        got = [out.get(timeout=300) for _ in ps]
    finally:
        for b in burners:
            b.kill()
    for p in ps:
        p.join(60)
    return got


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--resets", type=int, default=8)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--variants", default="gpu,gpu_small_camera,none")
    p.add_argument("--together", default="8x2", help="PxE: P processes of E envs resetting at once ('' to skip)")
    p.add_argument("--busy", type=int, default=0, help="processes keeping a core busy at niceness 10 during --together "
                   "(as the encoders do while the envs reset)")
    p.add_argument("--child", default=None)
    a = p.parse_args()
    if a.child:
        kind, variant = a.child.split(":")
        if kind == "one":
            print(json.dumps(_one(variant, a.size, a.resets)))
        else:
            procs, envs = map(int, a.together.split("x"))
            print(json.dumps(together(variant, a.size, procs, envs, a.resets, a.busy)))
        return
    for variant in a.variants.split(","):
        kinds = ["one"] + (["together"] if a.together else [])
        for kind in kinds:
            r = subprocess.run([sys.executable, "-m", "benchmarks.probe_reconfigure", "--child", f"{kind}:{variant}",
                                "--resets", str(a.resets), "--size", str(a.size), "--together", a.together or "1x1",
                                "--busy", str(a.busy)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                print(f"== {kind}:{variant} failed ({r.returncode}): {r.stderr[-2000:]}", flush=True)
                continue
            got = json.loads(r.stdout.strip().splitlines()[-1])
            if kind == "one":
                resets = got["resets"]
                print(f"== {variant}, one env: make+reset {got['made']:.2f} s; reconfiguring reset p50 "
                      f"{1e3 * statistics.median(resets):.0f} ms, mean {1e3 * statistics.mean(resets):.0f} ms")
                for k, v in sorted(got["timers"].items(), key=lambda kv: -sum(kv[1])):
                    print(f"     {k:22s} {len(v):4d} calls  mean {1e3 * statistics.mean(v):7.1f} ms  "
                          f"p50 {1e3 * statistics.median(v):7.1f} ms")
            else:
                flat = [t for proc in got for t in proc[2:-1]]  # make, the first reset (warm-up) and close left out
                makes, closes = [proc[0] for proc in got], [proc[-1] for proc in got]
                print(f"== {variant}, {a.together} together, {a.busy} busy at nice 10: a process's resets of its envs p50 "
                      f"{1e3 * statistics.median(flat):.0f} ms, mean {1e3 * statistics.mean(flat):.0f} ms, max "
                      f"{1e3 * max(flat):.0f} ms; make + first reset max {max(makes):.2f} s, close max "
                      f"{1e3 * max(closes):.0f} ms", flush=True)


if __name__ == "__main__":
    main()
