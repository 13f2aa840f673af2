"""Does a sub-env's own render system cost start-up, and where does a rendering process's exit go? (issue 27)

16 sub-envs made together took 4.4 s each against 1.7 s alone on the H200 machine. This makes PickCube-v1
(state obs, CPU physics) with ``render_backend`` gpu (today's sub-envs) and none (no render system), alone
and 16 together in fresh processes forked from a preloaded forkserver (make, reset and 10 steps, close);
with ``--exit-envs N``, a fresh process holding N envs that each rendered once times its exit after their
close: Python's own exit, ``os._exit``, and ``os._exit`` holding a 16-env record's two pinned staging arenas.

    python -m benchmarks.probe_subenv_render --backends gpu,none,gpu,none --num 16 --exit-envs 16 --json probe.json

On the CPU machine: ``--backends cpu,none --num 2 --exit-envs 2``. Figures: docs/performance.md ("three ideas
measured before building them"): render_backend none is slower (16 together 7.3 s against 4.0 s).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time


def make_one(backend: str, t_sent: float, q: mp.Queue) -> None:
    q.put(_make_one(backend, t_sent))


def _make_one(backend: str, t_sent: float) -> dict:
    t0 = time.time()
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401

    t1 = time.time()
    env = gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                   render_backend=backend, human_render_camera_configs=dict(width=512, height=512))
    t2 = time.time()
    env.reset(seed=0)
    for _ in range(10):
        env.step(env.action_space.sample())
    t3 = time.time()
    env.close()
    t4 = time.time()
    return dict(wait=t0 - t_sent, imports=t1 - t0, make=t2 - t1, reset_10_steps=t3 - t2, close=t4 - t3,
                done=t3 - t_sent)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backends", default="gpu,none")
    p.add_argument("--num", type=int, default=16)
    p.add_argument("--json")
    p.add_argument("--exit-envs", type=int, default=0, help="also time the exit of a process holding this many envs")
    a = p.parse_args()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "sapien", "gymnasium", "mani_skill.envs"])
    out: dict = {}
    q = ctx.Queue()
    warm = ctx.Process(target=time.sleep, args=(0.01,))  # the forkserver started and preloaded, not timed
    warm.start()
    warm.join()
    for b in a.backends.split(","):
        for n in (1, a.num):  # fresh processes forked from the preloaded server, as AsyncVectorEnv's
            t = time.time()
            procs = [ctx.Process(target=make_one, args=(b, t, q)) for _ in range(n)]
            for pr in procs:
                pr.start()
            rs = [q.get() for _ in range(n)]
            wall = time.time() - t
            for pr in procs:
                pr.join()
            key = f"{b} x{n}"
            out[key] = dict(wall=round(wall, 2), make_mean=round(sum(r["make"] for r in rs) / n, 2),
                            make_max=round(max(r["make"] for r in rs), 2),
                            reset_steps_mean=round(sum(r["reset_10_steps"] for r in rs) / n, 3),
                            close_mean=round(sum(r["close"] for r in rs) / n, 3))
            print(key, out[key], flush=True)
    if a.exit_envs:
        out["exit"] = exit_probe(a.exit_envs, a.backends.split(",")[0])
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)



EXIT_CHILD = r"""
import os, sys, time, gc
import torch, gymnasium as gym, mani_skill.envs
n, backend, how = int(sys.argv[1]), sys.argv[2], sys.argv[3]
envs = [gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                 render_backend=backend, human_render_camera_configs=dict(width=512, height=512)) for _ in range(n)]
for e in envs:
    e.reset(seed=0)
    e.render()
if how.endswith("pinned"):  # a record's two staging arenas at 16 envs x 51 frames of 512x512 yuv420p
    arenas = [torch.empty(321 << 20, dtype=torch.uint8).pin_memory() for _ in range(2)]
collect = gc.collect
gc.collect = lambda *a, **k: 0
t = time.time()
for e in envs:
    e.close()
gc.collect = collect
print(f"CLOSED {time.time() - t:.3f} {time.time():.6f}", flush=True)
if how.startswith("os_exit"):
    sys.stdout.flush()
    os._exit(0)
"""


def exit_probe(n: int, backend: str) -> dict:
    """Seconds from the envs' close to the process's end: a normal interpreter exit against ``os._exit``."""
    import subprocess
    import sys

    out = {}
    for how in ("normal", "os_exit", "os_exit_pinned", "normal", "os_exit", "os_exit_pinned"):
        r = subprocess.run([sys.executable, "-c", EXIT_CHILD, str(n), backend, how], capture_output=True, text=True)
        end = time.time()
        line = next((x for x in r.stdout.splitlines() if x.startswith("CLOSED")), None)
        if line is None:
            out[how] = f"failed: {r.stderr[-500:]}"
            continue
        _, close_s, stamp = line.split()
        out.setdefault(how, []).append(dict(close=float(close_s), exit=round(end - float(stamp), 3)))
        print("exit", how, out[how][-1], flush=True)
    return out


if __name__ == "__main__":
    main()
