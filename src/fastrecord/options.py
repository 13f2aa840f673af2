"""The recorder's options, declared once: `RecordOptions`.

The wrappers (`RecordEpisode`, `RecordVectorEpisode`) take exactly these arguments after ``env`` and
``output_dir`` (ManiSkill's positional order first, fastrecord's additions keyword-only), their
signature and docstring are derived from this class, and the CLI fills the same fields. Every value is
checked when the options are built, before anything touches the disk; a bad value raises a
`ValueError` naming the value, the allowed values and the fix.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastrecord.episode import KEEP_CHOICES, KeepFilter

IF_EXISTS = ("error", "overwrite", "resume")
VIDEO_LAYOUTS = ("per_env", "tiled")


def _opt(default: Any, help: str, *, kw_only: bool = False) -> Any:
    return field(default=default, kw_only=kw_only, metadata={"help": help})


@dataclass(frozen=True)
class RecordOptions:
    # ManiSkill's arguments, same meaning, defaults and positional order as
    # mani_skill.utils.wrappers.RecordEpisode (after env, output_dir)
    save_trajectory: bool = _opt(True, "write NAME.h5 + NAME.json in ManiSkill's trajectory format")
    trajectory_name: str | None = _opt(None, "NAME of the trajectory pair and run manifest (None: a timestamp, made unique)")
    save_video: bool = _opt(True, "write MP4 videos")
    info_on_video: bool = _opt(False, "draw reward and info scalars on each frame")
    save_on_reset: bool = _opt(True, "save the episode in progress at reset and close (False: only flush_* saves)")
    save_video_trigger: Callable[[int], bool] | None = _opt(None, "fn(elapsed_record_steps) -> capture frames of this step?")
    max_steps_per_video: int | None = _opt(None, "split each video into pieces of at most this many steps (the trajectory is not split)")
    clean_on_close: bool = _opt(True, "accepted for compatibility (episode ids are always consecutive)")
    record_reward: bool = _opt(True, "write rewards")
    record_env_state: bool = _opt(True, "write env states (needed to replay from states)")
    video_fps: float = _opt(30, "frames per second of the videos (a positive number; 7.5 and 29.97 work)")
    render_substeps: bool = _opt(False, "not supported: frames are captured once per env step")
    avoid_overwriting_video: bool = _opt(False, "accepted for compatibility: fastrecord never overwrites a video (a taken name gets _1, _2, ...)")
    source_type: str | None = _opt(None, "JSON source_type (e.g. 'motionplanning')")
    source_desc: str | None = _opt(None, "JSON source_desc")
    # fastrecord's additions (keyword-only)
    keep: KeepFilter = _opt("all", f"which finished episodes are written: one of {KEEP_CHOICES} or a callable(final_info) -> bool", kw_only=True)
    if_exists: Literal["error", "overwrite", "resume"] = _opt(
        "error", "when output_dir already holds a run of this trajectory_name: 'error' (refuse), 'overwrite' "
        "(delete that run's files first), 'resume' (keep them and add episodes after them)", kw_only=True)
    video_layout: Literal["per_env", "tiled"] = _opt("per_env", "one MP4 per env episode, or 'tiled' (ManiSkill's layout)", kw_only=True)
    video_source: str = _opt("render", "'render' (the human render camera) or 'sensor:<camera>' (an RGB camera of the observation)", kw_only=True)
    video_codec: str = _opt("auto", "'auto' (h264_nvenc where it encodes, else libx264) or a PyAV video encoder", kw_only=True)
    video_crf: int = _opt(23, "constant rate factor (lower is better quality; libx264: 0-51)", kw_only=True)
    video_preset: str = _opt("ultrafast", "libx264 preset (ultrafast keeps up with GPU envs)", kw_only=True)
    video_workers: int | None = _opt(None, "background encoders (None: one per core, at most 16)", kw_only=True)
    trajectory_writers: int = _opt(1, "HDF5 writer processes (each compresses whole batches of episodes)", kw_only=True)
    trajectory_compression: str = _opt(
        "gzip:1", "compression of image observations in NAME.h5: 'gzip:1' ... 'gzip:9' (ManiSkill writes 'gzip:5'), "
        "'lzf' or 'none' (README: Image observations on disk)", kw_only=True)
    buffer_capacity: int | None = _opt(None, "steps per env held on the device (None: max_episode_steps + 1; longer episodes grow it)", kw_only=True)

    def __post_init__(self) -> None:
        for name in ("save_trajectory", "save_video", "info_on_video", "save_on_reset", "clean_on_close",
                     "record_reward", "record_env_state", "render_substeps", "avoid_overwriting_video"):
            v = getattr(self, name)
            if not isinstance(v, (bool, _np_bool())):
                raise ValueError(f"{name}={v!r} must be True or False")
        if self.render_substeps:
            raise ValueError(
                "render_substeps=True is not supported by fastrecord yet (frames are captured once per env step); "
                "use mani_skill.utils.wrappers.RecordEpisode for substep videos, or raise video_fps"
            )
        name = self.trajectory_name
        if name is not None and (not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0")):
            raise ValueError(f"trajectory_name={name!r} must be a plain file name without folders (e.g. 'trajectory'), or None for a timestamp")
        if self.save_video_trigger is not None and not callable(self.save_video_trigger):
            raise ValueError(f"save_video_trigger={self.save_video_trigger!r} must be a callable(elapsed_steps) -> bool, or None")
        _positive_int_or_none("max_steps_per_video", self.max_steps_per_video, 1, "e.g. 50, or None to keep each episode in one video")
        fps = self.video_fps
        if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(float(fps)) or fps <= 0:
            raise ValueError(f"video_fps={fps!r} must be a positive number of frames per second (e.g. 30, or 7.5)")
        for name in ("source_type", "source_desc"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{name}={v!r} must be a string or None")
        if not (callable(self.keep) or (isinstance(self.keep, str) and self.keep in KEEP_CHOICES)):
            raise ValueError(f"keep={self.keep!r} is not a filter; use one of {KEEP_CHOICES} or a callable(final_info) -> bool")
        if self.if_exists not in IF_EXISTS:
            raise ValueError(f"if_exists={self.if_exists!r} is unknown; use one of {IF_EXISTS}")
        if self.video_layout not in VIDEO_LAYOUTS:
            raise ValueError(f"video_layout={self.video_layout!r} is unknown; use one of {VIDEO_LAYOUTS}")
        src = self.video_source
        if not isinstance(src, str) or not (src == "render" or (src.startswith("sensor:") and len(src) > 7)):
            raise ValueError(f"video_source={src!r} is unknown; use 'render' (the human render camera) or 'sensor:<camera name>'")
        if not isinstance(self.video_codec, str) or not self.video_codec:
            raise ValueError(f"video_codec={self.video_codec!r} must be an encoder name such as 'libx264', or 'auto'")
        if isinstance(self.video_crf, bool) or not isinstance(self.video_crf, numbers.Integral):
            raise ValueError(f"video_crf={self.video_crf!r} must be an integer (libx264: 0-51, lower is better; default 23)")
        if not isinstance(self.video_preset, str):
            raise ValueError(f"video_preset={self.video_preset!r} must be a preset name such as 'ultrafast'")
        _positive_int_or_none("video_workers", self.video_workers, 1, "e.g. 4, or None for one per core")
        _positive_int_or_none("trajectory_writers", self.trajectory_writers, 1, "e.g. 1 or 4", allow_none=False)
        from fastrecord.sinks.maniskill_h5 import parse_compression  # the one list of choices, with the writer

        parse_compression(self.trajectory_compression)
        _positive_int_or_none("buffer_capacity", self.buffer_capacity, 2,
                              "at least 2 (a reset slot and one step), or None for max_episode_steps + 1")

    def as_dict(self) -> dict[str, Any]:
        """JSON-friendly values (callables by name), for the run manifest."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[f.name] = getattr(v, "__qualname__", repr(v)) if callable(v) else v
        return out


