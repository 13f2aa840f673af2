"""A replay's sub-env processes, started before the CLI's imports where the replay draws its envs in one process.

Where a replay of CPU-simulated envs draws them on a CUDA device in one process (`fastrecord.replay.mirrored`,
``--workers 1 --vector async``), its sub-envs step in `fastrecord.packed.PackedVectorEnv` processes.
`early_subenvs` starts those processes from the command line's options and the input's JSON alone, on a thread,
right after the options are read: the sub-envs are made while this process imports torch and ManiSkill, as
`fastrecord record`'s are (`fastrecord.commands.record_env.early_subenvs`). The replay takes them over where its
plan asks for the same envs (`MirroredSubenv` compares equal) and ends them otherwise
(`fastrecord.replay.api.run_replay`, `fastrecord.replay.mirrored.mirrored_replay_env`).

Imports neither torch nor ManiSkill (nor this package's modules that do).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastrecord.render.device import on_cuda
from fastrecord.replay.config import CPU_BACKENDS, ReplayConfig
from fastrecord.replay.layout import subenvs_per_process

if TYPE_CHECKING:
    from fastrecord.packed import PackedLaunch

__all__ = ["MirroredSubenv", "early_subenvs"]


@dataclass(frozen=True)
class MirroredSubenv:
    """Makes one sub-env of a replay drawn in one process, in its own process: the replay env
    (`fastrecord.replay.envs.make_replay_env` of these arguments) under `fastrecord.replay.mirrored.ReplayReporter`,
    the process claimed and deaf to Ctrl-C (`fastrecord.replay.envs.in_worker`). Picklable; equal where it makes
    the same env (what a replay compares an early launch with)."""

    env_id: str
    env_kwargs: dict[str, Any]
    max_episode_steps: int | None

    def __call__(self) -> Any:
        from fastrecord.replay.envs import in_worker, make_replay_env
        from fastrecord.replay.mirrored import ReplayReporter

        thunk = functools.partial(make_replay_env, self.env_id, self.env_kwargs, self.max_episode_steps)
        return ReplayReporter(in_worker(thunk))


def early_subenvs(cfg: ReplayConfig) -> PackedLaunch | None:
    """The sub-env processes of ``cfg``'s replay, started now on a thread (a `fastrecord.packed.PackedLaunch`), where
    a cheap guess says it will draw its envs in this process, on a machine where the forkserver started before the
    CLI's imports (`fastrecord.PRESTART_CORES` cores); None elsewhere, and for whatever the guess does not cover
    (a resumed replay, torchrun, a config file's unusual choices: they start their envs once planned)."""
    guess = _guess(cfg)
    if guess is None:
        return None
    subenv, n = guess
    import gymnasium as gym

    from fastrecord.packed import PackedLaunch
    from fastrecord.system import stamp
    from fastrecord.workers import forkserver_context

    forkserver_context()  # here, not on the launch's thread: a server forked from this process needs it alone
    launch = PackedLaunch([subenv] * n, subenvs_per_process(n), context="forkserver",
                          autoreset_mode=gym.vector.AutoresetMode.DISABLED, background=True)
    stamp("early_subenvs")
    return launch


def _guess(cfg: ReplayConfig) -> tuple[MirroredSubenv, int] | None:
    """(the sub-env, how many) of a replay that will draw its envs in this process, as `fastrecord.replay.plan`
    would decide it from ``cfg`` and the input's JSON; None where it may not."""
    from fastrecord import PRESTART_CORES
    from fastrecord.options import usable_cores
    from fastrecord.shards import rank_info
    from fastrecord.system import has_nvidia_gpu
    from fastrecord.workers import affinity_cores

    if not cfg.traj_path or cfg.resume or rank_info().distributed or affinity_cores() < PRESTART_CORES:
        return None
    if cfg.workers != 1 or cfg.vector != "async" or cfg.batched_render == "off" or cfg.option("render_substeps"):
        return None
    try:
        info, episodes = _input(Path(cfg.traj_path))
        episodes = episodes[: cfg.count]
        modes = sorted({mode for ep in episodes if (mode := ep.get("control_mode"))})
        if not episodes or len(modes) > 1:
            return None
        from fastrecord.replay.plan import decide_env

        env = decide_env(cfg, info, episodes, modes, cuda=has_nvidia_gpu())
    except (OSError, ValueError, KeyError, TypeError):  # the plan says what is wrong, in its words
        return None
    kwargs = env.kwargs
    obs_mode = str(kwargs.get("obs_mode") or "state")
    camera_obs = obs_mode not in ("state", "state_dict", "none")
    render_videos = cfg.save_video and cfg.video_source == "render"
    cuda_render = on_cuda(kwargs.get("render_backend"))
    if (env.sim_backend not in CPU_BACKENDS or env.convert or "pointcloud" in obs_mode
            or not (camera_obs or render_videos) or (render_videos and kwargs.get("render_mode") != "rgb_array")
            or not (cuda_render or cfg.batched_render == "on")):  # "on" where it cannot run: the plan refuses it
        return None
    n = min(cfg.num_envs if cfg.num_envs is not None else (1 if cfg.maniskill else usable_cores()), len(episodes))
    return (MirroredSubenv(info["env_id"], kwargs, env.max_steps), n) if n > 1 else None


def _input(h5_path: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The input JSON's ``env_info`` and its episodes (the first ``count`` are the plan's)."""
    with open(h5_path.with_suffix(".json")) as f:
        meta = json.load(f)
    return meta["env_info"], list(meta["episodes"])
