"""What the writer processes run (`fastrecord.processes.IsolatedProcess` imports this module,
`layout.WRITER_PROCESS_MODULE`, and calls its functions by name): every h5py write of the format.

HDF5 may crash its process (h5py 3.16 / HDF5 2.0 can segfault closing a file after ENOSPC), so no h5py
write happens in the caller's process: `TrajectoryWriter`, `recover`, `consolidate` and `join_runs` call
these functions in a writer process. Each file is written under a temporary name, synced and renamed into
place, so a killed process leaves the file before or the file after, never half of one. Imports numpy,
h5py and the layout only.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from fastrecord.processes import parent_alive
from fastrecord.sinks.maniskill_h5.layout import (
    DEFAULT_COMPRESSION,
    EPISODES_ATTR,
    GROWING_NAME,
    HEADER_ATTR,
    IMAGE_KEYS,
    atomic_write_json,
    complete_parts,
    image_chunks,
    parse_compression,
    part_name,
    read_json,
    sibling_paths,
)


def write_dataset(group: h5py.Group, path: str, data: np.ndarray, compression: str = DEFAULT_COMPRESSION) -> None:
    *parents, leaf = path.split("/")
    for p in parents:
        group = group[p] if p in group else group.create_group(p, track_order=True)
    method, level = parse_compression(compression)
    if leaf in IMAGE_KEYS and data.ndim >= 3 and method is not None and data.size:
        group.create_dataset(leaf, data=data, chunks=image_chunks(data.shape, data.dtype.itemsize),
                             compression=method, compression_opts=level)
    else:
        group.create_dataset(leaf, data=data)


def fsync(path: Path) -> None:
    """Flush ``path``'s data to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_part(tmp: str, final: str, header: dict, entries: list[tuple[str, dict[str, np.ndarray], dict]],
                compression: str = DEFAULT_COMPRESSION) -> int:
    """Write one part file: ``entries`` are (group name, {dataset path: array}, JSON entry). Returns its size."""
    with h5py.File(tmp, "w", track_order=True) as f:
        for group, datasets, _ in entries:
            g = f.create_group(group, track_order=True)
            for path, data in datasets.items():
                write_dataset(g, path, data, compression)
        f.attrs[EPISODES_ATTR] = json.dumps([meta for _, _, meta in entries])
        f.attrs[HEADER_ATTR] = json.dumps(header)
    fsync(Path(tmp))
    if not parent_alive():  # the recording died meanwhile: nobody will list this part
        os.unlink(tmp)
        os._exit(0)
    os.replace(tmp, final)
    return os.path.getsize(final)


def publish_index(h5_path: str, links: list[tuple[str, str, str]], doc: dict) -> None:
    """Swap in the index ``NAME.h5`` (``links``: (name, part file, group in it)), then ``NAME.json``."""
    h5 = Path(h5_path)
    json_path, parts_dir = sibling_paths(h5)
    tmp = h5.with_name(h5.name + ".tmp")
    with h5py.File(tmp, "w", track_order=True) as f:
        for name, part, target in links:
            f[name] = h5py.ExternalLink(f"{parts_dir.name}/{part}", f"/{target}")
    if not parent_alive():
        os.unlink(tmp)
        os._exit(0)
    os.replace(tmp, h5)
    atomic_write_json(json_path, doc)


def link_index(h5_path: str, links: list[tuple[str, str, str]], doc: dict) -> None:
    """Swap in an index ``NAME.h5`` of external links (``links``: (name, file relative to the index's
    folder, group in it)), then ``NAME.json``; both atomically. `merge.join_runs` uses it."""
    h5 = Path(h5_path)
    tmp = h5.with_name(h5.name + ".tmp")
    with h5py.File(tmp, "w", track_order=True) as f:
        for name, target_file, target in links:
            f[name] = h5py.ExternalLink(target_file, f"/{target}")
    fsync(tmp)
    if not parent_alive():
        os.unlink(tmp)
        os._exit(0)
    os.replace(tmp, h5)
    atomic_write_json(h5.with_suffix(".json"), doc)


