"""`LeRobotWriter`: a LeRobot v3.0 dataset written episode by episode, crash-safe, many episodes per file.

Each finished episode first becomes a committed *part* in ``NAME.lerobot.parts/``: its camera videos
(``ep_SSSSSSSS.<key>.mp4``, encoded in fastrecord's encoder processes) and then its rows
(``ep_SSSSSSSS.parquet``, written under a temporary name and renamed: the commit; its parquet metadata
carries the episode's statistics and the dataset's features). Right after, the committed parts, in
episode order, go into the dataset's last file group (`roll`, on the writer's timer thread, never the
caller's; one write at a time, taking every part committed meanwhile): ``data/chunk-CCC/file-FFF.parquet``,
one ``videos/<key>/chunk-CCC/file-FFF.mp4`` per camera and ``meta/episodes/chunk-CCC/file-FFF.parquet``.
That group grows: it is rewritten with the new episodes after its old ones (the videos joined without re-encoding,
`fastrecord.sinks.lerobot.video.concat_mp4`: the old episodes keep their times) until it passes a size
limit (LeRobot's: 100 MB of data, 200 MB of video), then the next group starts; LeRobot's own writer
rewrites its current video file at every episode the same way. Writing a group: the videos (through a
temporary file and a rename each), the rows under a hidden name (``.file-FFF.parquet.next``), the
episodes file as ``file-FFF.parquet.pending`` (the commit of the group: its parquet metadata lists the
parts it holds), the renames that give both their names, then ``meta/tasks.parquet``,
``meta/stats.json`` and ``meta/info.json`` with the new totals, and the parts are removed. The parts'
statistics and rows, and the file groups up to the ``.pending`` commit, are written in the writer's helper
processes (`fastrecord.sinks.lerobot.files`: off the caller's GIL); the renames and meta files here.

Rewrites keep to a third of the time (`roll`: parts committed within twice the last write's duration
wait for a timer). LeRobot's reader reads the episodes and rows that meta/info.json counts (its length
is ``total_frames``), and every file appears atomically, so after a kill at any moment LeRobot loads the
dataset as it is, with every episode a group write took in, every frame readable:
rows and episodes past info.json's totals wait there unseen, a video's episodes past them are never
asked for. Opening the writer again on the same folders (``resume``: ``if_exists="resume"``, or
`fastrecord.sinks.lerobot.check.repair`, which ``fastrecord consolidate NAME.lerobot`` runs) finishes a committed
group's renames, counts what info.json did not, removes what an interrupted step left half done (dataset files past the
last committed episodes file, parts already in a file, videos of uncommitted parts) and carries on: the pending parts go
into a new file group.
Where a meta file's write fails after a group took its name (a full disk), the group's episodes count as filed
(no later write puts them in a file again); the meta files are written again before the next group and at the
close, which raises that error where they still cannot be written (a resume then counts them).
A part's number is the recorder's episode id, and only the episodes the whole run committed (``limit``:
its results rows, `fastrecord.sinks.results`) go into dataset files.
"""

from __future__ import annotations

import contextlib
import json
import queue
import re
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord.processes import IsolatedProcess
from fastrecord.sinks.lerobot.files import (
    FILE_META,
    MODULE,
    PART_META,
    PENDING,
    staged_path,
    write_parquet,
)
from fastrecord.sinks.lerobot.layout import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DATA_FILE_SIZE_IN_MB,
    DEFAULT_VIDEO_FILE_SIZE_IN_MB,
    INFO_PATH,
    STATS_PATH,
    TASKS_PATH,
    VIDEO_PATH,
    chunk_file,
    episode_columns,
    features_of,
    info_json,
    state_leaves,
    state_names,
    write_json,
)
from fastrecord.sinks.lerobot.stats import aggregate_stats, sampled_frames, unflat_stats
from fastrecord.staging import locate, on_arena_close

