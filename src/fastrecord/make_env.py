"""`make_eval_envs`: a drop-in for the diffusion-policy baseline's env factory, recording with fastrecord.

ManiSkill's baselines (``examples/baselines/diffusion_policy/diffusion_policy/make_env.py``) build
their evaluation envs with ``make_eval_envs``; this one has the same parameters, builds the same envs
(``reconfiguration_freq=1``, the caller's wrappers, a ``FrameStack`` of ``other_kwargs["obs_horizon"]``,
``ignore_terminations=True`` and ``record_metrics=True``) and returns the same kind of vector env, so
switching is one import:

    # from diffusion_policy.make_env import make_eval_envs
    from fastrecord import make_eval_envs

What changes is the recording. GPU simulation: fastrecord's `RecordEpisode` (one MP4 per env episode).
CPU simulation: the baseline records env 0 only (a ManiSkill ``RecordEpisode`` inside sub-env 0);
here one fastrecord recorder wraps the whole vector env from outside and keeps every env's videos.
``keep="success"`` keeps the videos of successful rollouts only.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium as gym
import numpy as np
from mani_skill.utils import common, gym_utils
from mani_skill.utils.wrappers import CPUGymWrapper

from fastrecord.envs import SubEnvAccess
from fastrecord.episode import KeepFilter
from fastrecord.record import RecordEpisode, RecordVectorEpisode

SOURCE_TYPE = "diffusion_policy"  # the baseline's labels, kept for tools that read them
SOURCE_DESC = "diffusion_policy evaluation rollout"


def make_eval_envs(
    env_id,  # untyped, as the baseline's (tests/test_make_eval_envs.py compares the hints)
    num_envs: int,
    sim_backend: str,
    env_kwargs: dict,
    other_kwargs: dict,
    video_dir: str | None = None,
    wrappers: list[gym.Wrapper] = [],  # noqa: B006 - the baseline's signature; never mutated
    *,
    keep: KeepFilter = "all",
    record_kwargs: dict[str, Any] | None = None,
    log: str | None = None,
    episodes: int | None = None,
    seed: int = 0,
    batched_render: bool | None = None,
    envs_per_process: int | None = None,
) -> gym.vector.VectorEnv:
    """Create vectorized environments for evaluation, recording every env's videos to ``video_dir``.

    Args (the baseline's):
        env_id: the environment id.
        num_envs: the number of parallel environments.
        sim_backend: "physx_cpu" builds a gymnasium vector env of CPU envs (Sync for one env, Async
            with the forkserver context otherwise); anything else one GPU-parallel ManiSkill env under
            ``ManiSkillVectorEnv``.
        env_kwargs: ``gym.make`` kwargs (``max_episode_steps`` included); pass
            ``render_mode="rgb_array"`` to record videos.
        other_kwargs: needs ``obs_horizon``, the number of stacked observations.
        video_dir: where the MP4s go; None records nothing.
        wrappers: wrappers applied to each env right after ``gym.make``.

    fastrecord's additions (keyword-only):
        keep: which episodes' videos are written: "all", "success" (successful at the end),
            "success_once", "failure", or a callable on the episode's final info.
        record_kwargs: further `fastrecord.RecordEpisode` arguments (e.g. ``video_layout="tiled"``,
            ``save_trajectory=True``, ``info_on_video=False``, ``sinks=[...]``).
        log: also log each kept episode (success, length, running success rate, a few videos) to
            "tensorboard" (``video_dir/tensorboard/NAME``) or "wandb" (a W&B run, ``video_dir/wandb``);
            None logs nothing. Only kept episodes are logged: ``keep="all"`` for the policy's success rate.
        episodes: a sharded evaluation (`fastrecord.shards`) of this many global episodes: episode g is
            reset with seed ``seed + g`` and recorded by rank ``g % world_size`` into
            ``video_dir/NAME.shards/rankNNNNN/``; the envs reset themselves with the rank's seeds (run
            this rank's share, ``len(shards.episodes_of(rank, world, episodes))``, rounded up to whole
            batches: the extra episodes are not recorded), and closing them joins the shards (rank 0: the
            videos linked into ``video_dir`` named by g, ``NAME.results.jsonl``, and ``video_dir/NAME.h5`` +
            ``NAME.json`` with ``save_trajectory=True``). Needed under torchrun,
            where the rank's device is also picked (``physx_cuda:LOCAL_RANK``, ``cuda:LOCAL_RANK``).
            None: the baseline's behaviour. ``sharding_of(envs)`` gives the rank's `ShardedResets`.
        seed: the base seed of a sharded evaluation.
        batched_render: CPU simulation only: render every env's video frame in one batched render in this
            process (`fastrecord.render`: the sub-envs step in their processes and send their poses; this
            process holds a mirror of each scene in one ``RenderSystemGroup``). None (default): when there
            is more than one env, a video_dir, a CUDA device and a GPU render backend; False: each sub-env
            renders itself (ManiSkill's way); True: required (a ValueError where it cannot run).
        envs_per_process: with the batched render, how many sub-envs each process simulates
            (`fastrecord.packed.PackedVectorEnv`). None (default): 2, with at least 4 processes and at most one a
            core (`fastrecord.packed.process_sizes`); 1: a process an env, as gymnasium's ``AsyncVectorEnv``.

    Returns:
        CPU: a ``gym.vector.VectorEnv`` with the baseline's observations (``[num_envs, obs_horizon,
        ...]`` numpy arrays) and gymnasium 0.29's same-step auto-reset, so ``info["final_info"]`` is
        an array of per-env final infos (each with ``"episode"`` metrics), as the baseline's
        ``evaluate`` reads it. GPU: a ``ManiSkillVectorEnv``, as the baseline.

    Long because: this docstring documents the baseline's arguments and fastrecord's (60 lines); the code is
    30 lines: the checks are `check_eval_env_arguments`', the branches `_cpu_eval_envs`' and `_gpu_eval_envs`'.
    """
    if sim_backend == "physx_cpu" and isinstance(num_envs, int) and num_envs > 1:
        from fastrecord.workers import start_forkserver

        # where `from fastrecord import make_eval_envs` did not start it already: its preload (torch, ManiSkill)
        # runs while this process builds gymnasium's dummy env (not a `SpacesProbe`: that one would wait for the
        # preload, then build the env, on the critical path; H200, 16 envs: env creation 11.7 s vs 11.5 s without)
        start_forkserver()
    from fastrecord import shards

    num_stack, batched = check_eval_env_arguments(
        env_id, num_envs, sim_backend, env_kwargs, other_kwargs, video_dir, wrappers, keep=keep,
        record_kwargs=record_kwargs, log=log, episodes=episodes, seed=seed, batched_render=batched_render,
        envs_per_process=envs_per_process)
    rec: dict[str, Any] = {**dict(output_dir=video_dir, save_trajectory=False, source_type=SOURCE_TYPE,
                                  source_desc=SOURCE_DESC, keep=keep), **(record_kwargs or {})}
    if log is not None:
        from fastrecord.sinks.loggers import make_logger

        rec["sinks"] = [*rec.get("sinks", ()), make_logger(log)]
    from fastrecord.options import RecordOptions

    if video_dir and (rec.get("save_video", RecordOptions.save_video) or rec.get("lerobot")):
        from fastrecord.video.encode import prefetch_codec

        # codec "auto"'s NVENC probe runs while the envs are made (their processes: the forkserver's)
        prefetch_codec(rec.get("video_codec", RecordOptions.video_codec), rec.get("lerobot_video_codec"))
    import mani_skill.envs  # noqa: F401 - registers the tasks

    sharding = None
    if episodes is not None:
        sim_backend, env_kwargs, rec, sharding = _sharded(env_id, num_envs, sim_backend, env_kwargs, str(video_dir),
                                                          rec, episodes, seed, shards.rank_info())
    if sim_backend == "physx_cpu":
        return _cpu_eval_envs(env_id, num_envs, env_kwargs, list(wrappers), num_stack, rec if video_dir else None,
                              batched, sharding, envs_per_process)
    return _gpu_eval_envs(env_id, num_envs, sim_backend, env_kwargs, list(wrappers), num_stack,
                          rec if video_dir else None, sharding)


def _sharded(env_id: str, num_envs: int, sim_backend: str, env_kwargs: dict, video_dir: str, rec: dict[str, Any],
             episodes: int, seed: int, info: Any) -> tuple[str, dict, dict[str, Any], Any]:
    """A sharded evaluation's backends (the rank's devices), recorder arguments (the rank's shard folder) and
    `fastrecord.shards.ShardedResets`; opens the run's folder."""
    from fastrecord import shards

    given = env_kwargs.get("render_backend", "auto")
    sim_backend, render = shards.rank_backends(sim_backend, given, info)
    if render != given:  # the rank's GPU renders
        env_kwargs = {**env_kwargs, "render_backend": render}
    run = shards.DistributedRun(video_dir, rec.get("trajectory_name"), total=episodes, base_seed=seed,
                                if_exists=rec.get("if_exists", "error"),
                                options=dict(command="make_eval_envs", env_id=env_id, num_envs=num_envs,
                                             sim_backend=sim_backend, env_kwargs=repr(env_kwargs))).open()
    rec = {**rec, "output_dir": str(run.shard_dir), "trajectory_name": run.name, "if_exists": run.shard_if_exists,
           "video_workers": rec.get("video_workers") or shards.default_workers(info)}
    return sim_backend, env_kwargs, rec, shards.ShardedResets(run, num_envs)


def _cpu_eval_envs(env_id: str, num_envs: int, env_kwargs: dict, wrappers: list, num_stack: int,
                   rec: dict[str, Any] | None, batched: bool, sharding: Any,
                   envs_per_process: int | None = None) -> gym.vector.VectorEnv:
    """The baseline's CPU branch: a gymnasium vector env of CPU envs (one batched render of their videos with
    ``batched``), fastrecord's recorder over it (``rec``: its arguments; None records nothing), frame stacking
    and same-step auto-reset above (`EvalVectorEnv`)."""
    envs: gym.vector.VectorEnv
    if batched:
        from fastrecord.render.device import device_of
        from fastrecord.render.vector import group_rendered, make_mirror_factory

        envs = group_rendered(lambda: _cpu_vector_env(env_id, num_envs, env_kwargs, wrappers, report_poses=True,
                                                      envs_per_process=envs_per_process),
                              make_mirror_factory(env_id, env_kwargs), num_envs,
                              device=device_of(env_kwargs.get("render_backend")))
    else:
        envs = _cpu_vector_env(env_id, num_envs, env_kwargs, wrappers)
    if rec is not None:  # what RecordEpisode makes of a vector env
        envs = RecordVectorEpisode(envs, **{"info_on_video": True, **rec})
    if sharding is not None:
        assert isinstance(envs, RecordVectorEpisode)  # a sharded evaluation records (check_eval_env_arguments)
        sharding.attach(envs.recorder)
    return EvalVectorEnv(envs, num_stack, sharding=sharding)


def _gpu_eval_envs(env_id: str, num_envs: int, sim_backend: str, env_kwargs: dict, wrappers: list, num_stack: int,
                   rec: dict[str, Any] | None, sharding: Any) -> gym.vector.VectorEnv:
    """The baseline's GPU branch: one GPU-parallel ManiSkill env, fastrecord's `RecordEpisode` below
    ``FrameStack`` (it records the env's own observations), under ``ManiSkillVectorEnv``."""
    from mani_skill.utils.wrappers import FrameStack
    from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

    env = gym.make(env_id, num_envs=num_envs, sim_backend=sim_backend, reconfiguration_freq=1, **env_kwargs)
    max_episode_steps = gym_utils.find_max_episode_steps_value(env)
    for wrapper in wrappers:
        env = wrapper(env)
    if rec is not None:
        env = RecordEpisode(env, **{"save_video": True, "max_steps_per_video": max_episode_steps, **rec})
    if sharding is not None:
        assert isinstance(env, RecordEpisode)  # a sharded evaluation records (check_eval_env_arguments)
        sharding.attach(env.recorder)
        env = _ScheduledResets(env, sharding)
    env = FrameStack(env, num_stack=num_stack)
    return ManiSkillVectorEnv(env, ignore_terminations=True, record_metrics=True)


# ---------------------------------------------------------------------------------------------- checks
def check_eval_env_arguments(env_id: Any, num_envs: Any, sim_backend: Any, env_kwargs: Any, other_kwargs: Any,
                             video_dir: Any, wrappers: Any, *, keep: Any, record_kwargs: Any, log: Any,
                             episodes: Any, seed: Any, batched_render: Any = None,
                             envs_per_process: Any = None) -> tuple[int, bool]:
    """Every check of `make_eval_envs`' arguments, in one place, before any env, process or file is made:
    values that would fail later (an IndexError, a KeyError deep in ManiSkill, an error after the envs are
    made) and combinations that cannot work raise a one-line ValueError naming the value and the fix.
    Returns the number of stacked observations and whether the videos are rendered in one batch."""
    _check_env_arguments(env_id, num_envs, sim_backend, env_kwargs, other_kwargs, wrappers)
    _check_record_arguments(video_dir, keep=keep, record_kwargs=record_kwargs, log=log, episodes=episodes, seed=seed)
    from fastrecord import shards
    from fastrecord.render import use_batched

    info = shards.rank_info()
    if episodes is None and info.distributed and video_dir:
        raise ValueError(f"make_eval_envs under torchrun (rank {info.rank} of {info.world_size}) needs episodes=N, the "
                         f"number of evaluation episodes of all ranks together: each rank then runs its share with "
                         f"seeds seed + g and records into its own shard of video_dir")
    if episodes is not None and not video_dir:
        raise ValueError(f"episodes={episodes!r} makes a sharded, recorded evaluation, which needs video_dir; pass "
                         f"video_dir='eval_videos', or episodes=None")
    if log is not None and not video_dir:
        raise ValueError(f"log={log!r} logs through the recorder, which records only with a video_dir (the logs go "
                         f"there too); pass video_dir='eval_videos', or log=None")
    if batched_render not in (None, True, False):
        raise ValueError(f"batched_render={batched_render!r} must be None (batched where it can run), True or False")
    if envs_per_process is not None:
        from fastrecord.packed import process_sizes

        process_sizes(num_envs, envs_per_process)  # its ValueError names the value
    batched = sim_backend == "physx_cpu" and use_batched(
        batched_render, num_envs=num_envs, render_backend=env_kwargs.get("render_backend", "auto"),
        render_mode=env_kwargs.get("render_mode"), videos=bool(video_dir),
        substeps=bool((record_kwargs or {}).get("render_substeps")), flag="batched_render=True",
        instead="batched_render=None (batched where it can run) or False, or render_backend='gpu' on a CUDA machine")
    return int(other_kwargs["obs_horizon"]), batched


def _check_env_arguments(env_id: Any, num_envs: Any, sim_backend: Any, env_kwargs: Any, other_kwargs: Any,
                         wrappers: Any) -> None:
    """The baseline's env arguments: a registered task, a count, a known backend, dicts, wrapper classes."""
    import difflib
    import numbers

    import mani_skill.envs  # noqa: F401 - registers the tasks
    from mani_skill.envs.utils.system.backend import sim_backend_name_mapping

    if isinstance(num_envs, bool) or not isinstance(num_envs, numbers.Integral) or num_envs < 1:
        raise ValueError(
            f"num_envs={num_envs!r} must be an integer >= 1 (the number of parallel envs), e.g. num_envs=8"
        )
    if not isinstance(env_id, str) or env_id not in gym.registry:
        close = difflib.get_close_matches(str(env_id), list(gym.registry), n=3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise ValueError(f"env_id={env_id!r} is not a registered environment; {hint}pass a ManiSkill task id such as "
                         f"'PickCube-v1' (gymnasium.registry lists them)")
    backends = ("auto", *sim_backend_name_mapping)  # "auto": ManiSkill's default, resolved by gym.make
    base = sim_backend.split(":")[0] if isinstance(sim_backend, str) else None
    if base not in backends:
        raise ValueError(
            f"sim_backend={sim_backend!r} is unknown; use one of {', '.join(backends)} (the CUDA ones also "
            f"as cuda:N), e.g. sim_backend='physx_cpu'"
        )
    if sim_backend_name_mapping.get(base) == "physx_cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError(f"sim_backend={sim_backend!r} needs a CUDA device and this machine has none (torch sees "
                             f"no CUDA); use sim_backend='physx_cpu'")
    for name, value in (("env_kwargs", env_kwargs), ("other_kwargs", other_kwargs)):
        if not isinstance(value, Mapping):
            raise ValueError(f"{name}={value!r} must be a dict of keyword arguments, e.g. {name}=dict()")
    if "obs_horizon" not in other_kwargs:
        raise ValueError(f"other_kwargs={other_kwargs!r} lacks 'obs_horizon', the number of observations stacked; "
                         f"pass e.g. other_kwargs=dict(obs_horizon=2)")
    horizon = other_kwargs["obs_horizon"]
    if isinstance(horizon, bool) or not isinstance(horizon, numbers.Integral) or horizon < 1:
        raise ValueError(f"other_kwargs['obs_horizon']={horizon!r} must be an integer >= 1 (the number of "
                         f"observations stacked), e.g. other_kwargs=dict(obs_horizon=2)")
    if wrappers is None or isinstance(wrappers, (str, bytes)) or not all(callable(w) for w in wrappers):
        raise ValueError(f"wrappers={wrappers!r} must be a list of wrapper classes (callables env -> env), e.g. [] ")


def _check_record_arguments(video_dir: Any, *, keep: Any, record_kwargs: Any, log: Any, episodes: Any,
                            seed: Any) -> None:
    """fastrecord's arguments: a folder, the recorder's options (its own checks), a logger, a sharded run's."""
    import numbers
    import os

    if video_dir:  # None or "": nothing recorded, as make_eval_envs reads it
        if not isinstance(video_dir, (str, os.PathLike)):
            raise ValueError(f"video_dir={video_dir!r} must be a folder path (str or Path), or None to record nothing")
        if os.path.exists(video_dir) and not os.path.isdir(video_dir):
            raise ValueError(f"video_dir={str(video_dir)!r} is a file, not a folder; pass a folder path, or None")
    if record_kwargs is not None and not isinstance(record_kwargs, Mapping):
        raise ValueError(
            f"record_kwargs={record_kwargs!r} must be a dict of fastrecord.RecordEpisode arguments, or None"
        )
    if log is not None:
        from fastrecord.sinks.loggers import LOGGERS

        if log not in LOGGERS:
            raise ValueError(
                f"log={log!r} is not a logger; use one of {', '.join(map(repr, LOGGERS))}, or None to log nothing"
            )
    if episodes is not None and (
        isinstance(episodes, bool) or not isinstance(episodes, numbers.Integral) or episodes < 1
    ):
        raise ValueError(
            f"episodes={episodes!r} must be an integer >= 1 (the evaluation episodes of all ranks), or None"
        )
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed={seed!r} must be an integer, e.g. seed=0")
    from fastrecord.options import RecordOptions

    options = {k: v for k, v in (record_kwargs or {}).items() if k not in ("output_dir", "sinks")}
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(RecordOptions)})
    if unknown:
        raise ValueError(f"record_kwargs has unknown keys {unknown}; use fastrecord.RecordEpisode's options "
                         f"({', '.join(f.name for f in dataclasses.fields(RecordOptions))}) or sinks")
    RecordOptions(**{"keep": keep, **options})  # raises the wrappers' ValueError for a bad value


