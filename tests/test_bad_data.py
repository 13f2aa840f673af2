"""Bad data is caught: non-finite values and length mismatches in a trajectory are named by `fastrecord
info` (exit 1) and refused by `fastrecord replay` before any env is made; a replay whose env produces
non-finite data stops at that episode instead of writing it.

A real PickCube-v1 recording (CPU, state observations, 3 episodes of 6 steps), corrupted with h5py or
by overwriting the bytes of a dataset.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from conftest import CAMERA

from fastrecord.commands.cli import main
from fastrecord.sinks.maniskill_h5 import EpisodeProblem, check_episode

STEPS = 6


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    import mani_skill.envs  # noqa: F401

    from fastrecord import RecordEpisode

    out = tmp_path_factory.mktemp("clean")
    env = RecordEpisode(gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                                 control_mode="pd_ee_delta_pos", human_render_camera_configs=CAMERA,
                                 max_episode_steps=20), str(out), trajectory_name="demo", save_video=False)
    rng = np.random.default_rng(0)
    for seed in range(3):
        env.reset(seed=seed)
        for _ in range(STEPS):
            env.step(rng.uniform(-1, 1, (1, 4)).astype(np.float32))
        env.flush_trajectory()
    env.close()
    return out / "demo.h5"


def copy_of(src: Path, folder: Path) -> Path:
    folder.mkdir()
    for suffix in (".h5", ".json"):
        shutil.copy(src.with_suffix(suffix), folder / f"demo{suffix}")
    return folder / "demo.h5"


def a_state_leaf(group: h5py.Group) -> str:
    names: list[str] = []
    group["env_states"].visit(lambda n: names.append(n) if isinstance(group["env_states"][n], h5py.Dataset) else None)
    return "env_states/" + sorted(names)[0]


def problems_of(path: Path) -> list[str]:
    meta = json.loads(path.with_suffix(".json").read_text())
    with h5py.File(path) as f:
        return [str(p) for ep in meta["episodes"] for p in check_episode(f[f"traj_{ep['episode_id']}"], ep)]


def replay_cli(path: Path, out: Path) -> list[str]:
    return ["replay", str(path), "--output-dir", str(out), "--num-envs", "1", "--no-video", "--by", "actions",
            "--quiet"]


def test_a_clean_recording_has_no_problems(clean, tmp_path, capsys):
    assert problems_of(clean) == []
    assert main(["info", str(clean)]) == 0
    assert "problems" not in capsys.readouterr().out
    assert main(["info", str(clean), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["runs"][0]["problems"] == []


def test_nan_env_states_are_named_by_info_and_refused_by_replay(clean, tmp_path, capsys):
    path = copy_of(clean, tmp_path / "nan")
    with h5py.File(path, "r+") as f:
        leaf = a_state_leaf(f["traj_1"])
        f["traj_1"][leaf][2:4] = np.nan
        width = int(np.prod(f["traj_1"][leaf].shape[1:]))
    expected = f"traj_1: {leaf} has {2 * width} non-finite values at steps 2-3"
    assert problems_of(path) == [expected]

    assert main(["info", str(path)]) == 1
    printed = capsys.readouterr().out
    assert f"  problems: {expected} (1 of 3 episodes bad;" in printed
    assert main(["info", str(path), "--json"]) == 1
    run = json.loads(capsys.readouterr().out)["runs"][0]
    assert run["problems"] == [
        {"episode": "traj_1", "field": leaf, "problem": f"has {2 * width} non-finite values at steps 2-3"}
    ]

    out = tmp_path / "replayed"
    assert main(replay_cli(path, out)) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert expected in err[0] and "--count 1" in err[0] and "Traceback" not in err[0]
    assert not out.exists()  # refused before any env or file was made

    # worker processes make their envs while the data is checked: ended before they write anything, the same error
    workers = tmp_path / "by_workers"
    assert main(["replay", str(path), "--output-dir", str(workers), "--no-video", "--by", "actions", "--workers", "2",
                 "--num-envs", "2", "--quiet"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0], err
    assert not workers.exists()  # no shard, manifest or folder left
    # with --overwrite the claim, which deletes the earlier replay, waits for the check (the workers make their envs
    # meanwhile): a bad input leaves the earlier replay as it was, every file and folder of it
    assert main(replay_cli(clean, workers)) == 0
    capsys.readouterr()
    earlier = {str(p.relative_to(workers)): p.read_bytes() if p.is_file() else None for p in workers.rglob("*")}
    assert main(["replay", str(path), "--output-dir", str(workers), "--no-video", "--by", "actions", "--workers", "2",
                 "--num-envs", "2", "--quiet", "--overwrite"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0] and "Traceback" not in err[0], err
    assert {str(p.relative_to(workers)): p.read_bytes() if p.is_file() else None for p in workers.rglob("*")} == earlier


def test_truncated_actions_are_a_length_mismatch(clean, tmp_path, capsys):
    path = copy_of(clean, tmp_path / "short")
    with h5py.File(path, "r+") as f:
        actions = f["traj_0/actions"][:-1]
        del f["traj_0/actions"]
        f["traj_0"].create_dataset("actions", data=actions)
    assert problems_of(path) == [f"traj_0: actions has {STEPS - 1} rows, but the episode has elapsed_steps {STEPS} "
                                 f"in the JSON (T = {STEPS} expected)"]
    assert main(["info", str(path)]) == 1
    assert "  problems: traj_0: actions has 5 rows" in capsys.readouterr().out

    assert main(replay_cli(path, tmp_path / "replayed")) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "traj_0: actions has 5 rows" in err[0] and "remove them" in err[0], err


def test_overwritten_bytes_are_caught(clean, tmp_path, capsys):
    """The issue's case: bytes of the file overwritten where an env state is stored."""
    path = copy_of(clean, tmp_path / "bytes")
    with h5py.File(path, "r") as f:
        leaf = a_state_leaf(f["traj_2"])
        d = f["traj_2"][leaf]
        offset = d.id.get_offset() if d.chunks is None else d.id.get_chunk_info(0).byte_offset
        size = d.id.get_storage_size() if d.chunks is None else d.id.get_chunk_info(0).size
    with open(path, "r+b") as raw:
        raw.seek(offset)
        raw.write(b"\xff" * size)  # 0xffffffff is a NaN float32 (or a chunk that no longer decompresses)
    found = problems_of(path)
    assert len(found) == 1 and found[0].startswith(f"traj_2: {leaf} ")
    assert main(["info", str(path)]) == 1
    assert f"traj_2: {leaf}" in capsys.readouterr().out
    assert main(replay_cli(path, tmp_path / "replayed")) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"traj_2: {leaf}" in err[0] and "--count 2" in err[0], err


