"""The LeRobot writer's work that runs in its helper processes, off the recording process.

`LeRobotWriter` keeps the bookkeeping (episode order, commits, when to roll, the renames and meta files)
in the caller and sends the CPU work here, to `fastrecord.processes.IsolatedProcess` helpers serving this
module (numpy, pyarrow and PyAV only: no torch, no ManiSkill): the stepping thread shares the caller's GIL
with whatever Python runs there, and the parquet, statistics and remux work took more of it than the
stepping itself (issue 29, item 5: 0.44x of the same run without LeRobot on the H200, docs/performance.md).

- `write_part` (the part processes, one call per finished episode): the episode's statistics (LeRobot's,
  `fastrecord.sinks.lerobot.stats`, from its columns and its cameras' sampled frames) and its rows as a
  committed part ``ep_SSSSSSSS.parquet`` (its parquet metadata: the episode, its statistics, the dataset's
  settings). Its videos were encoded before, in fastrecord's encoder processes.
- `write_group` (the one group process): the last file group (re)written with a batch of committed parts:
  each camera's video joined without re-encoding, the rows under their hidden name, the episodes file as
  ``.pending`` (the group's commit), the dataset's statistics aggregated with the batch's. The renames that
  show them and meta/info.json stay the caller's (`LeRobotWriter._write_file`), so a kill of either process
  at any moment leaves what the writer's recovery expects. The group's episodes rows live here between
  calls (the caller tracks its sizes).
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord.sinks.lerobot.layout import DATA_PATH, EPISODES_PATH, VIDEO_PATH, chunk_file, write_file
from fastrecord.sinks.lerobot.stats import aggregate_stats, episode_stats, flat_stats, listed, vector_stats
from fastrecord.staging import forget_arena, map_arena, mapped_frames  # noqa: F401 - the caller notifies them by name

MODULE = "fastrecord.sinks.lerobot.files"  # what the helper processes serve
PART_META = b"fastrecord.lerobot.part"  # a part's parquet metadata: its episode and the dataset's settings
FILE_META = b"fastrecord.lerobot.parts"  # an episodes file's parquet metadata: the parts it holds
PENDING = ".pending"  # meta/episodes/.../file-FFF.parquet.pending: committed, info.json not yet rewritten


def staged_path(data: Path) -> Path:
    """Where a data file's rows wait, hidden, until meta/info.json counts them (``.file-FFF.parquet.next``)."""
    return data.with_name(f".{data.name}.next")


def table_of(cols: Mapping[str, np.ndarray]) -> Any:
    """A pyarrow table of an episode's columns (``[T]``, or ``[T, D]`` as fixed-size lists)."""
    import pyarrow as pa

    arrays, names = [], []
    for key, a in cols.items():
        if a.ndim == 2:
            arrays.append(pa.FixedSizeListArray.from_arrays(pa.array(np.ascontiguousarray(a).ravel()), a.shape[1]))
        else:
            arrays.append(pa.array(a))
        names.append(key)
    return pa.Table.from_arrays(arrays, names=names)


def write_parquet(table: Any, path: Path) -> None:
    """``table`` as a parquet file, written atomically (`fastrecord.sinks.lerobot.layout.write_file`)."""
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    write_file(path, buf.getvalue())


# ---------------------------------------------------------------------------------------------- parts
def _frames(ref: Any) -> np.ndarray:
    """A camera's frames: an array (pickled), or ``(arena id, offset, shape)`` of uint8 frames in a mapped arena."""
    if isinstance(ref, np.ndarray):
        return ref
    arena_id, offset, shape = ref
    return mapped_frames(arena_id, offset, tuple(shape))


def write_part(path: str, cols: Mapping[str, np.ndarray], sampled: Mapping[str, Any], fps: float,
               meta: dict[str, Any]) -> tuple[dict[str, dict[str, list]], int]:
    """Commit one episode as the part ``path``: its statistics (``sampled``: each camera's frames that
    LeRobot's image statistics read, `fastrecord.sinks.lerobot.stats.sampled_frames`, as an array or where
    they lie in a mapped staging arena), then its rows with ``meta`` and the statistics in the parquet
    metadata; returns (statistics, the file's size)."""
    stats = episode_stats(cols, {k: _frames(v) for k, v in sampled.items()}, fps, sampled=True)
    table = table_of(cols).replace_schema_metadata({PART_META: json.dumps({**meta, "stats": stats})})
    write_parquet(table, Path(path))
    return stats, Path(path).stat().st_size


# ---------------------------------------------------------------------------------------------- file groups
_group: dict[str, Any] = {}  # this process's open file group: number, episodes rows, parts, entries


