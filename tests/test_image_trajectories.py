"""Trajectories with image observations (issue 9): written by several writer processes with each
compression choice, read back value for value against what the env produced, and read by ManiSkill's
own tools (`ManiSkillTrajectoryDataset`, ``replay_trajectory --use-env-states``)."""

from __future__ import annotations

import json
import subprocess
import sys

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch

from fastrecord import RecordEpisode
from fastrecord.options import RecordOptions
from fastrecord.sinks.maniskill_h5 import TrajectoryWriter
from fastrecord.testing import BatchedDoubleEnv


def _np_tree(obs) -> dict[str, np.ndarray]:
    """{"agent/qpos": array [N, ...], ...}: the env's observation as numpy leaves (copies)."""
    out = {}

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}/{k}" if path else k)
        else:
            out[path] = x.detach().cpu().numpy().copy()

    walk(obs, "")
    return out


def _read_tree(group: h5py.Group, prefix: str = "") -> dict[str, np.ndarray]:
    out = {}
    for k, v in group.items():
        path = f"{prefix}/{k}" if prefix else k
        out.update(_read_tree(v, path) if isinstance(v, h5py.Group) else {path: v[:]})
    return out


def record_batched(tmp_path, writers: int, compression: str, num_envs: int = 5, steps: int = 23):
    """Record the rgb double with per-env lengths and successes from the env, resetting only finished envs.
    Returns the episodes as the env produced them, in the order fastrecord numbers them."""
    lengths = lambda e, seed: 2 + (3 * e + seed) % 6  # noqa: E731 - 2..7 steps, drawn by the env at each reset
    src = BatchedDoubleEnv(num_envs=num_envs, max_episode_steps=8, size=12, obs_mode="rgb", episode_lengths=lengths,
                           success_step=[0, 0, 3, 0, 4][:num_envs])
    # what gym.make would attach: the JSON's env_info (ManiSkill's dataset reads env_id from it)
    src.spec = gym.envs.registration.EnvSpec(
        "fastrecord-BatchedDouble-v0",
        entry_point="fastrecord.testing:BatchedDoubleEnv",
        max_episode_steps=8,
        kwargs=dict(obs_mode="rgb", size=12),
    )
    env = RecordEpisode(src, tmp_path, trajectory_name="img", save_video=False, trajectory_writers=writers,
                        trajectory_compression=compression)
    seed = 0
    obs, _ = env.reset(seed=list(range(num_envs)))
    seed += num_envs
    current = [{"obs": [_np_tree(obs)], "actions": [], "seed": e} for e in range(num_envs)]
    finished = []
    rng = np.random.default_rng(0)
    for _ in range(steps):
        action = torch.as_tensor(rng.uniform(-1, 1, (num_envs, 3)), dtype=torch.float32)
        obs, _, term, trunc, _ = env.step(action)
        leaves = _np_tree(obs)
        for e in range(num_envs):
            current[e]["obs"].append(dict(leaves.items()))
            current[e]["actions"].append(action[e].numpy())
        done = torch.nonzero(term | trunc).reshape(-1).numpy()
        if len(done):
            for e in done:
                finished.append((e, current[e]))
            seeds = list(range(seed, seed + len(done)))
            seed += len(done)
            obs, _ = env.reset(seed=seeds, options={"env_idx": done})
            leaves = _np_tree(obs)
            for e, s in zip(done, seeds):
                current[e] = {"obs": [leaves], "actions": [], "seed": s}
    for e in range(num_envs):  # close() saves the episodes in progress, in env order
        if current[e]["actions"]:
            finished.append((e, current[e]))
    env.close()
    return finished


def expected_obs(env_idx: int, ep: dict) -> dict[str, np.ndarray]:
    return {k: np.stack([o[k][env_idx] for o in ep["obs"]]) for k in ep["obs"][0]}


@pytest.mark.parametrize("writers,compression", [(2, "gzip:1"), (3, "lzf"), (1, "none"), (2, "gzip:5")])
def test_image_obs_read_back_exactly(tmp_path, writers, compression):
    finished = record_batched(tmp_path, writers, compression)
    assert len(finished) >= 15
    meta = json.loads((tmp_path / "img.json").read_text())
    assert [e["episode_id"] for e in meta["episodes"]] == list(range(len(finished)))
    method = None if compression == "none" else compression.split(":")[0]
    level = int(compression.split(":")[1]) if compression.startswith("gzip") else None
    with h5py.File(tmp_path / "img.h5", "r") as f:
        assert all(isinstance(f.get(k, getlink=True), h5py.HardLink) for k in f)  # consolidated at close
        for i, (e, ep) in enumerate(finished):
            g = f[f"traj_{i}"]
            assert meta["episodes"][i]["episode_seed"] == ep["seed"]
            assert meta["episodes"][i]["elapsed_steps"] == len(ep["actions"])
            got = _read_tree(g["obs"])
            want = expected_obs(e, ep)
            assert sorted(got) == sorted(want)
            for k in want:
                np.testing.assert_array_equal(got[k], want[k], err_msg=f"traj_{i}/obs/{k}")
            np.testing.assert_array_equal(g["actions"][:], np.stack(ep["actions"]))
            rgb = g["obs/sensor_data/base_camera/rgb"]
            assert rgb.dtype == np.uint8 and rgb.shape == (len(ep["obs"]), 12, 12, 3)
            assert rgb.compression == method and rgb.compression_opts == level
            if method is not None:  # every frame of the episode (<= 64) in a chunk, a band of rows each
                assert rgb.chunks == (len(ep["obs"]), 12, 12, 3)
            assert g["obs/agent/qpos"].compression is None