PART_RE = re.compile(r"^ep_(\d{8})\.parquet$")
SEGMENT_RE = re.compile(r"^ep_(\d{8})\.(.+)\.mp4$")
INSTALL = "pip install 'fastrecord[lerobot]' (or pip install pyarrow pandas)"


def import_pyarrow() -> Any:
    """pyarrow, once pyarrow.parquet and pandas (meta/tasks.parquet is a pandas frame: its index is the
    task) import, or a ValueError naming the install command."""
    import importlib

    for module in ("pyarrow", "pyarrow.parquet", "pandas"):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(
                f"lerobot=True writes parquet files with pyarrow and pandas, and {e.name or module} is not "
                f"installed: {INSTALL}"
            ) from None
    return importlib.import_module("pyarrow")


@dataclass
class _Part:
    """A committed part: one finished episode not yet in a dataset file."""

    seq: int
    length: int
    stats: dict[str, dict[str, Any]]
    videos: dict[str, str]  # camera key -> segment file name
    data_bytes: int
    video_bytes: dict[str, int] = field(default_factory=dict)
    entry: dict[str, Any] = field(
        default_factory=dict
    )  # the episode's place in a sharded run (global_index, source_rank)


@dataclass
class _OpenFile:
    """The last file group of the dataset, still growing: rewritten with each new batch of parts until
    it passes a size limit (its episodes rows live in the group process: `files.write_group`)."""

    group: int  # its running number (chunk_file)
    held: int = 0  # the episodes it holds
    data_bytes: int = 0
    video_bytes: dict[str, int] = field(default_factory=dict)


