"""The rest of the drop-in surface: ManiSkill's attributes, max_steps_per_video, and user sinks.

ManiSkill's own scripts read attributes of its wrapper (motion planning's ``run.py`` reads
``env._h5_file.filename``; teleoperation also ``env._json_path``; replay ``env.save_trajectory``): each
is compared here with ManiSkill's wrapper on the same env, and ``max_steps_per_video`` is checked
against ManiSkill's wrapper recording the same actions.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from fastrecord import BackgroundSink, RecordEpisode, Sink, WorkerError
from fastrecord.testing import BatchedDoubleEnv
from fastrecord.video import decode_mp4


def _actions(env, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    low, high = env.action_space.low, env.action_space.high
    return [rng.uniform(low, high).astype(np.float32) for _ in range(n)]


def test_maniskill_attributes(make_env, tmp_path):
    from mani_skill.utils.wrappers import RecordEpisode as MSRecordEpisode

    # (info_on_video=True breaks ManiSkill 3.0.1's own wrapper on one env under numpy 2: float() of a 1-element array)
    kw = dict(trajectory_name="t", save_video=True, info_on_video=False, video_fps=20, max_steps_per_video=7,
              record_reward=False, save_on_reset=False)
    ours = RecordEpisode(make_env("PickCube-v1", max_episode_steps=9), tmp_path / "ours", **kw)
    theirs = MSRecordEpisode(make_env("PickCube-v1", max_episode_steps=9), str(tmp_path / "theirs"), **kw)
    for name in ("save_trajectory", "video_fps", "info_on_video", "max_episode_steps", "max_steps_per_video",
                 "record_reward", "record_env_state", "save_on_reset", "clean_on_close", "save_video", "_episode_id",
                 "_elapsed_record_steps"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert Path(ours._h5_file.filename) == tmp_path / "ours" / "t.h5"
    assert ours._json_path == str(tmp_path / "ours" / "t.json") == theirs._json_path.replace("theirs", "ours")
    assert set(ours._json_data) == set(theirs._json_data)
    assert ours._json_data["env_info"] == theirs._json_data["env_info"]

    for env in (ours, theirs):  # motion planning's loop: reset, steps, flush_trajectory (save_on_reset=False)
        env.reset(seed=3)
        for a in _actions(env, 4):
            env.step(a)
        env.flush_trajectory()
        env.flush_video()
    ours.wait_until_done()
    assert ours._episode_id == theirs._episode_id == 0
    assert ours._elapsed_record_steps == theirs._elapsed_record_steps == 4
    assert [e["episode_id"] for e in ours._json_data["episodes"]] == [0]
    assert ours._json_data["episodes"][0]["episode_seed"] == theirs._json_data["episodes"][0]["episode_seed"] == 3
    filename = ours._h5_file.filename  # as run.py: take the name, close, then read the file
    ours.close()
    theirs.close()
    with h5py.File(filename) as f:
        assert f["traj_0"]["actions"].shape == (4, *ours.action_space.shape)
    assert json.loads(Path(ours._json_path).read_text())["episodes"][0]["elapsed_steps"] == 4


def test_no_trajectory_attributes_without_trajectory(make_env, tmp_path):
    env = RecordEpisode(make_env(), tmp_path, save_trajectory=False)
    with pytest.raises(AttributeError, match="save_trajectory=True"):
        env._h5_file
    env.close()


@pytest.mark.parametrize("max_steps", [5, 4])
def test_max_steps_per_video_splits_videos_like_maniskill(make_env, tmp_path, max_steps):
    """Same env, same actions: the same number of videos with the same frames; trajectories not split."""
    from mani_skill.utils.wrappers import RecordEpisode as MSRecordEpisode

    runs = {}
    for name, cls in (("ours", RecordEpisode), ("theirs", MSRecordEpisode)):
        out = tmp_path / name
        env = cls(make_env("PushCube-v1", max_episode_steps=12), str(out), trajectory_name="t",
                  max_steps_per_video=max_steps)
        for episode, length in enumerate((12, 8)):  # the second episode ends early (a reset at step 8)
            env.reset(seed=episode)
            for a in _actions(env, length, seed=episode):
                env.step(a)
        env.close()
        runs[name] = out
    theirs = sorted(runs["theirs"].glob("*.mp4"), key=lambda p: int(p.stem))
    ours = sorted(runs["ours"].glob("*.mp4"), key=lambda p: (int(p.stem.split("_")[0]), p.stem))
    assert len(ours) == len(theirs) > 2
    for a, b in zip(ours, theirs):
        fa, fb = decode_mp4(a), decode_mp4(b)
        assert fa.shape == fb.shape, (a.name, b.name)
        mse = np.mean((fa.astype(np.float64) - fb.astype(np.float64)) ** 2)
        assert 10 * np.log10(255**2 / max(mse, 1e-9)) > 28, (a.name, b.name)  # the same pictures
    for out in runs.values():  # the trajectory keeps whole episodes
        eps = json.loads((out / "t.json").read_text())["episodes"]
        assert [e["elapsed_steps"] for e in eps] == [12, 8]


# ---------------------------------------------------------------------------------------------- user sinks
class Collect(Sink):
    """A user sink: keeps what it receives."""

    wants_frames = True

    def __init__(self) -> None:
        self.episodes = []
        self.closed = False

    def submit(self, episodes):
        self.episodes.extend(episodes)

    def close(self):
        self.closed = True


def test_user_sink_receives_every_kept_episode(tmp_path):
    sink = Collect()
    env = RecordEpisode(BatchedDoubleEnv(num_envs=3, max_episode_steps=4, size=32, success_step=[2, 0, 3]), tmp_path,
                        trajectory_name="t", keep="success", sinks=[sink])
    env.reset(seed=0)
    for _ in range(4):
        env.step(torch.zeros(3, 3))
    env.close()
    assert sink.closed
    assert [ep.env_idx for ep in sink.episodes] == [0, 2]
    assert [ep.episode_id for ep in sink.episodes] == [0, 1]
    with h5py.File(tmp_path / "t.h5") as f:  # the same episodes the trajectory file got
        for ep in sink.episodes:
            np.testing.assert_array_equal(f[f"traj_{ep.episode_id}"]["actions"][()], ep.datasets["actions"])
    assert all(ep.frames.shape == (ep.elapsed_steps + 1, 32, 32, 3) for ep in sink.episodes)


def test_background_sink_errors_reach_the_caller(tmp_path):
    class Flaky(BackgroundSink):
        wants_datasets = False

        def write(self, episode):
            self.seen = threading.current_thread().name
            raise ConnectionError("experiment server unreachable")

    sink = Flaky()
    env = RecordEpisode(BatchedDoubleEnv(num_envs=2, max_episode_steps=2), tmp_path, trajectory_name="t",
                        save_video=False, sinks=[sink])
    env.reset(seed=0)
    for _ in range(2):
        env.step(torch.zeros(2, 3))
    with pytest.raises(WorkerError, match="experiment server unreachable"):
        env.reset()
        env.wait_until_done()
    assert sink.seen != threading.main_thread().name
    with pytest.raises(WorkerError):
        env.close()
    assert len(json.loads((tmp_path / "t.json").read_text())["episodes"]) == 2  # the trajectory is safe
