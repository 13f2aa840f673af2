"""Experiment loggers as sinks: `TensorBoardSink` and `WandbSink` (as torchrl's loggers, rsl_rl's writers).

Per finished, kept episode, at step = its episode id, both log under ``TAG/`` (default ``eval/``):

- ``success`` (0/1) and ``success_rate`` (running, over the episodes this sink logged) when the env
  reports success. Only kept episodes are logged (they have an id): with ``keep="success"`` the rate is
  1; use ``keep="all"`` for the policy's rate;
- ``episode_length``;
- ``return`` (the sum of the rewards);
- ``video``: the episode's frames, for the 1st, (k+1)-th, (2k+1)-th ... episode this sink receives
  (``video_every=k``) until ``max_videos`` videos (None: no limit; 0: no videos, and nothing is rendered
  for the logger).

The scalars come from the recorder's `EpisodeEnded` events (``episodes_ended``), the frames from the kept episodes
(``submit``, just before). Writes run on one background thread (the stepping thread waits only when the queue is full;
an error reaches it as `fastrecord.WorkerError`). Files go into the run directory and are listed in its manifest:
TensorBoard ``output_dir/tensorboard/NAME/events.out.tfevents.*``, W&B ``output_dir/wandb/<its run folder>/``.

TensorBoard videos are animated GIFs in an image summary, the record ``SummaryWriter.add_video`` writes;
the GIF is encoded here with Pillow (a tensorboard dependency), because ``add_video`` needs moviepy < 2
and prints and drops the video without it. W&B videos are MP4s encoded with PyAV (``wandb.Video`` of an
array needs moviepy too).
"""

from __future__ import annotations

import importlib
import io
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord.episode import EpisodeData, EpisodeEnded
from fastrecord.sinks.base import BackgroundSink, RunDirectory, Sink

LOGGERS = ("tensorboard", "wandb")


class MissingLoggerError(ImportError, ValueError):
    """A logger's library is not installed (a ValueError too, so the CLI prints it as one line)."""


class LoggerLoginError(RuntimeError):
    """A logger's service has no credentials on this machine (the CLI prints it as one line, exit 1)."""


WANDB_NO_LOGIN_MODES = ("offline", "disabled", "dryrun")  # W&B modes that need no login


def check_wandb_login() -> None:
    """Raise `LoggerLoginError` when ``wandb.init`` would need a login and this machine has none: no
    ``WANDB_API_KEY``, no netrc entry for the W&B host, and W&B not set to an offline mode (``WANDB_MODE``
    or ``wandb offline``'s settings file). Reads files only; never prompts nor reaches the network."""
    import configparser
    import netrc
    import os
    from urllib.parse import urlparse

    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE", "").lower() in WANDB_NO_LOGIN_MODES:
        return
    settings = configparser.ConfigParser()
    config_dir = os.environ.get("WANDB_CONFIG_DIR") or os.path.join(os.path.expanduser("~"), ".config", "wandb")
    try:
        settings.read(os.path.join(config_dir, "settings"))
    except configparser.Error:
        pass
    if settings.get("default", "mode", fallback="").lower() in WANDB_NO_LOGIN_MODES:
        return
    # (typeshed's ConfigParser.get may return None; with a str fallback it returns a str)
    base = os.environ.get("WANDB_BASE_URL") or str(settings.get("default", "base_url", fallback="https://api.wandb.ai"))
    host = urlparse(base).hostname or base
    home = os.path.expanduser("~")
    for path in (os.environ.get("NETRC"), os.path.join(home, ".netrc"), os.path.join(home, "_netrc")):
        if path and os.path.isfile(path):
            try:
                if netrc.netrc(path).authenticators(host):
                    return
            except (OSError, netrc.NetrcParseError):
                pass
    raise LoggerLoginError(
        f"--log wandb needs a W&B login and this machine has none for {host} (no WANDB_API_KEY, no netrc entry); "
        f"run `wandb login` first, or log offline with WANDB_MODE=offline (then `wandb sync` the run later)"
    )


def _require(module: str, who: str) -> None:
    try:
        importlib.import_module(module)
    except ImportError as e:
        raise MissingLoggerError(
            f"{who} needs the {module} package, which is not installed: pip install 'fastrecord[loggers]' "
            f"(or pip install {module})"
        ) from e


