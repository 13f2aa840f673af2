"""Run configurations: frozen dataclasses that YAML presets (configs/) and CLI flags fill.

Every problem with a configuration (a missing or malformed file, an unknown option, a value of the wrong
type or out of range) is a ``ValueError`` naming the option, the value and the fix, raised before
anything is created or written: ``fastrecord <cmd>`` prints it as one line and exits with status 2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastrecord.checks import check_at_least, check_frame_size, check_types, lift_env_kwargs
from fastrecord.options import RecordOptions, cli_option_names, record_options

T = TypeVar("T")

# The recording options' values where the CLI's differ from the library's (one NAME, not a timestamp).
RECORD_DEFAULTS: dict[str, Any] = {"trajectory_name": "trajectory"}


def _default_record() -> RecordOptions:
    return RecordOptions(**RECORD_DEFAULTS)


# The gym.make keywords a `RecordConfig` has an option of its own for: key -> its flag.
ENV_OPTIONS = {
    "obs_mode": "--obs-mode",
    "control_mode": "--control-mode",
    "sim_backend": "--sim-backend",
    "render_backend": "--render-backend",
    "max_episode_steps": "--max-episode-steps",
    "num_envs": "--num-envs",
    "reward_mode": "--reward-mode",
    "shader_dir": "--shader-dir",
    "robot_uids": "--robot-uids",
    "sim_config": "--sim-config",
    "sensor_configs": "--sensor-configs",
}
# gym.make keywords `record` decides itself
ENV_REFUSED = {
    "render_mode": "record renders its videos with render_mode='rgb_array'; drop it (--no-video records none)"
}


@dataclass(frozen=True)
class RecordConfig:
    """A `fastrecord record` run: the run's own options (task, envs, episodes, policy, backends, camera,
    seed) and ``record``, the recording options (`fastrecord.RecordOptions`, declared and validated
    there only). A YAML preset and the flags give both kinds as flat keys (``episodes: 8``,
    ``video_crf: 28``); `from_values` sorts them."""

    env_id: str = "PickCube-v1"  # ManiSkill task to record
    num_envs: int = 1  # parallel envs (GPU sim: one batched env; CPU sim: a vector env of processes)
    episodes: int = 4  # episodes in the run, in total: a resumed run (--if-exists resume) records the missing ones
    policy: str = "random"  # "random" (seeded per episode) or "module:factory"; factory(env) returns act(obs) -> action
    output_dir: str = "recordings"  # where the .h5/.json and the MP4s go
    sim_backend: str = "physx_cpu"  # physx_cpu | physx_cuda (GPU simulation needs a CUDA machine)
    render_backend: str = "auto"  # auto (GPU if CUDA is present, else CPU) | cpu | gpu
    batched_render: str = (
        "auto"  # CPU sim, num_envs > 1: auto (one batched render when rendering on a CUDA device) | on | off
    )
    envs_per_process: int | None = None  # batched render's sub-envs a process (None: fastrecord.packed.process_sizes)
    vector: str = "auto"  # CPU sim, num_envs > 1: auto | sync (the envs in this process) | async (in processes)
    obs_mode: str = "state"  # ManiSkill observation mode recorded in the trajectory
    control_mode: str | None = None  # None: the task's default
    width: int = 256  # human render camera width
    height: int = 256  # human render camera height
    max_episode_steps: int | None = None  # None: the task's default
    seed: int = 0  # episode g (0, 1, ...) is reset with seed + g
    reward_mode: str | None = None  # the env's reward mode: sparse, dense, normalized_dense, none (None: the task's)
    shader_dir: str | None = None  # shader pack of every camera: minimal, default, rt, rt-fast (None: the task's)
    robot_uids: str | list[str] | None = None  # the robot(s), e.g. panda or a JSON list (None: the task's)
    sim_config: dict[str, Any] | None = None  # SimConfig fields as JSON, e.g. {"sim_freq": 200} (None: the task's)
    sensor_configs: dict[str, Any] | None = None  # sensor cameras as JSON, e.g. {"width": 128} (None: the task's)
    env_kwargs: dict[str, Any] = field(
        default_factory=dict
    )  # any other gym.make keywords, e.g. {"enable_shadow": true}
    record: RecordOptions = field(
        default_factory=_default_record
    )  # the recording options (flat keys in YAML and flags)

    def __post_init__(self) -> None:
        check_types(self)
        check_at_least(self, 1, "num_envs", "episodes", "width", "height", "max_episode_steps", "envs_per_process")
        check_frame_size(self, "width", "height")
        if self.batched_render not in ("auto", "on", "off"):
            raise ValueError(f"batched_render={self.batched_render!r} must be one of auto, on, off (--batched-render)")
        self._check_vector()
        if not self.record.save_on_reset:
            raise ValueError("save_on_reset=False saves episodes only through flush_trajectory()/flush_video() calls, "
                             "which fastrecord record never makes: it would record nothing; drop --no-save-on-reset "
                             "(--keep success chooses which episodes are written), or call flush_trajectory() yourself "
                             "through fastrecord.RecordEpisode(..., save_on_reset=False)")
        if not (self.record.save_video or self.record.save_trajectory or self.record.lerobot):
            raise ValueError(
                "nothing to record: both the video and the trajectory are off; drop --no-video or --no-trajectory, "
                "or add --lerobot"
            )

    def _check_vector(self) -> None:
        if self.vector not in ("auto", "sync", "async"):
            raise ValueError(f"vector={self.vector!r} must be one of auto, sync, async (--vector)")
        if self.vector == "auto":
            return
        if self.sim_backend not in ("physx_cpu", "cpu"):
            raise ValueError(f"vector={self.vector!r} lays out CPU-simulated envs; sim_backend={self.sim_backend!r} "
                             f"runs every env in one batched env: drop --vector")
        if self.vector == "sync" and self.batched_render == "on":
            raise ValueError("batched_render='on' steps the envs in processes of their own and draws them here; "
                             "vector='sync' keeps them in this process: drop --vector sync or --batched-render on")
        if self.vector == "async" and self.record.render_substeps:
            raise ValueError("render_substeps=True draws every physics substep of envs in this process; "
                             "vector='async' puts them in processes of their own: drop --vector async (auto keeps "
                             "them here) or --render-substeps")

    @classmethod
    def option_names(cls) -> list[str]:
        """Every key a YAML preset (or a flag) may set: the run's own and `cli_option_names`."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "record"] + list(cli_option_names())

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> RecordConfig:
        """The config of flat ``values`` (YAML keys and flags): recording options go to `RecordOptions`,
        which checks them; its error then also names the flag and the config key. An ``env_kwargs`` entry
        that an option of the run names (``obs_mode``, ``reward_mode``, ...) becomes that option's value,
        an error if that option is given too (`ENV_OPTIONS`)."""
        values = lift_env_kwargs(values, ENV_OPTIONS, ENV_REFUSED)
        if "human_render_camera_configs" in values.get("env_kwargs", {}) and ({"width", "height"} & set(values)):
            raise ValueError(
                "the video camera is given twice: --width/--height and --env-kwargs human_render_camera_configs=... "
                "(or width:/height: and env_kwargs: in the --config file); pass one of them"
            )
        recording = {k: v for k, v in values.items() if k in cli_option_names()}
        own = {k: v for k, v in values.items() if k not in recording}
        return cls(**own, record=record_options({**RECORD_DEFAULTS, **recording}))

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-friendly values (a run manifest's ``args``)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "record"}
        rec = self.record.as_dict()
        return own | {k: rec[k] for k in cli_option_names()}
