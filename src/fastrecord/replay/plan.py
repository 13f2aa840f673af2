"""A replay's plan: what it decided from its options and its input before making any env or file.

`make_plan` checks the input file and the options (a ValueError naming the fix) and decides the env's
``gym.make`` kwargs, the output's folder and name, and the layout (envs, vector kind, worker processes).
The caller and every worker process make the same plan from the same `ReplayConfig`.

Imports neither torch nor ManiSkill until a plan is made: `fastrecord.replay.early` decides the env's kwargs with
`decide_env` before the CLI's own imports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastrecord.options import usable_cores
from fastrecord.replay.config import CONVERTERS, CPU_BACKENDS, ReplayConfig
from fastrecord.replay.layout import ENVS_PER_WORKER, GPU_DEFAULT_ENVS, default_workers
from fastrecord.sinks.base import takes_render_frames
from fastrecord.sinks.maniskill_h5 import EpisodeProblem, TrajectoryFile, check_episode


def _cuda() -> bool:
    from fastrecord.system import torch_sees_cuda

    return torch_sees_cuda()


def _resolve_backend(cfg: ReplayConfig, recorded: str | None, cuda: bool) -> str:
    if cfg.sim_backend != "auto":
        return cfg.sim_backend
    if recorded is None or recorded in CPU_BACKENDS or recorded == "auto":
        return "physx_cpu"
    return recorded if cuda else "physx_cpu"


def _camera_configs(cfg: ReplayConfig, kwargs: dict[str, Any]) -> None:
    """Apply --width/--height/--shader to the camera the videos come from."""
    settings = {
        k: v for k, v in (("width", cfg.width), ("height", cfg.height), ("shader_pack", cfg.shader)) if v is not None
    }
    if not settings:
        return
    if cfg.video_source == "render":
        kwargs["human_render_camera_configs"] = {**(kwargs.get("human_render_camera_configs") or {}), **settings}
    else:
        cam = cfg.video_source.split(":", 1)[1]
        sensors = dict(kwargs.get("sensor_configs") or {})
        sensors[cam] = {**(sensors.get(cam) or {}), **settings}
        kwargs["sensor_configs"] = sensors


class Verdict:
    """A keep filter whose answer the replay loop sets just before it ends a replay (ManiSkill's rule
    needs the replay's success and truncation, decided outside the recorder)."""

    value = False

    def __call__(self, final_info: Any) -> bool:
        return self.value


@dataclass
class ReplayPlan:
    """What a replay decided before making any env or file: the same in the caller and in every worker."""

    cfg: ReplayConfig
    traj: TrajectoryFile
    episodes: list[dict[str, Any]]  # the input episodes to replay (the first --count)
    env_id: str
    kwargs: dict[str, Any]  # gym.make kwargs of the replay env
    ori_kwargs: dict[str, Any]  # the env the actions were recorded in (conversion: ManiSkill's ori_env)
    max_steps: int | None
    sim_backend: str
    gpu_sim: bool
    source_mode: str | None  # the recorded control mode
    convert: bool  # -c to another control mode
    out: Path  # output directory
    name: str  # output trajectory name
    num_envs: int  # episodes side by side, over all workers
    vector: str  # sync | async | batched
    workers: int  # processes replaying a share each (1: this one)
    distributed: bool = False  # a torchrun rank: the ranks are the workers (fastrecord.shards)
    render_device: str | None = (
        None  # CUDA device each worker's envs are drawn on in one batch (None: each env draws itself)
    )
    frames: bool = False  # the recorder takes the render camera's frames (`takes_render_frames`): the envs draw them

    @property
    def if_exists(self) -> str:
        if self.cfg.resume:
            return "resume"
        return "overwrite" if (self.cfg.overwrite or self.cfg.maniskill) else "error"

    def recorder_kwargs(self, out: Path, name: str, verdict: Verdict, sinks: list[Any] | None,
                        resume: bool = False) -> Callable[[int], dict[str, Any]]:
        """``control_freq -> RecordEpisode kwargs`` of one recorder writing ``out/name`` (``resume``: add to
        what an earlier replay of that name left)."""
        cfg = self.cfg
        if_exists = "resume" if resume else self.if_exists
        how = (f"converted from {self.source_mode} to {cfg.target_control_mode}" if self.convert
               else f"by {'env states' if cfg.replay_by == 'states' else 'actions'}")

        def rec_kwargs(control_freq: int) -> dict[str, Any]:
            options = cfg.recorder_kwargs(name, int(control_freq), verdict, if_exists,
                                          f"fastrecord replay of {self.traj.h5_path.name} {how}")
            # --log: logger sinks (fastrecord.sinks.loggers); one recorder per replay
            if (
                self.workers > 1 and options["trajectory_writers"] is None
            ):  # the workers share the cores: one writer each
                options["trajectory_writers"] = 1
            return dict(output_dir=str(out), **options, sinks=list(sinks or []))

        return rec_kwargs


def make_plan(cfg: ReplayConfig, traj: TrajectoryFile, checked: bool = False,
              sinks: list[Any] | None = None) -> ReplayPlan:
    """Check the input and the options and decide the env, the output and the layout; raises ValueError.
    ``checked``: the caller has checked the episodes' data (`check_input`) already: a worker's plan, which would
    read every episode's states and actions again (~3 ms an episode on the 2-core machine) before its envs.
    ``sinks``: the recorder's extra sinks (`run_replay`'s): a logger's videos are frames the envs draw."""
    import mani_skill.envs  # noqa: F401 - registers the tasks

    episodes, modes = _episodes(cfg, traj, checked)
    env = _env(cfg, traj.env_info, episodes, modes)
    out, name = _output(cfg, traj, env)
    frames = takes_render_frames(cfg.video_source, cfg.save_video, sinks)
    layout = _layout(cfg, env, len(episodes), out, name, frames)
    plan = ReplayPlan(cfg, traj, episodes, traj.env_info["env_id"], env.kwargs, env.ori_kwargs, env.max_steps,
                      env.sim_backend, env.gpu_sim, env.source_mode, env.convert, out, name, layout.num_envs,
                      layout.vector, layout.workers, layout.distributed, layout.render_device, frames)
    plan.recorder_kwargs(out, name, Verdict(), None)(20)  # the recorder's options, checked: before any env or file
    return plan


def _episodes(cfg: ReplayConfig, traj: TrajectoryFile, checked: bool = False) -> tuple[list[dict[str, Any]], list[str]]:
    """The episodes to replay (the first ``count``), checked, and the control modes they were recorded in."""
    import gymnasium as gym

    env_id = traj.env_info["env_id"]
    if env_id not in gym.registry:
        raise ValueError(
            f"{traj.json_path.name} was recorded in {env_id!r}, which is not a registered ManiSkill task here; "
            f"import the module that registers it, or check the ManiSkill version"
        )
    episodes = traj.episodes[: cfg.count]
    if not episodes:
        raise ValueError(f"{str(traj.json_path)!r} lists no episodes: nothing to replay")
    modes = sorted({mode for ep in episodes if (mode := ep.get("control_mode"))})
    if len(modes) > 1:
        raise ValueError(
            f"{traj.json_path.name} mixes control modes {modes}; replay them separately (--count, or split the file)"
        )
    if cfg.replay_by == "states" or cfg.use_first_env_state:
        lacking = [ep["episode_id"] for ep in episodes if "env_states" not in traj.group(ep)]
        if lacking:
            raise ValueError(
                f"{str(traj.h5_path)!r} holds no env_states for episodes {lacking[:5]}; "
                "replay it by actions (--by actions)"
            )
    if not checked:
        check_input(traj, episodes)
    return episodes, modes


@dataclass(frozen=True)
class _Env:
    """The replay env a plan decided (`_env`)."""

    kwargs: dict[str, Any]  # gym.make kwargs of the replay env
    ori_kwargs: dict[str, Any]  # the env the actions were recorded in
    max_steps: int | None
    sim_backend: str
    gpu_sim: bool
    source_mode: str | None
    convert: bool


def _env(cfg: ReplayConfig, env_info: dict[str, Any], episodes: list[dict[str, Any]], modes: list[str]) -> _Env:
    """`decide_env` on this machine (CUDA as torch sees it), its keywords checked against the task's."""
    from fastrecord.envs import check_env_kwargs

    env_id = env_info["env_id"]
    check_env_kwargs(env_id, cfg.env_kwargs)  # a misspelt keyword: one line, before any env is made
    env = decide_env(cfg, env_info, episodes, modes, cuda=_cuda())
    check_env_kwargs(env_id, {"reward_mode": env.kwargs.get("reward_mode")})  # one of the task's reward modes
    return env


def decide_env(cfg: ReplayConfig, env_info: dict[str, Any], episodes: list[dict[str, Any]], modes: list[str],
               cuda: bool) -> _Env:
    """The env's ``gym.make`` kwargs: the recorded ones (``env_info``, the input JSON's), then the replay's choices,
    then ``env_kwargs``; ``cuda``: whether this machine has a CUDA device. Imports nothing heavy (the CLI's early
    sub-envs, `fastrecord.replay.early`, decide with it before torch is imported); raises ValueError for a choice
    that cannot run."""
    info = env_info
    kwargs = {k: v for k, v in (info.get("env_kwargs") or {}).items() if k not in ("num_envs", "max_episode_steps")}
    sim_backend = _resolve_backend(cfg, kwargs.pop("sim_backend", None), cuda)
    gpu_sim = sim_backend not in CPU_BACKENDS
    if gpu_sim and not cuda:
        raise ValueError(
            f"sim_backend={sim_backend!r} needs a CUDA GPU, and there is none; use --sim-backend physx_cpu"
        )
    kwargs["sim_backend"] = sim_backend
    kwargs["render_backend"] = cfg.render_backend if cfg.render_backend != "auto" else ("gpu" if cuda else "cpu")
    if modes and "control_mode" not in kwargs:
        kwargs["control_mode"] = modes[0]
    source_mode = kwargs.get("control_mode")
    convert = cfg.target_control_mode is not None and cfg.target_control_mode != source_mode
    if convert:
        _check_conversion(cfg, source_mode, cfg.replay_by, gpu_sim)
    ori_kwargs = dict(kwargs)
    if cfg.target_control_mode is not None:
        kwargs["control_mode"] = cfg.target_control_mode
    if cfg.obs_mode is not None:
        kwargs["obs_mode"] = cfg.obs_mode
    if cfg.reward_mode is not None:
        kwargs["reward_mode"] = cfg.reward_mode
    kwargs["render_mode"] = cfg.render_mode
    if cfg.maniskill and cfg.shader is not None:
        kwargs["shader_dir"] = cfg.shader  # ManiSkill's --shader: every camera
    else:
        _camera_configs(cfg, kwargs)
    kwargs.update(cfg.env_kwargs)
    if (
        cfg.video_source.startswith("sensor:")
        and cfg.save_video
        and kwargs.get("obs_mode", "state") in ("state", "state_dict", "none")
    ):
        raise ValueError(f"video_source={cfg.video_source!r} takes frames from the observation's camera images; "
                         f"add --obs-mode rgb (or rgbd), or use --video-source render")
    longest = max(int(ep["elapsed_steps"]) for ep in episodes)
    max_steps = max(int(info.get("max_episode_steps") or 0), longest) or None
    return _Env(kwargs, ori_kwargs, max_steps, sim_backend, gpu_sim, source_mode, convert)


def _output(cfg: ReplayConfig, traj: TrajectoryFile, env: _Env) -> tuple[Path, str]:
    """Where the replay goes: ``output_dir`` and ManiSkill's name ``<stem>.<obs_mode>.<control_mode>.<sim_backend>``
    (or ``trajectory_name``), never over the input."""
    obs_mode = env.kwargs.get("obs_mode") or "state"
    stem = traj.h5_path.stem.split(".")[0]
    name = cfg.trajectory_name or f"{stem}.{obs_mode}.{env.kwargs.get('control_mode', 'default')}.{env.sim_backend}"
    if cfg.output_dir is not None:
        out = Path(cfg.output_dir)
    else:  # ManiSkill's tool writes next to its input
        out = traj.h5_path.parent if cfg.maniskill else traj.h5_path.parent / "replay"
    new_h5 = out / f"{name}.h5"
    if new_h5.exists() and new_h5.resolve() == traj.h5_path.resolve():
        raise ValueError(
            f"the replay would write over its input {str(traj.h5_path)!r}; pass another --output-dir or "
            "--trajectory-name"
        )
    return out, name


@dataclass(frozen=True)
class _Layout:
    """Where the envs run (`_layout`)."""

    num_envs: int
    vector: str
    workers: int
    distributed: bool
    render_device: str | None


def _default_workers(cfg: ReplayConfig, episodes: int, gpu_sim: bool, gpu_render: bool, out: Path, name: str) -> int:
    """`fastrecord.replay.layout.default_workers`, except where one layout is the one that fits: ManiSkill's command
    lines without ``-n`` replay in one env, as its tool does; and a replay that continues an earlier one of this
    name (``--resume``, or an unfinished sharded replay) takes that one's layout: one process, or the shards'
    (at least two workers), whatever this machine's default."""
    from fastrecord.sinks.base import MANIFEST_SUFFIX, read_manifest

    if cfg.maniskill and cfg.num_envs is None:
        return 1
    if not cfg.overwrite and not cfg.maniskill:  # ManiSkill's command lines replace an earlier replay
        before = read_manifest(out / f"{name}{MANIFEST_SUFFIX}")
        sharding = before.get("options", {}).get("sharding") if before else None
        if isinstance(sharding, dict):
            world = sharding.get("world_size")
            return max(2, world if isinstance(world, int) and not isinstance(world, bool) else 2)
        if before and cfg.resume:
            return 1
    return default_workers(cfg.num_envs, episodes, gpu_sim, gpu_render)


def _layout(cfg: ReplayConfig, env: _Env, episodes: int, out: Path, name: str, frames: bool) -> _Layout:
    """The envs side by side, their vector kind, the worker processes and the batched render's device."""
    from fastrecord.shards import rank_info

    info = rank_info()
    if info.distributed and cfg.workers not in (None, 1):
        raise ValueError(f"--workers {cfg.workers} under torchrun: the {info.world_size} ranks are the workers (each "
                         f"replays its share); drop --workers, or run without torchrun")
    vector, gpu_sim = cfg.vector, env.gpu_sim
    cores = usable_cores(info.local_world_size)  # under torchrun the ranks of a host share its cores
    gpu_render = str(env.kwargs.get("render_backend")).lower() not in ("cpu", "sapien_cpu")
    workers = (1 if info.distributed else cfg.workers if cfg.workers is not None
               else _default_workers(cfg, episodes, gpu_sim, gpu_render, out, name))
    workers = min(workers, episodes)
    if cfg.num_envs is not None:
        n = cfg.num_envs
        if n < workers:
            raise ValueError(
                f"--workers {workers} with --num-envs {n}: each worker replays in envs of its own, so the "
                f"workers share the {n} envs; pass --num-envs {workers} or more, or --workers {n} or fewer"
            )
    elif gpu_sim:
        n = GPU_DEFAULT_ENVS * workers
    else:  # CPU: one env per core (ManiSkill's tool: one), or the one env a CPU ManiSkill env holds
        n = workers if (vector == "batched" or cfg.maniskill) else max(cores, workers)
    n = min(n, episodes)
    if workers == 1 and not info.distributed and cfg.resume:
        from fastrecord.shards import list_shards

        if list_shards(out, name):  # its episodes are the shards' (NAME.h5 is their join, rebuilt by each merge)
            raise ValueError(
                f"{out / name!s}.h5 is a sharded replay (its episodes are in {name}.shards/): resume it with "
                f"--workers 2 or more (or under torchrun), or pass --overwrite"
            )
    per_worker = -(-n // workers)  # the largest share
    render_device = _render_device(cfg, env.kwargs, per_worker, gpu_sim or env.convert, vector)
    if vector == "auto":
        # CPU envs drawn by the CPU (lavapipe: a process draws its pictures one after another): each in a sub-env
        # process running its next step while this one records (`fastrecord.replay.ahead`; on 2 cores, 2 envs, 8
        # episodes, medians: 13.9 s against 15.9 s in this process, 21.1 against 27.0 s with videos). Drawn on a
        # GPU: up to ENVS_PER_WORKER in this process, their renders submitted together; more in sub-processes, one
        # each (on 16 cores, 16 envs: 34.9 s in sub-processes, 39.2 s in one process); drawn in one batch: in this
        # process
        cpu_drawn = (per_worker > 1 and not (gpu_render or env.convert or cfg.option("render_substeps"))
                     and _draws(env.kwargs, frames))
        vector = ("batched" if gpu_sim else "sync" if render_device or (per_worker <= ENVS_PER_WORKER and not cpu_drawn)
                  else "async")
    _check_vector(cfg, vector, per_worker, env)
    return _Layout(n, vector, workers, info.distributed, render_device)


def _check_vector(cfg: ReplayConfig, vector: str, per_worker: int, env: _Env) -> None:
    """Refuse a vector kind that cannot hold these envs (one line naming the fix)."""
    if vector == "batched" and per_worker > 1 and cfg.replay_by == "actions" and not cfg.use_first_env_state:
        raise ValueError("replaying by actions side by side in one GPU-parallel env cannot reproduce the seeded starts "
                         "(ManiSkill seeds partial resets for the whole batch only); add --use-first-env-state")
    if vector == "batched" and not env.gpu_sim and per_worker > 1:
        raise ValueError(
            f"vector='batched' runs {per_worker} envs in one ManiSkill env, which needs GPU simulation; on the "
            f"CPU use vector='async' or 'sync' (or num_envs=1)"
        )
    if vector in ("sync", "async") and env.gpu_sim and not env.convert:
        raise ValueError(
            f"vector={vector!r} makes a vector env of CPU envs; with sim_backend={env.sim_backend!r} use "
            f"vector='batched'"
        )


def _render_device(
    cfg: ReplayConfig, kwargs: dict[str, Any], per_worker: int, own_env: bool, vector: str
) -> str | None:
    """The CUDA device on which each worker draws its CPU-simulated envs in one batch per camera name
    (`fastrecord.replay.grouped`), or None. ``--batched-render auto`` batches where a worker holds more than
    one env, renders on a CUDA device and draws something (camera observations, or videos of the render
    camera in ``rgb_array`` mode); ``on`` requires it (a ValueError naming the fix); ``off`` never.
    ``own_env``: GPU simulation (it draws in one batch by itself) or a control mode conversion (one env)."""
    from fastrecord import render
    from fastrecord.render.device import device_of

    wanted = {"auto": None, "on": True, "off": False}[cfg.batched_render]
    if wanted is False:
        return None
    obs_mode = kwargs.get("obs_mode") or "state"
    # --vector async: the envs in sub-env processes, drawn in this one (`fastrecord.replay.mirrored`), which puts
    # camera pictures back in the observation; a point cloud is made of them inside the env
    mirrored_cannot = vector == "async" and "pointcloud" in obs_mode
    if own_env or vector == "batched" or mirrored_cannot:
        if wanted:
            why = (
                "GPU simulation draws its envs in one batch by itself, and a conversion (-c) runs one env"
                if own_env
                else "--vector batched holds one env; use --vector sync, async or auto" if vector == "batched"
                else f"--vector async draws its sub-envs' cameras in this process, which cannot make the {obs_mode!r} "
                     f"observation of them; use --vector sync or auto"
            )
            raise ValueError(f"--batched-render on draws the CPU-simulated envs of a replay together, and {why}; or "
                             f"drop --batched-render")
        return None
    # the render camera's videos (a logger's alone are drawn by each env: the batched path is not tested for them)
    videos = cfg.save_video and cfg.video_source == "render"
    if not render.use_batched(wanted, num_envs=per_worker,
                              render_backend=kwargs.get("render_backend"),
                              render_mode=kwargs.get("render_mode") if videos else "rgb_array",
                              videos=_draws(kwargs, videos), substeps=bool(cfg.option("render_substeps")),
                              flag="--batched-render on", instead="--batched-render off or auto"):
        return None
    return device_of(kwargs.get("render_backend"))


def _draws(kwargs: dict[str, Any], frames: bool) -> bool:
    """Whether the replay's envs draw pictures: camera observations, or the render camera's ``frames``."""
    camera_obs = (kwargs.get("obs_mode") or "state") not in ("state", "state_dict", "none")
    return camera_obs or frames


def check_input(traj: TrajectoryFile, episodes: list[dict[str, Any]]) -> None:
    """Refuse to replay ``episodes`` (of ``traj``) when any holds bad data: one ValueError naming each bad
    episode, what is wrong and the fix. Reads their states, actions and step fields (small), not their
    observations (a replay makes its own)."""
    bad: list[tuple[int, list[EpisodeProblem]]] = []
    for i, ep in enumerate(episodes):
        problems = check_episode(traj.group(ep), ep, observations=False)
        if problems:
            bad.append((i, problems))
    if not bad:
        return
    shown = [str(p) for _, problems in bad[:5] for p in problems[:2]]
    more = f" (and {len(bad) - 5} more episodes)" if len(bad) > 5 else ""
    first = bad[0][0]
    if first > 0:
        fix = f"re-record the bad episodes, or replay only those before the first bad one with --count {first}"
    else:
        fix = "re-record the bad episodes, or remove them from the file (and from its JSON) before replaying"
    raise ValueError(f"{str(traj.h5_path)!r} holds bad data in {len(bad)} of the {len(episodes)} episodes to replay, "
                     f"which would replay into wrong results: {'; '.join(shown)}{more}. {fix[0].upper()}{fix[1:]}")


def _check_conversion(cfg: ReplayConfig, source: str | None, by: str, gpu_sim: bool) -> None:
    """Refuse what ManiSkill's tool cannot convert, with its reasons, before anything is made."""
    if by == "states":
        raise ValueError(
            "cannot replay by env states (--use-env-states / --by states) while converting to another control "
            "mode: the converted actions take a different number of steps to reach the same states; drop one"
        )
    if gpu_sim:
        raise ValueError("control mode conversion (-c) runs in a CPU env, as in ManiSkill's tool; pass -b physx_cpu")
    if source not in CONVERTERS:
        raise ValueError(f"ManiSkill's conversion code converts from {' or '.join(CONVERTERS)}, not from {source!r} "
                         f"(to {cfg.target_control_mode!r}); replay without -c, or record in pd_joint_pos")
    target = cfg.target_control_mode
    if source == "pd_joint_delta_pos" and target != "pd_joint_pos":
        raise ValueError(f"ManiSkill's conversion code converts pd_joint_delta_pos only to pd_joint_pos, not to "
                         f"{target!r}; pass -c pd_joint_pos (and convert that replay to {target!r}), or record in "
                         f"pd_joint_pos")
