"""Joining episodes of several trajectory files into one ``NAME.h5`` + ``NAME.json``: the HDF5 side of
`fastrecord.shards.merge` (which decides, from the shards, which episode goes where).

By default the joined ``NAME.h5`` holds a copy of every episode (self-contained: it can be copied
alone, as ManiSkill's ``merge_trajectory`` writes); ``links=True`` writes an index of external links into
the source files instead (no copy, but it only opens next to them). Both files are swapped in
atomically, ``NAME.h5`` first, by a writer process. `TrajectoryJoin` is this format's part of joining the
shards of a sharded run.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastrecord.sinks.maniskill_h5.layout import read_json
from fastrecord.sinks.maniskill_h5.recover import run_in_child


def join_runs(h5_path: str | Path, sources: Sequence[tuple[str, str, str]], doc: dict[str, Any], *,
              links: bool = False) -> Path:
    """Write ``h5_path`` + its ``.json`` (``doc``: the header and the joined episodes' entries).

    ``sources`` are (group name in ``h5_path``, source file relative to ``h5_path``'s folder, group in
    it), one per episode. ``links=False`` copies each group (the sources are read, never changed);
    ``links=True`` links to it. Refuses (ValueError) to replace an unreadable ``h5_path``, or a
    self-contained one holding episodes ``doc`` no longer lists (never deletes recorded data). Returns
    ``h5_path``."""
    h5_path = Path(h5_path)
    json_path = h5_path.with_suffix(".json")
    if h5_path.exists():
        state = run_in_child("groups_of", str(h5_path))
        if "error" in state and h5_path.stat().st_size > 0:
            raise ValueError(f"{h5_path} exists and is not a readable HDF5 file ({state['error']}); move it away and "
                             f"join again")
        old = read_json(json_path) or {}
        kept = {int(e["episode_id"]) for e in doc.get("episodes", []) if "episode_id" in e}
        listed = {int(x["episode_id"]) for x in old.get("episodes", []) if isinstance(x, dict) and "episode_id" in x}
        lost = sorted(listed - kept)
        if state.get("self_contained") and lost:
            shown = ", ".join(map(str, lost[:10])) + (f", ... ({len(lost) - 10} more)" if len(lost) > 10 else "")
            raise ValueError(f"{h5_path} is a self-contained file holding episodes {shown} that the files being joined "
                             f"no longer have; joining would drop them. Move {h5_path.name} and {json_path.name} "
                             f"away first")
    run_in_child("link_index" if links else "copy_index", str(h5_path), list(sources), doc)
    return h5_path


def _comparable(info: Any) -> str:
    return json.dumps(info, sort_keys=True, default=repr)


class TrajectoryJoin:
    """The trajectory's part of joining a sharded run (`fastrecord.shards.merge`, which drives it): reads
    every shard's ``NAME.json`` entries (``read_shard``) and writes ``DIR/NAME.h5`` + ``DIR/NAME.json`` with
    each global episode ``g`` once, the lowest rank's, as ``traj_{g}`` (``write``, through `join_runs`).

    The shards' headers must agree on ``env_info`` (else ValueError naming the ranks); every entry needs
    ``global_index`` and an int ``episode_id`` (else ValueError naming the shard's file). Entries at or past
    a shard's ``limit`` (its committed episodes) are left out: the shard's resume records them again."""

    def __init__(self, run_dir: Path, name: str, *, links: bool) -> None:
        from fastrecord.shards.layout import shards_root

        self.run_dir, self.name, self.links = run_dir, name, links
        self.root = shards_root(run_dir, name)
        self.header: dict[str, Any] | None = None
        self.header_rank = -1
        self.chosen: dict[int, tuple[int, dict[str, Any]]] = {}  # g -> (rank, shard entry)
        self.folders: dict[int, Path] = {}
        self.duplicates: list[int] = []

    @property
    def found(self) -> bool:
        """Some shard has a readable ``NAME.json``."""
        return self.header is not None

    def read_shard(self, rank: int, folder: Path, limit: int | None) -> None:
        name = self.name
        doc = read_json(folder / f"{name}.json")
        if doc is None:
            return
        self.folders[rank] = folder
        shard_header = {k: v for k, v in doc.items() if k != "episodes"}
        if self.header is None:
            self.header, self.header_rank = shard_header, rank
        elif _comparable(shard_header.get("env_info")) != _comparable(self.header.get("env_info")):
            raise ValueError(
                f"the shards disagree on env_info: rank {self.header_rank} has {self.header.get('env_info')!r}, rank "
                f"{rank} has {shard_header.get('env_info')!r} ({folder}); they are not one run. Move the foreign shard "
                f"folder out of {self.root} and merge again"
            )
        for e in doc.get("episodes", []):
            g = self._global_index(e, folder)
            if limit is not None and e["episode_id"] >= limit:
                continue  # left by a stop before the shard's other outputs held it: its resume records it again
            if g in self.chosen:
                self.duplicates.append(g)
                continue
            self.chosen[g] = (rank, e)

    def _global_index(self, e: Any, folder: Path) -> int:
        """The global index of shard entry ``e``, checked (ValueError naming the file and the fix)."""
        from fastrecord.shards.layout import global_index_of

        where, root = folder / f"{self.name}.json", self.root
        if not isinstance(e, dict) or "global_index" not in e or "episode_id" not in e:
            raise ValueError(f"{where} has an episode entry without global_index/episode_id ({str(e)[:120]}); it is "
                             f"not a shard of a sharded run. Move it out of {root}")
        g = global_index_of(e, where, f", or move {folder} out of {root}")
        if isinstance(e["episode_id"], bool) or not isinstance(e["episode_id"], int):
            raise ValueError(
                f"{where} has an episode entry with episode_id={e['episode_id']!r} (global_index {g}); it must be "
                f"the episode's group number in that shard's {self.name}.h5 (traj_<episode_id>). Fix that entry, or "
                f"move {folder} out of {root}"
            )
        return g

    def write(self, report: Any,
              joined: dict[int, tuple[int, dict[str, Any]]]) -> dict[int, tuple[int, dict[str, Any]]]:
        """Write the joined pair (a `fastrecord.shards.MergeReport` says what); returns {g: (rank, entry)}."""
        report.trajectory = self.found
        if self.header is None:
            return {}
        sources: list[tuple[str, str, str]] = []  # (name in NAME.h5, shard file relative to DIR, group in it)
        episodes: list[dict[str, Any]] = []
        for g in sorted(self.chosen):
            rank, e = self.chosen[g]
            target = os.path.relpath(self.folders[rank] / f"{self.name}.h5", self.run_dir)
            sources.append((f"traj_{g}", target, f"traj_{int(e['episode_id'])}"))
            episodes.append({**e, "episode_id": g, "global_index": g, "source_rank": rank,
                             "shard_episode_id": int(e["episode_id"])})
        report.episodes = len(episodes)
        join_runs(self.run_dir / f"{self.name}.h5", sources, {**self.header, "episodes": episodes}, links=self.links)
        return dict(self.chosen)
