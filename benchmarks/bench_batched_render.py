"""Issue 19: one batched render of CPU-simulated envs (`fastrecord.render`) vs rendering each env by itself.

Needs a CUDA device with Vulkan (the lent GPU machine). Every figure of one run comes from that run:

1. render: 16 mirrors of PickCube-v1 (512x512 human camera) in one ``RenderSystemGroup``. The floor is the
   group's own picture (``update_render`` + ``take_picture`` + ``get_picture_cuda``, nothing else);
   fastrecord's render adds the pose upload and the copy out of SAPIEN's buffer; "one by one" is each
   env's own ``render()`` in this process.
2. eval: `make_eval_envs`' CPU branch, 16 envs, every env's video with the info overlay, episodes of 50
   steps: the default (batched) vs ``batched_render=False`` (each sub-env renders itself, as before) vs
   ManiSkill's own step + render loop over the same vector env without recording.
3. record: ``fastrecord record PickCube-v1 --num-envs 16 --width 512 --height 512 --episodes 64`` as whole
   commands, default vs ``--batched-render off``.

    python benchmarks/bench_batched_render.py                  # all three
    python benchmarks/bench_batched_render.py --only render,eval --envs 8 --size 256
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

SRC = Path(__file__).resolve().parents[1] / "src"


def emit(**row) -> dict:
    print(json.dumps(row), flush=True)
    return row


def _kw(size: int, steps: int) -> dict:
    return dict(obs_mode="state", render_mode="rgb_array", render_backend="gpu", max_episode_steps=steps,
                human_render_camera_configs=dict(width=size, height=size))


def bench_render(n: int, size: int, reps: int) -> dict:
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    import torch

    from fastrecord.render.group import GroupRenderer
    from fastrecord.render.vector import mirror_kwargs

    t = time.perf_counter()
    envs = [gym.make("PickCube-v1", **mirror_kwargs(_kw(size, 50))) for _ in range(n)]
    for i, e in enumerate(envs):
        e.reset(seed=i)
    make_s = time.perf_counter() - t
    group = GroupRenderer(envs)
    group.set_poses_from_envs()
    group.render("render_camera")
    cg = group._camera_group("render_camera")

    def timed(fn) -> float:
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) / reps * 1e3

    def floor():
        group._group.update_render()
        cg.take_picture()
        cg.get_picture_cuda("Color").torch()

    def batched():
        group.set_poses_from_envs()
        group.render("render_camera")

    def one_by_one():
        for e in envs:
            e.render()

    floor_ms, batched_ms = timed(floor), timed(batched)
    host = dict(update_render=0.0, take_picture=0.0, get_picture_cuda=0.0, render_call=0.0)
    torch.cuda.synchronize()
    for _ in range(reps):  # where the host waits: each call's own time, no synchronize between them
        t0 = time.perf_counter()
        group._group.update_render()
        t1 = time.perf_counter()
        cg.take_picture()
        t2 = time.perf_counter()
        cg.get_picture_cuda("Color").torch()
        t3 = time.perf_counter()
        host["update_render"] += t1 - t0
        host["take_picture"] += t2 - t1
        host["get_picture_cuda"] += t3 - t2
    torch.cuda.synchronize()
    for _ in range(reps):
        t0 = time.perf_counter()
        group.render("render_camera")
        host["render_call"] += time.perf_counter() - t0
    torch.cuda.synchronize()
    host = {k: round(v / reps * 1e3, 2) for k, v in host.items()}
    t0 = time.perf_counter()
    for _ in range(reps):
        group.set_poses_from_envs()
    gather_ms = (time.perf_counter() - t0) / reps * 1e3
    single_ms = timed(one_by_one)
    for e in envs:
        e.close()
    return emit(
        phase="render",
        envs=n,
        size=size,
        make_s=round(make_s, 1),
        floor_ms=round(floor_ms, 2),
        floor_ms_per_camera=round(floor_ms / n, 3),
        batched_ms=round(batched_ms, 2),
        of_which_pose_gather_in_process_ms=round(gather_ms, 2),
        one_by_one_ms=round(single_ms, 2),
        batched_over_floor=round(batched_ms / floor_ms, 2),
        one_by_one_over_floor=round(single_ms / floor_ms, 2),
        host_ms=host,
    )


def _loop(envs, steps: int, episode: int) -> float:
    """ManiSkill's way: step, then every sub-env renders itself (one frame each, the recorder's work left
    out); every env resets after ``episode`` steps, as the evaluation's envs do."""
    envs.reset(seed=list(range(envs.num_envs)))
    t = time.perf_counter()
    for i in range(1, steps + 1):
        envs.step(envs.action_space.sample())
        envs.call("render")
        if i % episode == 0:
            envs.reset()
            envs.call("render")
    return time.perf_counter() - t


