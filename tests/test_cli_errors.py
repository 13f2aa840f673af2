"""Runtime failures of the CLI are one line and exit status 1 (issue 17.3): a full disk while writing
trajectories, while encoding and at start, a read-only or missing output folder for gallery and merge,
W&B without a login; `FASTRECORD_DEBUG=1` / `--debug` keep the traceback. Also ``-V``.

The folders: ``small_disk`` (a 2 MiB tmpfs) and ``read_only`` (a read-only tmpfs) of conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import h5py
import pytest
from conftest import fastrecord_cli, record_args, tmpfs

from fastrecord.commands.cli import main
from fastrecord.video import decode_mp4


def fill(disk: Path, leave: int) -> None:
    """Fill the small tmpfs ``disk`` until about ``leave`` bytes are free."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(disk / "filler", "wb") as f:
        try:
            f.write(os.urandom(max(0, free - leave)))
        except OSError:  # full: as meant when leave is 0
            pass


def assert_one_line(stderr: str, command: str) -> str:
    """The error line of ``stderr`` (progress bars aside): exactly one, no traceback."""
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("fastrecord ")]
    assert len(lines) == 1 and lines[0].startswith(f"fastrecord {command}: error: "), stderr
    return lines[0]


def test_short_version_flag(capsys):
    with pytest.raises(SystemExit) as e:
        main(["-V"])
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("fastrecord ")


