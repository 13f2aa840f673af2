"""The public API: declared once, typed, and documented.

- The wrappers' explicit parameters are `RecordOptions`' fields (names, defaults, order, keyword-only
  split, types), after ManiSkill 3.0.1's ``RecordEpisode`` parameters in ManiSkill's order, so the
  two declarations cannot drift; positional arguments land where ManiSkill puts them.
- Every package declares ``__all__``, and every name in it imports.
- docs/api.md lists exactly the top-level ``fastrecord.__all__``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from pathlib import Path

import pytest

import fastrecord
from fastrecord.options import RecordOptions
from fastrecord.record import RecordEpisode, RecordVectorEpisode
from fastrecord.testing import BatchedDoubleEnv

ROOT = Path(__file__).parents[1]
SRC = ROOT / "src" / "fastrecord"
P = inspect.Parameter


def _option_params(cls: type) -> list[inspect.Parameter]:
    params = list(inspect.signature(cls).parameters.values())
    assert [p.name for p in params[:2]] == ["env", "output_dir"] and params[-1].name == "sinks"
    assert params[-1].kind is P.KEYWORD_ONLY and params[-1].default == ()
    return params[2:-1]


@pytest.mark.parametrize("cls", [RecordEpisode, RecordVectorEpisode])
def test_wrapper_parameters_are_record_options_fields(cls):
    """Names, order, defaults, keyword-only split and the annotation text of each parameter equal the
    field's; inspect.signature(cls) (what help() and IDEs show) is its __init__'s, without self."""
    fields = dataclasses.fields(RecordOptions)
    params = _option_params(cls)
    assert [p.name for p in params] == [f.name for f in fields]
    for p, f in zip(params, fields, strict=True):
        assert p.default == f.default, p.name
        assert p.kind is (P.KEYWORD_ONLY if f.kw_only else P.POSITIONAL_OR_KEYWORD), p.name
        assert p.annotation == f.type, p.name  # both the source text (from __future__ import annotations)
    init = list(inspect.signature(cls.__init__).parameters.values())
    assert init[0].name == "self" and init[1:] == list(inspect.signature(cls).parameters.values())
    assert inspect.signature(cls.__init__).return_annotation == "None"


def test_maniskill_parameters_come_first_in_maniskills_order():
    from mani_skill.utils.wrappers import RecordEpisode as MSRecordEpisode

    theirs = list(inspect.signature(MSRecordEpisode.__init__).parameters.values())[3:]  # after self, env, output_dir
    ours = _option_params(RecordEpisode)
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    assert [p.default for p in ours[: len(theirs)]] == [p.default for p in theirs]
    assert all(p.kind is P.POSITIONAL_OR_KEYWORD for p in ours[: len(theirs)])
    assert all(p.kind is P.KEYWORD_ONLY for p in ours[len(theirs):])  # fastrecord's additions


def test_positional_arguments_in_maniskills_order(tmp_path):
    """RecordEpisode(env, dir, save_trajectory, trajectory_name, save_video, ...) as ManiSkill's: the
    recorder gets each value under its name, and writes under that trajectory name."""
    env = RecordEpisode(BatchedDoubleEnv(num_envs=2, max_episode_steps=3), tmp_path, True, "pos", False,
                        False, True, None, None, True, False, record_env_state=True, keep="success")
    try:
        assert env.options.trajectory_name == "pos" and env.options.save_video is False
        assert env.options.record_reward is False and env.options.keep == "success"
        assert env.save_trajectory is True and env.record_reward is False
        assert Path(env._h5_file.filename) == tmp_path / "pos.h5"
    finally:
        env.close()


def test_bad_call_names_every_parameter(tmp_path):
    with pytest.raises(TypeError, match=r"RecordEpisode: .*unexpected keyword argument 'trajectory_nmae'; "
                                        r"did you mean 'trajectory_name'\? its parameters are \['env', 'output_dir'"):
        RecordEpisode(BatchedDoubleEnv(), tmp_path, trajectory_nmae="x")
    with pytest.raises(TypeError, match=r"multiple values for argument 'save_trajectory'"):
        RecordEpisode(BatchedDoubleEnv(), tmp_path, True, save_trajectory=False)
    with pytest.raises(TypeError, match=r"too many positional arguments.*'keep'"):  # keyword-only past ManiSkill's
        RecordEpisode(BatchedDoubleEnv(), tmp_path, *[f.default for f in dataclasses.fields(RecordOptions)][:16])
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_make_eval_envs_signature_is_typed():
    """Every parameter typed but ``env_id`` (the diffusion-policy baseline's, kept untyped as the baseline
    has it: tests/test_make_eval_envs.py), and the return."""
    sig = inspect.signature(fastrecord.make_eval_envs)
    untyped = [n for n, p in sig.parameters.items() if p.annotation is P.empty]
    assert untyped == ["env_id"]
    assert sig.return_annotation == "gym.vector.VectorEnv"


def test_replay_trajectories_parameters_are_replay_options():
    """`replay_trajectories` declares every replay option (ReplayConfig's fields, then the recording options it
    takes), keyword-only, in that order, each with the option's default (None where the replay decides) and
    type, so an IDE and a type checker see them and the two declarations cannot drift."""
    from fastrecord.replay.config import RECORDING_OPTIONS, REPLAY_DEFAULTS, ReplayConfig

    params = list(inspect.signature(fastrecord.replay_trajectories).parameters.values())
    assert [p.name for p in params[:2]] == ["traj_path", "output_dir"]
    assert [p.name for p in params[-2:]] == ["stop", "sinks"]
    options = params[2:-2]
    assert [p.name for p in options] == [n for n in ReplayConfig.option_names() if n not in ("traj_path", "output_dir")]
    assert all(p.kind is P.KEYWORD_ONLY for p in params[2:])
    own = {f.name: f for f in dataclasses.fields(ReplayConfig)}
    recording = {f.name: f for f in dataclasses.fields(RecordOptions)}
    for p in options:
        if p.name in own:
            f = own[p.name]
            default = None if f.default is dataclasses.MISSING else f.default  # env_kwargs: None, an empty dict
            annotation = f.type if f.default is not dataclasses.MISSING else f"{f.type} | None"
        else:
            assert p.name in RECORDING_OPTIONS
            f = recording[p.name]
            default = REPLAY_DEFAULTS.get(p.name, f.default)
            annotation = f.type if p.name not in REPLAY_DEFAULTS or "None" in f.type else f"{f.type} | None"
            annotation = "str | None" if p.name == "keep" else annotation  # a replay's keep is a choice, no callable
        assert p.default == default, p.name
        assert p.annotation == annotation, p.name
    assert inspect.signature(fastrecord.replay_trajectories).return_annotation == "ReplaySummary"


def _packages() -> list[str]:
    return sorted(".".join(("fastrecord", *p.parent.relative_to(SRC).parts)) for p in SRC.rglob("__init__.py"))


def test_every_package_declares_all_and_each_name_imports():
    packages = _packages()
    assert {"fastrecord", "fastrecord.sinks", "fastrecord.replay", "fastrecord.commands"} <= set(packages)
    for name in packages:
        module = importlib.import_module(name)
        names = getattr(module, "__all__", None)
        assert isinstance(names, list), f"{name} declares no __all__"
        assert len(set(names)) == len(names), f"{name}.__all__ repeats a name"
        missing = [n for n in names if getattr(module, n, None) is None]
        assert not missing, f"{name}.__all__ names {missing}, which do not import"
    # the lazily imported packages: __all__ and their table of modules agree
    for module in (fastrecord, importlib.import_module("fastrecord.replay")):
        assert sorted(module.__all__) == sorted(module._EXPORTS), module.__name__


def test_docs_api_lists_the_top_level_all():
    """docs/api.md's table under "## `fastrecord`" has one row per name of ``fastrecord.__all__``."""
    text = (ROOT / "docs" / "api.md").read_text()
    section = text.split("\n## `fastrecord`\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| `([A-Za-z_]+)` \|", section, flags=re.M)
    assert sorted(listed) == sorted(fastrecord.__all__)
    assert len(listed) == len(set(listed))