def make_logger(name: str, **kwargs: Any) -> Sink:
    """The logger sink called ``name`` ("tensorboard" or "wandb"), built with ``kwargs``."""
    if name == "tensorboard":
        return TensorBoardSink(**kwargs)
    if name == "wandb":
        return WandbSink(**kwargs)
    raise ValueError(
        f"log={name!r} is not a logger; use one of {', '.join(map(repr, LOGGERS))}, or None to log nothing"
    )


class _EpisodeLogger(BackgroundSink):
    """Owns: the writer thread (`BackgroundSink`), the running counts (episodes, successes, videos), the choice of the
    episodes whose video is logged and their frames until their episode's event arrives. A backend
    implements ``_start(run)`` (on the caller's thread, in ``open``), ``_log(step, scalars, video)`` (on
    the writer thread) and ``_finish(failed)``."""

    def __init__(self, tag: str, max_videos: int | None, video_every: int, fps: float | None, log_return: bool) -> None:
        if not isinstance(tag, str) or not tag.strip("/"):
            raise ValueError(f"tag={tag!r} must be a non-empty string, e.g. tag='eval'")
        if max_videos is not None and (
            isinstance(max_videos, bool) or not isinstance(max_videos, int) or max_videos < 0
        ):
            raise ValueError(
                f"max_videos={max_videos!r} must be an int >= 0 (0: no videos) or None (every chosen episode)"
            )
        if isinstance(video_every, bool) or not isinstance(video_every, int) or video_every < 1:
            raise ValueError(f"video_every={video_every!r} must be an int >= 1 (1: every episode, k: every k-th)")
        if fps is not None and not (0 < fps < float("inf")):
            raise ValueError(
                f"fps={fps!r} must be a positive number of frames per second, or None (the recorder's video_fps)"
            )
        self.tag = tag.strip("/")
        self.max_videos = max_videos
        self.video_every = video_every
        self.fps = fps
        self.log_return = log_return  # accepted for compatibility: the return is always logged
        self.wants_frames = max_videos != 0
        self.wants_datasets = False  # everything logged but the video comes with the EpisodeEnded events
        self.accepts_yuv420p = False  # frames arrive as [T+1, H, W, 3] RGB
        self.episodes = 0  # episodes received (kept ones)
        self.successes = 0  # of those with a success flag, the successful ones
        self.judged = 0  # episodes with a success flag
        self.videos = 0  # videos chosen for logging
        self._frames: dict[int, np.ndarray] = {}  # episode id -> frames, from submit to episodes_ended
        self._files: list[Path] = []
        self._finished = False

    def _fps(self) -> float:
        """The logged videos' frame rate: ``fps``, or (once open) the recorder's ``video_fps``."""
        assert self.fps is not None, "the logger's fps is set in open()"
        return self.fps

    def open(self, run: RunDirectory) -> None:
        if self.fps is None:
            self.fps = float(run.options.get("video_fps") or 30)
        # one writer thread (BackgroundSink's default): episodes are logged in order (the running rate, W&B's
        # step order)
        super().open(run)
        try:
            self._start(run)
        except BaseException:
            super().close()
            raise

    # -------------------------------------------------------------- stepping thread
    def submit(self, episodes: Sequence[EpisodeData]) -> None:
        if self.wants_frames:
            self._frames.update((ep.episode_id, ep.frames) for ep in episodes if ep.frames is not None)

    def episodes_ended(self, ended: Sequence[EpisodeEnded]) -> None:
        for ev in ended:
            if ev.episode_id is None:  # not kept
                continue
            frames = self._frames.pop(ev.episode_id, None)
            chosen = self.episodes % self.video_every == 0 and (
                self.max_videos is None or self.videos < self.max_videos
            )
            video = np.ascontiguousarray(frames) if chosen and frames is not None else None
            self.videos += video is not None
            self.episodes += 1
            scalars: dict[str, float] = {"episode_length": float(ev.length)}
            if ev.success is not None:
                self.judged += 1
                self.successes += ev.success
                scalars["success"] = float(ev.success)
                scalars["success_rate"] = self.successes / self.judged
            scalars["return"] = float(ev.episode_return)
            self.queue((ev.episode_id, {f"{self.tag}/{k}": v for k, v in scalars.items()}, video))
        self._frames.clear()

    # -------------------------------------------------------------- writer thread
    def write(self, job: tuple[int, dict[str, float], np.ndarray | None]) -> None:
        self._log(*job)

    def close(self) -> None:
        """Drain the queue, then close the logger (also after a failure). Idempotent; re-raises."""
        failed = False
        try:
            super().close()
        except BaseException:
            failed = True
            raise
        finally:
            if not self._finished:
                self._finished = True
                self._finish(failed)

    @property
    def files(self) -> list[Path]:
        return list(self._files)

    # backends
    def _start(self, run: RunDirectory) -> None:
        raise NotImplementedError

    def _log(self, step: int, scalars: dict[str, float], video: np.ndarray | None) -> None:
        raise NotImplementedError

    def _finish(self, failed: bool) -> None:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------- TensorBoard