def write_group(root: str, parts_dir: str, group: int, fresh: bool, batch: Sequence[Mapping[str, Any]],
                first_episode: int, first_index: int, dataset_stats: dict[str, Any] | None,
                settings: Mapping[str, Any], chunks_size: int) -> dict[str, Any]:
    """(Re)write file group ``group`` (``fresh``: it holds no episode yet) with the parts of ``batch``
    (``seq``, ``stats``, ``videos``, ``entry`` each) after the episodes it holds, numbered from
    ``first_episode`` and ``first_index``: each camera's video (the old file's packets, then the parts',
    without re-encoding: the episodes already in it keep their times), the rows under their hidden name
    (`staged_path`), the episodes file as ``.pending`` (the commit). Returns the sizes written, the new
    totals and ``dataset_stats`` aggregated with the batch's, as LeRobot's save_episode does.
    Nothing is committed for a caller that died meanwhile (`fastrecord.processes.parent_alive`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fastrecord.processes import parent_alive
    from fastrecord.sinks.lerobot.video import concat_mp4

    root_, parts = Path(root), Path(parts_dir)
    if fresh:
        _group.clear()
        _group.update(group=group, rows=None, parts=[], entries=[])
    elif _group.get("group") != group:
        raise RuntimeError(f"the LeRobot group process holds file group {_group.get('group')}, not {group}; "
                           "the dataset's parts stay on disk: resume the run or run fastrecord consolidate on it")
    chunk, file = chunk_file(group, chunks_size)
    where = dict(chunk_index=chunk, file_index=file)
    features = settings.get("features") or {}
    task = settings["task"]
    cameras = [k for k, v in features.items() if v.get("dtype") == "video"]
    spans, video_bytes = {}, {}
    for k in cameras:
        path = root_ / VIDEO_PATH.format(video_key=k, **where)
        old = [path] if not fresh else []
        spans[k] = concat_mp4([*old, *(parts / p["videos"][k] for p in batch)], path)[len(old):]
        video_bytes[k] = path.stat().st_size
    data = root_ / DATA_PATH.format(**where)
    tables = [pq.read_table(data)] if not fresh else []
    rows = []
    batch_stats = []
    index = first_index
    for j, (part, t) in enumerate(zip(batch, _read_parts(parts, batch), strict=True)):
        n, ep = t.num_rows, first_episode + j
        t = t.set_column(t.schema.get_field_index("episode_index"), "episode_index",
                         pa.array(np.full(n, ep, np.int64)))
        t = t.set_column(t.schema.get_field_index("index"), "index",
                         pa.array(np.arange(index, index + n, dtype=np.int64)))
        tables.append(t)
        stats = placed(part["stats"], ep, index, n)
        row: dict[str, Any] = {"episode_index": ep, "tasks": [task], "length": n, "data/chunk_index": chunk,
                               "data/file_index": file, "dataset_from_index": index, "dataset_to_index": index + n}
        for k in cameras:
            row.update({f"videos/{k}/chunk_index": chunk, f"videos/{k}/file_index": file,
                        f"videos/{k}/from_timestamp": spans[k][j][0], f"videos/{k}/to_timestamp": spans[k][j][1]})
        row.update(flat_stats(stats))
        row.update({"meta/episodes/chunk_index": chunk, "meta/episodes/file_index": file})
        rows.append(row)
        batch_stats.append(stats)
        index += n
    # the dataset's statistics aggregated with the batch's in one call (LeRobot aggregates at each episode, the
    # same weighted sums: one call over 611 parts took 2.4 s pairwise, 4 ms each)
    stats_so_far = aggregate_stats([*([dataset_stats] if dataset_stats is not None else []), *batch_stats])
    staged = staged_path(data)  # hidden from LeRobot's reader (it loads data/*/*.parquet) until info.json counts it
    write_parquet(pa.concat_tables(tables), staged)
    new_rows = pa.Table.from_pylist(rows)
    if _group["rows"] is not None:
        new_rows = pa.concat_tables([_group["rows"], new_rows], promote_options="default")
    parts_held = [*_group["parts"], *(p["seq"] for p in batch)]
    entries = [*_group["entries"], *(p["entry"] for p in batch)]
    meta = dict(parts=parts_held, entries=entries, dataset=dict(settings))
    final = root_ / EPISODES_PATH.format(**where)
    pending = final.with_name(final.name + PENDING)  # complete, but not yet counted by info.json
    if not parent_alive():  # the recorder died: what it asked for stays in its committed parts
        raise RuntimeError("the recording process is gone; file group left uncommitted")
    write_parquet(new_rows.replace_schema_metadata({FILE_META: json.dumps(meta)}), pending)  # the commit
    _group.update(rows=new_rows, parts=parts_held, entries=entries)
    return dict(data_bytes=staged.stat().st_size, video_bytes=video_bytes, episodes=first_episode + len(batch),
                frames=index, stats=stats_so_far, staged=str(staged), data=str(data), pending=str(pending),
                final=str(final))


def _read_parts(parts: Path, batch: Sequence[Mapping[str, Any]]) -> list[Any]:
    """The rows of the batch's parts, in its order, read by a few threads (pyarrow reads outside the GIL; one
    at a time, 611 small parts took 1.5 s)."""
    from concurrent.futures import ThreadPoolExecutor

    import pyarrow.parquet as pq

    paths = [parts / f"ep_{part['seq']:08d}.parquet" for part in batch]
    read = lambda p: pq.read_table(p).replace_schema_metadata(None)  # noqa: E731
    if len(paths) < 8:
        return [read(p) for p in paths]
    with ThreadPoolExecutor(max_workers=min(8, len(paths))) as pool:
        return list(pool.map(read, paths))


def placed(stats: Mapping[str, Mapping[str, Any]], episode: int, first_index: int,
           n: int) -> dict[str, dict[str, Any]]:
    """An episode's statistics with its final ``episode_index`` and ``index`` (the part's were provisional)."""
    out = {k: dict(v) for k, v in stats.items()}
    out["episode_index"] = listed(vector_stats(np.full(n, episode, dtype=np.int64)))
    out["index"] = listed(vector_stats(np.arange(first_index, first_index + n, dtype=np.int64)))
    return out