# ---------------------------------------------------------------------------------------------- CPU
def _cpu_vector_env(env_id: str, num_envs: int, env_kwargs: dict, wrappers: list, report_poses: bool = False,
                    envs_per_process: int | None = None) -> gym.vector.VectorEnv:
    """More than one env: sub-env processes, one an env (gymnasium's ``AsyncVectorEnv``), or with ``report_poses``
    (the batched render's sub-envs) several a process (`fastrecord.packed.PackedVectorEnv`: ``envs_per_process``)."""
    thunks = [_CpuThunk(env_id, seed, env_kwargs, wrappers, own_process=num_envs > 1, report_poses=report_poses)
              for seed in range(num_envs)]
    mode = gym.vector.AutoresetMode.DISABLED  # EvalVectorEnv resets finished envs itself, after the recorder saw them
    if num_envs == 1:
        return gym.vector.SyncVectorEnv(thunks, autoreset_mode=mode)
    from fastrecord.render.vector import scenes_built
    from fastrecord.workers import forkserver_context

    forkserver_context()  # the sub-envs start with ManiSkill imported (fastrecord.workers.FORKSERVER_PRELOAD)
    if report_poses:  # they render nothing: their processes' GPU render devices are what 16 processes wait for
        from fastrecord.packed import PackedVectorEnv

        return PackedVectorEnv(thunks, envs_per_process, context="forkserver", autoreset_mode=mode)
    with scenes_built():  # gymnasium builds and closes a dummy env here: ManiSkill's collections skip our heap
        return gym.vector.AsyncVectorEnv(thunks, context="forkserver", autoreset_mode=mode)


