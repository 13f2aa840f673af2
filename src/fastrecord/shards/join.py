"""Joining the shards of a run into one ManiSkill dataset: `merge` builds ``DIR/NAME.h5`` +
``DIR/NAME.json`` from ``DIR/NAME.shards/rank*/`` and says what it found in a `MergeReport`.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastrecord.shards.layout import SHARDS_SUFFIX, global_index_of, list_shards, results_rows, shards_root
from fastrecord.sinks.maniskill_h5.layout import read_json
from fastrecord.sinks.results import RESULTS_SUFFIX

log = logging.getLogger("fastrecord")


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
    trajectory: bool = True
    lerobot_path: Path | None = (
        None  # DIR/NAME.lerobot, joined from the shards' LeRobot datasets (None: they have none)
    )
    lerobot_episodes: int = 0  # episodes in it
    lerobot_missing: list[int] = field(default_factory=list)  # in NAME.h5, but in no shard's LeRobot dataset files

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
    with merging(run_dir, name):
        return _merge(run_dir, name, links=links, expected=expected)


@contextlib.contextmanager
def merging(run_dir: Path, name: str) -> Iterator[None]:
    """Hold ``run_dir/.NAME.merge.lock`` (an exclusive ``flock``; the kernel releases it if the process
    dies): one merge of run ``NAME`` at a time. Not the run's own lock ``.NAME.lock``: rank 0 holds that
    for the whole recording and merges under it, and a merge while the run records is allowed. A second
    merge logs that it waits, then waits."""
    path = run_dir / f".{name}.merge.lock"
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "unknown process"
            log.warning("fastrecord: waiting for another merge of %r in %s (%s) to end", name, str(run_dir), holder)
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:  # the holder removes the file as it ends: a lock on a removed file is no lock, take the new one
            if os.fstat(fd).st_ino == os.stat(path).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}".encode(), 0)
        yield
    finally:
        path.unlink(missing_ok=True)  # before the close that releases it: a waiter then sees it removed
        os.close(fd)


def _merge(run_dir: Path, name: str, *, links: bool, expected: int | None) -> MergeReport:
    """`merge`'s work, under `merging`."""
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
    h5_path, json_path = run_dir / f"{name}.h5", run_dir / f"{name}.json"
    report = MergeReport(h5_path, json_path, expected=expected, consolidated=not links)

    header: dict[str, Any] | None = None
    header_rank = -1
    chosen: dict[int, tuple[int, dict[str, Any]]] = {}  # g -> (rank, shard entry)
    dropped: set[int] = set()
    from fastrecord.sinks.reconcile import inspect_run

    damaged = None
    for rank, folder in shards.items():
        limit = None  # a shard's committed episodes (its results file's commit log): what it holds past them is not
        if lock_held(folder, name):
            report.recording.append(rank)
        else:
            if read_manifest(folder / f"{name}{MANIFEST_SUFFIX}").get("status") == "recording":
                report.crashed.append(rank)
            state = inspect_run(folder, name, videos=False)
            if state.problems and damaged is None:  # raised once the entries are checked (a bad one says more)
                damaged = f"not merging run {name!r}: its shard {folder.relative_to(run_dir)}: {state.problems[0]}"
            limit = state.committed if state.rows is not None else None
        for row in results_rows(folder, name):
            if row.get("episode_id") is None and "global_index" in row:
                dropped.add(
                    global_index_of(row, folder / f"{name}{RESULTS_SUFFIX}", f", or move {folder} out of {root}")
                )
        doc = read_json(folder / f"{name}.json")
        if doc is None:
            continue
        shard_header = {k: v for k, v in doc.items() if k != "episodes"}
        if header is None:
            header, header_rank = shard_header, rank
        elif _comparable(shard_header.get("env_info")) != _comparable(header.get("env_info")):
            raise ValueError(
                f"the shards disagree on env_info: rank {header_rank} has {header.get('env_info')!r}, rank {rank} has "
                f"{shard_header.get('env_info')!r} ({folder}); they are not one run. Move the foreign shard folder out "
                f"of {root} and merge again"
            )
        for e in doc.get("episodes", []):
            if not isinstance(e, dict) or "global_index" not in e or "episode_id" not in e:
                raise ValueError(f"{folder / (name + '.json')} has an episode entry without global_index/episode_id "
                                 f"({str(e)[:120]}); it is not a shard of a sharded run. Move it out of {root}")
            g = global_index_of(e, folder / f"{name}.json", f", or move {folder} out of {root}")
            if isinstance(e["episode_id"], bool) or not isinstance(e["episode_id"], int):
                raise ValueError(
                    f"{folder / (name + '.json')} has an episode entry with episode_id={e['episode_id']!r} "
                    f"(global_index {g}); it must be the episode's group number in that shard's {name}.h5 "
                    f"(traj_<episode_id>). Fix that entry, or move {folder} out of {root}"
                )
            if limit is not None and e["episode_id"] >= limit:
                continue  # left by a stop before the shard's other outputs held it: its resume records it again
            if g in chosen:
                report.duplicates.append(g)
                continue
            chosen[g] = (rank, e)
    if damaged is not None:
        raise ValueError(damaged)
    lerobot = _lerobot_roots(shards, name)
    if header is None and not lerobot:
        raise NothingToMerge(
            f"no shard in {str(root)!r} has a readable {name}.json yet (recording without a trajectory, "
            f"or nothing finished); there is nothing to join"
        )

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
    if header is not None:
        from fastrecord.sinks.maniskill_h5.merge import join_runs

        join_runs(h5_path, sources, {**header, "episodes": episodes}, links=links)
    else:
        report.trajectory = False
    if lerobot:
        present = _join_lerobot(run_dir, name, lerobot, report)
        report.lerobot_missing = sorted(set(order) - set(present))
        if header is None:
            chosen = {g: (rank, {}) for g, rank in present.items()}
            order = sorted(chosen)
    top = max([*order, *dropped], default=-1) + 1
    span = range(expected if expected is not None else top)
    report.dropped = sorted(g for g in dropped if g not in chosen)
    report.missing = [g for g in span if g not in chosen and g not in dropped]
    report.duplicates = sorted(set(report.duplicates))
    _join_results(run_dir, name, shards, chosen)
    return report