def copy_index(h5_path: str, links: list[tuple[str, str, str]], doc: dict) -> None:
    """Like `link_index`, but copies every linked group into one self-contained ``NAME.h5`` (the
    sources, external links included, are followed and left as they are)."""
    h5 = Path(h5_path)
    write_copies(h5, h5.parent, links)
    atomic_write_json(h5.with_suffix(".json"), doc)


def write_copies(h5: Path, folder: Path, links: Sequence[tuple[str, str, str]]) -> None:
    """Swap in ``h5`` (atomically) holding a copy of every group of ``links`` ((name, file in ``folder``,
    group in it)); each source file is opened once per run of links into it and left as it is. If the
    recording died meanwhile, exits without swapping it in (nobody will list the result)."""
    tmp = h5.with_name(h5.name + ".tmp")
    with h5py.File(tmp, "w", track_order=True) as dst:
        _copy_links(dst, folder, links)
    _swap_in(tmp, h5)


def _copy_links(dst: h5py.File, folder: Path, links: Sequence[Sequence[str]]) -> None:
    """Copy each group of ``links`` ((name, file in ``folder``, group in it)) into ``dst`` as it is stored
    (HDF5 copies compressed chunks without decoding them)."""
    src, src_name = None, None
    try:
        for name, source_file, target in links:
            if source_file != src_name:
                if src is not None:
                    src.close()
                src, src_name = h5py.File(folder / source_file, "r"), source_file
            assert src is not None  # opened above for the first link (src_name starts as None)
            src.copy(src[target], dst, name=name)
    finally:
        if src is not None:
            src.close()


def _swap_in(tmp: Path, h5: Path) -> None:
    """Sync the closed file ``tmp`` and rename it to ``h5``; if the recording died meanwhile, remove it and exit
    (nobody will list it)."""
    fsync(tmp)
    if not parent_alive():
        os.unlink(tmp)
        os._exit(0)
    os.replace(tmp, h5)


# ---------------------------------------------------------------------------------------------- the growing copy
@dataclass
class _Growing:
    """The self-contained copy of a recording's committed episodes that its close will swap in, kept open."""

    path: Path
    file: h5py.File
    links: list[tuple[str, str, str]] = field(default_factory=list)  # copied so far, in index order


_growing: dict[str, _Growing] = {}  # NAME.h5's path -> its growing copy (this process's, while it records)
_given_up: set[str] = set()  # recordings whose copy failed (a full disk): their close copies everything


def extend_copy(h5_path: str, links: Sequence[Sequence[str]]) -> int:
    """Grow the copy that `consolidate_here` swaps in at the close (``NAME.h5.parts/consolidating.h5.tmp``, open in
    this process) with the episodes of ``links`` (the index's, ``(name, part file, group in it)``) it does not hold
    yet: the close then copies only the last ones (a copy costs about 0.5 ms an episode of 9 datasets: 5 s at the
    close of 10,000 episodes). The file is never read as the run's: a kill leaves a ``*.tmp`` that recovery removes.
    ``links`` that do not extend what it holds start it again. An OSError (a full disk) gives it up for this
    recording, its file unlinked and its handle left open (HDF5 may crash closing a file after ENOSPC); the close
    then copies every episode, as before. Returns the episodes it holds."""
    if h5_path in _given_up:
        return 0
    wanted = _as_links(links)
    grown = _growing.get(h5_path)
    if grown is not None and wanted[: len(grown.links)] != grown.links:
        _drop_copy(h5_path)
        grown = None
    parts_dir = sibling_paths(Path(h5_path))[1]
    try:
        if grown is None:
            path = parts_dir / GROWING_NAME
            grown = _growing[h5_path] = _Growing(path, h5py.File(path, "w", track_order=True))
        new = wanted[len(grown.links):]
        _copy_links(grown.file, parts_dir, new)
        grown.links += new
    except OSError:
        _given_up.add(h5_path)
        grown = _growing.pop(h5_path, None)
        if grown is not None:
            _abandon(grown)
        return 0
    return len(grown.links)


