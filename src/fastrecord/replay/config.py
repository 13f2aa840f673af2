"""A replay's options (`ReplayConfig`), its outcome (`ReplaySummary`, `Divergence`) and its errors.

Imports neither torch nor ManiSkill: ``fastrecord replay --help`` reads the fields' defaults and
comments from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fastrecord.checks import check_at_least, check_choice, check_frame_size, check_types, lift_env_kwargs
from fastrecord.episode import KEEP_CHOICES
from fastrecord.options import RecordOptions, cli_option_names, record_options

BY_CHOICES = ("states", "actions")
CONVERTERS = ("pd_joint_pos", "pd_joint_delta_pos")  # control modes ManiSkill's conversion code starts from
VECTOR_CHOICES = ("auto", "sync", "async", "batched")
BATCHED_RENDER_CHOICES = ("auto", "on", "off")
CPU_BACKENDS = ("physx_cpu", "cpu")
RENDER_MODES = ("rgb_array", "sensors", "all")  # render modes a replay's videos can take

# The recording options a replay decides itself (no flag, no config key): ``save_on_reset`` (the replay
# loop saves each replay when it ends, and a reset never ends one), ``if_exists`` (--overwrite, --resume and
# ManiSkill's flags decide it; a worker's shard follows the sharded run) and ``video_layout`` (each env's
# replay is saved on its own when it ends, the slots refilled with episodes of other lengths, so no batch
# of episodes ends together to be tiled: the videos are one per replay).
REPLAY_DECIDES = ("save_on_reset", "if_exists", "video_layout")
# The `fastrecord.RecordOptions` fields a replay takes: its flags, config keys and `replay_trajectories` keywords.
RECORDING_OPTIONS = tuple(n for n in cli_option_names() if n not in REPLAY_DECIDES)
# The recording options whose replay default is not RecordOptions' (None: not given); `ReplayConfig.recorder_kwargs`
# decides them: trajectory_name NAME.<obs_mode>.<control_mode>.<sim_backend> (ManiSkill's naming), video_fps the
# task's control frequency, keep "all" (ManiSkill's flags: its success, --allow-failure and --discard-timeout
# rule), record_reward on (ManiSkill's flags: only with --record-rewards).
REPLAY_DEFAULTS: dict[str, Any] = {"trajectory_name": None, "video_fps": None, "keep": None, "record_reward": None}
# The gym.make keywords a replay has an option of its own for (key -> its flag): an ``env_kwargs`` entry of one
# becomes that option's value (an error if the option is given too); those a replay decides itself are refused.
ENV_OPTIONS = {"obs_mode": "--obs-mode", "reward_mode": "--reward-mode", "sim_backend": "--sim-backend",
               "render_backend": "--render-backend", "render_mode": "--render-mode"}
ENV_REFUSED = {
    "num_envs": "--num-envs sets the envs replayed side by side",
    "max_episode_steps": "a replay takes the file's time limit (or its longest episode's)",
    "control_mode": "a replay takes the file's control mode; -c/--target-control-mode converts the actions to another",
}


def _given(values: Mapping[str, Any]) -> dict[str, Any]:
    """The recording options of ``values`` that were given (None is not, for those of `REPLAY_DEFAULTS`)."""
    return {k: v for k, v in values.items() if k in RECORDING_OPTIONS and not (v is None and k in REPLAY_DEFAULTS)}


@dataclass(frozen=True)
class ReplayConfig:
    """Every option of one replay, checked when it is made (a ValueError naming the option and the fix): the
    replay's own fields, and ``record``, the recording options given (declared and checked by
    `fastrecord.RecordOptions` only; the replay decides the others per input and mode, so it keeps the given
    ones rather than a whole `RecordOptions`, and `recorder_kwargs` completes them).

    ``fastrecord replay``'s flags and its ``--config`` YAML files give both kinds as flat keys (``obs_mode: rgb``,
    ``video_crf: 28``), as `replay_trajectories` takes them as keywords; `from_values` sorts them."""

    traj_path: str = ""  # the NAME.h5 to replay (NAME.json must sit next to it)
    output_dir: str | None = None  # None: a "replay" folder next to the input file
    # states (set every recorded env state) | actions (re-simulate the actions); None: states (maniskill: actions)
    by: str | None = None
    use_first_env_state: bool = False  # by actions: start from the recorded first state, not the seeded reset
    count: int | None = None  # replay the first COUNT episodes (None: all)
    num_envs: int | None = None  # episodes side by side (None: CPU one per core, maniskill 1; GPU 64; batched CPU 1)
    vector: str = "auto"  # auto | sync | async (CPU envs in this / in sub-env processes) | batched (one ManiSkill env)
    sim_backend: str = "auto"  # auto (the file's, CPU where CUDA is absent) | physx_cpu | physx_cuda
    render_backend: str = "auto"  # auto (GPU if CUDA is present, else CPU) | cpu | gpu
    # CPU sim: each worker's envs drawn in one batch per camera on the GPU: auto (where it can run) | on | off
    batched_render: str = "auto"
    obs_mode: str | None = None  # observation mode of the new trajectory (None: the file's)
    width: int | None = None  # video camera width (None: the file's / the task's)
    height: int | None = None  # video camera height (None: the file's / the task's)
    shader: str | None = None  # shader pack of the video camera: minimal | default | rt | rt-fast
    overwrite: bool = False  # replace the output of an earlier run of this name (never the input)
    resume: bool = False
    # processes replaying a share of the episodes each, merged at the end (None: several on machines of many cores,
    # see fastrecord.replay.layout)
    workers: int | None = None
    progress: bool = True  # show a progress bar
    env_kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # more gym.make keywords, replacing the file's env_kwargs of those keys
    # the recording options given (`RECORDING_OPTIONS`, flat keys of the flags, YAML files and keywords that
    # `from_values` sorts here), checked by `fastrecord.RecordOptions`; the others are RecordOptions' defaults
    # or the replay's (`REPLAY_DEFAULTS`)
    record: dict[str, Any] = field(default_factory=dict)
    # ManiSkill's replay_trajectory flags, same meaning; `maniskill` switches to its defaults (see the module docstring)
    maniskill: bool = False  # ManiSkill's semantics: set by --traj-path or any other flag only ManiSkill's tool has
    target_control_mode: str | None = None  # -c: convert the actions to this control mode (None: no conversion)
    allow_failure: bool = False  # maniskill: also write replays that do not end in success
    discard_timeout: bool = False  # maniskill: drop replays truncated by the time limit at their last step
    max_retry: int = 0  # maniskill: replay a failed episode up to this many more times
    reward_mode: str | None = None  # the env's reward mode (None: the file's / the task's)
    render_mode: str = "rgb_array"  # render mode of the videos: rgb_array | sensors | all
    verbose: bool = False  # maniskill: print each replay that is not kept

    def __post_init__(self) -> None:
        check_types(self)
        unknown = sorted(set(self.record) - set(RECORDING_OPTIONS))
        if unknown:
            raise ValueError(
                f"record={unknown} are not recording options of a replay; use names from {RECORDING_OPTIONS}"
            )
        record_options(_given(self.record))  # the one check of each recording option's value
        if self.keep is not None and not isinstance(self.keep, str):
            # a replay's options travel to worker processes and its summary names the filter
            raise ValueError(f"keep={self.keep!r}: a replay takes one of {KEEP_CHOICES}, not a callable; filter the "
                             f"replayed episodes afterwards, or record with fastrecord.RecordEpisode(keep=...)")
        if self.by is not None:
            check_choice(self, "by", BY_CHOICES)
        check_choice(self, "vector", VECTOR_CHOICES)
        check_choice(self, "batched_render", BATCHED_RENDER_CHOICES)
        check_choice(self, "render_mode", RENDER_MODES)
        check_at_least(self, 1, "count", "num_envs", "width", "height", "workers")
        check_frame_size(self, "width", "height")
        if self.resume and self.overwrite:
            raise ValueError("--resume keeps the earlier replay's files and --overwrite deletes them; pass one")
        check_at_least(self, 0, "max_retry")
        if self.use_first_env_state and self.replay_by == "states":
            raise ValueError(
                "use_first_env_state only applies to --by actions (--by states sets every recorded state anyway)"
            )
        if not self.maniskill and not (self.save_video or self.save_trajectory or self.option("lerobot")):
            raise ValueError(
                "nothing to write: both the video and the trajectory are off; drop --no-video or --no-trajectory, "
                "or add --lerobot"
            )
        if self.maniskill and self.keep is not None and (self.allow_failure or self.discard_timeout):
            raise ValueError(f"--keep {self.keep} and --allow-failure/--discard-timeout both choose which replays are "
                             f"written; pass one of them")
        if not self.maniskill and (self.allow_failure or self.discard_timeout or self.max_retry):
            raise ValueError("allow_failure, discard_timeout and max_retry are ManiSkill's replay semantics: set "
                             "maniskill: true (the CLI does when a ManiSkill flag is given), or use keep")

    @classmethod
    def option_names(cls) -> list[str]:
        """Every key a YAML file, a flag or a `replay_trajectories` keyword may set: the replay's own and
        `RECORDING_OPTIONS`."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "record"] + list(RECORDING_OPTIONS)

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> ReplayConfig:
        """The config of flat ``values`` (YAML keys, flags, keywords): the recording options go to ``record``
        (None for those of `REPLAY_DEFAULTS`: the replay decides), the others to the replay's own fields."""
        values = lift_env_kwargs(dict(values), ENV_OPTIONS, ENV_REFUSED)
        if values.get("shader") is not None and "shader_dir" in values.get("env_kwargs", {}):
            raise ValueError(
                f"the shader is given twice: --shader {values['shader']!r} and --env-kwargs "
                f"shader_dir={values['env_kwargs']['shader_dir']!r} (or shader: and env_kwargs: in the --config "
                f"file); pass one of them"
            )
        own = {k: v for k, v in values.items() if k not in RECORDING_OPTIONS}
        return cls(**own, record=_given(values))

    def option(self, name: str) -> Any:
        """The value of recording option ``name``: given, else the replay's default (`REPLAY_DEFAULTS`: None,
        decided per replay), else RecordOptions'."""
        if name not in RECORDING_OPTIONS:
            raise ValueError(f"{name!r} is not a recording option of a replay; use one of {RECORDING_OPTIONS}")
        if name in self.record:
            return self.record[name]
        if name in REPLAY_DEFAULTS:
            return REPLAY_DEFAULTS[name]
        return RecordOptions.__dataclass_fields__[name].default

    # the recording options the replay reads before its recorder exists
    @property
    def save_video(self) -> bool:
        return self.option("save_video")

    @property
    def save_trajectory(self) -> bool:
        return self.option("save_trajectory")

    @property
    def video_source(self) -> str:
        return self.option("video_source")

    @property
    def trajectory_name(self) -> str | None:
        """The output's NAME; None: NAME.<obs_mode>.<control_mode>.<sim_backend>, decided by the plan."""
        return self.option("trajectory_name")

    @property
    def keep(self) -> str | None:
        """The keep choice given (None: all, or with ``maniskill`` ManiSkill's rule: `keep_filter`)."""
        return self.option("keep")

    def recorder_kwargs(self, name: str, control_freq: float, verdict: Callable[[Any], bool], if_exists: str,
                        source_desc: str) -> dict[str, Any]:
        """A replay recorder's `RecordOptions`, as the wrapper's keyword arguments: the options given, the
        replay's defaults for the others (`REPLAY_DEFAULTS`: ``video_fps=control_freq``; ``verdict``, the
        loop's keep filter, where ManiSkill's rule decides) and what a replay decides itself (`REPLAY_DECIDES`:
        ``if_exists``), writing the trajectory ``name``."""
        derived = {"video_fps": control_freq, "record_reward": not self.maniskill}
        decided = {"trajectory_name": name, "keep": self.keep_filter if self.keep_filter is not None else verdict,
                   "save_on_reset": False, "if_exists": if_exists, "video_layout": "per_env",
                   "source_type": "fastrecord-replay", "source_desc": source_desc}
        opts = RecordOptions(**{**derived, **_given(self.record), **decided})
        return {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}

    @property
    def replay_by(self) -> str:
        """states | actions: ``by``, else the default of the mode (ManiSkill's tool replays by actions)."""
        return self.by or ("actions" if self.maniskill else "states")

    @property
    def keep_filter(self) -> str | None:
        """The keep choice, or None where ManiSkill's success/allow_failure/discard_timeout rule decides."""
        if self.keep is not None:
            return self.keep
        if self.maniskill and not (self.allow_failure and not self.discard_timeout):
            return None
        return "all"

    def maniskill_keeps(self, success: bool | None, truncated: bool) -> bool:
        """ManiSkill's rule for one replay: success at the end (or --allow-failure), and not truncated
        with --discard-timeout."""
        ok = bool(success) or self.allow_failure
        return ok and not (self.discard_timeout and truncated)