def test_disk_full_while_writing_trajectories(small_disk, tmp_path):
    fill(small_disk, 300 << 10)
    out = small_disk / "rec"
    r = fastrecord_cli("record", "PickCube-v1", "--episodes", "200", "--max-episode-steps", "10", "--width", "64",
                       "--height", "64", "--obs-mode", "rgb", "--no-video", "--output-dir", str(out), cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    line = assert_one_line(r.stderr, "record")
    assert "No space left on device" in line and "safely on disk" in line, line
    eps = json.loads((out / "trajectory.json").read_text())["episodes"]
    assert eps
    with h5py.File(out / "trajectory.h5", "r") as f:  # the finished episodes are readable
        for e in eps:
            assert f[f"traj_{e['episode_id']}/actions"].shape[0] == e["elapsed_steps"]


def test_disk_full_while_encoding(small_disk, tmp_path):
    fill(small_disk, 120 << 10)
    out = small_disk / "rec"
    r = fastrecord_cli("record", "PickCube-v1", "--episodes", "200", "--max-episode-steps", "10", "--width", "128",
                       "--height", "128", "--no-trajectory", "--output-dir", str(out), cwd=tmp_path)
    assert r.returncode == 1, r.stderr
    line = assert_one_line(r.stderr, "record")
    assert "No space left on device" in line and f"kept and readable in {out}" in line, line
    videos = sorted(out.glob("*.mp4"))
    assert videos
    for v in videos:
        assert decode_mp4(v).shape[1:] == (128, 128, 3)


def test_no_space_at_start_leaves_nothing(small_disk, capsys):
    fill(small_disk, 0)
    out = small_disk / "rec"
    assert main(record_args(out, episodes=1, max_steps=2)) == 1
    line = assert_one_line(capsys.readouterr().err, "record")
    assert "No space left on device" in line and "nothing was written" in line, line
    assert sorted(p.name for p in small_disk.iterdir()) == ["filler"]  # no folder, no lock


def test_gallery_into_a_read_only_or_missing_folder(read_only, tmp_path, capsys):
    assert main(["gallery", str(tmp_path), "--output", str(read_only / "g.html")]) == 1
    line = assert_one_line(capsys.readouterr().err, "gallery")
    assert "is read-only" in line and "--output" in line, line
    assert main(["gallery", str(tmp_path), "--output", str(tmp_path / "missing" / "g.html")]) == 1
    line = assert_one_line(capsys.readouterr().err, "gallery")
    assert "does not exist" in line, line
    assert list(read_only.iterdir()) == []


def test_merge_into_a_read_only_folder(tmp_path, capsys, monkeypatch):
    from test_shards import _record_double

    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with tmpfs(tmp_path / "run", "size=4m") as mnt:
        _record_double(mnt, total=3)
        (mnt / "double.h5").unlink()  # the joined file to be made again
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        assert main(["merge", str(mnt), "--name", "double"]) == 1
        line = assert_one_line(capsys.readouterr().err, "merge")
        assert "read-only" in line, line


def test_wandb_without_a_login_is_refused_before_any_env(tmp_path, monkeypatch, capsys):
    for k in ("WANDB_API_KEY", "WANDB_MODE", "NETRC", "WANDB_BASE_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    out = tmp_path / "rec"
    assert main(["record", "PickCube-v1", "--log", "wandb", "--output-dir", str(out)]) == 1
    line = assert_one_line(capsys.readouterr().err, "record")
    assert "wandb login" in line and "WANDB_MODE=offline" in line, line
    assert not out.exists()
    from fastrecord.sinks.loggers import check_wandb_login

    monkeypatch.setenv("WANDB_MODE", "offline")
    check_wandb_login()  # offline needs no login
    monkeypatch.delenv("WANDB_MODE")
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password abc\n")
    (tmp_path / ".netrc").chmod(0o600)
    check_wandb_login()  # `wandb login` wrote this


def test_debug_keeps_the_traceback(tmp_path, monkeypatch):
    missing = str(tmp_path / "missing" / "g.html")
    with pytest.raises(FileNotFoundError):
        main(["--debug", "gallery", str(tmp_path), "--output", missing])
    with pytest.raises(FileNotFoundError):
        main(["gallery", str(tmp_path), "--output", missing, "--debug"])
    monkeypatch.setenv("FASTRECORD_DEBUG", "1")
    with pytest.raises(FileNotFoundError):
        main(["gallery", str(tmp_path), "--output", missing])


def test_a_policy_that_refuses_the_env_leaves_no_run(tmp_path, monkeypatch, capsys):
    """A policy factory's ``check_env`` sees the env before the recorder opens the run (issue 28.7): its
    refusal is one line, exit 2, and the output folder is not created."""
    (tmp_path / "picky_policy.py").write_text(
        "def factory(env):\n    raise AssertionError('check_env runs first')\n\n\n"
        "def _check(env):\n"
        "    raise ValueError(f'picky needs 7 envs, the env has {env.unwrapped.num_envs}; pass --num-envs 7')\n\n\n"
        "factory.check_env = _check\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "rec"
    assert main(["record", "PickCube-v1", "--policy", "picky_policy:factory", "--episodes", "1", "--width", "32",
                 "--height", "32", "--output-dir", str(out)]) == 2
    line = assert_one_line(capsys.readouterr().err, "record")
    assert line.endswith("picky needs 7 envs, the env has 1; pass --num-envs 7"), line
    assert not out.exists()


def test_debug_flag_keeps_the_traceback_of_a_refused_env_keyword(tmp_path):
    bad = ["record", "PickCube-v1", "--sim-config", '{"bogus": 1}', "--output-dir", str(tmp_path / "o")]
    r = fastrecord_cli(*bad, cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = assert_one_line(r.stderr, "record")
    assert "PickCube-v1 refused its keywords" in line and "bogus" in line, line
    r = fastrecord_cli(*bad, "--debug", cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" in r.stderr and "UnexpectedDataError" in r.stderr
    assert not (tmp_path / "o").exists()


def test_replay_refusals_on_a_default_recording_are_one_line(tmp_path, capsys):
    """A recording in the task's default control mode (pd_joint_delta_pos): ``-c pd_ee_delta_pose`` (ManiSkill's
    conversion code asserts it converts that mode to pd_joint_pos only) and a reward mode the task lacks are one
    line each, exit 2, nothing written."""
    src = tmp_path / "src"
    assert main(["record", "PickCube-v1", "--episodes", "1", "--max-episode-steps", "2", "--no-video",
                 "--output-dir", str(src)]) == 0
    capsys.readouterr()
    out = tmp_path / "rep"
    assert main(["replay", str(src / "trajectory.h5"), "-c", "pd_ee_delta_pose", "--output-dir", str(out)]) == 2
    line = assert_one_line(capsys.readouterr().err, "replay")
    assert line.endswith("ManiSkill's conversion code converts pd_joint_delta_pos only to pd_joint_pos, not to "
                         "'pd_ee_delta_pose'; pass -c pd_joint_pos (and convert that replay to 'pd_ee_delta_pose'), "
                         "or record in pd_joint_pos"), line
    assert main(["replay", str(src / "trajectory.h5"), "--reward-mode", "foo", "--output-dir", str(out)]) == 2
    line = assert_one_line(capsys.readouterr().err, "replay")
    assert line.endswith("reward_mode='foo' is not a reward mode of PickCube-v1; use one of normalized_dense, dense, "
                         "sparse, none"), line
    assert not out.exists()
