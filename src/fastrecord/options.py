"""The recorder's options, declared once: `RecordOptions`.

The wrappers (`RecordEpisode`, `RecordVectorEpisode`) take exactly these arguments after ``env`` and
``output_dir`` (ManiSkill's positional order first, fastrecord's additions keyword-only), written out
in their signatures (tests/test_api.py holds them equal to these fields), their docstring is derived
from this class, and the command-line flags of ``fastrecord record``
and ``scripts/evaluate.py`` are generated from its field metadata (`add_record_flags`: help, default,
choices). Every value is checked when the options are built, before anything touches the disk; a bad
value raises a `ValueError` naming the value, the allowed values and the fix.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import numbers
import os
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from fastrecord.episode import KEEP_CHOICES, KeepFilter
from fastrecord.workers import usable_cores  # noqa: F401 - sized defaults read it here (tests patch it here)

IfExists = Literal["error", "overwrite", "resume"]
VideoLayout = Literal["per_env", "tiled"]
IF_EXISTS: tuple[str, ...] = typing.get_args(IfExists)  # the choices, declared once (the type above)
VIDEO_LAYOUTS: tuple[str, ...] = typing.get_args(VideoLayout)


def _opt(default: Any, help: str, *, kw_only: bool = False, flag: str | None = None, off: str | None = None,
         choices: tuple[str, ...] | None = None) -> Any:
    """A field with its metadata: ``help``; for the CLI (`add_record_flags`) the ``flag`` when it is not
    ``--name-with-dashes`` (or ``--no-...`` for a boolean that defaults to True), ``off`` (what that
    ``--no-...`` flag does) and the ``choices`` of a string option."""
    meta = {"help": help, "flag": flag, "off": off, "choices": choices}
    return field(default=default, kw_only=kw_only, metadata=meta)


def default_video_workers(cores: int) -> int:
    """The default of ``video_workers``: one encoder process per usable core, at most 16."""
    return max(1, min(cores, 16))


def stepping_video_workers(workers: int, sim_processes: int, cores: int) -> int:
    """How many of ``workers`` encoders may encode at once while the env steps: all of them where the env steps in
    this process (a GPU env, a sync vector env); beside a CPU vector env stepping in ``sim_processes`` processes of
    its own, the ``cores`` those processes and the stepping process leave, but at least a quarter of the workers
    (at least 2). Every writer encodes while the caller waits for the videos (for room in the queue, at close).

    Measured (the H100 machine, 16 cores, `make_eval_envs` of 16 PickCube envs at 512x512 with info text, 8
    sub-env processes): with 16 encoders starting on the 16 videos of a batch, the 10 steps after each reset step
    took 22.9-26.9 ms against 16.0 ms with 7 or 8, and the reset steps 112-153 ms against 100-120 ms. With a
    process per env, 2 at once fell behind (the last reset step waited 1.0 s for room in the queue); 4 kept up."""
    if sim_processes <= 0:
        return workers
    least = min(workers, max(2, workers // 4))
    return max(least, min(workers, cores - sim_processes - 1))


def default_trajectory_writers(cores: int, image_leaves: bool) -> int:
    """The default of ``trajectory_writers``: 1 when the recorded observations hold no image leaves (one
    writer keeps up with state-only episodes), else half of the usable ``cores``, at least 1 and at most 8
    (gzip of camera images is what a writer spends its time on: on 16 cores, 128x128 rgb observations
    recorded 3,097 env-steps/s with 1 writer and 8,283 with 8)."""
    return min(8, max(1, cores // 2)) if image_leaves else 1


@dataclass(frozen=True)
class RecordOptions:
    # ManiSkill's arguments, same meaning, defaults and positional order as
    # mani_skill.utils.wrappers.RecordEpisode (after env, output_dir)
    save_trajectory: bool = _opt(
        True,
        "write NAME.h5 + NAME.json in ManiSkill's trajectory format",
        flag="--no-trajectory",
        off="write no trajectory (no NAME.h5 + NAME.json): videos only",
    )
    trajectory_name: str | None = _opt(
        None, "NAME of the trajectory pair and run manifest (None: a timestamp, made unique)"
    )
    save_video: bool = _opt(True, "write MP4 videos", flag="--no-video", off="write no MP4 videos: the trajectory only")
    info_on_video: bool = _opt(False, "draw reward and info scalars on each frame")
    save_on_reset: bool = _opt(True, "save the episode in progress at reset and close (False: only flush_* saves)",
                               off="refused by fastrecord record, which makes no flush_* calls (it would save nothing)")
    save_video_trigger: Callable[[int], bool] | None = _opt(
        None, "fn(elapsed_record_steps) -> capture frames of this step?"
    )
    max_steps_per_video: int | None = _opt(
        None, "split each video into pieces of at most this many steps (the trajectory is not split)"
    )
    clean_on_close: bool = _opt(True, "accepted for compatibility (episode ids are always consecutive)")
    record_reward: bool = _opt(True, "write rewards", off="write no rewards")
    record_env_state: bool = _opt(True, "write env states (needed to replay from states)",
                                  off="write no env states (the episodes can then be replayed from actions only)")
    video_fps: float = _opt(30, "frames per second of the videos (a positive number; 7.5 and 29.97 work)")
    render_substeps: bool = _opt(
        False,
        "videos get a frame after every physics substep, as ManiSkill's (sim_steps_per_control + 1 "
        "frames a step; the trajectory keeps one row a step)",
    )
    avoid_overwriting_video: bool = _opt(
        False, "accepted for compatibility: fastrecord never overwrites a video (a taken name gets _1, _2, ...)"
    )
    source_type: str | None = _opt(None, "JSON source_type (e.g. 'motionplanning')")
    source_desc: str | None = _opt(None, "JSON source_desc")
    # fastrecord's additions (keyword-only)
    keep: KeepFilter = _opt(
        "all",
        f"which finished episodes are written: one of {KEEP_CHOICES} or a callable(final_info) -> bool",
        kw_only=True,
        choices=KEEP_CHOICES,
    )
    if_exists: IfExists = _opt(
        "error",
        "when output_dir already holds a run of this trajectory_name: 'error' (refuse), 'overwrite' "
        "(delete that run's files first), 'resume' (keep them and add episodes after them)",
        kw_only=True,
        choices=IF_EXISTS,
    )
    video_layout: VideoLayout = _opt(
        "per_env", "one MP4 per env episode, or 'tiled' (ManiSkill's layout)", kw_only=True, choices=VIDEO_LAYOUTS
    )
    video_source: str = _opt(
        "render",
        "'render' (the human render camera) or 'sensor:<camera>' (an RGB camera of the observation)",
        kw_only=True,
    )
    video_codec: str = _opt(
        "auto", "'auto' (h264_nvenc where it encodes, else libx264) or a PyAV video encoder", kw_only=True
    )
    video_crf: int = _opt(23, "constant rate factor (lower is better quality; libx264: 0-51)", kw_only=True)
    video_preset: str = _opt("ultrafast", "libx264 preset (ultrafast keeps up with GPU envs)", kw_only=True)
    video_gop: int | None = _opt(None, "keyframe interval of the MP4 videos in frames (None: the encoder's default, "
                                 "libx264's 250: one key frame per episode video)", kw_only=True)
    video_workers: int | None = _opt(
        None, "background encoder processes (None: one per usable core, at most 16; beside a CPU vector env's "
        "sub-env processes only the cores they leave encode while the envs step, every one at close)", kw_only=True
    )
    trajectory_writers: int | None = _opt(
        None,
        "HDF5 writer processes, each compressing whole batches of episodes (None: 1 when the observations hold "
        "no image leaves, else half the usable cores, 1 to 8; decided from the first reset's observations)",
        kw_only=True,
    )
    trajectory_compression: str = _opt(
        "gzip:1", "compression of image observations in NAME.h5: 'gzip:1' ... 'gzip:9' (ManiSkill writes 'gzip:5'), "
        "'lzf' or 'none' (docs/format.md: Image observations on disk)", kw_only=True)
    buffer_capacity: int | None = _opt(
        None, "steps per env held on the device (None: max_episode_steps + 1; longer episodes grow it)", kw_only=True
    )
    lerobot: bool = _opt(
        False,
        "also write a LeRobot v3.0 dataset NAME.lerobot/ (a row per step at the env's control "
        "frequency, sensor cameras as H.264 videos; needs pip install 'fastrecord[lerobot]')",
        kw_only=True,
    )
    lerobot_video_codec: str | None = _opt(
        None, "encoder of the LeRobot dataset's videos: None (video_codec's), 'libx264', or 'libsvtav1' (AV1, "
        "LeRobot's own default: files ~1.5x smaller, encoding ~6x slower; docs/format.md)", kw_only=True)
    lerobot_gop: int = _opt(
        2,
        "keyframe interval of the LeRobot videos in frames (2, as LeRobot: training reads "
        "random frames, each decoded from the key frame before it; docs/format.md)",
        kw_only=True,
    )
    lerobot_crf: int | None = _opt(None, "rate factor of the LeRobot videos (None: video_crf for H.264, LeRobot's 30 "
                                         "for libsvtav1, whose range is 0-63)", kw_only=True)
    lerobot_state_keys: str | tuple[str, ...] | None = _opt(
        None, "observation leaves that make the LeRobot dataset's observation.state, in this order, e.g. "
        "'agent/qpos,extra/tcp_pose' (None: every non-image leaf: agent, then extra)", kw_only=True)

    def __post_init__(self) -> None:
        for name in ("save_trajectory", "save_video", "info_on_video", "save_on_reset", "clean_on_close",
                     "record_reward", "record_env_state", "render_substeps", "avoid_overwriting_video", "lerobot"):
            v = getattr(self, name)
            if not isinstance(v, (bool, _np_bool())):
                raise ValueError(f"{name}={v!r} must be True or False")
        if self.render_substeps and self.video_source != "render":
            raise ValueError(
                f"render_substeps=True renders the human render camera after each physics substep, but "
                f"video_source={self.video_source!r} takes the video from an observation camera, which has one picture "
                f"a step; use video_source='render' with render_substeps=True, or render_substeps=False"
            )
        traj_name = self.trajectory_name
        if traj_name is not None and (
            not isinstance(traj_name, str) or not traj_name or traj_name in (".", "..")
            or any(c in traj_name for c in "/\\\0")
        ):
            raise ValueError(
                f"trajectory_name={traj_name!r} must be a plain file name without folders (e.g. 'trajectory'), "
                "or None for a timestamp"
            )
        if self.save_video_trigger is not None and not callable(self.save_video_trigger):
            raise ValueError(
                f"save_video_trigger={self.save_video_trigger!r} must be a callable(elapsed_steps) -> bool, or None"
            )
        _positive_int_or_none(
            "max_steps_per_video", self.max_steps_per_video, 1, "e.g. 50, or None to keep each episode in one video"
        )
        check_video_fps(self.video_fps)
        for name in ("source_type", "source_desc"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"{name}={v!r} must be a string or None")
        if not (callable(self.keep) or (isinstance(self.keep, str) and self.keep in KEEP_CHOICES)):
            raise ValueError(
                f"keep={self.keep!r} is not a filter; use one of {KEEP_CHOICES} or a callable(final_info) -> bool"
            )
        if self.if_exists not in IF_EXISTS:
            raise ValueError(f"if_exists={self.if_exists!r} is unknown; use one of {IF_EXISTS}")
        if self.video_layout not in VIDEO_LAYOUTS:
            raise ValueError(f"video_layout={self.video_layout!r} is unknown; use one of {VIDEO_LAYOUTS}")
        src = self.video_source
        if not isinstance(src, str) or not (src == "render" or (src.startswith("sensor:") and len(src) > 7)):
            raise ValueError(
                f"video_source={src!r} is unknown; use 'render' (the human render camera) or 'sensor:<camera name>'"
            )
        if not isinstance(self.video_codec, str) or not self.video_codec:
            raise ValueError(f"video_codec={self.video_codec!r} must be an encoder name such as 'libx264', or 'auto'")
        if isinstance(self.video_crf, bool) or not isinstance(self.video_crf, numbers.Integral):
            raise ValueError(
                f"video_crf={self.video_crf!r} must be an integer (libx264: 0-51, lower is better; default 23)"
            )
        if not isinstance(self.video_preset, str):
            raise ValueError(f"video_preset={self.video_preset!r} must be a preset name such as 'ultrafast'")
        _positive_int_or_none("video_workers", self.video_workers, 1, "e.g. 4, or None for one per core")
        _positive_int_or_none(
            "video_gop", self.video_gop, 1, "frames between key frames, e.g. 2, or None: the encoder's"
        )
        _positive_int_or_none("lerobot_gop", self.lerobot_gop, 1, "frames between key frames, e.g. 2")
        if self.lerobot_gop is None:
            raise ValueError(
                "lerobot_gop=None: the LeRobot videos need a keyframe interval; use an integer >= 1 (e.g. 2)"
            )
        codec = self.lerobot_video_codec
        if codec is not None and (not isinstance(codec, str) or not codec):
            raise ValueError(f"lerobot_video_codec={codec!r} must be an encoder name such as 'libx264' or 'libsvtav1', "
                             f"or None for video_codec's")
        crf = self.lerobot_crf
        if crf is not None and (isinstance(crf, bool) or not isinstance(crf, numbers.Integral)):
            raise ValueError(f"lerobot_crf={crf!r} must be an integer (libx264: 0-51, libsvtav1: 0-63) or None")
        state_keys(self.lerobot_state_keys)
        _positive_int_or_none(
            "trajectory_writers", self.trajectory_writers, 1, "e.g. 1 or 4, or None to size it to the machine"
        )
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


def state_keys(value: Any) -> tuple[str, ...] | None:
    """``lerobot_state_keys`` as a tuple of observation keys (a string is split at commas), or None;
    ValueError for anything else."""
    if value is None:
        return None
    keys = tuple(k.strip() for k in value.split(",")) if isinstance(value, str) else value
    if not isinstance(keys, (tuple, list)) or not keys or not all(isinstance(k, str) and k.strip("/. ") for k in keys):
        raise ValueError(f"lerobot_state_keys={value!r} must name observation keys, e.g. 'agent/qpos,extra/tcp_pose' "
                         f"or ('agent', 'extra'), or be None for every non-image observation leaf")
    return tuple(k.strip() for k in keys)


def check_video_fps(fps: Any) -> None:
    """Raise ValueError unless ``fps`` is a positive, finite number of frames per second. The one check of
    every fps option."""
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(float(fps)) or fps <= 0:
        raise ValueError(f"video_fps={fps!r} must be a positive number of frames per second (e.g. 30, 7.5 or 29.97)")


def check_output_dir(output_dir: Any, owner: str) -> None:
    """Raise a TypeError naming ``output_dir`` unless it is a folder path (str or ``os.PathLike``), before
    anything is made: ``owner`` (e.g. "RecordEpisode") says whose argument it is."""
    if isinstance(output_dir, bool) or not isinstance(output_dir, (str, os.PathLike)) or output_dir == "":
        raise TypeError(f"{owner}: output_dir={output_dir!r} must be a folder path (str or pathlib.Path), e.g. "
                        f"'recordings'; it is the argument after env: {owner}(env, 'recordings', ...)")


def _np_bool() -> type:
    import numpy as np

    return np.bool_


def _positive_int_or_none(name: str, v: Any, lo: int, example: str) -> None:
    if v is None:
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


# ---------------------------------------------------------------------------------------------- the CLI's flags
# Fields no command line can fill: callables, and ManiSkill's source metadata (the command sets it).
CLI_EXCLUDED = ("save_video_trigger", "source_type", "source_desc")


def cli_option_names() -> tuple[str, ...]:
    """The `RecordOptions` fields a command line or a YAML config can set (all but `CLI_EXCLUDED`)."""
    return tuple(f.name for f in dataclasses.fields(RecordOptions) if f.name not in CLI_EXCLUDED)


def flag_of(name: str) -> str:
    """The command-line flag of option ``name``: ``--no-video`` for ``save_video``, ``--video-fps`` for
    ``video_fps``, ``--no-record-reward`` for ``record_reward`` (a boolean that defaults to True)."""
    f = {f.name: f for f in dataclasses.fields(RecordOptions)}.get(name)
    if f is None or name in CLI_EXCLUDED:
        raise ValueError(f"{name!r} is not a recording option with a flag; use one of {cli_option_names()}")
    if f.metadata["flag"]:
        return f.metadata["flag"]
    dashed = name.replace("_", "-")
    return f"--no-{dashed}" if f.default is True else f"--{dashed}"


def _value_type(f: dataclasses.Field) -> Callable[[str], Any]:
    text = str(f.type)
    return float if text.startswith("float") else int if text.startswith("int") else str


def add_record_flags(
    parser: argparse.ArgumentParser,
    *,
    include: typing.Iterable[str] | None = None,
    exclude: typing.Iterable[str] = (),
    defaults: typing.Mapping[str, Any] | None = None,
    help: typing.Mapping[str, str] | None = None,
    title: str | None = "recording options (fastrecord.RecordOptions)",
) -> list[str]:
    """Add one flag per `RecordOptions` field to ``parser`` (an ``argparse.ArgumentParser``): the fields
    of `cli_option_names`, only those in ``include`` if given, minus ``exclude``. Returns the fields added.

    Each flag stores into the field's name and defaults to None ("not given": a --config file or the
    dataclass fills the value), so the values are validated once, by `RecordOptions`. The help is the
    field's, with the default the command uses (``defaults`` overrides the field's, e.g. a CLI's
    ``trajectory_name="trajectory"``; ``help`` replaces a field's text, a switch's too); a string option with declared
    choices gets them (`IF_EXISTS`, `VIDEO_LAYOUTS`, `KEEP_CHOICES`). A boolean that defaults to True
    becomes an off switch (``--no-video`` sets ``save_video=False``), one that defaults to False an on
    switch (``--info-on-video``)."""
    names = cli_option_names()
    if include is not None:
        include = list(include)
        unknown = [n for n in include if n not in names]
        if unknown:
            raise ValueError(f"include={unknown} are not recording options with a flag; use names from {names}")
        names = tuple(n for n in names if n in include)
    skip = set(exclude)
    defaults, help = dict(defaults or {}), dict(help or {})
    fields = {f.name: f for f in dataclasses.fields(RecordOptions)}
    group = parser.add_argument_group(title) if title else parser
    added = []
    for name in names:
        if name in skip:
            continue
        f = fields[name]
        default = defaults.get(name, f.default)
        text = help.get(name, f.metadata["help"]).replace("%", "%%")
        if f.default is True:  # an off switch
            off = help.get(name) or f.metadata["off"] or text
            group.add_argument(flag_of(name), dest=name, action="store_const", const=False, default=None,
                               help=f"{off} (sets {name}=False; default {name}={default})")
        elif f.default is False:
            group.add_argument(flag_of(name), dest=name, action="store_const", const=True, default=None,
                               help=f"{text} (sets {name}=True; default {name}={default})")
        else:
            shown = "" if "default" in text.lower() else f" (default: {default})".replace("%", "%%")
            group.add_argument(
                flag_of(name),
                dest=name,
                type=_value_type(f),
                choices=f.metadata["choices"],
                default=None,
                help=f"{text}{shown}",
            )
        added.append(name)
    return added


def given_options(args: argparse.Namespace, names: typing.Iterable[str]) -> dict[str, Any]:
    """{name: value} of the flags among ``names`` that ``args`` (an ``argparse.Namespace``) was given."""
    return {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}


def record_options(values: typing.Mapping[str, Any]) -> RecordOptions:
    """``RecordOptions(**values)`` for the flat values of a command line or a YAML config: a bad value's
    ValueError also names the option's flag and config key."""
    try:
        return RecordOptions(**values)
    except ValueError as e:
        name = str(e).split("=", 1)[0]
        if name not in cli_option_names():
            raise
        raise ValueError(f"{e} (the {flag_of(name)} flag, or {name}: in the --config file)") from None
