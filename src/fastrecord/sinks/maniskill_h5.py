"""ManiSkill trajectory files (``NAME.h5`` + ``NAME.json``): the writer and the reader, written so that a
crash loses nothing finished and a full disk never takes the caller's process down.

Layout (ManiSkill's; documented in README "On-disk schema"): one group ``traj_{episode_id}`` per episode
with ``actions [T, A]``, ``terminated/truncated/success/fail [T]``, ``rewards [T]``, ``env_states``
(nested groups, ``[T+1, D]`` leaves) and ``obs`` (``[T+1, ...]``, nested for dict observations); the JSON
holds ``env_info``, ``commit_info``, ``episodes`` and ``source_type``/``source_desc``.

Crash safety. HDF5 has no journal: a process killed while the library holds dirty metadata leaves a file
h5py cannot open (ManiSkill's writer loses every episode that way). So while recording, each batch of
finished episodes goes to its own file ``NAME.h5.parts/part_K.h5``, written under a temporary name and
renamed into place once closed. The parts are the truth: each one also stores its episodes' JSON entries
(root attribute ``fastrecord_episodes``) and the JSON header (``fastrecord_header``). ``NAME.h5`` is a
small index of external links to the parts, rebuilt whole and swapped in with an atomic rename, then the
JSON likewise; both list the same episodes. `recover` rebuilds them from the parts alone (after a crash
some complete parts may not be listed yet); `consolidate` copies everything into one self-contained
``NAME.h5`` (atomic rename) and only then removes the parts. ``TrajectoryWriter(resume=True)`` appends
to what is on disk.

Isolation. HDF5 may crash its process (h5py 3.16 / HDF5 2.0 can segfault closing a file after ENOSPC),
so every h5py write happens in writer processes (`fastrecord.workers.IsolatedProcess`, which import
numpy, h5py and this module only): ``num_writers`` of them write whole part files in parallel (image
observations are compressed in parallel), one more writes the index and consolidates. A failure there
is a `WorkerError` in the caller naming the cause, the fix, and what is safe on disk. Episode ids stay
consecutive in submission order: the index lists the longest prefix of batches whose parts are complete.
"""

from __future__ import annotations

import errno
import json
import os
import queue
import re
import shutil
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from fastrecord.workers import (
    ChildDied,
    IsolatedProcess,
    WorkerError,
    exit_description,
    parent_alive,
)

# image leaves, stored compressed (ManiSkill compresses rgb/depth/seg with gzip level 5)
_IMAGE_KEYS = ("rgb", "depth", "seg", "segmentation", "position", "normal", "albedo")
COMPRESSIONS = tuple(f"gzip:{k}" for k in range(1, 10)) + ("lzf", "none")  # trajectory_compression values
DEFAULT_COMPRESSION = "gzip:1"  # measured on PickCube-v1 rgb frames: README "Image observations on disk"
_BAND_BYTES = 2048  # bytes of one frame in an image chunk: a chunk is many frames of a few rows (see _image_chunks)
_CHUNK_FRAMES = 64  # frames in an image chunk, at most
EPISODES_ATTR = "fastrecord_episodes"  # part file root attribute: JSON list of its episodes' entries
HEADER_ATTR = "fastrecord_header"  # part file root attribute: JSON of the header (env_info, commit_info, ...)
_PART = re.compile(r"^part_(\d+)\.h5$")
_THIS_MODULE = "fastrecord.sinks.maniskill_h5"  # what the writer processes import
_LOW_DISK = 64 << 20  # bytes free below which a dead writer is blamed on the disk as well

if TYPE_CHECKING:  # writer processes import this module: keep it to numpy and h5py
    from fastrecord.episode import EpisodeData


def _to_jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _to_jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_to_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return x.tolist()
    if isinstance(x, np.generic):
        return x.item()
    if hasattr(x, "tolist"):  # torch tensors
        return x.tolist()
    return x


