"""`Mp4Sink`: MP4 videos of finished episodes, encoded in the background.

Layouts: ``per_env`` (default), one video per env episode, ``{episode_id}_env{env}_{success|failure}.mp4`` (no suffix
when the env reports no success); ``tiled`` (ManiSkill's), the episodes of a batch ending together tiled into one
``{video_id}.mp4``. ``max_steps_per_video=M`` splits a video as ManiSkill does: pieces of M steps (M + 1 frames, with
``render_substeps`` M * (sim_steps_per_control + 1) + 1: each piece starts with the last frame of the one before), a
last piece of a single frame dropped; per-env pieces are named ``..._part{k}.mp4``. The trajectory is never split.

A finished video appears atomically and never replaces an existing file (a taken name gets ``_1``,
``_2``, ...). Each file is in the run's journal before it is encoded and once it lands
(`RunDirectory.intend_file`, `RunDirectory.add_file`), with the episodes it holds; an episode is committed here
once all its videos are. The naming rule is `fastrecord.sinks.video_names`.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord.episode import EpisodeData
from fastrecord.options import default_video_workers, usable_cores
from fastrecord.sinks.base import BackgroundSink, RunDirectory
from fastrecord.sinks.video_names import tiled_video_name, video_name
from fastrecord.video import VideoSettings, encode_mp4
from fastrecord.video.overlay import Overlay, draw_overlay, maniskill_font
from fastrecord.video.pool import EncodeGate
from fastrecord.video.yuv import Yuv420Frames


class Mp4Sink(BackgroundSink):
    """Owns: the encode queue and its worker threads (`BackgroundSink`: each drives one encoder process at a
    time; at most ``stepping_workers`` of them encode at once, except while the caller waits for the videos: for
    room in the queue, `wait_until_done`, `close`), the video names (which episode went into which video), and
    the list of videos written."""

    wants_frames = True
    wants_datasets = False
    thread_name = "fastrecord-mp4"

    def __init__(
        self,
        settings: VideoSettings,
        *,
        layout: str = "per_env",
        num_envs: int = 1,
        max_steps_per_video: int | None = None,
        info_on_video: bool = False,
        workers: int | None = None,
        stepping_workers: int | None = None,
        gate: EncodeGate | None = None,
    ) -> None:
        self.settings = settings
        self.layout = layout
        self.num_envs = num_envs
        self.max_steps_per_video = max_steps_per_video
        self.info_on_video = info_on_video
        self.workers = workers or default_video_workers(usable_cores())
        # encodes at once while the env steps (`fastrecord.options.stepping_video_workers`): all of them by default;
        # ``gate``: a limit shared with the recorder's other encoders (a LeRobot dataset's videos: `build_sinks`)
        self._gate = gate if gate is not None else EncodeGate(min(self.workers, stepping_workers or self.workers))
        # frames converted on the GPU (half the bytes to copy, no conversion in the encoder; the info text is drawn
        # on yuv420p as well)
        self.accepts_yuv420p = layout == "per_env"
        self._font = maniskill_font() if info_on_video else None
        self._paths: list[Path] = []
        self._written: dict[str, Path] = {}  # a video's intended name -> the file written (first pieces only)
        self._names: dict[int, str] = {}  # episode id -> the intended name of its (first) video, until taken
        self._outstanding: dict[int, int] = {}  # episode id -> its videos (pieces) not yet on disk
        self._lock = threading.Lock()

    def open(self, run: RunDirectory) -> None:
        if self.settings.executor != "thread":
            from fastrecord.video.encode import use_processes

            if use_processes(self.settings):
                # the encoder pool exists (and its exit hook is registered) before the recorder's own exit
                # hook, so that hook, which runs first, can still drain videos through it
                from fastrecord.video.pool import default_encoder_pool

                # started now (forked from a server that imports PyAV once), not when the first episodes wait
                default_encoder_pool().start(min(self.workers, self.num_envs))
        self._video_id = run.counters.get("next_video_id", 0)
        self.max_pending = max(2 * self.workers, self.num_envs + self.workers)
        super().open(run)

    # -------------------------------------------------------------- stepping thread
    def submit(self, episodes: Sequence[EpisodeData]) -> None:
        ready = [ep for ep in episodes if ep.frames is not None]
        if not ready:
            return
        if self.layout == "per_env":
            for ep in ready:
                frames = ep.frames
                assert frames is not None  # ready
                success = bool(ep.meta["success"]) if "success" in ep.meta else None
                pieces = self._pieces(len(frames), ep.frames_per_step)
                with self._lock:
                    self._outstanding[ep.episode_id] = len(pieces)
                for k, (lo, hi) in enumerate(pieces):
                    name = video_name(ep.episode_id, ep.env_idx, success, k if len(pieces) > 1 else None)
                    if k == 0:
                        self._names[ep.episode_id] = name
                    overlay = ep.overlay[lo:hi] if ep.overlay else None
                    path = self.run.output_dir / name
                    self.run.intend_file(path, [ep.episode_id])
                    self.queue((path, frames[lo:hi], overlay, k == 0, (ep.episode_id,)))
            return
        from mani_skill.utils.visualization.misc import tile_images

        clips = [ep.frames for ep in ready if ep.frames is not None]  # ready's frames, in order
        length = max(len(f) for f in clips)
        padded = [np.concatenate([f, np.repeat(f[-1:], length - len(f), 0)]) for f in clips]
        if any(ep.overlay for ep in ready):
            padded = [draw_overlay(f, ep.overlay, font=self._font) if ep.overlay else f
                      for f, ep in zip(padded, ready, strict=True)]
        tiled = tile_images(padded, nrows=int(np.sqrt(self.num_envs)))
        ids = tuple(ep.episode_id for ep in ready)
        pieces = self._pieces(length, ready[0].frames_per_step)
        with self._lock:
            self._outstanding.update((e, len(pieces)) for e in ids)
        for k, (lo, hi) in enumerate(pieces):
            path = self.run.output_dir / tiled_video_name(self._video_id)
            if k == 0:
                self._names.update((ep.episode_id, path.name) for ep in ready)
            self._video_id += 1
            self.run.set_counter("next_video_id", self._video_id)
            self.run.intend_file(path, ids)
            self.queue((path, np.ascontiguousarray(tiled[lo:hi]), None, True, ids))

    def _pieces(self, frames: int, per_step: int = 1) -> list[tuple[int, int]]:
        """Frame ranges of the videos of an episode with ``frames`` frames, ``per_step`` of them a step
        (render_substeps), as ManiSkill splits: ``max_steps_per_video`` counts steps, so a piece has
        ``max_steps_per_video * per_step + 1`` frames."""
        if self.max_steps_per_video is None:
            return [(0, frames)]
        m = self.max_steps_per_video * per_step
        if frames <= m + 1:
            return [(0, frames)]
        out = [(lo, min(lo + m + 1, frames)) for lo in range(0, frames - 1, m)]
        return [(lo, hi) for lo, hi in out if hi - lo > 1]

    # -------------------------------------------------------------- encoder threads
    def write(self, job: tuple[Path, np.ndarray, list | None, bool, tuple[int, ...]]) -> None:
        path, frames, overlay, first, ids = job
        if overlay is not None and not isinstance(overlay, Overlay):  # per-frame dicts from a sink's caller
            if isinstance(frames, Yuv420Frames):
                frames = Yuv420Frames(draw_overlay(frames.plain(), overlay, font=self._font, fmt="yuv420p"))
            else:
                frames = draw_overlay(frames, overlay, font=self._font)
            overlay = None
        # an Overlay is drawn where the video is encoded (an encoder process): not in this process
        with self._gate.slot():
            written = Path(encode_mp4(path, frames, self.settings, overlay=overlay or None) or path)
        self.run.add_file(written, ids, intended=path)  # in the journal before the episode counts as committed
        with self._lock:
            self._paths.append(written)
            if first:
                self._written[path.name] = written
            for e in ids:
                left = self._outstanding.get(e, 1) - 1
                if left > 0:
                    self._outstanding[e] = left
                else:
                    self._outstanding.pop(e, None)

    @property
    def stepping_workers(self) -> int:
        """How many videos encode at once while the env steps."""
        return self._gate.limit

    @property
    def most_at_once(self) -> int:
        """The most videos seen encoding at once."""
        return self._gate.most

    def while_blocked(self) -> contextlib.AbstractContextManager[Any]:
        return self._gate.lifted()  # the stepping thread waits for the writers: the envs do not step meanwhile

    def wait_until_done(self) -> None:
        with self._gate.lifted():  # the caller waits: every writer encodes
            super().wait_until_done()

    def close(self) -> None:
        with self._gate.lifted():
            super().close()

    def committed(self, episode_id: int) -> bool:
        """Every video (piece) of episode ``episode_id`` is on disk and in the run's journal."""
        with self._lock:
            return episode_id not in self._outstanding

    def take_video_name(self, episode_id: int) -> str | None:
        """The intended name of the video (its first piece when split; the tiled video it is in) that
        ``submit`` queued for episode ``episode_id``, once (None: it had no frames)."""
        return self._names.pop(episode_id, None)

    def written(self, name: str) -> Path | None:
        """The file written for the video meant to be ``name`` (a first piece), which may carry ``_1`` if
        the name was taken; None while it is not on disk."""
        with self._lock:
            return self._written.get(name)

    @property
    def files(self) -> list[Path]:
        with self._lock:
            return list(self._paths)
