"""`fastrecord record --num-envs N` where the CPU draws: each env in a process of its own that answers every step with
its env state and frame (`fastrecord.reported`). What it records equals the envs in one process (``SyncVectorEnv``):
every trajectory dataset bit-equal and every decoded video frame equal, with episodes that end at different steps;
the layout is chosen where it draws something, and a policy reading the simulator keeps its envs in this process."""

from __future__ import annotations

import json
from pathlib import Path

import gymnasium as gym
import h5py
import numpy as np
import pytest
from conftest import leaves

from fastrecord.commands.config import RecordConfig
from fastrecord.commands.record_env import make_recorded_env
from fastrecord.commands.record_run import for_policy
from fastrecord.reported import ReportedVectorEnv

SMALL = dict(num_envs=2, episodes=2, render_backend="cpu", width=32, height=32, max_episode_steps=4,
             sensor_configs={"width": 32, "height": 32})


def _vector_kind(cfg: RecordConfig) -> type:
    env = make_recorded_env(cfg, auto_reset=False)
    try:
        return type(env.env)  # under the RecordEpisode wrapper
    finally:
        env.close()


def test_the_layout_is_a_process_an_env_where_the_cpu_draws_something(tmp_path):
    """auto: several CPU envs drawn by the CPU that draw videos or camera observations run in processes of their own;
    state observations without videos, --render-substeps and --vector sync keep them in this process."""
    def cfg(**kw):
        out = str(tmp_path / f"out{len(list(tmp_path.iterdir()))}")
        return RecordConfig.from_values({**SMALL, "output_dir": out, **kw})

    assert _vector_kind(cfg()) is ReportedVectorEnv
    assert _vector_kind(cfg(obs_mode="rgb", save_video=False)) is ReportedVectorEnv
    assert _vector_kind(cfg(save_video=False)) is gym.vector.SyncVectorEnv  # nothing drawn
    assert _vector_kind(cfg(vector="sync")) is gym.vector.SyncVectorEnv
    assert _vector_kind(cfg(render_substeps=True)) is gym.vector.SyncVectorEnv
    assert _vector_kind(cfg(save_video=False, vector="async")) is ReportedVectorEnv


def test_a_policy_reading_the_simulator_keeps_its_envs_here():
    """`fastrecord.policies.pick_cube_policy` reads the envs' simulator: --vector auto becomes sync for it (and its
    check refuses a vector env of processes, naming --vector sync); other policies leave the config as it is."""
    from fastrecord.commands.record_run import policy_factory

    pick = policy_factory("fastrecord.policies:pick_cube_policy")
    cfg = RecordConfig(num_envs=2, render_backend="cpu")
    assert for_policy(pick, cfg).vector == "sync"
    assert for_policy(None, cfg).vector == "auto"  # the random policy
    assert for_policy(pick, RecordConfig(num_envs=2, vector="async")).vector == "async"  # asked for: its check refuses

    class Elsewhere(gym.vector.VectorEnv):  # a vector env whose sub-envs live in other processes
        num_envs = 2

    with pytest.raises(ValueError, match="--vector sync"):
        pick.check_env(Elsewhere())


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(vector="threads"), "vector='threads' must be one of auto, sync, async"),
        (dict(vector="sync", batched_render="on"), "drop --vector sync or --batched-render on"),
        (dict(vector="async", render_substeps=True), "drop --vector async"),
        (dict(vector="async", sim_backend="physx_cuda"), "drop --vector"),
    ],
)
def test_a_vector_that_cannot_hold_the_run_is_refused(values, message):
    with pytest.raises(ValueError, match=message):
        RecordConfig.from_values(values)


