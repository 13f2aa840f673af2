"""`ManiSkillH5Sink`: the recorder's seam to the ManiSkill trajectory writer."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastrecord.sinks.base import RunDirectory, Sink
from fastrecord.sinks.maniskill_h5.layout import DEFAULT_COMPRESSION, parse_compression
from fastrecord.sinks.maniskill_h5.writer import TrajectoryWriter

if TYPE_CHECKING:
    from fastrecord.episode import EpisodeData


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

    def add_writers(self, total: int) -> None:
        """Grow to ``total`` writer processes (`TrajectoryWriter.add_writers`)."""
        self.writers = max(self.writers, total)
        if self.writer is not None:
            self.writer.add_writers(total)

    def _opened(self) -> TrajectoryWriter:
        """The writer `open` made (the recorder calls the methods below only between open and close)."""
        assert self.writer is not None, "ManiSkillH5Sink used before open()"
        return self.writer

    @property
    def next_episode_id(self) -> int:
        return self._opened().next_episode_id

    def submit(self, episodes: Sequence[EpisodeData]) -> None:
        self._opened().submit(list(episodes))

    def committed(self, episode_id: int) -> bool:
        """Its part is complete and in the committed prefix (the next index lists it; a crash keeps it)."""
        return episode_id < self._opened().num_episodes

    def raise_if_failed(self) -> None:
        # every step and reset: polling the writer processes' exit status (3 waitpid calls, 0.5 ms a step
        # in the imageobs profile) at most every 0.1 s; submit, wait_until_done and close always poll
        self._opened().raise_if_failed(max_age=0.1)

    def wait_until_done(self) -> None:
        self._opened().wait_until_done()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    @property
    def files(self) -> list[Path]:
        return [self.writer.h5_path, self.writer.json_path] if self.writer is not None else []
