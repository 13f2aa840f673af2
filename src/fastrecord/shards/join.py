"""Joining the shards of a run into one ManiSkill dataset: `merge` builds ``DIR/NAME.h5`` +
``DIR/NAME.json`` from ``DIR/NAME.shards/rank*/`` and says what it found in a `MergeReport`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fastrecord import locks
from fastrecord.shards.layout import SHARDS_SUFFIX, global_index_of, list_shards, results_rows, shards_root
from fastrecord.shards.videos import JoinedVideos, join_videos
from fastrecord.sinks.results import RESULTS_SUFFIX

log = logging.getLogger("fastrecord")


def lock_held(shard: Path, name: str) -> bool:
    """Whether a live process holds the shard's run lock (it is recording now)."""
    from fastrecord.sinks.runfiles import lock_path

    return locks.lock_held(lock_path(shard, name))


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
    trajectory: bool = True
    lerobot_path: Path | None = (
        None  # DIR/NAME.lerobot, joined from the shards' LeRobot datasets (None: they have none)
    )
    lerobot_episodes: int = 0  # episodes in it
    lerobot_missing: list[int] = field(default_factory=list)  # in NAME.h5, but in no shard's LeRobot dataset files
    videos: list[Path] = field(default_factory=list)  # the joined episodes' videos, linked into DIR (`shards.videos`)
    videos_copied: int = 0  # of them, copies: the file system would not link (the shards' stay: twice the disk)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.recording

    def lines(self) -> list[str]:
        """The report in words (``fastrecord merge`` prints it)."""
        out = [f"{self.h5_path}: {self.episodes} episodes from {len(self.shards)} shard(s)"
               + (" (one self-contained file)" if self.consolidated
                  else f" (index of links into {self.h5_path.stem}{SHARDS_SUFFIX}/: it opens only next to that folder)")
               ] if self.trajectory else []
        if self.lerobot_path is not None:
            out.append(
                f"{self.lerobot_path}: {self.lerobot_episodes} episodes (LeRobot v3.0)"
                + ("" if self.trajectory else f" from {len(self.shards)} shard(s); the shards hold no trajectory")
            )
        if self.lerobot_missing:
            out.append(
                f"not in the shards' LeRobot datasets: {len(self.lerobot_missing)} global episodes "
                f"({ranges_text(self.lerobot_missing)}); a shard left by a crash holds them as parts: re-run the "
                f"recording command with --if-exists resume (or fastrecord consolidate the shard), then merge again"
            )
        if not self.trajectory and self.lerobot_path is None:
            out.append(f"{self.h5_path.parent}: {self.episodes} episodes from {len(self.shards)} shard(s) (their "
                       f"results rows; the shards hold no trajectory)")
        if self.videos:
            how = "linked" if not self.videos_copied else f"linked ({self.videos_copied} copied: no hard links there)"
            out.append(f"{self.h5_path.parent}: {len(self.videos)} videos of the joined episodes {how}, named by "
                       f"global episode")
        if self.expected is not None:
            out.append(f"expected {self.expected} global episodes (0..{self.expected - 1})")
        if self.dropped:
            out.append(f"not kept by the keep filter: {len(self.dropped)} ({ranges_text(self.dropped)})")
        if self.missing:
            out.append(
                f"missing: {len(self.missing)} global episodes ({ranges_text(self.missing)}); re-run the recording "
                f"command with --if-exists resume to record them, then merge again"
            )
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
    start: int | None = None
    prev = 0  # the last value seen (read only while a span is open, so after one)
    for v in [*values, None]:
        if start is not None and (v is None or v != prev + 1):
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = None
        if v is not None:
            if start is None:
                start = v
            prev = v
    text = ", ".join(spans[:limit])
    return text + (f", ... ({len(spans) - limit} more spans)" if len(spans) > limit else "")


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

    One merge of a run at a time: a merge holds ``DIR/.NAME.merge.lock`` (`merging`) from reading the
    shards to swapping in the pair, so that two (rank 0's at the end of a run and a user's ``fastrecord
    merge``, say) never write the same temporary files; the second waits, then rebuilds the pair.
    """
    run_dir = Path(run_dir)
    if not name or any(c in name for c in "/\\\0"):
        raise ValueError(f"name={name!r} must be the run's plain name (the NAME of DIR/NAME.shards), e.g. 'trajectory'")
    if not list_shards(run_dir, name):
        raise NothingToMerge(
            f"{str(shards_root(run_dir, name))!r} holds no shard folders rank00000, rank00001, ...: nothing "
            f"to merge. Pass the run directory and the run's name (--name, default 'trajectory') of a "
            f"sharded recording"
        )
    from fastrecord.sinks.maniskill_h5 import one_writer_process

    with merging(run_dir, name), one_writer_process():  # every shard's check and the join: one HDF5 process
        return _merge(run_dir, name, links=links, expected=expected)


@contextlib.contextmanager
def merging(run_dir: Path, name: str) -> Iterator[None]:
    """Hold ``run_dir/.NAME.merge.lock`` (an exclusive ``flock``; the kernel releases it if the process
    dies): one merge of run ``NAME`` at a time. Not the run's own lock ``.NAME.lock``: rank 0 holds that
    for the whole recording and merges under it, and a merge while the run records is allowed. A second
    merge logs that it waits, then waits."""

    def waiting(holder: str) -> None:
        log.warning("fastrecord: waiting for another merge of %r in %s (%s) to end", name, str(run_dir),
                    holder or "unknown process")

    with locks.holding(run_dir / f".{name}.merge.lock", waiting=waiting):
        yield


class JoinPart(Protocol):
    """A format's part of `merge` (`fastrecord.sinks.maniskill_h5.merge.TrajectoryJoin`,
    `fastrecord.sinks.lerobot.join.LeRobotJoin`): reads what each shard holds in that format (``read_shard``,
    ``limit``: the shard's committed episodes, None: unknown), then writes the joined output in ``DIR``
    (``write``, told what the parts before it joined) and returns ``{global episode: (rank, entry)}``."""

    duplicates: list[int]  # global episodes found in several shards (the lowest rank's is used)

    @property
    def found(self) -> bool: ...

    def read_shard(self, rank: int, folder: Path, limit: int | None) -> None: ...

    def write(self, report: MergeReport,
              joined: dict[int, tuple[int, dict[str, Any]]]) -> dict[int, tuple[int, dict[str, Any]]]: ...


def join_parts(run_dir: Path, name: str, *, links: bool) -> list[JoinPart]:
    """The formats' parts of a merge, in the order they are written: the trajectory (whose episodes the
    report and the results rows follow when there is one), then the LeRobot dataset."""
    from fastrecord.sinks.lerobot.join import LeRobotJoin
    from fastrecord.sinks.maniskill_h5.merge import TrajectoryJoin

    return [TrajectoryJoin(run_dir, name, links=links), LeRobotJoin(run_dir, name)]


def _merge(run_dir: Path, name: str, *, links: bool, expected: int | None) -> MergeReport:
    """`merge`'s work, under `merging`: the shards read once, each format's part joined, the report and the
    joined results rows written."""
    from fastrecord.sinks.base import MANIFEST_SUFFIX, read_manifest

    shards = list_shards(run_dir, name)
    root = shards_root(run_dir, name)
    if not shards:
        raise NothingToMerge(
            f"{str(root)!r} holds no shard folders rank00000, rank00001, ...: nothing to merge. Pass the "
            f"run directory and the run's name (--name, default 'trajectory') of a sharded recording"
        )
    if expected is None:
        sharding = read_manifest(run_dir / f"{name}{MANIFEST_SUFFIX}").get("options", {}).get("sharding", {})
        if isinstance(sharding, dict) and isinstance(sharding.get("total"), int):
            expected = sharding["total"]
    report = MergeReport(run_dir / f"{name}.h5", run_dir / f"{name}.json", expected=expected, consolidated=not links)
    parts = join_parts(run_dir, name, links=links)
    dropped, rows = _read_shards(run_dir, name, shards, parts, report)
    primary = next((p for p in parts if p.found), None)
    chosen: dict[int, tuple[int, dict[str, Any]]] = {}
    if primary is None:  # no trajectory, no LeRobot dataset: the results rows (and videos) are joined
        chosen = _kept_rows(shards, rows, name, report)
        if not chosen:
            raise NothingToMerge(
                f"no shard in {str(root)!r} has a readable {name}.json or a kept episode's results row yet (nothing "
                f"finished); there is nothing to join"
            )
        report.trajectory, report.episodes = False, len(chosen)
    for part in parts if primary is not None else []:
        joined = part.write(report, chosen)
        if part is primary:
            chosen = joined
        report.duplicates += part.duplicates
    for rank, _ in chosen.values():
        report.shards[rank] = report.shards.get(rank, 0) + 1
    top = max([*chosen, *dropped], default=-1) + 1
    span = range(expected if expected is not None else top)
    report.dropped = sorted(g for g in dropped if g not in chosen)
    report.missing = [g for g in span if g not in chosen and g not in dropped]
    report.duplicates = sorted(set(report.duplicates))
    ids = _shard_episodes(rows, chosen)
    videos = join_videos(run_dir, name, shards, ids)
    report.videos, report.videos_copied = videos.paths, videos.copied
    _join_results(run_dir, name, shards, rows, set(chosen), ids, videos)
    return report


def _shard_episodes(rows: dict[int, list[dict[str, Any]]],
                    chosen: dict[int, tuple[int, dict[str, Any]]]) -> dict[int, tuple[int, int]]:
    """``{g: (rank, its episode id in that shard)}`` of the joined episodes: the joined entry's ``episode_id``, or,
    where the entry has none (a LeRobot dataset's), the id of that shard's kept results row of ``g``."""
    out = {g: (rank, e["episode_id"]) for g, (rank, e) in chosen.items()
           if isinstance(e.get("episode_id"), int) and not isinstance(e.get("episode_id"), bool)}
    for rank, shard_rows in rows.items():
        for row in shard_rows:
            g, eid = row.get("global_index"), row.get("episode_id")
            if isinstance(g, int) and g in chosen and g not in out and chosen[g][0] == rank and isinstance(eid, int):
                out[g] = (rank, eid)
    return out


def _kept_rows(shards: dict[int, Path], rows: dict[int, list[dict[str, Any]]], name: str,
               report: MergeReport) -> dict[int, tuple[int, dict[str, Any]]]:
    """``{g: (rank, results row)}`` of every kept episode (a row with an ``episode_id``), the lowest rank's where
    several shards hold ``g``: a run that writes no trajectory and no LeRobot dataset (videos and results only)."""
    kept: dict[int, tuple[int, dict[str, Any]]] = {}
    for rank, folder in shards.items():
        for row in rows[rank]:
            if row.get("episode_id") is None or "global_index" not in row:
                continue
            g = global_index_of(row, folder / f"{name}{RESULTS_SUFFIX}", f", or move {folder} out of {folder.parent}")
            if g in kept:
                report.duplicates.append(g)
            else:
                kept[g] = (rank, row)
    return kept


def _read_shards(run_dir: Path, name: str, shards: dict[int, Path], parts: Sequence[JoinPart],
                 report: MergeReport) -> tuple[set[int], dict[int, list[dict[str, Any]]]]:
    """Read every shard for the parts (a shard recording now or left by a crash noted in ``report``); returns
    the global episodes the shards' results rows say the keep filter dropped, and each shard's rows (read once,
    for the whole merge). A damaged shard (`inspect_run`) is a ValueError, raised once every shard's entries were
    checked (a bad entry says more)."""
    from fastrecord.sinks.base import MANIFEST_SUFFIX, read_manifest
    from fastrecord.sinks.reconcile import inspect_run

    root = shards_root(run_dir, name)
    dropped: set[int] = set()
    rows: dict[int, list[dict[str, Any]]] = {}
    damaged = None
    for rank, folder in shards.items():
        limit = None  # a shard's committed episodes (its results file's commit log): what it holds past them is not
        if lock_held(folder, name):
            report.recording.append(rank)
        else:
            if read_manifest(folder / f"{name}{MANIFEST_SUFFIX}").get("status") == "recording":
                report.crashed.append(rank)
            state = inspect_run(folder, name, videos=False)
            if state.problems and damaged is None:
                damaged = f"not merging run {name!r}: its shard {folder.relative_to(run_dir)}: {state.problems[0]}"
            limit = state.committed if state.rows is not None else None
        rows[rank] = results_rows(folder, name)
        for row in rows[rank]:
            if row.get("episode_id") is None and "global_index" in row:
                dropped.add(
                    global_index_of(row, folder / f"{name}{RESULTS_SUFFIX}", f", or move {folder} out of {root}")
                )
        for part in parts:
            part.read_shard(rank, folder, limit)
    if damaged is not None:
        raise ValueError(damaged)
    return dropped, rows


def _join_results(run_dir: Path, name: str, shards: dict[int, Path], shard_rows: dict[int, list[dict[str, Any]]],
                  joined: set[int], chosen: dict[int, tuple[int, int]], videos: JoinedVideos) -> None:
    """``DIR/NAME.results.jsonl``: every global episode's results row once, by global index, as an unsharded
    run's (``episode_id`` its id in the joined ``NAME.h5``, null if not kept; ``video`` relative to ``DIR``: the
    joined video next to ``NAME.h5``, else its shard's; ``videos``: every piece of a split video): a kept
    episode's row is the one of the shard entry joined, an episode not kept gets its last row."""
    from fastrecord.sinks.base import atomic_write_bytes

    rows: dict[int, dict[str, Any]] = {}
    for rank, folder in shards.items():
        for row in shard_rows[rank]:
            if "global_index" not in row:
                continue
            g = global_index_of(row, folder / f"{name}{RESULTS_SUFFIX}", f", or move {folder} out of {folder.parent}")
            kept = g in joined
            if kept and chosen.get(g) != (rank, row.get("episode_id")):  # (rank, shard episode id) of the joined copy
                continue  # a row of another copy of a joined episode
            video = row.get("video")
            rows[g] = {**row, "episode_id": g if kept else None, "source_rank": rank,
                       "video": videos.names.get((rank, video)) or os.path.relpath(folder / video, run_dir)
                       if video else video}
            if kept and len(pieces := videos.pieces.get(g, [])) > 1:
                rows[g]["videos"] = pieces
    if rows or (run_dir / f"{name}{RESULTS_SUFFIX}").exists():
        text = "".join(json.dumps(rows[g], allow_nan=False) + "\n" for g in sorted(rows))
        atomic_write_bytes(run_dir / f"{name}{RESULTS_SUFFIX}", text.encode())