def bench_eval(n: int, size: int, steps: int, episode: int) -> list[dict]:
    from fastrecord import make_eval_envs
    from fastrecord.make_env import cpu_vector_env

    rows = []
    t = time.perf_counter()
    envs = cpu_vector_env("PickCube-v1", n, _kw(size, episode), [])
    make_s = time.perf_counter() - t
    loop = _loop(envs, steps, episode)
    envs.close()
    rows.append(emit(phase="eval", path="maniskill step+render, no recording", envs=n, make_s=round(make_s, 1),
                     env_steps_per_s=round(n * steps / loop, 1)))
    for label, batched in (("fastrecord default (batched)", None), ("fastrecord batched_render=False", False)):
        with tempfile.TemporaryDirectory() as d:
            t = time.perf_counter()
            envs = make_eval_envs("PickCube-v1", n, "physx_cpu", _kw(size, episode), dict(obs_horizon=1), video_dir=d,
                                  batched_render=batched)
            make_s = time.perf_counter() - t
            envs.reset(seed=0)
            t = time.perf_counter()
            for _ in range(steps):
                envs.step(envs.action_space.sample())
            loop = time.perf_counter() - t
            t = time.perf_counter()
            envs.close()
            close_s = time.perf_counter() - t
            videos = len(list(Path(d).rglob("*.mp4")))
        rows.append(emit(phase="eval", path=label, envs=n, make_s=round(make_s, 1), loop_s=round(loop, 2),
                         close_s=round(close_s, 2), videos=videos, env_steps_per_s=round(n * steps / loop, 1),
                         env_steps_per_s_with_close=round(n * steps / (loop + close_s), 1)))
    base = rows[0]["env_steps_per_s"]
    emit(
        phase="eval",
        summary=True,
        batched_over_maniskill=round(rows[1]["env_steps_per_s_with_close"] / base, 2),
        batched_over_per_process=round(
            rows[1]["env_steps_per_s_with_close"] / rows[2]["env_steps_per_s_with_close"], 2
        ),
    )
    return rows


def bench_record(n: int, size: int, episodes: int) -> list[dict]:
    rows = []
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for label, extra in (("default (batched)", []), ("--batched-render off", ["--batched-render", "off"])):
        with tempfile.TemporaryDirectory() as d:
            cmd = [
                sys.executable,
                "-m",
                "fastrecord",
                "record",
                "PickCube-v1",
                "--num-envs",
                str(n),
                "--width",
                str(size),
                "--height",
                str(size),
                "--episodes",
                str(episodes),
                "--output-dir",
                d,
                *extra,
            ]
            t = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True, env=env)
            wall = time.perf_counter() - t
        rate = re.findall(r"([\d.]+) env-steps/s", r.stdout)
        rows.append(emit(phase="record", path=label, rc=r.returncode, wall_s=round(wall, 1),
                         env_steps_per_s=float(rate[-1]) if rate else None,
                         tail=None if r.returncode == 0 else (r.stdout + r.stderr)[-600:]))
    if all(r["env_steps_per_s"] for r in rows):
        emit(
            phase="record",
            summary=True,
            steps_ratio=round(rows[0]["env_steps_per_s"] / rows[1]["env_steps_per_s"], 2),
            wall_ratio=round(rows[1]["wall_s"] / rows[0]["wall_s"], 2),
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", default="render,eval,record")
    p.add_argument("--envs", type=int, default=16)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--steps", type=int, default=200, help="eval: parallel steps timed (4 episodes of 50)")
    p.add_argument("--episode", type=int, default=50, help="eval: steps an episode")
    p.add_argument("--episodes", type=int, default=64, help="record: episodes of the command")
    a = p.parse_args()
    only = set(a.only.split(","))
    if "render" in only:
        bench_render(a.envs, a.size, a.reps)
    if "eval" in only:
        bench_eval(a.envs, a.size, a.steps, a.episode)
    if "record" in only:
        bench_record(a.envs, a.size, a.episodes)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
