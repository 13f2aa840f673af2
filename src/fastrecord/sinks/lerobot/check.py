"""What a run's LeRobot dataset holds, and whether its files agree: `scan_dataset`; `repair`, which folds
a killed run's parts into the dataset once it agrees.

Read only. ``fastrecord info``, ``consolidate``, ``merge`` and a resumed run (`fastrecord.sinks.reconcile`)
use it before they write anything: a dataset whose files were deleted, truncated or added by hand is
reported as problems (one line each, naming the file and what to do), never rewritten or renumbered.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastrecord.sinks.lerobot.layout import DATA_PATH, EPISODES_PATH, INFO_PATH, VIDEO_PATH, chunk_file
from fastrecord.sinks.lerobot.writer import FILE_META, PART_META, PART_RE, PENDING, LeRobotWriter, staged_path

_FILE_RE = re.compile(r"^file-(\d+)\.(parquet|mp4)$")
_CHUNK_RE = re.compile(r"^chunk-(\d+)$")


@dataclass
class DatasetState:
    """A LeRobot dataset of a run (``root``) and its parts folder, as found on disk."""

    root: Path
    filed: list[int] = field(default_factory=list)  # episode seqs in dataset files, in file order
    parts: list[int] = field(default_factory=list)  # committed parts not yet in a file, in seq order
    files: int = 0  # dataset files of each kind (episodes files found)
    problems: list[str] = field(default_factory=list)  # damage: one line each, naming the file and the fix

    @property
    def seqs(self) -> list[int]:
        return self.filed + self.parts


def _fix(root: Path) -> str:
    return (f"restore it from a copy of {root.name}/, or record the run again (--if-exists overwrite); nothing "
            f"was changed")


def _episodes_files(root: Path, chunks: int) -> dict[int, Path]:
    """Each file group's episodes file: ``file-FFF.parquet``, or its ``.pending`` commit where one exists. A
    group's rewrite (more episodes in the open group) writes ``.pending`` beside the older episodes file and
    then replaces it; a kill between the two leaves both, and the ``.pending`` one is the group's commit
    (the writer's recovery gives it the name)."""
    found: dict[int, Path] = {}
    for p in (root / "meta" / "episodes").glob("chunk-*/file-*.parquet*"):
        c, f = _CHUNK_RE.match(p.parent.name), re.match(r"^file-(\d+)\.parquet(\.pending)?$", p.name)
        if c and f:
            group = int(c[1]) * chunks + int(f[1])
            if group not in found or p.name.endswith(PENDING):
                found[group] = p
    return found


def scan_dataset(root: Path, parts: Path | None = None, videos: bool = True) -> DatasetState:
    """The episodes of the dataset ``root`` (``NAME.lerobot``) and its parts (``NAME.lerobot.parts``),
    and every disagreement between its files: ``meta/info.json``'s totals and the episodes files, each
    episodes file's data file (its rows) and videos (present; with ``videos`` also readable and long enough),
    files past the last episodes file, unreadable parts or parts without their videos."""
    root = Path(root)
    parts = Path(parts) if parts is not None else root.with_name(root.name + ".parts")
    st = DatasetState(root)
    info: dict[str, Any] = {}
    if (root / INFO_PATH).exists():
        try:
            info = json.loads((root / INFO_PATH).read_text())
        except (OSError, ValueError) as e:
            st.problems.append(f"{_rel(root, root / INFO_PATH)} cannot be read ({e}); {_fix(root)}")
    chunks = int(info.get("chunks_size") or 1000)
    groups = sorted(_episodes_files(root, chunks).items())
    cameras = [k for k, v in (info.get("features") or {}).items() if isinstance(v, dict) and v.get("dtype") == "video"]
    episodes = frames = 0
    for k, (group, path) in enumerate(groups):
        if group != k:
            missing = root / EPISODES_PATH.format(**_where(k, chunks))
            st.problems.append(f"{_rel(root, missing)} is missing (the episodes files go on with {_rel(root, path)}); "
                               f"{_fix(root)}")
            break
        counted = _check_group(st, path, group, chunks, cameras, videos)
        if counted is None:
            break
        episodes, frames = episodes + counted[0], frames + counted[1]
    st.files = len(groups)
    if info and not st.problems:
        _check_totals(st, info, episodes, frames, chunks)
    _check_extra_files(st, chunks)
    _scan_parts(st, parts)
    return st


def _rel(root: Path, p: Path) -> str:
    return f"{root.name}/{p.relative_to(root)}"


def _where(group: int, chunks: int) -> dict[str, int]:
    chunk, file = chunk_file(group, chunks)
    return dict(chunk_index=chunk, file_index=file)


def _check_group(st: DatasetState, path: Path, group: int, chunks: int, cameras: list[str],
                 videos: bool) -> tuple[int, int] | None:
    """The episodes file ``path`` of file group ``group``: its parts added to ``st.filed``, its data file's rows
    and its videos checked (problems to ``st.problems``); returns (episodes, frames) it holds, None where it
    cannot be read (the files after it are not checked)."""
    import pyarrow.parquet as pq

    root = st.root
    try:
        table = pq.read_table(path)
        meta = json.loads(table.schema.metadata[FILE_META])
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a damaged file
        st.problems.append(f"{_rel(root, path)} cannot be read ({type(e).__name__}: {str(e)[:120]}); {_fix(root)}")
        return None
    st.filed += [int(s) for s in meta.get("parts", [])]
    rows = table.to_pylist()
    where = _where(group, chunks)
    data = root / DATA_PATH.format(**where)
    # a .pending episodes file is committed but not yet named nor counted by info.json (a kill): the group's
    # episodes all the same (info.json may count the older episodes file it replaces, never more than it holds)
    pending = path.name.endswith(PENDING)
    want_rows = sum(int(r["length"]) for r in rows)
    data_file = staged_path(data) if pending and staged_path(data).exists() else data
    if not data_file.exists():
        st.problems.append(f"{_rel(root, data)} is missing: {len(rows)} episodes of {_rel(root, path)} ({want_rows} "
                           f"rows) have no data; {_fix(root)}")
    else:
        try:
            got = pq.ParquetFile(data_file).metadata.num_rows
            if got != want_rows:
                st.problems.append(f"{_rel(root, data_file)} holds {got} rows where {_rel(root, path)} says "
                                   f"{want_rows}; {_fix(root)}")
        except Exception as e:  # noqa: BLE001
            st.problems.append(f"{_rel(root, data_file)} cannot be read (truncated or damaged: {type(e).__name__}); "
                               f"{_fix(root)}")
    for key in cameras:
        video = root / VIDEO_PATH.format(video_key=key, **where)
        end = max((float(r.get(f"videos/{key}/to_timestamp") or 0.0) for r in rows), default=0.0)
        problem = _video_problem(video, end) if videos else (None if video.exists() else "is missing")
        if problem:
            st.problems.append(f"{_rel(root, video)} {problem}: the videos of {len(rows)} episodes of "
                               f"{_rel(root, path)}; {_fix(root)}")
    return len(rows), want_rows


def _check_totals(st: DatasetState, info: dict[str, Any], episodes: int, frames: int, chunks: int) -> None:
    """meta/info.json's totals against what the episodes files hold (``episodes``, ``frames``). More in the
    episodes files than info.json counts is a kill inside a group's write, after the episodes file took its
    name and before info.json (LeRobot reads what info.json counts; a resume counts the rest): no damage.
    Fewer is."""
    root, info_path = st.root, st.root / INFO_PATH
    if int(info.get("total_episodes", 0)) > episodes:  # the episodes file after the last one found is gone
        missing = root / EPISODES_PATH.format(**_where(st.files, chunks))
        st.problems.append(f"{_rel(root, missing)} is missing: {_rel(root, info_path)} counts "
                           f"{info['total_episodes']} episodes, the episodes files {episodes}; {_fix(root)}")
    for key, have in (("total_episodes", episodes), ("total_frames", frames)):
        if not st.problems and int(info.get(key, 0)) > have:
            st.problems.append(f"{_rel(root, info_path)} says {key} {info.get(key)} but the episodes files hold "
                               f"{have}; {_fix(root)}")


def _check_extra_files(st: DatasetState, chunks: int) -> None:
    """Data and video files of no episodes file. The next group's videos are written before its episodes file:
    what a kill there leaves (a resume removes it) is not one."""
    root = st.root
    for kind in ("data", "videos"):
        for p in sorted((root / kind).rglob("*.*")) if (root / kind).is_dir() else ():
            c, f = _CHUNK_RE.match(p.parent.name), _FILE_RE.match(p.name)
            group = int(c[1]) * chunks + int(f[1]) if c and f else -1
            if p.is_file() and group >= st.files and not (kind == "videos" and group == st.files):
                st.problems.append(f"{_rel(root, p)} is not counted by any episodes file (extra); move it out of "
                                   f"{root.name}/")


def _scan_parts(st: DatasetState, parts: Path) -> None:
    """The committed parts not yet in a dataset file (``st.parts``); an unreadable part, or one without its
    videos, is a problem."""
    import pyarrow.parquet as pq

    for p in sorted(parts.glob("ep_*.parquet")) if parts.is_dir() else ():
        m = PART_RE.match(p.name)
        if not m:
            continue
        try:
            meta = json.loads(pq.read_schema(p).metadata[PART_META])
            lost = [v for v in meta.get("videos", {}).values() if not (parts / v).exists()]
        except Exception as e:  # noqa: BLE001
            st.problems.append(f"{parts.name}/{p.name} cannot be read (truncated or damaged: {type(e).__name__}); "
                               f"restore it or delete it (its episode {int(m[1])} is then recorded again on resume)")
            continue
        if lost:
            st.problems.append(f"{parts.name}/{p.name} has no video {lost[0]}; restore it, or delete {p.name} (episode "
                               f"{int(m[1])} is then recorded again on resume)")
            continue
        if int(m[1]) not in st.filed:
            st.parts.append(int(m[1]))


def _video_problem(path: Path, end: float) -> str | None:
    """Why the video ``path`` cannot show ``end`` seconds (missing, unreadable, shorter), or None."""
    if not path.exists():
        return "is missing"
    try:
        import av

        with av.open(str(path)) as c:
            s = c.streams.video[0]
            duration = float(s.duration * s.time_base) if s.duration else float(c.duration or 0) / 1e6
    except Exception as e:  # noqa: BLE001 - PyAV raises several kinds for a damaged file
        return f"cannot be read (truncated or damaged: {type(e).__name__})"
    if duration + 0.05 < end:
        return f"is {duration:.2f} s long where its episodes need {end:.2f} s (truncated)"
    return None


def repair(root: Path) -> LeRobotWriter:
    """Fold what a killed run left in ``NAME.lerobot.parts/`` into the dataset ``root`` (``NAME.lerobot``)
    and return the closed writer (its ``episodes`` and ``files`` say what the dataset holds)."""
    root = Path(root)
    parts = root.with_name(root.name + ".parts")
    if not root.is_dir() and not parts.is_dir():
        raise ValueError(f"{root} is no LeRobot dataset of a run: neither it nor {parts.name}/ exist; pass the "
                         f"NAME.lerobot folder of a recorded run")
    state = scan_dataset(root, parts, videos=False)  # a damaged dataset is refused before anything is changed
    gap = next((i for i, s in enumerate(state.seqs) if s != i), None)
    if state.problems:
        raise ValueError(f"not repairing {root}: {state.problems[0]}")
    if gap is not None:
        raise ValueError(f"not repairing {root}: episode {gap} is neither in its files nor in {parts.name}/ (a part "
                         f"deleted?) while later ones are; folding them in would renumber them. Restore "
                         f"{parts.name}/ep_{gap:08d}.parquet, or resume the run (if_exists='resume'), which records "
                         f"again "
                         f"what its results file does not commit")
    writer = LeRobotWriter(root, parts, resume=True)
    writer.close()
    return writer
