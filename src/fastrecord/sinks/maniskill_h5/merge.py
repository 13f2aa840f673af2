"""Joining episodes of several trajectory files into one ``NAME.h5`` + ``NAME.json``: the HDF5 side of
`fastrecord.shards.merge` (which decides, from the shards, which episode goes where).

By default the joined ``NAME.h5`` holds a copy of every episode (self-contained: it can be copied
alone, as ManiSkill's ``merge_trajectory`` writes); ``links=True`` writes an index of external links into
the source files instead (no copy, but it only opens next to them). Both files are swapped in
atomically, ``NAME.h5`` first, by a writer process.
"""

from __future__ import annotations

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
