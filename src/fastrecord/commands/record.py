"""`fastrecord record`: run a policy in N envs, record the episodes, print a summary.

Examples:
    fastrecord record PickCube-v1                                # 4 episodes, CPU sim + render
    fastrecord record PushCube-v1 --num-envs 4 --episodes 16 --keep success
    fastrecord record PickCube-v1 --config configs/pickcube_cpu.yaml
    fastrecord record PickCube-v1 --policy fastrecord.policies:pick_cube_policy --keep success
    fastrecord record PickCube-v1 --output-dir recordings --if-exists resume   # record what the run lacks
    fastrecord record PickCube-v1 --no-video --trajectory-compression gzip:5 --video-crf 28

Episode g of a run (0 .. --episodes - 1) is reset with seed --seed + g and the random policy is seeded
per episode, so the same command records the same dataset, with or without torchrun; --if-exists resume
records the episodes of --episodes the run does not have yet (a crashed or stopped run continues where it
ended). Every recording option of `fastrecord.RecordOptions` has a flag and a config key of the same name.

Ctrl-C or SIGTERM stops the run between two steps: every finished episode is saved, the episodes in
progress are not (a cut episode is not a finished one: --if-exists resume records it whole, with its
seed), the summary is printed, and the exit status is 130 (SIGINT) or 143 (SIGTERM). A sharded run
(OUTPUT_DIR/NAME.shards/ holds shards) resumed without torchrun is resumed from its shards, in this one
process, and joined again.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fastrecord.checks import env_kwargs_of, json_flag, json_or_text, load_config, parse_env_kwarg
from fastrecord.commands.config import RECORD_DEFAULTS, RecordConfig
from fastrecord.exits import StopSignals
from fastrecord.options import add_record_flags
from fastrecord.system import stamp


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


def _render_backend(name: str) -> str:
    if name != "auto":
        return name
    import torch

    return "gpu" if torch.cuda.is_available() else "cpu"


def recorder_kwargs(cfg: RecordConfig) -> dict[str, Any]:
    """The wrapper's arguments: ``cfg.record`` (checked when the config was built) and the source metadata."""
    opts = dataclasses.replace(
        cfg.record, source_type="fastrecord", source_desc=f"fastrecord record, policy {cfg.policy}"
    )
    return {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}


def env_kwargs_for(cfg: RecordConfig, render_backend: str) -> dict[str, Any]:
    """The ``gym.make`` keywords of `record`'s envs."""
    kwargs: dict[str, Any] = dict(
        obs_mode=cfg.obs_mode,
        render_mode="rgb_array",
        sim_backend=cfg.sim_backend,
        render_backend=render_backend,
        human_render_camera_configs=dict(width=cfg.width, height=cfg.height),
        # a fresh episode seed at every (auto-)reset, so each recorded episode replays from its seed
        enhanced_determinism=True,
    )
    kwargs.update(cfg.env_kwargs)
    if cfg.control_mode:
        kwargs["control_mode"] = cfg.control_mode
    if cfg.max_episode_steps:
        kwargs["max_episode_steps"] = cfg.max_episode_steps
    for key in ("reward_mode", "shader_dir", "robot_uids", "sim_config", "sensor_configs"):
        if getattr(cfg, key) is not None:
            kwargs[key] = getattr(cfg, key)
    return kwargs


def spaces_probe(cfg: RecordConfig) -> Any:
    """Where `record` will step its envs in forkserver processes (CPU simulation, several envs, the batched
    render: a cheap guess, without torch), a `fastrecord.workers.SpacesProbe` of its sub-env, started now:
    it builds gymnasium's dummy env on another core while this process imports (None elsewhere)."""
    from fastrecord.system import has_nvidia_gpu

    render = cfg.render_backend
    if render == "auto":
        render = "gpu" if has_nvidia_gpu() else "cpu"
    batched = {"on": True, "off": False}.get(cfg.batched_render, render.split(":")[0] in ("gpu", "cuda", "sapien_cuda"))
    if (cfg.sim_backend not in ("physx_cpu", "cpu") or cfg.num_envs <= 1 or not batched or not cfg.record.save_video
            or cfg.record.render_substeps):
        return None
    from fastrecord.workers import SpacesProbe

    return SpacesProbe(_CpuEnvThunk(cfg.env_id, env_kwargs_for(cfg, render), report_poses=True))