class TensorBoardSink(_EpisodeLogger):
    """Logs kept episodes to TensorBoard with ``torch.utils.tensorboard.SummaryWriter``.

    Owns: one `SummaryWriter` (its event file) and the GIF encoding of the logged videos.

    Args:
        log_dir: the writer's folder; None: ``output_dir/tensorboard/NAME`` (NAME: the run's
            trajectory_name), so ``tensorboard --logdir output_dir/tensorboard`` shows each run apart.
        tag: prefix of every logged name (``eval/success``, ``eval/video``, ...).
        max_videos: videos logged at most (None: no limit; 0: none). Videos are large.
        video_every: log the video of every k-th episode this sink receives (1: each, up to max_videos).
        fps: frames per second of the videos; None: the recorder's ``video_fps``.
        log_return: accepted for compatibility; the return is always logged.
        flush_secs: how often the writer flushes its event file.

    ``RecordEpisode(env, "out", sinks=[TensorBoardSink()])``; then ``tensorboard --logdir out/tensorboard``.
    """

    def __init__(
        self,
        log_dir: str | Path | None = None,
        tag: str = "eval",
        *,
        max_videos: int | None = 8,
        video_every: int = 1,
        fps: float | None = None,
        log_return: bool = False,
        flush_secs: float = 10,
    ) -> None:
        _require("tensorboard", "TensorBoardSink")
        super().__init__(tag, max_videos, video_every, fps, log_return)
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.flush_secs = flush_secs
        self.writer: Any = None

    def _start(self, run: RunDirectory) -> None:
        from torch.utils.tensorboard import SummaryWriter

        log_dir = self.log_dir if self.log_dir is not None else run.output_dir / "tensorboard" / run.name
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        before = set(log_dir.glob("events.out.tfevents.*"))
        self.writer = SummaryWriter(log_dir=str(log_dir), flush_secs=self.flush_secs)
        self._files = sorted(set(log_dir.glob("events.out.tfevents.*")) - before)
        for f in self._files:  # the manifest lists this run's event file, not the folder others may share
            run.add_file(f)

    def _log(self, step: int, scalars: dict[str, float], video: np.ndarray | None) -> None:
        for name, value in scalars.items():
            self.writer.add_scalar(name, value, global_step=step)
        if video is not None:
            summary = gif_summary(f"{self.tag}/video", video, self._fps())
            self.writer.file_writer.add_summary(summary, global_step=step)

    def _finish(self, failed: bool) -> None:
        if self.writer is not None:
            self.writer.close()


def encode_gif(frames: np.ndarray, fps: float) -> bytes:
    """``[T, H, W, 3]`` uint8 RGB frames as an animated, looping GIF (Pillow; a palette per frame)."""
    from PIL import Image

    images = [Image.fromarray(f) for f in frames]
    out = io.BytesIO()
    images[0].save(out, format="GIF", save_all=True, append_images=images[1:], duration=max(20, round(1000 / fps)),
                   loop=0, optimize=False, disposal=1)
    return out.getvalue()


