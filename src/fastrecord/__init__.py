"""fastrecord: record ManiSkill episodes (trajectories + per-env MP4s) at encoder speed.

    from fastrecord import RecordEpisode      # drop-in for mani_skill.utils.wrappers.RecordEpisode
    env = RecordEpisode(env, "videos", keep="success")

The names below are imported on first use (PEP 562), so ``import fastrecord`` and the ``fastrecord``
command start without torch and ManiSkill: the CLI's ``--help`` and ``--version`` answer at once, and
``fastrecord replay --workers N`` starts its worker processes' imports while its own are still running.

    from fastrecord import replay_trajectories   # the replay as a function (package: fastrecord.replay)
    summary = replay_trajectories("videos/trajectory.h5", obs_mode="rgb", save_video=False)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# The public API (docs/api.md lists it, tests/test_api.py holds the two equal); every other module is
# internal unless docs/api.md names it. Where each name lives: imported on first use (__getattr__).
__all__ = [
    # recording
    "RecordEpisode",
    "RecordVectorEpisode",
    "RecordOptions",
    "make_eval_envs",
    # outputs
    "Sink",
    "BackgroundSink",
    # replay
    "replay_trajectories",
    "ReplayConfig",
    "ReplaySummary",
    # process end
    "install_signal_handlers",
    # errors
    "OutputExistsError",
    "BufferTooLargeError",
    "WorkerError",
]
_EXPORTS = {
    "RecordEpisode": "fastrecord.record",
    "RecordVectorEpisode": "fastrecord.record",
    "RecordOptions": "fastrecord.options",
    "make_eval_envs": "fastrecord.make_env",
    "Sink": "fastrecord.sinks",
    "BackgroundSink": "fastrecord.sinks",
    "replay_trajectories": "fastrecord.replay",
    "ReplayConfig": "fastrecord.replay",
    "ReplaySummary": "fastrecord.replay",
    "install_signal_handlers": "fastrecord.exits",
    "OutputExistsError": "fastrecord.sinks",
    "BufferTooLargeError": "fastrecord.buffer",
    "WorkerError": "fastrecord.workers",
}

if TYPE_CHECKING:
    from fastrecord.buffer import BufferTooLargeError
    from fastrecord.exits import install_signal_handlers
    from fastrecord.make_env import make_eval_envs
    from fastrecord.options import RecordOptions
    from fastrecord.record import RecordEpisode, RecordVectorEpisode
    from fastrecord.replay import ReplayConfig, ReplaySummary, replay_trajectories
    from fastrecord.sinks import BackgroundSink, OutputExistsError, Sink
    from fastrecord.workers import WorkerError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'fastrecord' has no attribute {name!r}")
    if name == "make_eval_envs":
        _prestart_forkserver()
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


PRESTART_CORES = 4  # `_prestart_forkserver` only where this many cores are usable


def _prestart_forkserver() -> None:
    """``from fastrecord import make_eval_envs`` (the baseline's one-line switch) starts the forkserver its CPU vector
    envs fork from, before `fastrecord.make_env` imports ManiSkill: the server's preload (torch, ManiSkill: about 7 s on
    the H200 machine) runs on another core while the script imports and loads its policy, not after `make_eval_envs` is
    called (H200, started before the script's imports: the eval's first step 5 s sooner). Only in a script's main
    process: not in a process multiprocessing started, nor while a server or a spawned process imports the script (as
    ``__mp_main__``, with the process marked as inheriting), nor on fewer than `PRESTART_CORES` cores: there the preload
    competes with the script's own imports for the cores (2-core machine: the script's imports took longer by about what
    the preload takes)."""
    import multiprocessing
    import sys

    from fastrecord.workers import affinity_cores

    if (affinity_cores() < PRESTART_CORES or multiprocessing.parent_process() is not None
            or getattr(multiprocessing.current_process(), "_inheriting", False)
            or sys.modules.get("__mp_main__", sys.modules.get("__main__")) is not sys.modules.get("__main__")):
        return
    from fastrecord.workers import start_forkserver

    start_forkserver()


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