def test_maniskill_dataset_reads_image_trajectories_of_several_writers(tmp_path):
    from mani_skill.trajectory.dataset import ManiSkillTrajectoryDataset

    finished = record_batched(tmp_path, 3, "gzip:1")
    ds = ManiSkillTrajectoryDataset(str(tmp_path / "img.h5"))
    # the dataset drops each episode's last observation and concatenates episodes in id order
    want = np.concatenate([expected_obs(e, ep)["sensor_data/base_camera/rgb"][:-1] for e, ep in finished])
    np.testing.assert_array_equal(ds.obs["sensor_data"]["base_camera"]["rgb"], want)
    assert len(ds) == len(want)
    item = ds[len(ds) - 1]
    np.testing.assert_array_equal(item["obs"]["sensor_data"]["base_camera"]["rgb"], want[-1])


@pytest.mark.parametrize("bad", ["gzip", "gzip:0", "gzip:10", "zstd", "GZIP:1", 5, None])
def test_bad_compression_is_refused_with_the_choices(tmp_path, bad):
    with pytest.raises(ValueError, match=rf"trajectory_compression={bad!r} is unknown; use 'gzip:1'.*'lzf'.*'none'"):
        RecordOptions(trajectory_compression=bad)
    with pytest.raises(ValueError, match="trajectory_compression="):
        TrajectoryWriter(tmp_path / "x.h5", {}, compression=bad)
    assert not (tmp_path / "x.h5").exists()
    src = BatchedDoubleEnv(num_envs=2, obs_mode="rgb")
    with pytest.raises(ValueError, match="trajectory_compression="):
        RecordEpisode(src, tmp_path, save_video=False, trajectory_compression=bad)
    assert list(tmp_path.iterdir()) == []  # nothing written before the options are checked


def test_real_env_rgb_two_writers_dataset_and_replay(make_env, tmp_path):
    """PickCube-v1 with obs_mode='rgb' (64x64 sensor): what the env returned is in the file, ManiSkill's
    dataset loads it and its replay tool replays it from the recorded env states."""
    from mani_skill.trajectory.dataset import ManiSkillTrajectoryDataset

    env = RecordEpisode(
        make_env("PickCube-v1", obs_mode="rgb", sensor_configs=dict(width=64, height=64), max_episode_steps=5),
        tmp_path,
        trajectory_name="rgb",
        save_video=False,
        trajectory_writers=2,
    )
    frames = []
    for seed in (0, 1):
        obs, _ = env.reset(seed=seed)
        ep = [obs["sensor_data"]["base_camera"]["rgb"].numpy().copy()]
        for _ in range(5):
            obs, *_ = env.step(env.action_space.sample())
            ep.append(obs["sensor_data"]["base_camera"]["rgb"].numpy().copy())
        frames.append(np.concatenate(ep))
    env.close()
    with h5py.File(tmp_path / "rgb.h5", "r") as f:
        for i in range(2):
            np.testing.assert_array_equal(f[f"traj_{i}/obs/sensor_data/base_camera/rgb"][:], frames[i])
    ds = ManiSkillTrajectoryDataset(str(tmp_path / "rgb.h5"))
    np.testing.assert_array_equal(ds.obs["sensor_data"]["base_camera"]["rgb"], np.concatenate([x[:-1] for x in frames]))
    out = subprocess.run(
        [sys.executable, "-m", "mani_skill.trajectory.replay_trajectory", "--traj-path", str(tmp_path / "rgb.h5"),
         "--use-env-states", "--allow-failure", "-b", "physx_cpu"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Replayed 2 episodes" in out.stdout + out.stderr


def test_image_chunks_are_frames_by_bands_of_rows(tmp_path):
    """Chunks hold up to 64 frames of a band of rows about 2 KiB a frame (README: Image observations on disk)."""
    from fastrecord.sinks.maniskill_h5.layout import image_chunks as _image_chunks
    from fastrecord.sinks.maniskill_h5.process import write_dataset as _write_dataset

    assert _image_chunks((51, 128, 128, 3), 1) == (51, 5, 128, 3)
    assert _image_chunks((200, 64, 64, 3), 1) == (64, 10, 64, 3)
    assert _image_chunks((10, 512, 1024, 3), 1) == (10, 1, 1024, 3)  # a row over 2 KiB: one row a band
    assert _image_chunks((10, 128, 128, 1), 2) == (10, 8, 128, 1)  # uint16 depth
    depth = np.random.default_rng(0).integers(0, 2**16, (70, 32, 32, 1), dtype=np.uint16)
    with h5py.File(tmp_path / "d.h5", "w") as f:
        _write_dataset(f, "obs/sensor_data/cam/depth", depth, "gzip:3")
        _write_dataset(f, "obs/sensor_data/cam/rgb", np.zeros((0, 8, 8, 3), np.uint8), "gzip:3")  # empty: no chunks
    with h5py.File(tmp_path / "d.h5", "r") as f:
        d = f["obs/sensor_data/cam/depth"]
        assert d.chunks == (64, 32, 32, 1) and d.compression_opts == 3
        np.testing.assert_array_equal(d[:], depth)
        assert f["obs/sensor_data/cam/rgb"].shape == (0, 8, 8, 3)