def test_a_replay_producing_non_finite_data_stops_at_that_episode(clean, tmp_path, monkeypatch):
    """NaN env states get past a disabled input check and are set into the env by a replay by states: the
    env's observations and states turn non-finite, and the replay stops at that episode, having written
    only the ones before it."""
    from fastrecord.replay import ReplayConfig, plan, run_replay

    path = copy_of(clean, tmp_path / "nan_actions")
    with h5py.File(path, "r+") as f:
        f["traj_1"][a_state_leaf(f["traj_1"])][3] = np.nan
    monkeypatch.setattr(plan, "check_input", lambda traj, episodes: None)
    out = tmp_path / "replayed"
    cfg = ReplayConfig.from_values(dict(traj_path=str(path), output_dir=str(out), progress=False, vector="sync",
                                        num_envs=1, save_video=False, by="states", workers=1))
    with pytest.raises(ValueError, match=r"the replay of demo.h5 traj_1 produced \d+ non-finite values in "):
        run_replay(cfg)
    written = sorted(out.glob("*.h5"))
    assert len(written) == 1
    assert problems_of(written[0]) == []
    assert [e["source_episode_id"] for e in json.loads(written[0].with_suffix(".json").read_text())["episodes"]] == [0]


def test_episode_problem_reads_as_one_line():
    p = EpisodeProblem("traj_3", "env_states/actors/cube", "has 12 non-finite values at steps 4-9")
    assert str(p) == "traj_3: env_states/actors/cube has 12 non-finite values at steps 4-9"
