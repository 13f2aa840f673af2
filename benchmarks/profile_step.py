"""Profile fastrecord's work on the stepping thread: where each millisecond of `EpisodeRecorder.on_step` goes.

    python benchmarks/profile_step.py --num-envs 128 --size 512                 # batched source, render = one gather
    python benchmarks/profile_step.py --num-envs 128 --size 512 --gap-ms 20     # idle gaps between steps (as a sim)
    python benchmarks/profile_step.py --num-envs 128 --size 512 --busy 16       # 16 busy processes (as encoders)
    python benchmarks/profile_step.py --real-env PickCube-v1 --size 512         # one real env (GPU render on CUDA)
    python benchmarks/profile_step.py --num-envs 128 --size 128 --trajectory --obs-mode rgb   # image observations

The batched source is `fastrecord.testing.BatchedDoubleEnv` replaying a clip bank, as in `fastrecord bench`
(render is one gather on the device, its time summed in ``busy_seconds``).

Prints the host time of `on_step` (p50 and mean) split into its parts (render, collect, leaves, buffer
write, rest), then the torch.profiler ops (CPU- and CUDA-runtime-side) that ran *inside* on_step only,
by self CPU time: kernel launches, synchronizations, copies.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

import numpy as np
import torch

from fastrecord import RecordEpisode
from fastrecord.testing import BatchedDoubleEnv, gradient_clips

LABEL = "fastrecord.on_step"


def _spin(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


class Timers:
    """Wraps methods with wall-clock timers (time spent in each, per call)."""

    def __init__(self) -> None:
        self.t: dict[str, list[float]] = defaultdict(list)
        self._undo: list[tuple[Any, str, Any]] = []

    def wrap(self, owner: Any, name: str, key: str) -> None:
        orig = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return orig(*a, **k)
            finally:
                self.t[key].append(time.perf_counter() - t0)

        setattr(owner, name, timed)
        self._undo.append((owner, name, orig))

    def clear(self) -> None:
        self.t.clear()

    def restore(self) -> None:
        for owner, name, orig in reversed(self._undo):
            setattr(owner, name, orig)


def _inside(prof: Any, label: str, top: int = 25) -> tuple[list[tuple[str, float, int]], float]:
    """Self CPU time (us) of every op that ran under ``label`` ranges, by op name (the ``top`` ones), and the
    ops (calls) per range in all."""
    agg: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])

    def walk(ev: Any) -> None:
        for ch in ev.cpu_children:
            a = agg[ch.name]
            a[0] += ch.self_cpu_time_total
            a[1] += 1
            walk(ch)

    n = 0
    for ev in prof.events():
        if ev.name == label:
            n += 1
            walk(ev)
    rows = sorted(((k, v[0] / max(1, n), int(v[1] / max(1, n))) for k, v in agg.items()), key=lambda r: -r[1])
    return rows[:top], sum(v[1] for v in agg.values()) / max(1, n)


def make_env(args: argparse.Namespace, device: str) -> Any:
    """A real ManiSkill env, or the batched double replaying a small gradient clip bank (episodes never end)."""
    if args.real_env:
        import gymnasium as gym
        import mani_skill.envs  # noqa: F401

        render = "gpu" if device == "cuda" else "cpu"
        base = gym.make(args.real_env, num_envs=1, obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                        render_backend=render, human_render_camera_configs=dict(width=args.size, height=args.size))
        return base
    bank = gradient_clips(clips=4, frames=16, height=args.size, width=args.size)
    return BatchedDoubleEnv(
        num_envs=args.num_envs, max_episode_steps=10**6, device=device, bank=bank, obs_mode=args.obs_mode
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-envs", type=int, default=128)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--trajectory", action="store_true", help="also record obs/states/rewards")
    p.add_argument("--obs-mode", default="state", choices=("state", "rgb"),
                   help="the batched source's observations: a state vector, or ManiSkill's rgb dict (state leaves + a "
                        "--size camera image; recorded with --trajectory)")
    p.add_argument("--gap-ms", type=float, default=0.0, help="sleep between steps (an idle host, as during a sim step)")
    p.add_argument("--busy", type=int, default=0, help="processes spinning on the CPU meanwhile (as encoders)")
    p.add_argument("--real-env", default=None, help="profile around a real ManiSkill env (one env) instead")
    p.add_argument(
        "--sync", action="store_true", help="drain the GPU before each step (is on_step waiting for earlier GPU work?)"
    )
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = make_env(args, device)
    stop = mp.Event()
    spinners = [mp.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.busy)]
    for s in spinners:
        s.start()
    timers = Timers()
    with tempfile.TemporaryDirectory() as out:
        env = RecordEpisode(base, out, save_trajectory=args.trajectory, buffer_capacity=args.steps + 100,
                            max_steps_per_video=None)
        env.reset(seed=0)
        rec = env.recorder
        timers.wrap(rec.view, "render", "render")
        timers.wrap(rec, "_collect", "collect (incl. render)")
        timers.wrap(rec, "_leaves", "leaves")
        timers.wrap(rec.buffer, "step", "buffer.step")
        timers.wrap(rec, "on_step", "on_step")
        orig_on_step = rec.on_step

        def labelled(*a: Any, **k: Any) -> Any:
            n = len(timers.t["render"])
            with torch.profiler.record_function(LABEL):
                out = orig_on_step(*a, **k)
            timers.t["render in on_step"].append(sum(timers.t["render"][n:]))
            return out

        rec.on_step = labelled
        space = env.action_space
        if args.real_env:
            space.seed(0)
        a = torch.zeros(args.num_envs, 3, device=device) if not args.real_env else None

        def run(n: int) -> None:
            for _ in range(n):
                act = space.sample() if args.real_env else a
                if args.gap_ms:
                    time.sleep(args.gap_ms / 1000)
                if args.sync and device == "cuda":
                    torch.cuda.synchronize()
                _, _, te, tr, _ = env.step(act)
                if (
                    args.real_env and bool(torch.as_tensor(te | tr).any())
                ) or rec.buffer.cursor.max() >= args.steps + 90:
                    env.reset()

        run(20)
        if device == "cuda":
            torch.cuda.synchronize()
        timers.clear()
        t0 = time.perf_counter()
        run(args.steps)
        if device == "cuda":
            torch.cuda.synchronize()
        wall = (time.perf_counter() - t0) / args.steps
        what = args.real_env or f"{args.num_envs} envs, bank render"
        print(
            f"== {what}, {args.size}x{args.size}, obs {args.obs_mode}, trajectory={args.trajectory}, gap {args.gap_ms} ms, sync {args.sync}, "
            f"{args.busy} busy processes, {device}; loop {1000 * wall:.3f} ms/step"
        )
        t = timers.t
        on = t["on_step"]
        render = float(np.mean(t["render in on_step"])) if t["render in on_step"] else 0.0
        print(f"on_step p50 {1000 * statistics.median(on):.3f} ms, mean {1000 * np.mean(on):.3f} ms "
              f"(mean excl. render {1000 * (np.mean(on) - render):.3f} ms)")
        for k in ("render in on_step", "collect (incl. render)", "leaves", "buffer.step"):
            if t[k]:
                print(
                    f"  {k:24s} p50 {1000 * statistics.median(t[k]):.3f} ms, p90 {1000 * np.percentile(t[k], 90):.3f} ms, "
                    f"max {1000 * max(t[k]):.3f} ms, mean {1000 * sum(t[k]) / len(on):.3f} ms/step"
                )
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts) as prof:
            run(50)
            if device == "cuda":
                torch.cuda.synchronize()
        rows, calls_per_step = _inside(prof, LABEL)
        print(
            f"ops inside on_step, self CPU us per step (calls per step), profiler on; {calls_per_step:.1f} calls a step in all:"
        )
        for name, us, calls in rows:
            print(f"  {us:9.1f} us  x{calls:<3d} {name}")
        if device == "cuda":
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12))
        timers.restore()
        if not args.real_env:
            rec.buffer.cursor[:] = -1  # nothing to write at close
        env.close()
    stop.set()
    for s in spinners:
        s.join(timeout=5)


if __name__ == "__main__":
    main()
