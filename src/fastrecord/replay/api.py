"""The replay's entry points: `run_replay` (a `ReplayConfig`) and `replay_trajectories` (keyword options).

``fastrecord replay`` (and each torchrun rank running it) builds a `ReplayConfig` from its flags and
calls `run_replay`; a Python caller calls `replay_trajectories` with the same options as keywords.
Imports neither torch nor ManiSkill until a replay starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastrecord.replay.config import ReplayConfig, ReplaySummary, StopRequest

if TYPE_CHECKING:
    from fastrecord.packed import PackedLaunch


def check_input(h5: Path) -> None:
    """A fastrecord run given as input whose outputs disagree (a file deleted, truncated or added: see
    `fastrecord.sinks.reconcile`) is refused with one line naming the file; ManiSkill's files (no
    manifest) and a run recording now are taken as they are."""
    from fastrecord.shards import lock_held
    from fastrecord.sinks.base import MANIFEST_SUFFIX
    from fastrecord.sinks.reconcile import refuse_damage

    if h5.suffix == ".h5" and h5.with_name(h5.stem + MANIFEST_SUFFIX).exists() and not lock_held(h5.parent, h5.stem):
        refuse_damage(h5.parent, h5.stem, "cannot replay")


def run_replay(cfg: ReplayConfig, stop: StopRequest | None = None, sinks: list[Any] | None = None,
               early: PackedLaunch | None = None) -> ReplaySummary:
    """Replay ``cfg.traj_path`` and record the replays (see `fastrecord.replay`).

    With ``stop`` (the CLI's signal handlers), a stop request ends the replay between two steps: the
    replays in progress are not saved (``resume`` replays them whole), the env is closed and the summary says so.
    ``sinks``: extra sinks for the recorder (one process only), e.g. ``fastrecord.sinks.loggers``'.
    With more than one worker (``cfg.workers``, or by default on machines of many cores) worker
    processes replay a share of the episodes each and the shards are joined at the end; under
    torchrun each rank is one worker. Raises ValueError for a bad option or input (before any env or
    file is made) and `ReplayWorkerError` when a worker process fails. ``early``: the sub-env processes
    `fastrecord.replay.early.early_subenvs` started for ``cfg`` (the CLI's), taken over where the plan draws
    the same envs in this process, ended here otherwise."""
    t0 = time.perf_counter()
    from fastrecord.replay.drive import run_plan
    from fastrecord.replay.workers import run_rank, run_workers
    from fastrecord.sinks.base import OutputExistsError
    from fastrecord.system import process_age, stamp

    age = process_age()
    with contextlib.ExitStack() as cleanup:
        if early is not None:  # a launch the replay did not take over (a refusal): its processes end, the refusal
            cleanup.callback(early.close, wait=False)  # not waiting for their starts
        if sinks and cfg.workers is None:  # a logger takes the replays of one process: the default where it can be
            cfg = dataclasses.replace(cfg, workers=1)
        try:
            traj, plan = _opened(cfg, sinks, cleanup)
            # the input's outputs (a fastrecord run: an HDF5 scan in a helper process, 0.2 s on the 2-core machine)
            # and the episodes' data (their states and actions read: ~3 ms an episode there) are checked before any
            # env or file is made; with worker processes, while they make their envs (they start replaying once it
            # passed, and end having written nothing where it did not)
            check = functools.partial(_check_all, Path(cfg.traj_path), traj, plan.episodes)
            if plan.distributed or plan.workers == 1:
                check()
            stamp("plan_made")  # benchmarks/bench_replay.py --stamps: the input read and checked, the plan made
            if early is not None and (plan.distributed or plan.workers > 1):
                early.close()  # the guess was wrong: worker processes make their own envs
            if plan.distributed:
                summary = run_rank(plan, stop, sinks, t0)
            elif plan.workers > 1:
                summary = run_workers(plan, stop, sinks, t0, check=check)
            else:
                summary = run_plan(plan, plan.episodes, plan.out, plan.name, plan.num_envs, stop, sinks, t0,
                                   launch=early)
            summary.process_age = age
            return summary
        except OutputExistsError as e:
            if e.found is None:  # another process holds the name: its advice stands
                raise
            raise OutputExistsError(
                f"{e.found} Choose: --resume (resume=True) continues that replay, replaying only the episodes it does "
                f"not hold; --overwrite (overwrite=True) deletes it first; or pass another --trajectory-name or "
                f"--output-dir.", found=e.found) from None


def _opened(cfg: ReplayConfig, sinks: list[Any] | None, cleanup: contextlib.ExitStack) -> tuple[Any, Any]:
    """The input opened (closed by ``cleanup``) and the replay's plan; where either fails, a damaged input's own
    error (`check_input`) comes first: it names the file to restore."""
    from fastrecord.replay.plan import make_plan
    from fastrecord.sinks.maniskill_h5 import open_trajectory

    try:
        traj = open_trajectory(cfg.traj_path)
        cleanup.callback(traj.close)
        return traj, make_plan(cfg, traj, checked=True, sinks=sinks)
    except Exception:
        check_input(Path(cfg.traj_path))
        raise


def _check_all(h5: Path, traj: Any, episodes: list[dict[str, Any]]) -> None:
    """The input's check: its outputs agree (`check_input`), then its episodes' data (`plan.check_input`)."""
    from fastrecord.replay.plan import check_input as check_episodes

    check_input(h5)
    check_episodes(traj, episodes)


def replay_trajectories(
    traj_path: str | os.PathLike[str],
    output_dir: str | os.PathLike[str] | None = None,
    *,
    # ReplayConfig's fields, in its order (tests/test_api.py holds them equal)
    by: str | None = None,
    use_first_env_state: bool = False,
    count: int | None = None,
    num_envs: int | None = None,
    vector: str = "auto",
    sim_backend: str = "auto",
    render_backend: str = "auto",
    batched_render: str = "auto",
    obs_mode: str | None = None,
    width: int | None = None,
    height: int | None = None,
    shader: str | None = None,
    overwrite: bool = False,
    resume: bool = False,
    workers: int | None = None,
    progress: bool = True,
    env_kwargs: dict[str, Any] | None = None,
    maniskill: bool = False,
    target_control_mode: str | None = None,
    allow_failure: bool = False,
    discard_timeout: bool = False,
    max_retry: int = 0,
    reward_mode: str | None = None,
    render_mode: str = "rgb_array",
    verbose: bool = False,
    # the recording options a replay takes (RECORDING_OPTIONS, RecordOptions' order and types; None: the replay decides)
    save_trajectory: bool = True,
    trajectory_name: str | None = None,
    save_video: bool = True,
    info_on_video: bool = False,
    max_steps_per_video: int | None = None,
    clean_on_close: bool = True,
    record_reward: bool | None = None,
    record_env_state: bool = True,
    video_fps: float | None = None,
    render_substeps: bool = False,
    avoid_overwriting_video: bool = False,
    keep: str | None = None,
    video_source: str = "render",
    video_codec: str = "auto",
    video_crf: int = 23,
    video_preset: str = "ultrafast",
    video_gop: int | None = None,
    video_workers: int | None = None,
    trajectory_writers: int | None = None,
    trajectory_compression: str = "gzip:1",
    buffer_capacity: int | None = None,
    lerobot: bool = False,
    lerobot_video_codec: str | None = None,
    lerobot_gop: int = 2,
    lerobot_crf: int | None = None,
    lerobot_state_keys: str | tuple[str, ...] | None = None,
    # the run's hooks, as in `run_replay`
    stop: StopRequest | None = None,
    sinks: list[Any] | None = None,
) -> ReplaySummary:
    """Replay the episodes of ``traj_path`` (a ``NAME.h5`` with ``NAME.json`` next to it) and record them
    again into ``output_dir`` (None: a ``replay`` folder next to the input).

    The options are `ReplayConfig`'s fields (``obs_mode="rgb"``, ``by="actions"``, ``count=10``, ``num_envs=4``,
    ``overwrite=True``, ...; docs/replay.md) and the recording options of `fastrecord.RecordOptions` a replay
    takes (`fastrecord.replay.config.RECORDING_OPTIONS`: ``save_video=False``, ``keep="success"``,
    ``video_crf=30``, ``trajectory_compression="gzip:5"``, ...; None where the replay decides: the output's
    name, the video fps, which replays are kept, rewards), checked once before anything is made; ``stop``
    and ``sinks`` as in `run_replay`. Returns the `ReplaySummary`.

    Long because: its signature declares 55 options, one a line; the body is six.

        from fastrecord import replay_trajectories
        s = replay_trajectories("demos/trajectory.h5", "replayed", obs_mode="rgb", save_video=False)
        print(s.episodes, s.kept, s.files)
    """
    values = dict(locals())  # first thing: only the parameters are defined
    del values["stop"], values["sinks"]
    # the options that differ from their defaults, as the CLI gives only the flags it got (a default is no choice:
    # ``sim_backend="auto"`` beside ``env_kwargs={"sim_backend": ...}`` is not the option given twice)
    defaults = _defaults()
    given = {k: v for k, v in values.items() if k not in defaults or (v is not defaults[k] and v != defaults[k])}
    given["traj_path"] = os.fspath(traj_path)
    given["output_dir"] = None if output_dir is None else os.fspath(output_dir)
    return run_replay(ReplayConfig.from_values(given), stop=stop, sinks=sinks)


@functools.cache
def _defaults() -> dict[str, Any]:
    """`replay_trajectories`' keyword defaults."""
    return {n: p.default for n, p in inspect.signature(replay_trajectories).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}
