"""Run configurations: frozen dataclasses that YAML presets (configs/) and CLI flags fill."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


@dataclass(frozen=True)
class RecordConfig:
    env_id: str = "PickCube-v1"  # ManiSkill task to record
    num_envs: int = 1  # parallel envs (GPU sim: one batched env; CPU sim: a vector env of processes)
    episodes: int = 4  # stop after this many finished episodes (kept or not)
    policy: str = "random"  # "random" or "module:factory"; factory(env) returns act(obs) -> action
    output_dir: str = "recordings"  # where the .h5/.json and the MP4s go
    trajectory_name: str = "trajectory"  # base name of the .h5/.json pair
    keep: str = "all"  # all | success | success_once | failure
    save_video: bool = True  # write MP4s
    save_trajectory: bool = True  # write the HDF5/JSON trajectory pair
    video_layout: str = "per_env"  # per_env | tiled
    sim_backend: str = "physx_cpu"  # physx_cpu | physx_cuda (GPU simulation needs a CUDA machine)
    render_backend: str = "auto"  # auto (GPU if CUDA is present, else CPU) | cpu | gpu
    obs_mode: str = "state"  # ManiSkill observation mode recorded in the trajectory
    control_mode: str | None = None  # None: the task's default
    width: int = 256  # human render camera width
    height: int = 256  # human render camera height
    max_episode_steps: int | None = None  # None: the task's default
    seed: int = 0  # first episode seed (env i starts at seed + i)
    video_fps: int = 30  # frames per second of the MP4s
    video_codec: str = "auto"  # auto (h264_nvenc where usable, else libx264) | libx264 | any PyAV encoder
    video_workers: int | None = None  # encoder threads (None: one per core, at most 16)
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # extra gym.make kwargs


def load_config(cls: type[T], path: str | Path | None = None, **overrides: Any) -> T:
    """Fill ``cls`` from a YAML file, then from ``overrides`` (None values are ignored)."""
    values: dict[str, Any] = {}
    if path is not None:
        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"config file {str(path)!r} must hold a mapping of option: value, got {type(loaded).__name__}")
        values.update(loaded)
    values.update({k: v for k, v in overrides.items() if v is not None})
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {cls.__name__}; valid options: {sorted(names)}")
    return cls(**values)