def _as_links(links: Sequence[Sequence[str]]) -> list[tuple[str, str, str]]:
    """``links`` as (name, part file, group) tuples of str (they arrive as lists through the process's pipe)."""
    return [(str(a), str(b), str(c)) for a, b, c in links]


def _drop_copy(h5_path: str) -> None:
    """Close and remove the growing copy of ``h5_path``, if any."""
    grown = _growing.pop(h5_path, None)
    if grown is not None:
        grown.file.close()
        grown.path.unlink(missing_ok=True)


_abandoned: list[h5py.File] = []  # handles of given-up copies: never closed (see extend_copy)


def _abandon(grown: _Growing) -> None:
    """A copy a full disk stopped: its space back now (unlinked), its handle never closed (see extend_copy)."""
    _abandoned.append(grown.file)
    grown.path.unlink(missing_ok=True)


def _finish_copy(h5: Path, links: Sequence[Sequence[str]]) -> bool:
    """Swap in the growing copy of ``h5`` completed with the rest of ``links``; False (nothing done, the copy
    dropped) where there is none, or it does not hold a prefix of ``links``."""
    wanted = _as_links(links)
    grown = _growing.get(str(h5))
    if grown is None or wanted[: len(grown.links)] != grown.links:
        _drop_copy(str(h5))
        return False
    del _growing[str(h5)]
    try:
        _copy_links(grown.file, grown.path.parent, wanted[len(grown.links):])
    except OSError:  # a full disk
        _abandon(grown)
        raise
    grown.file.close()
    _swap_in(grown.path, h5)
    return True


def groups_of(h5_path: str) -> dict[str, Any]:
    """What an existing ``NAME.h5`` holds: its top-level names and whether any is stored in the file
    itself rather than as an external link (a consolidated file); ``{"error": text}`` if unreadable."""
    try:
        with h5py.File(h5_path, "r") as f:
            names = list(f)
            own = [k for k in names if not isinstance(f.get(k, getlink=True), h5py.ExternalLink)]
    except OSError as e:
        return {"error": str(e)}
    return {"names": names, "self_contained": bool(own)}


def self_contained(h5: Path) -> bool:
    """Whether ``NAME.h5`` holds data itself (a consolidated or ManiSkill file), not only links to parts."""
    try:
        with h5py.File(h5, "r") as f:
            return any(not isinstance(f.get(k, getlink=True), h5py.ExternalLink) for k in f)
    except OSError as e:
        raise ValueError(f"{h5} is not a readable HDF5 file ({e}) and there are no part files to rebuild it from; "
                         f"move it away (or pass resume=False with another output_dir)") from None


def adopt(src: Path, final: Path, metas: list[dict], header: dict) -> None:
    """Make ``src`` a part carrying its entries: a copy gets the attributes, then replaces ``final``
    atomically (a crash at any point leaves ``src`` or the finished part, never a half-edited file)."""
    tmp = final.with_name(final.name + ".tmp")
    shutil.copyfile(src, tmp)
    with h5py.File(tmp, "r+") as f:
        f.attrs[EPISODES_ATTR] = json.dumps(metas)
        f.attrs[HEADER_ATTR] = json.dumps(header)
    fsync(tmp)
    os.replace(tmp, final)


