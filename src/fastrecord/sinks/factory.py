"""`build_sinks`: the sinks a recorder writes to, made from its `RecordOptions`.

fastrecord's own outputs come from the options (``save_trajectory``: `ManiSkillH5Sink`, ``save_video``: `Mp4Sink`,
``lerobot``: `LeRobotSink`), the user's sinks follow, and `ResultsSink` is always last: it names the videos the sinks
before it wrote. A new built-in output format is a new sink module plus one branch here.

Process counts left at None (``trajectory_writers``, ``video_workers``) are chosen here, from the cores
this process may use and the env's observations (`fastrecord.options.default_trajectory_writers`,
`fastrecord.options.default_video_workers`); explicit values are used as given. How many videos encode at once
while the env steps leaves a CPU vector env's sub-env processes their cores
(`fastrecord.options.stepping_video_workers`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fastrecord.options import default_trajectory_writers, default_video_workers, stepping_video_workers, usable_cores
from fastrecord.sinks.base import Sink
from fastrecord.video.pool import EncodeGate

if TYPE_CHECKING:
    from fastrecord.envs import EnvView
    from fastrecord.options import RecordOptions
    from fastrecord.sinks.lerobot import LeRobotSink
    from fastrecord.sinks.maniskill_h5 import ManiSkillH5Sink
    from fastrecord.sinks.mp4 import Mp4Sink
    from fastrecord.sinks.results import ResultsSink
    from fastrecord.video import VideoSettings


@dataclass
class RecorderSinks:
    """The sinks of one recorder: fastrecord's own by role, and all of them in the order they receive
    episodes (`all`)."""

    trajectory: ManiSkillH5Sink | None  # NAME.h5 + NAME.json (save_trajectory)
    videos: Mp4Sink | None  # the MP4s (save_video)
    lerobot: LeRobotSink | None  # the LeRobot dataset NAME.lerobot/ (lerobot)
    results: ResultsSink  # NAME.results.jsonl: every finished episode, kept or not
    all: list[Sink]  # trajectory, videos, lerobot, the user's sinks, results (last)
    chosen: dict[str, int]  # process counts chosen for options left at None (the run manifest records them)


def observation_space(env: Any) -> Any:
    """``env``'s observation space of one env (``single_observation_space`` of a vector env), or None."""
    return getattr(env, "single_observation_space", None) or getattr(env, "observation_space", None)


def commit_info() -> dict[str, Any] | None:
    """The ``commit_info`` of the trajectory JSON: ManiSkill's `mani_skill.get_commit_info` (the commit of a ManiSkill
    installed from a git checkout), None without GitPython's import where ManiSkill's folder is no git checkout (an
    installed package: what its function returns there). GitPython's import took 0.1 s of every recorder's start on
    the 2-core machine and 0.18-0.42 s on the H100 machine, with four replay workers starting."""
    import mani_skill

    if not (Path(mani_skill.PACKAGE_DIR).parent / ".git").exists():  # its git.Repo(that folder) would refuse it
        return None
    return mani_skill.get_commit_info()


def build_sinks(options: RecordOptions, view: EnvView, extra: Sequence[Sink] = ()) -> RecorderSinks:
    """The sinks of a recorder of ``view``'s env with ``options``, then ``extra`` (the user's `Sink`
    instances). Every check that can fail runs here, before the run directory touches the disk."""
    for s in extra:
        if not isinstance(s, Sink):
            raise ValueError(
                f"sinks=[..., {s!r}, ...]: every sink must be a fastrecord.sinks.Sink "
                "(subclass it and implement submit)"
            )
    from fastrecord.sinks.results import ResultsSink

    trajectory = videos = None
    chosen: dict[str, int] = {}
    if options.save_trajectory:
        from fastrecord.sinks.maniskill_h5 import ManiSkillH5Sink, has_image_leaves

        writers = options.trajectory_writers
        if writers is None:
            images = has_image_leaves(observation_space(view.env))
            writers = chosen["trajectory_writers"] = default_trajectory_writers(usable_cores(), images)

        header: dict[str, Any] = dict(env_info=view.env_info(), commit_info=commit_info())
        if options.source_type is not None:
            header["source_type"] = options.source_type
        if options.source_desc is not None:
            header["source_desc"] = options.source_desc
        trajectory = ManiSkillH5Sink(header, writers=writers, compression=options.trajectory_compression)
    gate = None  # the recorder's encoders (videos, LeRobot's videos) at once while the env steps
    if options.save_video or options.lerobot:
        from fastrecord.envs import simulation_processes

        workers = options.video_workers
        if workers is None:
            workers = chosen["video_workers"] = default_video_workers(usable_cores())
        gate = EncodeGate(min(workers, stepping_video_workers(workers, simulation_processes(view.env), usable_cores())))
    if options.save_video:
        from fastrecord.sinks.mp4 import Mp4Sink

        settings = video_settings(options)
        videos = Mp4Sink(settings, layout=options.video_layout, num_envs=view.num_envs, workers=workers, gate=gate,
                         max_steps_per_video=options.max_steps_per_video, info_on_video=options.info_on_video)
    lerobot = None
    if options.lerobot:
        lerobot = lerobot_sink(options, view, chosen, gate)
    own = [s for s in (trajectory, videos, lerobot) if s is not None]
    results = ResultsSink(videos, outputs=[*own, *extra])
    return RecorderSinks(trajectory, videos, lerobot, results, [*own, *extra, results], chosen)


