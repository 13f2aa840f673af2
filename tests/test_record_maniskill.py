"""fastrecord.RecordEpisode on real ManiSkill envs (CPU simulation, lavapipe rendering)."""

from __future__ import annotations

import json
import subprocess
import sys

import gymnasium as gym
import h5py
import numpy as np
import torch

from fastrecord import RecordEpisode
from fastrecord.testing import frame_psnr as psnr
from fastrecord.video import decode_mp4


def maniskill_video_psnr(frames: np.ndarray, tmp_path) -> float:
    """PSNR of ManiSkill's own video writer (images_to_video, its defaults) on the same frames."""
    from mani_skill.utils.visualization.misc import images_to_video

    images_to_video(list(frames), str(tmp_path), "maniskill_ref", fps=30, verbose=False)
    return float(psnr(decode_mp4(tmp_path / "maniskill_ref.mp4"), frames).min())


class CountRenders(gym.Wrapper):
    """Counts render() calls that reach the env (below the recorder)."""

    def __init__(self, env):
        super().__init__(env)
        self.calls = 0

    def render(self):
        self.calls += 1
        return self.env.render()


def rollout(env, base, steps: int, seed: int) -> dict[str, np.ndarray]:
    """Step with random actions, keeping what the env produced: obs, actions, rewards, states, frames."""
    obs, _ = env.reset(seed=seed)
    rec = dict(obs=[obs], actions=[], rewards=[], states=[base.get_state()], frames=[base.render()])
    for _ in range(steps):
        a = torch.as_tensor(env.action_space.sample())[None]
        obs, r, *_ = env.step(a)
        for k, v in (
            ("obs", obs),
            ("actions", a),
            ("rewards", r),
            ("states", base.get_state()),
            ("frames", base.render()),
        ):
            rec[k].append(v)
    return {k: torch.cat([x.clone() for x in v]).numpy() for k, v in rec.items()}


def test_single_env_round_trip(make_env, tmp_path):
    """PickCube-v1, one CPU env: HDF5 values, JSON entries and decoded MP4 frames equal what the env produced."""
    counted = CountRenders(make_env("PickCube-v1", max_episode_steps=8))
    env = RecordEpisode(counted, tmp_path, trajectory_name="traj", video_fps=10)
    base = env.unwrapped
    ep0 = rollout(env, base, steps=8, seed=3)
    renders_after_first = counted.calls
    ep1 = rollout(env, base, steps=5, seed=4)
    env.close()

    # one render per reset and one per step, all through the wrapper chain (test captures go to base)
    assert renders_after_first == 1 + 8
    assert counted.calls == 2 * 1 + 8 + 5

    with h5py.File(tmp_path / "traj.h5") as f:
        assert sorted(f) == ["traj_0", "traj_1"]
        for name, ep, steps in (("traj_0", ep0, 8), ("traj_1", ep1, 5)):
            g = f[name]
            np.testing.assert_allclose(g["obs"][:], ep["obs"], rtol=1e-6)
            np.testing.assert_allclose(g["actions"][:], ep["actions"], rtol=1e-6)
            np.testing.assert_allclose(g["rewards"][:], ep["rewards"], rtol=1e-5)
            assert g["terminated"].shape == g["truncated"].shape == g["success"].shape == (steps,)
            assert g["truncated"][-1] == (steps == 8)
            # env_states: ManiSkill's nested layout, and the flat state per step equals get_state()
            flat = np.concatenate(
                [g["env_states/actors"][k][:] for k in g["env_states/actors"]]
                + [g["env_states/articulations"][k][:] for k in g["env_states/articulations"]],
                axis=1,
            )
            np.testing.assert_allclose(flat, ep["states"], rtol=1e-5, atol=1e-6)
    meta = json.loads((tmp_path / "traj.json").read_text())
    assert meta["env_info"]["env_id"] == "PickCube-v1"
    assert meta["env_info"]["max_episode_steps"] == 8
    e0, e1 = meta["episodes"]
    assert (e0["episode_id"], e0["elapsed_steps"], e0["episode_seed"], e0["reset_kwargs"]["seed"]) == (0, 8, 3, 3)
    assert (e1["episode_id"], e1["elapsed_steps"], e1["episode_seed"]) == (1, 5, 4)
    assert e0["control_mode"] == "pd_joint_delta_pos" and e0["success"] is False

    # videos: one per episode, elapsed steps + 1 frames, each frame the one rendered at that step
    for vid, ep in (("0_env0_failure.mp4", ep0), ("1_env0_failure.mp4", ep1)):
        decoded = decode_mp4(tmp_path / vid)
        assert decoded.shape == ep["frames"].shape
        ours = psnr(decoded, ep["frames"])
        assert ours.min() >= maniskill_video_psnr(ep["frames"], tmp_path) - 0.5
        assert ours.min() > 28
        # a video shifted by one frame would not pass: the same check against shifted frames fails
        assert psnr(decoded[1:], ep["frames"][:-1]).min() < ours.min() - 3


