"""`BatchedDoubleEnv` keeps ManiSkill's GPU-parallel env contract (the recorder's tests, the benchmark and
the profiler all stand on it): batched shapes and devices, partial resets, seeds, per-env truncation,
clip-bank frames, success/fail flags; and the clip banks they share (`gradient_clips`, `make_bank`,
`source_env`, `maniskill_clips`, `sensor_clips`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastrecord.testing import BatchedDoubleEnv, frames_for

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def bank(clips: int = 3, frames: int = 4, h: int = 8, w: int = 6) -> np.ndarray:
    """Every pixel of frame (c, t) holds 10 * c + t (channel 0): a frame says which one it is."""
    out = np.zeros((clips, frames, h, w, 3), np.uint8)
    for c in range(clips):
        for t in range(frames):
            out[c, t] = (10 * c + t, 100 + t, 200)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_are_batched_tensors_on_the_device(device):
    env = BatchedDoubleEnv(num_envs=3, max_episode_steps=5, size=16, device=device)
    obs, info = env.reset(seed=0)
    assert obs.shape == (3, 4) and obs.device.type == device and info == {"reconfigure": False}
    obs, reward, term, trunc, info = env.step(torch.zeros(3, 3, device=device))
    assert obs.shape == (3, 4) and reward.shape == term.shape == trunc.shape == (3,)
    assert term.dtype == trunc.dtype == info["success"].dtype == info["fail"].dtype == torch.bool
    assert info["elapsed_steps"].tolist() == [1, 1, 1]
    for t in (obs, reward, term, trunc, info["success"], info["fail"], info["elapsed_steps"]):
        assert t.device.type == device
    img = env.render()
    assert img.shape == (3, 16, 16, 3) and img.dtype == torch.uint8 and img.device.type == device
    state = env.get_state_dict()
    assert state["actors"]["box"].shape == (3, 13) and state["articulations"]["arm"].shape == (3, 4)
    assert env.action_space.shape == (3, 3) and env.single_action_space.shape == (3,)
    assert env.observation_space.shape == (3, 4) and env.gpu_sim_enabled == (device == "cuda")


def test_partial_reset_resets_only_those_envs():
    env = BatchedDoubleEnv(num_envs=4, max_episode_steps=10)
    env.reset(seed=[10, 11, 12, 13])
    for _ in range(3):
        env.step(torch.ones(4, 3))
    before = env.pos.clone()
    obs, _ = env.reset(options={"env_idx": torch.tensor([1, 3])})
    assert obs.shape == (4, 4)  # obs of every env
    assert env.elapsed_steps.tolist() == [3, 0, 3, 0]
    torch.testing.assert_close(env.pos[[0, 2]], before[[0, 2]])
    assert not torch.allclose(env.pos[[1, 3]], before[[1, 3]])
    assert env._episode_seed.tolist() == [10, 11, 12, 13]  # no seed given: the episode seeds stay
    _, _, _, _, info = env.step(torch.zeros(4, 3))
    assert info["elapsed_steps"].tolist() == [4, 1, 4, 1]


def test_seeds_set_episode_seeds_and_start_states():
    env = BatchedDoubleEnv(num_envs=3)
    env.reset(seed=5)
    assert env._episode_seed.tolist() == [5, 6, 7]  # one seed: consecutive seeds per env
    first = env.pos.clone()
    env.reset(seed=[5, 6, 7])
    torch.testing.assert_close(env.pos, first)  # the same seeds, the same start states
    env.reset(seed=[9], options={"env_idx": [2]})
    assert env._episode_seed.tolist() == [5, 6, 9]
    torch.testing.assert_close(env.pos[:2], first[:2])
    assert not torch.allclose(env.pos[2], first[2])
    assert len({tuple(p) for p in first.tolist()}) == 3  # envs start apart


def test_truncation_at_each_envs_own_length():
    env = BatchedDoubleEnv(num_envs=3, max_episode_steps=5, episode_lengths=[2, 5, 3])
    env.reset(seed=0)
    truncated_at = {}
    for t in range(1, 6):
        trunc = env.step(torch.zeros(3, 3))[3]
        for e in np.flatnonzero(trunc.numpy()):
            truncated_at.setdefault(int(e), t)
    assert truncated_at == {0: 2, 1: 5, 2: 3}
    env.reset(options={"env_idx": [0]})  # env 0 starts over: its length again
    assert env.step(torch.zeros(3, 3))[3].tolist() == [False, True, True]
    assert env.step(torch.zeros(3, 3))[3].tolist() == [True, True, True]


def test_default_length_is_max_episode_steps():
    env = BatchedDoubleEnv(num_envs=2, max_episode_steps=3)
    env.reset(seed=0)
    assert [env.step(torch.zeros(2, 3))[3].tolist() for _ in range(3)] == [[False, False]] * 2 + [[True, True]]


def test_episode_lengths_function_of_env_and_seed():
    calls = []

    def length(env_idx: int, seed: int) -> int:
        calls.append((env_idx, seed))
        return 1 + (env_idx + seed) % 4

    env = BatchedDoubleEnv(num_envs=3, max_episode_steps=4, episode_lengths=length)
    env.reset(seed=[0, 0, 2])
    assert calls == [(0, 0), (1, 0), (2, 2)] and env.episode_lengths.tolist() == [1, 2, 1]
    env.reset(seed=[1], options={"env_idx": [0]})  # called again for the envs reset, with their new seeds
    assert calls[-1] == (0, 1) and env.episode_lengths.tolist() == [2, 2, 1]
    assert env.step(torch.zeros(3, 3))[3].tolist() == [False, False, True]


def test_bad_episode_lengths():
    with pytest.raises(ValueError, match=r"2 entries for num_envs=3"):
        BatchedDoubleEnv(num_envs=3, episode_lengths=[1, 2])
    with pytest.raises(ValueError, match=r"\[\(1, 9\)\].*outside 1..max_episode_steps=8.*raise max_episode_steps"):
        BatchedDoubleEnv(num_envs=2, episode_lengths=[3, 9])
    env = BatchedDoubleEnv(num_envs=2, episode_lengths=lambda e, s: 0)
    with pytest.raises(ValueError, match=r"outside 1..max_episode_steps"):
        env.reset(seed=0)


@pytest.mark.parametrize("device", DEVICES)
def test_bank_frames_are_the_bank_entries(device):
    clips = bank()
    env = BatchedDoubleEnv(num_envs=5, max_episode_steps=6, device=device, bank=clips)
    env.reset(seed=0)
    steps = np.zeros(5, dtype=int)

    def check():
        img = env.render()
        assert img.shape == (5, 8, 6, 3) and img.device.type == device
        want = clips[np.arange(5) % 3, np.minimum(steps, 3)]  # env e: clip e % clips, held at its last frame
        np.testing.assert_array_equal(img.cpu().numpy(), want)

    check()
    for _t in range(2):
        env.step(torch.zeros(5, 3, device=device))
        steps += 1
        check()
    env.reset(options={"env_idx": torch.tensor([1, 4], device=device)})
    steps[[1, 4]] = 0
    check()
    for _ in range(3):  # envs 0, 2, 3 run past the clip's last frame
        env.step(torch.zeros(5, 3, device=device))
        steps += 1
        check()


def test_bad_bank():
    with pytest.raises(ValueError, match=r"\[clips, frames, H, W, 3\] uint8"):
        BatchedDoubleEnv(bank=np.zeros((2, 3, 8, 8, 3), np.float32))
    with pytest.raises(ValueError, match=r"\[clips, frames, H, W, 3\] uint8"):
        BatchedDoubleEnv(bank=np.zeros((3, 8, 8, 3), np.uint8))


def test_frames_without_bank_are_frames_for_the_state():
    env = BatchedDoubleEnv(num_envs=3, size=16)
    env.reset(seed=0)
    env.step(torch.ones(3, 3))
    torch.testing.assert_close(env.render(), frames_for(env.pos, env.elapsed_steps, 16))
    assert env.render_calls == 1  # one batched render per call


def test_success_and_fail_flags():
    env = BatchedDoubleEnv(num_envs=3, max_episode_steps=8, success_step=[2, 0, 0], fail_step=[0, 3, 0])
    env.reset(seed=0)
    rows = []
    for _ in range(3):
        _, _, term, _, info = env.step(torch.zeros(3, 3))
        rows.append((info["success"].tolist(), info["fail"].tolist(), term.tolist()))
    assert rows == [
        ([False, False, False], [False, False, False], [False, False, False]),
        ([True, False, False], [False, False, False], [True, False, False]),
        ([True, False, False], [False, True, False], [True, True, False]),  # terminated = success | fail
    ]
    env.reset(options={"env_idx": [0]})
    _, _, term, _, info = env.step(torch.zeros(3, 3))
    assert info["success"].tolist() == [False, False, False] and term.tolist() == [False, True, False]


def test_sim_seconds_and_busy_seconds():
    env = BatchedDoubleEnv(num_envs=2, sim_seconds=0.02)
    env.reset(seed=0)
    busy = env.busy_seconds
    for _ in range(3):
        env.step(torch.zeros(2, 3))
    assert env.busy_seconds - busy >= 0.06  # step time counts, sleep included
    busy = env.busy_seconds
    env.render()
    assert env.busy_seconds > busy


def test_state_dict_round_trip_all_and_some_envs():
    env = BatchedDoubleEnv(num_envs=3)
    env.reset(seed=0)
    state = env.get_state_dict()
    env.step(torch.ones(3, 3))
    env.set_state_dict(state)
    torch.testing.assert_close(env.pos, state["actors"]["box"][:, :3])
    env.step(torch.ones(3, 3))
    moved = env.pos.clone()
    env.set_state_dict({"actors": {"box": state["actors"]["box"][[1]]}}, env_idx=torch.tensor([1]))
    torch.testing.assert_close(env.pos[1], state["actors"]["box"][1, :3])
    torch.testing.assert_close(env.pos[[0, 2]], moved[[0, 2]])


@pytest.mark.parametrize("device", DEVICES)
def test_rgb_obs_mode_is_maniskills_rgb_observation(device):
    """obs_mode='rgb': ManiSkill's rgb observation layout (PickCube-v1's keys), the camera showing what
    render() shows, every leaf batched on the device; the spaces describe it."""
    env = BatchedDoubleEnv(num_envs=3, max_episode_steps=5, device=device, bank=bank(frames=6), obs_mode="rgb")
    obs, _ = env.reset(seed=0)
    assert set(obs) == {"agent", "extra", "sensor_param", "sensor_data"}
    assert set(obs["agent"]) == {"qpos", "qvel"} and set(obs["extra"]) == {"is_grasped", "tcp_pose", "goal_pos"}
    assert set(obs["sensor_param"]["base_camera"]) == {"extrinsic_cv", "cam2world_gl", "intrinsic_cv"}
    for _ in range(2):
        obs, *_ = env.step(torch.zeros(3, 3, device=device))
    rgb = obs["sensor_data"]["base_camera"]["rgb"]
    assert rgb.shape == (3, 8, 6, 3) and rgb.dtype == torch.uint8 and rgb.device.type == device
    assert torch.equal(rgb, env.render())
    assert rgb[:, 0, 0, 0].tolist() == [2, 12, 22]  # clip e, frame 2
    assert obs["sensor_param"]["base_camera"]["extrinsic_cv"].shape == (3, 3, 4)
    assert obs["extra"]["is_grasped"].dtype == torch.bool and obs["extra"]["is_grasped"].shape == (3,)
    assert env.single_observation_space["sensor_data"]["base_camera"]["rgb"].shape == (8, 6, 3)
    assert env.observation_space["agent"]["qpos"].shape == (3, 9)


def test_bad_obs_mode():
    with pytest.raises(ValueError, match=r"obs_mode='rgbd' is unknown; BatchedDoubleEnv has \('state', 'rgb'\)"):
        BatchedDoubleEnv(obs_mode="rgbd")


# ---------------------------------------------------------------------------------------------- clip banks
def test_gradient_clips_shape_and_seed():
    from fastrecord.testing import gradient_clips

    a = gradient_clips(2, 3, 8, 10)
    assert a.shape == (2, 3, 8, 10, 3) and a.dtype == np.uint8
    np.testing.assert_array_equal(a, gradient_clips(2, 3, 8, 10))  # a function of the seed
    assert not np.array_equal(a, gradient_clips(2, 3, 8, 10, seed=1))
    assert not np.array_equal(a[0, 0], a[0, 1]) and not np.array_equal(a[0], a[1])  # frames move, clips differ


def test_make_bank_rolls_each_clip_sideways():
    from fastrecord.testing import make_bank

    clips = bank(clips=2, frames=3, w=6)
    clips[..., 1] = np.arange(6, dtype=np.uint8)  # columns tell the shift
    out = make_bank(clips, variants=3)
    assert out.shape == (6, 3, 8, 6, 3) and out.flags.c_contiguous
    for c in range(2):
        for v in range(3):  # clip c, variant v at row c * variants + v, rolled by v * W / variants
            np.testing.assert_array_equal(out[c * 3 + v], np.roll(clips[c], 2 * v, axis=2))


def test_source_env_replays_the_bank_in_clip_long_episodes():
    from fastrecord.testing import source_env

    clips = bank(clips=2, frames=4)
    env = source_env(clips, num_envs=3, device="cpu", sim_seconds=0.0)
    env.reset(seed=0)
    np.testing.assert_array_equal(env.render().numpy(), clips[[0, 1, 0], 0])
    truncated = [env.step(torch.zeros(3, 3))[3].tolist() for _ in range(3)]
    assert truncated == [[False] * 3, [False] * 3, [True] * 3]  # frames - 1 steps
    np.testing.assert_array_equal(env.render().numpy(), clips[[0, 1, 0], 3])


def test_maniskill_and_sensor_clips_are_frames_of_a_real_task():
    """PickCube-v1 on the CPU at 16x16: the human camera (render) and the sensor camera (rgb observation)."""
    from fastrecord.testing import maniskill_clips, sensor_clips

    human = maniskill_clips("PickCube-v1", clips=1, frames=2, height=16, width=12, render_backend="cpu")
    assert human.shape == (1, 2, 16, 12, 3) and human.dtype == np.uint8 and human.std() > 0
    sensor = sensor_clips("PickCube-v1", clips=1, frames=2, size=16, render_backend="cpu")
    assert sensor.shape == (1, 2, 16, 16, 3) and sensor.dtype == np.uint8 and sensor.std() > 0
