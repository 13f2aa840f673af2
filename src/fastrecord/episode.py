"""What a recording is made of, declared once, and the hand-off of a finished episode to sinks.

`FIELDS` is the schema of recorded quantities (reset, step and flush all loop over it); `EpisodeData`
is one kept, finished env episode on the host, the unit every sink (`fastrecord.sinks`) receives through
``submit``; `EpisodeEnded` is the outcome of every finished episode, kept or not, which every sink
receives through ``episodes_ended`` (results, loggers).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

KeepFilter = Literal["all", "success", "success_once", "failure"] | Callable[[dict[str, Any]], bool]
KEEP_CHOICES = ("all", "success", "success_once", "failure")


@dataclass(frozen=True)
class Field:
    """One recorded quantity. ``state`` fields have T+1 rows (reset + every step), ``transition`` T."""

    name: str  # top-level key in the trajectory group (leaves are name/...)
    kind: Literal["state", "transition"]
    dtype: type | None = None  # dtype on disk; None keeps the env's


# What is recorded, declared once: reset, step and flush all loop over this.
FIELDS = {
    f.name: f
    for f in (
        Field("obs", "state"),
        Field("env_states", "state", np.float32),
        Field("frames", "state"),  # video images, not written to HDF5
        Field("actions", "transition", np.float32),
        Field("terminated", "transition", np.bool_),
        Field("truncated", "transition", np.bool_),
        Field("success", "transition", np.bool_),
        Field("fail", "transition", np.bool_),
        Field("rewards", "transition", np.float32),
        Field("overlay", "transition"),  # scalars drawn on frames when info_on_video
    )
}


def field_of(leaf: str) -> Field:
    """The field a buffer leaf ("obs/agent/qpos") belongs to."""
    return FIELDS[leaf.split("/", 1)[0]]


@dataclass
class EpisodeData:
    """One finished env episode on the host, ready to write. Arrays are already trimmed to the episode."""

    episode_id: int
    env_idx: int
    elapsed_steps: int
    datasets: dict[str, np.ndarray]  # "actions", "env_states/actors/cube", "obs/agent/qpos", ...
    meta: dict[str, Any]  # the JSON episode entry (episode_id, episode_seed, reset_kwargs, ...)
    frames: np.ndarray | None = None  # [T * frames_per_step + 1, H, W, 3] uint8, for the video writer
    overlay: Sequence[dict[str, Any]] | None = field(default=None)  # per-frame info for info_on_video (an Overlay)
    frames_per_step: int = 1  # render_substeps: sim_steps_per_control + 1 (the substeps' frames, then the step's)




@dataclass(frozen=True)
class EpisodeEnded:
    """The outcome of one finished env episode, kept or not: what the recorder knows of it when it ends.

    Kept episodes reach the sinks as `EpisodeData` (``submit``) first, then as this event
    (``episodes_ended``), in the same call of the recorder.
    """

    env_idx: int
    episode_id: int | None  # its id in NAME.h5/NAME.json and its video name; None: not kept (the keep filter)
    length: int  # steps taken
    seed: int  # the episode's seed
    episode_return: float  # the sum of its rewards (float64; NaN/inf if the env gave such rewards)
    success: bool | None  # at the last step; None: the env reports no success
    success_once: bool | None  # at any step
    fail: bool | None  # at the last step; None: the env reports no fail
    terminated: bool | None  # the last step's flags (both False: ended from outside, e.g. in progress at close)
    truncated: bool | None
    has_frames: bool = False  # every frame of the episode was captured (a video sink wrote its video)
    meta: Mapping[str, Any] = field(default_factory=dict)  # extra fields set by the caller (set_episode_meta)

    @property
    def kept(self) -> bool:
        return self.episode_id is not None
