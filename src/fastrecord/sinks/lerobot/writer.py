"""`LeRobotWriter`: a LeRobot v3.0 dataset written episode by episode, crash-safe, many episodes per file.

Each finished episode first becomes a committed *part* in ``NAME.lerobot.parts/``: its camera videos
(``ep_SSSSSSSS.<key>.mp4``, encoded in fastrecord's encoder processes) and then its rows
(``ep_SSSSSSSS.parquet``, written under a temporary name and renamed: the commit; its parquet metadata
carries the episode's statistics and the dataset's features). Once the committed parts, in episode
order, pass a file size limit (LeRobot's: 100 MB of data, 500 MB of video), and at ``close()``, they
become the next dataset file of each kind: ``data/chunk-CCC/file-FFF.parquet``, one
``videos/<key>/chunk-CCC/file-FFF.mp4`` per camera (the episode videos joined without re-encoding,
`fastrecord.sinks.lerobot.video.concat_mp4`) and ``meta/episodes/chunk-CCC/file-FFF.parquet``, first
written as ``file-FFF.parquet.pending``: the commit of the file (its parquet metadata lists the parts it
holds; the data file is written before it under a hidden name). Then ``meta/tasks.parquet``,
``meta/stats.json`` and ``meta/info.json`` are rewritten with the new totals, the data file and then the
episodes file take their names (so LeRobot's reader sees them and the totals together) and the parts
are removed. Every file appears atomically, and no dataset file is ever rewritten.

After a kill, every finished episode is readable: those of earlier files in the dataset (LeRobot loads
it: its files and meta/info.json agree, but for a kill between the two renames that end a file: a data
file's rows wait under a hidden name, ``.file-FFF.parquet.next``, until info.json counts them), the
others as parts (parquet + MP4). Opening the writer again on the same folders (``resume``:
``if_exists="resume"``, or `fastrecord.sinks.lerobot.check.repair`, which ``fastrecord consolidate
NAME.lerobot`` runs) removes what an interrupted step left half done (dataset files past the last committed
episodes file, parts already in a file, videos of uncommitted parts) and carries on: the pending parts go into
the next file. A part's number is the recorder's episode id, and only the episodes the whole run committed
(``limit``: its results rows, `fastrecord.sinks.results`) go into dataset files.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord.sinks.lerobot.layout import (
    DATA_PATH,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DATA_FILE_SIZE_IN_MB,
    DEFAULT_VIDEO_FILE_SIZE_IN_MB,
    EPISODES_PATH,
    INFO_PATH,
    STATS_PATH,
    TASKS_PATH,
    VIDEO_PATH,
    aggregate_stats,
    chunk_file,
    episode_columns,
    episode_stats,
    features_of,
    flat_stats,
    info_json,
    unflat_stats,
    write_file,
    write_json,
)

PART_META = b"fastrecord.lerobot.part"  # a part's parquet metadata: its episode and the dataset's settings
FILE_META = b"fastrecord.lerobot.parts"  # an episodes file's parquet metadata: the parts it holds
PENDING = ".pending"  # meta/episodes/.../file-FFF.parquet.pending: committed, info.json not yet rewritten
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
            raise ValueError(f"lerobot=True writes parquet files with pyarrow and pandas, and {e.name or module} is not "
                             f"installed: {INSTALL}") from None
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
    entry: dict[str, Any] = field(default_factory=dict)  # the episode's place in a sharded run (global_index, source_rank)


class LeRobotWriter:
    """Owns: the dataset folder ``root`` and its parts folder ``parts`` (see the module docstring), the
    order of the episodes (``reserve``), the files written so far and the dataset's features (fixed by
    the first episode).

    ``write_episode`` runs on any number of threads; ``close`` puts every committed part into files."""

    def __init__(self, root: Path, parts: Path, *, fps: float | None = None, task: str | None = None,
                 robot_type: str | None = None, video: Any = None, resume: bool = False,
                 limit: Any = None, chunks_size: int = DEFAULT_CHUNK_SIZE,
                 data_files_size_in_mb: float = DEFAULT_DATA_FILE_SIZE_IN_MB,
                 video_files_size_in_mb: float = DEFAULT_VIDEO_FILE_SIZE_IN_MB) -> None:
        self.pa = import_pyarrow()
        import pyarrow.parquet as pq

        self.pq = pq
        self.root, self.parts = Path(root), Path(parts)
        self.fps, self.task, self.robot_type = fps, task, robot_type
        self.video = video  # fastrecord.video.VideoSettings of the episode videos (fps = the dataset's)
        self.chunks_size, self.data_mb, self.video_mb = chunks_size, data_files_size_in_mb, video_files_size_in_mb
        self.features: dict[str, Any] | None = None
        self.files = 0  # dataset files written (of each kind)
        self.episodes = 0  # episodes in them
        self.frames = 0  # rows in them
        self._episode_stats: list[dict[str, Any]] = []  # per episode in files, for stats.json
        self._order: list[int] = []  # parts expected, in episode order, not yet in a file
        self._ready: dict[int, _Part] = {}  # committed parts by sequence number
        self._next_seq = 0
        self._committed: set[int] = set()  # sequence numbers committed as parts by this writer
        # limit() -> n: only parts 0 .. n-1 go into dataset files (the episodes the whole run committed: a
        # recorder's `RunDirectory.committed`), so a dataset file never holds an episode another output lacks
        self.limit = limit
        self._lock = threading.Lock()  # the fields above
        self._files_lock = threading.Lock()  # one thread writes dataset files at a time
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
            return seq in self._committed

    def write_episode(self, seq: int, datasets: Mapping[str, np.ndarray], length: int,
                      entry: Mapping[str, Any] | None = None) -> None:
        """Commit episode ``seq`` as a part (videos encoded, then its rows), then write dataset files if
        the committed parts passed a size limit. ``entry``: JSON fields kept with the episode in the
        parquet metadata (a sharded run's ``global_index`` and ``source_rank``: `episode_entries` reads
        them back, `fastrecord.sinks.lerobot.join` orders the joined dataset by them)."""
        from fastrecord.video import encode_mp4

        cols, images = episode_columns(datasets, length, self.fps)
        features = features_of(cols, images, self.fps, self.video.codec if self.video else "h264")
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
            written = Path(encode_mp4(self.parts / f"ep_{seq:08d}.{key}.mp4", frames, self.video))
            videos[key], video_bytes[key] = written.name, written.stat().st_size
        stats = episode_stats(cols, images)
        entry = dict(entry or {})
        meta = dict(seq=seq, length=int(length), stats=stats, videos=videos, dataset=self._settings(), entry=entry)
        table = self._table(cols).replace_schema_metadata({PART_META: json.dumps(meta)})
        path = self.parts / f"ep_{seq:08d}.parquet"
        self._write_parquet(table, path)
        part = _Part(seq, int(length), stats, videos, path.stat().st_size, video_bytes, entry)
        with self._lock:
            self._ready[seq] = part
            self._committed.add(seq)
        self.roll()

    def _settings(self) -> dict[str, Any]:
        """What a later writer of this dataset takes up (`_take_settings`), in every part and episodes file."""
        return dict(fps=self.fps, task=self.task, robot_type=self.robot_type, features=self.features)

    def _take_settings(self, found: Mapping[str, Any]) -> None:
        self.fps, self.task = self.fps or found["fps"], self.task or found["task"]
        self.robot_type = self.robot_type or found["robot_type"]
        self.features = self.features or found["features"]

    def _table(self, cols: Mapping[str, np.ndarray]) -> Any:
        pa = self.pa
        arrays, names = [], []
        for key, a in cols.items():
            if a.ndim == 2:
                arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(a).ravel()), a.shape[1]))
            else:
                arrays.append(pa.array(a))
            names.append(key)
        return pa.Table.from_arrays(arrays, names=names)

    def _write_parquet(self, table: Any, path: Path) -> None:
        import io

        buf = io.BytesIO()
        self.pq.write_table(table, buf)
        write_file(path, buf.getvalue())

    # -------------------------------------------------------------- dataset files
    def roll(self, final: bool = False) -> None:
        """Write dataset files of the committed parts in episode order: those past a size limit (each file
        closed once past it), or with ``final`` all of them. Returns at once while another thread is at
        it (that thread takes the newly committed parts too), unless ``final``."""
        while True:
            if not self._files_lock.acquire(blocking=final):
                return
            try:
                while True:
                    with self._lock:
                        batch = self._next_file(final)
                    if not batch:
                        break
                    self._write_file(batch)
                    with self._lock:
                        for part in batch:
                            self._order.remove(part.seq)
                            del self._ready[part.seq]
            finally:
                self._files_lock.release()
            with self._lock:  # a part committed while this thread held the lock, and its thread returned
                if final or not self._next_file(False):
                    return

    def _next_file(self, final: bool) -> list[_Part]:
        """The parts of the next dataset file: the committed prefix of the episode order up to the part that
        passes a size limit; with ``final`` the whole committed prefix if none does."""
        batch: list[_Part] = []
        data, video = 0, {}
        limit = self.limit() if self.limit is not None else None
        for seq in self._order:
            part = self._ready.get(seq)
            if part is None or (limit is not None and seq >= limit):
                break
            batch.append(part)
            data += part.data_bytes
            for k, v in part.video_bytes.items():
                video[k] = video.get(k, 0) + v
            if data >= self.data_mb * 2**20 or any(v >= self.video_mb * 2**20 for v in video.values()):
                return batch
        return batch if final else []

    def _write_file(self, batch: Sequence[_Part]) -> None:
        pa = self.pa
        chunk, file = chunk_file(self.files, self.chunks_size)
        where = dict(chunk_index=chunk, file_index=file)
        cameras = [k for k, v in (self.features or {}).items() if v.get("dtype") == "video"]
        from fastrecord.sinks.lerobot.video import concat_mp4

        spans = {k: concat_mp4([self.parts / p.videos[k] for p in batch], self.root / VIDEO_PATH.format(video_key=k, **where))
                 for k in cameras}
        tables, rows = [], []
        first, index = self.episodes, self.frames
        for j, part in enumerate(batch):
            t = self.pq.read_table(self.parts / f"ep_{part.seq:08d}.parquet").replace_schema_metadata(None)
            n, ep = t.num_rows, first + j
            t = t.set_column(t.schema.get_field_index("episode_index"), "episode_index", pa.array(np.full(n, ep, np.int64)))
            t = t.set_column(t.schema.get_field_index("index"), "index", pa.array(np.arange(index, index + n, dtype=np.int64)))
            tables.append(t)
            stats = _placed(part.stats, ep, index)
            row: dict[str, Any] = {"episode_index": ep, "tasks": [self.task], "length": n, "data/chunk_index": chunk,
                                   "data/file_index": file, "dataset_from_index": index, "dataset_to_index": index + n}
            for k in cameras:
                row.update({f"videos/{k}/chunk_index": chunk, f"videos/{k}/file_index": file,
                            f"videos/{k}/from_timestamp": spans[k][j][0], f"videos/{k}/to_timestamp": spans[k][j][1]})
            row.update(flat_stats(stats))
            row.update({"meta/episodes/chunk_index": chunk, "meta/episodes/file_index": file})
            rows.append(row)
            self._episode_stats.append(stats)
            index += n
        data = self.root / DATA_PATH.format(**where)
        staged = staged_path(data)  # hidden from LeRobot's reader (it loads data/*/*.parquet) until info.json counts it
        self._write_parquet(pa.concat_tables(tables), staged)
        meta = dict(parts=[p.seq for p in batch], entries=[p.entry for p in batch], dataset=self._settings())
        episodes = pa.Table.from_pylist(rows).replace_schema_metadata({FILE_META: json.dumps(meta)})
        final = self.root / EPISODES_PATH.format(**where)
        pending = final.with_name(final.name + PENDING)  # complete, but not yet counted by info.json
        self._write_parquet(episodes, pending)  # the commit of this file: a recovery finishes the steps below
        self.files, self.episodes, self.frames = self.files + 1, first + len(batch), index
        self._write_meta()
        staged.replace(data)  # LeRobot's reader sees the rows and the episodes with info.json's new totals
        pending.replace(final)  # (but for a kill between these two renames)
        for part in batch:
            self._remove_part(part.seq)

    def _write_meta(self) -> None:
        import pandas as pd

        info = info_json(features=self.features or {}, fps=self.fps, robot_type=self.robot_type or "unknown",
                         episodes=self.episodes, frames=self.frames, files=self.files, chunks_size=self.chunks_size,
                         data_mb=self.data_mb, video_mb=self.video_mb)
        tasks = pd.DataFrame({"task_index": [0]}, index=[self.task])
        self._write_parquet(self.pa.Table.from_pandas(tasks), self.root / TASKS_PATH)
        write_json(self.root / STATS_PATH, aggregate_stats(self._episode_stats))
        write_json(self.root / INFO_PATH, info)

    def _remove_part(self, seq: int) -> None:
        for p in self.parts.glob(f"ep_{seq:08d}.*"):
            p.unlink(missing_ok=True)

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
        for path in paths:
            table = self.pq.read_table(path)
            meta = json.loads(table.schema.metadata[FILE_META])
            consumed.update(meta["parts"])
            self._take_settings(meta["dataset"])
            for row in table.to_pylist():
                self._episode_stats.append(unflat_stats(row))
                self.frames = max(self.frames, int(row["dataset_to_index"]))
            self.episodes += table.num_rows
        self.files = len(paths)
        for kind in ("data", "videos"):  # files of a file group whose episodes file was never committed
            for p in (self.root / kind).rglob("*") if (self.root / kind).is_dir() else ():
                m = re.match(r"^chunk-(\d+)$", p.parent.name), re.match(r"^file-(\d+)\.(parquet|mp4)$", p.name)
                if p.is_file() and (p.name.startswith(".") or (all(m) and int(m[0][1]) * self.chunks_size + int(m[1][1]) >= self.files)):
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
            seq = int(m.group(1)) if m else None
            if seq is None or seq not in committed:  # in a file already, a video of an unfinished part, a temporary
                p.unlink()
        self._order = [p.seq for p in pending]
        self._ready = {p.seq: p for p in pending}
        if self.files:
            self._write_meta()  # what a kill after a file's commit left undone
        self._next_seq = max(seqs) + 1 if seqs else 0

    @property
    def pending(self) -> int:
        """Committed episodes not yet in a dataset file."""
        with self._lock:
            return len(self._ready)

    def close(self) -> None:
        """Put every committed part into dataset files (parts that never committed are dropped: their
        episodes failed), then remove the parts folder."""
        with self._lock:
            self._order = [s for s in self._order if s in self._ready]
        self.roll(final=True)
        if self.parts.is_dir():
            for p in self.parts.iterdir():
                m = PART_RE.match(p.name) or SEGMENT_RE.match(p.name)
                if not m or int(m.group(1)) not in self._ready:
                    p.unlink()  # videos of parts that never committed (parts past `limit` stay, with theirs)
            if not any(self.parts.iterdir()):
                shutil.rmtree(self.parts, ignore_errors=True)


def staged_path(data: Path) -> Path:
    """Where a data file's rows wait, hidden, until meta/info.json counts them (``.file-FFF.parquet.next``)."""
    return data.with_name(f".{data.name}.next")


def _placed(stats: Mapping[str, Mapping[str, Any]], episode: int, first_index: int) -> dict[str, dict[str, Any]]:
    """An episode's statistics with its final ``episode_index`` and ``index`` (the part's were provisional)."""
    out = {k: dict(v) for k, v in stats.items()}
    n = out["frame_index"]["count"]
    out["episode_index"] = {"min": [episode], "max": [episode], "mean": [float(episode)], "std": [0.0], "count": n}
    f = out["frame_index"]
    out["index"] = {"min": [f["min"][0] + first_index], "max": [f["max"][0] + first_index],
                    "mean": [f["mean"][0] + first_index], "std": f["std"], "count": n}
    return out


def _diff(a: Mapping[str, Any], b: Mapping[str, Any]) -> str:
    keys = sorted(set(a) ^ set(b)) or sorted(k for k in a if a[k] != b.get(k))
    return ", ".join(f"{k}: {a.get(k, {}).get('shape', 'absent')} vs {b.get(k, {}).get('shape', 'absent')}" for k in keys[:4])
