"""Bad input gets a clear error naming the value and the fix; nothing already recorded is lost."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch

import fastrecord.sinks.mp4 as mp4_mod
from fastrecord import BufferTooLargeError, RecordEpisode, WorkerError
from fastrecord.testing import BatchedDoubleEnv


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
        (dict(video_codec="aac"), r"'aac'.*audio encoder"),
        (dict(video_codec="mjpeg"), r"'mjpeg'.*trial encode.*libx264"),
        (dict(video_preset="fastest"), r"video_preset='fastest'.*ultrafast"),
        (dict(video_crf=99), r"video_crf=99.*0.*51"),
        (dict(video_crf=22.5), r"video_crf=22.5 must be an integer"),
        (dict(video_fps=0), r"video_fps=0 must be a positive number of frames per second"),
        (dict(video_fps=-5), r"video_fps=-5 must be a positive number"),
        (dict(video_fps="30"), r"video_fps='30' must be a positive number"),
        (dict(video_fps=float("nan")), r"video_fps=nan must be a positive number"),
        (dict(video_layout="grid"), r"video_layout='grid' is unknown; use one of \('per_env', 'tiled'\)"),
        (dict(video_source="camera"), r"video_source='camera' is unknown; use 'render'"),
        (dict(video_workers=0), r"video_workers=0 must be an integer >= 1"),
        (dict(buffer_capacity=0), r"buffer_capacity=0 must be an integer >= 2"),
        (dict(buffer_capacity=-1), r"buffer_capacity=-1 must be an integer >= 2"),
        (dict(max_steps_per_video=0), r"max_steps_per_video=0 must be an integer >= 1"),
        (dict(trajectory_writers=0), r"trajectory_writers=0 must be an integer >= 1"),
        (dict(trajectory_name="runs/a"), r"trajectory_name='runs/a' must be a plain file name"),
        (dict(if_exists="append"), r"if_exists='append' is unknown; use one of \('error', 'overwrite', 'resume'\)"),
        (dict(save_video="yes"), r"save_video='yes' must be True or False"),
        (dict(save_video_trigger=5), r"save_video_trigger=5 must be a callable"),
        (
            dict(render_substeps=True, video_source="sensor:base_camera"),
            r"render_substeps=True renders the human render camera",
        ),
        (dict(sinks=["stdout"]), r"every sink must be a fastrecord.sinks.Sink"),
    ],
)
def test_bad_options(tmp_path, kwargs, match):
    """Every argument is checked at construction, before anything is written."""
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        RecordEpisode(BatchedDoubleEnv(), out, **kwargs)
    assert not out.exists()


def test_unknown_argument_names_the_valid_ones(tmp_path):
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'save_videos'.*'save_video'"):
        RecordEpisode(BatchedDoubleEnv(), tmp_path, save_videos=True)


def test_fractional_fps_works(tmp_path):
    from fractions import Fraction

    import av

    env = RecordEpisode(
        BatchedDoubleEnv(num_envs=1, max_episode_steps=3), tmp_path, video_fps=7.5, save_trajectory=False
    )
    env.reset(seed=0)
    for _ in range(3):
        env.step(torch.zeros(1, 3))
    env.close()
    (video,) = tmp_path.glob("*.mp4")
    with av.open(str(video)) as c:
        assert c.streams.video[0].average_rate == Fraction(15, 2)


def test_growth_failure_leaves_a_consistent_episode(tmp_path, monkeypatch):
    """A buffer that cannot grow raises, and the episode keeps exactly the steps recorded before."""
    import fastrecord.buffer as buffer_mod

    env = RecordEpisode(BatchedDoubleEnv(num_envs=2, max_episode_steps=20), tmp_path, trajectory_name="t",
                        buffer_capacity=4)
    env.reset(seed=0)
    actions = [torch.full((2, 3), 0.1 * (k + 1)) for k in range(3)]
    for a in actions:  # slots 1..3 of 4: no growth yet
        env.step(a)
    monkeypatch.setattr(buffer_mod, "free_bytes", lambda device: 0)  # the growth at slot 4 cannot fit
    with pytest.raises(BufferTooLargeError, match="needs"):
        env.step(torch.full((2, 3), 9.0))
    with pytest.raises(BufferTooLargeError):  # still cannot: the same error, nothing half-written
        env.step(torch.full((2, 3), 9.0))
    env.close()  # saves the episodes as recorded
    meta = json.loads((tmp_path / "t.json").read_text())["episodes"]
    assert [e["elapsed_steps"] for e in meta] == [3, 3]
    with h5py.File(tmp_path / "t.h5") as f:
        for e in range(2):
            g = f[f"traj_{e}"]
            assert g["actions"].shape == (3, 3) and g["obs"].shape[0] == 4 and g["terminated"].shape == (3,)
            np.testing.assert_allclose(g["actions"][()], torch.stack([a[e] for a in actions]).numpy())
            np.testing.assert_array_equal(g["env_states/articulations/arm"][:, 0], [0, 1, 2, 3])


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
    env.close()  # the writers end: no thread left to the tests after this one


def test_missing_sensor_camera(make_env, tmp_path):
    with pytest.raises(ValueError, match=r"video_source='sensor:wrist'.*no camera images.*obs_mode='rgb'"):
        RecordEpisode(make_env("PickCube-v1"), tmp_path / "out", video_source="sensor:wrist")  # before any file
    assert list(tmp_path.iterdir()) == []


def _raw_pickcube():
    import gymnasium as gym
    import mani_skill.envs  # noqa: F401

    return gym.make("PickCube-v1", obs_mode="state", sim_backend="physx_cpu", max_episode_steps=10)


def test_a_vector_env_of_unwrapped_maniskill_envs_names_the_leaf_and_cpu_gym_wrapper(tmp_path):
    """gymnasium's vector env gathers a ManiSkill env's torch-tensor infos into arrays of objects: the recorder names
    the leaf and the fix (ManiSkill's CPUGymWrapper) instead of passing on torch's conversion error."""
    import gymnasium as gym

    env = RecordEpisode(gym.vector.SyncVectorEnv([_raw_pickcube] * 2), tmp_path, save_video=False)
    try:
        env.reset(seed=0)
        with pytest.raises(TypeError, match=r"the env's 'success' holds Tensor objects.*"
                                            r"mani_skill.utils.wrappers.CPUGymWrapper"):
            env.step(env.action_space.sample())
    finally:
        env.close()


def test_buffer_that_cannot_fit(tmp_path):
    env = RecordEpisode(BatchedDoubleEnv(num_envs=4, size=512), tmp_path, buffer_capacity=10**7)
    with pytest.raises(
        BufferTooLargeError,
        match=r"needs [\d.]+ GiB on cpu \(4 envs x 10000000 steps x \[512, 512, 3\].*"
        r"human_render_camera_configs.*buffer_capacity",
    ):
        env.reset(seed=0)
    env.close()


def test_writer_error_surfaces_and_keeps_what_was_written(tmp_path, monkeypatch):
    """An encoder failure is raised in the caller at a later step or at close; trajectories survive."""
    env = RecordEpisode(BatchedDoubleEnv(num_envs=2, max_episode_steps=2), tmp_path, trajectory_name="t")
    env.reset(seed=0)
    for _ in range(2):
        env.step(torch.zeros(2, 3))
    env.reset()  # 2 episodes finished and written
    env.wait_until_done()

    def broken(path, frames, settings, *args, **kwargs):
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


@pytest.mark.parametrize("output_dir", [123, None, b"out", ""])
def test_output_dir_that_is_not_a_path(tmp_path, monkeypatch, output_dir):
    """``RecordEpisode(env, 123)`` names output_dir and the fix (it was a bare TypeError from pathlib)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(TypeError, match=rf"RecordEpisode: output_dir={output_dir!r} must be a folder path \(str or "
                                        r"pathlib.Path\), e.g. 'recordings'"):
        RecordEpisode(BatchedDoubleEnv(), output_dir)
    assert not any(tmp_path.iterdir())


def test_python_errors_name_the_parameter_not_a_flag(tmp_path):
    """A value checked by a run configuration names the Python keyword when called from Python (the CLI adds
    the flag: test_cli.py)."""
    from fastrecord import replay_trajectories

    with pytest.raises(ValueError, match=r"^count=-1 must be at least 1; pass count=1 or more$"):
        replay_trajectories(tmp_path / "demo.h5", tmp_path / "out", count=-1)
    with pytest.raises(ValueError, match=r"^width=20000 is larger than the 16384 pixels H.264 \(libx264\) encodes; "
                                         r"pass width=16384 or less$"):
        replay_trajectories(tmp_path / "demo.h5", tmp_path / "out", width=20000)
    assert not (tmp_path / "out").exists()


def test_frames_larger_than_h264_are_refused_before_anything_renders(make_env, tmp_path):
    """A human render camera wider than libx264 encodes (16384): refused when the wrapper is made, naming the
    camera and the fix (the encoder refused it only after an episode had rendered, leaving a run behind)."""
    out = tmp_path / "out"
    env = make_env("PickCube-v1", human_render_camera_configs=dict(width=20000, height=64))
    with pytest.raises(ValueError, match=r"camera 'render_camera' makes 20000x64 frames, larger than the 16384 pixels "
                                         r"a side H.264 \(libx264\) encodes; create the env with "
                                         r"human_render_camera_configs=dict\(width=..., height=...\)"):
        RecordEpisode(env, out)
    assert not out.exists()
    RecordEpisode(env, out, save_video=False).close()  # trajectories alone render nothing