class LeRobotWriter:
    """Owns: the dataset folder ``root`` and its parts folder ``parts`` (see the module docstring), the
    order of the episodes (``reserve``), the files written so far, the dataset's features (fixed by
    the first episode) and its helper processes (`fastrecord.sinks.lerobot.files`): up to
    ``part_processes`` that commit parts (statistics, rows), one that writes the file groups; the calling
    threads only wait on them (and on the encoder processes), so the caller's GIL stays free.

    ``write_episode`` runs on any number of threads; ``close`` puts every committed part into files."""

    def __init__(self, root: Path, parts: Path, *, fps: float | None = None, task: str | None = None,
                 robot_type: str | None = None, video: Any = None, resume: bool = False,
                 state_keys: Sequence[str] | None = None, state_layout: Sequence[tuple[str, int]] | None = None,
                 limit: Any = None, chunks_size: int = DEFAULT_CHUNK_SIZE,
                 data_files_size_in_mb: float = DEFAULT_DATA_FILE_SIZE_IN_MB,
                 video_files_size_in_mb: float = DEFAULT_VIDEO_FILE_SIZE_IN_MB, part_processes: int = 1,
                 encode_slot: Callable[[], contextlib.AbstractContextManager[Any]] | None = None) -> None:
        self.pa = import_pyarrow()
        import pyarrow.parquet as pq

        self.pq = pq
        self.root, self.parts = Path(root), Path(parts)
        self.fps, self.task, self.robot_type = fps, task, robot_type
        self.video = video  # fastrecord.video.VideoSettings of the episode videos (fps = the dataset's)
        self.state_keys = state_keys  # observation leaves of observation.state (None: all but the cameras')
        self.state_layout = state_layout  # the env's state leaves (path, width) in its order
        self.chunks_size, self.data_mb, self.video_mb = chunks_size, data_files_size_in_mb, video_files_size_in_mb
        self.features: dict[str, Any] | None = None
        self.files = 0  # dataset files written (of each kind)
        self.episodes = 0  # episodes in them
        self.frames = 0  # rows in them
        self._stats: dict[str, Any] | None = None  # stats.json: the episodes' in files, aggregated as LeRobot does
        self._open: _OpenFile | None = None  # the file group still growing (None: the next batch starts one)
        self._order: list[int] = []  # parts expected, in episode order, not yet in a file
        self._ready: dict[int, _Part] = {}  # committed parts by sequence number
        self._next_seq = 0
        self._committed_seqs: set[int] = set()  # sequence numbers committed as parts by this writer
        # limit() -> n: only parts 0 .. n-1 go into dataset files (the episodes the whole run committed: a
        # recorder's `RunDirectory.committed`), so a dataset file never holds an episode another output lacks
        self.limit = limit
        # held around each video's encode: a recorder's `fastrecord.video.pool.EncodeGate` (its encoders at once)
        self.encode_slot = encode_slot or contextlib.nullcontext
        self._lock = threading.Lock()  # the fields above
        self._files_lock = threading.Lock()  # one thread writes dataset files at a time
        self._quiet_until = 0.0  # time.monotonic() before which parts wait (`roll`)
        self._timer: threading.Timer | None = None  # writes the waiting parts after the quiet time
        self._error: BaseException | None = None  # the timer's write failed: raised by the next call
        self._closed = False
        self._max_part_procs = max(1, int(part_processes))
        self._part_procs: list[IsolatedProcess] = []  # started on demand, up to _max_part_procs
        self._idle_procs: queue.Queue[IsolatedProcess] = queue.Queue()
        self._group_proc: IsolatedProcess | None = None  # writes the file groups (holds the open group's rows)
        self._group_error: BaseException | None = None  # a file group's write failed: no further group writes
        self._meta_behind = False  # a group took its name, its meta files not yet written (`_catch_up_meta`)
        self._mapped: dict[int, set[int]] = {}  # a part process's pid -> the staging arenas it has mapped
        on_arena_close(self._forget_arena)
        if resume:
            self._recover()
        elif self._holds_anything():
            raise ValueError(f"{self.root} or {self.parts} already holds a dataset; resume it (if_exists='resume') or "
                             f"remove it (if_exists='overwrite')")

    # -------------------------------------------------------------- episodes
    def reserve(self, seq: int | None = None) -> int:
        """The sequence number of the next episode (its place in the dataset; ``seq``: the recorder's
        episode id, which it equals in a run); on the stepping thread, in episode order."""
        with self._lock:
            seq = self._next_seq if seq is None else int(seq)
            self._next_seq = seq + 1
            self._order.append(seq)
            return seq

    def committed(self, seq: int) -> bool:
        """Whether episode ``seq`` is committed (a part, or already in a dataset file)."""
        with self._lock:
            return seq in self._committed_seqs

    def write_episode(self, seq: int, datasets: Mapping[str, np.ndarray], length: int,
                      entry: Mapping[str, Any] | None = None) -> None:
        """Commit episode ``seq`` as a part (videos encoded, then its rows, statistics computed), then
        put the committed parts into the dataset's files (`roll`). ``entry``: JSON fields kept with the
        episode in the parquet metadata (a sharded run's ``global_index`` and ``source_rank``:
        `episode_entries` reads them back, `fastrecord.sinks.lerobot.join` orders the joined dataset by them)."""
        from fastrecord.video import encode_mp4

        fps = self._fps()
        cols, images = episode_columns(datasets, length, fps, self.state_keys, self.state_layout)
        names = state_names(state_leaves(datasets, self.state_keys, self.state_layout), datasets, self.state_layout)
        features = features_of(cols, images, fps, self.video.codec if self.video else "libx264", names)
        with self._lock:
            if self.features is None:
                self.features = features
            elif features != self.features:
                raise ValueError(f"episode {seq} has other columns or shapes than the dataset's first episode "
                                 f"({_diff(features, self.features)}); a LeRobot dataset holds one schema: record "
                                 f"episodes of one observation mode and camera setup per run")
        self.parts.mkdir(parents=True, exist_ok=True)
        videos, video_bytes = {}, {}
        for key, frames in images.items():
            with self.encode_slot():
                written = Path(encode_mp4(self.parts / f"ep_{seq:08d}.{key}.mp4", frames, self.video))
            videos[key], video_bytes[key] = written.name, written.stat().st_size
        entry = dict(entry or {})
        meta = dict(seq=seq, length=int(length), videos=videos, dataset=self._settings(), entry=entry)
        sampled = {k: sampled_frames(v) for k, v in images.items()}  # what the statistics read (pickled)
        path = self.parts / f"ep_{seq:08d}.parquet"
        stats, size = self._part_call(str(path), cols, sampled, fps, meta)
        part = _Part(seq, int(length), stats, videos, size, video_bytes, entry)
        with self._lock:
            self._ready[seq] = part
            self._committed_seqs.add(seq)
        self.roll()

    # -------------------------------------------------------------- helper processes
    def start_processes(self) -> None:
        """Start the group process and a part process now (their imports then overlap the caller's set-up)."""
        self._group()
        if not self._part_procs:
            self._idle_procs.put(self._new_part_proc())

    def _new_part_proc(self) -> IsolatedProcess:
        proc = IsolatedProcess(MODULE, f"the LeRobot part process {len(self._part_procs)}", keep_after_error=True,
                               background=False)
        with self._lock:
            self._part_procs.append(proc)
        return proc

    def _part_call(self, *args: Any) -> Any:
        """`files.write_part` in an idle part process (a new one while fewer than ``part_processes`` run)."""
        try:
            proc = self._idle_procs.get_nowait()
        except queue.Empty:
            with self._lock:
                more = len(self._part_procs) < self._max_part_procs and not self._closed
            proc = self._new_part_proc() if more else self._idle_procs.get()
        try:
            path, cols, sampled, fps, meta = args
            refs: dict[str, Any] = {}
            for key, frames in sampled.items():  # frames in staging memory are read there in place, not pickled
                loc = locate(frames) if frames.dtype == np.uint8 else None
                if loc is None:
                    refs[key] = frames
                    continue
                arena, offset = loc
                mapped = self._mapped.setdefault(proc.pid, set())
                if arena.id not in mapped:
                    proc.notify("map_arena", arena.id, arena.size, fds=[arena.fd])
                    mapped.add(arena.id)
                refs[key] = (arena.id, offset, tuple(frames.shape))
            return proc.call("write_part", path, cols, refs, fps, meta)
        finally:
            self._idle_procs.put(proc)

    def _forget_arena(self, arena_id: int) -> None:
        """A staging arena is being unmapped: the part processes that mapped it unmap it too."""
        for proc in list(self._part_procs):
            mapped = self._mapped.get(proc.pid, set())
            if arena_id in mapped:
                mapped.discard(arena_id)
                try:
                    proc.notify("forget_arena", arena_id)
                except RuntimeError:  # stopped or died: nothing left to unmap
                    pass

    def _group(self) -> IsolatedProcess:
        if self._group_proc is None:
            self._group_proc = IsolatedProcess(MODULE, "the LeRobot file group process", background=False)
        return self._group_proc

    def _stop_processes(self) -> None:
        procs = [*self._part_procs, *([self._group_proc] if self._group_proc is not None else [])]
        for proc in procs:
            proc.stop()

    def _fps(self) -> float:
        """The dataset's frame rate: the one given, else (resume) the one its parts and files record."""
        assert self.fps is not None, f"{self.root}: no fps given, and none in a dataset to take up"
        return self.fps

    def _settings(self) -> dict[str, Any]:
        """What a later writer of this dataset takes up (`_take_settings`), in every part and episodes file."""
        return dict(fps=self.fps, task=self.task, robot_type=self.robot_type, features=self.features)

    def _take_settings(self, found: Mapping[str, Any]) -> None:
        self.fps, self.task = self.fps or found["fps"], self.task or found["task"]
        self.robot_type = self.robot_type or found["robot_type"]
        self.features = self.features or found["features"]

    # -------------------------------------------------------------- dataset files
    def roll(self, final: bool = False) -> None:
        """Put the committed parts, in episode order, into the dataset's files: the last file group grows
        (is rewritten with them) until it passes a size limit, then the next one starts. Not ``final``: on a
        timer's thread, never the caller's (a group rewrite takes seconds at tens of thousands of rows; in
        the caller's thread it held a worker of the sink, and so the stepping thread, that long), and
        returns at once. A rewrite costs more as its group grows, so writing keeps to a third of the time:
        until twice the last write's duration has passed, the parts wait (committed; the timer writes them
        then). ``final``: here, every committed part, waiting for a write in flight first."""
        if final:
            self._write_committed(final=True)
            return
        self.raise_if_failed()
        self._wake_later()

    def _write_committed(self, final: bool) -> None:
        """The committed parts into the dataset's files (`roll`): not ``final``, one batch, or none while
        the quiet time lasts or another thread writes (that thread takes the newly committed parts too)."""
        while True:
            if not final and time.monotonic() < self._quiet_until:
                self._wake_later()
                return
            if not self._files_lock.acquire(blocking=final):
                return
            try:
                while True:
                    with self._lock:
                        batch = self._committed()
                    if not batch:
                        break
                    start = time.monotonic()
                    self._write_batch(batch)  # each part leaves the waiting ones as its group takes its name
                    self._quiet_until = time.monotonic() + 2 * (time.monotonic() - start)
                    if not final:  # the parts committed meanwhile wait for the quiet time
                        break
            finally:
                self._files_lock.release()
            with self._lock:  # a part committed while this thread held the lock, and its thread returned
                if final or not self._committed():
                    return

    def _wake_later(self) -> None:
        """A timer that writes the waiting parts once the quiet time is over (one at a time)."""
        with self._lock:
            if self._timer is not None or self._closed:
                return
            self._timer = threading.Timer(max(0.0, self._quiet_until - time.monotonic()), self._on_timer)
            self._timer.daemon = True
            self._timer.start()

    def _on_timer(self) -> None:
        with self._lock:
            self._timer = None
            if self._closed:
                return
        try:
            self._write_committed(final=False)
        except BaseException as e:  # noqa: BLE001 - kept, raised in the caller's thread (raise_if_failed)
            self._error = self._error or e

    def raise_if_failed(self) -> None:
        """Raise the error of a background write (the timer's), once, in the caller's thread."""
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def _committed(self) -> list[_Part]:
        """The committed prefix of the episode order."""
        batch: list[_Part] = []
        limit = self.limit() if self.limit is not None else None
        for seq in self._order:
            part = self._ready.get(seq)
            if part is None or (limit is not None and seq >= limit):
                break
            batch.append(part)
        return batch

    def _write_batch(self, batch: Sequence[_Part]) -> None:
        """Write ``batch`` into the open file group, closing it (and starting the next) where a size limit
        is passed."""
        i = 0
        while i < len(batch):
            open_ = self._open or _OpenFile(self.files)
            data, video = open_.data_bytes, dict(open_.video_bytes)
            j, full = i, False
            while j < len(batch) and not full:
                part = batch[j]
                data += part.data_bytes
                for k, v in part.video_bytes.items():
                    video[k] = video.get(k, 0) + v
                full = data >= self.data_mb * 2**20 or any(v >= self.video_mb * 2**20 for v in video.values())
                j += 1
            self._write_file(open_, batch[i:j], full)
            i = j

    def _write_file(self, open_: _OpenFile, batch: Sequence[_Part], full: bool) -> None:
        """(Re)write the file group ``open_`` with ``batch`` after the episodes it holds: the group process
        writes each camera's video (the old file's packets, then the parts', without re-encoding: the
        episodes already in it keep their times), the rows under a hidden name and the episodes file as
        ``.pending`` (the commit, `files.write_group`); then here the renames that give both their names,
        and the meta files, meta/info.json last: LeRobot's reader reads the rows and episodes info.json
        counts, so every step leaves the dataset it loads whole."""
        if self._group_error is not None:  # the group process failed: its open group is not trusted
            raise self._group_error
        self._catch_up_meta()
        jobs = [dict(seq=p.seq, stats=p.stats, videos=p.videos, entry=p.entry) for p in batch]
        try:
            done = self._group().call("write_group", str(self.root), str(self.parts), open_.group, open_.held == 0,
                                      jobs, self.episodes, self.frames, self._stats, self._settings(),
                                      self.chunks_size)
        except BaseException as e:
            self._group_error = e
            raise
        open_.held += len(batch)
        open_.data_bytes, open_.video_bytes = done["data_bytes"], dict(done["video_bytes"])
        self._stats = done["stats"]
        self.files, self.episodes, self.frames = max(self.files, open_.group + 1), done["episodes"], done["frames"]
        try:
            Path(done["staged"]).replace(done["data"])  # rows past info.json's totals: LeRobot reads what it counts
            Path(done["pending"]).replace(done["final"])  # the group's commit: its episodes are in the files
        except BaseException as e:  # the group's state on disk is unknown: no further group writes
            self._group_error = e
            raise
        with self._lock:  # filed: no later write puts these episodes in the files again
            for part in batch:
                self._order.remove(part.seq)
                del self._ready[part.seq]
        self._open = None if full else open_
        self._meta_behind = True
        self._catch_up_meta()  # info.json last: LeRobot's reader sees the new episodes from here on
        for part in batch:
            self._remove_part(part)

    def _catch_up_meta(self) -> None:
        """Write the meta files (meta/info.json last) where the dataset's files are ahead of them: after each
        group's commit, and again at the next group write and at close where that write failed (a full disk)."""
        if self._meta_behind:
            self._write_meta()
            self._meta_behind = False

    def _write_meta(self) -> None:
        import pandas as pd

        info = info_json(features=self.features or {}, fps=self._fps(), robot_type=self.robot_type or "unknown",
                         episodes=self.episodes, frames=self.frames, chunks_size=self.chunks_size,
                         data_mb=self.data_mb, video_mb=self.video_mb)
        tasks = pd.DataFrame({"task_index": [0]}, index=[self.task])
        write_parquet(self.pa.Table.from_pandas(tasks), self.root / TASKS_PATH)
        write_json(self.root / STATS_PATH, self._stats or {})
        write_json(self.root / INFO_PATH, info)

    def _remove_part(self, part: _Part) -> None:
        """Its files by name (a glob would list the whole parts folder for every episode)."""
        for name in (f"ep_{part.seq:08d}.parquet", *part.videos.values()):
            (self.parts / name).unlink(missing_ok=True)

    # -------------------------------------------------------------- recovery
    def _holds_anything(self) -> bool:
        return any(p.exists() and any(p.iterdir()) for p in (self.root, self.parts) if p.is_dir())

    def _recover(self) -> None:
        """Take up a dataset left by an earlier writer (closed, or killed at any point): see the module
        docstring."""
        consumed: set[int] = set()
        for p in (self.root / "meta" / "episodes").glob(f"chunk-*/file-*.parquet{PENDING}"):
            final = p.with_name(p.name[: -len(PENDING)])
            data = self.root / "data" / final.relative_to(self.root / "meta" / "episodes")
            if staged_path(data).exists():  # committed with its rows still hidden: shown now
                staged_path(data).replace(data)
            p.replace(final)  # committed: info.json is rewritten below
        paths = sorted((self.root / "meta" / "episodes").glob("chunk-*/file-*.parquet"))
        found: list[dict[str, Any]] = []
        rows: list[dict[str, Any]] = []
        for path in paths:
            table = self.pq.read_table(path)
            meta = json.loads(table.schema.metadata[FILE_META])
            consumed.update(meta["parts"])
            self._take_settings(meta["dataset"])
            rows = table.to_pylist()
            for row in rows:
                found.append(unflat_stats(row))
                self.frames = max(self.frames, int(row["dataset_to_index"]))
            self.episodes += table.num_rows
        self._stats = aggregate_stats(found) if found else None
        self.files = len(paths)
        if paths:
            self._trim_videos(len(paths) - 1, rows)
        for kind in ("data", "videos"):  # files of a file group whose episodes file was never committed
            for p in (self.root / kind).rglob("*") if (self.root / kind).is_dir() else ():
                chunk = re.match(r"^chunk-(\d+)$", p.parent.name)
                file = re.match(r"^file-(\d+)\.(parquet|mp4)$", p.name)
                if p.is_file() and (
                    p.name.startswith(".")
                    or (chunk and file and int(chunk[1]) * self.chunks_size + int(file[1]) >= self.files)
                ):
                    p.unlink()
        for p in self.root.rglob(".*.tmp") if self.root.is_dir() else ():
            p.unlink()
        seqs = set(consumed)
        pending: list[_Part] = []
        for p in sorted(self.parts.iterdir()) if self.parts.is_dir() else ():
            m = PART_RE.match(p.name)
            if not m:
                continue
            seq = int(m.group(1))
            seqs.add(seq)
            if seq in consumed:
                continue
            meta = json.loads(self.pq.read_schema(p).metadata[PART_META])
            self._take_settings(meta["dataset"])
            sizes = {k: (self.parts / v).stat().st_size for k, v in meta["videos"].items()}
            pending.append(_Part(seq, meta["length"], meta["stats"], meta["videos"], p.stat().st_size, sizes,
                                 meta.get("entry", {})))
        committed = {p.seq for p in pending}
        for p in list(self.parts.iterdir()) if self.parts.is_dir() else ():
            m = PART_RE.match(p.name) or SEGMENT_RE.match(p.name)
            if m is None or int(m.group(1)) not in committed:  # in a file already, an unfinished part's video, a .tmp
                p.unlink()
        self._order = [p.seq for p in pending]
        self._ready = {p.seq: p for p in pending}
        if self.files:
            self._write_meta()  # what a kill after a file's commit left undone
        self._next_seq = max(seqs) + 1 if seqs else 0

    def _trim_videos(self, group: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """Cut the last file group's videos back to its episodes (``rows``): a kill after a video's new
        version and before its episodes file left frames past them (unread, but not part of the dataset)."""
        from fastrecord.sinks.lerobot.video import split_mp4

        where = dict(zip(("chunk_index", "file_index"), chunk_file(group, self.chunks_size), strict=True))
        for key in [k for k, v in (self.features or {}).items() if v.get("dtype") == "video"]:
            path = self.root / VIDEO_PATH.format(video_key=key, **where)
            end = max(float(r[f"videos/{key}/to_timestamp"]) for r in rows)
            with av_open(path) as c:
                stream = c.streams.video[0]
                last = max((p.pts + (p.duration or 0) for p in c.demux(stream) if p.pts is not None), default=0)
                longer = float(last * stream.time_base) > end + 1e-6
            if longer:
                split_mp4(path, [(0.0, end)], [path])

    @property
    def pending(self) -> int:
        """Committed episodes not yet in a dataset file."""
        with self._lock:
            return len(self._ready)

    def close(self) -> None:
        """Put every committed part into dataset files (parts that never committed are dropped: their
        episodes failed), then remove the parts folder; raises a background write's error."""
        with self._lock:
            self._order = [s for s in self._order if s in self._ready]
            self._closed, timer, self._timer = True, self._timer, None
        if timer is not None:
            timer.cancel()
        try:
            self.roll(final=True)
            self._catch_up_meta()
        finally:
            self._stop_processes()
        self.raise_if_failed()
        if self.parts.is_dir():
            for p in self.parts.iterdir():
                m = PART_RE.match(p.name) or SEGMENT_RE.match(p.name)
                if not m or int(m.group(1)) not in self._ready:
                    p.unlink()  # videos of parts that never committed (parts past `limit` stay, with theirs)
            if not any(self.parts.iterdir()):
                shutil.rmtree(self.parts, ignore_errors=True)


def av_open(path: Path) -> Any:
    import av

    return av.open(str(path))


def _diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    keys = sorted(set(a) ^ set(b)) or sorted(k for k in a if a[k] != b.get(k))
    return ", ".join(
        f"{k}: {a.get(k, {}).get('shape', 'absent')} vs {b.get(k, {}).get('shape', 'absent')}" for k in keys[:4]
    )
