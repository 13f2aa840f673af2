"""`LeRobotSink`: the recorder's seam to `LeRobotWriter` (``lerobot=True``, or passed with ``sinks=``)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypedDict

from fastrecord.sinks.base import RunDirectory, Sink
from fastrecord.sinks.lerobot.layout import (
    DEFAULT_CHUNK_SIZE,
    DEFAULT_DATA_FILE_SIZE_IN_MB,
    DEFAULT_VIDEO_FILE_SIZE_IN_MB,
    dataset_paths,
    state_leaves,
)
from fastrecord.sinks.lerobot.writer import LeRobotWriter, import_pyarrow
from fastrecord.video.pool import EncodeGate
from fastrecord.workers import WorkerPool

MAX_PART_PROCESSES = 4  # an episode's part takes ~10 ms: 4 keep up with ~400 finished episodes a second


class _Limits(TypedDict):
    """`LeRobotSink.limits`: the dataset files' size limits, as `LeRobotWriter` takes them."""

    data_files_size_in_mb: float
    video_files_size_in_mb: float
    chunks_size: int

if TYPE_CHECKING:
    from fastrecord.episode import EpisodeData
    from fastrecord.video import VideoSettings


class LeRobotSink(Sink):
    """Owns: the run's LeRobot v3.0 dataset ``NAME.lerobot/`` (through `LeRobotWriter`) and the worker
    threads that turn kept episodes into its parts off the stepping thread: each camera's video encoded in
    fastrecord's encoder processes, the statistics and rows in the writer's part processes, the file groups
    in its group process (`fastrecord.sinks.lerobot.files`); the threads only wait on those processes, and
    the stepping thread only queues the episodes, in episode order, and waits when they fall behind.

    ``fps``: the dataset's frame rate (the env's control frequency: a row per step); ``task``: the task
    string of every episode (the env id); ``video``: the encoder settings of the camera videos (their
    ``fps`` is set to ``fps``; a ``gop`` of None becomes 2, LeRobot's: training reads random frames);
    ``state_keys``: the observation leaves of ``observation.state`` (None: every leaf but the cameras');
    ``state_layout``: the env's state leaves in its order, with their widths
    (`fastrecord.sinks.factory.state_layout`). The size limits and
    ``chunks_size`` are LeRobot's defaults."""

    wants_datasets = True

    def __init__(
        self,
        fps: float,
        task: str,
        video: VideoSettings,
        *,
        robot_type: str = "unknown",
        workers: int = 1,
        state_keys: Sequence[str] | None = None,
        state_layout: Sequence[tuple[str, int]] | None = None,
        data_files_size_in_mb: float = DEFAULT_DATA_FILE_SIZE_IN_MB,
        video_files_size_in_mb: float = DEFAULT_VIDEO_FILE_SIZE_IN_MB,
        chunks_size: int = DEFAULT_CHUNK_SIZE,
        gate: EncodeGate | None = None,
    ) -> None:
        import_pyarrow()  # before anything is written: the error names the install command
        from dataclasses import replace

        from fastrecord.video import check_video_settings

        if not (isinstance(fps, (int, float)) and fps > 0):
            raise ValueError(f"fps={fps!r} must be a positive number of rows (steps) per second")
        self.fps, self.task, self.robot_type = fps, task, robot_type
        self.video = check_video_settings(replace(video, fps=fps, gop=2 if video.gop is None else video.gop))
        self.state_keys = None if state_keys is None else tuple(state_keys)
        self.state_layout = None if state_layout is None else [(str(p), int(w)) for p, w in state_layout]
        self.workers = max(1, int(workers))
        self.limits = _Limits(data_files_size_in_mb=data_files_size_in_mb,
                              video_files_size_in_mb=video_files_size_in_mb, chunks_size=chunks_size)
        # encodes at once while the env steps, shared with the recorder's videos (`build_sinks`); none: no limit
        self.gate = gate
        self.writer: LeRobotWriter | None = None
        self._pool: WorkerPool | None = None
        self._closed = False
        self._rolled_to = 0  # the run's committed count when a roll was last asked for
        self._keys_checked = False

    def open(self, run: RunDirectory) -> None:
        super().open(run)
        root, parts = dataset_paths(run.output_dir, run.name)
        self.writer = writer = LeRobotWriter(
            root,
            parts,
            fps=self.fps,
            task=self.task,
            robot_type=self.robot_type,
            video=self.video,
            resume=run.resuming,
            state_keys=self.state_keys,
            state_layout=self.state_layout,
            limit=lambda: run.committed,
            part_processes=min(self.workers, MAX_PART_PROCESSES),
            encode_slot=self.gate.slot if self.gate is not None else None,
            **self.limits,
        )
        writer.start_processes()
        from fastrecord.video.encode import use_processes

        if use_processes(self.video):
            from fastrecord.video.pool import default_encoder_pool

            default_encoder_pool().start(self.workers)
        self._pool = WorkerPool(
            self._write, num_workers=self.workers, max_pending=2 * self.workers, name="fastrecord-lerobot"
        )

    def _opened(self) -> tuple[LeRobotWriter, WorkerPool]:
        """The writer and the worker pool `open` made (the recorder calls the methods below only after open)."""
        assert self.writer is not None and self._pool is not None, "LeRobotSink used before open()"
        return self.writer, self._pool

    @property
    def root(self) -> Path:
        return self._opened()[0].root

    def submit(self, episodes: Sequence[EpisodeData]) -> None:
        if episodes and not self._keys_checked:  # a wrong key is the caller's error, raised here, not in a writer
            state_leaves(episodes[0].datasets, self.state_keys, self.state_layout)
            self._keys_checked = True
        writer, pool = self._opened()
        for ep in episodes:  # waiting for room in the queue, the envs do not step: every encoder may encode
            pool.submit((writer.reserve(ep.episode_id), ep), while_blocked=self._lifted)

    def _lifted(self) -> contextlib.AbstractContextManager[Any]:
        """The gate's limit off (the caller waits for this sink), where there is a gate."""
        return self.gate.lifted() if self.gate is not None else contextlib.nullcontext()

    def committed(self, episode_id: int) -> bool:
        return self._opened()[0].committed(episode_id)

    def _write(self, job: tuple[int, EpisodeData]) -> None:
        writer = self._opened()[0]
        seq, ep = job
        entry: dict[str, Any] = {k: ep.meta[k] for k in ("global_index", "source_rank") if k in ep.meta}
        writer.write_episode(seq, ep.datasets, ep.elapsed_steps, entry)

    def raise_if_failed(self) -> None:
        writer, pool = self._opened()
        pool.raise_if_failed()
        writer.raise_if_failed()

    def after_commit(self, committed: int, wait: bool) -> None:
        """The run's commit log (results rows) moved past what the dataset's files hold: a part written
        before its episode was committed by every output waits for this (the writer's `limit`). ``wait``:
        in the dataset's files on return (`wait_until_done`), else the writer's timer rolls them in (`roll`:
        never on this thread, the stepping one, nor in the queue of the episodes' writes)."""
        if self._pool is None or self._closed:
            return
        if wait:
            self.wait_until_done()
        elif committed > self._rolled_to:
            self._rolled_to = committed
            self._opened()[0].roll()

    def wait_until_done(self) -> None:
        """Every submitted episode written, and in the dataset's files (LeRobot loads it from here on)."""
        writer, pool = self._opened()
        with self._lifted():
            pool.wait_until_done()
        writer.roll(final=True)
        writer.raise_if_failed()

    def close(self) -> None:
        """Drain the queue, then write the last dataset files (also after a failed episode: the others are
        kept); re-raises the first error."""
        if self._pool is None or self._closed:
            return
        self._closed = True
        writer, pool = self._opened()
        try:
            with self._lifted():
                pool.close()
        finally:
            writer.close()

    @property
    def files(self) -> list[Path]:
        return [self.writer.root] if self.writer is not None and self.writer.root.exists() else []