def recover_here(h5_path: str, header: dict | None, resume: bool) -> dict[str, Any]:
    """Rebuild ``NAME.h5`` + ``NAME.json`` from the complete parts; see `recover`.

    With ``resume``, a self-contained ``NAME.h5`` (a closed run) first becomes part 0. Returns the
    state: header, episodes (renumbered entries), links, next_part, skipped, self_contained.
    """
    h5 = Path(h5_path)
    json_path, parts_dir = sibling_paths(h5)
    _remove_leftovers(h5)
    old = read_json(json_path)
    if header is None and old is not None:
        header = {k: v for k, v in old.items() if k != "episodes"}
    old_entries = old.get("episodes", []) if old is not None else []
    if not isinstance(old_entries, list):
        old_entries = []
    parts = complete_parts(parts_dir)
    if not parts and h5.exists() and not self_contained(h5):
        _refuse_an_index_without_parts(h5)
    if not parts and h5.exists() and self_contained(h5):
        if not resume:  # a closed run: already one file
            return dict(
                header=header or {}, episodes=old_entries, links=[], next_part=0, skipped=[], self_contained=True
            )
        _adopt_closed_run(h5, old, header)
        parts = complete_parts(parts_dir)
    by_id = {e["episode_id"]: e for e in old_entries if isinstance(e, dict) and "episode_id" in e}
    episodes: list[dict] = []
    links: list[tuple[str, str, str]] = []
    skipped: list[str] = []
    for _, part in parts:
        read = _read_part(part, by_id, header, json_path.name)
        if isinstance(read, str):
            skipped.append(read)
            continue
        items, header = read
        for g, m in items:
            m = dict(m, episode_id=len(episodes))
            episodes.append(m)
            links.append((f"traj_{m['episode_id']}", part.name, g))
    header = header or {}
    parts_dir.mkdir(exist_ok=True)
    publish_index(str(h5), links, {**header, "episodes": episodes})
    next_part = parts[-1][0] + 1 if parts else 0
    return dict(
        header=header, episodes=episodes, links=links, next_part=next_part, skipped=skipped, self_contained=False
    )


def _remove_leftovers(h5: Path) -> None:
    """What a crash left half-done around ``NAME.h5``: the parts folder of a finished consolidation that died
    deleting it, temporaries of the pair, half-written parts. FileNotFoundError where there is no run at all."""
    json_path, parts_dir = sibling_paths(h5)
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


def _refuse_an_index_without_parts(h5: Path) -> None:
    """A ValueError where ``NAME.h5`` is an index of links copied without its parts folder: rebuilding it from
    no parts would list nothing."""
    with h5py.File(h5, "r") as f:
        linked = [f.get(k, getlink=True).filename for k in f if isinstance(f.get(k, getlink=True), h5py.ExternalLink)]
    if linked:
        parts_dir = sibling_paths(h5)[1]
        raise ValueError(
            f"{h5} is an index of links ({len(linked)} episodes, e.g. into {linked[0]}) and "
            f"{parts_dir.name}/ is not next to it: there are no parts to rebuild it from. Run this in the folder "
            f"the run was recorded in, or copy {parts_dir.name}/ next to {h5.name} first"
        )


def _adopt_closed_run(h5: Path, old: dict | None, header: dict | None) -> None:
    """A resume of a closed run: its self-contained ``NAME.h5`` becomes part 0 (every group listed in
    ``NAME.json``, ``old``; a ValueError where one is not, or the JSON is missing)."""
    json_path, parts_dir = sibling_paths(h5)
    if old is None:
        raise ValueError(f"cannot resume {h5}: {json_path.name} (the episodes' seeds and ids) is missing or not valid "
                         f"JSON")
    old_entries = old.get("episodes", [])
    old_entries = old_entries if isinstance(old_entries, list) else []
    with h5py.File(h5, "r") as f:
        metas = [e for e in old_entries if f"traj_{e.get('episode_id')}" in f]
        unlisted = sorted(set(f) - {f"traj_{e['episode_id']}" for e in metas})
    if unlisted:
        raise ValueError(f"cannot resume {h5}: groups {unlisted[:5]} have no entry in {json_path.name}; "
                         f"resuming would drop them. Move the pair away and record with resume=False")
    parts_dir.mkdir(exist_ok=True)
    adopt(h5, parts_dir / part_name(0), metas, header or {})


