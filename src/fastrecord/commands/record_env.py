"""The env stack `fastrecord record` records from: ``gym.make``'s keywords for the run's config, the recorder's
options, the batched env (GPU simulation, or N=1) or the vector env of CPU sub-envs (with the batched render
where it applies), the start-up probe of its dummy env, and a close that skips ManiSkill's garbage collections.

`fastrecord.commands.record_run` runs its loop over this stack; `fastrecord.commands.record` is the CLI.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fastrecord.commands.config import RecordConfig
from fastrecord.render.device import on_cuda
from fastrecord.system import stamp

__all__ = ["EarlySubenvs", "close_without_collecting", "early_subenvs", "env_kwargs_for", "make_recorded_env",
           "recorder_kwargs", "resolve_render_backend"]


def resolve_render_backend(name: str) -> str:
    """``--render-backend``: "auto" resolved to "gpu" where torch sees CUDA, else "cpu"; any other name as it is."""
    if name != "auto":
        return name
    from fastrecord.system import torch_sees_cuda

    return "gpu" if torch_sees_cuda() else "cpu"


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


def early_subenvs(cfg: RecordConfig) -> EarlySubenvs | None:
    """Where `record` will step its envs in sub-env processes (CPU simulation, several envs, the batched render: a
    cheap guess, without torch) on a machine of `fastrecord.PRESTART_CORES` cores or more, their processes
    (`EarlySubenvs`), started now on a thread: the sub-envs are made while this process
    imports torch and ManiSkill (None elsewhere). `make_recorded_env` takes it over where its guess was right
    (the same ``gym.make`` keywords) and ends it otherwise."""
    from fastrecord.system import has_nvidia_gpu

    render = cfg.render_backend
    if render == "auto":
        render = "gpu" if has_nvidia_gpu() else "cpu"
    batched = {"on": True, "off": False}.get(cfg.batched_render, on_cuda(render))
    if (cfg.sim_backend not in ("physx_cpu", "cpu") or cfg.num_envs <= 1 or not batched or not cfg.record.save_video
            or cfg.record.render_substeps or cfg.vector == "sync"):
        return None
    from fastrecord import PRESTART_CORES
    from fastrecord.workers import affinity_cores

    if affinity_cores() < PRESTART_CORES:  # the forkserver starts after the imports there (fastrecord.commands.cli)
        return None
    return _launch(cfg, env_kwargs_for(cfg, render))


class EarlySubenvs:
    """`record`'s sub-env processes of the batched render, started before the CLI's imports: the
    `fastrecord.packed.PackedLaunch` and the ``gym.make`` keywords its envs were made with (what `make_recorded_env`
    compares with the run's own before it takes the processes over)."""

    def __init__(self, launch: Any, env_kwargs: dict[str, Any]) -> None:
        self.launch, self.env_kwargs = launch, dict(env_kwargs)

    def close(self, wait: bool = True) -> None:
        """End the processes, unless a vector env took them over (``wait``: `fastrecord.packed.PackedLaunch.close`),
        and let go of the render device opened beside them (`fastrecord.render.device`; the mirrors hold it by now)."""
        from fastrecord.render.device import release_early

        release_early()
        self.launch.close(wait)


def _launch(cfg: RecordConfig, kwargs: dict[str, Any]) -> EarlySubenvs:
    """`record`'s sub-env processes of the batched render (``kwargs``: their ``gym.make`` keywords), started."""
    import gymnasium as gym

    from fastrecord.packed import PackedLaunch
    from fastrecord.render.device import device_of, open_early
    from fastrecord.workers import forkserver_context

    forkserver_context()  # here, not on the launch's thread: a server forked from this process needs it alone
    launch = PackedLaunch([_CpuEnvThunk(cfg.env_id, kwargs, report_poses=True)] * cfg.num_envs, cfg.envs_per_process,
                          context="forkserver", autoreset_mode=gym.vector.AutoresetMode.DISABLED, background=True)
    if on_cuda(kwargs["render_backend"]):  # the mirrors' render engine, opened while this process imports and before
        open_early(device_of(kwargs["render_backend"]))  # the sub-envs open theirs (`fastrecord.render.device`)
    return EarlySubenvs(launch, kwargs)


def make_recorded_env(cfg: RecordConfig, sinks: list[Any] | None = None, auto_reset: bool = True,
                      early: EarlySubenvs | None = None,
                      check_env: Callable[[Any], None] | None = None) -> Any:
    """The env stack `record` uses: one batched env (GPU sim or N=1) or a vector env of CPU envs.

    ``auto_reset=False`` (what `run_record` and `run_record_sharded` use: their loop,
    `fastrecord.shards.record_schedule`, resets each env with its episode's seed): the batched env's
    ``ManiSkillVectorEnv`` does not reset, the vector env has ``autoreset_mode=DISABLED``. ``early``: the
    `early_subenvs` of ``cfg``, its sub-env processes started before the imports (taken over where they fit, ended
    otherwise). ``check_env`` (a policy factory's, `check_policy`) sees the env before the recorder wraps it: its
    refusal writes nothing."""
    try:
        return _make_recorded_env(cfg, sinks, auto_reset, early, check_env)
    finally:
        if early is not None:
            early.close()  # where its guess was wrong or the env stack failed (a no-op where the env took it over)


def _start_helpers(cfg: RecordConfig) -> None:
    """What the recorder will wait for, started while the envs are made: codec "auto"'s NVENC probe, and the HDF5
    writer process (an interpreter importing h5py: `fastrecord.prestart`)."""
    if cfg.record.save_video or cfg.record.lerobot:
        from fastrecord.video.encode import prefetch_codec

        prefetch_codec(cfg.record.video_codec, cfg.record.lerobot_video_codec)
    if cfg.record.save_trajectory:
        from fastrecord.prestart import prestart_h5_writer

        prestart_h5_writer()


def _make_recorded_env(cfg: RecordConfig, sinks: list[Any] | None, auto_reset: bool, early: EarlySubenvs | None,
                       check_env: Callable[[Any], None] | None) -> Any:
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers the tasks
    from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

    from fastrecord.record import RecordEpisode
    from fastrecord.sinks.base import takes_render_frames

    kwargs = env_kwargs_for(cfg, resolve_render_backend(cfg.render_backend))
    if cfg.env_id not in gym.registry:
        raise ValueError(
            f"env_id={cfg.env_id!r} is not a registered ManiSkill task; e.g. PickCube-v1, PushCube-v1, StackCube-v1"
        )
    from fastrecord.envs import check_env_kwargs, make_checked

    check_env_kwargs(cfg.env_id, kwargs)  # a misspelt keyword or a bad reward mode: one line, before any env is made
    rec = recorder_kwargs(cfg)
    rec["sinks"] = list(sinks or [])  # --log: logger sinks (fastrecord.sinks.loggers)
    stamp("imported")  # benchmarks/bench_whole.py: interpreter and imports end here, env creation starts
    _start_helpers(cfg)
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

    envs = _cpu_vector_env(cfg, kwargs, auto_reset, early, takes_render_frames(cfg.record.video_source,
                                                                             cfg.record.save_video, sinks))
    try:
        if check_env is not None:
            check_env(envs)
        return RecordEpisode(envs, cfg.output_dir, **rec)
    except BaseException:
        envs.close()
        raise


def _cpu_vector_env(cfg: RecordConfig, kwargs: dict[str, Any], auto_reset: bool, early: EarlySubenvs | None,
                    frames: bool) -> Any:
    """`record`'s vector env of CPU envs: stepped in processes and drawn here in one batch (the batched render), each
    in a process of its own drawing itself (`fastrecord.reported`; ``frames``: its answers carry its frame), or all in
    this process (``SyncVectorEnv``)."""
    import gymnasium as gym

    mode = gym.vector.AutoresetMode.NEXT_STEP if auto_reset else gym.vector.AutoresetMode.DISABLED
    envs: Any
    from fastrecord import render

    wanted = {"auto": None, "on": True, "off": False}[cfg.batched_render]
    if cfg.vector == "sync":  # the envs in this process (a policy reading the simulator): no sub-env processes
        wanted = False
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
        # the envs step in processes of their own (several envs a process); this process renders them all in one batch
        from fastrecord.packed import PackedVectorEnv
        from fastrecord.render.device import device_of
        from fastrecord.render.vector import group_rendered, make_mirror_factory
        from fastrecord.workers import forkserver_context

        fits = early is not None and early.env_kwargs == kwargs and mode == gym.vector.AutoresetMode.DISABLED
        launch = early.launch if early is not None and fits else None  # else a wrong guess: make_recorded_env ends it
        if launch is None:
            forkserver_context()
        envs = group_rendered(
            lambda: PackedVectorEnv(
                [_CpuEnvThunk(cfg.env_id, kwargs, report_poses=True)] * cfg.num_envs, cfg.envs_per_process,
                context="forkserver", autoreset_mode=mode, launch=launch),
            make_mirror_factory(cfg.env_id, kwargs),
            cfg.num_envs,
            device=device_of(kwargs["render_backend"]),
        )
        envs.terminate_subenvs = True  # they simulate and report poses, nothing else: no close to wait for
    elif cfg.vector == "async" or (cfg.vector == "auto" and _cpu_drawn(cfg, kwargs, frames)):
        # each env in a process of its own, drawing its own pictures, answering each step with its state and frame
        from fastrecord.reported import reported_vector_env

        envs = reported_vector_env(_CpuEnvThunk(cfg.env_id, kwargs), cfg.num_envs, frames, autoreset_mode=mode)
    else:
        envs = gym.vector.SyncVectorEnv([_CpuEnvThunk(cfg.env_id, kwargs)] * cfg.num_envs, autoreset_mode=mode)
    return envs


def _cpu_drawn(cfg: RecordConfig, kwargs: dict[str, Any], frames: bool) -> bool:
    """``--vector auto``'s choice of a process an env (`fastrecord.reported`) over one process for all: several CPU
    envs drawn by the CPU (lavapipe draws one process's pictures one after another: on the 2-core machine two
    PickCube envs at 128x128 stepped at 19-23 env-steps/s in one process, 29 in two), drawing something (frames or
    camera observations), without --render-substeps (its substep frames are drawn by envs in this process)."""
    camera_obs = (kwargs.get("obs_mode") or "state") not in ("state", "state_dict", "none")
    cpu = str(kwargs.get("render_backend")).split(":")[0] in ("cpu", "sapien_cpu")
    return cfg.num_envs > 1 and cpu and (frames or camera_obs) and not cfg.record.render_substeps


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
        from fastrecord.workers import claim_process

        claim_process()  # a process of the CLI's (a sub-env, or the CLI's own): imports frozen, the BRDF table
        env = CPUGymWrapper(make_checked(self.env_id, **self.kwargs))
        if self.report_poses:
            from fastrecord.render.vector import PoseReporter

            env = PoseReporter(env)
        return env


