"""ManiSkill trajectory files (``NAME.h5`` + ``NAME.json``): the one owner of their layout.

Layout (ManiSkill's; documented in docs/format.md "On-disk schema"): one group ``traj_{episode_id}`` per episode
with ``actions [T, A]``, ``terminated/truncated/success/fail [T]``, ``rewards [T]``, ``env_states``
(nested groups, ``[T+1, D]`` leaves) and ``obs`` (``[T+1, ...]``, nested for dict observations); the JSON
holds ``env_info``, ``commit_info``, ``episodes`` and ``source_type``/``source_desc``.

Modules:

- `layout`: part names, attributes, sibling paths, compression choices, image leaves and chunks, JSON helpers.
- `writer`: `TrajectoryWriter`, crash-safe (part files + an index of links while recording).
- `process`: what the writer processes run (every h5py write); `layout.WRITER_PROCESS_MODULE`.
- `reader`: `open_trajectory`, `TrajectoryFile`, `read_tree`, `check_links`, `check_episode` (`EpisodeProblem`).
- `recover`: `recover` and `consolidate` after a crash; `run_in_child`, `one_writer_process`.
- `merge`: `join_runs`, several files' episodes into one pair (`fastrecord.shards.merge` uses it).
- `sink`: `ManiSkillH5Sink`, the recorder's sink.
"""

from __future__ import annotations

from fastrecord.sinks.maniskill_h5.layout import (
    COMPRESSIONS,
    DEFAULT_COMPRESSION,
    EPISODES_ATTR,
    GROWING_NAME,
    HEADER_ATTR,
    PART_PATTERN,
    PARTS_SUFFIX,
    WRITER_PROCESS_MODULE,
    atomic_write_json,
    complete_parts,
    has_image_leaves,
    image_chunks,
    parse_compression,
    part_name,
    read_json,
    sibling_paths,
)
from fastrecord.sinks.maniskill_h5.merge import join_runs
from fastrecord.sinks.maniskill_h5.reader import (
    EpisodeProblem,
    TrajectoryFile,
    check_episode,
    check_links,
    missing_link_targets,
    open_trajectory,
    read_tree,
)
from fastrecord.sinks.maniskill_h5.recover import consolidate, one_writer_process, recover, run_in_child
from fastrecord.sinks.maniskill_h5.sink import ManiSkillH5Sink
from fastrecord.sinks.maniskill_h5.writer import TrajectoryWriter

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_COMPRESSION",
    "EPISODES_ATTR",
    "GROWING_NAME",
    "HEADER_ATTR",
    "PARTS_SUFFIX",
    "PART_PATTERN",
    "WRITER_PROCESS_MODULE",
    "EpisodeProblem",
    "ManiSkillH5Sink",
    "TrajectoryFile",
    "TrajectoryWriter",
    "atomic_write_json",
    "check_episode",
    "check_links",
    "complete_parts",
    "consolidate",
    "has_image_leaves",
    "image_chunks",
    "join_runs",
    "missing_link_targets",
    "one_writer_process",
    "open_trajectory",
    "parse_compression",
    "part_name",
    "read_json",
    "read_tree",
    "recover",
    "run_in_child",
    "sibling_paths",
]
