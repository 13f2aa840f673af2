"""Replay saved ManiSkill trajectories side by side and record them again, as a library.

    from fastrecord import replay_trajectories
    summary = replay_trajectories("demos/trajectory.h5", "replayed", obs_mode="rgb", save_video=False)

Reads a ``NAME.h5`` + ``NAME.json`` pair written by fastrecord or by ManiSkill's ``RecordEpisode`` and
replays N episodes at once, in a gymnasium vector env of CPU envs (``physx_cpu``) or in one
GPU-parallel ManiSkill env (``physx_cuda``). The output goes through fastrecord's recorder: new MP4s
(any camera, resolution, shader) and a new trajectory (any observation mode). ``fastrecord replay``
is a command-line parser over this package, and torchrun ranks run that command.

Names: ``fastrecord.replay`` is this package; its entry points are `replay_trajectories` (options as
keywords, also exported as ``fastrecord.replay_trajectories``) and `run_replay` (a `ReplayConfig`).

Replay by env states (``by="states"``, the default) sets every recorded state exactly: each step runs
the physics from the recorded state (so contact-based checks such as grasping see real contacts), then
sets the next recorded state and computes observation, reward and success on it. Replay by actions
(``by="actions"``) resets with the episode seed and applies the recorded actions; episodes whose final
success differs from the recorded one are reported (`ReplaySummary.diverged`).

The recording options are `fastrecord.RecordOptions`' (``video_crf=30``, ``trajectory_compression="gzip:5"``,
``keep="success"``, ...: `RECORDING_OPTIONS`), bar the three a replay decides itself (`REPLAY_DECIDES`).

Episodes are renumbered in the order they finish; each output JSON episode names the episode it
replays in ``source_episode_id``. Existing output files are never replaced without ``overwrite``;
``resume`` continues an interrupted replay, skipping the episodes it holds.

``workers=N`` splits the episodes over N processes (forked by the preloaded forkserver), each with its
own envs and recorder writing a shard (each env takes the next input episode no worker took when it is
free, so that the workers end together); the shards are joined at the end into ``NAME.h5`` (a copy of every
episode) + ``NAME.json``, in input order. Under torchrun
each rank is one worker and rank 0 joins. A worker that fails or is killed does not stop the others;
the error names it and the missing episodes, and running again resumes.

``maniskill=True`` gives ManiSkill's ``replay_trajectory`` semantics: by actions unless ``by``, only
successful replays kept unless ``allow_failure``, rewards only with ``record_reward``, the output
``<stem>.<obs>.<control>.<backend>.h5`` next to the input, replacing an earlier replay of that name.
``target_control_mode`` converts the actions to another control mode with ManiSkill's own conversion
code (from ``pd_joint_pos`` or ``pd_joint_delta_pos``), one episode at a time in a CPU env.

Modules: `config` (options, summary, errors), `layout` (default envs and workers), `envs` (the env
wrappers and the adapters holding N envs), `plan` (decisions before any env or file), `drive` (the
replay loop and conversion), `workers` (worker processes, torchrun ranks, joining the shards), `api`
(the entry points). `config`, `layout` and `api` import neither torch nor ManiSkill.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# imported on first use (PEP 562): the CLI reads `fastrecord.replay.layout` before its heavy imports
_EXPORTS = {
    "BY_CHOICES": "fastrecord.replay.config",
    "RECORDING_OPTIONS": "fastrecord.replay.config",
    "RENDER_MODES": "fastrecord.replay.config",
    "REPLAY_DECIDES": "fastrecord.replay.config",
    "VECTOR_CHOICES": "fastrecord.replay.config",
    "Divergence": "fastrecord.replay.config",
    "ReplayConfig": "fastrecord.replay.config",
    "ReplaySummary": "fastrecord.replay.config",
    "ReplayWorkerError": "fastrecord.replay.config",
    "StopRequest": "fastrecord.replay.config",
    "default_workers": "fastrecord.replay.layout",
    "replay_trajectories": "fastrecord.replay.api",
    "run_replay": "fastrecord.replay.api",
}
__all__ = [  # the keys of _EXPORTS (tests/test_api.py), spelt out for linters and type checkers
    "BY_CHOICES",
    "RECORDING_OPTIONS",
    "RENDER_MODES",
    "REPLAY_DECIDES",
    "VECTOR_CHOICES",
    "Divergence",
    "ReplayConfig",
    "ReplaySummary",
    "ReplayWorkerError",
    "StopRequest",
    "default_workers",
    "replay_trajectories",
    "run_replay",
]

if TYPE_CHECKING:
    from fastrecord.replay.api import replay_trajectories, run_replay
    from fastrecord.replay.config import (
        BY_CHOICES,
        RECORDING_OPTIONS,
        RENDER_MODES,
        REPLAY_DECIDES,
        VECTOR_CHOICES,
        Divergence,
        ReplayConfig,
        ReplaySummary,
        ReplayWorkerError,
        StopRequest,
    )
    from fastrecord.replay.layout import default_workers


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'fastrecord.replay' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
