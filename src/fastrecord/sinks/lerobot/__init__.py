"""LeRobot v3.0 datasets written while recording: ``NAME.lerobot/`` (``lerobot=True``).

Modules:

- `layout`: the dataset's paths, the mapping of ManiSkill's trajectory onto LeRobot's columns and
  features, statistics, ``meta/info.json`` (numpy only).
- `video`: `concat_mp4`, episode videos joined into one file without re-encoding (PyAV).
- `writer`: `LeRobotWriter` (crash-safe parts, files rolled past a size limit, recovery).
- `check`: `scan_dataset` (what a dataset holds; deleted, truncated or extra files) and `repair`.
- `sink`: `LeRobotSink`, the recorder's sink.
- `join`: `join_datasets`, episodes of several datasets (a sharded run's shards) into one, in a given
  order (`fastrecord.shards.merge` runs it).

Needs pyarrow and pandas: ``pip install 'fastrecord[lerobot]'``.
"""

from __future__ import annotations

from fastrecord.sinks.lerobot.check import repair
from fastrecord.sinks.lerobot.layout import DATASET_SUFFIX, PARTS_SUFFIX, dataset_paths, episode_columns
from fastrecord.sinks.lerobot.sink import LeRobotSink
from fastrecord.sinks.lerobot.writer import LeRobotWriter

__all__ = [
    "DATASET_SUFFIX",
    "PARTS_SUFFIX",
    "LeRobotSink",
    "LeRobotWriter",
    "dataset_paths",
    "episode_columns",
    "repair",
]