def _join_results(run_dir: Path, name: str, shards: dict[int, Path],
                  chosen: dict[int, tuple[int, dict[str, Any]]]) -> None:
    """``DIR/NAME.results.jsonl``: every global episode's results row once, by global index, as an unsharded
    run's (``episode_id`` its id in the joined ``NAME.h5``, null if not kept; ``video`` relative to ``DIR``):
    a kept episode's row is the one of the shard entry joined, an episode not kept gets its last row."""
    from fastrecord.sinks.base import atomic_write_bytes

    rows: dict[int, dict[str, Any]] = {}
    for rank, folder in shards.items():
        for row in results_rows(folder, name):
            if "global_index" not in row:
                continue
            g = global_index_of(row, folder / f"{name}{RESULTS_SUFFIX}", f", or move {folder} out of {folder.parent}")
            kept = chosen.get(g)
            if kept is not None and (kept[0] != rank or kept[1].get("episode_id") != row.get("episode_id")):
                continue  # a row of another copy of a joined episode
            video = row.get("video")
            rows[g] = {**row, "episode_id": g if kept is not None else None, "source_rank": rank,
                       "video": os.path.relpath(folder / video, run_dir) if video else video}
    if rows or (run_dir / f"{name}{RESULTS_SUFFIX}").exists():
        text = "".join(json.dumps(rows[g], allow_nan=False) + "\n" for g in sorted(rows))
        atomic_write_bytes(run_dir / f"{name}{RESULTS_SUFFIX}", text.encode())


def _lerobot_roots(shards: dict[int, Path], name: str) -> dict[int, Path]:
    """{rank: its ``NAME.lerobot``} of the shards that recorded a LeRobot dataset (its folder, or its parts
    folder, exists)."""
    from fastrecord.sinks.lerobot.layout import dataset_paths

    return {rank: dataset_paths(folder, name)[0] for rank, folder in shards.items()
            if any(p.is_dir() for p in dataset_paths(folder, name))}


def _join_lerobot(run_dir: Path, name: str, roots: dict[int, Path], report: MergeReport) -> dict[int, int]:
    """Join the shards' LeRobot datasets ``roots`` into ``DIR/NAME.lerobot``: each global episode once
    (the lowest rank's), ordered by global index, renumbered 0..N-1 (`fastrecord.sinks.lerobot.join`).
    Returns {global episode: rank} of those joined. Without a trajectory, ``report.shards`` counts them."""
    from fastrecord.sinks.lerobot.join import episode_entries, join_datasets
    from fastrecord.sinks.lerobot.layout import DATASET_SUFFIX

    shards = {rank: root.parent for rank, root in roots.items()}
    chosen: dict[int, tuple[Path, int, dict[str, Any]]] = {}
    for rank, root in roots.items():
        for ep, entry, _ in episode_entries(root) if root.is_dir() else ():
            if "global_index" not in entry:
                raise ValueError(
                    f"{root} has episode {ep} without a global_index (written by an older fastrecord, or "
                    f"not by a sharded run); it cannot be placed in the joined dataset. Move {shards[rank]} "
                    f"out of {shards_root(run_dir, name)}"
                )
            g = global_index_of(entry, root, f", or move {shards[rank]} out of {shards_root(run_dir, name)}")
            if g in chosen:
                report.duplicates.append(g)
                continue
            chosen[g] = (root, ep, {"global_index": g, "source_rank": rank})
    target = run_dir / f"{name}{DATASET_SUFFIX}"
    report.lerobot_episodes = join_datasets(target, [chosen[g] for g in sorted(chosen)])
    report.lerobot_path = target if target.is_dir() else None
    if not report.trajectory:
        for _, _, entry in chosen.values():
            report.shards[entry["source_rank"]] = report.shards.get(entry["source_rank"], 0) + 1
    return {g: entry["source_rank"] for g, (_, _, entry) in chosen.items()}
