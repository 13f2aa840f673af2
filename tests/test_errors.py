"""Bad input gets a clear error naming the value and the fix; nothing already recorded is lost."""

from __future__ import annotations

import json

import h5py
import pytest
import torch
from fastrecord.testing import BatchedDoubleEnv

import fastrecord.sinks.mp4 as mp4_mod
from fastrecord import BufferTooLargeError, RecordEpisode, WorkerError


def test_env_without_image_render_mode(make_env, tmp_path):
    env = make_env("PickCube-v1", render_mode=None)
    with pytest.raises(ValueError, match=r"Render mode is None.*render_mode='rgb_array'.*save_video=False"):
        RecordEpisode(env, tmp_path)
    RecordEpisode(env, tmp_path, save_video=False).close()  # trajectories alone need no renderer


def test_unwritable_output_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match=r"output_dir='.*file/out' cannot be created.*writable directory"):
        RecordEpisode(BatchedDoubleEnv(), blocker / "out")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(keep="successful"), r"keep='successful' is not a filter; use one of \('all', 'success'"),
        (dict(video_codec="h265_magic"), r"video codec 'h265_magic' is not available.*libx264"),
        (dict(video_layout="grid"), r"video_layout='grid' is unknown; use one of \('per_env', 'tiled'\)"),
        (dict(video_source="camera"), r"video_source='camera' is unknown; use 'render'"),
        (dict(render_substeps=True), r"render_substeps=True is not supported"),
    ],
)
def test_bad_options(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        RecordEpisode(BatchedDoubleEnv(), tmp_path, **kwargs)


def test_keep_needs_the_flag_it_filters_on(tmp_path):
    class NoSuccess(BatchedDoubleEnv):
        def step(self, action):
            obs, r, term, trunc, info = super().step(action)
            return obs, r, term, trunc, {"elapsed_steps": info["elapsed_steps"]}

    env = RecordEpisode(NoSuccess(num_envs=2), tmp_path, keep="success")
    env.reset(seed=0)
    env.step(torch.zeros(2, 3))
    with pytest.raises(ValueError, match=r"keep='success' needs info\['success'\].*keep='all'"):
        env.reset()


def test_missing_sensor_camera(make_env, tmp_path):
    env = RecordEpisode(make_env("PickCube-v1"), tmp_path, video_source="sensor:wrist")
    with pytest.raises(ValueError, match=r"sensor_data/wrist/rgb.*obs_mode='rgb'"):
        env.reset(seed=0)


def test_buffer_that_cannot_fit(tmp_path):
    env = RecordEpisode(BatchedDoubleEnv(num_envs=4, size=512), tmp_path, buffer_capacity=10**7)
    with pytest.raises(BufferTooLargeError, match=r"needs [\d.]+ GiB on cpu \(4 envs x 10000000 steps x \[512, 512, 3\].*"
                                                   r"human_render_camera_configs.*buffer_capacity"):
        env.reset(seed=0)


def test_writer_error_surfaces_and_keeps_what_was_written(tmp_path, monkeypatch):
    """An encoder failure is raised in the caller at a later step or at close; trajectories survive."""
    env = RecordEpisode(BatchedDoubleEnv(num_envs=2, max_episode_steps=2), tmp_path, trajectory_name="t")
    env.reset(seed=0)
    for _ in range(2):
        env.step(torch.zeros(2, 3))
    env.reset()  # 2 episodes finished and written
    env.wait_until_done()

    def broken(path, frames, settings):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mp4_mod, "encode_mp4", broken)
    for _ in range(2):
        env.step(torch.zeros(2, 3))
    with pytest.raises(WorkerError, match="No space left on device"):
        env.reset()  # these episodes' videos fail in the background: raised here or at the next call
        env.wait_until_done()
    with pytest.raises(WorkerError):
        env.step(torch.zeros(2, 3))
    with pytest.raises(WorkerError):
        env.close()
    env.close()  # a second close is a no-op
    meta = json.loads((tmp_path / "t.json").read_text())
    assert len(meta["episodes"]) == 4
    with h5py.File(tmp_path / "t.h5") as f:
        assert sorted(f) == ["traj_0", "traj_1", "traj_2", "traj_3"]
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == ["0_env0_failure.mp4", "1_env1_failure.mp4"]


def test_lifecycle(tmp_path):
    env = RecordEpisode(BatchedDoubleEnv(num_envs=2), tmp_path, trajectory_name="t")
    with pytest.raises(RuntimeError, match=r"step\(\) for envs \[0, 1\].*call env.reset\(\) first"):
        env.step(torch.zeros(2, 3))
    env.reset(seed=0)
    env.step(torch.zeros(2, 3))
    env.close()
    env.close()
    with pytest.raises(RuntimeError, match="recorder is closed"):
        env.step(torch.zeros(2, 3))
    assert len(json.loads((tmp_path / "t.json").read_text())["episodes"]) == 2  # flushed at close
