"""Temporary home of `ManiSkillH5Sink` while maniskill_h5.py is rewritten (moves there)."""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fastrecord.episode import EpisodeData
from fastrecord.sinks.base import RunDirectory, Sink
from fastrecord.sinks.maniskill_h5 import TrajectoryWriter


class ManiSkillH5Sink(Sink):
    """ManiSkill's trajectory pair ``NAME.h5`` + ``NAME.json`` of the run, through `TrajectoryWriter`
    (crash-safe parts, writer processes). ``resume`` runs continue the episode ids on disk."""

    wants_datasets = True

    def __init__(self, header: dict[str, Any], writers: int = 1) -> None:
        self.header = header
        self.writers = writers
        self.writer: TrajectoryWriter | None = None

    def open(self, run: RunDirectory) -> None:
        super().open(run)
        kw = dict(resume=run.resuming, num_writers=self.writers) if "resume" in inspect.signature(TrajectoryWriter).parameters else {}
        self.writer = TrajectoryWriter(run.path(".h5"), self.header, **kw)

    @property
    def next_episode_id(self) -> int:
        return getattr(self.writer, "next_episode_id", 0)

    def submit(self, episodes: Sequence[EpisodeData]) -> None:
        self.writer.submit(list(episodes))

    def raise_if_failed(self) -> None:
        self.writer.raise_if_failed()

    def wait_until_done(self) -> None:
        self.writer.wait_until_done()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    @property
    def files(self) -> list[Path]:
        return [self.writer.h5_path, self.writer.json_path] if self.writer is not None else []
