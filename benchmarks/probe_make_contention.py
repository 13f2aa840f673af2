"""Where do 16 sub-env makes made together spend their 4 s, against 0.9 s alone? (issue 27, time to first step)

On the H200 machine one PickCube-v1 ``gym.make`` in a process forked from a preloaded forkserver took 0.9 s,
and 16 made together 3.9-4.2 s each (``probe_subenv_render``). This forks N processes from a preloaded
forkserver, as ``AsyncVectorEnv`` does, and in each times the render device's creation and ``gym.make`` +
reset apart, with the process's CPU seconds (all its threads) beside the wall seconds, its thread count, and
a cProfile of the make; the parent merges the profiles of each variant and prints the functions that gained
the most seconds from alone to together. Variants (``--variants``):

- ``alone``: one process, one env.
- ``together``: N processes, one env each (today's sub-envs).
- ``threads1``: N processes, each with ``torch.set_num_threads(1)`` before its make.
- ``packed``: N/4 processes of 4 envs made one after another (fewer render devices).
- ``fork``, ``fork_alone``: frozen, the processes forked from this one (torch, SAPIEN, ManiSkill imported and
  frozen here first) instead of from the forkserver: what forking sub-envs from the command's own process would
  cost, without the forkserver's preload (a fresh interpreter importing them again).
- ``frozen_none``, ``frozen_alone_none``: frozen, with ``render_backend="none"`` (no render system).
- ``frozen``, ``frozen_alone``, ``frozen_packed``: the same with ``gc.freeze()`` first, as fastrecord's own
  sub-env processes do (ManiSkill's ``gc.collect()`` at each make then skips the imported modules; a walk of
  them also writes to every page that holds one, a copy-on-write of the forkserver's heap). The minor page
  faults of the make are printed beside (``faults_k``).

    python -m benchmarks.probe_make_contention --num 16 --backend gpu --json probe.json

On the CPU machine: ``--num 2 --backend cpu``.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import multiprocessing as mp
import os
import pstats
import resource
import tempfile
import threading
import time


def child(variant: str, backend: str, envs_here: int, t_sent: float, prof_path: str, q: mp.Queue) -> None:
    try:
        q.put(_child(variant, backend, envs_here, t_sent, prof_path))
    except Exception as e:  # noqa: BLE001 - a probe reports what failed
        q.put(dict(error=repr(e)))


def _child(variant: str, backend: str, envs_here: int, t_sent: float, prof_path: str) -> dict:
    t0 = time.time()
    c0 = time.process_time()
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401
    import sapien
    import torch

    if variant == "threads1":
        torch.set_num_threads(1)
    if variant.startswith(("frozen", "fork")):
        import gc

        gc.freeze()  # as fastrecord's own sub-envs do (workers.freeze_imports): ManiSkill's gc.collect skips imports
    t1 = time.time()
    if variant.endswith("none"):
        backend = "none"
    else:
        dev = sapien.Device("cuda" if backend == "gpu" else "cpu")
        sapien.render.RenderSystem(dev)  # the process's Vulkan instance and device, which every env then shares
    t2 = time.time()
    c2 = time.process_time()
    f2 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    prof = cProfile.Profile()
    envs = []
    prof.enable()
    for _ in range(envs_here):
        envs.append(gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                             render_backend=backend, human_render_camera_configs=dict(width=512, height=512)))
    t3 = time.time()
    for e in envs:
        e.reset(seed=0)
    prof.disable()
    t4 = time.time()
    c4 = time.process_time()
    f4 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    prof.dump_stats(prof_path)
    threads = len(os.listdir("/proc/self/task"))
    for e in envs:
        e.close()
    return dict(wait=t0 - t_sent, imports=t1 - t0, device=t2 - t1, make=t3 - t2, reset=t4 - t3, done=t4 - t_sent,
                cpu_device=c2 - c0, cpu_make_reset=c4 - c2, wall_make_reset=t4 - t2, threads=threads, faults_k=(f4 - f2) / 1000,
                py_threads=threading.active_count())


def run_variant(ctx, variant: str, backend: str, num: int, tmp: str) -> dict:
    if variant.startswith("fork"):  # forked from this process (its imports done, frozen), not from the forkserver
        ctx = mp.get_context("fork")
    if "alone" in variant:
        layout = [1]
    elif variant.endswith("packed"):
        layout = [4] * max(1, num // 4)
    else:
        layout = [1] * num
    q = ctx.Queue()
    t = time.time()
    paths = [os.path.join(tmp, f"{variant}-{i}.prof") for i in range(len(layout))]
    procs = [ctx.Process(target=child, args=(variant, backend, k, t, p, q)) for k, p in zip(layout, paths)]
    for pr in procs:
        pr.start()
    rs = [q.get() for _ in procs]
    wall = time.time() - t
    for pr in procs:
        pr.join()
    errors = [r["error"] for r in rs if "error" in r]
    if errors:
        return dict(errors=errors)

    def mean(k: str) -> float:
        return round(sum(r[k] for r in rs) / len(rs), 3)

    out = dict(processes=len(layout), envs=sum(layout), wall=round(wall, 2),
               **{k: mean(k) for k in ("wait", "device", "make", "reset", "cpu_device", "cpu_make_reset",
                                       "wall_make_reset", "threads", "faults_k")},
               done_max=round(max(r["done"] for r in rs), 2))
    stats = pstats.Stats(paths[0])
    for p in paths[1:]:
        stats.add(p)
    out["_stats"] = stats
    out["_n"] = len(layout)
    return out


def top_gains(alone: dict, other: dict, k: int = 25) -> list[tuple[str, float, float]]:
    """The functions whose own seconds per process grew most from ``alone`` to ``other``."""

    def per_func(v: dict) -> dict[str, float]:
        st = v["_stats"].stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
        return {f"{os.path.basename(f)}:{ln}:{fn}": tt / v["_n"] for (f, ln, fn), (_, _, tt, _, _) in st.items()}

    a, b = per_func(alone), per_func(other)
    rows = [(name, a.get(name, 0.0), s) for name, s in b.items()]
    rows.sort(key=lambda r: r[2] - r[1], reverse=True)
    return [(n, round(x, 4), round(y, 4)) for n, x, y in rows[:k]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num", type=int, default=16)
    p.add_argument("--backend", default="gpu")
    p.add_argument("--variants", default="alone,together,frozen_alone,frozen,fork_alone,fork,packed,frozen_packed,frozen_alone_none,frozen_none,threads1,alone,together,frozen,fork")
    p.add_argument("--json")
    a = p.parse_args()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "sapien", "gymnasium", "mani_skill.envs"])
    if any(v.startswith("fork") for v in a.variants.split(",")):
        import gc

        import gymnasium  # noqa: F401
        import mani_skill.envs  # noqa: F401
        import sapien  # noqa: F401
        import torch  # noqa: F401

        gc.freeze()
    warm = ctx.Process(target=time.sleep, args=(0.01,))
    warm.start()
    warm.join()
    out: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for v in a.variants.split(","):
            r = run_variant(ctx, v, a.backend, a.num, tmp)
            out.setdefault(v, []).append(r)
            print(v, {k: x for k, x in r.items() if not k.startswith("_")}, flush=True)
        if "alone" in out and "together" in out and "_stats" in out["alone"][0]:
            for v in ("together", "frozen", "fork", "frozen_none", "threads1", "packed", "frozen_packed"):
                if v in out and "_stats" in out[v][0]:
                    print(f"-- own seconds a process, alone -> {v}: the 25 largest gains", flush=True)
                    for name, x, y in top_gains(out["alone"][0], out[v][0]):
                        print(f"   {x:8.4f} -> {y:8.4f}  {name}", flush=True)
            print("-- alone, by own seconds", flush=True)
            out["alone"][0]["_stats"].sort_stats("tottime").print_stats(20)
    for rs in out.values():
        for r in rs:
            r.pop("_stats", None)
            r.pop("_n", None)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
