"""Does a replay by env states need the physics step once the recorded state is set? (issue 19)

`ReplayStates` plays step t as ManiSkill's replay tool does: the physics step from state t with action t
(`BaseEnv._step_action`), then the recorded state t+1 is set, then info, observation and reward are
computed on it. These tests drive a real PickCube-v1 env on the CPU the same way, once with the physics
step and once setting the state only, and compare both with what the recording holds.

Finding (docs/replay.md, "Replay by env states: the physics step"): the state does not carry what only a
physics step computes. Contact forces (PickCube's ``is_grasped``, in info, in the ``extra`` observation
of every obs mode but "none", and in the dense reward) are those of the env's last physics step, and a
controller's target (``pd_ee_target_delta_pose``: ``agent/controller`` in the observation and the
``controller`` env state) is not part of what ``set_state_dict`` sets. Pictures depend on poses only and
are the same either way. No obs mode is free of it (info and reward are computed in every mode), so the
replay keeps the physics step in every mode. A reset takes no physics step: its contacts are the previous
episode's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gymnasium as gym
import h5py
import numpy as np
import pytest
import torch
from conftest import CAMERA

from fastrecord.replay.envs import tree_index, tree_stack
from fastrecord.sinks.maniskill_h5.reader import read_tree

ENV_ID = "PickCube-v1"
SEED = 0  # the scripted policy grasps the cube at step 7 and places it at step 18 (success)


def leaves(tree: Any, prefix: str = "") -> dict[str, np.ndarray]:
    """Copies of the arrays of a nested dict (torch or numpy) by path; a bare array is the leaf "". (Copies:
    an observation can alias the env's own tensors, e.g. the controller's target, which a reset changes.)"""
    if not isinstance(tree, dict):
        return {prefix.rstrip("/"): torch.as_tensor(tree).cpu().numpy().copy()}
    out: dict[str, np.ndarray] = {}
    for k, v in tree.items():
        out |= leaves(v, f"{prefix}{k}/")
    return out


def record(out: Path, control_mode: str, actions: Any, steps: int) -> h5py.Group:
    """One episode of PickCube-v1 (state_dict observations, dense reward) recorded by fastrecord."""
    import mani_skill.envs  # noqa: F401

    from fastrecord import RecordEpisode

    env = RecordEpisode(gym.make(ENV_ID, obs_mode="state_dict", control_mode=control_mode, reward_mode="dense",
                                 sim_backend="physx_cpu", max_episode_steps=50), str(out),
                        trajectory_name="trajectory", save_video=False)
    act = actions(env)
    obs, _ = env.reset(seed=SEED)
    for _ in range(steps):
        obs, _, _, _, info = env.step(act(obs))
        if bool(info["success"]):
            break
    env.close()
    f = h5py.File(out / "trajectory.h5", "r")
    return f["traj_0"]


@pytest.fixture(scope="module")
def grasp(tmp_path_factory):
    """An episode in which the robot grasps the cube and places it at the goal (fastrecord's scripted policy)."""
    from fastrecord.policies import pick_cube_policy

    traj = record(tmp_path_factory.mktemp("grasp"), "pd_ee_delta_pos", pick_cube_policy, 50)
    yield traj
    traj.file.close()


def replay(base: Any, traj: h5py.Group, physics_step: bool, render: bool = False) -> list[dict[str, np.ndarray]]:
    """Replay the episode by its env states, as `ReplayStates` does, with or without the physics step: per
    step, the observation's leaves before flattening ("obs/..."; "flat": as the obs mode returns it),
    "info/...", "controller/..." (its env state), "reward", the human camera's "frame"."""
    states, actions = read_tree(traj["env_states"]), traj["actions"][:]
    device = torch.device(base.device)
    base.reset(
        seed=SEED, options=dict(reset_to_env_states=dict(env_states=tree_stack([tree_index(states, 0)], device)))
    )
    rows = []
    for t, action in enumerate(torch.as_tensor(actions[:, None], device=device)):
        if physics_step:
            base._step_action(action)
        base._elapsed_steps += 1
        base.set_state_dict(tree_stack([tree_index(states, t + 1)], device))
        info = base.get_info()
        obs = base.get_obs(info, unflattened=True)
        reward = base.get_reward(obs=obs, action=action, info=info)
        row = {f"obs/{k}": v[0] for k, v in leaves(obs).items()}
        row |= {f"info/{k}": v.reshape(-1)[0] for k, v in leaves(info).items()}
        row |= {f"controller/{k}": v[0] for k, v in leaves(base.get_state_dict().get("controller", {})).items()}
        row |= {"reward": leaves(reward)[""][0], "flat": leaves(base._flatten_raw_obs(obs))}  # "state": one vector
        if render:
            row["frame"] = leaves(base.render())[""][0]
        rows.append(row)
    return rows


def column(rows: list[dict[str, Any]], key: str) -> np.ndarray:
    return np.stack([r[key] for r in rows])


def recorded_obs(traj: h5py.Group) -> dict[str, np.ndarray]:
    """The recorded observations after each step (row 0 is the reset's), by the replay's "obs/..." keys."""
    return {f"obs/{k}": v[1:] for k, v in leaves(read_tree(traj["obs"])).items()}


@pytest.fixture
def make_base(make_env):
    def _make(obs_mode: str, **kw):
        return make_env(ENV_ID, obs_mode=obs_mode, reward_mode="dense", max_episode_steps=50, **kw).unwrapped
    return _make


@pytest.mark.parametrize("obs_mode", ["state_dict", "state", "none"])
def test_state_observation_needs_the_physics_step(grasp, make_base, obs_mode):
    """Without the physics step, ``is_grasped`` (contact forces) is whatever the env's last physics step left,
    and the dense reward with it; every other leaf comes from the state and is the same either way.
    obs_mode "none" has no observation, but the same info and reward."""
    recorded = recorded_obs(grasp)
    rec_grasped = grasp["obs/extra/is_grasped"][1:]
    rec_reward, rec_success = grasp["rewards"][:], grasp["success"][:]
    assert 0 < rec_grasped.sum() < len(rec_grasped)  # the episode reaches, grasps and carries the cube

    base = make_base(obs_mode, control_mode="pd_ee_delta_pos")
    # set-only first, in an env that has not simulated yet: it has no contacts at all
    set_only = replay(base, grasp, physics_step=False)
    stepped = replay(base, grasp, physics_step=True)
    # set-only again, after the stepped replay: the contacts of its last step (the cube held) stay
    stale = replay(base, grasp, physics_step=False)

    # with the physics step: the recording, leaf by leaf (contacts are those of a step from the recorded state)
    np.testing.assert_array_equal(column(stepped, "info/is_grasped"), rec_grasped)
    np.testing.assert_allclose(column(stepped, "reward"), rec_reward, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(column(stepped, "info/success"), rec_success)
    # ("state" and "state_dict" compute the same leaves; "state" then flattens them into one vector)
    if obs_mode == "none":
        assert not any(k.startswith("obs/") for k in stepped[0]) and not stepped[0]["flat"]
        recorded = {}
    assert {k for k in stepped[0] if k.startswith("obs/")} == recorded.keys()
    for k, v in recorded.items():
        np.testing.assert_allclose(column(stepped, k), v, rtol=0, atol=1e-6, err_msg=k)

    for rows, grasped in ((set_only, False), (stale, True)):
        assert column(rows, "info/is_grasped").tolist() == [grasped] * len(
            rec_grasped
        )  # frozen: no step, no new contacts
        wrong = column(rows, "info/is_grasped") != rec_grasped
        assert wrong.any()
        # the reward is wrong exactly where is_grasped is (PickCube's dense reward adds it), by >= 1,
        # but at success (a flat 5)
        reward_off = np.abs(column(rows, "reward") - rec_reward)
        assert np.array_equal(reward_off > 1e-5, wrong & ~rec_success) and reward_off[wrong & ~rec_success].min() >= 1.0
        # success (cube at the goal, robot still) reads poses and joint velocities only: the same
        np.testing.assert_array_equal(column(rows, "info/success"), rec_success)
        for k in recorded:
            a, b = column(rows, k), column(stepped, k)
            if k == "obs/extra/is_grasped":
                assert not np.array_equal(a, b)
            else:  # qpos, qvel, tcp and cube poses, goal: set from the file
                np.testing.assert_array_equal(a, b, err_msg=k)
        # the observation as the obs mode returns it ("state": one vector, is_grasped in it) differs too
        assert obs_mode == "none" or any(
            not np.array_equal(r["flat"][k], s["flat"][k]) for r, s in zip(rows, stepped) for k in r["flat"]
        )


def test_reset_observation_holds_the_previous_episodes_contacts(grasp, make_base):
    """A reset takes no physics step either (ManiSkill 3.0.1, by seed or to a recorded state): its
    ``is_grasped`` is the last step's of the episode before, in a recording as in a replay. Row 0 of an
    episode's contact-based observations is therefore not a function of its recorded state, and no replay
    reproduces it but by chance; from row 1 on, the physics step makes them the recording's."""
    base = make_base("state_dict", control_mode="pd_ee_delta_pos")
    replay(base, grasp, physics_step=True)  # ends with the cube held at the goal
    first = tree_stack([tree_index(read_tree(grasp["env_states"]), 0)], torch.device(base.device))
    _, info = base.reset(seed=SEED, options=dict(reset_to_env_states=dict(env_states=first)))
    assert not grasp["obs/extra/is_grasped"][0]  # recorded in a fresh env: the gripper open, the cube on the table
    assert bool(info["is_grasped"])  # the same state, after an episode that ended holding the cube
    _, info = base.reset(seed=SEED)  # a seeded reset alike
    assert bool(info["is_grasped"])


def test_controller_target_needs_the_physics_step(tmp_path, make_base):
    """A controller that keeps a target (pd_ee_target_delta_pose) moves it in the physics step's
    ``set_action``; ``set_state_dict`` does not set it. Without the step it stays where the reset put it."""
    gen = np.random.default_rng(0)

    def wiggle(env):
        return lambda obs: gen.uniform(-1, 1, size=(1, 7)).astype(np.float32)

    traj = record(tmp_path, "pd_ee_target_delta_pose", wiggle, 6)
    try:
        target = "obs/agent/controller/arm/target_pose"
        recorded = recorded_obs(traj)[target]
        assert np.abs(np.diff(recorded, axis=0)).max() > 1e-3  # the target moves every step
        base = make_base("state_dict", control_mode="pd_ee_target_delta_pose")
        stepped = replay(base, traj, physics_step=True)
        set_only = replay(base, traj, physics_step=False)
        np.testing.assert_allclose(column(stepped, target), recorded, rtol=0, atol=1e-6)
        np.testing.assert_allclose(column(stepped, "controller/arm/target_pose"),
                                   traj["env_states/controller/arm/target_pose"][1:], rtol=0, atol=1e-6)
        # set-only: the reset's target (the recorded row 0) at every step
        held = column(set_only, target)
        np.testing.assert_allclose(held, np.broadcast_to(traj[target][0], held.shape), rtol=0, atol=1e-6)
        assert np.abs(held - recorded).max() > 1e-2
    finally:
        traj.file.close()


def test_pictures_do_not_need_the_physics_step(grasp, make_base):
    """Sensor and human-camera pictures depend on poses only: bit-identical with and without the physics
    step. The visual obs modes still carry agent/extra state, which does differ (is_grasped)."""
    base = make_base("rgb", control_mode="pd_ee_delta_pos", sensor_configs=CAMERA)
    set_only = replay(base, grasp, physics_step=False, render=True)
    stepped = replay(base, grasp, physics_step=True, render=True)
    rgb = "obs/sensor_data/base_camera/rgb"
    for key in (rgb, "frame"):
        a, b = column(stepped, key), column(set_only, key)
        assert a.shape == (len(stepped), 64, 64, 3)
        assert len({x.tobytes() for x in a}) > len(a) // 2  # the scene moves: most pictures differ from each other
        np.testing.assert_array_equal(a, b, err_msg=key)
    assert not np.array_equal(column(stepped, "obs/extra/is_grasped"), column(set_only, "obs/extra/is_grasped"))
