"""`RecordEpisode` and `RecordVectorEpisode` agree on every constructor argument (issue 28.8): for each
argument, the same value given to both, on the same steps of the same PickCube-v1 episodes (one ManiSkill
CPU env; a gymnasium SyncVectorEnv of one such env with auto-reset off), writes the same files with the
same contents: file names, the trajectory's JSON episodes and HDF5 arrays, the videos' frames, the
results rows, what a user sink receives. `test_every_argument_is_covered` fails when an argument is added
without a case here.

Also ``save_on_reset=False`` on a vector env that auto-resets: the episode that ended is dropped at the
auto-reset (as ManiSkill's wrapper under ``ManiSkillVectorEnv`` drops it) unless ``flush_trajectory()``
saves it first; before the fix the vector wrapper saved every auto-reset episode regardless."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import gymnasium as gym
import h5py
import mani_skill.envs  # noqa: F401 - registers the tasks
import numpy as np
import pytest
from conftest import leaves
from mani_skill.utils.wrappers import CPUGymWrapper

from fastrecord import RecordEpisode, RecordVectorEpisode
from fastrecord.options import RecordOptions
from fastrecord.sinks.base import Sink
from fastrecord.video import decode_mp4

CAMERA = dict(width=32, height=32)
RGB = dict(obs_mode="rgb", sensor_configs=dict(width=32, height=32))


class Collect(Sink):
    """A user sink: the ids, lengths and action sums of the episodes it receives."""

    def __init__(self) -> None:
        self.got: list[tuple[int, int, float]] = []

    def submit(self, episodes) -> None:
        for ep in episodes:
            self.got.append((int(ep.episode_id), int(ep.datasets["actions"].shape[0]),
                             round(float(np.asarray(ep.datasets["actions"]).sum()), 5)))


def every_second_step(n: int) -> bool:
    return n % 2 == 0


# argument -> (value, env keywords it needs, and under "_record" other wrapper arguments it needs); every
# RecordOptions field and `sinks`
CASES: dict[str, tuple[Any, dict[str, Any]]] = {
    "save_trajectory": (False, {}),
    "trajectory_name": ("other", {}),
    "save_video": (False, {}),
    "info_on_video": (True, {}),
    "save_on_reset": (False, {}),
    "save_video_trigger": (every_second_step, {}),
    "max_steps_per_video": (2, {}),
    "clean_on_close": (False, {}),
    "record_reward": (False, {}),
    "record_env_state": (False, {}),
    "video_fps": (7.5, {}),
    "render_substeps": (True, {}),
    "avoid_overwriting_video": (True, {}),
    "source_type": ("parity", {}),
    "source_desc": ("the parity test", {}),
    "keep": ("failure", {}),
    "if_exists": ("overwrite", {}),
    "video_layout": ("tiled", {}),
    "video_source": ("sensor:base_camera", RGB),
    "video_codec": ("libx264", {}),
    "video_crf": (35, {}),
    "video_preset": ("veryfast", {}),
    "video_gop": (2, {}),
    "video_workers": (1, {}),
    "trajectory_writers": (2, {}),
    "trajectory_compression": ("lzf", RGB),
    "buffer_capacity": (2, {}),
    "lerobot": (True, {}),
    "lerobot_video_codec": ("libsvtav1", RGB | {"_record": {"lerobot": True}}),
    "lerobot_gop": (5, RGB | {"_record": {"lerobot": True}}),
    "lerobot_crf": (40, RGB | {"_record": {"lerobot": True}}),
    "lerobot_state_keys": ("agent/qpos", RGB | {"_record": {"lerobot": True}}),
    "sinks": ("collect", {}),
}
# steps of each episode, each episode reset with seed 10 + its index; the last is in progress at close
EPISODES = (3, 2, 2)


def test_every_argument_is_covered():
    params = [p for p in inspect.signature(RecordEpisode).parameters if p not in ("env", "output_dir")]
    assert sorted(CASES) == sorted(params) == sorted([f.name for f in dataclasses.fields(RecordOptions)] + ["sinks"])
    vector, single = inspect.signature(RecordVectorEpisode), inspect.signature(RecordEpisode)
    assert vector.parameters.keys() == single.parameters.keys()


def make(vector: bool, env_kwargs: dict[str, Any]) -> gym.Env:
    kw = dict(obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu", human_render_camera_configs=CAMERA,
              max_episode_steps=50) | env_kwargs
    if not vector:
        return gym.make("PickCube-v1", **kw)
    return gym.vector.SyncVectorEnv([lambda: CPUGymWrapper(gym.make("PickCube-v1", **kw))],
                                    autoreset_mode=gym.vector.AutoresetMode.DISABLED)


def drive(vector: bool, out: Path, name: str, value: Any, env_kwargs: dict[str, Any]) -> list | None:
    """Record `EPISODES` with argument ``name=value``; returns what a user sink received (``sinks`` case)."""
    collect = Collect() if name == "sinks" else None
    env_kwargs = dict(env_kwargs)
    kwargs = dict(env_kwargs.pop("_record", {})) | ({"sinks": [collect]} if collect else {name: value})
    kwargs.setdefault("trajectory_name", "run")
    cls = RecordVectorEpisode if vector else RecordEpisode
    env = cls(make(vector, env_kwargs), out, **kwargs)
    actions = np.random.default_rng(0).uniform(-1, 1, size=(sum(EPISODES), 1, 8)).astype(np.float32)
    t = 0
    for i, steps in enumerate(EPISODES):
        env.reset(seed=10 + i)
        for _ in range(steps):
            env.step(actions[t])
            t += 1
    env.close()
    return collect.got if collect else None


def read_back(out: Path) -> dict[str, Any]:
    """Everything a run wrote, comparable across the two wrappers (no timestamps or absolute paths)."""
    got: dict[str, Any] = {"files": sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())}
    for p in sorted(out.glob("*.json")):
        doc = json.loads(p.read_text())
        if p.name.endswith(".fastrecord.json"):  # the manifest: its options and counters
            got[p.name] = {k: doc.get(k) for k in ("options", "counters", "status")}
        elif "episodes" in doc:
            got[p.name] = {"episodes": doc["episodes"], "source_type": doc.get("source_type"),
                           "source_desc": doc.get("source_desc")}
    for p in sorted(out.glob("*.h5")):
        with h5py.File(p, "r") as f:
            got[p.name] = {k: f[k].compression for k in datasets(f)} | {"values": leaves(f)}
    for p in sorted(out.glob("*.mp4")):
        got[p.name] = decode_mp4(p)
    for p in sorted(out.glob("*.results.jsonl")):
        rows = [json.loads(line) for line in p.read_text().splitlines()]
        got[p.name] = [{k: v for k, v in r.items() if k not in ("time", "ended_at", "wall_time")} for r in rows]
    return got


def datasets(f: h5py.File) -> list[str]:
    names: list[str] = []
    f.visititems(lambda k, v: names.append(k) if isinstance(v, h5py.Dataset) else None)
    return names


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, sorted(a), sorted(b) if isinstance(b, dict) else b)
        for k in a:
            assert_same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, np.ndarray):
        assert isinstance(b, np.ndarray) and a.shape == b.shape and a.dtype == b.dtype, (where, a.shape, np.shape(b))
        if a.dtype == np.uint8 and a.ndim == 4:  # decoded frames: the same pictures, encoded the same way
            assert np.abs(a.astype(int) - b.astype(int)).max() <= 2, where
        else:
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5, err_msg=where)
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("name", sorted(CASES))
def test_same_argument_same_files(name, tmp_path):
    value, env_kwargs = CASES[name]
    got = {}
    for vector in (False, True):
        out = tmp_path / ("vector" if vector else "single")
        received = drive(vector, out, name, value, env_kwargs)
        got[vector] = read_back(out) | ({"sink": received} if received is not None else {})
    assert_same(got[False], got[True])
    if name == "save_on_reset":
        assert not any(k.endswith(".mp4") for k in got[True]) and not got[True]["run.json"]["episodes"]
    if name == "sinks":
        assert [g[:2] for g in got[True]["sink"]] == [(0, 3), (1, 2), (2, 2)]


def test_vector_save_on_reset_false_drops_autoreset_episodes_unless_flushed(tmp_path):
    """NEXT_STEP auto-reset and ``save_on_reset=False``: an episode that ends is saved only by
    ``flush_trajectory()`` before the next step (as ManiSkill's scripts do)."""
    kw = dict(obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu", human_render_camera_configs=CAMERA,
              max_episode_steps=3)
    venv = gym.vector.SyncVectorEnv([lambda: CPUGymWrapper(gym.make("PickCube-v1", **kw))] * 2)
    env = RecordVectorEpisode(venv, tmp_path, trajectory_name="run", save_on_reset=False, save_video=False)
    env.reset(seed=0)
    zero = np.zeros((2, 8), np.float32)
    flushed = False
    for _t in range(1, 10):  # episodes end at steps 3, 7 (the auto-reset takes a step)
        _, _, term, trunc, _ = env.step(zero)
        done = np.logical_or(term, trunc)
        if done.any() and not flushed:  # save the first ended episode of env 1 only
            env.flush_trajectory(env_idxs_to_flush=[1])
            flushed = True
    env.close()
    episodes = json.loads((tmp_path / "run.json").read_text())["episodes"]
    assert [(e["episode_id"], e["elapsed_steps"]) for e in episodes] == [(0, 3)]
    rows = [json.loads(line) for line in (tmp_path / "run.results.jsonl").read_text().splitlines()]
    assert len(rows) == 1
