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
from typing import Any, TypeVar

import yaml

T = TypeVar("T")


# ---------------------------------------------------------------------------------------------- checks
def check_at_least(cfg: Any, minimum: int, **flags: str) -> None:
    """Raise unless each named option (None allowed: "the default") is >= ``minimum``; ``flags`` maps
    option names to their command-line flag, for the message."""
    for name, flag in flags.items():
        value = getattr(cfg, name)
        if value is not None and value < minimum:
            raise ValueError(f"{name}={value!r} must be at least {minimum}; pass {flag} N with N >= {minimum} "
                             f"(or fix {name} in the --config file)")


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