def make_recorded_env(cfg: RecordConfig, sinks: list[Any] | None = None, auto_reset: bool = True, probe: Any = None,
                      check_env: Callable[[Any], None] | None = None):
    """The env stack `record` uses: one batched env (GPU sim or N=1) or a vector env of CPU envs.

    ``auto_reset=False`` (what `run_record` and `run_record_sharded` use: their loop,
    `fastrecord.shards.record_schedule`, resets each env with its episode's seed): the batched env's
    ``ManiSkillVectorEnv`` does not reset, the vector env has ``autoreset_mode=DISABLED``. ``probe``: a
    `spaces_probe` of ``cfg``, which answers the vector env's dummy env where the sub-envs fork. ``check_env``
    (a policy factory's, `check_policy`) sees the env before the recorder wraps it: its refusal writes nothing."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers the tasks
    from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

    from fastrecord.record import RecordEpisode

    kwargs = env_kwargs_for(cfg, _render_backend(cfg.render_backend))
    if cfg.env_id not in gym.registry:
        raise ValueError(
            f"env_id={cfg.env_id!r} is not a registered ManiSkill task; e.g. PickCube-v1, PushCube-v1, StackCube-v1"
        )
    from fastrecord.envs import check_env_kwargs, make_checked

    check_env_kwargs(cfg.env_id, kwargs)  # a misspelt keyword or a bad reward mode: one line, before any env is made
    rec = recorder_kwargs(cfg)
    rec["sinks"] = list(sinks or [])  # --log: logger sinks (fastrecord.sinks.loggers)
    stamp("imported")  # benchmarks/bench_whole.py: interpreter and imports end here, env creation starts
    gpu_sim = cfg.sim_backend not in ("physx_cpu", "cpu")
    if gpu_sim or cfg.num_envs == 1:
        env = make_checked(cfg.env_id, num_envs=cfg.num_envs, **kwargs)
        try:
            if check_env is not None:
                check_env(env)
            env = RecordEpisode(env, cfg.output_dir, **rec)
        except BaseException:
            env.close()
            raise
        return ManiSkillVectorEnv(env, auto_reset=auto_reset, ignore_terminations=False)

    mode = gym.vector.AutoresetMode.NEXT_STEP if auto_reset else gym.vector.AutoresetMode.DISABLED
    from fastrecord import render

    wanted = {"auto": None, "on": True, "off": False}[cfg.batched_render]
    if render.use_batched(
        wanted,
        num_envs=cfg.num_envs,
        render_backend=kwargs["render_backend"],
        render_mode="rgb_array",
        videos=cfg.record.save_video,
        substeps=cfg.record.render_substeps,
        flag="--batched-render on",
        instead="--batched-render auto or off",
    ):
        # the envs step in processes of their own; this process renders them all in one batch
        from fastrecord.render.vector import device_of, group_rendered, make_mirror_factory
        from fastrecord.workers import first_thunk, forkserver_context

        forkserver_context()
        thunks = first_thunk([_CpuEnvThunk(cfg.env_id, kwargs, report_poses=True)] * cfg.num_envs, probe)
        envs = group_rendered(
            lambda: gym.vector.AsyncVectorEnv(thunks, context="forkserver", autoreset_mode=mode),
            make_mirror_factory(cfg.env_id, kwargs),
            cfg.num_envs,
            device=device_of(kwargs["render_backend"]),
        )
    else:
        envs = gym.vector.SyncVectorEnv([_CpuEnvThunk(cfg.env_id, kwargs)] * cfg.num_envs, autoreset_mode=mode)
    try:
        if check_env is not None:
            check_env(envs)
        return RecordEpisode(envs, cfg.output_dir, **rec)
    except BaseException:
        envs.close()
        raise


def close_without_collecting(env: Any) -> None:
    """``env.close()`` with ``gc.collect`` a no-op meanwhile: ManiSkill's close of every env this process holds
    (a sync vector env's envs, the batched render's mirror scenes) runs a full collection to release GPU
    memory, 0.1-0.3 s each (2.7 s of a 16-env `record`'s close on the H200 machine went to closing), which
    the command's exit releases anyway. The recorder's own close (encoders, files) is unchanged."""
    import gc

    collect = gc.collect
    gc.collect = lambda *args, **kwargs: 0
    try:
        env.close()
    finally:
        gc.collect = collect


class _CpuEnvThunk:
    """Builds one CPU sub-env of `record` (picklable: an AsyncVectorEnv sends it to the sub-env's process)."""

    def __init__(self, env_id: str, kwargs: dict[str, Any], report_poses: bool = False) -> None:
        self.env_id, self.kwargs, self.report_poses = env_id, dict(kwargs), report_poses

    def __call__(self) -> Any:

        import mani_skill.envs  # noqa: F401 - registers the tasks (sub-env processes too)
        from mani_skill.utils.wrappers import CPUGymWrapper

        from fastrecord.envs import make_checked

        env = CPUGymWrapper(make_checked(self.env_id, **self.kwargs))
        if self.report_poses:
            from fastrecord.render.vector import PoseReporter

            env = PoseReporter(env)
        return env


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


def load_policy(spec: str, env: Any) -> Callable[[Any], Any]:
    """`policy_factory` (spec), called on ``env``: act(obs) -> batched action."""
    return policy_factory(spec)(env)


def _recorder(env: Any):
    cur = env
    while cur is not None:
        if hasattr(cur, "recorder"):
            return cur.recorder
        cur = getattr(cur, "_env", None) or getattr(cur, "env", None)
    raise RuntimeError("no fastrecord recorder in this env stack")


def run_record(cfg: RecordConfig, progress: bool = True, stop: StopSignals | None = None,
               sinks: list[Any] | None = None, probe: Any = None) -> RecordSummary:
    """Record episodes 0 .. ``cfg.episodes``-1 of the run: episode g is reset with seed ``cfg.seed + g`` and the random
    policy is seeded per episode (`fastrecord.shards.SeededRandomPolicy`), so the same command records the same dataset,
    with or without torchrun. A resumed run (``--if-exists resume``) records the episodes its NAME.json and results file
    do not have yet (`fastrecord.shards.single_schedule`): ``cfg.episodes`` is the run's total; whether the run on disk
    can be resumed (`fastrecord.shards.check_resume`: its episode list readable, its seeds this command's) is checked
    before the env is made or a file written. With ``stop`` (the CLI's), a SIGINT/SIGTERM ends the run between two
    steps. The episodes in progress when the run stops (a signal, an error) are not saved, as in a sharded run: a cut
    episode is not a finished one, and a resumed run records it whole; the summary counts them (``cut``)."""
    from tqdm import tqdm

    from fastrecord import shards

    factory = None if cfg.policy == "random" else policy_factory(cfg.policy)
    check_env = check_policy(factory, cfg)
    if cfg.record.if_exists == "resume" and cfg.record.trajectory_name:
        shards.check_resume(cfg.output_dir, cfg.record.trajectory_name, base_seed=cfg.seed)
    t_start = time.perf_counter()
    env = make_recorded_env(cfg, sinks, auto_reset=False, probe=probe, check_env=check_env)
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
        schedule = shards.single_schedule(cfg.output_dir, cfg.record.trajectory_name, total=cfg.episodes,
                                          base_seed=cfg.seed, num_envs=n)
        act = shards.SeededRandomPolicy(env.single_action_space, n) if factory is None else factory(env)
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
        try:  # episodes in progress (a stop, an error) are never saved: a resumed run records them whole
            _recorder(env).set_episode_meta(np.arange(n), [None] * n)
        finally:
            close_without_collecting(env)
            stamp("closed")
    if seconds is None:
        seconds = time.perf_counter() - t0
    successes = 0
    json_path = Path(cfg.output_dir) / f"{cfg.record.trajectory_name}.json"
    files = sorted(rec.video_paths)
    if cfg.record.save_trajectory and json_path.exists():
        import json

        episodes = json.loads(json_path.read_text())["episodes"]  # with --if-exists resume, earlier runs' first
        successes = sum(bool(e.get("success")) for e in episodes[len(episodes) - rec.num_episodes:])
        files = [json_path.with_suffix(".h5"), json_path] + files
    results = rec.results
    if rec.lerobot is not None:
        files += rec.lerobot.files  # NAME.lerobot/
    files.append(results.path)
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
    info = shards.rank_info()
    sim, render = shards.rank_backends(cfg.sim_backend, _render_backend(cfg.render_backend), info)
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
            act = shards.SeededRandomPolicy(env.single_action_space, cfg.num_envs) if factory is None else factory(env)
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
            try:  # episodes in progress (a stop, an error) are never saved: a resumed run records them whole
                _recorder(env).set_episode_meta(np.arange(cfg.num_envs), [None] * cfg.num_envs)
            finally:
                env.close()
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


def print_sharded(s: ShardedSummary, output_dir: str | Path) -> None:
    """Rank 0's summary of a sharded run: each rank, the results of all, the merge report."""
    if s.interrupted:
        print(
            f"rank {s.rank}: interrupted ({s.interrupted}) after {s.finished} of its {s.scheduled} episodes; the "
            f"episodes in progress were not saved. Run the same command again to resume (then fastrecord merge "
            f"{output_dir} if it was not joined)"
        )
        return
    if s.rank != 0:
        return
    for r in s.ranks:
        rate = r["env_steps"] / r["seconds"] if r["seconds"] > 0 else 0.0
        print(
            f"rank {r['rank']}: {r['finished']}/{r['scheduled']} scheduled episodes finished, {r['kept']} kept; "
            f"{r['env_steps']} env-steps in {r['seconds']:.1f} s = {rate:.1f} env-steps/s "
            f"(start-up {r['startup_seconds']:.1f} s)"
            + (f"; interrupted ({r['interrupted']})" if r.get("interrupted") else "")
        )
    rows = [row for r in s.ranks for row in r["results"]]
    print_results(rows, len(rows), None)
    if s.report is not None:
        for line in s.report.lines():
            print(line)
    print(f"run directory: {output_dir} (shards in {Path(output_dir) / (s.shard_dir.parent.name)})")


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("env_id", nargs="?", help="ManiSkill task id (default PickCube-v1)")
    p.add_argument("--config", help="YAML preset filling RecordConfig (see configs/)")
    p.add_argument("--num-envs", type=int)
    p.add_argument("--episodes", type=int)
    p.add_argument("--policy", help="'random' or 'module:factory'")
    p.add_argument("--output-dir")
    p.add_argument("--sim-backend")
    p.add_argument("--render-backend")
    p.add_argument(
        "--batched-render",
        choices=["auto", "on", "off"],
        help="CPU simulation with --num-envs > 1: step the envs in processes of their own and render all of "
        "them in one batch in this process (needs a CUDA device); auto: when rendering on a CUDA device",
    )
    p.add_argument("--obs-mode")
    p.add_argument("--control-mode")
    p.add_argument("--width", type=int)
    p.add_argument("--height", type=int)
    p.add_argument("--max-episode-steps", type=int)
    p.add_argument("--seed", type=int)
    env = p.add_argument_group("env options (gym.make keywords)")
    env.add_argument("--reward-mode")
    env.add_argument("--shader-dir")
    env.add_argument("--robot-uids", type=json_or_text)
    env.add_argument("--sim-config", type=json_flag("--sim-config", (dict,), '{"sim_freq": 200, "control_freq": 20}'))
    env.add_argument("--sensor-configs", type=json_flag("--sensor-configs", (dict,), '{"width": 128, "height": 128}'))
    env.add_argument(
        "--env-kwargs",
        nargs="+",
        type=parse_env_kwarg,
        metavar="KEY=VALUE",
        help="any gym.make keywords, each KEY=VALUE with the value as JSON where it parses, else a string "
        "(reward_mode=dense shader_dir=rt-fast sim_config='{\"sim_freq\": 200}'); added to the config's "
        "env_kwargs; a key that has a flag of its own (--obs-mode, --reward-mode, ...) goes through one of the two",
    )
    p.add_argument(
        "--log",
        choices=["tensorboard", "wandb"],
        help="also log each kept episode (success, length, success rate, a few videos) to TensorBoard "
        "(OUTPUT_DIR/tensorboard/NAME) or W&B (OUTPUT_DIR/wandb); needs pip install fastrecord[loggers]",
    )
    add_record_flags(p, defaults=RECORD_DEFAULTS, help=RECORD_HELP)


# Where `record`'s meaning of a recording option is narrower than the library's.
RECORD_HELP = {
    "trajectory_name": "NAME of the trajectory pair (NAME.h5 + NAME.json), run manifest and results file",
    "if_exists": "when output_dir already holds a run of this NAME: 'error' (refuse), 'overwrite' (delete that run's "
                 "files first), 'resume' (keep them and record the episodes of --episodes it lacks, with their seeds)",
    "keep": "which finished episodes are written",
}


def main_from_args(args: argparse.Namespace) -> int:
    opts = {k: v for k, v in vars(args).items() if k not in ("config", "command", "func", "log")}
    opts["env_kwargs"] = env_kwargs_of(opts.get("env_kwargs"))
    cfg = load_config(RecordConfig, args.config, **opts)
    from fastrecord.shards import rank_info

    distributed = rank_info().distributed
    probe = None if distributed else spaces_probe(cfg)  # before the imports below, which it overlaps
    from fastrecord.sinks.loggers import log_sinks
    from fastrecord.workers import freeze_imports

    freeze_imports()  # this process is the CLI's (see fastrecord.workers.freeze_imports)

    resume_shards = not distributed and resumes_shards(cfg)
    if distributed or resume_shards:  # torchrun: this process records one shard
        if resume_shards:
            print(
                f"resuming the sharded run {cfg.record.trajectory_name!r} in {cfg.output_dir} from its shards "
                f"({cfg.record.trajectory_name}.shards/), in this one process; the shards are joined again at the end"
            )
        with StopSignals("record") as stop:
            s = run_record_sharded(cfg, stop=stop, sinks=log_sinks(getattr(args, "log", None)))
            print_sharded(s, cfg.output_dir)
            return stop.exit_code
    with StopSignals("record") as stop:
        s = run_record(cfg, stop=stop, sinks=log_sinks(getattr(args, "log", None)), probe=probe)
        if s.interrupted:
            print(interrupted_line(s.interrupted, s.finished_before_stop, s.cut, cfg.record.keep, saved=False))
        if s.scheduled < cfg.episodes:
            print(f"resumed: {cfg.episodes - s.scheduled} of the run's {cfg.episodes} episodes were on disk, "
                  f"{s.scheduled} to record")
        print(f"episodes: {s.episodes} finished, {s.kept} kept, {s.successes} successful")
        print_results(s.results, s.finished_in_run, s.results_path)
        print_speed_and_files(s.env_steps, s.seconds, s.files, cfg.output_dir, s.startup_seconds)
        return stop.exit_code


def resumes_shards(cfg: RecordConfig) -> bool:
    """Whether ``cfg`` resumes a sharded run (``--if-exists resume``, and ``OUTPUT_DIR/NAME.shards/`` holds
    shard folders): `run_record_sharded` then continues it from its shards, whatever the world size."""
    from fastrecord.shards import list_shards

    name = cfg.record.trajectory_name
    return cfg.record.if_exists == "resume" and bool(name) and bool(list_shards(cfg.output_dir, name))


def interrupted_line(signal_name: str, finished: int, in_progress: int, keep: Any, saved: bool = True) -> str:
    """The one line an interrupted run prints before its summary (record: the episodes in progress are not
    ``saved``; replay in one process: the replays in progress are)."""
    cut = f"{in_progress} episode{'s' if in_progress != 1 else ''} in progress"
    if not saved:
        tail = (f"{cut} not saved (--if-exists resume records {'them' if in_progress != 1 else 'it'} whole)"
                if in_progress else "no episode in progress")
    else:
        tail = f"{cut} saved" if keep == "all" else f"{cut} saved if kept (keep={keep})"
    return f"interrupted ({signal_name}): stopped after {finished} episode{'s' if finished != 1 else ''}; {tail}"


def print_results(rows: list[dict[str, Any]], counted: int, path: Path | None) -> None:
    """The results part of a run's summary (record, replay): the first ``counted`` rows are the episodes
    the progress bar counted; rows after them ended at close (in progress, saved), listed but not rated."""
    from fastrecord.sinks.results import summary_lines

    lines = summary_lines(rows[:counted])
    extra = len(rows) - counted
    if extra > 0:
        lines[0] += f" (+{extra} in progress at the end: in the results file, not rated)"
    for line in lines:
        print(line)
    if path is not None:
        print(f"results: {path}")


def print_speed_and_files(env_steps: int, seconds: float, files: list[Path], where: str | Path,
                          startup: float | None = None) -> None:
    """The end of a run's summary (record, replay): start-up, throughput, then the first files written."""
    rate = env_steps / seconds if seconds > 0 else 0.0
    if startup is not None:
        print(f"start-up (env creation): {startup:.1f} s")
    print(f"speed: {env_steps} env-steps in {seconds:.1f} s = {rate:.1f} env-steps/s")
    print(f"files ({len(files)}) in {where}:")
    for f in files[:10]:
        print(f"  {f}")
    if len(files) > 10:
        print(f"  ... and {len(files) - 10} more")
