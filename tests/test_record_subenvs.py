"""`fastrecord record`'s sub-env processes of the batched render, started before the CLI's imports
(`commands.record_env.early_subenvs`): the envs they make are the run's envs, and an early launch the run cannot use
ends with the run's refusal. The batched render itself needs CUDA (tests/test_batched_render.py, ``-m gpu``); these
run its sub-envs (CPU simulation, poses reported) on the CPU machine."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fastrecord
from fastrecord import system
from fastrecord.commands.config import RecordConfig
from fastrecord.commands.record_env import early_subenvs, env_kwargs_for, make_recorded_env
from fastrecord.packed import PackedVectorEnv
from fastrecord.render.vector import INFO_KEY, PoseReporter


@pytest.fixture
def batched_cfg(monkeypatch, tmp_path):
    """A run whose command line asks for the batched render on a machine said to have a GPU and many cores."""
    monkeypatch.setattr(system, "has_nvidia_gpu", lambda: True)
    monkeypatch.setattr(fastrecord, "PRESTART_CORES", 1)
    return RecordConfig(num_envs=3, episodes=3, batched_render="on", render_backend="cpu", width=32, height=32,
                        max_episode_steps=5, envs_per_process=2, output_dir=str(tmp_path / "out"))


def test_the_early_subenvs_are_the_runs_envs(batched_cfg):
    """Started early, the processes hold 2 + 1 envs made with the run's own keywords: reset with the episode seeds
    and stepped, they give a fresh env's observations, and report each scene's poses and, at a new scene, its
    seed."""
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401 - registers the tasks
    from mani_skill.utils.wrappers import CPUGymWrapper

    from fastrecord.render import device

    early = early_subenvs(batched_cfg)
    assert early is not None and early.launch.sizes == [2, 1]
    assert device.wait_early() is None  # render_backend="cpu": no CUDA engine opened beside them
    envs = PackedVectorEnv(launch=early.launch)
    try:
        assert [p.is_alive() for p in envs.processes] == [True, True]
        obs, info = envs.reset(seed=[10, 11, 12])
        assert info["_" + INFO_KEY].all()
        assert [info[INFO_KEY][i][1][1] for i in range(3)] == [10, 11, 12]  # each new scene's episode seed
        actions = np.stack([envs.single_action_space.sample() * 0 + 0.1 * i for i in range(3)]).astype(np.float32)
        obs2, _, _, _, info2 = envs.step(actions)
        assert all(info2[INFO_KEY][i][1] is None for i in range(3))  # the same scenes
        ref = PoseReporter(CPUGymWrapper(gym.make(batched_cfg.env_id, **env_kwargs_for(batched_cfg, "cpu"))))
        try:
            for i in range(3):
                o, inf = ref.reset(seed=10 + i)
                np.testing.assert_allclose(obs[i], o, rtol=1e-6, atol=1e-6)
                np.testing.assert_allclose(info[INFO_KEY][i][0], inf[INFO_KEY][0], atol=1e-6)
                o2, *_ = ref.step(actions[i])
                np.testing.assert_allclose(obs2[i], o2, rtol=1e-5, atol=1e-5)
        finally:
            ref.close()
    finally:
        envs.close(terminate=True)
    assert not any(p.is_alive() for p in envs.processes)


def test_an_early_launch_the_run_cannot_use_ends_with_its_refusal(batched_cfg):
    """No CUDA here: the run refuses ``--batched-render on`` with its one-line error, and the processes started for
    it have ended; an early launch for other keywords than the run's is ended too."""
    early = early_subenvs(batched_cfg)
    assert early is not None
    with pytest.raises(ValueError, match="--batched-render"):
        make_recorded_env(batched_cfg, auto_reset=False, early=early)
    assert early.launch.processes and not any(p.is_alive() for p in early.launch.processes)
    other = early_subenvs(dataclasses.replace(batched_cfg, width=48))
    assert other is not None
    with pytest.raises(ValueError, match="--batched-render"):
        make_recorded_env(batched_cfg, auto_reset=False, early=other)
    assert not any(p.is_alive() for p in other.launch.processes)


def test_a_render_device_opened_early_where_none_opens_leaves_the_runs_refusal_as_it_was(batched_cfg):
    """A GPU render backend on a machine without CUDA (the command line's guess said there is one): the early open of
    the render engine fails on its thread, silently; the run refuses ``--batched-render on`` with its own one-line
    error, the sub-env processes have ended and nothing of the early open is held."""
    import torch

    from fastrecord.render import device

    if torch.cuda.is_available():
        pytest.skip("CUDA is here: the batched render runs instead of refusing")
    cfg = dataclasses.replace(batched_cfg, render_backend="gpu")
    early = early_subenvs(cfg)
    assert early is not None and device._early is not None and device._early.device == "cuda"
    assert device.wait_early() is None  # it could not open
    with pytest.raises(ValueError, match="--batched-render on renders on a CUDA device"):
        make_recorded_env(cfg, auto_reset=False, early=early)
    assert early.launch.processes and not any(p.is_alive() for p in early.launch.processes)
    assert device._early is None