def _read_part(part: Path, by_id: dict[int, dict], header: dict | None,
               json_name: str) -> tuple[list[tuple[str, dict]], dict | None] | str:
    """A complete part's episodes, ``[(group, entry)]``, and the header (``header``, or the part's where none);
    or why it is skipped. A part written before parts carried their entries takes them from ``NAME.json``'s
    (``by_id``), for good: ids are renumbered by the caller, ``NAME.json``'s would not match later."""
    try:
        with h5py.File(part, "r") as f:
            text = f.attrs.get(EPISODES_ATTR)
            if header is None and HEADER_ATTR in f.attrs:
                header = json.loads(f.attrs[HEADER_ATTR])
            if text is None:  # written before parts carried their entries: NAME.json has them
                found = [by_id.get(int(g[5:])) for g in f if g.startswith("traj_") and g[5:].isdigit()]
                if any(m is None for m in found):
                    return f"{part.name} (episodes without an entry in {json_name})"
                metas = [m for m in found if m is not None]
            else:
                metas = json.loads(text)
            items = [(f"traj_{m['episode_id']}", m) for m in metas]
            if any(g not in f for g, _ in items):
                return f"{part.name} (groups listed in {EPISODES_ATTR} are missing)"
    except (OSError, ValueError, KeyError) as e:
        return f"{part.name} ({type(e).__name__}: {e})"
    if text is None:
        adopt(part, part, metas, header or {})
    return items, header


def consolidate_here(h5_path: str, header: dict | None, known: tuple[list, dict] | None = None) -> dict[str, Any]:
    """Recover, copy every listed episode into one self-contained ``NAME.h5``, then drop the parts.

    ``known`` = (links, JSON document): what a `TrajectoryWriter` that wrote every part knows; the parts are
    then not read back first, and ``NAME.json`` is written after ``NAME.h5`` is swapped in (a crash in
    between leaves the parts, from which `recover` rebuilds both)."""
    h5 = Path(h5_path)
    json_path, parts_dir = sibling_paths(h5)
    if known is not None:
        state = dict(
            header=header or {}, episodes=known[1]["episodes"], links=known[0], skipped=[], self_contained=False
        )
    else:
        state = recover_here(h5_path, header, resume=False)
    if state["self_contained"]:
        if parts_dir.is_dir() and not any(parts_dir.iterdir()):
            parts_dir.rmdir()
        return state
    if state["skipped"]:
        raise ValueError(f"not consolidating {h5}: part files {state['skipped']} cannot be used; the other parts are "
                         f"listed in {h5.name}. Move those files out of {parts_dir} and run consolidate again")
    _given_up.discard(h5_path)
    if known is None or not _finish_copy(h5, state["links"]):  # the copy grown while recording, or all of it now
        _drop_copy(h5_path)
        write_copies(h5, parts_dir, state["links"])
    if known is not None:
        atomic_write_json(json_path, known[1])
    # rename first: a crash while deleting must not leave a subset of the parts (the truth) behind
    doomed = parts_dir.with_name(parts_dir.name + ".deleting")
    os.replace(parts_dir, doomed)
    shutil.rmtree(doomed)
    return state



