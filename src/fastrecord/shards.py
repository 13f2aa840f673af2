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
  episode, as `SeededRandomPolicy`).
- **Where shards go.** In the run directory ``DIR`` of a run named ``NAME``, rank ``r`` records a normal
  fastrecord run named ``NAME`` in ``DIR/NAME.shards/rank{r:05d}/`` (`shard_dir`): its own crash-safe
  ``NAME.h5`` + ``NAME.json`` (parts while recording), its lock, manifest, results file and videos
  (video names carry the shard's own episode ids; the JSON entries map them to ``g``).
- **Tagging episodes.** The process that records a shard tells its recorder which global episode each
  env slot is running: ``recorder.set_episode_meta(env_idx, [episode_meta(g, rank), ...])`` right after
  the reset that starts those episodes (None for a slot that runs no scheduled episode: its episode is
  neither written nor counted). Every JSON entry and results row of the shard then carries
  ``global_index`` and ``source_rank``; ``episode_seed`` (and ``reset_kwargs["seed"]``) is the seed.
  `EpisodeSchedule` hands episodes to env slots and builds those lists.
- **Joining.** `merge(DIR, NAME)` builds ``DIR/NAME.h5`` (a copy of every episode as ``traj_{g}``: one
  self-contained file that can be copied alone) and ``DIR/NAME.json`` (the shards' header, which must
  agree, and the episodes sorted by ``g`` with ``episode_id = g``, ``global_index``, ``source_rank``,
  ``shard_episode_id``). It is idempotent and reads the shards only (they are kept); ``links=True``
  writes an index of external links into the shard files instead (no copy; it opens only next to
  ``NAME.shards/``). It reports, rather than fails on, missing global episodes, episodes the keep filter
  dropped, duplicates, and shards still recording or left by a crash (`MergeReport`).
- **The run manifest.** ``DIR/NAME.fastrecord.json`` (a `fastrecord.sinks.RunDirectory` manifest) holds
  the arguments under ``options`` and the sharding under ``options["sharding"]``: ``world_size``,
  ``base_seed``, ``total``, ``rule``; ``fastrecord`` is the version. `DistributedRun.open` writes it (rank 0).
- **Communication** (`DistributedRun`): once at the start (rank 0 applies ``if_exists`` to the run
  directory, every rank opens its shard, the ranks exchange which global episodes are already on disk)
  and once at the end (summaries; rank 0 merges). Never per step.

Resuming: re-running the same command (``if_exists="resume"``) skips every global episode some shard
has committed (`committed_global_indices`); a rank killed with SIGKILL leaves its complete parts, which
its shard's resume recovers.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord.sinks.maniskill_h5.layout import read_json

SHARDS_SUFFIX = ".shards"  # DIR/NAME.shards/ holds the shards of run NAME
RULE = "g % world_size"  # the episode -> rank rule, as written in the manifest
_RANK_DIR = re.compile(r"^rank(\d{5,})$")


# ---------------------------------------------------------------------------------------------- ranks
@dataclass(frozen=True)
class RankInfo:
    """Where this process stands in a (possibly distributed) run."""

    rank: int  # global rank, 0 .. world_size-1
    world_size: int  # number of processes in the run
    local_rank: int  # rank on this host (picks the device: cuda:local_rank)
    local_world_size: int  # processes on this host (shares the CPU cores)

    @property
    def distributed(self) -> bool:
        """Launched as part of a multi-process run (torchrun sets WORLD_SIZE, also to 1)."""
        return self.world_size > 1 or "WORLD_SIZE" in os.environ


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer; torchrun sets it, unset it or "
                         f"launch with torchrun") from None


def rank_info() -> RankInfo:
    """The rank and world of this process: ``torch.distributed`` if it is initialised, else torchrun's
    environment variables ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, else 0 of 1."""
    rank, world = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except ImportError:
        pass
    # without torchrun's LOCAL_* variables (another launcher): one host is assumed
    local_rank, local_world = _env_int("LOCAL_RANK", rank), _env_int("LOCAL_WORLD_SIZE", world)
    if not (0 <= rank < world) or not (0 <= local_rank < max(local_world, 1)):
        raise ValueError(f"rank {rank} of world size {world} (local rank {local_rank} of {local_world}) is not a valid "
                         f"place in a run; launch with torchrun, or unset RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE")
    return RankInfo(rank, world, local_rank, max(local_world, 1))


