"""Where the start-up of N CPU-simulated envs goes (issue 27): one env in one process (imports, make, reset,
first render, first step) beside N env processes forked from fastrecord's forkserver (its preload, then the
N envs made and reset at once), with the sub-envs' render backend as given and with none.

    PYTHONPATH=src python -m benchmarks.probe_startup --num-envs 16 --size 512 --render gpu
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def _kwargs(render: str, size: int) -> dict[str, Any]:
    kw: dict[str, Any] = dict(obs_mode="state", sim_backend="physx_cpu", render_backend=render)
    if render != "none":
        kw.update(render_mode="rgb_array", human_render_camera_configs=dict(width=size, height=size))
    return kw


def _noop() -> None:
    pass


def _child(kw: dict[str, Any], q: Any) -> None:
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401

    t0 = time.time()
    env = gym.make("PickCube-v1", **kw)
    t1 = time.time()
    env.reset(seed=0)
    q.put((t0, t1, time.time()))
    env.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-envs", type=int, default=16)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--render", default="gpu")
    a = p.parse_args()
    res: dict[str, Any] = {}
    t0 = time.time()
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    import torch  # noqa: F401

    from fastrecord.system import use_lavapipe_if_no_gpu

    use_lavapipe_if_no_gpu()
    t1 = time.time()
    env = gym.make("PickCube-v1", **_kwargs(a.render, a.size))
    t2 = time.time()
    env.reset(seed=0)
    t3 = time.time()
    env.render()
    t4 = time.time()
    env.step(env.action_space.sample())
    t5 = time.time()
    env.close()
    res["one_env"] = dict(imports=t1 - t0, make=t2 - t1, reset=t3 - t2, first_render=t4 - t3, first_step=t5 - t4)
    from fastrecord.workers import forkserver_context, start_forkserver

    ctx = forkserver_context()
    s0 = time.time()
    start_forkserver()
    proc = ctx.Process(target=_noop)
    proc.start()
    proc.join()
    res["forkserver_preload_and_first_fork"] = time.time() - s0
    for render in (a.render, "none"):
        q = ctx.Queue()
        w0 = time.time()
        procs = [ctx.Process(target=_child, args=(_kwargs(render, a.size), q)) for _ in range(a.num_envs)]
        for pr in procs:
            pr.start()
        started = time.time() - w0
        got = [q.get() for _ in procs]
        w1 = time.time()
        for pr in procs:
            pr.join()
        res[f"{a.num_envs}_envs_render_{render}"] = dict(
            all_made_and_reset=w1 - w0, processes_started=started,
            make_median=sorted(g[1] - g[0] for g in got)[len(got) // 2],
            make_max=max(g[1] - g[0] for g in got), reset_max=max(g[2] - g[1] for g in got),
            first_make_start=min(g[0] for g in got) - w0, last_make_start=max(g[0] for g in got) - w0,
            joined=time.time() - w1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
