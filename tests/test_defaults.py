"""Defaults sized to the machine and the data: the process-count rules (`default_trajectory_writers`,
`default_video_workers`), the image-leaf test they read (`has_image_leaves`), and a recorder on a real
PickCube-v1 env choosing its HDF5 writers from its observations, recording the choice in the manifest."""

from __future__ import annotations

import json
import os

import gymnasium as gym
import h5py
import numpy as np
import pytest
from gymnasium import spaces

from fastrecord.options import (
    RecordOptions,
    default_trajectory_writers,
    default_video_workers,
    stepping_video_workers,
    usable_cores,
)
from fastrecord.sinks.maniskill_h5 import has_image_leaves


@pytest.mark.parametrize(("cores", "images", "expected"), [
    (1, False, 1), (2, False, 1), (16, False, 1), (128, False, 1),  # one writer keeps up without images
    (1, True, 1), (2, True, 1), (3, True, 1), (4, True, 2), (8, True, 4), (16, True, 8), (64, True, 8),
])
def test_trajectory_writers_rule(cores, images, expected):
    assert default_trajectory_writers(cores, images) == expected


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 2), (16, 16), (17, 16), (128, 16)])
def test_video_workers_rule(cores, expected):
    assert default_video_workers(cores) == expected


def test_usable_cores_is_the_affinity_mask_shared_by_the_ranks(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert usable_cores() == len(os.sched_getaffinity(0)) >= 1
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # torchrun: four ranks on this host share its cores
    assert usable_cores() == 4


def _box(*shape: int) -> spaces.Box:
    return spaces.Box(0, 255, shape=shape, dtype=np.uint8)


@pytest.mark.parametrize(("space", "expected"), [
    (_box(4), False),  # a flat state vector
    (None, False),  # an env that declares no space
    (spaces.Dict({"agent": spaces.Dict({"qpos": _box(9)}), "extra": spaces.Dict({"tcp_pose": _box(7)})}), False),
    (spaces.Dict({"sensor_data": spaces.Dict({"base_camera": spaces.Dict({"rgb": _box(64, 64, 3)})})}), True),
    (spaces.Dict({"sensor_data": spaces.Dict({"cam": spaces.Dict({"depth": _box(64, 64, 1)})})}), True),
    (spaces.Dict({"sensor_data": spaces.Dict({"cam": spaces.Dict({"segmentation": _box(8, 8, 1)})})}), True),
    (spaces.Dict({"rgb": spaces.Dict({"qpos": _box(9)})}), False),  # a group named like an image key is no leaf
])
def test_has_image_leaves(space, expected):
    assert has_image_leaves(space) is expected


@pytest.mark.parametrize(("writers", "workers"), [(None, None), (3, 5), (1, 1)])
def test_explicit_counts_win_and_none_is_the_default(monkeypatch, writers, workers):
    """Where the counts are chosen (`build_sinks`), on a 16-core machine with image observations: None
    gets the rules' 8 writers and 16 encoders (and the manifest records the choice); an explicit count is
    used as given, also where the rule would choose more, and no choice is recorded for it."""
    from fastrecord.envs import ManiSkillView
    from fastrecord.sinks.factory import build_sinks
    from fastrecord.testing import BatchedDoubleEnv

    assert RecordOptions().trajectory_writers is None and RecordOptions().video_workers is None
    monkeypatch.setattr("fastrecord.sinks.factory.usable_cores", lambda: 16)
    view = ManiSkillView(BatchedDoubleEnv(num_envs=2, obs_mode="rgb"))
    built = build_sinks(RecordOptions(trajectory_writers=writers, video_workers=workers), view)
    assert (built.trajectory.writers, built.videos.workers) == (writers or 8, workers or 16)
    assert built.chosen == ({"trajectory_writers": 8, "video_workers": 16} if writers is None else {})
    with pytest.raises(
        ValueError, match=r"trajectory_writers=0 must be an integer >= 1 .*or None to size it to the machine"
    ):
        RecordOptions(trajectory_writers=0)


@pytest.mark.parametrize("obs_mode", ["state", "rgb"])
def test_recorder_chooses_writers_from_the_observations(make_env, tmp_path, monkeypatch, obs_mode):
    from fastrecord import RecordEpisode

    monkeypatch.setattr("fastrecord.sinks.factory.usable_cores", lambda: 4)  # a 4-core machine: rgb gets 2 writers
    env = RecordEpisode(make_env(obs_mode=obs_mode, sensor_configs=dict(width=16, height=16)), tmp_path,
                        trajectory_name="t", save_video=False)
    try:
        expected = {"state": 1, "rgb": 2}[obs_mode]
        sink = env.recorder.trajectory
        assert sink.writers == sink.writer.num_writers == expected
        # several writers have an index process beside them; one writer writes the index itself
        assert len(sink.writer.pids) == (1 if expected == 1 else expected + 1)
        manifest = json.loads((tmp_path / "t.fastrecord.json").read_text())
        assert manifest["options"]["trajectory_writers"] == expected
        env.reset(seed=0)
        env.step(env.action_space.sample())
    finally:
        env.close()


class _DeclaresFlatBox(gym.Wrapper):
    """An env that declares a flat Box observation space but returns ManiSkill's rgb observation dicts."""

    def __init__(self, env: gym.Env) -> None:
        super().__init__(env)
        self.observation_space = gym.spaces.Box(-np.inf, np.inf, (10,), np.float32)


def test_writers_follow_the_observations_returned_not_the_declared_space(make_env, tmp_path, monkeypatch):
    """The writer count is chosen from the observations the env returns (at the first reset): an env that
    declares a flat Box but returns camera images gets the writers of image observations (issue 28.9)."""
    from fastrecord import RecordEpisode

    for where in ("fastrecord.sinks.factory.usable_cores", "fastrecord.options.usable_cores"):
        monkeypatch.setattr(where, lambda: 4)  # a 4-core machine: rgb gets 2 writers
    env = RecordEpisode(_DeclaresFlatBox(make_env(obs_mode="rgb", sensor_configs=dict(width=16, height=16))), tmp_path,
                        trajectory_name="t", save_video=False)
    try:
        sink = env.recorder.trajectory
        assert sink.writer.num_writers == 1  # chosen from the declared space: no image leaves
        obs, _ = env.reset(seed=0)
        assert obs["sensor_data"]["base_camera"]["rgb"].shape[-1] == 3
        assert sink.writers == sink.writer.num_writers == 2 and len(sink.writer.pids) == 2  # index in writer 0
        for _ in range(3):
            env.step(env.action_space.sample())
        env.reset(seed=1)
        env.step(env.action_space.sample())
    finally:
        env.close()
    assert json.loads((tmp_path / "t.fastrecord.json").read_text())["options"]["trajectory_writers"] == 2
    with h5py.File(tmp_path / "t.h5", "r") as f:  # both episodes written, images read back
        shapes = [f[f"traj_{i}/obs/sensor_data/base_camera/rgb"].shape for i in (0, 1)]
        assert shapes == [(4, 16, 16, 3), (2, 16, 16, 3)]


def test_explicit_writers_are_used_as_given(make_env, tmp_path):
    from fastrecord import RecordEpisode

    env = RecordEpisode(make_env(), tmp_path, trajectory_name="t", save_video=False, trajectory_writers=2)
    try:
        assert env.recorder.trajectory.writer.num_writers == 2
        assert json.loads((tmp_path / "t.fastrecord.json").read_text())["options"]["trajectory_writers"] == 2
    finally:
        env.close()


@pytest.mark.parametrize(("workers", "processes", "cores", "expected"), [
    (16, 0, 16, 16),  # the env steps in this process (a GPU env, a sync vector env): every encoder
    (16, 8, 16, 7),  # make_eval_envs' 16 envs, 2 a sub-env process: the cores those 8 and the caller leave
    (16, 16, 16, 4),  # a process per env: at least a quarter of the workers
    (8, 16, 16, 2),  # and at least 2
    (4, 8, 16, 4),  # never more than the writers
    (1, 8, 4, 1),
    (2, 1, 2, 2),  # the 2-core machine's eval: as before
])
def test_stepping_video_workers_rule(workers, processes, cores, expected):
    assert stepping_video_workers(workers, processes, cores) == expected


def test_simulation_processes_are_a_vector_envs_own_through_its_wrappers():
    """`simulation_processes`: gymnasium's AsyncVectorEnv's processes, under a wrapper; a SyncVectorEnv and a
    single env step in the caller's process."""
    from fastrecord.envs import simulation_processes

    envs = gym.vector.AsyncVectorEnv([lambda: gym.make("CartPole-v1")] * 3)
    try:
        assert simulation_processes(gym.vector.VectorWrapper(envs)) == simulation_processes(envs) == 3
    finally:
        envs.close()
    sync = gym.vector.SyncVectorEnv([lambda: gym.make("CartPole-v1")] * 2)
    assert simulation_processes(sync) == simulation_processes(gym.make("CartPole-v1")) == 0
    sync.close()