def _part_ids(part: Path, by_id: dict[int, dict]) -> list[int] | None:
    """The episode ids a complete part holds, in its order (None: unreadable, or a group is missing)."""
    try:
        with h5py.File(part, "r") as f:
            text = f.attrs.get(EPISODES_ATTR)
            if text is None:  # written before parts carried their entries: NAME.json has them
                ids = [int(g[5:]) for g in f if g.startswith("traj_") and g[5:].isdigit()]
                return ids if all(i in by_id for i in ids) else None
            ids = [int(m["episode_id"]) for m in json.loads(text)]
            return ids if all(f"traj_{i}" in f for i in ids) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def scan_here(h5_path: str) -> dict[str, Any]:
    """What a run's trajectory holds, read only: ``ids``, the episode ids of its complete parts in part
    order (or of a self-contained ``NAME.h5``: its JSON entries whose group exists), ``unreadable``: part
    files that cannot be read, ``parts``: {part file name: its ids}."""
    h5 = Path(h5_path)
    json_path, parts_dir = sibling_paths(h5)
    old = read_json(json_path) or {}
    entries = [e for e in old.get("episodes", []) if isinstance(e, dict) and isinstance(e.get("episode_id"), int)]
    by_id = {int(e["episode_id"]): e for e in entries}
    parts = complete_parts(parts_dir)
    if parts:
        ids: list[int] = []
        unreadable: list[str] = []
        held: dict[str, list[int]] = {}
        for _, part in parts:
            got = _part_ids(part, by_id)
            if got is None:
                unreadable.append(part.name)
            else:
                held[part.name] = got
                ids += got
        return dict(ids=ids, unreadable=unreadable, parts=held)
    if not h5.exists():
        return dict(ids=[], unreadable=[], parts={})
    try:
        with h5py.File(h5, "r") as f:
            ids = [int(e["episode_id"]) for e in entries if f"traj_{e['episode_id']}" in f]
    except OSError as e:
        return dict(ids=[], unreadable=[f"{h5.name} ({e})"], parts={})
    return dict(ids=ids, unreadable=[], parts={})


def trim_here(h5_path: str, n: int) -> dict[str, Any]:
    """Keep episodes ``0 .. n-1`` of a run's trajectory and drop the others (a run that stopped before its
    other outputs held them: `fastrecord.sinks.reconcile`), then list what is left (`recover_here`).
    Whole parts past ``n`` are deleted, last first; a part holding both is rewritten with its first
    episodes (atomically); a self-contained ``NAME.h5`` is copied with its first ``n`` episodes, then its
    JSON follows. Returns `scan_here` of the result."""
    h5 = Path(h5_path)
    json_path, parts_dir = sibling_paths(h5)
    state = scan_here(h5_path)
    if state["parts"]:
        for name, ids in reversed(list(state["parts"].items())):
            part = parts_dir / name
            if all(i >= n for i in ids):
                part.unlink()
            elif any(i >= n for i in ids):
                _rewrite_part(part, [i for i in ids if i < n])
        if complete_parts(parts_dir):
            recover_here(h5_path, None, False)
        else:  # nothing left: an empty index (its links would point at the deleted parts)
            old = read_json(json_path) or {}
            publish_index(h5_path, [], {**{k: v for k, v in old.items() if k != "episodes"}, "episodes": []})
    elif any(i >= n for i in state["ids"]):
        old = read_json(json_path) or {}
        keep = [e for e in old.get("episodes", []) if isinstance(e, dict) and isinstance(e.get("episode_id"), int)
                and e["episode_id"] < n]
        write_copies(h5, h5.parent, [(f"traj_{e['episode_id']}", h5.name, f"traj_{e['episode_id']}") for e in keep])
        atomic_write_json(json_path, {**old, "episodes": keep})
    return scan_here(h5_path)


def _rewrite_part(part: Path, keep: list[int]) -> None:
    """Replace ``part`` (atomically) by a copy holding only the episodes ``keep``, with their entries."""
    tmp = part.with_name(part.name + ".trim.tmp")
    with h5py.File(part, "r") as src, h5py.File(tmp, "w", track_order=True) as dst:
        metas = [m for m in json.loads(src.attrs[EPISODES_ATTR]) if int(m["episode_id"]) in keep]
        for m in metas:
            src.copy(src[f"traj_{m['episode_id']}"], dst, name=f"traj_{m['episode_id']}")
        dst.attrs[EPISODES_ATTR] = json.dumps(metas)
        if HEADER_ATTR in src.attrs:
            dst.attrs[HEADER_ATTR] = src.attrs[HEADER_ATTR]
    fsync(tmp)
    os.replace(tmp, part)