cpu_vector_env = _cpu_vector_env  # public: make_eval_envs' CPU vector env alone (benchmarks/paths.py times it)


class _CpuThunk:
    """Builds one CPU sub-env (picklable for the forkserver workers)."""

    def __init__(self, env_id: str, seed: int, env_kwargs: dict, wrappers: list, own_process: bool = False,
                 report_poses: bool = False) -> None:
        self.env_id, self.seed, self.env_kwargs, self.wrappers = env_id, seed, dict(env_kwargs), wrappers
        self.own_process = own_process  # built in a sub-env process of fastrecord's, not in the caller's
        self.made_in = os.getpid()  # gymnasium's AsyncVectorEnv also calls the first thunk here (its dummy env)
        self.report_poses = report_poses  # batched rendering: each step's info carries the scene's poses

    def __call__(self) -> gym.Env:
        import mani_skill.envs  # noqa: F401 - registers the tasks (worker processes too)

        from fastrecord.system import use_lavapipe_if_no_gpu
        from fastrecord.workers import claim_process

        use_lavapipe_if_no_gpu()
        if self.own_process and os.getpid() != self.made_in:  # a sub-env's process, never the caller's
            claim_process()  # each of its resets reconfigures the scene (and collects garbage)
        env = gym.make(self.env_id, reconfiguration_freq=1, **self.env_kwargs)
        for wrapper in self.wrappers:
            env = wrapper(env)
        env = _CPUGymWrapper(env, ignore_terminations=True, record_metrics=True)
        env.action_space.seed(self.seed)
        env.observation_space.seed(self.seed)
        if self.report_poses:
            from fastrecord.render.vector import PoseReporter

            env = PoseReporter(env)
        return env