def test_replay_tool_reproduces_success(make_env, tmp_path):
    """PushCube-v1 episodes recorded by fastrecord replay with ManiSkill's replay tool to the same success flags."""
    env = RecordEpisode(
        make_env("PushCube-v1", max_episode_steps=6), tmp_path, trajectory_name="push", save_video=False
    )
    for seed in (0, 1):
        env.reset(seed=seed)
        for _ in range(6):
            env.step(env.action_space.sample())
    env.close()
    meta = json.loads((tmp_path / "push.json").read_text())
    assert [e["episode_id"] for e in meta["episodes"]] == [0, 1]
    out = subprocess.run(
        [sys.executable, "-m", "mani_skill.trajectory.replay_trajectory", "--traj-path", str(tmp_path / "push.h5"),
         "--use-env-states", "--save-traj", "--allow-failure", "-b", "physx_cpu"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Replayed 2 episodes" in out.stdout + out.stderr
    replayed = json.loads(next(tmp_path.glob("push.*.json")).read_text())
    assert [e["success"] for e in replayed["episodes"]] == [e["success"] for e in meta["episodes"]]
    with h5py.File(next(tmp_path.glob("push.*.h5"))) as r, h5py.File(tmp_path / "push.h5") as o:
        for k in ("traj_0", "traj_1"):
            # the replay re-simulates each step from our state t-1 with our action t-1 (row 0 it overwrites
            # with row 1 in ManiSkill 3.0.1, so it is skipped): positions agree with what we recorded
            np.testing.assert_allclose(
                r[k]["env_states/actors/cube"][1:, :3], o[k]["env_states/actors/cube"][1:, :3], atol=1e-4
            )


def test_keep_success_on_real_successes(make_env, tmp_path):
    """keep='success' writes only the episodes that end successful (a scripted PickCube policy succeeds)."""
    from fastrecord.policies import pick_cube_policy

    env = RecordEpisode(make_env("PickCube-v1", control_mode="pd_ee_delta_pos", max_episode_steps=30),
                        tmp_path, trajectory_name="t", keep="success")
    act = pick_cube_policy(env)
    results = []
    for seed, scripted in ((0, True), (1, False), (2, True)):
        obs, _ = env.reset(seed=seed)
        for _ in range(30):
            obs, _, term, trunc, info = env.step(act(obs) if scripted else torch.zeros(1, 4))
            if term.any() or trunc.any():
                break
        results.append(bool(info["success"].item()))
    env.close()
    assert results == [True, False, True]
    meta = json.loads((tmp_path / "t.json").read_text())
    assert [(e["episode_id"], e["episode_seed"], e["success"]) for e in meta["episodes"]] == [
        (0, 0, True),
        (1, 2, True),
    ]
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == ["0_env0_success.mp4", "1_env0_success.mp4"]
    with h5py.File(tmp_path / "t.h5") as f:
        assert sorted(f) == ["traj_0", "traj_1"] and f["traj_1/success"][-1]


def test_vector_env_partial_resets(tmp_path):
    """A SyncVectorEnv of 3 ManiSkill CPU envs whose episodes end at different steps (auto-reset)."""
    import mani_skill.envs  # noqa: F401
    from conftest import CAMERA
    from mani_skill.utils.wrappers import CPUGymWrapper

    lengths = [3, 5, 4]

    def thunk(n):
        return lambda: CPUGymWrapper(gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array",
                                              sim_backend="physx_cpu", human_render_camera_configs=CAMERA,
                                              max_episode_steps=n))

    vec = gym.vector.SyncVectorEnv([thunk(n) for n in lengths])
    env = RecordEpisode(vec, tmp_path, trajectory_name="v")
    obs, _ = env.reset(seed=[10, 11, 12])
    seen_obs = [[o] for o in obs]  # per env, per step
    seen_frames = [[f] for f in vec.call("render")]
    for _ in range(9):
        obs, *_ = env.step(env.action_space.sample())
        for i, f in enumerate(vec.call("render")):
            seen_obs[i].append(obs[i])
            seen_frames[i].append(f)
    env.close()

    meta = json.loads((tmp_path / "v.json").read_text())
    by_env: dict[int, list[dict]] = {0: [], 1: [], 2: []}
    videos = {int(p.name.split("_")[0]): p for p in tmp_path.glob("*.mp4")}  # "{episode}_env{i}_{outcome}.mp4"
    with h5py.File(tmp_path / "v.h5") as f:
        for e in meta["episodes"]:
            env_idx = int(videos[e["episode_id"]].name.split("_env")[1].split("_")[0])
            by_env[env_idx].append(e)
            g = f[f"traj_{e['episode_id']}"]
            # where this episode sits in the env's step sequence: episodes follow each other, a step apart
            start = sum(x["elapsed_steps"] + 1 for x in by_env[env_idx][:-1])
            T = e["elapsed_steps"]
            np.testing.assert_allclose(g["obs"][:], np.stack(seen_obs[env_idx][start : start + T + 1]), rtol=1e-6)
            decoded = decode_mp4(videos[e["episode_id"]])
            ref = np.stack(seen_frames[env_idx][start : start + T + 1])
            assert decoded.shape == ref.shape
            ours = psnr(decoded, ref).min()
            assert ours >= maniskill_video_psnr(ref, tmp_path) - 0.5
    # full episodes end at their own time limits; each env's last, unfinished episode is flushed at close
    assert [x["elapsed_steps"] for x in by_env[0]] == [3, 3, 1]
    assert [x["elapsed_steps"] for x in by_env[1]] == [5, 3]
    assert [x["elapsed_steps"] for x in by_env[2]] == [4, 4]
    assert next(x["episode_seed"] for x in by_env[1]) == 11


def test_sensor_camera_video_needs_no_render(make_env, tmp_path):
    """video_source='sensor:base_camera' takes frames from the observation: no render call at all."""
    counted = CountRenders(make_env("PickCube-v1", obs_mode="rgb", max_episode_steps=4,
                                    sensor_configs=dict(width=32, height=32)))
    env = RecordEpisode(
        counted, tmp_path, trajectory_name="s", video_source="sensor:base_camera", save_trajectory=False
    )
    obs, _ = env.reset(seed=0)
    frames = [obs["sensor_data"]["base_camera"]["rgb"][0].numpy()]
    for _ in range(4):
        obs, *_ = env.step(env.action_space.sample())
        frames.append(obs["sensor_data"]["base_camera"]["rgb"][0].numpy())
    env.close()
    assert counted.calls == 0
    decoded = decode_mp4(tmp_path / "0_env0_failure.mp4")
    assert decoded.shape == (5, 32, 32, 3)
    assert psnr(decoded, np.stack(frames)).min() > 25


def test_async_vector_env(tmp_path):
    """AsyncVectorEnv sub-envs in other processes: flat states per step, split back into ManiSkill's dict."""
    import mani_skill.envs  # noqa: F401
    from conftest import CAMERA
    from mani_skill.utils.wrappers import CPUGymWrapper

    def thunk():
        return CPUGymWrapper(gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                                      human_render_camera_configs=CAMERA, max_episode_steps=3))

    vec = gym.vector.AsyncVectorEnv([thunk, thunk], context="forkserver")
    env = RecordEpisode(vec, tmp_path, trajectory_name="a")
    env.reset(seed=[5, 6])
    states = [env.call("get_state_dict")]
    for _ in range(3):
        env.step(env.action_space.sample())
        states.append(env.call("get_state_dict"))
    env.close()
    eps = json.loads((tmp_path / "a.json").read_text())["episodes"]
    assert [(e["elapsed_steps"], e["episode_seed"], e["reset_kwargs"]["seed"]) for e in eps] == [(3, 5, 5), (3, 6, 6)]
    with h5py.File(tmp_path / "a.h5") as f:
        for i in range(2):
            g = f[f"traj_{i}/env_states"]
            for group in ("actors", "articulations"):
                assert list(g[group]) == list(states[0][i][group])
                for name in g[group]:
                    expected = np.concatenate([np.asarray(s[i][group][name]) for s in states])
                    np.testing.assert_allclose(g[group][name][:], expected, rtol=1e-6)