@dataclass
class Divergence:
    """One replayed episode whose final success differs from its recording."""

    episode_id: int  # the episode id in the input file
    recorded: bool  # its recorded final success
    replayed: bool  # the final success of its replay


@dataclass
class ReplaySummary:
    """What a replay did: episodes replayed and written, successes, divergences, timings and files."""

    episodes: int  # episodes replayed
    kept: int  # episodes written (keep filter)
    successes: int  # replayed episodes that end in success
    diverged: list[Divergence]  # replays whose final success differs from the recording
    env_steps: int  # env steps replayed (summed over episodes)
    seconds: float  # wall time of the replay loop (the progress bar's), writing included; env creation not
    output_dir: Path
    files: list[Path]
    source_episode_ids: list[int] = field(default_factory=list)  # output episode k replays input episode [k]
    interrupted: str | None = None  # the signal that stopped the replay early ("SIGINT", "SIGTERM")
    partial: int = 0  # interrupted: replays cut short and saved as they were
    startup_seconds: float = 0.0  # env creation, before the progress bar (``seconds`` is the replay after it)
    results: list[dict[str, Any]] = field(
        default_factory=list
    )  # NAME.results.jsonl's rows: every replay, retries included
    results_path: Path | None = None
    converted: bool = False  # the actions were converted to another control mode (-c)
    skipped: int = 0  # --resume: episodes the output already held, not replayed again
    workers: int = 1  # processes that replayed a share each
    missing: list[int] = field(default_factory=list)  # sharded: input episodes no shard holds (a worker stopped early)
    # --workers: each worker's (started, replaying, done) in seconds since the replay began: its process up
    # with its imports, its envs made, its share written; and the time the shards' merge took
    worker_times: list[tuple[float, float, float]] = field(default_factory=list)
    merge_seconds: float = 0.0
    process_age: float | None = None  # seconds from this process's start to the replay's (interpreter, imports)


class ReplayWorkerError(RuntimeError):
    """A replay worker process failed or died; the message names the worker, its share and the cause."""


class StartCancelled(Exception):
    """A replay worker told not to start replaying (its caller's check of the input failed while the worker made its
    envs): it ends before its recorder, so nothing was written."""


class StopRequest(Protocol):
    """Asked between two steps of a replay: whether to stop now, and why (a signal's name, "SIGINT").

    ``fastrecord.exits.StopSignals`` is one: the CLI's SIGINT/SIGTERM handlers."""

    @property
    def requested(self) -> bool: ...

    @property
    def name(self) -> str: ...