class _CPUGymWrapper(CPUGymWrapper):
    """ManiSkill's ``CPUGymWrapper`` that also answers ``max_episode_steps`` and ``get_state_dict``.

    fastrecord's vector-env recorder asks the sub-envs for it through ``get_attr``, and an
    ``AsyncVectorEnv`` worker asked for an attribute it lacks shuts down.
    """

    @property
    def max_episode_steps(self) -> int | None:
        return gym_utils.find_max_episode_steps_value(self.env)

    def get_state_dict(self) -> dict[str, Any]:
        """The env state as numpy arrays (for ``save_trajectory=True``): torch tensors leave an
        AsyncVectorEnv worker through torch's shared-memory hand-off, a socket round trip per tensor."""
        return common.to_numpy(self.base_env.get_state_dict())


class _ScheduledResets(gym.Wrapper):
    """Resets of a batched ManiSkill env with a sharded evaluation's seeds (`fastrecord.shards.ShardedResets`):
    every (auto-)reset of env slots gives them their next global episodes' seeds, then tags the recorder;
    ``close`` ends the rank's part (the shards are joined on rank 0)."""

    def __init__(self, env: gym.Env, sharding: Any) -> None:
        super().__init__(env)
        self.sharding = sharding

    def reset(self, *, seed: Any = None, options: dict[str, Any] | None = None) -> tuple[Any, dict[str, Any]]:
        import torch

        n = self.sharding.num_envs
        idx = (options or {}).get("env_idx")
        slots = np.arange(n) if idx is None else np.asarray(torch.as_tensor(idx).cpu(), dtype=np.int64).reshape(-1)
        seeds, metas = self.sharding.seeds(slots)
        obs, info = self.env.reset(seed=seeds if n > 1 else seeds[0], options=options)
        self.sharding.started(slots, metas)
        return obs, info

    def close(self) -> None:
        self.sharding.before_close()
        failed = True
        try:
            self.env.close()
            failed = False
        finally:
            self.sharding.after_close(failed=failed)