def default_workers(info: RankInfo | None = None, cap: int = 16) -> int:
    """Encoder processes for one rank: the cores divided by the ranks on this host (at least 1, at most ``cap``)."""
    info = info or rank_info()
    return max(1, min(cap, (os.cpu_count() or 1) // info.local_world_size))


# ---------------------------------------------------------------------------------------------- episodes
def _check_world(world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1 (torchrun's --nproc-per-node x --nnodes)")


def owner(g: int, world_size: int) -> int:
    """The rank that records global episode ``g``: ``g % world_size``."""
    _check_world(world_size)
    if g < 0:
        raise ValueError(f"global episode index g={g} must be >= 0")
    return g % world_size


def episodes_of(rank: int, world_size: int, total: int) -> range:
    """Rank ``rank``'s global episodes out of ``total``, in increasing order: ``range(rank, total, world_size)``."""
    _check_world(world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside 0..{world_size - 1} (world_size={world_size})")
    return range(rank, total, world_size)


def episode_seed(base_seed: int, g: int) -> int:
    """The reset seed of global episode ``g``: ``base_seed + g``."""
    return int(base_seed) + int(g)


def episode_meta(g: int, rank: int) -> dict[str, int]:
    """The JSON fields a shard's episode entry and results row carry: ``global_index`` and ``source_rank``."""
    return {"global_index": int(g), "source_rank": int(rank)}


# ---------------------------------------------------------------------------------------------- paths
def shards_root(run_dir: str | Path, name: str) -> Path:
    """``DIR/NAME.shards``: the folder of run ``NAME``'s shards."""
    return Path(run_dir) / f"{name}{SHARDS_SUFFIX}"


def shard_dir(run_dir: str | Path, name: str, rank: int) -> Path:
    """``DIR/NAME.shards/rank{rank:05d}``: the output folder of rank ``rank``'s shard (a run named ``NAME``)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise ValueError(f"rank={rank!r} must be an integer >= 0")
    return shards_root(run_dir, name) / f"rank{rank:05d}"


def list_shards(run_dir: str | Path, name: str) -> dict[int, Path]:
    """{rank: shard folder} of every shard folder on disk (also of ranks beyond today's world size)."""
    root = shards_root(run_dir, name)
    if not root.is_dir():
        return {}
    found = {int(m.group(1)): p for p in root.iterdir() if p.is_dir() and (m := _RANK_DIR.match(p.name))}
    return dict(sorted(found.items()))


# ---------------------------------------------------------------------------------------------- schedule
class SeededRandomPolicy:
    """Uniform random actions, drawn per env slot from the action space seeded with the episode's seed at
    each episode start: episode ``g``'s actions are the same whatever slot, rank or world size runs it.

    Owns: one copy of the single-env action space per slot. `EpisodeSchedule` calls `restart`.
    """

    def __init__(self, single_action_space: Any, num_envs: int) -> None:
        import copy

        self.spaces = [copy.deepcopy(single_action_space) for _ in range(num_envs)]

    def restart(self, slots: Iterable[int], seeds: Iterable[int]) -> None:
        for e, s in zip(slots, seeds):
            self.spaces[int(e)].seed(int(s))

    def __call__(self, obs: Any) -> np.ndarray:
        return np.stack([s.sample() for s in self.spaces])


class EpisodeSchedule:
    """Owns: the global episodes this rank still has to record (in increasing ``g``) and which one each
    env slot runs.

    ``todo`` are the global indices to record (`episodes_of` minus what the shards have committed).
    `assign(slots)` gives the next episodes to env slots that are about to be reset; slots left without
    one (the schedule ran out) run spare episodes that are not recorded (their meta is None). ``rank``
    None: an unsharded run (`single_schedule`), whose episodes carry ``global_index`` only.
    """

    def __init__(self, todo: Sequence[int], num_envs: int, rank: int | None, base_seed: int) -> None:
        self.todo = [int(g) for g in todo]
        self._queue = deque(self.todo)
        self.num_envs = num_envs
        self.rank = rank
        self.base_seed = int(base_seed)
        self.current: list[int | None] = [None] * num_envs  # global episode running in each slot
        self.seeds = np.full(num_envs, self.base_seed, dtype=np.int64)  # each slot's current reset seed
        self.finished: list[int] = []  # global episodes that ended, in finish order

    @property
    def active(self) -> np.ndarray:
        """``[num_envs]`` bool: slots running a scheduled episode."""
        return np.array([g is not None for g in self.current], dtype=bool)

    @property
    def done(self) -> bool:
        return not self._queue and not self.active.any()

    def assign(self, slots: Iterable[int]) -> list[dict[str, int] | None]:
        """The episodes in ``slots`` end (if scheduled: they count as finished); give each slot the next
        global episode. Updates `seeds` (spare slots keep theirs) and returns the recorder's metas."""
        metas: list[dict[str, int] | None] = []
        for e in slots:
            e = int(e)
            if self.current[e] is not None:
                self.finished.append(self.current[e])
            g = self._queue.popleft() if self._queue else None
            self.current[e] = g
            if g is not None:
                self.seeds[e] = episode_seed(self.base_seed, g)
            if g is None:
                metas.append(None)
            else:
                metas.append(episode_meta(g, self.rank) if self.rank is not None else {"global_index": g})
        return metas


def single_schedule(run_dir: str | Path, name: str, *, total: int, base_seed: int, num_envs: int) -> EpisodeSchedule:
    """The schedule of an unsharded run (one process records global episodes ``0 .. total-1`` into
    ``run_dir/NAME.h5`` itself, as ``fastrecord record`` without torchrun): the episodes its ``NAME.json``
    and results file do not have (`committed_global_indices`; all of them in a new run), so a resumed
    run continues the seed sequence and ``total`` is the run's size. Call it once the recorder has
    opened the run (a resumed run has then recovered its complete parts).

    Raises ValueError when the run on disk was recorded with another base seed (its episodes' seeds
    minus their global indices), since global episode g has seed ``base_seed + g``, and when it holds
    episodes without a global index (recorded by `RecordEpisode` directly): their seeds are unknown."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"total={total!r} must be an integer >= 1 (the number of episodes in the run)")
    try:
        doc = json.loads((Path(run_dir) / f"{name}.json").read_text())
    except (OSError, ValueError):
        doc = None
    entries = [e for e in doc.get("episodes", []) if isinstance(e, dict)] if isinstance(doc, dict) else []
    untagged = sum("global_index" not in e for e in entries)
    if untagged:
        raise ValueError(f"cannot resume run {name!r} in {str(run_dir)!r}: {untagged} of its episodes have no global_index "
                         f"(recorded by RecordEpisode in Python or an older fastrecord), so which seeds it holds is unknown; "
                         f"record into another --output-dir or --trajectory-name, or pass --if-exists overwrite")
    bases = {int(e["episode_seed"]) - int(e["global_index"]) for e in entries
             if isinstance(e.get("episode_seed"), int) and isinstance(e.get("global_index"), int)}
    if bases and bases != {int(base_seed)}:
        before = min(bases)
        raise ValueError(f"cannot resume run {name!r} in {str(run_dir)!r}: it was recorded with seed {before} and this "
                         f"command has seed {base_seed}; episode g has seed base + g, so pass --seed {before} "
                         f"(or record into another --output-dir or --trajectory-name)")
    done = committed_global_indices(run_dir, name)
    return EpisodeSchedule([g for g in range(total) if g not in done], num_envs, None, base_seed)


# ---------------------------------------------------------------------------------------------- reading shards
def _read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return rows
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a torn last line (crash mid-write)
        if isinstance(row, dict):
            rows.append(row)
    return rows


def committed_global_indices(shard: str | Path, name: str) -> set[int]:
    """The global episodes a shard folder has finished for good: those its ``NAME.json`` lists, and those
    its results file says ended and were not kept (``keep`` dropped them: recording them again would
    drop them again). Without a trajectory (``save_trajectory=False``), every episode with a results row
    (a kept episode's row is written once its video is on disk)."""
    shard = Path(shard)
    doc = read_json(shard / f"{name}.json")
    done: set[int] = set()
    if doc is not None:
        done |= {int(e["global_index"]) for e in doc.get("episodes", []) if isinstance(e, dict) and "global_index" in e}
    for row in _read_rows(shard / f"{name}.results.jsonl"):
        if "global_index" in row and (doc is None or row.get("episode_id") is None):
            done.add(int(row["global_index"]))
    return done


def lock_held(shard: Path, name: str) -> bool:
    """Whether a live process holds the shard's run lock (it is recording now)."""
    lock = shard / f".{name}.lock"
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


# ---------------------------------------------------------------------------------------------- merge
class NothingToMerge(ValueError):
    """`merge` found no shard with a trajectory (no shard folders, or none has a readable ``NAME.json``)."""


@dataclass
class MergeReport:
    """What `merge` built and what it found missing. ``ok``: every expected global episode is present."""

    h5_path: Path
    json_path: Path
    episodes: int = 0  # episodes in the joined dataset
    expected: int | None = None  # global episodes the run was asked for (None: unknown)
    missing: list[int] = field(default_factory=list)  # expected global episodes in no shard
    dropped: list[int] = field(default_factory=list)  # finished, but the keep filter did not keep them
    duplicates: list[int] = field(default_factory=list)  # in several shards (the lowest rank's is used)
    shards: dict[int, int] = field(default_factory=dict)  # rank -> episodes taken from its shard
    recording: list[int] = field(default_factory=list)  # ranks whose shard is being written now
    crashed: list[int] = field(default_factory=list)  # ranks whose shard was left by a run that did not close
    consolidated: bool = True  # NAME.h5 holds a copy of every episode (False: links into the shards)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.recording

    def lines(self) -> list[str]:
        """The report in words (``fastrecord merge`` prints it)."""
        out = [f"{self.h5_path}: {self.episodes} episodes from {len(self.shards)} shard(s)"
               + (" (one self-contained file)" if self.consolidated
                  else f" (index of links into {self.h5_path.stem}{SHARDS_SUFFIX}/: it opens only next to that folder)")]
        if self.expected is not None:
            out.append(f"expected {self.expected} global episodes (0..{self.expected - 1})")
        if self.dropped:
            out.append(f"not kept by the keep filter: {len(self.dropped)} ({ranges_text(self.dropped)})")
        if self.missing:
            out.append(f"missing: {len(self.missing)} global episodes ({ranges_text(self.missing)}); re-run the recording "
                       f"command with --if-exists resume to record them, then merge again")
        if self.duplicates:
            out.append(f"in several shards: {ranges_text(self.duplicates)} (the lowest rank's copy is used)")
        if self.recording:
            out.append(f"still recording: rank(s) {self.recording}; merge again when they are done")
        if self.crashed and (self.missing or self.expected is None):
            out.append(f"not closed (crashed or killed): rank(s) {self.crashed}; re-running the recording command "
                       f"with --if-exists resume recovers their complete parts")
        elif self.crashed:  # every expected episode is here: the shards' unclosed state loses nothing
            out.append(f"rank(s) {self.crashed} did not close their shard (crashed or killed), but every expected "
                       f"episode is in the joined dataset: nothing is lost")
        return out


def ranges_text(values: Sequence[int], limit: int = 12) -> str:
    """Sorted integers as spans, "0-3, 7, 9-12" (at most ``limit`` spans, then how many more)."""
    values = sorted(values)
    spans: list[str] = []
    start = prev = None
    for v in values + [None]:
        if start is not None and (v is None or v != prev + 1):
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if v is not None and start is None:
            start = v
        prev = v
    text = ", ".join(spans[:limit])
    return text + (f", ... ({len(spans) - limit} more spans)" if len(spans) > limit else "")


def _comparable(info: Any) -> str:
    return json.dumps(info, sort_keys=True, default=repr)


def merge(run_dir: str | Path, name: str, *, links: bool = False, expected: int | None = None) -> MergeReport:
    """Build (or rebuild) the joined dataset ``DIR/NAME.h5`` + ``DIR/NAME.json`` from the shards in
    ``DIR/NAME.shards/rank*/``; return a `MergeReport`.

    ``NAME.h5`` gets a copy of each global episode ``g`` found, as ``traj_{g}`` (one self-contained file
    that can be copied alone; the shards stay, so merging again rebuilds it). ``links=True`` writes one
    external link ``traj_{g}`` per episode into the shard's ``NAME.h5`` instead (relative paths: the
    folder can be moved whole, but ``NAME.h5`` alone does not open). ``NAME.json`` gets the first shard's
    header (``env_info``, ``commit_info``, ``source_type``/``source_desc``; ``env_info`` must be the same
    in every shard, else ValueError naming the ranks) and the episodes sorted by ``g``, each its shard
    entry with ``episode_id = g`` (plus ``global_index``, ``source_rank``, ``shard_episode_id``). Both
    files are swapped in atomically (``NAME.h5`` first), by a writer process
    (`fastrecord.sinks.maniskill_h5.join_runs`).

    Reads the shards only: a shard still recording (its lock is held) contributes what it has listed so
    far; one left by a crash contributes what its index lists (resuming the run recovers the rest).
    ``expected`` (default: ``total`` from the run manifest) is the number of global episodes asked for;
    those in no shard are reported as missing, or as dropped when the shard's results file says the keep
    filter did not keep them. Idempotent. Refuses to replace a self-contained ``NAME.h5`` holding
    episodes the shards no longer have (never deletes recorded data).
    """
    from fastrecord.sinks.base import MANIFEST_SUFFIX, read_manifest

    run_dir = Path(run_dir)
    if not name or any(c in name for c in "/\\\0"):
        raise ValueError(f"name={name!r} must be the run's plain name (the NAME of DIR/NAME.shards), e.g. 'trajectory'")
    shards = list_shards(run_dir, name)
    root = shards_root(run_dir, name)
    if not shards:
        raise NothingToMerge(f"{str(root)!r} holds no shard folders rank00000, rank00001, ...: nothing to merge. Pass the "
                         f"run directory and the run's name (--name, default 'trajectory') of a sharded recording")
    if expected is None:
        sharding = read_manifest(run_dir / f"{name}{MANIFEST_SUFFIX}").get("options", {}).get("sharding", {})
        if isinstance(sharding, dict) and isinstance(sharding.get("total"), int):
            expected = sharding["total"]
    h5_path, json_path = run_dir / f"{name}.h5", run_dir / f"{name}.json"
    report = MergeReport(h5_path, json_path, expected=expected, consolidated=not links)

    header: dict[str, Any] | None = None
    header_rank = -1
    chosen: dict[int, tuple[int, dict[str, Any]]] = {}  # g -> (rank, shard entry)
    dropped: set[int] = set()
    for rank, folder in shards.items():
        if lock_held(folder, name):
            report.recording.append(rank)
        elif read_manifest(folder / f"{name}{MANIFEST_SUFFIX}").get("status") == "recording":
            report.crashed.append(rank)
        for row in _read_rows(folder / f"{name}.results.jsonl"):
            if row.get("episode_id") is None and "global_index" in row:
                dropped.add(int(row["global_index"]))
        doc = read_json(folder / f"{name}.json")
        if doc is None:
            continue
        shard_header = {k: v for k, v in doc.items() if k != "episodes"}
        if header is None:
            header, header_rank = shard_header, rank
        elif _comparable(shard_header.get("env_info")) != _comparable(header.get("env_info")):
            raise ValueError(
                f"the shards disagree on env_info: rank {header_rank} has {header.get('env_info')!r}, rank {rank} has "
                f"{shard_header.get('env_info')!r} ({folder}); they are not one run. Move the foreign shard folder out of "
                f"{root} and merge again")
        for e in doc.get("episodes", []):
            if not isinstance(e, dict) or "global_index" not in e or "episode_id" not in e:
                raise ValueError(f"{folder / (name + '.json')} has an episode entry without global_index/episode_id "
                                 f"({str(e)[:120]}); it is not a shard of a sharded run. Move it out of {root}")
            g = int(e["global_index"])
            if g in chosen:
                report.duplicates.append(g)
                continue
            chosen[g] = (rank, e)
    if header is None:
        raise NothingToMerge(f"no shard in {str(root)!r} has a readable {name}.json yet (recording without a trajectory, "
                         f"or nothing finished); there is nothing to join")

    order = sorted(chosen)
    sources: list[tuple[str, str, str]] = []  # (name in NAME.h5, shard file relative to DIR, group in it)
    episodes: list[dict[str, Any]] = []
    for g in order:
        rank, e = chosen[g]
        target = os.path.relpath(shards[rank] / f"{name}.h5", run_dir)
        sources.append((f"traj_{g}", target, f"traj_{int(e['episode_id'])}"))
        report.shards[rank] = report.shards.get(rank, 0) + 1
        episodes.append({**e, "episode_id": g, "global_index": g, "source_rank": rank,
                         "shard_episode_id": int(e["episode_id"])})
    report.episodes = len(episodes)
    top = max([*order, *dropped], default=-1) + 1
    span = range(expected if expected is not None else top)
    report.dropped = sorted(g for g in dropped if g not in chosen)
    report.missing = [g for g in span if g not in chosen and g not in dropped]
    report.duplicates = sorted(set(report.duplicates))

    from fastrecord.sinks.maniskill_h5.merge import join_runs

    join_runs(h5_path, sources, {**header, "episodes": episodes}, links=links)
    return report


# ---------------------------------------------------------------------------------------------- run directory
def sharding_options(world_size: int, base_seed: int, total: int) -> dict[str, Any]:
    """The ``options["sharding"]`` entry of a sharded run's manifest."""
    return dict(world_size=int(world_size), base_seed=int(base_seed), total=int(total), rule=RULE,
                shards=f"NAME{SHARDS_SUFFIX}/rank{{rank:05d}}")


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

    def __init__(self, output_dir: str | Path, name: str | None, *, total: int, base_seed: int, if_exists: str = "error",
                 options: dict[str, Any] | None = None, timeout_s: float = 24 * 3600.0) -> None:
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
        self.run = None  # rank 0: the RunDirectory of the joined run
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
                    raise ValueError(f"WORLD_SIZE={info.world_size} but MASTER_ADDR/MASTER_PORT are not set: launch with "
                                     f"torchrun (e.g. torchrun --standalone --nproc-per-node {info.world_size} -m fastrecord record ...)")
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

        sharding = sharding_options(self.info.world_size, self.base_seed, self.total)
        if self.name is not None and self.if_exists == "error" and self._unfinished():
            import logging

            logging.getLogger("fastrecord").warning(
                "fastrecord: %s/%s is a sharded run that did not finish: resuming it (its shards keep what they "
                "committed; the missing global episodes are recorded)", self.output_dir, self.name)
            self.if_exists = "resume"
        run = RunDirectory(self.output_dir, self.name, self.if_exists,
                           options={**self.options, "sharding": sharding}).open()
        self.name = run.name  # a default name: the timestamp rank 0 claimed
        try:
            if run.resuming:
                before = run.previous.get("options", {}).get("sharding")
                if not isinstance(before, dict):
                    raise ValueError(f"{str(self.output_dir)!r} holds a run named {self.name!r} that was not recorded sharded "
                                     f"(its manifest has no sharding); resume it without torchrun, or pass another "
                                     f"--trajectory-name / --output-dir")
                if int(before.get("base_seed", self.base_seed)) != self.base_seed:
                    raise ValueError(f"cannot resume run {self.name!r}: it was recorded with base seed {before['base_seed']} "
                                     f"and this command has seed {self.base_seed}; global episode g has seed base + g, so pass "
                                     f"--seed {before['base_seed']} (or record into another --output-dir)")
            run.add_file(shards_root(self.output_dir, self.name))
            run.add_file(self.output_dir / f"{self.name}.h5")
            run.add_file(self.output_dir / f"{self.name}.json")
        except BaseException:
            run.close(status="failed") if run.resuming else run.abandon()
            raise
        self.run = run

    @property
    def rank(self) -> int:
        return self.info.rank

    @property
    def world_size(self) -> int:
        return self.info.world_size

    @property
    def shard_dir(self) -> Path:
        """This rank's output folder: record a run named ``NAME`` there."""
        return shard_dir(self.output_dir, self.name, self.info.rank)

    @property
    def shard_if_exists(self) -> str:
        """The ``if_exists`` of this rank's shard: ``"resume"`` when the run resumes (a shard there is this
        rank's earlier work), else ``"error"`` (rank 0 has already refused or removed an earlier run)."""
        return "resume" if self.if_exists == "resume" else "error"

    def plan(self, recorder: Any, num_envs: int) -> EpisodeSchedule:
        """Exchange what is on disk and return this rank's `EpisodeSchedule`: its global episodes
        (`episodes_of`) that no shard has committed. Call it once the rank's recorder has opened its
        shard (a resumed shard has then recovered its complete parts)."""
        mine = committed_global_indices(self.shard_dir, self.name)
        everyone = self._gather(sorted(mine))
        done = set().union(*map(set, everyone))
        for rank, folder in list_shards(self.output_dir, self.name).items():
            if rank >= self.world_size:  # shards of an earlier, larger world: read only
                done |= committed_global_indices(folder, self.name)
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
                report = merge(self.output_dir, self.name, expected=self.total)
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


# ---------------------------------------------------------------------------------------------- devices and the loop
_CUDA_SIM = ("physx_cuda", "cuda", "gpu")
_CUDA_RENDER = ("sapien_cuda", "cuda", "gpu")


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
    if render_backend in (*_CUDA_RENDER, "auto"):
        render_backend = f"cuda:{gpu}"
    return sim_backend, render_backend


def record_schedule(env: Any, recorder: Any, schedule: EpisodeSchedule, act: Any, *,
                    stop: Any = None, on_step: Any = None) -> int:
    """Run ``schedule``'s episodes in ``env`` (the recorded env stack whose recorder is ``recorder``);
    returns the env-steps taken.

    Every env slot is reset by this loop with its episode's seed (``schedule.seeds``) when its episode
    ends (terminated or truncated), and the recorder is told the slot's global episode right after
    (`EpisodeRecorder.set_episode_meta`). ``env`` must not auto-reset: a ManiSkill env (batched or one
    env; ``ManiSkillVectorEnv(auto_reset=False)`` on top is fine), partial resets through
    ``options["env_idx"]``, or a gymnasium vector env with ``autoreset_mode=DISABLED`` (recorded by
    `RecordVectorEpisode`), partial resets through ``options["reset_mask"]``. ``act(obs)`` gives the
    batched action; if it has ``restart(slots, seeds)`` (`SeededRandomPolicy`) it is called at each
    reset. ``stop()`` is checked between steps; ``on_step(schedule)`` after each step (progress).
    """
    import torch

    n = schedule.num_envs
    restart = getattr(act, "restart", None)

    def reset(slots: np.ndarray) -> Any:
        metas = schedule.assign(slots)
        seeds = [int(s) for s in schedule.seeds]
        if n == 1:
            obs, _ = env.reset(seed=seeds[0])
        elif len(slots) == n:
            obs, _ = env.reset(seed=seeds)
        else:
            obs, _ = env.reset(seed=seeds, options=recorder.view.partial_reset_options(slots))
        recorder.set_episode_meta(slots, metas)
        if restart is not None:
            restart(slots, schedule.seeds[slots])
        return obs

    def flags(x: Any) -> np.ndarray:
        return (x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)).reshape(-1).astype(bool)

    steps = 0
    obs = reset(np.arange(n))
    while not schedule.done and not (stop is not None and stop()):
        obs, _, terminated, truncated, _ = env.step(act(obs))
        steps += n
        ended = np.flatnonzero(flags(terminated) | flags(truncated))
        if len(ended):
            obs = reset(ended)
        if on_step is not None:
            on_step(schedule)
    return steps


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
