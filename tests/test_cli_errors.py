"""Runtime failures of the CLI are one line and exit status 1 (issue 17.3): a full disk while writing
trajectories, while encoding and at start, a read-only or missing output folder for gallery and merge,
W&B without a login; `FASTRECORD_DEBUG=1` / `--debug` keep the traceback. Also ``-V``.

The folders: ``small_disk`` (a 2 MiB tmpfs) and ``read_only`` (a read-only tmpfs) of conftest.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import pytest

from conftest import tmpfs
from fastrecord.commands.cli import main
from fastrecord.video import decode_mp4

REPO = Path(__file__).parents[1]


def fill(disk: Path, leave: int) -> None:
    """Fill the small tmpfs ``disk`` until about ``leave`` bytes are free."""
    free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
    with open(disk / "filler", "wb") as f:
        try:
            f.write(os.urandom(max(0, free - leave)))
        except OSError:  # full: as meant when leave is 0
            pass


def fastrecord(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("FASTRECORD_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "fastrecord", *args], capture_output=True, text=True, env=env,
                          cwd=cwd, timeout=timeout)


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
    r = fastrecord("record", "PickCube-v1", "--episodes", "200", "--max-episode-steps", "10", "--width", "64",
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
    r = fastrecord("record", "PickCube-v1", "--episodes", "200", "--max-episode-steps", "10", "--width", "128",
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
    assert main(["record", "PickCube-v1", "--episodes", "1", "--max-episode-steps", "2", "--width", "64", "--height", "64",
                 "--output-dir", str(out)]) == 1
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