def gif_summary(tag: str, frames: np.ndarray, fps: float) -> Any:
    """The TensorBoard summary ``add_video`` writes: an image summary holding an animated GIF."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    _, h, w, c = frames.shape
    image = Summary.Image(height=h, width=w, colorspace=c, encoded_image_string=encode_gif(frames, fps))
    return Summary(value=[Summary.Value(tag=tag, image=image)])


# ---------------------------------------------------------------------------------------------- W&B
class WandbSink(_EpisodeLogger):
    """Logs kept episodes to Weights & Biases.

    Owns: the W&B run it starts (or none: it logs into ``run`` when given one, and leaves it open), and
    the temporary MP4s it encodes for ``wandb.Video``.

    Args:
        project: the W&B project (None: W&B's default).
        run: an active ``wandb`` run to log into (e.g. the training run); None starts one, named after the
            recording, which ``close()`` finishes.
        tag: prefix of every logged name; ``TAG/episode`` (the episode id) is the x-axis of ``TAG/*``.
        max_videos, video_every, fps, log_return: as `TensorBoardSink`.
        log_dir: where the started run's ``wandb/`` folder goes (``wandb.init(dir=...)``); None: output_dir.
        mode: ``wandb.init``'s mode ("online", "offline", "disabled"); None: W&B's default (``WANDB_MODE``).
        name: the started run's name; None: the recording's trajectory_name.
        config: the started run's config.
        init_kwargs: more ``wandb.init`` arguments.
    """

    def __init__(
        self,
        project: str | None = None,
        run: Any = None,
        tag: str = "eval",
        *,
        max_videos: int | None = 8,
        video_every: int = 1,
        fps: float | None = None,
        log_return: bool = False,
        log_dir: str | Path | None = None,
        mode: str | None = None,
        name: str | None = None,
        config: dict[str, Any] | None = None,
        init_kwargs: dict[str, Any] | None = None,
    ) -> None:
        _require("wandb", "WandbSink")
        super().__init__(tag, max_videos, video_every, fps, log_return)
        self.project = project
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.mode = mode
        self.name = name
        self.config = config
        self.init_kwargs = dict(init_kwargs or {})
        self.wandb_run: Any = run
        self._owns_run = run is None
        self._tmp: Path | None = None

    def _start(self, run: RunDirectory) -> None:
        import wandb

        if self._owns_run:
            root = self.log_dir if self.log_dir is not None else run.output_dir
            root.mkdir(parents=True, exist_ok=True)
            kwargs = dict(project=self.project, dir=str(root), mode=self.mode, name=self.name or run.name,
                          config=self.config, reinit="create_new", settings=wandb.Settings(console="off"))
            self.wandb_run = wandb.init(**{**kwargs, **self.init_kwargs})
            folder = Path(self.wandb_run.dir).parent  # wandb/<offline-|>run-DATE-ID; .dir is its files/
            self._files = [folder]
            run.add_file(folder)
        self.wandb_run.define_metric(f"{self.tag}/episode")
        self.wandb_run.define_metric(f"{self.tag}/*", step_metric=f"{self.tag}/episode")
        self._tmp = Path(tempfile.mkdtemp(prefix="fastrecord-wandb-"))

    def _log(self, step: int, scalars: dict[str, float], video: np.ndarray | None) -> None:
        import wandb

        from fastrecord.video import VideoSettings, encode_mp4

        data: dict[str, Any] = {f"{self.tag}/episode": step, **scalars}
        path = None
        try:
            if video is not None:
                assert self._tmp is not None  # made by _start
                settings = VideoSettings(fps=self._fps(), executor="thread")
                path = encode_mp4(self._tmp / f"{step}.mp4", video, settings)
                data[f"{self.tag}/video"] = wandb.Video(str(path), format="mp4")
            self.wandb_run.log(data)  # copies the video into the run's media folder
        finally:
            if path is not None:
                path.unlink(missing_ok=True)

    def _finish(self, failed: bool) -> None:
        try:
            if self._owns_run and self.wandb_run is not None:
                self.wandb_run.finish(exit_code=1 if failed else 0)
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


def log_sinks(log: str | None) -> list[Sink]:
    """``--log`` of the commands: [] for None, else the one logger sink of that name (default options)."""
    return [] if log is None else [make_logger(log)]
