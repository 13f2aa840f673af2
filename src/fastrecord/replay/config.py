"""A replay's options (`ReplayConfig`), its outcome (`ReplaySummary`, `Divergence`) and its errors.

Imports neither torch nor ManiSkill: ``fastrecord replay --help`` reads the fields' defaults and
comments from here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from fastrecord.checks import check_at_least, check_choice, check_fps, check_types
from fastrecord.episode import KEEP_CHOICES

BY_CHOICES = ("states", "actions")
CONVERTERS = ("pd_joint_pos", "pd_joint_delta_pos")  # control modes ManiSkill's conversion code starts from
VECTOR_CHOICES = ("auto", "sync", "async", "batched")
CPU_BACKENDS = ("physx_cpu", "cpu")
RENDER_MODES = ("rgb_array", "sensors", "all")  # render modes a replay's videos can take


@dataclass(frozen=True)
class ReplayConfig:
    """Every option of one replay, checked when it is made (a ValueError naming the option and the fix).

    ``fastrecord replay``'s flags and its ``--config`` YAML files fill these fields; `replay_trajectories`
    takes them as keyword arguments."""

    traj_path: str = ""  # the NAME.h5 to replay (NAME.json must sit next to it)
    output_dir: str | None = None  # None: a "replay" folder next to the input file
    trajectory_name: str | None = None  # None: NAME.<obs_mode>.<control_mode>.<sim_backend> (ManiSkill's naming)
    by: str | None = None  # states (set every recorded env state) | actions (re-simulate the actions); None: states (maniskill: actions)
    use_first_env_state: bool = False  # by actions: start from the recorded first state, not the seeded reset
    count: int | None = None  # replay the first COUNT episodes (None: all)
    num_envs: int | None = None  # episodes side by side (None: CPU one per core, maniskill 1; GPU 64; batched CPU 1)
    vector: str = "auto"  # auto | sync | async (gymnasium vector env of CPU envs) | batched (one ManiSkill env)
    sim_backend: str = "auto"  # auto (the file's, CPU where CUDA is absent) | physx_cpu | physx_cuda
    render_backend: str = "auto"  # auto (GPU if CUDA is present, else CPU) | cpu | gpu
    obs_mode: str | None = None  # observation mode of the new trajectory (None: the file's)
    save_video: bool = True  # write one MP4 per replayed episode
    save_trajectory: bool = True  # write the new NAME.h5/.json pair
    video_source: str = "render"  # render (human render camera) | sensor:<camera> (needs an rgb obs mode)
    width: int | None = None  # video camera width (None: the file's / the task's)
    height: int | None = None  # video camera height
    shader: str | None = None  # shader pack of the video camera: minimal | default | rt | rt-fast
    keep: str | None = None  # all | success | success_once | failure: which replays are written (None: all; maniskill: see allow_failure)
    video_fps: float | None = None  # None: the task's control frequency
    video_codec: str = "auto"  # auto (h264_nvenc where usable, else libx264) | libx264 | any PyAV encoder
    overwrite: bool = False  # replace the output of an earlier run of this name (never the input)
    resume: bool = False  # continue an earlier, interrupted replay of this name: episodes it holds are not replayed again
    workers: int | None = None  # processes replaying a share of the episodes each, merged at the end (None: several on machines of many cores, see fastrecord.replay.layout)
    progress: bool = True  # show a progress bar
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # extra gym.make kwargs (override the file's)
    # ManiSkill's replay_trajectory flags, same meaning; `maniskill` switches to its defaults (see the module docstring)
    maniskill: bool = False  # ManiSkill's semantics: set by --traj-path or any other flag only ManiSkill's tool has
    target_control_mode: str | None = None  # -c: convert the actions to this control mode (ManiSkill's conversion code)
    allow_failure: bool = False  # maniskill: also write replays that do not end in success
    discard_timeout: bool = False  # maniskill: drop replays truncated by the time limit at their last step
    max_retry: int = 0  # maniskill: replay a failed episode up to this many more times
    record_rewards: bool | None = None  # write rewards (None: fastrecord yes, maniskill no)
    reward_mode: str | None = None  # the env's reward mode (None: the file's / the task's)
    render_mode: str = "rgb_array"  # render mode of the videos: rgb_array | sensors | all
    verbose: bool = False  # maniskill: print each replay that is not kept

    def __post_init__(self) -> None:
        check_types(self)
        if self.by is not None:
            check_choice(self, "by", BY_CHOICES)
        check_choice(self, "vector", VECTOR_CHOICES)
        if self.keep is not None:
            check_choice(self, "keep", KEEP_CHOICES)
        check_choice(self, "render_mode", RENDER_MODES)
        check_at_least(self, 1, count="--count", num_envs="--num-envs", width="--width", height="--height", workers="--workers")
        if self.resume and self.overwrite:
            raise ValueError("--resume keeps the earlier replay's files and --overwrite deletes them; pass one")
        check_at_least(self, 0, max_retry="--max-retry")
        check_fps(self.video_fps)
        if self.use_first_env_state and self.replay_by == "states":
            raise ValueError("use_first_env_state only applies to --by actions (--by states sets every recorded state anyway)")
        if not (self.video_source == "render" or self.video_source.startswith("sensor:")):
            raise ValueError(f"video_source={self.video_source!r} is unknown; use 'render' or 'sensor:<camera name>'")
        if not self.maniskill and not (self.save_video or self.save_trajectory):
            raise ValueError("nothing to write: both the video and the trajectory are off; drop --no-video or --no-trajectory")
        if self.maniskill and self.keep is not None and (self.allow_failure or self.discard_timeout):
            raise ValueError(f"--keep {self.keep} and --allow-failure/--discard-timeout both choose which replays are "
                             f"written; pass one of them")
        if not self.maniskill and (self.allow_failure or self.discard_timeout or self.max_retry):
            raise ValueError("allow_failure, discard_timeout and max_retry are ManiSkill's replay semantics: set "
                             "maniskill: true (the CLI does when a ManiSkill flag is given), or use keep")

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
    results: list[dict[str, Any]] = field(default_factory=list)  # NAME.results.jsonl's rows: every replay, retries included
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


class StopRequest(Protocol):
    """Asked between two steps of a replay: whether to stop now, and why (a signal's name, "SIGINT").

    ``fastrecord.exits.StopSignals`` is one: the CLI's SIGINT/SIGTERM handlers."""

    @property
    def requested(self) -> bool: ...

    @property
    def name(self) -> str: ...