def _np_bool() -> type:
    import numpy as np

    return np.bool_


def _positive_int_or_none(name: str, v: Any, lo: int, example: str, allow_none: bool = True) -> None:
    if v is None and allow_none:
        return
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < lo:
        raise ValueError(f"{name}={v!r} must be an integer >= {lo} ({example})")


def options_help() -> str:
    """One line per option (name, default, meaning): the wrappers' docstring."""
    lines = []
    for f in dataclasses.fields(RecordOptions):
        default = f.default if f.default is not dataclasses.MISSING else None
        lines.append(f"        {f.name} (default {default!r}): {f.metadata['help']}")
    return "\n".join(lines)


def wrapper_signature(*, vector: bool, method: bool) -> inspect.Signature:
    """The wrappers' signature: env, output_dir, then `RecordOptions`' fields, then ``sinks``
    (``self`` first for ``__init__``)."""
    P = inspect.Parameter
    env_ann = "gym.vector.VectorEnv" if vector else "gym.Env"
    params = [P("self", P.POSITIONAL_OR_KEYWORD)] if method else []
    params += [P("env", P.POSITIONAL_OR_KEYWORD, annotation=env_ann), P("output_dir", P.POSITIONAL_OR_KEYWORD, annotation="str | Path")]
    for f in dataclasses.fields(RecordOptions):
        kind = P.KEYWORD_ONLY if f.kw_only else P.POSITIONAL_OR_KEYWORD
        params.append(P(f.name, kind, default=f.default, annotation=f.type))
    params.append(P("sinks", P.KEYWORD_ONLY, default=(), annotation="Sequence[fastrecord.sinks.Sink]"))
    return inspect.Signature(params)