def sharding_of(envs: Any) -> Any:
    """The `fastrecord.shards.ShardedResets` of ``make_eval_envs(..., episodes=N)``'s envs (None if not sharded):
    after ``close()``, rank 0's ``rows`` (every rank's results) and ``report`` (the merge)."""
    cur = envs
    while cur is not None:
        if getattr(cur, "sharding", None) is not None:
            return cur.sharding
        cur = getattr(cur, "_env", None) or getattr(cur, "env", None)
    return None


def _tree_map(fn: Callable, *trees: Any) -> Any:
    if isinstance(trees[0], Mapping):
        return {k: _tree_map(fn, *(t[k] for t in trees)) for k in trees[0]}
    return fn(*trees)


def _env_info(info: Mapping[str, Any], i: int) -> dict[str, Any]:
    """Env ``i``'s own info out of a gymnasium vector info (arrays with ``_key`` masks)."""
    out: dict[str, Any] = {}
    for k, v in info.items():
        if k.startswith("_"):
            continue
        mask = info.get("_" + k)
        if mask is not None and not mask[i]:
            continue
        out[k] = _env_info(v, i) if isinstance(v, Mapping) else v[i]
    return out


def _stack_space(space: gym.Space, num_stack: int) -> gym.Space:
    if isinstance(space, gym.spaces.Dict):
        return gym.spaces.Dict({k: _stack_space(s, num_stack) for k, s in space.spaces.items()})
    if isinstance(space, gym.spaces.Box):
        low = np.repeat(space.low[None], num_stack, axis=0)
        high = np.repeat(space.high[None], num_stack, axis=0)
        return gym.spaces.Box(low, high, dtype=space.dtype)
    raise TypeError(f"cannot stack observations of space {space}; ManiSkill observations are Box or Dict spaces")


