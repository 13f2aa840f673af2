"""Run configurations: frozen dataclasses that YAML presets (configs/) and CLI flags fill.

Every problem with a configuration (a missing or malformed file, an unknown option, a value of the wrong
type or out of range) is a ``ValueError`` naming the option, the value and the fix, raised before
anything is created or written: ``fastrecord <cmd>`` prints it as one line and exits with status 2.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastrecord.checks import check_at_least, check_types
from fastrecord.options import RecordOptions, cli_option_names, record_options

T = TypeVar("T")

# The recording options' values where the CLI's differ from the library's (one NAME, not a timestamp).
RECORD_DEFAULTS: dict[str, Any] = {"trajectory_name": "trajectory"}


def _default_record() -> RecordOptions:
    return RecordOptions(**RECORD_DEFAULTS)


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
    obs_mode: str = "state"  # ManiSkill observation mode recorded in the trajectory
    control_mode: str | None = None  # None: the task's default
    width: int = 256  # human render camera width
    height: int = 256  # human render camera height
    max_episode_steps: int | None = None  # None: the task's default
    seed: int = 0  # episode g (0, 1, ...) is reset with seed + g
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # extra gym.make kwargs
    record: RecordOptions = field(default_factory=_default_record)  # the recording options (flat keys in YAML and flags)

    def __post_init__(self) -> None:
        check_types(self)
        check_at_least(self, 1, num_envs="--num-envs", episodes="--episodes", width="--width", height="--height",
                       max_episode_steps="--max-episode-steps")
        if not (self.record.save_video or self.record.save_trajectory or self.record.lerobot):
            raise ValueError("nothing to record: both the video and the trajectory are off; drop --no-video or --no-trajectory, "
                             "or add --lerobot")

    @classmethod
    def option_names(cls) -> list[str]:
        """Every key a YAML preset (or a flag) may set: the run's own and `cli_option_names`."""
        return [f.name for f in dataclasses.fields(cls) if f.name != "record"] + list(cli_option_names())

    @classmethod
    def from_values(cls, values: dict[str, Any]) -> RecordConfig:
        """The config of flat ``values`` (YAML keys and flags): recording options go to `RecordOptions`,
        which checks them; its error then also names the flag and the config key."""
        recording = {k: v for k, v in values.items() if k in cli_option_names()}
        own = {k: v for k, v in values.items() if k not in recording}
        return cls(**own, record=record_options({**RECORD_DEFAULTS, **recording}))

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-friendly values (a run manifest's ``args``)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "record"}
        rec = self.record.as_dict()
        return own | {k: rec[k] for k in cli_option_names()}
