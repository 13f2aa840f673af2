"""Checks of configuration values and YAML preset loading, shared by the run configurations
(`fastrecord.commands.config.RecordConfig`, `fastrecord.replay.ReplayConfig`, the benchmark's config).

Every problem (a missing or malformed file, an unknown option, a value of the wrong type or out of range)
is a ``ValueError`` naming the option, the value and the fix, raised before anything is created or written.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import yaml

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")  # a configuration dataclass


# ---------------------------------------------------------------------------------------------- checks
def check_at_least(cfg: Any, minimum: int, *names: str, **flags: str) -> None:
    """Raise unless each named option (None allowed: "the default") is >= ``minimum``. An option of
    ``names`` is named as a Python keyword (`load_config`, the command line's path, adds its flag); one of
    ``flags`` (a command-line-only config: option -> how to set it) is named with its flag."""
    for name in [*names, *flags]:
        value = getattr(cfg, name)
        if value is None or value >= minimum:
            continue
        if name in flags:
            raise ValueError(f"{name}={value!r} must be at least {minimum}; pass {flags[name]} N with N >= {minimum} "
                             f"(or fix {name} in the --config file)")
        raise ValueError(f"{name}={value!r} must be at least {minimum}; pass {name}={minimum} or more")


# The largest frame side a video can have: libx264 refuses wider or taller frames (measured with PyAV: 16384
# encodes, 16400 does not), and Vulkan's renderers commonly stop there too. Checked before anything renders.
MAX_FRAME_SIDE = 16384


def check_frame_size(cfg: Any, *names: str) -> None:
    """Raise unless each named option (None allowed) is at most `MAX_FRAME_SIDE` pixels."""
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value > MAX_FRAME_SIDE:
            raise ValueError(f"{name}={value!r} is larger than the {MAX_FRAME_SIDE} pixels H.264 (libx264) encodes; "
                             f"pass {name}={MAX_FRAME_SIDE} or less")


def flag_hint(message: str, names: Any) -> str:
    """``message`` (a config's ValueError, "NAME=VALUE ...") with NAME's command-line flag and config key
    added, where NAME is one of ``names`` and the message names no flag yet: what the command line shows."""
    name = message.split("=", 1)[0]
    if name not in names or "--" in message or not name.isidentifier():
        return message
    return f"{message} (the --{name.replace('_', '-')} flag, or {name}: in the --config file)"


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
        raise ValueError(
            f"config file {str(path)!r} does not exist; pass the path of a YAML preset (see configs/)"
        ) from None
    except IsADirectoryError:
        raise ValueError(
            f"config file {str(path)!r} is a directory; pass the path of a YAML preset (see configs/)"
        ) from None
    except UnicodeDecodeError:
        raise ValueError(
            f"config file {str(path)!r} is not a text (YAML) file; pass a YAML preset (see configs/)"
        ) from None
    except OSError as e:
        raise ValueError(
            f"config file {str(path)!r} cannot be read ({e.strerror}); check the path and its permissions"
        ) from None
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
        raise ValueError(
            f"config file {str(path)!r} must hold a mapping of option: value, got {type(loaded).__name__}; "
            f"write one 'option: value' per line (see configs/)"
        )
    return loaded


def load_config(cls: type[T], path: str | Path | None = None, **overrides: Any) -> T:
    """Fill ``cls`` from a YAML file, then from ``overrides`` (None values are ignored; a mapping adds to
    the file's mapping of that key).

    Raises ValueError (file, line and fix) for a missing or malformed file, an unknown option, and
    whatever the dataclass's own checks refuse."""
    values: dict[str, Any] = {}
    if path is not None:
        values.update(_read_yaml(path))
    for k, v in overrides.items():
        if v is None:
            continue
        # a mapping flag (--env-kwargs) adds to the file's mapping, its keys replacing the file's
        values[k] = {**values[k], **v} if isinstance(v, dict) and isinstance(values.get(k), dict) else v
    option_names = getattr(cls, "option_names", None)  # a config with nested options lists its flat keys
    names = set(option_names()) if option_names else {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names, key=str)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for {cls.__name__}; valid options: {sorted(names)}")
    from_values = getattr(cls, "from_values", None)
    try:
        cfg = from_values(values) if from_values else cls(**values)
    except ValueError as e:
        hinted = flag_hint(str(e), names)
        if hinted == str(e):
            raise
        raise ValueError(hinted) from None
    check_types(cfg)  # also for configs without checks of their own
    return cfg


# ---------------------------------------------------------------------------------------------- gym.make keywords
def parse_env_kwarg(text: str) -> tuple[str, Any]:
    """One ``--env-kwargs`` item, ``KEY=VALUE`` -> ``(KEY, value)``: the value parsed as JSON where it parses
    (``5``, ``true``, ``'{"sim_freq": 200}'``, ``'["panda", "panda"]'``), else the string as given
    (``dense``, ``rt-fast``). An argparse ``type``: a bad item is an ``argparse.ArgumentTypeError``."""
    import argparse

    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key.isidentifier():
        raise argparse.ArgumentTypeError(
            f"{text!r} is not KEY=VALUE; pass gym.make keywords as KEY=VALUE items, e.g. --env-kwargs "
            f"reward_mode=dense shader_dir=rt-fast sim_config='{{\"sim_freq\": 200}}'"
        )
    return key, json_or_text(raw)


def json_or_text(raw: str) -> Any:
    """``raw`` parsed as JSON where it parses, else the string itself."""
    import json

    try:
        return json.loads(raw)
    except ValueError:
        return raw


def json_flag(flag: str, kinds: tuple[type, ...], example: str) -> Any:
    """An argparse ``type`` for a flag whose value is JSON of one of ``kinds`` (``dict``: a JSON object)."""
    import argparse
    import json

    def parse(raw: str) -> Any:
        try:
            value = json.loads(raw)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{raw!r} is not JSON ({e}); pass e.g. {flag} '{example}'") from None
        if not isinstance(value, kinds):
            raise argparse.ArgumentTypeError(
                f"{raw!r} is a JSON {type(value).__name__}, not a JSON object; pass e.g. {flag} '{example}'"
            )
        return value

    return parse


def env_kwargs_of(pairs: list[tuple[str, Any]] | None) -> dict[str, Any] | None:
    """The dict of ``--env-kwargs`` items (None: the flag was not given); a key given twice is a ValueError."""
    if pairs is None:
        return None
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"--env-kwargs gives {key} twice ({key}={out[key]!r} and {key}={value!r}); pass it once")
        out[key] = value
    return out


def lift_env_kwargs(
    values: dict[str, Any], options: dict[str, str], refused: dict[str, str] | None = None
) -> dict[str, Any]:
    """``values`` (a config's flat keys: YAML and flags) with the entries of ``values["env_kwargs"]`` that
    the config has an option of its own for (``options``: gym.make key -> the option's flag) moved to that
    option, so that one value decides each key. A key that ``values`` also gives through its option is a
    ValueError naming both; a key of ``refused`` (key -> why and the fix) is refused in ``env_kwargs``."""
    env_kwargs = values.get("env_kwargs")
    if not isinstance(env_kwargs, dict):
        return values  # check_types reports it
    out, rest = dict(values), dict(env_kwargs)
    for key, why in (refused or {}).items():
        if key in rest:
            raise ValueError(
                f"env_kwargs {key}={rest[key]!r} (--env-kwargs, or env_kwargs: in the --config file): {why}"
            )
    for key, flag in options.items():
        if key not in rest:
            continue
        if values.get(key) is not None:
            raise ValueError(
                f"{key} is given twice: {flag} {values[key]!r} and --env-kwargs {key}={rest[key]!r} (or {key}: "
                f"and env_kwargs: in the --config file); pass one of them"
            )
        out[key] = rest.pop(key)
    out["env_kwargs"] = rest
    return out