class EvalVectorEnv(SubEnvAccess, gym.vector.VectorWrapper):
    """Frame stacking and same-step auto-reset over a vector env of CPU envs (autoreset disabled).

    Owns: the stacked observations ``[num_envs, num_stack, ...]`` of every env.

    Stacks as ManiSkill's ``FrameStack`` does in each sub-env (after a reset every slot holds the
    reset observation), but above the recorder, which therefore records the envs' own observations.
    When envs finish (terminated or truncated), it resets them in the same step, after the recorder has
    captured their last frame, and returns what gymnasium 0.29's vector envs returned: the reset
    observations, with ``info["final_observation"]`` and ``info["final_info"]`` (object arrays, None for
    envs that go on; masks ``_final_observation``/``_final_info``). ``info`` itself is the step's.
    """

    def __init__(self, env: gym.vector.VectorEnv, num_stack: int, sharding: Any = None) -> None:
        super().__init__(env)
        self.num_stack = num_stack
        self.sharding = sharding  # a sharded evaluation: resets take the rank's seeds (fastrecord.shards)
        self.single_observation_space = _stack_space(env.single_observation_space, num_stack)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, env.num_envs)
        self._frames: Any = None

    def _fill(self, obs: Any, mask: np.ndarray | None) -> None:
        def fill(frames: np.ndarray | None, o: Any) -> np.ndarray:
            o = np.asarray(o)
            if frames is None or mask is None:
                return np.repeat(o[:, None], self.num_stack, axis=1)
            frames[mask] = o[mask][:, None]
            return frames

        if self._frames is None or mask is None:
            self._frames = _tree_map(lambda o: fill(None, o), obs)
        else:
            self._frames = _tree_map(fill, self._frames, obs)

    def _push(self, obs: Any) -> None:
        def push(frames: np.ndarray, o: Any) -> np.ndarray:
            frames[:, :-1] = frames[:, 1:]
            frames[:, -1] = np.asarray(o)
            return frames

        self._frames = _tree_map(push, self._frames, obs)

    def _stacked(self) -> Any:
        return _tree_map(np.copy, self._frames)

    def reset(self, *, seed: int | list[int] | None = None, options: dict[str, Any] | None = None
              ) -> tuple[Any, dict[str, Any]]:
        mask = (
            None if not options or options.get("reset_mask") is None else np.asarray(options["reset_mask"], dtype=bool)
        )
        obs, info = self._reset(seed, None if options is None else dict(options), mask)
        self._fill(obs, None if mask is None or mask.all() else mask)
        return self._stacked(), info

    def _reset(self, seed: Any, options: dict[str, Any] | None, mask: np.ndarray | None) -> tuple[Any, dict[str, Any]]:
        if self.sharding is None:
            return self.env.reset(seed=seed, options=options)
        slots = np.arange(self.num_envs) if mask is None else np.flatnonzero(mask)
        seeds, metas = self.sharding.seeds(slots)
        out = self.env.reset(seed=seeds, options=options)
        self.sharding.started(slots, metas)
        return out

    def close(self, **kwargs: Any) -> None:
        if self.sharding is None:
            return self.env.close(**kwargs)
        self.sharding.before_close()
        failed = True
        try:
            self.env.close(**kwargs)
            failed = False
        finally:
            self.sharding.after_close(failed=failed)

    def step(self, actions: Any) -> tuple[Any, np.ndarray, np.ndarray, np.ndarray, dict[str, Any]]:
        obs, rew, terminated, truncated, info = self.env.step(actions)
        self._push(obs)
        done = np.logical_or(np.asarray(terminated), np.asarray(truncated))
        if done.any():
            final_obs = self._stacked()
            info = dict(info)
            finals_obs = np.full(self.num_envs, None, dtype=object)
            finals_info = np.full(self.num_envs, None, dtype=object)
            for i in map(int, np.flatnonzero(done)):
                finals_obs[i] = _tree_map(lambda x, i=i: x[i], final_obs)
                finals_info[i] = _env_info(info, i)
            reset_obs, _ = self._reset(None, {"reset_mask": done.copy()}, done.copy())
            self._fill(reset_obs, done)
            info.update(final_observation=finals_obs, _final_observation=done.copy(),
                        final_info=finals_info, _final_info=done.copy())
        return self._stacked(), rew, terminated, truncated, info

