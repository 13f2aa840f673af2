"""What a recording is made of, declared once, and the hand-off of a finished episode to sinks.

`FIELDS` is the schema of recorded quantities (reset, step and flush all loop over it); `EpisodeData`
is one finished env episode on the host, the unit every sink (`fastrecord.sinks`) receives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class EpisodeData:
    """One finished env episode on the host, ready to write. Arrays are already trimmed to the episode."""

    episode_id: int
    env_idx: int
    elapsed_steps: int
    datasets: dict[str, np.ndarray]  # "actions", "env_states/actors/cube", "obs/agent/qpos", ...
    meta: dict[str, Any]  # the JSON episode entry (episode_id, episode_seed, reset_kwargs, ...)
    frames: np.ndarray | None = None  # [T+1, H, W, 3] uint8, for the video writer
    overlay: list[dict[str, Any]] | None = field(default=None)  # per-frame text for info_on_video


