"""The `fastrecord record` main job, as a user runs it."""

from __future__ import annotations

import json

import h5py
import pytest

from fastrecord.commands.cli import main
from fastrecord.video import decode_mp4


def test_record_default_job_small(tmp_path, capsys):
    out = tmp_path / "rec"
    rc = main(["record", "PickCube-v1", "--episodes", "2", "--max-episode-steps", "4", "--width", "64",
               "--height", "64", "--output-dir", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "episodes: 2 finished, 2 kept" in printed and "env-steps/s" in printed
    eps = json.loads((out / "trajectory.json").read_text())["episodes"]
    assert [e["elapsed_steps"] for e in eps] == [4, 4]
    with h5py.File(out / "trajectory.h5") as f:
        assert sorted(f) == ["traj_0", "traj_1"]
    assert decode_mp4(out / "0_env0_failure.mp4").shape == (5, 64, 64, 3)


def test_record_vector_env_from_yaml(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text(f"env_id: PushCube-v1\nnum_envs: 2\nepisodes: 2\nmax_episode_steps: 3\nwidth: 64\nheight: 64\n"
                   f"output_dir: {tmp_path / 'rec'}\nkeep: failure\n")
    assert main(["record", "--config", str(cfg)]) == 0
    eps = json.loads((tmp_path / "rec" / "trajectory.json").read_text())["episodes"]
    assert len(eps) >= 2 and not any(e["success"] for e in eps)
    assert {p.name.split("_")[1] for p in (tmp_path / "rec").glob("*.mp4")} == {"env0", "env1"}


@pytest.mark.parametrize(
    "argv, match",
    [
        (["record", "NoSuchTask-v9"], "env_id='NoSuchTask-v9' is not a registered ManiSkill task"),
        (["record", "--policy", "nomodule"], "policy='nomodule' must be 'random' or 'module:factory'"),
    ],
)
def test_record_errors(tmp_path, capsys, argv, match):
    assert main(argv + ["--output-dir", str(tmp_path), "--episodes", "1", "--width", "32", "--height", "32"]) == 2
    assert match in capsys.readouterr().err


def test_unknown_yaml_option(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("env: PickCube-v1\n")
    assert main(["record", "--config", str(cfg)]) == 2
    assert "unknown option(s) ['env'] for RecordConfig" in capsys.readouterr().err
