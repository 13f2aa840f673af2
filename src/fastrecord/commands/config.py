"""Run configurations: frozen dataclasses that YAML presets (configs/) and CLI flags fill.

Every problem with a configuration (a missing or malformed file, an unknown option, a value of the wrong
type or out of range) is a ``ValueError`` naming the option, the value and the fix, raised before
anything is created or written: ``fastrecord <cmd>`` prints it as one line and exits with status 2.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import yaml

from fastrecord.options import RecordOptions, check_video_fps, cli_option_names, flag_of

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
        if not (self.record.save_video or self.record.save_trajectory):
            raise ValueError("nothing to record: both the video and the trajectory are off; drop --no-video or --no-trajectory")

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
        try:
            record = RecordOptions(**{**RECORD_DEFAULTS, **recording})
        except ValueError as e:
            name = str(e).split("=", 1)[0]
            if name not in cli_option_names():
                raise
            raise ValueError(f"{e} (the {flag_of(name)} flag, or {name}: in the --config file)") from None
        return cls(**own, record=record)

    def as_dict(self) -> dict[str, Any]:
        """Flat, JSON-friendly values (a run manifest's ``args``)."""
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "record"}
        rec = self.record.as_dict()
        return own | {k: rec[k] for k in cli_option_names()}


# ---------------------------------------------------------------------------------------------- checks
def check_at_least(cfg: Any, minimum: int, **flags: str) -> None:
    """Raise unless each named option (None allowed: "the default") is >= ``minimum``; ``flags`` maps
    option names to their command-line flag, for the message."""
    for name, flag in flags.items():
        value = getattr(cfg, name)
        if value is not None and value < minimum:
            raise ValueError(f"{name}={value!r} must be at least {minimum}; pass {flag} N with N >= {minimum} "
                             f"(or fix {name} in the --config file)")


def check_fps(fps: float | None) -> None:
    """`fastrecord.options.check_video_fps` (None allowed), naming the flag and the config key."""
    try:
        check_video_fps(fps, allow_none=True)
    except ValueError as e:
        raise ValueError(f"{e} (the --video-fps flag, or video_fps: in the --config file)") from None


def check_choice(cfg: Any, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise ValueError(f"{name}={value!r} is unknown; use one of {', '.join(choices)}")


def _matches(value: Any, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if hint is Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin in (tuple, list):  # YAML gives lists for tuples
        return isinstance(value, (tuple, list)) and all(_matches(v, typing.get_args(hint)[0]) for v in value)
    if origin is dict:
        return isinstance(value, dict)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _describe(hint: Any) -> str:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) in (tuple, list):
        return f"a list of {_describe(args[0])}"
    if typing.get_origin(hint) is dict:
        return "a mapping"
    return getattr(hint, "__name__", str(hint))


def check_types(cfg: Any) -> None:
    """Raise if a field holds a value of another type than its annotation (a YAML ``num_envs: two``)."""
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if not _matches(value, hints[f.name]):
            raise ValueError(f"{f.name}={value!r} must be {_describe(hints[f.name])}, not {type(value).__name__}; "
                             f"fix {f.name} in the --config file (or its flag)")


# ---------------------------------------------------------------------------------------------- loading
def _read_yaml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ValueError(f"config file {str(path)!r} does not exist; pass the path of a YAML preset (see configs/)") from None
    except IsADirectoryError:
        raise ValueError(f"config file {str(path)!r} is a directory; pass the path of a YAML preset (see configs/)") from None
    except UnicodeDecodeError:
        raise ValueError(f"config file {str(path)!r} is not a text (YAML) file; pass a YAML preset (see configs/)") from None
    except OSError as e:
        raise ValueError(f"config file {str(path)!r} cannot be read ({e.strerror}); check the path and its permissions") from None
    try:
        loaded = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        context, context_mark = getattr(e, "context", None), getattr(e, "context_mark", None)
        if context and context_mark is not None and mark is not None and context_mark.line != mark.line:
            problem += f" ({context} from line {context_mark.line + 1})"
        raise ValueError(f"config file {str(path)!r} is not valid YAML{where}: {problem}; "
                         f"write one 'option: value' per line (see configs/)") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ValueError(f"config file {str(path)!r} must hold a mapping of option: value, got {type(loaded).__name__}; "
                         f"write one 'option: value' per line (see configs/)")
    return loaded


def load_config(cls: type[T], path: str | Path | None = None, **overrides: Any) -> T:
    """Fill ``cls`` from a YAML file, then from ``overrides`` (None values are ignored).

    Raises ValueError (file, line and fix) for a missing or malformed file, an unknown option, and
    whatever the dataclass's own checks refuse."""
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_read_yaml(path))
    values.update({k: v for k, v in overrides.items() if v is not None})
    option_names = getattr(cls, "option_names", None)  # a config with nested options lists its flat keys
    names = set(option_names()) if option_names else {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names, key=str)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {cls.__name__}; valid options: {sorted(names)}")
    from_values = getattr(cls, "from_values", None)
    cfg = from_values(values) if from_values else cls(**values)
    check_types(cfg)  # also for configs without checks of their own
    return cfg