def _record(out: Path, vector: str) -> Path:
    """Two PickCube envs (camera observations and 32x32 videos) recorded by fastrecord's `RecordEpisode` in the
    ``vector`` layout, episodes ending at different steps (partial resets with seeds): env 0's after 3 and 4 steps,
    env 1's after 5; the close saves the two in progress (3 and 5 steps), as ManiSkill's wrapper does."""
    import mani_skill.envs  # noqa: F401 - registers the tasks

    from fastrecord import RecordEpisode
    from fastrecord.commands.record_env import env_kwargs_for
    from fastrecord.reported import reported_vector_env

    cfg = RecordConfig.from_values({**SMALL, "obs_mode": "rgb", "max_episode_steps": 20})
    kwargs = env_kwargs_for(cfg, "cpu")

    def make() -> gym.Env:
        from mani_skill.utils.wrappers import CPUGymWrapper

        return CPUGymWrapper(gym.make("PickCube-v1", **kwargs))

    mode = gym.vector.AutoresetMode.DISABLED
    envs = (reported_vector_env(make, 2, frames=True, autoreset_mode=mode) if vector == "async"
            else gym.vector.SyncVectorEnv([make] * 2, autoreset_mode=mode))
    env = RecordEpisode(envs, str(out), trajectory_name="demo", save_video=True, info_on_video=False)
    actions = np.random.default_rng(0).uniform(-1, 1, size=(12, 2, *envs.single_action_space.shape)).astype(np.float32)
    seeds = iter(range(10, 20))
    env.reset(seed=[0, 1])
    for t in range(1, 11):
        env.step(actions[t])
        mask = np.array([t in (3, 7), t == 5])
        if mask.any():
            env.reset(seed=[next(seeds) if m else None for m in mask], options={"reset_mask": mask})
    env.close()
    return out / "demo.h5"


def _frames(path: Path) -> np.ndarray:
    import av

    with av.open(str(path)) as c:
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)])


def test_envs_in_processes_of_their_own_record_what_one_process_records(tmp_path):
    """The same actions, seeds and partial resets: every dataset of the trajectory file bit-equal (camera observations
    and env states included), the JSON's episodes equal, every decoded frame of every video equal."""
    a, b = _record(tmp_path / "async", "async"), _record(tmp_path / "sync", "sync")
    with h5py.File(a) as fa, h5py.File(b) as fb:
        assert sorted(fa) == sorted(fb) == [f"traj_{i}" for i in range(5)]  # 3 ended, 2 in progress at the close
        for name in fa:
            la, lb = leaves(fa[name]), leaves(fb[name])
            assert la.keys() == lb.keys() and "obs/sensor_data/base_camera/rgb" in la
            for k in la:
                np.testing.assert_array_equal(la[k], lb[k], err_msg=f"{name}/{k}")
    ea = json.loads(a.with_suffix(".json").read_text())["episodes"]
    assert ea == json.loads(b.with_suffix(".json").read_text())["episodes"]
    assert sorted(e["elapsed_steps"] for e in ea) == [3, 3, 4, 5, 5]
    videos = sorted(p.name for p in (tmp_path / "sync").glob("*.mp4"))
    assert len(videos) == 5 and videos == sorted(p.name for p in (tmp_path / "async").glob("*.mp4"))
    for name in videos:
        fa, fb = _frames(tmp_path / "async" / name), _frames(tmp_path / "sync" / name)
        assert len(fa) == len(fb) and len(fa) in (4, 5, 6)
        np.testing.assert_array_equal(fa, fb, err_msg=name)


def test_the_cli_records_the_same_files_either_way(tmp_path):
    """`fastrecord record --num-envs 2` as typed on a machine where the CPU draws (the new default layout) against
    --vector sync: the same trajectory and videos."""
    from fastrecord.commands.cli import main

    out = {}
    for vector in ("auto", "sync"):
        out[vector] = tmp_path / vector
        assert main(["record", "PickCube-v1", "--num-envs", "2", "--episodes", "3", "--max-episode-steps", "4",
                     "--width", "32", "--height", "32", "--render-backend", "cpu", "--vector", vector,
                     "--output-dir", str(out[vector])]) == 0
    with h5py.File(out["auto"] / "trajectory.h5") as fa, h5py.File(out["sync"] / "trajectory.h5") as fb:
        assert sorted(fa) == sorted(fb) and len(fa) == 3
        for name in fa:
            la, lb = leaves(fa[name]), leaves(fb[name])
            assert la.keys() == lb.keys()
            for k in la:
                np.testing.assert_array_equal(la[k], lb[k], err_msg=f"{name}/{k}")
    videos = sorted(p.name for p in out["sync"].glob("*.mp4"))
    assert len(videos) == 3 and videos == sorted(p.name for p in out["auto"].glob("*.mp4"))
    for name in videos:
        np.testing.assert_array_equal(_frames(out["auto"] / name), _frames(out["sync"] / name), err_msg=name)