def test_vector_env_closes_beside_the_writers_and_its_error_surfaces(tmp_path):
    """``RecordVectorEpisode.close`` ends the episodes in progress, then closes the vector env while the writers
    finish them: every episode is still saved whole, and an error of the env's close reaches the caller after
    the files are complete."""
    import mani_skill.envs  # noqa: F401
    import pytest
    from conftest import CAMERA
    from mani_skill.utils.wrappers import CPUGymWrapper

    class BrokenClose(gym.vector.SyncVectorEnv):
        def close_extras(self, **kwargs):
            super().close_extras(**kwargs)
            raise RuntimeError("a sub-env failed to close")

    def thunk():
        return CPUGymWrapper(gym.make("PickCube-v1", obs_mode="state", render_mode="rgb_array", sim_backend="physx_cpu",
                                      human_render_camera_configs=CAMERA, max_episode_steps=10))

    vec = BrokenClose([thunk, thunk])
    env = RecordEpisode(vec, tmp_path, trajectory_name="c")
    env.reset(seed=[1, 2])
    frames = [vec.call("render")]
    for _ in range(2):
        env.step(env.action_space.sample())
        frames.append(vec.call("render"))
    with pytest.raises(RuntimeError, match="a sub-env failed to close"):
        env.close()
    env.close()  # idempotent
    eps = json.loads((tmp_path / "c.json").read_text())["episodes"]
    assert sorted((e["episode_seed"], e["elapsed_steps"]) for e in eps) == [(1, 2), (2, 2)]
    for i in range(2):
        (video,) = tmp_path.glob(f"*_env{i}_*.mp4")
        ref = np.stack([np.asarray(f[i]) for f in frames])
        decoded = decode_mp4(video)
        assert decoded.shape == ref.shape and psnr(decoded, ref).min() > 25
