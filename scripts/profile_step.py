"""Profile fastrecord's per-step work on the stepping thread (no simulation, a free render).

    python scripts/profile_step.py --num-envs 128 --size 512      # on a CUDA machine
Prints the mean wall time of `EpisodeRecorder.on_step` and torch.profiler's CPU-side table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from doubles import BatchedDoubleEnv  # noqa: E402

from fastrecord import RecordEpisode  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--num-envs", type=int, default=128)
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--trajectory", action="store_true", help="also record obs/states/rewards")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = BatchedDoubleEnv(num_envs=args.num_envs, max_episode_steps=10**6, size=args.size, device=device)
    frame = base.render()
    base.render = lambda: frame  # free render: the recorder alone
    with tempfile.TemporaryDirectory() as out:
        env = RecordEpisode(base, out, save_trajectory=args.trajectory, buffer_capacity=args.steps + 100)
        env.reset(seed=0)
        rec = env.recorder
        a = torch.zeros(args.num_envs, 3, device=device)
        obs, r, te, tr, info = base.step(a)
        for _ in range(20):
            rec.on_step(a, obs, r, te, tr, info)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            rec.on_step(a, obs, r, te, tr, info)
        host = (time.perf_counter() - t0) / args.steps
        if device == "cuda":
            torch.cuda.synchronize()
        total = (time.perf_counter() - t0) / args.steps
        print(f"on_step: {1000 * host:.3f} ms/step on the host thread, {1000 * total:.3f} ms/step incl. GPU drain "
              f"({args.num_envs} envs x {args.size}x{args.size}, trajectory={args.trajectory})")
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(50):
                rec.on_step(a, obs, r, te, tr, info)
        print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
        rec.buffer.cursor[:] = -1  # nothing to write at close
        env.close()


if __name__ == "__main__":
    main()
