"""The recording loop of `fastrecord record`: the policy (``--policy``, checked before any env is made), one
process's run (`run_record`) and one rank's part of a sharded run (`run_record_sharded`, torchrun), each
returning its summary. Episode g of a run has seed ``--seed + g`` in both (`fastrecord.shards`).

The env stack comes from `fastrecord.commands.record_env`; `fastrecord.commands.record` is the CLI.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from fastrecord.commands.config import RecordConfig
from fastrecord.commands.record_env import (
    EarlySubenvs,
    close_without_collecting,
    make_recorded_env,
    resolve_render_backend,
)
from fastrecord.exits import StopSignals
from fastrecord.system import stamp

__all__ = ["RecordSummary", "ShardedSummary", "check_policy", "for_policy", "load_policy", "policy_factory",
           "run_record", "run_record_sharded"]


@dataclass
class RecordSummary:
    episodes: int  # finished episodes
    kept: int  # episodes written
    successes: int  # kept episodes whose final success flag is set
    env_steps: int  # env-steps taken (parallel steps x num_envs)
    seconds: float
    files: list[Path]
    interrupted: str | None = None  # the signal that stopped the run early ("SIGINT", "SIGTERM"), None if it ran out
    finished_before_stop: int = 0  # episodes finished when the signal stopped the run (the rest ended at close)
    startup_seconds: float = 0.0  # env creation (and the recorder's checks), before the progress bar started
    results: list[dict[str, Any]] = field(default_factory=list)  # NAME.results.jsonl's rows of this run
    results_path: Path | None = None
    finished_in_run: int = 0  # episodes that ended while the run stepped (the bar's count); later rows ended at close
    scheduled: int = 0  # episodes of the run this command had to record (the rest were on disk: --if-exists resume)
    cut: int = 0  # episodes in progress when the run stopped early: not saved (a resumed run records them whole)


def policy_factory(spec: str) -> Callable[[Any], Callable[[Any], Any]]:
    """'random', or 'module:factory' where factory(env) returns act(obs) -> batched action.

    Imported here, before any env is made, so that a wrong name costs nothing and writes nothing."""
    if spec == "random":
        return lambda env: (lambda obs: env.action_space.sample())
    module, sep, name = spec.partition(":")
    if not sep:
        raise ValueError(
            f"policy={spec!r} must be 'random' or 'module:factory' (e.g. fastrecord.policies:pick_cube_policy)"
        )
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"policy={spec!r} cannot be loaded ({e}); check the module path and the factory name") from e


def check_policy(factory: Any, cfg: RecordConfig) -> Callable[[Any], None] | None:
    """Refuse, before any env or file is made, a run the policy ``factory`` declares it cannot drive
    (``factory.control_mode``: the control mode it needs); returns its ``check_env`` (None: it has none), for
    `make_recorded_env` to call on the env before the recorder opens the run."""
    need = getattr(factory, "control_mode", None)
    if need is not None and cfg.control_mode != need:
        has = repr(cfg.control_mode) if cfg.control_mode else "the task's default"
        raise ValueError(f"policy={cfg.policy!r} drives control_mode={need!r} and this run has {has}; "
                         f"pass --control-mode {need}")
    return getattr(factory, "check_env", None)


def for_policy(factory: Any, cfg: RecordConfig) -> RecordConfig:
    """``cfg`` laid out for the policy ``factory``: one that reads the simulator of its envs
    (``factory.reads_simulator``, `fastrecord.policies`) keeps them in this process where ``--vector`` is auto (its
    ``check_env`` refuses processes)."""
    if getattr(factory, "reads_simulator", False) and cfg.vector == "auto" and cfg.batched_render != "on":
        return dataclasses.replace(cfg, vector="sync")
    return cfg


def load_policy(spec: str, env: Any) -> Callable[[Any], Any]:
    """`policy_factory` (spec), called on ``env``: act(obs) -> batched action."""
    return policy_factory(spec)(env)


def _recorder(env: Any) -> Any:
    cur = env
    while cur is not None:
        if hasattr(cur, "recorder"):
            return cur.recorder
        cur = getattr(cur, "_env", None) or getattr(cur, "env", None)
    raise RuntimeError("no fastrecord recorder in this env stack")


def _acting(factory: Any, env: Any, num_envs: int) -> Callable[[Any], Any]:
    """act(obs) of the run: ``factory(env)``, or (no factory: ``--policy random``) the random policy seeded per
    episode."""
    from fastrecord import shards

    return shards.SeededRandomPolicy(env.single_action_space, num_envs) if factory is None else factory(env)


def _drop_in_progress_then_close(env: Any, num_envs: int, close: Callable[[Any], None]) -> None:
    """The end of a run, whatever stopped it: the episodes in progress (a stop, an error) are never saved (a
    resumed run records them whole), then ``close(env)``."""
    try:
        _recorder(env).set_episode_meta(np.arange(num_envs), [None] * num_envs)
    finally:
        close(env)


def _close_and_stamp(env: Any) -> None:
    close_without_collecting(env)
    stamp("closed")


def _kept_files(cfg: RecordConfig, rec: Any) -> tuple[int, list[Path]]:
    """(successful episodes among those this run kept, the files of the run: the trajectory pair, the videos,
    the LeRobot dataset, the results file)."""
    successes = 0
    json_path = Path(cfg.output_dir) / f"{cfg.record.trajectory_name}.json"
    files = sorted(rec.video_paths)
    if cfg.record.save_trajectory and json_path.exists():
        import json

        episodes = json.loads(json_path.read_text())["episodes"]  # with --if-exists resume, earlier runs' first
        successes = sum(bool(e.get("success")) for e in episodes[len(episodes) - rec.num_episodes:])
        files = [json_path.with_suffix(".h5"), json_path] + files
    if rec.lerobot is not None:
        files += rec.lerobot.files  # NAME.lerobot/
    files.append(rec.results.path)
    return successes, files


def run_record(cfg: RecordConfig, progress: bool = True, stop: StopSignals | None = None,
               sinks: list[Any] | None = None, early: EarlySubenvs | None = None) -> RecordSummary:
    """Record episodes 0 .. ``cfg.episodes``-1 of the run: episode g is reset with seed ``cfg.seed + g`` and the random
    policy is seeded per episode (`fastrecord.shards.SeededRandomPolicy`), so the same command records the same dataset,
    with or without torchrun. A resumed run (``--if-exists resume``) records the episodes its NAME.json and results file
    do not have yet (`fastrecord.shards.single_schedule`): ``cfg.episodes`` is the run's total; whether the run on disk
    can be resumed (`fastrecord.shards.check_resume`: its episode list readable, its seeds this command's) is checked
    before the env is made or a file written. With ``stop`` (the CLI's), a SIGINT/SIGTERM ends the run between two
    steps. The episodes in progress when the run stops (a signal, an error) are not saved, as in a sharded run: a cut
    episode is not a finished one, and a resumed run records it whole; the summary counts them (``cut``). ``early``:
    the sub-env processes `fastrecord.commands.record_env.early_subenvs` started (ended here where the run refuses)."""
    from tqdm import tqdm

    from fastrecord import shards

    try:
        factory = None if cfg.policy == "random" else policy_factory(cfg.policy)
        check_env = check_policy(factory, cfg)
        cfg = for_policy(factory, cfg)
        if cfg.record.if_exists == "resume" and cfg.record.trajectory_name:
            shards.check_resume(cfg.output_dir, cfg.record.trajectory_name, base_seed=cfg.seed)
    except BaseException:
        if early is not None:  # the sub-envs started early end with the refusal, which does not wait for their starts
            early.close(wait=False)
        raise
    t_start = time.perf_counter()
    env = make_recorded_env(cfg, sinks, auto_reset=False, early=early, check_env=check_env)
    startup = time.perf_counter() - t_start
    stamp("env_ready")
    stopping = (lambda: stop.requested) if stop is not None else (lambda: False)
    n = cfg.num_envs
    steps = 0
    finished_before_stop = 0
    t0 = time.perf_counter()
    seconds = None
    cut = 0
    try:
        rec = _recorder(env)
        schedule = shards.single_schedule(cfg.output_dir, cast(str, cfg.record.trajectory_name), total=cfg.episodes,
                                          base_seed=cfg.seed, num_envs=n)
        act = _acting(factory, env, n)
        bar = tqdm(total=len(schedule.todo), unit="episode", disable=not progress, dynamic_ncols=True, mininterval=1.0)

        stepped = [0]  # env-steps so far, for the bar's rate

        def on_step(sch: shards.EpisodeSchedule) -> None:
            if not stepped[0]:
                stamp("first_step")
            stepped[0] += n
            if len(sch.finished) > bar.n:
                bar.set_postfix(kept=rec.num_episodes, steps_per_s=f"{stepped[0] / (time.perf_counter() - t0):.0f}",
                                refresh=False)
                bar.update(len(sch.finished) - bar.n)

        t0 = time.perf_counter()
        try:
            if not stopping():
                steps = shards.record_schedule(env, rec, schedule, act, stop=stopping, on_step=on_step)
        finally:
            bar.close()
        stamp("loop_end")
        finished_before_stop = rec.num_finished
        cut = int(schedule.active.sum())  # scheduled episodes in progress: only a stop leaves any
        if not stopping():
            rec.wait_until_done()
            seconds = time.perf_counter() - t0
            stamp("drained")
    finally:
        _drop_in_progress_then_close(env, n, _close_and_stamp)
    if seconds is None:
        seconds = time.perf_counter() - t0
    successes, files = _kept_files(cfg, rec)
    results = rec.results
    return RecordSummary(rec.num_finished, rec.num_episodes, successes, steps, seconds, files,
                         stop.name if stop is not None and stop.requested else None, finished_before_stop,
                         startup, list(results.rows), results.path, finished_before_stop, len(schedule.todo), cut)


@dataclass
class ShardedSummary:
    """One rank's part of a sharded `record` run; on rank 0 also every rank's part and the merge report."""

    rank: int
    world_size: int
    scheduled: int  # global episodes this rank had to record (its share minus what the shards had)
    finished: int  # of those, finished in this run
    kept: int  # episodes written to this rank's shard in this run
    env_steps: int
    seconds: float
    startup_seconds: float
    shard_dir: Path
    interrupted: str | None = None
    results: list[dict[str, Any]] = field(default_factory=list)  # this rank's results rows of this run
    ranks: list[dict[str, Any]] = field(default_factory=list)  # rank 0: every rank's summary
    report: Any = None  # rank 0: fastrecord.shards.MergeReport


def run_record_sharded(cfg: RecordConfig, progress: bool = True, stop: StopSignals | None = None,
                       sinks: list[Any] | None = None) -> ShardedSummary:
    """`run_record` for a sharded run (launched by torchrun, any world size): global episode g (0 ..
    ``cfg.episodes``-1) has seed ``cfg.seed + g`` and is recorded by rank ``g % world_size`` into
    ``OUTPUT_DIR/NAME.shards/rankNNNNN/``; rank 0 then joins the shards into ``OUTPUT_DIR/NAME.h5`` +
    ``NAME.json`` (`fastrecord.shards`). ``--if-exists resume`` skips the global episodes already on disk.
    The random policy is seeded per episode (`SeededRandomPolicy`), so the dataset does not depend on the
    world size. A stop signal ends the run between two steps; the episodes in progress are then not
    saved (a resumed run records them whole)."""
    from fastrecord import shards

    factory = None if cfg.policy == "random" else policy_factory(cfg.policy)
    check_env = check_policy(factory, cfg)  # before the run directory is opened
    cfg = for_policy(factory, cfg)
    info = shards.rank_info()
    sim, render = shards.rank_backends(cfg.sim_backend, resolve_render_backend(cfg.render_backend), info)
    run = shards.DistributedRun(
        cfg.output_dir,
        cfg.record.trajectory_name,
        total=cfg.episodes,
        base_seed=cfg.seed,
        if_exists=cfg.record.if_exists,
        options={"command": "record", "args": cfg.as_dict()},
    ).open()
    failed = True
    try:
        shard_record = dataclasses.replace(cfg.record, if_exists=run.shard_if_exists,
                                           video_workers=cfg.record.video_workers or shards.default_workers(info))
        shard_cfg = dataclasses.replace(cfg, output_dir=str(run.shard_dir), sim_backend=sim, render_backend=render,
                                        record=shard_record)
        t_start = time.perf_counter()
        env = make_recorded_env(shard_cfg, sinks, auto_reset=False, check_env=check_env)
        startup = time.perf_counter() - t_start
        steps, seconds = 0, 0.0
        try:
            rec = _recorder(env)
            schedule = run.plan(rec, cfg.num_envs)
            act = _acting(factory, env, cfg.num_envs)
            from tqdm import tqdm

            bar = tqdm(total=len(schedule.todo), unit="episode", disable=not progress or run.rank != 0,
                       dynamic_ncols=True, mininterval=1.0, desc=f"rank {run.rank}/{run.world_size}")
            t0 = time.perf_counter()
            try:
                steps = shards.record_schedule(
                    env, rec, schedule, act, stop=(lambda: stop.requested) if stop is not None else None,
                    on_step=lambda sch: bar.update(len(sch.finished) - bar.n) if len(sch.finished) > bar.n else None)
                rec.wait_until_done()
                seconds = time.perf_counter() - t0
            finally:
                bar.close()
        finally:
            _drop_in_progress_then_close(env, cfg.num_envs, lambda e: e.close())
        failed = False
    finally:
        if failed:  # this rank cannot finish; torchrun stops the others
            run.close(status="failed")
    mine = ShardedSummary(run.rank, run.world_size, len(schedule.todo), len(schedule.finished), rec.num_episodes, steps,
                          seconds, startup, run.shard_dir, stop.name if stop is not None and stop.requested else None,
                          list(rec.results.rows))
    if mine.interrupted:  # no end exchange: the other ranks may be gone (torchrun stops them all on a failure)
        run.close(status="failed")
        mine.ranks = [dataclasses.asdict(mine)]
        return mine
    ranks, report = run.finish(dataclasses.asdict(mine) | {"shard_dir": str(mine.shard_dir)})
    run.close()
    mine.ranks, mine.report = ranks, report
    return mine


