"""ManiSkill trajectory files (``NAME.h5`` + ``NAME.json``), written so that a crash loses nothing finished.

Layout (ManiSkill's; documented in README "On-disk schema"): one group ``traj_{episode_id}`` per episode
with ``actions [T, A]``, ``terminated/truncated/success/fail [T]``, ``rewards [T]``, ``env_states``
(nested groups, ``[T+1, D]`` leaves) and ``obs`` (``[T+1, ...]``, nested for dict observations); the JSON
holds ``env_info``, ``commit_info``, ``episodes`` and ``source_type``/``source_desc``.

Crash safety. HDF5 has no journal: a process killed while the library holds dirty metadata leaves a file
h5py cannot open (ManiSkill's writer loses every episode that way). So while recording, each batch of
finished episodes goes to its own file ``NAME.h5.parts/part_K.h5``, written under a temporary name and
renamed into place once closed. ``NAME.h5`` itself is a small index of external links to those parts,
rebuilt whole and swapped in with an atomic rename, then the JSON likewise. At any instant both files are
complete, and they list the same episodes. ``close()`` consolidates: the data are copied into one
self-contained ``NAME.h5`` (atomic rename again) and the parts are removed.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from fastrecord.episode import EpisodeData  # noqa: F401 - the hand-off type
from fastrecord.workers import WorkerPool

# leaves stored compressed, one frame a chunk (ManiSkill compresses these with gzip level 5 too)
_IMAGE_KEYS = ("rgb", "depth", "seg", "segmentation", "position", "normal", "albedo")


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


def _write_dataset(group: h5py.Group, path: str, data: np.ndarray) -> None:
    *parents, leaf = path.split("/")
    for p in parents:
        group = group[p] if p in group else group.create_group(p, track_order=True)
    if leaf in _IMAGE_KEYS and data.ndim >= 3:
        chunks = (1, *data.shape[1:])
        group.create_dataset(leaf, data=data, chunks=chunks, compression="gzip", compression_opts=5)
    else:
        group.create_dataset(leaf, data=data)


class TrajectoryWriter:
    """Owns: ``NAME.h5``, ``NAME.json``, the part files, and the writer thread that fills them.

    ``submit(episodes)`` queues a batch (blocking when the writer is behind); ``close()`` writes what
    is queued, consolidates the file and re-raises any writer error. Idempotent.
    """

    def __init__(self, h5_path: Path, header: dict[str, Any], max_pending: int = 4, index_interval_s: float = 1.0):
        self.h5_path = Path(h5_path)
        self.json_path = self.h5_path.with_suffix(".json")
        self.parts_dir = self.h5_path.with_name(self.h5_path.name + ".parts")
        self._header = dict(header)
        self._committed: list[dict[str, Any]] = []  # JSON entries whose data are in a closed part file
        self._links: list[tuple[str, str]] = []  # (traj name, part file name) in episode order
        self._published = 0  # how many of _committed the index and JSON list
        self._last_publish = 0.0
        self._index_interval_s = index_interval_s
        self._part = 0
        self._closed = False
        if self.parts_dir.exists():
            shutil.rmtree(self.parts_dir)
        self.parts_dir.mkdir(parents=True)
        self._publish(force=True)  # an empty but valid file pair from the start
        self._pool = WorkerPool(self._write_batch, num_workers=1, max_pending=max_pending, name="fastrecord-h5")

    # -------------------------------------------------------------- caller side
    def submit(self, episodes: list[EpisodeData]) -> None:
        if episodes:
            self._pool.submit(episodes)

    def raise_if_failed(self) -> None:
        self._pool.raise_if_failed()

    def wait_until_done(self) -> None:
        self._pool.wait_until_done()
        self._publish(force=True)

    @property
    def num_episodes(self) -> int:
        return len(self._committed)

    def close(self, consolidate: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._pool.close()
        finally:
            self._publish(force=True)
            if consolidate:
                self._consolidate()

    # -------------------------------------------------------------- writer thread
    def _write_batch(self, episodes: list[EpisodeData]) -> None:
        name = f"part_{self._part:06d}.h5"
        self._part += 1
        tmp = self.parts_dir / (name + ".tmp")
        with h5py.File(tmp, "w", track_order=True) as f:
            for ep in episodes:
                g = f.create_group(f"traj_{ep.episode_id}", track_order=True)
                for path, data in ep.datasets.items():
                    _write_dataset(g, path, data)
        os.replace(tmp, self.parts_dir / name)
        for ep in episodes:
            self._links.append((f"traj_{ep.episode_id}", name))
            self._committed.append(ep.meta)
        # rebuilding the index costs O(episodes): do it at most once per interval while busy
        self._publish(force=self._pool.pending == 0)

    def _publish(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now - self._last_publish < self._index_interval_s:
            return
        n = len(self._committed)
        if n == self._published and self.h5_path.exists():
            return
        tmp = self.h5_path.with_name(self.h5_path.name + ".tmp")
        with h5py.File(tmp, "w", track_order=True) as f:
            for traj, part in self._links[:n]:
                f[traj] = h5py.ExternalLink(f"{self.parts_dir.name}/{part}", f"/{traj}")
        os.replace(tmp, self.h5_path)
        atomic_write_json(self.json_path, {**self._header, "episodes": self._committed[:n]})
        self._published = n
        self._last_publish = now

    def _consolidate(self) -> None:
        consolidate(self.h5_path)


def consolidate(h5_path: str | Path) -> Path:
    """Copy every episode of ``NAME.h5`` (an index of links into ``NAME.h5.parts/``, as left by a crash
    or during recording) into one self-contained ``NAME.h5`` (atomic rename), then drop the parts."""
    h5_path = Path(h5_path)
    parts = h5_path.with_name(h5_path.name + ".parts")
    tmp = h5_path.with_name(h5_path.name + ".tmp")
    with h5py.File(h5_path, "r") as src, h5py.File(tmp, "w", track_order=True) as dst:
        for traj in src:
            src.copy(src[traj], dst, name=traj)
    os.replace(tmp, h5_path)
    shutil.rmtree(parts, ignore_errors=True)
    return h5_path
