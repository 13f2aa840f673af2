"""``render_substeps=True``: a frame after every physics substep, compared with ManiSkill's wrapper.

ManiSkill 3.0.1's ``RecordEpisode(render_substeps=True)`` renders after each of the
``sim_steps_per_control`` physics steps of an ``env.step`` and again after the step: ``1 + T * (S + 1)``
frames for T steps. fastrecord's videos must have the same frames (decoded, PSNR >= 28 dB per frame, as
the ``max_steps_per_video`` test), on one CPU env, on the sub-envs of Sync and Async vector envs, and
with the trajectory still one row a step. GPU-batched envs are stood in for by `BatchedDoubleEnv`, which
runs ManiSkill's substep hook (its frames are recomputed and compared).
"""

from __future__ import annotations

import json

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from conftest import CAMERA

from fastrecord import RecordEpisode
from fastrecord.substeps import SubstepFrames
from fastrecord.testing import BatchedDoubleEnv, frame_psnr, frames_for
from fastrecord.video import decode_mp4
from fastrecord.video.overlay import Overlay


def _actions(space, n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(space.low, space.high).astype(np.float32) for _ in range(n)]


def _same_pictures(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    assert frame_psnr(ours, theirs).min() >= 28


def _maniskill_video(make_env, out, seed: int, actions, **kw) -> list[np.ndarray]:
    """ManiSkill's wrapper, render_substeps=True, one episode of ``actions`` from ``seed``: its videos."""
    from mani_skill.utils.wrappers import RecordEpisode as MSRecordEpisode

    env = MSRecordEpisode(make_env("PushCube-v1", max_episode_steps=len(actions)), str(out), trajectory_name="t",
                          render_substeps=True, **kw)
    env.reset(seed=seed)
    for a in actions:
        env.step(a)
    env.close()
    return [decode_mp4(p) for p in sorted(out.glob("*.mp4"), key=lambda p: int(p.stem))]


@pytest.mark.parametrize("max_steps", [None, 2])
def test_single_env_frames_equal_maniskill(make_env, tmp_path, max_steps):
    """Same env, same actions: the same videos (count, frames, pictures); the trajectory is not changed."""
    env = make_env("PushCube-v1", max_episode_steps=5)
    substeps = env.unwrapped._sim_steps_per_control
    assert substeps > 1
    actions = _actions(env.action_space, 5)
    theirs = _maniskill_video(make_env, tmp_path / "theirs", 7, actions, max_steps_per_video=max_steps)

    rec = RecordEpisode(
        env, tmp_path / "ours", trajectory_name="t", render_substeps=True, max_steps_per_video=max_steps
    )
    rec.reset(seed=7)
    for a in actions:
        rec.step(a)
    rec.close()
    ours = [decode_mp4(p) for p in sorted((tmp_path / "ours").glob("*.mp4"), key=lambda p: p.stem)]
    assert len(ours) == len(theirs) == (1 if max_steps is None else 3)
    if max_steps is None:
        assert len(ours[0]) == 1 + 5 * (substeps + 1)
    else:  # pieces of 2 steps, each starting with the last frame of the one before
        assert [len(v) for v in ours] == [1 + 2 * (substeps + 1)] * 2 + [1 + substeps + 1]
    for a, b in zip(ours, theirs):
        _same_pictures(a, b)
    if max_steps is None:  # the substeps move the scene: consecutive substep frames differ
        assert (frame_psnr(ours[0][1:substeps], ours[0][2:substeps + 1]) < 60).any()
    with h5py.File(tmp_path / "ours" / "t.h5") as f:  # one row a step, as ManiSkill
        assert f["traj_0/actions"].shape[0] == 5 and f["traj_0/obs"].shape[0] == 6
    assert json.loads((tmp_path / "ours" / "t.json").read_text())["episodes"][0]["elapsed_steps"] == 5


def _cpu_thunk(steps: int, wrap: bool = False):
    def thunk():
        import mani_skill.envs  # noqa: F401
        from mani_skill.utils.wrappers import CPUGymWrapper

        env = CPUGymWrapper(gym.make("PushCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                                     human_render_camera_configs=CAMERA, max_episode_steps=steps))
        return SubstepFrames(env) if wrap else env

    return thunk


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_vector_env_frames_equal_maniskill(make_env, tmp_path, kind):
    """Each sub-env's video equals ManiSkill's recording of that env alone (Async: sub-envs wrapped in
    SubstepFrames render in their own process); an auto-reset step (no substeps) is not a frame of it."""
    seeds, steps = [3, 4], 3
    if kind == "sync":
        vec = gym.vector.SyncVectorEnv([_cpu_thunk(steps)] * 2)
    else:
        vec = gym.vector.AsyncVectorEnv([_cpu_thunk(steps, wrap=True)] * 2, context="forkserver")
    env = RecordEpisode(vec, tmp_path / "ours", trajectory_name="v", render_substeps=True)
    env.reset(seed=seeds)
    actions = [np.stack(a) for a in zip(*[_actions(vec.single_action_space, steps, seed=s) for s in seeds])]
    for a in actions + actions[:1]:  # the last step auto-resets both envs
        env.step(a)
    env.close()
    for e, seed in enumerate(seeds):
        (theirs,) = _maniskill_video(make_env, tmp_path / f"theirs{e}", seed, [a[e] for a in actions])
        (ours,) = [decode_mp4(p) for p in (tmp_path / "ours").glob(f"*_env{e}_*.mp4")]
        _same_pictures(ours, theirs)


def test_async_vector_env_without_the_wrapper_is_refused(tmp_path):
    vec = gym.vector.AsyncVectorEnv([_cpu_thunk(2)] * 2, context="forkserver")
    env = None
    try:
        with pytest.raises(ValueError, match=r"sub-envs \[0, 1\] are not wrapped in fastrecord.substeps.SubstepFrames"):
            RecordEpisode(vec, tmp_path / "out", render_substeps=True)
        assert not (tmp_path / "out").exists()
        env = RecordEpisode(vec, tmp_path / "out", trajectory_name="a")  # the env is still usable without substeps
        env.reset(seed=0)
        env.step(vec.action_space.sample())
    finally:
        (env or vec).close()  # the recorder closes its writers and the vector env


def test_batched_env_substep_frames(tmp_path):
    """GPU-batched envs (the double runs ManiSkill's hook): every substep's picture, partial resets, and
    save_video_trigger switching the substep renders off for the steps it does not capture."""
    n, s, size = 3, 4, 32
    env = BatchedDoubleEnv(num_envs=n, max_episode_steps=6, size=size, sim_steps_per_control=s)
    rec = RecordEpisode(env, tmp_path, trajectory_name="b", render_substeps=True, max_steps_per_video=None)
    rec.reset(seed=0)
    expected = [[frames_for(env.pos, env.elapsed_steps, size)[e]] for e in range(n)]
    actions = torch.linspace(-1, 1, 9).reshape(3, 3)
    for t in range(3):
        pos = env.pos.clone()
        for k in range(1, s + 1):  # what each substep shows: the state moved by k / s of the step
            sub = frames_for(pos + k * (0.1 / s) * actions, env.elapsed_steps, size)
            for e in range(n):
                expected[e].append(sub[e])
        rec.step(actions)
        after = frames_for(env.pos, env.elapsed_steps, size)
        for e in range(n):
            expected[e].append(after[e])
        if t == 1:  # env 1 ends early: a partial reset
            rec.reset(options={"env_idx": torch.tensor([1])})
            expected[1] = [frames_for(env.pos, env.elapsed_steps, size)[1]]
    rec.close()
    assert env.render_calls == 1 + 3 * (s + 1) + 1  # a reset, 3 steps of s substeps + 1, a partial reset
    for e in range(n):
        videos = sorted(tmp_path.glob(f"*_env{e}_*.mp4"), key=lambda p: int(p.name.split("_")[0]))
        got = decode_mp4(videos[-1])
        want = torch.stack(expected[e]).numpy()
        assert got.shape == want.shape == ((1 + 3 * (s + 1)) if e != 1 else (1 + s + 1), size, size, 3)
        assert frame_psnr(got, want).min() > 30

    # a step whose frames are not captured renders no substeps
    calls = []
    env2 = BatchedDoubleEnv(num_envs=1, max_episode_steps=4, size=size, sim_steps_per_control=s)
    rec = RecordEpisode(
        env2, tmp_path / "trig", render_substeps=True, save_video_trigger=lambda i: calls.append(i) or False
    )
    rec.reset(seed=0)
    for _ in range(2):
        rec.step(torch.zeros(1, 3))
    rec.close()
    assert env2.render_calls == 0 and not list((tmp_path / "trig").glob("*.mp4"))
    assert env2.unwrapped.__dict__.get("_after_simulation_step") is None  # the hook is gone after close


def test_env_without_substeps_is_refused(tmp_path):
    class NoSubsteps(BatchedDoubleEnv):
        _after_simulation_step = None

    with pytest.raises(ValueError, match=r"render_substeps=True hooks the physics substeps of a ManiSkill env"):
        RecordEpisode(NoSubsteps(), tmp_path / "out", render_substeps=True)
    assert not (tmp_path / "out").exists()


def test_overlay_on_the_step_frames_only():
    """info_on_video with substeps: ManiSkill draws the info on the frame after each step, not the substeps'."""
    o = Overlay.of_episode({"reward": np.array([1.0, 2.0])}, "font.ttf", per_step=3)
    assert len(o) == 7
    assert [d.get("reward") for d in o] == [None, None, None, 1.0, None, None, 2.0]
    assert [o[f].get("reward") for f in range(7)] == [d.get("reward") for d in o]
    assert [d.get("reward") for d in o[3:7]] == [1.0, None, None, 2.0]
