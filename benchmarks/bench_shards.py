"""Sharded recording on one machine: world size 1 vs 2 ranks (torchrun, gloo over loopback) sharing the devices.

Each rank records its global episodes (``g % world_size``, `fastrecord.shards`) of the batched test double
(`fastrecord.testing.BatchedDoubleEnv`: frames from a clip bank on the rank's device, episode lengths
30-50 steps from the seed, partial resets) through `fastrecord.RecordEpisode` with video, into its shard;
rank 0 merges. The driver runs world size 1, then 2, on the same global episodes, and prints each run's
env-frames/s (wall time of the recording loops, the merge included) and their ratio, after checking that
the merged NAME.json holds episodes 0..N-1 once each:

    python benchmarks/bench_shards.py --episodes 512 --num-envs 64 --size 512          # H200 machine: cuda
    python benchmarks/bench_shards.py --episodes 16 --num-envs 4 --size 64 --device cpu  # a 2-core machine

On one GPU both ranks share it (cuda:0); the encoder processes per rank are the cores divided by the
ranks (the default). This measures the sharding's overhead and sharing, not a multi-GPU speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def rank_main(args: argparse.Namespace) -> None:
    import numpy as np
    import torch

    from fastrecord import RecordEpisode
    from fastrecord.shards import DistributedRun, SeededRandomPolicy, rank_info, record_schedule
    from fastrecord.testing import BatchedDoubleEnv

    info = rank_info()
    device = args.device
    if device == "cuda":
        device = f"cuda:{info.local_rank % torch.cuda.device_count()}"
    rng = np.random.default_rng(0)
    bank = rng.integers(0, 256, (4, 8, args.size, args.size, 3), dtype=np.uint8)  # 4 clips of 8 frames, looped
    run = DistributedRun(args.out, "shards", total=args.episodes, base_seed=0, if_exists="error",
                         options={"script": "benchmarks/bench_shards.py"}).open()
    base = BatchedDoubleEnv(num_envs=args.num_envs, max_episode_steps=60, device=device, bank=bank,
                            episode_lengths=lambda env_idx, seed: 30 + seed % 21)
    env = RecordEpisode(base, run.shard_dir, trajectory_name="shards", if_exists=run.shard_if_exists,
                        save_trajectory=True, video_fps=20)
    schedule = run.plan(env.recorder, args.num_envs)
    act = SeededRandomPolicy(base.single_action_space, args.num_envs)
    t0 = time.perf_counter()
    steps = record_schedule(env, env.recorder, schedule, act)
    env.close()
    loop = time.perf_counter() - t0
    frames = sum(int(r["length"]) + 1 for r in env.recorder.results.rows)  # a video holds the reset frame too
    ranks, report = run.finish({"frames": frames, "steps": steps, "seconds": loop})
    run.close()
    if info.rank == 0:
        print(json.dumps({"world_size": info.world_size, "ranks": ranks, "seconds_to_merged": time.perf_counter() - t0,
                          "missing": report.missing, "device": device}), flush=True)


def drive(args: argparse.Namespace) -> None:
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_shards_"))
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    rates = {}
    try:
        for world in (1, 2):
            out = work / f"world{world}"
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
                    __file__, "--rank-main", "--out", str(out), "--episodes", str(args.episodes),
                    "--num-envs", str(args.num_envs), "--size", str(args.size), "--device", args.device]
            r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout)
            if r.returncode != 0:
                sys.exit(f"world size {world} failed:\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}")
            res = json.loads([line for line in r.stdout.splitlines() if line.startswith("{")][-1])
            meta = json.loads((out / "shards.json").read_text())
            ids = [e["episode_id"] for e in meta["episodes"]]
            if ids != list(range(args.episodes)) or res["missing"]:
                sys.exit(f"world size {world}: merged episode ids {ids[:10]}..., missing {res['missing']}")
            frames = sum(x["frames"] for x in res["ranks"])
            rates[world] = frames / res["seconds_to_merged"]
            per_rank = ", ".join(f"rank {i}: {x['frames'] / x['seconds']:,.0f}" for i, x in enumerate(res["ranks"]))
            print(f"world size {world} ({res['device']}, {args.num_envs} envs x {args.size}x{args.size} a rank): "
                  f"{frames:,} frames of {args.episodes} episodes in {res['seconds_to_merged']:.1f} s to the merged "
                  f"file = {rates[world]:,.0f} env-frames/s (loops: {per_rank}); ids 0..{args.episodes - 1} once each",
                  flush=True)
        print(f"2 ranks / 1 rank: {rates[2] / rates[1]:.2f}x", flush=True)
    finally:
        if not args.work_dir:
            shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--episodes", type=int, default=512)
    p.add_argument("--num-envs", type=int, default=64, help="parallel envs of each rank")
    p.add_argument("--size", type=int, default=512, help="frame side")
    p.add_argument("--device", default="cuda", help="cuda (each rank: cuda:LOCAL_RANK modulo the GPUs) or cpu")
    p.add_argument("--timeout", type=float, default=500)
    p.add_argument("--work-dir")
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    rank_main(args) if args.rank_main else drive(args)


if __name__ == "__main__":
    main()
