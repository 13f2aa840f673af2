"""A sharded recording of the batched test double, run by tests/test_shards.py under torchrun (or alone).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/shard_worker.py OUT TOTAL NUM_ENVS

Each rank records its global episodes (g % world_size) in NUM_ENVS parallel envs of `BatchedDoubleEnv`
whose episode lengths depend on the seed (envs end at different steps, slots are reused), with the
per-episode seeded random policy; rank 0 merges. Prints one JSON line per rank: its summary.
"""

from __future__ import annotations

import json
import sys

import numpy as np


def main() -> None:
    out, total, num_envs = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    from fastrecord import RecordEpisode
    from fastrecord.shards import DistributedRun, SeededRandomPolicy, record_schedule
    from fastrecord.testing import BatchedDoubleEnv

    run = DistributedRun(out, "double", total=total, base_seed=1000, if_exists="error",
                         options={"worker": "tests/shard_worker.py"}).open()
    base = BatchedDoubleEnv(num_envs=num_envs, max_episode_steps=9, size=16,
                            episode_lengths=lambda env_idx, seed: 2 + seed % 7,
                            success_step=[4] * num_envs)
    env = RecordEpisode(base, run.shard_dir, trajectory_name="double", if_exists=run.shard_if_exists,
                        video_fps=10, video_workers=1)
    schedule = run.plan(env.recorder, num_envs)
    act = SeededRandomPolicy(base.single_action_space, num_envs)
    steps = record_schedule(env, env.recorder, schedule, act)
    env.close()
    ranks, report = run.finish({"finished": sorted(schedule.finished), "steps": steps})
    run.close()
    print(json.dumps({"rank": run.rank, "world_size": run.world_size, "finished": sorted(schedule.finished),
                      "ranks": ranks if report is not None else None,
                      "missing": report.missing if report is not None else None}), flush=True)


if __name__ == "__main__":
    np.set_printoptions(precision=3)
    main()
