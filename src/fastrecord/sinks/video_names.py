"""The names of fastrecord's video files, written (`fastrecord.sinks.mp4.Mp4Sink`) and read back
(``fastrecord gallery``) by these functions only.

- per-env videos: ``{episode_id}_env{env_idx}[_success|_failure][_part{k}].mp4`` (no outcome when the env
  reports no success; ``_part{k}``: piece k of a video split by ``max_steps_per_video``);
- tiled videos (and ManiSkill's own): ``{video_id}.mp4``;
- a name already taken gets ``_1``, ``_2``, ... before ``.mp4`` (the encoder never replaces a file).

Kept free of heavy imports: the gallery command imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


def video_name(episode_id: int, env_idx: int, success: bool | None = None, part: int | None = None) -> str:
    """The file name of a per-env video: ``{episode_id}_env{env_idx}[_success|_failure][_part{part}].mp4``
    (no outcome when the env reports no success; ``part``: piece k of a split video)."""
    tag = "" if success is None else ("_success" if success else "_failure")
    return f"{episode_id}_env{env_idx}{tag}" + ("" if part is None else f"_part{part}") + ".mp4"


def tiled_video_name(video_id: int) -> str:
    """The file name of a tiled video (and of ManiSkill's videos): ``{video_id}.mp4``."""
    return f"{video_id}.mp4"


@dataclass(frozen=True)
class VideoName:
    """What a video's file name says (`parse_video_name`)."""

    number: int  # per-env: the episode id; tiled (and ManiSkill's): the video's number
    env_idx: int | None = None  # None: a tiled or ManiSkill video
    success: bool | None = None  # None: not in the name
    part: int | None = None  # piece k of a split video

    @property
    def per_env(self) -> bool:
        return self.env_idx is not None


# `video_name`'s names; _k: a taken name got a suffix (the encoder never replaces a file)
_PER_ENV_NAME = re.compile(
    r"^(?P<number>\d+)_env(?P<env>\d+)(?:_(?P<outcome>success|failure))?(?:_part(?P<part>\d+))?(?:_\d+)?$"
)
_TILED_NAME = re.compile(r"^(?P<number>\d+)$")


def parse_video_name(name: str) -> VideoName | None:
    """The parts of a name `video_name` or `tiled_video_name` made (``.mp4`` optional; a ``_k`` suffix of a
    taken name allowed); None for any other name."""
    stem = name[:-4] if name.endswith(".mp4") else name
    if m := _PER_ENV_NAME.match(stem):
        success = None if m["outcome"] is None else m["outcome"] == "success"
        return VideoName(int(m["number"]), int(m["env"]), success, int(m["part"]) if m["part"] else None)
    if m := _TILED_NAME.match(stem):
        return VideoName(int(m["number"]))
    return None
