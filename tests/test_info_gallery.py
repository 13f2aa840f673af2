"""`fastrecord info` and `fastrecord gallery`: on fastrecord's runs (closed and still recording), on
ManiSkill's RecordEpisode output, and the gallery page rendered by a real headless browser (chromium)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

from fastrecord import RecordEpisode
from fastrecord.commands.cli import main
from fastrecord.commands.gallery import collect, write_gallery
from fastrecord.commands.info import describe
from fastrecord.testing import BatchedDoubleEnv


def _double_run(out: Path) -> dict:
    """13 episodes of the batched test double, 9 successes (env0 every 2 steps, env2 every 4) and 4 failures."""
    base = BatchedDoubleEnv(num_envs=4, max_episode_steps=6, success_step=[2, 0, 4, 0], size=32)
    env = ManiSkillVectorEnv(RecordEpisode(base, out, trajectory_name="t"), auto_reset=True, ignore_terminations=False)
    env.reset(seed=list(range(4)))
    for _ in range(12):
        env.step(torch.ones(4, 3))
    env.close()
    return json.loads((out / "t.json").read_text())


def _step_episodes(env, episodes: int, steps: int) -> None:
    for _ in range(episodes):
        for _ in range(steps):
            env.step(env.action_space.sample())
        env.reset()


# ---------------------------------------------------------------------------------------------- info
def test_info_real_run_while_recording_and_closed(make_env, tmp_path, capsys):
    out = tmp_path / "rec"
    env = RecordEpisode(make_env("PickCube-v1", obs_mode="state_dict", max_episode_steps=4), out, trajectory_name="run")
    env.reset(seed=0)
    _step_episodes(env, 1, 4)
    env.wait_until_done()
    # recording: NAME.h5 is an index of the parts, the manifest says so, the process is alive
    (live,) = describe(out)
    assert live["status"] == "recording" and live["episodes"] == 1
    assert live["parts"]["complete"] == live["parts"]["indexed"] >= 1 and live["parts"]["unindexed"] == []
    _step_episodes(env, 1, 3)  # episode 1 ends at step 3 by the reset (not the time limit)
    env.close()

    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(str(out / "run.h5"))
    assert "env: PickCube-v1   obs mode: state_dict   control mode: pd_joint_delta_pos   sim backend: physx_cpu" in text
    assert "episodes: 2, 0 successful (0.0%)" in text  # the episode begun by the last reset has no step: not saved
    assert "status: closed by fastrecord" in text and "parts: none" in text
    assert re.search(r"^    agent/qpos\s+\[9\] float32$", text, re.MULTILINE), text
    assert "actions (per step): [8] float32" in text

    assert main(["info", str(out / "run.h5"), "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    eps = json.loads((out / "run.json").read_text())["episodes"]
    lengths = [e["elapsed_steps"] for e in eps]
    assert run["episodes"] == 2 and lengths == [4, 3] and run["steps"] == 7
    assert run["episode_length"] == {"min": min(lengths), "mean": pytest.approx(np.mean(lengths)), "max": max(lengths)}
    assert run["success_rate"] == 0.0 and run["successes"] == 0
    assert run["observations"]["agent/qpos"] == {"shape": [9], "dtype": "float32"}
    assert run["observations"]["extra/is_grasped"] == {"shape": [], "dtype": "bool"}
    assert run["actions"] == {"shape": [8], "dtype": "float32"}
    assert {"rewards", "success", "terminated", "truncated"} <= set(run["other_fields"])
    assert run["status"] == "closed" and run["parts"] is None
    videos = sorted(out.glob("*.mp4"))
    f = run["files"]
    assert f["videos"] == len(videos) == 2
    assert f["h5_bytes"] == (out / "run.h5").stat().st_size and f["json_bytes"] == (out / "run.json").stat().st_size
    assert f["total_bytes"] == f["h5_bytes"] + f["json_bytes"] + sum(v.stat().st_size for v in videos)


def test_info_and_gallery_on_maniskill_recordepisode(make_env, tmp_path, capsys):
    from mani_skill.utils.wrappers import RecordEpisode as ManiSkillRecordEpisode

    out = tmp_path / "ms"
    env = ManiSkillRecordEpisode(make_env("PushCube-v1", max_episode_steps=3), str(out), save_video=True)
    env.reset(seed=1)
    _step_episodes(env, 2, 3)
    env.close()
    (h5,) = out.glob("*.h5")
    assert main(["info", str(out), "--json"]) == 0
    (run,) = json.loads(capsys.readouterr().out)["runs"]
    meta = json.loads(h5.with_suffix(".json").read_text())
    assert run["name"] == h5.stem and run["env_id"] == "PushCube-v1" and run["episodes"] == len(meta["episodes"])
    assert run["status"] == "unknown" and run["recorder"] is None  # no fastrecord manifest
    assert run["control_mode"] == "pd_joint_delta_pos" and run["actions"]["shape"] == [8]
    assert run["files"]["videos"] == len(list(out.glob("*.mp4"))) >= 1

    # ManiSkill names videos {k}.mp4: the gallery takes env and outcome from the folder's one JSON
    tiles = collect(out, out / "gallery.html")
    assert len(tiles) == len(list(out.glob("*.mp4")))
    by_id = {e["episode_id"]: e for e in meta["episodes"]}
    for t in tiles:
        assert t.env_id == "PushCube-v1" and t.run == h5.stem
        assert t.outcome == ("success" if by_id[t.episode_id]["success"] else "failure")


def test_info_folder_reports_each_run_and_errors(tmp_path, capsys):
    _double_run(tmp_path)
    (tmp_path / "broken.h5").write_bytes(b"not hdf5")
    (tmp_path / "broken.json").write_text(json.dumps({"env_info": {"env_id": "X-v1"}, "episodes": []}))
    assert main(["info", str(tmp_path)]) == 1  # one run cannot be read: reported, the other still described
    text = capsys.readouterr().out
    assert "error: " in text and "is not a readable HDF5 file" in text
    assert "episodes: 13, 9 successful (69.2%)" in text
    assert main(["info", str(tmp_path / "nothing")]) == 2
    assert "does not exist; pass a NAME.h5 trajectory or a folder" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- gallery
def test_gallery_labels_and_relative_links(tmp_path, capsys):
    meta = _double_run(tmp_path / "run")
    assert main(["gallery", str(tmp_path / "run")]) == 0
    page = tmp_path / "run" / "gallery.html"
    assert capsys.readouterr().out.strip() == f"gallery of 13 videos: {page}"
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "<link" not in text  # nothing from a network
    srcs = re.findall(r'<video src="([^"]+)"', text)
    assert sorted(srcs) == sorted(p.name for p in (tmp_path / "run").glob("*.mp4"))  # relative: the folder can move
    outcomes = {ep: o for o, ep in re.findall(r'data-outcome="(\w+)" data-episode="(\d+)"', text)}
    assert outcomes == {str(e["episode_id"]): ("success" if e["success"] else "failure") for e in meta["episodes"]}
    # a copy of the folder still works: same page, links resolve
    shutil.copytree(tmp_path / "run", tmp_path / "copy")
    assert all((tmp_path / "copy" / s).exists() for s in srcs)
    assert main(["gallery", str(tmp_path / "run" / "t.h5")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    (tmp_path / "novideo").mkdir()
    assert main(["gallery", str(tmp_path / "novideo")]) == 2  # a folder without videos: one line, nothing written
    assert "holds no MP4 video" in capsys.readouterr().err and not any((tmp_path / "novideo").iterdir())


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (scripts/setup.sh installs it: apt-get install -y chromium)")
    return exe


def _browse(exe: str, url: str, tmp_path: Path, *flags: str) -> subprocess.CompletedProcess:
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={tmp_path / 'chromium-profile'}",
           *flags, url]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        pytest.skip("chromium did not finish within 120 s")
    return r


def _screenshot(exe: str, url: str, tmp_path: Path, name: str) -> np.ndarray:
    shot = tmp_path / name
    r = _browse(exe, url, tmp_path, f"--screenshot={shot}", "--window-size=1200,900")
    if not shot.exists():
        pytest.skip(f"chromium cannot start here (exit {r.returncode}): {r.stderr.strip()[-300:]}")
    with av.open(str(shot)) as c:
        return next(c.decode(video=0)).to_ndarray(format="rgb24")


def _near(img: np.ndarray, rgb: tuple[int, int, int], tol: int = 12) -> np.ndarray:
    return (np.abs(img.astype(int) - np.array(rgb)) <= tol).all(axis=-1)


GREEN, RED, BACKGROUND = (0x1E, 0x9E, 0x3E), (0xD2, 0x2F, 0x2F), (0xF4, 0xF4, 0xF6)


def test_gallery_in_headless_chromium(tmp_path):
    exe = _chromium()
    meta = _double_run(tmp_path / "run")
    successes = sum(e["success"] for e in meta["episodes"])
    page = write_gallery(tmp_path / "run")
    url = page.resolve().as_uri()

    # the rendered DOM: one <video> per MP4, the filter from the address hides the others
    for address, hidden in ((url, 0), (url + "#failure", successes), (url + "?filter=success", 13 - successes)):
        r = _browse(exe, address, tmp_path, "--dump-dom")
        if "<video" not in r.stdout:
            pytest.skip(f"chromium cannot start here (exit {r.returncode}): {r.stderr.strip()[-300:]}")
        assert r.stdout.count("<video ") == 13
        figures = re.findall(r"<figure [^>]*>", r.stdout)
        assert len(figures) == 13 and sum("hidden" in f for f in figures) == hidden, address
        assert re.search(r'<span id="shown">(\d+)</span>', r.stdout)[1] == str(13 - hidden)

    # the screenshot: tiles drawn (green and red borders and badges, non-background area), and none green under #failure
    img = _screenshot(exe, url, tmp_path, "all.png")
    body = img[130:]  # below the title, summary and buttons
    assert _near(body, GREEN).sum() > 500 and _near(body, RED).sum() > 200
    assert (~_near(body, BACKGROUND, 3)).mean() > 0.3  # tiles cover the grid area
    rows = np.flatnonzero((_near(body, GREEN) | _near(body, RED)).any(axis=1))
    assert rows.max() - rows.min() > 400  # more than one row of tiles
    failures = _screenshot(exe, url + "#failure", tmp_path, "failure.png")[130:]
    assert _near(failures, GREEN).sum() == 0 and _near(failures, RED).sum() > 200


def test_gallery_lists_a_link_to_a_missing_video_without_failing(tmp_path):
    """`collect` tells a joined video from its shard's by inode; a link whose file is gone is listed, not fatal."""
    from fastrecord.commands.gallery import collect

    (tmp_path / "0_env0_success.mp4").symlink_to(tmp_path / "gone.mp4")
    assert [t.path.name for t in collect(tmp_path, tmp_path / "gallery.html")] == ["0_env0_success.mp4"]
