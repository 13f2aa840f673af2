"""One process's part in a sharded run: `DistributedRun` (the process group, rank 0's claim on the run
directory, the exchanges at the start and the end), `ShardedResets` (a rank's schedule applied to resets
an evaluation loop drives) and `rank_backends` (each rank's own GPU).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from fastrecord.render.device import CUDA_NAMES
from fastrecord.shards.join import MergeReport, NothingToMerge, merge
from fastrecord.shards.layout import (
    RankInfo,
    committed_global_indices,
    episodes_of,
    list_shards,
    rank_info,
    shard_dir,
    sharding_options,
    shards_root,
)
from fastrecord.shards.schedule import EpisodeSchedule

if TYPE_CHECKING:
    from fastrecord.sinks.base import RunDirectory


class DistributedRun:
    """Owns: this process's part in a sharded run: the gloo process group (created when torchrun
    launched the process and none exists; destroyed by `close` only then), rank 0's claim on the run
    directory (`fastrecord.sinks.RunDirectory` of ``NAME``: lock, ``if_exists``, the manifest with
    ``options["sharding"]``), and the two exchanges between the ranks: `plan` at the start and `finish`
    at the end. A single process (world size 1, no torchrun) needs no process group.

    Usage (what ``fastrecord record`` does under torchrun)::

        run = DistributedRun("out", "trajectory", total=100, base_seed=0, if_exists="error", options=args).open()
        env = RecordEpisode(make_env(), run.shard_dir, trajectory_name="trajectory", if_exists=run.shard_if_exists)
        schedule = run.plan(env.recorder, num_envs)          # the rank's global episodes not yet on disk
        ... reset slots with schedule.seeds, env.recorder.set_episode_meta(slots, schedule.assign(slots)) ...
        env.close()
        summaries, report = run.finish({"episodes": n})      # report: rank 0's MergeReport, None elsewhere
        run.close()
    """

    def __init__(
        self,
        output_dir: str | Path,
        name: str | None,
        *,
        total: int,
        base_seed: int,
        if_exists: str = "error",
        options: dict[str, Any] | None = None,
        timeout_s: float = 24 * 3600.0,
    ) -> None:
        from fastrecord.options import IF_EXISTS

        if if_exists not in IF_EXISTS:
            raise ValueError(f"if_exists={if_exists!r} is unknown; use one of {IF_EXISTS}")
        if isinstance(total, bool) or not isinstance(total, int) or total < 1:
            raise ValueError(f"total={total!r} must be an integer >= 1 (the number of global episodes)")
        if name is not None and (not name or any(c in name for c in "/\\\0")):
            raise ValueError(f"name={name!r} must be a plain file name (the run's trajectory_name), e.g. 'trajectory', "
                             f"or None (rank 0 picks a unique timestamp and tells the others)")
        self.output_dir = Path(output_dir)
        self.name = name
        self.total = total
        self.base_seed = int(base_seed)
        self.if_exists = if_exists
        self.options = dict(options or {})
        self.timeout_s = timeout_s
        self.info: RankInfo | None = None
        self.run: RunDirectory | None = None  # rank 0: the RunDirectory of the joined run
        self._own_group = False
        self._closed = False

    # -------------------------------------------------------------- collectives (no-ops for one process)
    def _group(self) -> bool:
        import torch.distributed as dist

        return dist.is_available() and dist.is_initialized()

    def _gather(self, obj: Any) -> list[Any]:
        if not self._group():
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out

    def _broadcast(self, obj: Any) -> Any:
        if not self._group():
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    # -------------------------------------------------------------- start
    def open(self) -> DistributedRun:
        """Join the process group (gloo, torchrun's environment), then rank 0 claims the run directory
        and applies ``if_exists``; its verdict reaches every rank (an error is raised on all of them)."""
        info = rank_info()
        if info.world_size > 1:
            import datetime

            import torch.distributed as dist

            if not dist.is_initialized():
                if not all(k in os.environ for k in ("MASTER_ADDR", "MASTER_PORT")):
                    raise ValueError(
                        f"WORLD_SIZE={info.world_size} but MASTER_ADDR/MASTER_PORT are not set: launch with "
                        f"torchrun (e.g. torchrun --standalone --nproc-per-node {info.world_size} "
                        "-m fastrecord record ...)"
                    )
                dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=self.timeout_s))
                self._own_group = True
            info = rank_info()
        self.info = info
        error = None
        if info.rank == 0:
            try:
                self._claim()
            except (ValueError, OSError) as e:
                error = f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
        error, self.if_exists, self.name = self._broadcast((error, self.if_exists, self.name))
        if error is not None:
            self.close(status="failed")
            raise ValueError(error)
        return self

    def _unfinished(self) -> bool:
        """Whether the run directory holds this run, sharded, not closed (a rank was killed, or the run was
        interrupted): the same command then resumes it instead of refusing."""
        from fastrecord.sinks.base import MANIFEST_SUFFIX, read_manifest

        before = read_manifest(self.output_dir / f"{self.name}{MANIFEST_SUFFIX}")
        sharding = before.get("options", {}).get("sharding")
        return (isinstance(sharding, dict) and before.get("status") != "closed"
                and sharding.get("base_seed") == self.base_seed)

    def _claim(self) -> None:
        from fastrecord.sinks.base import RunDirectory

        assert self.info is not None  # open() sets it before rank 0 claims
        sharding = sharding_options(self.info.world_size, self.base_seed, self.total)
        if self.name is not None and self.if_exists == "error" and self._unfinished():
            import logging

            logging.getLogger("fastrecord").warning(
                "fastrecord: %s/%s is a sharded run that did not finish: resuming it (its shards keep what they "
                "committed; the missing global episodes are recorded)", self.output_dir, self.name)
            self.if_exists = "resume"
        run = RunDirectory(self.output_dir, self.name, self.if_exists, options={**self.options, "sharding": sharding},
                           check_resume=self._check_resume).open()
        self.name = run.name  # a default name: the timestamp rank 0 claimed
        try:
            run.add_file(shards_root(self.output_dir, self.name))
            run.add_file(self.output_dir / f"{self.name}.h5")
            run.add_file(self.output_dir / f"{self.name}.json")
        except BaseException:
            run.close(status="failed") if run.resuming else run.abandon()
            raise
        self.run = run

    def _check_resume(self, previous: dict[str, Any]) -> None:
        """The earlier run this one resumes (its manifest ``previous``) must be a sharded run of the same base
        seed; checked by the `RunDirectory` claim before it writes anything."""
        before = previous.get("options", {}).get("sharding") if isinstance(previous.get("options"), dict) else None
        if not isinstance(before, dict):
            raise ValueError(f"{str(self.output_dir)!r} holds a run named {self.name!r} that was not recorded sharded "
                             f"(its manifest has no sharding); resume it without torchrun, or pass another "
                             f"--trajectory-name / --output-dir")
        if int(before.get("base_seed", self.base_seed)) != self.base_seed:
            raise ValueError(f"cannot resume run {self.name!r}: it was recorded with base seed {before['base_seed']} "
                             f"and this command has seed {self.base_seed}; global episode g has seed base + g, so pass "
                             f"--seed {before['base_seed']} (or record into another --output-dir)")

    @property
    def rank(self) -> int:
        assert self.info is not None, "DistributedRun.open() first"
        return self.info.rank

    @property
    def world_size(self) -> int:
        assert self.info is not None, "DistributedRun.open() first"
        return self.info.world_size

    @property
    def shard_dir(self) -> Path:
        """This rank's output folder: record a run named ``NAME`` there."""
        return shard_dir(self.output_dir, self._opened_name(), self.rank)

    def _opened_name(self) -> str:
        """The run's name: set by `open` on every rank (a default one is the timestamp rank 0 claimed)."""
        assert self.name is not None, "DistributedRun.open() first"
        return self.name

    @property
    def shard_if_exists(self) -> Literal["resume", "error"]:
        """The ``if_exists`` of this rank's shard: ``"resume"`` when the run resumes (a shard there is this
        rank's earlier work), else ``"error"`` (rank 0 has already refused or removed an earlier run)."""
        return "resume" if self.if_exists == "resume" else "error"

    def plan(self, recorder: Any, num_envs: int) -> EpisodeSchedule:
        """Exchange what is on disk and return this rank's `EpisodeSchedule`: its global episodes
        (`episodes_of`) that no shard has committed. Call it once the rank's recorder has opened its
        shard (a resumed shard has then recovered its complete parts)."""
        name = self._opened_name()
        mine = committed_global_indices(self.shard_dir, name)
        everyone = self._gather(sorted(mine))
        done = set().union(*map(set, everyone))
        for rank, folder in list_shards(self.output_dir, name).items():
            if rank >= self.world_size:  # shards of an earlier, larger world: read only
                done |= committed_global_indices(folder, name)
        todo = [g for g in episodes_of(self.rank, self.world_size, self.total) if g not in done]
        return EpisodeSchedule(todo, num_envs, self.rank, self.base_seed)

    # -------------------------------------------------------------- end
    def finish(self, summary: dict[str, Any], failed: bool = False) -> tuple[list[dict[str, Any]], MergeReport | None]:
        """Exchange the ranks' summaries (after each closed its recorder); rank 0 then merges (`merge`)
        and closes the run's manifest. Returns (every rank's summary, rank 0's report or None)."""
        summaries = self._gather(dict(summary, rank=self.rank, failed=failed))
        report = None
        if self.rank == 0:
            any_failed = any(s.get("failed") for s in summaries)
            try:
                report = merge(self.output_dir, self._opened_name(), expected=self.total)
            except NothingToMerge:  # a run without trajectories (videos and results only): nothing to join
                report = None
            except BaseException:
                self.close(status="failed")
                raise
            self.close(status="failed" if any_failed else "closed")
        return summaries, report

    def close(self, status: str = "closed") -> None:
        """Release rank 0's claim (manifest status ``status``) and leave the process group if this object
        joined it. Idempotent."""
        if self.run is not None:
            self.run.close(status=status)
            self.run = None
        if self._own_group and not self._closed:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        self._closed = True


# ---------------------------------------------------------------------------------------------- devices
_CUDA_SIM = ("physx_cuda", "cuda", "gpu")


def rank_backends(sim_backend: str, render_backend: str, info: RankInfo | None = None) -> tuple[str, str]:
    """ManiSkill's ``sim_backend`` / ``render_backend`` for this rank: a CUDA backend without a device
    number gets the rank's own GPU (``physx_cuda:LOCAL_RANK``, ``cuda:LOCAL_RANK``) when CUDA is present
    and the run is distributed; CPU backends and explicit devices are left as given."""
    info = info or rank_info()
    if not info.distributed:
        return sim_backend, render_backend
    import torch

    if not torch.cuda.is_available():
        return sim_backend, render_backend
    gpu = info.local_rank % max(torch.cuda.device_count(), 1)
    torch.cuda.set_device(gpu)
    if sim_backend in _CUDA_SIM:
        sim_backend = f"{'physx_cuda' if sim_backend == 'gpu' else sim_backend}:{gpu}"
    if render_backend in (*CUDA_NAMES, "auto"):
        render_backend = f"cuda:{gpu}"
    return sim_backend, render_backend


class ShardedResets:
    """Owns: a rank's `EpisodeSchedule` applied to resets that someone else drives (``make_eval_envs``:
    the evaluation loop resets, and the env wrappers ask here for the seeds), the end of the rank's part
    (`close`), and, on rank 0 after it, every rank's results rows and the merge report.

    The wrapper that resets calls `seeds` (the full list of ``num_envs`` seeds, the resetting slots'
    being their next global episodes'), resets, then `started`; `before_close` just before the recorder
    closes (episodes in progress are not saved), `after_close` once it is closed (the end exchange).
    """

    def __init__(self, run: DistributedRun, num_envs: int) -> None:
        self.run = run
        self.num_envs = num_envs
        self.schedule: EpisodeSchedule | None = None
        self.recorder: Any = None
        self.rows: list[dict[str, Any]] = []  # rank 0, after close: every rank's results rows
        self.report: MergeReport | None = None  # rank 0, after close
        self._done = False

    def attach(self, recorder: Any) -> None:
        """The rank's recorder is open (its shard claimed): plan the rank's episodes."""
        self.recorder = recorder
        self.schedule = self.run.plan(recorder, self.num_envs)

    def seeds(self, slots: Sequence[int]) -> tuple[list[int], list[dict[str, int] | None]]:
        assert self.schedule is not None, "attach() plans the rank's episodes before the first reset"
        metas = self.schedule.assign(slots)
        return [int(s) for s in self.schedule.seeds], metas

    def started(self, slots: Sequence[int], metas: Sequence[dict[str, int] | None]) -> None:
        self.recorder.set_episode_meta(np.asarray(slots), list(metas))

    def before_close(self) -> None:
        if self.recorder is not None and not self.recorder.closed:
            self.recorder.set_episode_meta(np.arange(self.num_envs), [None] * self.num_envs)

    def after_close(self, failed: bool = False) -> None:
        """The end exchange (once): rank 0 gathers the rows, merges, closes the run manifest."""
        if self._done:
            return
        self._done = True
        rows = list(self.recorder.results.rows) if self.recorder is not None else []
        ranks, self.report = self.run.finish({"rows": rows}, failed=failed)
        self.rows = [row for r in ranks for row in r.get("rows", [])] if self.run.rank == 0 else rows
        self.run.close()
