"""Sharded runs: one run recorded by several processes (torchrun ranks, or replay workers), joined into
one ManiSkill dataset.

The contract (stable: `fastrecord record` under torchrun, ``make_eval_envs`` and ``fastrecord replay
--workers`` build on it):

- **Who am I.** `rank_info()`: rank, world size, local rank and local world size, from
  ``torch.distributed`` when it is initialised, else torchrun's environment variables (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``), else a single process (0 of 1).
- **Global episodes.** A sharded run records ``total`` global episodes ``g = 0 .. total-1``. Episode
  ``g`` is reset with seed ``base_seed + g`` (`episode_seed`) and belongs to rank ``g % world_size``
  (`owner`; `episodes_of` lists a rank's share in increasing ``g``). Round robin rather than blocks:
  each rank gets ``total // world_size`` or one more, and a run extended with more episodes keeps the
  owners of the episodes it has. Merged episode ids are ``g``, so the joined dataset does not depend on
  the world size nor on timing (given a policy that is a function of the observation, or is seeded per
  episode, as `SeededRandomPolicy`). Replay worker processes (``fastrecord replay --workers``, on one host)
  hand the episodes out instead as their envs free up (one shared counter): ``g`` is in the shard of the
  worker that took it (its ``source_rank``), and the join, which reads every shard's tags, is the same.
- **Where shards go.** In the run directory ``DIR`` of a run named ``NAME``, rank ``r`` records a normal
  fastrecord run named ``NAME`` in ``DIR/NAME.shards/rank{r:05d}/`` (`shard_dir`): its own crash-safe
  ``NAME.h5`` + ``NAME.json`` (parts while recording), its lock, manifest, results file and videos
  (video names carry the shard's own episode ids; the JSON entries map them to ``g``; the join links them
  next to ``DIR/NAME.h5``, named by ``g``: `fastrecord.shards.videos`).
- **Tagging episodes.** The process that records a shard tells its recorder which global episode each
  env slot is running: ``recorder.set_episode_meta(env_idx, [episode_meta(g, rank), ...])`` right after
  the reset that starts those episodes (None for a slot that runs no scheduled episode: its episode is
  neither written nor counted). Every JSON entry and results row of the shard then carries
  ``global_index`` and ``source_rank``; ``episode_seed`` (and ``reset_kwargs["seed"]``) is the seed.
  `EpisodeSchedule` hands episodes to env slots and builds those lists.
- **Joining.** `merge(DIR, NAME)` builds ``DIR/NAME.h5`` (a copy of every episode as ``traj_{g}``: one
  self-contained file that can be copied alone) and ``DIR/NAME.json`` (the shards' header, which must
  agree, and the episodes sorted by ``g`` with ``episode_id = g``, ``global_index``, ``source_rank``,
  ``shard_episode_id``), and each joined episode's videos next to them, named by ``g`` (hard links of the
  shards' files, `join_videos`). It is idempotent and changes no shard (they are kept); ``links=True``
  writes an index of external links into the shard files instead (no copy; it opens only next to
  ``NAME.shards/``). Shards with a LeRobot dataset (``lerobot=True``) are joined into ``DIR/NAME.lerobot``
  the same way (`fastrecord.sinks.lerobot.join`: episodes ordered by ``g``, renumbered 0..N-1, videos
  not re-encoded), also when they hold no trajectory. It reports, rather than fails on, missing global
  episodes, episodes the keep filter dropped, duplicates, and shards still recording or left by a crash
  (`MergeReport`).
- **The run manifest.** ``DIR/NAME.fastrecord.json`` (a `fastrecord.sinks.RunDirectory` manifest) holds
  the arguments under ``options`` and the sharding under ``options["sharding"]``: ``world_size``,
  ``base_seed``, ``total``, ``rule``; ``fastrecord`` is the version. `DistributedRun.open` writes it (rank 0).
- **Communication** (`DistributedRun`): once at the start (rank 0 applies ``if_exists`` to the run
  directory, every rank opens its shard, the ranks exchange which global episodes are already on disk)
  and once at the end (summaries; rank 0 merges). Never per step.

Resuming: re-running the same command (``if_exists="resume"``) skips every global episode some shard
has committed (`committed_global_indices`); a rank killed with SIGKILL leaves its complete parts, which
its shard's resume recovers.

The modules: `layout` (ranks, the episode rule, shard paths, what a shard has committed), `schedule`
(`EpisodeSchedule`, `record_schedule`, `SeededRandomPolicy`), `join` (`merge`, `MergeReport`), `videos`
(`join_videos`: the joined episodes' videos next to ``NAME.h5``) and `distributed` (`DistributedRun`,
`ShardedResets`, `rank_backends`). Every public name is here too.
"""

from __future__ import annotations

from fastrecord.shards.distributed import DistributedRun, ShardedResets, rank_backends
from fastrecord.shards.join import MergeReport, NothingToMerge, lock_held, merge, ranges_text
from fastrecord.shards.layout import (
    RULE,
    SHARDS_SUFFIX,
    RankInfo,
    committed_global_indices,
    default_workers,
    episode_meta,
    episode_seed,
    episodes_of,
    global_index_of,
    list_shards,
    owner,
    rank_info,
    results_rows,
    shard_dir,
    sharding_options,
    shards_root,
)
from fastrecord.shards.schedule import (
    EpisodeSchedule,
    SeededRandomPolicy,
    check_resume,
    record_schedule,
    single_schedule,
)

__all__ = [
    "RULE",
    "SHARDS_SUFFIX",
    "DistributedRun",
    "EpisodeSchedule",
    "MergeReport",
    "NothingToMerge",
    "RankInfo",
    "SeededRandomPolicy",
    "ShardedResets",
    "check_resume",
    "committed_global_indices",
    "default_workers",
    "episode_meta",
    "episode_seed",
    "episodes_of",
    "global_index_of",
    "list_shards",
    "lock_held",
    "merge",
    "owner",
    "rank_backends",
    "rank_info",
    "ranges_text",
    "record_schedule",
    "results_rows",
    "shard_dir",
    "sharding_options",
    "shards_root",
    "single_schedule",
]