def video_settings(options: RecordOptions) -> VideoSettings:
    """The videos' `VideoSettings`, checked (a ValueError naming the bad option and the fix).

    ``video_codec="auto"`` not yet resolved in this process stays "auto" here: its NVENC probe (0.46 s on the H100
    machine, 0.66 s on the H200: a CUDA context opened, no encoder found) is started (`prefetch_codec`: in a helper
    process where an NVIDIA driver is loaded) while the recorder is made and its first episodes are stepped, and
    the first video resolves it (`encode_mp4` checks its settings), waiting for the probe if it is still running.
    The other options are checked now, with the encoder "auto" falls back to (libx264: NVENC takes the same crf
    range and the default pixel format). Any other codec, or a PyAV without libx264, is resolved and checked here."""
    from fastrecord.video import VideoSettings, check_video_settings
    from fastrecord.video.encode import codec_available, codec_resolved, prefetch_codec

    settings = VideoSettings(
        codec=options.video_codec,
        crf=int(options.video_crf),
        preset=options.video_preset,
        fps=options.video_fps,
        gop=options.video_gop,
    )
    if settings.codec == "auto" and not codec_resolved("auto") and codec_available("libx264"):
        prefetch_codec("auto")
        check_video_settings(replace(settings, codec="libx264"))
        return settings
    return check_video_settings(settings)  # "auto" (resolved already) or a codec named: resolved there


def env_attribute(view: EnvView, name: str) -> Any:
    """Attribute ``name`` of ``view``'s (first) ManiSkill env, or None where it has none."""
    base = getattr(view, "base", None)
    if base is not None:
        return getattr(base, name, None)
    env = view.env
    if hasattr(env, "get_attr"):  # a vector env of ManiSkill CPU envs: every one has the ManiSkill attributes
        try:
            return env.get_attr(name)[0]
        except Exception:  # noqa: BLE001 - not a ManiSkill env: the caller's default
            return None
    return getattr(getattr(env, "unwrapped", env), name, None)


def lerobot_sink(options: RecordOptions, view: EnvView, chosen: dict[str, int],
                 gate: EncodeGate | None = None) -> LeRobotSink:
    """The `LeRobotSink` of ``lerobot=True``: a row per env step at the env's control frequency (else
    ``video_fps``), the env id as the task, the robot uid as ``robot_type``, the ``lerobot_*`` encoder
    options (the video options' where None), ``lerobot_state_keys``, and the env's state layout
    (`state_layout`: the order of observation.state and the names of a flat state observation). ``gate``: the
    limit its encodes share with the recorder's videos while the env steps."""
    from fastrecord.sinks.lerobot import LeRobotSink
    from fastrecord.video import VideoSettings, resolve_codec

    fps = env_attribute(view, "control_freq")
    fps = float(fps) if isinstance(fps, (int, float)) and fps > 0 else float(options.video_fps)
    fps = int(fps) if fps.is_integer() else fps
    robot = env_attribute(view, "robot_uids")
    robot = robot if isinstance(robot, str) else "_".join(robot) if isinstance(robot, (tuple, list)) and all(
        isinstance(r, str) for r in robot) else "unknown"
    task = (view.env_info() or {}).get("env_id") or "unknown task"
    workers = options.video_workers or chosen.setdefault("video_workers", default_video_workers(usable_cores()))
    from fastrecord.options import state_keys

    codec = resolve_codec(options.lerobot_video_codec or options.video_codec)
    crf = options.lerobot_crf if options.lerobot_crf is not None else 30 if codec == "libsvtav1" else options.video_crf
    video = VideoSettings(codec=codec, crf=int(crf), preset=options.video_preset, gop=options.lerobot_gop)
    keys = state_keys(options.lerobot_state_keys)
    leaves = observation_leaves(view) if keys is not None else None
    if keys is not None and leaves is not None:  # a wrong key refused before anything is recorded
        from fastrecord.sinks.lerobot.layout import state_leaves

        state_leaves(dict.fromkeys(leaves), keys)
    return LeRobotSink(fps, task, video, robot_type=robot, workers=workers, state_keys=keys,
                       state_layout=state_layout(view), gate=gate)


def observation_leaves(view: EnvView) -> list[str] | None:
    """The trajectory leaves the env's observations give, from its observation space (one env's), named as the
    recorder names an observation's (`fastrecord.buffer.flatten_tree`): ``obs/agent/qpos``, ... of a dictionary
    (ManiSkill builds its space from an observation, leaf for leaf), ``obs`` of an array; None for another space
    (the first episode's leaves then decide)."""
    from gymnasium import spaces

    from fastrecord.buffer import flatten_tree

    env = view.env
    space = getattr(env, "single_observation_space", None)
    space = getattr(env, "observation_space", None) if space is None else space
    if isinstance(space, spaces.Box):
        return ["obs"]
    return list(flatten_tree(space, "obs")) if isinstance(space, spaces.Dict) else None


def state_layout(view: EnvView) -> list[tuple[str, int]] | None:
    """The leaves of a ManiSkill env's state dictionary (``agent``, then ``extra``, each leaf in the order
    the env returns it: ManiSkill's flattened state observation) as ``(path, width)``, ``("agent/qpos",
    9)``, a width of 0 for a scalar per env (``extra/is_grasped``); None where the env has none."""
    base = getattr(getattr(view, "base", None), "unwrapped", None)
    base = base or getattr(getattr(view, "env", None), "unwrapped", None)
    if base is None or not hasattr(base, "_get_obs_state_dict") or not hasattr(base, "get_info"):
        return None
    try:
        state = base._get_obs_state_dict(base.get_info())
    except Exception:  # noqa: BLE001 - a custom env: observation.state falls back to sorted leaves, state.<i> names
        return None
    out: list[tuple[str, int]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}" if prefix else str(k), v)
            return
        shape = tuple(getattr(value, "shape", ()))[1:]  # [num_envs, ...]
        width = 1
        for d in shape:
            width *= int(d)
        out.append((prefix, width if shape else 0))

    walk("", state)
    return out