def atomic_write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(_to_jsonable(data), f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _sibling_paths(h5_path: Path) -> tuple[Path, Path]:
    """``NAME.h5`` -> (``NAME.json``, ``NAME.h5.parts``)."""
    return h5_path.with_suffix(".json"), h5_path.with_name(h5_path.name + ".parts")


def _part_name(k: int) -> str:
    return f"part_{k:06d}.h5"


def _free_bytes(path: Path) -> int | None:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return None


def _is_disk_full(e: BaseException) -> bool:
    # h5py raises OSError(ENOSPC), or RuntimeError("... errno = 28, error message = 'No space left on device'")
    return (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e)


# ================================================================================ in a writer process
# These functions run in `IsolatedProcess`es started by `TrajectoryWriter`, `recover` and `consolidate`.

def parse_compression(spec: Any) -> tuple[str | None, int | None]:
    """``"gzip:1"`` -> ("gzip", 1), ``"lzf"`` -> ("lzf", None), ``"none"`` -> (None, None); anything else is a
    ValueError naming the choices. All are HDF5 filters that h5py ships, so ManiSkill's readers open them
    (``lzf`` only through h5py, not other HDF5 tools)."""
    if spec not in COMPRESSIONS:
        raise ValueError(
            f"trajectory_compression={spec!r} is unknown; use 'gzip:1' (the default: fastest gzip, files about 15% "
            f"larger than level 5), 'gzip:2' ... 'gzip:9' (smaller, slower; ManiSkill writes 'gzip:5'), 'lzf' "
            f"(as fast as gzip:1, larger files, read by h5py only) or 'none'")
    if spec == "none":
        return None, None
    if spec == "lzf":
        return "lzf", None
    return "gzip", int(spec.split(":")[1])


def _image_chunks(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Chunks of up to 64 frames x a band of rows about 2 KiB a frame (``[T, H, W, C]`` images).

    Consecutive frames of a camera share most pixels; with each frame's band 2 KiB apart, gzip's 32 KiB
    window (lzf's 8 KiB) sees the same rows of the frames before, so the static parts compress to almost
    nothing. On PickCube-v1 rgb frames one frame a chunk stored 64-69% of the raw bytes, these chunks
    7-10%, and compressing was 3-6x faster (README "Image observations on disk").
    """
    row = int(np.prod(shape[2:], dtype=np.int64)) * itemsize
    rows = max(1, min(shape[1], _BAND_BYTES // max(row, 1)))
    return (max(1, min(shape[0], _CHUNK_FRAMES)), rows, *shape[2:])


def _write_dataset(group: h5py.Group, path: str, data: np.ndarray, compression: str = DEFAULT_COMPRESSION) -> None:
    *parents, leaf = path.split("/")
    for p in parents:
        group = group[p] if p in group else group.create_group(p, track_order=True)
    method, level = parse_compression(compression)
    if leaf in _IMAGE_KEYS and data.ndim >= 3 and method is not None and data.size:
        group.create_dataset(leaf, data=data, chunks=_image_chunks(data.shape, data.dtype.itemsize),
                             compression=method, compression_opts=level)
    else:
        group.create_dataset(leaf, data=data)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_part(tmp: str, final: str, header: dict, entries: list[tuple[str, dict[str, np.ndarray], dict]],
                compression: str = DEFAULT_COMPRESSION) -> int:
    """Write one part file: ``entries`` are (group name, {dataset path: array}, JSON entry). Returns its size."""
    with h5py.File(tmp, "w", track_order=True) as f:
        for group, datasets, _ in entries:
            g = f.create_group(group, track_order=True)
            for path, data in datasets.items():
                _write_dataset(g, path, data, compression)
        f.attrs[EPISODES_ATTR] = json.dumps([meta for _, _, meta in entries])
        f.attrs[HEADER_ATTR] = json.dumps(header)
    _fsync(Path(tmp))
    if not parent_alive():  # the recording died meanwhile: nobody will list this part
        os.unlink(tmp)
        os._exit(0)
    os.replace(tmp, final)
    return os.path.getsize(final)


def _publish_here(h5_path: str, links: list[tuple[str, str, str]], doc: dict) -> None:
    """Swap in the index ``NAME.h5`` (``links``: (name, part file, group in it)), then ``NAME.json``."""
    h5 = Path(h5_path)
    json_path, parts_dir = _sibling_paths(h5)
    tmp = h5.with_name(h5.name + ".tmp")
    with h5py.File(tmp, "w", track_order=True) as f:
        for name, part, target in links:
            f[name] = h5py.ExternalLink(f"{parts_dir.name}/{part}", f"/{target}")
    if not parent_alive():
        os.unlink(tmp)
        os._exit(0)
    os.replace(tmp, h5)
    atomic_write_json(json_path, doc)


def _link_index_here(h5_path: str, links: list[tuple[str, str, str]], doc: dict) -> None:
    """Swap in an index ``NAME.h5`` of external links (``links``: (name, file relative to the index's
    folder, group in it)), then ``NAME.json``; both atomically. `fastrecord.shards.merge` uses it."""
    h5 = Path(h5_path)
    tmp = h5.with_name(h5.name + ".tmp")
    with h5py.File(tmp, "w", track_order=True) as f:
        for name, target_file, target in links:
            f[name] = h5py.ExternalLink(target_file, f"/{target}")
    _fsync(tmp)
    if not parent_alive():
        os.unlink(tmp)
        os._exit(0)
    os.replace(tmp, h5)
    atomic_write_json(h5.with_suffix(".json"), doc)


def _copy_index_here(h5_path: str, links: list[tuple[str, str, str]], doc: dict) -> None:
    """Like `_link_index_here`, but copies every linked group into one self-contained ``NAME.h5`` (the
    sources, external links included, are followed and left as they are)."""
    h5 = Path(h5_path)
    _write_copies(h5, h5.parent, links)
    atomic_write_json(h5.with_suffix(".json"), doc)


def _write_copies(h5: Path, folder: Path, links: Sequence[tuple[str, str, str]]) -> None:
    """Swap in ``h5`` (atomically) holding a copy of every group of ``links`` ((name, file in ``folder``,
    group in it)); each source file is opened once per run of links into it and left as it is. If the
    recording died meanwhile, exits without swapping it in (nobody will list the result)."""
    tmp = h5.with_name(h5.name + ".tmp")
    with h5py.File(tmp, "w", track_order=True) as dst:
        src, src_name = None, None
        try:
            for name, source_file, target in links:
                if source_file != src_name:
                    if src is not None:
                        src.close()
                    src, src_name = h5py.File(folder / source_file, "r"), source_file
                src.copy(src[target], dst, name=name)
        finally:
            if src is not None:
                src.close()
    _fsync(tmp)
    if not parent_alive():
        os.unlink(tmp)
        os._exit(0)
    os.replace(tmp, h5)


def _groups_here(h5_path: str) -> dict[str, Any]:
    """What an existing ``NAME.h5`` holds: its top-level names and whether any is stored in the file
    itself rather than as an external link (a consolidated file); ``{"error": text}`` if unreadable."""
    try:
        with h5py.File(h5_path, "r") as f:
            names = list(f)
            own = [k for k in names if not isinstance(f.get(k, getlink=True), h5py.ExternalLink)]
    except OSError as e:
        return {"error": str(e)}
    return {"names": names, "self_contained": bool(own)}


def _complete_parts(parts_dir: Path) -> list[tuple[int, Path]]:
    if not parts_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in parts_dir.iterdir() if (m := _PART.match(p.name))]
    return sorted(found)


def _read_json(path: Path) -> dict | None:
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def _self_contained(h5: Path) -> bool:
    """Whether ``NAME.h5`` holds data itself (a consolidated or ManiSkill file), not only links to parts."""
    try:
        with h5py.File(h5, "r") as f:
            return any(not isinstance(f.get(k, getlink=True), h5py.ExternalLink) for k in f)
    except OSError as e:
        raise ValueError(f"{h5} is not a readable HDF5 file ({e}) and there are no part files to rebuild it from; "
                         f"move it away (or pass resume=False with another output_dir)") from None


def _adopt(src: Path, final: Path, metas: list[dict], header: dict) -> None:
    """Make ``src`` a part carrying its entries: a copy gets the attributes, then replaces ``final``
    atomically (a crash at any point leaves ``src`` or the finished part, never a half-edited file)."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.copyfile(src, tmp)
    with h5py.File(tmp, "r+") as f:
        f.attrs[EPISODES_ATTR] = json.dumps(metas)
        f.attrs[HEADER_ATTR] = json.dumps(header)
    _fsync(tmp)
    os.replace(tmp, final)


def _recover_here(h5_path: str, header: dict | None, resume: bool) -> dict[str, Any]:
    """Rebuild ``NAME.h5`` + ``NAME.json`` from the complete parts; see `recover`.

    With ``resume``, a self-contained ``NAME.h5`` (a closed run) first becomes part 0. Returns the
    state: header, episodes (renumbered entries), links, next_part, skipped, self_contained.
    """
    h5 = Path(h5_path)
    json_path, parts_dir = _sibling_paths(h5)
    doomed = parts_dir.with_name(parts_dir.name + ".deleting")
    if not (h5.exists() or json_path.exists() or parts_dir.exists() or doomed.exists()):
        raise FileNotFoundError(f"nothing to recover at {h5}: neither it, {json_path.name} nor {parts_dir.name}/ exist")
    if doomed.exists() and h5.exists():  # a consolidation finished, then died deleting the parts
        shutil.rmtree(doomed)
    for tmp in (h5.with_name(h5.name + ".tmp"), json_path.with_name(json_path.name + ".tmp")):
        tmp.unlink(missing_ok=True)
    if parts_dir.is_dir():
        for tmp in parts_dir.glob("*.tmp"):  # parts a crash left half-written
            tmp.unlink()
    old = _read_json(json_path)
    if header is None and old is not None:
        header = {k: v for k, v in old.items() if k != "episodes"}
    old_entries = old.get("episodes", []) if old is not None else []
    if not isinstance(old_entries, list):
        old_entries = []
    parts = _complete_parts(parts_dir)
    if not parts and h5.exists() and _self_contained(h5):
        if not resume:  # a closed run: already one file
            return dict(header=header or {}, episodes=old_entries, links=[], next_part=0, skipped=[], self_contained=True)
        if old is None:
            raise ValueError(f"cannot resume {h5}: {json_path.name} (the episodes' seeds and ids) is missing or not valid JSON")
        with h5py.File(h5, "r") as f:
            metas = [e for e in old_entries if f"traj_{e.get('episode_id')}" in f]
            unlisted = sorted(set(f) - {f"traj_{e['episode_id']}" for e in metas})
        if unlisted:
            raise ValueError(f"cannot resume {h5}: groups {unlisted[:5]} have no entry in {json_path.name}; "
                             f"resuming would drop them. Move the pair away and record with resume=False")
        parts_dir.mkdir(exist_ok=True)
        _adopt(h5, parts_dir / _part_name(0), metas, header or {})
        parts = _complete_parts(parts_dir)
    by_id = {e["episode_id"]: e for e in old_entries if isinstance(e, dict) and "episode_id" in e}
    episodes: list[dict] = []
    links: list[tuple[str, str, str]] = []
    skipped: list[str] = []
    for _, part in parts:
        try:
            with h5py.File(part, "r") as f:
                text = f.attrs.get(EPISODES_ATTR)
                if header is None and HEADER_ATTR in f.attrs:
                    header = json.loads(f.attrs[HEADER_ATTR])
                if text is None:  # written before parts carried their entries: NAME.json has them
                    groups = [g for g in f if g.startswith("traj_") and g[5:].isdigit()]
                    metas = [by_id.get(int(g[5:])) for g in groups]
                    if any(m is None for m in metas):
                        skipped.append(f"{part.name} (episodes without an entry in {json_path.name})")
                        continue
                    legacy = True
                else:
                    metas = json.loads(text)
                    legacy = False
                items = [(f"traj_{m['episode_id']}", m) for m in metas]
                if any(g not in f for g, _ in items):
                    skipped.append(f"{part.name} (groups listed in {EPISODES_ATTR} are missing)")
                    continue
        except (OSError, ValueError, KeyError) as e:
            skipped.append(f"{part.name} ({type(e).__name__}: {e})")
            continue
        if legacy:  # give it its entries for good: ids are renumbered below, NAME.json's would not match later
            _adopt(part, part, metas, header or {})
        for g, m in items:
            m = dict(m, episode_id=len(episodes))
            episodes.append(m)
            links.append((f"traj_{m['episode_id']}", part.name, g))
    header = header or {}
    parts_dir.mkdir(exist_ok=True)
    _publish_here(str(h5), links, {**header, "episodes": episodes})
    next_part = parts[-1][0] + 1 if parts else 0
    return dict(header=header, episodes=episodes, links=links, next_part=next_part, skipped=skipped, self_contained=False)


def _consolidate_here(h5_path: str, header: dict | None, known: tuple[list, dict] | None = None) -> dict[str, Any]:
    """Recover, copy every listed episode into one self-contained ``NAME.h5``, then drop the parts.

    ``known`` = (links, JSON document): what a `TrajectoryWriter` that wrote every part knows; the parts are
    then not read back first, and ``NAME.json`` is written after ``NAME.h5`` is swapped in (a crash in
    between leaves the parts, from which `recover` rebuilds both)."""
    h5 = Path(h5_path)
    json_path, parts_dir = _sibling_paths(h5)
    if known is not None:
        state = dict(header=header or {}, episodes=known[1]["episodes"], links=known[0], skipped=[], self_contained=False)
    else:
        state = _recover_here(h5_path, header, resume=False)
    if state["self_contained"]:
        if parts_dir.is_dir() and not any(parts_dir.iterdir()):
            parts_dir.rmdir()
        return state
    if state["skipped"]:
        raise ValueError(f"not consolidating {h5}: part files {state['skipped']} cannot be used; the other parts are "
                         f"listed in {h5.name}. Move those files out of {parts_dir} and run consolidate again")
    _write_copies(h5, parts_dir, state["links"])
    if known is not None:
        atomic_write_json(json_path, known[1])
    # rename first: a crash while deleting must not leave a subset of the parts (the truth) behind
    doomed = parts_dir.with_name(parts_dir.name + ".deleting")
    os.replace(parts_dir, doomed)
    shutil.rmtree(doomed)
    return state


# ================================================================================ in the caller's process
def _run_in_child(func: str, *args: Any) -> Any:
    """Run one of the functions above in a fresh writer process; a crash there is a WorkerError here."""
    proc = IsolatedProcess(_THIS_MODULE, "the HDF5 writer process")
    try:
        return proc.call(func, *args)
    except ChildDied as e:
        where = Path(args[0])
        raise WorkerError(f"{e} while running {func} on {where}; {_disk_text(where.parent)}") from e
    except OSError as e:
        if _is_disk_full(e):
            where = Path(args[0])
            raise WorkerError(f"No space left on device while running {func} on {where}: {_disk_text(where.parent)}. "
                              f"Free space or choose another output_dir") from e
        raise
    finally:
        proc.stop()


def _runs(jobs: list[tuple[int, list, bool]], max_bytes: int = 64 << 20) -> list[list[tuple[int, list, bool]]]:
    """Jobs in runs of consecutive part numbers (of at most ``max_bytes`` of arrays): each run is one part."""
    runs: list[list[tuple[int, list, bool]]] = []
    size = 0
    for job in jobs:
        nbytes = sum(a.nbytes for _, datasets, _ in job[1] for a in datasets.values())
        if runs and job[0] == runs[-1][-1][0] + 1 and job[2] and runs[-1][-1][2] and size + nbytes <= max_bytes:
            runs[-1].append(job)
            size += nbytes
        else:
            runs.append([job])
            size = nbytes
    return runs


def _disk_text(path: Path) -> str:
    free = _free_bytes(path)
    if free is None:
        return f"the free space of {path} is unknown"
    text = f"{free:,} bytes free on the filesystem of {path}"
    if free < _LOW_DISK:
        text += " (nearly full: free space or choose another output_dir)"
    return text


def recover(h5_path: str | Path) -> int:
    """Rebuild ``NAME.h5`` (the index) and ``NAME.json`` from the complete part files alone.

    For files a crash left behind: leftover ``*.tmp`` half-written parts are deleted; every complete part
    is listed, in part order, with episodes renumbered to consecutive ids 0..n-1 (index links and JSON
    entries alike). Parts written before parts carried their JSON entries take them from ``NAME.json``.
    A self-contained (consolidated) ``NAME.h5`` with no parts is left as it is. Returns the number of
    episodes. Parts that cannot be read are left in place, unlisted, with a warning.
    """
    state = _run_in_child("_recover_here", str(h5_path), None, False)
    if state["skipped"]:
        warnings.warn(f"recover({str(h5_path)!r}): part files not listed: {state['skipped']}", stacklevel=2)
    return len(state["episodes"])


def consolidate(h5_path: str | Path) -> Path:
    """Make ``NAME.h5`` one self-contained file: `recover` first (so complete parts a crash left unlisted
    are kept), copy every episode into a new file with the same group names and JSON ids (in a writer
    process, atomic rename), and only then remove ``NAME.h5.parts``. Returns ``NAME.h5``."""
    _run_in_child("_consolidate_here", str(h5_path), None)
    return Path(h5_path)


class TrajectoryWriter:
    """Owns: ``NAME.h5``, ``NAME.json``, the part files, the writer processes that fill them (one thread
    each feeds its process), and the index process that publishes the index and JSON.

    ``submit(episodes)`` queues a batch as one part (blocking when the writers are behind: at most
    ``max_pending`` batches wait); ``wait_until_done()`` returns once everything submitted is on disk and
    listed; ``close()`` drains, publishes, consolidates (``consolidate_on_close``, not after a failure)
    and re-raises. A failure of any writer is a `WorkerError` at the next call; the parts stay.

    ``resume=False`` refuses existing files (`FileExistsError`); ``resume=True`` recovers them and
    appends, episode ids continuing at ``next_episode_id``.
    """

    def __init__(self, h5_path: Path, header: dict[str, Any], *, resume: bool = False, num_writers: int = 1,
                 max_pending: int = 4, index_interval_s: float = 1.0, consolidate_on_close: bool = True,
                 compression: str = DEFAULT_COMPRESSION) -> None:
        if not isinstance(num_writers, int) or num_writers < 1:
            raise ValueError(f"num_writers={num_writers!r}: pass an int >= 1 (writer processes, e.g. 1-4)")
        parse_compression(compression)
        self.compression = compression
        self.num_writers = num_writers
        if not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending={max_pending!r}: pass an int >= 1 (batches waiting for a writer)")
        self.h5_path = Path(h5_path)
        self.json_path, self.parts_dir = _sibling_paths(self.h5_path)
        existing = [p for p in (self.h5_path, self.json_path, self.parts_dir) if p.exists()]
        if existing and not resume:
            names = ", ".join(p.name for p in existing)
            raise FileExistsError(
                f"{names} already exist in {self.h5_path.parent}: TrajectoryWriter(resume=False) never replaces a "
                f"recording. Pass resume=True to append to it, or remove them, or choose another output_dir or name"
            )
        self._header: dict[str, Any] = {k: v for k, v in _to_jsonable(dict(header)).items() if k != "episodes"}
        self._committed: list[dict[str, Any]] = []  # JSON entries whose parts are complete, in id order
        self.json_data: dict[str, Any] = {**self._header, "episodes": self._committed}
        self._links: list[tuple[str, str, str]] = []  # (index name, part file, group in it), one per committed
        self._done: dict[int, list[tuple[str, dict]]] = {}  # complete parts not yet in the prefix
        self._next_part = 0  # number of the next submitted part
        self._next_commit = 0  # the first part not in the committed prefix
        self._in_flight = 0  # batches submitted and not finished
        self._published = -1  # episodes listed by the index + JSON on disk
        self._last_publish = 0.0
        self._last_alive_check = 0.0
        self._index_interval_s = index_interval_s
        self._consolidate_on_close = consolidate_on_close
        self._failure: tuple[str, BaseException | None] | None = None
        self._closed = False
        self._stopping = False
        self._active: set[int] = set()  # pids of processes whose call (and its error handling) is under way
        self.blocked_seconds = 0.0  # time submit() waited for a free slot
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue(maxsize=max_pending)
        self._index: IsolatedProcess | None = None
        self._writers: list[IsolatedProcess] = []
        try:  # processes start in parallel; the first call waits for its process's imports
            self._index = IsolatedProcess(_THIS_MODULE, "the HDF5 index process")
            self._writers = [IsolatedProcess(_THIS_MODULE, f"HDF5 writer process {i}") for i in range(num_writers)]
            if existing:
                self._resume()
            else:
                self.parts_dir.mkdir(parents=True, exist_ok=True)
                self._publish(force=True)  # an empty but valid file pair from the start
                self.raise_if_failed()
        except BaseException:
            self._stop_processes()
            raise
        self.next_episode_id = len(self._committed)
        self._threads = [threading.Thread(target=self._run, args=(p,), name=f"fastrecord-h5-{i}", daemon=True)
                         for i, p in enumerate(self._writers)]
        for t in self._threads:
            t.start()

    def _resume(self) -> None:
        try:
            state = self._index.call("_recover_here", str(self.h5_path), self._header, True)
        except (ChildDied, OSError) as e:
            raise WorkerError(self._explain(e, f"recovering {self.h5_path.name} to resume", self.parts_dir)) from e
        if state["skipped"]:
            warnings.warn(f"resuming {self.h5_path}: part files not listed: {state['skipped']}", stacklevel=3)
        self._committed.extend(state["episodes"])
        self._links.extend(tuple(link) for link in state["links"])
        self._next_part = self._next_commit = state["next_part"]
        self._published = len(self._committed)
        self._last_publish = time.monotonic()

    # -------------------------------------------------------------- caller side
    @property
    def num_episodes(self) -> int:
        return len(self._committed)

    @property
    def pids(self) -> list[int]:
        """Process ids: the part writers, then the index process."""
        return [p.pid for p in self._writers] + ([self._index.pid] if self._index is not None else [])

    def submit(self, episodes: list[EpisodeData]) -> None:
        """Queue one batch of finished episodes: one part file, or one per writer when the batch has more
        episodes than one (so a batch's compression runs on every writer); blocks while ``max_pending`` wait."""
        if self._closed:
            raise RuntimeError("submit() on a closed TrajectoryWriter; open a new one with resume=True to append")
        self.raise_if_failed()
        if not episodes:
            return
        entries = []
        for ep in episodes:
            meta = _to_jsonable(dict(ep.meta))
            meta["episode_id"] = int(ep.episode_id)
            entries.append((f"traj_{int(ep.episode_id)}", {k: np.asarray(v) for k, v in ep.datasets.items()}, meta))
        # a batch larger than one episode a writer is spread over the writers: one part each, in order
        n = min(self.num_writers, len(entries))
        bounds = [round(i * len(entries) / n) for i in range(n + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            with self._lock:
                k = self._next_part
                self._next_part += 1
                self._in_flight += 1
            t0 = time.perf_counter()
            self._jobs.put((k, entries[lo:hi], n == 1))  # (part, entries, may share a part with its neighbours)
            self.blocked_seconds += time.perf_counter() - t0
        self.raise_if_failed()

    def raise_if_failed(self, max_age: float = 0.0) -> None:
        """Raise a writer's failure; a process that died while idle counts too (its exit status is polled
        unless polled less than ``max_age`` seconds ago: the per-step check of the sink)."""
        if self._failure is None and not self._stopping and time.monotonic() - self._last_alive_check >= max_age:
            self._check_alive()
        if self._failure is not None:
            text, cause = self._failure
            raise WorkerError(f"{text}. {self._safe_text()}") from cause

    def wait_until_done(self) -> None:
        """Block until every submitted batch is on disk and listed by ``NAME.h5`` + ``NAME.json``."""
        if self._closed:
            self.raise_if_failed()
            return
        self._jobs.join()
        self.raise_if_failed()
        self._publish(force=True)
        self.raise_if_failed()

    def close(self) -> None:
        """Drain, publish, consolidate (unless a writer failed), stop the processes, re-raise. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            for _ in self._threads:
                self._jobs.put(None)
            for t in self._threads:
                t.join()
            if self._failure is None:
                self._check_alive()
            failed = self._failure is not None
            if failed or not self._consolidate_on_close:  # consolidating publishes (from the parts) itself
                self._publish(force=True, best_effort=failed)
            if self._failure is None and self._consolidate_on_close:
                try:
                    with self._lock:  # every batch is written: the links and entries of every part
                        known = (list(self._links), {**self._header, "episodes": list(self._committed)})
                    self._index.call("_consolidate_here", str(self.h5_path), self._header, known)
                except BaseException as e:  # noqa: BLE001 - raised below as a WorkerError
                    self._fail(self._explain(e, f"consolidating {self.h5_path.name}", self.h5_path.parent), e)
                    self.h5_path.with_name(self.h5_path.name + ".tmp").unlink(missing_ok=True)
                    self._publish(force=True, best_effort=True)  # the index lists every committed episode
        finally:
            self._stop_processes()
        self.raise_if_failed()

    def __enter__(self) -> TrajectoryWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- feeding threads
    def _run(self, proc: IsolatedProcess) -> None:
        while True:
            jobs = [self._jobs.get()]
            # small batches queued behind this one (the writers fell behind: envs finishing a few at a time)
            # share its part: one file, one fsync, one round trip for all of them
            while jobs[-1] is not None and jobs[-1][2]:
                try:
                    nxt = self._jobs.get_nowait()
                except queue.Empty:
                    break
                jobs.append(nxt)
            try:
                for run in _runs([j for j in jobs if j is not None]):
                    if self._failure is None:
                        self._write(proc, run)
                    else:  # after a failure, drain without working
                        with self._lock:
                            self._in_flight -= len(run)
                if jobs[-1] is None:
                    return
            finally:
                for _ in jobs:
                    self._jobs.task_done()
                jobs = run = None  # drop the batches' arrays before waiting again

    def _write(self, proc: IsolatedProcess, run: list[tuple[int, list, bool]]) -> None:
        """Write the jobs of ``run`` (consecutive part numbers) as one part, named by the first."""
        k = run[0][0]
        entries = [e for job in run for e in job[1]]
        name = _part_name(k)
        tmp = self.parts_dir / (name + ".tmp")
        metas = [(group, meta) for group, _, meta in entries]
        self._active.add(proc.pid)
        try:
            proc.call("_write_part", str(tmp), str(self.parts_dir / name), self._header, entries, self.compression)
        except BaseException as e:  # noqa: BLE001 - raised in the caller as a WorkerError
            ids = f"{metas[0][1]['episode_id']}-{metas[-1][1]['episode_id']}"
            with self._lock:
                self._in_flight -= len(run)
            self._fail(self._explain(e, f"writing {name} (episodes {ids})", tmp), e)
            tmp.unlink(missing_ok=True)  # garbage; frees the space for the index below
            self._publish(force=True, best_effort=True)
            return
        finally:
            self._active.discard(proc.pid)
        with self._lock:
            self._done[k] = metas
            for job in run[1:]:  # the parts it absorbed: no file, no episodes
                self._done[job[0]] = []
            while self._next_commit in self._done:
                part = _part_name(self._next_commit)
                for group, meta in self._done.pop(self._next_commit):
                    meta["episode_id"] = len(self._committed)
                    self._links.append((f"traj_{meta['episode_id']}", part, group))
                    self._committed.append(meta)
                self._next_commit += 1
            self._in_flight -= len(run)
            idle = self._in_flight == 0
        # rebuilding the index costs O(episodes): at most once per interval while busy
        self._publish(force=idle)

    def _publish(self, force: bool, best_effort: bool = False) -> None:
        """Swap in the index + JSON of the committed prefix (in the index process)."""
        if not force and time.monotonic() - self._last_publish < self._index_interval_s:
            return
        if not self._publish_lock.acquire(blocking=force):
            return  # another thread is publishing
        try:
            with self._lock:
                n = len(self._committed)
                if n == self._published:
                    return
                links = list(self._links[:n])
                doc = {**self._header, "episodes": list(self._committed[:n])}
            index = self._index
            self._active.add(index.pid)
            try:
                if best_effort and index.poll() is not None:  # after a failure: a fresh one lists what is safe
                    index.stop()
                    index = self._index = IsolatedProcess(_THIS_MODULE, "the HDF5 index process")
                index.call("_publish_here", str(self.h5_path), links, doc)
            except BaseException as e:  # noqa: BLE001 - raised in the caller as a WorkerError
                for p in (self.h5_path, self.json_path):
                    p.with_name(p.name + ".tmp").unlink(missing_ok=True)
                if not best_effort:
                    self._fail(self._explain(e, f"writing the index {self.h5_path.name} + {self.json_path.name}",
                                             self.h5_path), e)
                return
            finally:
                self._active.discard(index.pid)
            self._published = n
            self._last_publish = time.monotonic()
        finally:
            self._publish_lock.release()

    # -------------------------------------------------------------- failures
    def _fail(self, text: str, cause: BaseException | None) -> None:
        with self._lock:
            if self._failure is None:
                self._failure = (text, cause)

    def _check_alive(self) -> None:
        """A process that died while idle (a signal, the OOM killer) is a failure too."""
        self._last_alive_check = time.monotonic()
        for p in [*self._writers, *([self._index] if self._index is not None else [])]:
            code = p.poll()
            if code is not None and p.pid not in self._active and not self._stopping:
                err = ChildDied(f"{p.name} (pid {p.pid}) {exit_description(code)}", code)
                self._fail(self._explain(err, "waiting for work", self.parts_dir), err)
                return

    def _explain(self, e: BaseException, what: str, path: Path) -> str:
        """The cause of a failure in words, with the fix where there is one."""
        if _is_disk_full(e):
            free = _free_bytes(path.parent)
            return (f"No space left on device while {what} ({path}): {free:,} bytes free on that filesystem. "
                    f"Free space or choose another output_dir")
        if isinstance(e, ChildDied):
            free = _free_bytes(path.parent)
            if free is not None and free < _LOW_DISK:  # HDF5 may crash rather than report ENOSPC
                return (f"{e} while {what}, with {free:,} bytes free on the filesystem of {path}: most likely "
                        f"No space left on device. Free space or choose another output_dir")
            return f"{e} while {what}; {_disk_text(path.parent)}"
        tb = getattr(e, "remote_traceback", None)
        text = f"{type(e).__name__} while {what} ({path}): {e}"
        return text + (f"\n(in the writer process; its traceback:\n{tb})" if tb and not isinstance(e, OSError) else "")

    def _safe_text(self) -> str:
        n, listed = len(self._committed), max(self._published, 0)
        text = f"{n} finished episode(s) are safely on disk"
        if listed >= n:
            text += f", listed in {self.h5_path.name} + {self.json_path.name}"
        else:
            text += (f": {listed} listed in {self.h5_path.name} + {self.json_path.name}, {n - listed} more in complete "
                     f"part files (fastrecord.sinks.maniskill_h5.recover({str(self.h5_path)!r}) lists them)")
        return (text + f"; the part files in {self.parts_dir} are kept: "
                f"fastrecord.sinks.maniskill_h5.consolidate({str(self.h5_path)!r}) makes one file of them")

    def _stop_processes(self) -> None:
        self._stopping = True
        for p in [*self._writers, *([self._index] if self._index is not None else [])]:
            p.stop()


# ================================================================================ reading
@dataclass
class TrajectoryFile:
    """A validated ManiSkill trajectory pair: the open HDF5 file and its JSON metadata."""

    h5_path: Path
    json_path: Path
    h5: Any  # h5py.File, open read-only
    meta: dict[str, Any]

    @property
    def env_info(self) -> dict[str, Any]:
        return self.meta["env_info"]

    @property
    def episodes(self) -> list[dict[str, Any]]:
        return self.meta["episodes"]

    def group(self, episode: Mapping[str, Any]):
        return self.h5[f"traj_{episode['episode_id']}"]

    def actions(self, episode: Mapping[str, Any]) -> np.ndarray:
        return np.asarray(self.group(episode)["actions"][:], dtype=np.float32)

    def env_states(self, episode: Mapping[str, Any]) -> dict[str, Any]:
        return _read_tree(self.group(episode)["env_states"])

    def recorded_success(self, episode: Mapping[str, Any]) -> bool | None:
        g = self.group(episode)
        if "success" in g and len(g["success"]):
            return bool(g["success"][-1])
        return None if "success" not in episode else bool(episode["success"])

    def close(self) -> None:
        self.h5.close()


def _read_tree(group) -> dict[str, Any]:
    return {k: (_read_tree(v) if isinstance(v, h5py.Group) else v[:]) for k, v in group.items()}


def open_trajectory(path: str | Path) -> TrajectoryFile:
    """Open and check a trajectory pair; every problem is a ValueError naming the file and the fix."""
    h5_path = Path(path)
    if not h5_path.exists():
        raise ValueError(f"trajectory file {str(h5_path)!r} does not exist; pass the NAME.h5 of a recorded NAME.h5 + NAME.json pair")
    if h5_path.is_dir() or h5_path.suffix != ".h5":
        raise ValueError(f"{str(h5_path)!r} is not a .h5 trajectory file; pass the NAME.h5 of a recorded NAME.h5 + NAME.json pair")
    json_path = h5_path.with_suffix(".json")
    if not json_path.exists():
        raise ValueError(
            f"{str(json_path)!r} is missing: a ManiSkill trajectory is a NAME.h5 + NAME.json pair, and the JSON holds "
            f"the env id, env kwargs and episode seeds that {h5_path.name} needs to be replayed"
        )
    try:
        meta = json.loads(json_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{str(json_path)!r} is not valid JSON ({e.msg} at line {e.lineno}); the file is corrupt or truncated") from None
    except UnicodeDecodeError:
        raise ValueError(f"{str(json_path)!r} is not a text (JSON) file; the file is corrupt") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("env_info"), dict) or not isinstance(meta.get("episodes"), list):
        found = sorted(meta) if isinstance(meta, dict) else type(meta).__name__
        raise ValueError(
            f"{str(json_path)!r} is not ManiSkill trajectory metadata: it needs 'env_info' (a mapping) and 'episodes' "
            f"(a list), found {found}. Pass a file written by fastrecord or mani_skill's RecordEpisode"
        )
    if not meta["env_info"].get("env_id"):
        raise ValueError(f"{str(json_path)!r} has no env_info.env_id: the task to replay in is unknown; the file is not a ManiSkill trajectory")
    for i, ep in enumerate(meta["episodes"]):
        missing = [k for k in ("episode_id", "episode_seed", "elapsed_steps") if k not in ep]
        if missing:
            raise ValueError(f"{str(json_path)!r}: episodes[{i}] lacks {missing}; the file is not a ManiSkill trajectory (or is corrupt)")
    try:
        h5 = h5py.File(h5_path, "r")
    except OSError as e:
        raise ValueError(f"{str(h5_path)!r} is not a readable HDF5 file ({e}); the file is corrupt, truncated or of another format") from None
    traj = TrajectoryFile(h5_path, json_path, h5, meta)
    for ep in meta["episodes"]:
        name = f"traj_{ep['episode_id']}"
        if name not in h5 or "actions" not in h5[name]:
            h5.close()
            problem = "no group" if name not in h5 else "no actions in group"
            raise ValueError(
                f"{str(h5_path)!r} has {problem} {name!r} for episode {ep['episode_id']} listed in {json_path.name}: the .h5 "
                f"and .json do not belong together, or the file is not a ManiSkill trajectory"
            )
    return traj


# ---------------------------------------------------------------------------------------------- the sink
# (sinks.base imports only numpy and fastrecord.workers: writer processes may import this module)
from fastrecord.sinks.base import RunDirectory, Sink  # noqa: E402


class ManiSkillH5Sink(Sink):
    """ManiSkill's trajectory pair ``NAME.h5`` + ``NAME.json`` of the run, through `TrajectoryWriter`
    (crash-safe parts, writer processes). ``resume`` runs continue the episode ids on disk."""

    wants_datasets = True

    def __init__(self, header: dict[str, Any], writers: int = 1, compression: str = DEFAULT_COMPRESSION) -> None:
        parse_compression(compression)
        self.header = header
        self.writers = writers
        self.compression = compression
        self.writer: TrajectoryWriter | None = None

    def open(self, run: RunDirectory) -> None:
        super().open(run)
        self.writer = TrajectoryWriter(run.path(".h5"), self.header, resume=run.resuming, num_writers=self.writers,
                                       compression=self.compression)

    @property
    def next_episode_id(self) -> int:
        return self.writer.next_episode_id

    def submit(self, episodes: Sequence[EpisodeData]) -> None:
        self.writer.submit(list(episodes))

    def raise_if_failed(self) -> None:
        # every step and reset: polling the writer processes' exit status (3 waitpid calls, 0.5 ms a step
        # in the imageobs profile) at most every 0.1 s; submit, wait_until_done and close always poll
        self.writer.raise_if_failed(max_age=0.1)

    def wait_until_done(self) -> None:
        self.writer.wait_until_done()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    @property
    def files(self) -> list[Path]:
        return [self.writer.h5_path, self.writer.json_path] if self.writer is not None else []
