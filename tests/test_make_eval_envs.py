"""fastrecord.make_eval_envs: the diffusion-policy baseline's signature, its envs, and every env's videos.

Real ManiSkill CPU envs (lavapipe rendering), 64x64 cameras, a few steps per episode.
"""

from __future__ import annotations

import importlib.util
import inspect
import typing
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from conftest import CAMERA

from fastrecord import make_eval_envs
from fastrecord.video import decode_mp4

ENV_ID = "PushCube-v1"
STEPS = 4  # max_episode_steps
OBS_DIM = 35  # PushCube-v1 state observation


def baseline_make_eval_envs(
    env_id,
    num_envs: int,
    sim_backend: str,
    env_kwargs: dict,
    other_kwargs: dict,
    video_dir: str | None = None,
    wrappers: list[gym.Wrapper] = [],  # noqa: B006
):
    """The signature of ManiSkill's examples/baselines/diffusion_policy/diffusion_policy/make_env.py
    (haosulab/ManiSkill, commit eb1a823), copied verbatim; the baseline is not part of the mani_skill wheel."""


def env_kwargs(**kw):
    return dict(control_mode="pd_ee_delta_pos", reward_mode="sparse", obs_mode="state", render_mode="rgb_array",
                human_render_camera_configs=CAMERA, max_episode_steps=STEPS) | kw


def load_example():
    path = Path(__file__).parents[1] / "scripts" / "evaluate.py"
    spec = importlib.util.spec_from_file_location("fastrecord_example_evaluate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_signature_is_the_baselines():
    ours = inspect.signature(make_eval_envs).parameters
    theirs = inspect.signature(baseline_make_eval_envs).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    our_hints, their_hints = typing.get_type_hints(make_eval_envs), typing.get_type_hints(baseline_make_eval_envs)
    for name, p in theirs.items():
        assert ours[name].kind == p.kind, name
        assert ours[name].default == p.default, name
        assert our_hints.get(name) == their_hints.get(name), name
    extra = [p for n, p in ours.items() if n not in theirs]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is not inspect.Parameter.empty for p in extra)
    assert "keep" in ours


def test_cpu_branch_records_every_env_and_feeds_the_baselines_loop(tmp_path, monkeypatch):
    """Two CPU envs (AsyncVectorEnv, as the baseline): stacked numpy observations, gymnasium-0.29 style
    final_info that the baseline's evaluate loop reads, and one MP4 per env episode for every env. On an 8-core
    machine 8 encoders, of which 5 encode at once while the 2 sub-env processes and the caller step."""
    ex = load_example()
    monkeypatch.setattr("fastrecord.sinks.factory.usable_cores", lambda: 8)
    envs = make_eval_envs(ENV_ID, 2, "physx_cpu", env_kwargs(), dict(obs_horizon=3), video_dir=str(tmp_path))
    try:
        videos = envs.env.recorder.videos
        assert (videos.workers, videos.stepping_workers) == (8, 5)
        assert isinstance(envs, gym.vector.VectorEnv)
        assert envs.single_observation_space.shape == (3, OBS_DIM)
        obs, _ = envs.reset(seed=0)
        assert isinstance(obs, np.ndarray) and obs.shape == (2, 3, OBS_DIM)
        assert (obs[:, 0] == obs[:, 2]).all()  # after a reset every slot holds the reset observation
        metrics = ex.evaluate(
            4, ex.ScriptedAgent(act_horizon=2, noise=0.0, seed=0), envs, torch.device("cpu"), "physx_cpu"
        )
    finally:
        envs.close()
    assert {"success_once", "success_at_end", "return", "episode_len"} <= set(metrics)
    assert metrics["episode_len"].tolist() == [STEPS] * 4
    names = sorted(p.name for p in tmp_path.glob("*.mp4"))
    assert [n.split("_")[1] for n in names] == ["env0", "env1", "env0", "env1"]  # every env, not env 0 only
    for p in tmp_path.glob("*.mp4"):
        frames = decode_mp4(p)
        assert frames.shape == (STEPS + 1, CAMERA["height"], CAMERA["width"], 3)
        assert frames.std() > 1  # a rendered scene, not a blank frame


def test_frame_stack_and_autoreset_match_maniskill_framestack_in_each_env(tmp_path):
    """Our stacking sits above the recorder; it must give what ManiSkill's FrameStack inside the
    sub-env gives (the baseline's order), across auto-resets, with the same final observation/info.

    Auto-resets are unseeded, and ManiSkill then draws the new episode from torch's global RNG: each
    stack runs alone from the same torch seed, with the same actions.
    """
    from mani_skill.utils.wrappers import CPUGymWrapper, FrameStack

    def reference():
        env = gym.make(ENV_ID, reconfiguration_freq=1, **env_kwargs())
        env = FrameStack(env, num_stack=2)
        return CPUGymWrapper(env, ignore_terminations=True, record_metrics=True)

    def rollout(make):
        torch.manual_seed(0)
        envs = make()
        rng = np.random.default_rng(0)
        try:
            obs, _ = envs.reset(seed=5)
            out = [obs]
            for _ in range(2 * STEPS + 1):
                obs, _, _, truncated, info = envs.step(rng.uniform(-1, 1, size=(1, 4)).astype(np.float32))
                out.append(obs)
                if truncated[0]:
                    final = info["final_observation" if "final_observation" in info else "final_obs"][0]
                    finals = info["final_info"]
                    episode = (
                        finals[0]["episode"]
                        if isinstance(finals, np.ndarray)
                        else {k: v[0] for k, v in finals["episode"].items() if not k.startswith("_")}
                    )
                    out.append(("final", final, episode))
            return envs.single_observation_space, out
        finally:
            envs.close()

    ref_space, ref = rollout(
        lambda: gym.vector.SyncVectorEnv([reference], autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)
    )
    our_space, ours = rollout(
        lambda: make_eval_envs(ENV_ID, 1, "physx_cpu", env_kwargs(), dict(obs_horizon=2), video_dir=str(tmp_path))
    )
    assert our_space == ref_space
    assert len(ours) == len(ref) == 2 * STEPS + 2 + 2  # observations and two truncations
    for a, b in zip(ours, ref):
        if isinstance(b, tuple):
            np.testing.assert_array_equal(a[1], b[1])
            assert a[2].keys() == b[2].keys()
            for k in b[2]:
                np.testing.assert_array_equal(a[2][k], b[2][k])
        else:
            np.testing.assert_array_equal(a, b)
    # two whole episodes, and the one-step episode in progress, saved at close
    lengths = {p.name: len(decode_mp4(p)) for p in tmp_path.glob("*.mp4")}
    assert lengths == {"0_env0_failure.mp4": STEPS + 1, "1_env0_failure.mp4": STEPS + 1, "2_env0_failure.mp4": 2}


def test_keep_success_leaves_only_the_videos_of_successes(tmp_path):
    """keep="success": one keyword. A scripted episode that succeeds and a still one that fails."""
    ex = load_example()
    steps = 16
    envs = make_eval_envs(ENV_ID, 1, "physx_cpu", env_kwargs(max_episode_steps=steps), dict(obs_horizon=2),
                          video_dir=str(tmp_path), keep="success")
    try:
        outcomes = []
        obs, _ = envs.reset(seed=1)
        for policy in ("scripted", "still"):
            for _ in range(steps):
                action = ex.push_cube_policy(obs[:, -1]) if policy == "scripted" else np.zeros((1, 4), np.float32)
                obs, _, _, truncated, info = envs.step(action)
            assert truncated.all()
            outcomes.append(bool(info["final_info"][0]["episode"]["success_at_end"]))
    finally:
        envs.close()
    assert outcomes == [True, False]
    assert [p.name for p in tmp_path.glob("*.mp4")] == ["0_env0_success.mp4"]


def test_gpu_branch_wiring_runs_with_one_cpu_env(tmp_path):
    """Any sim_backend other than "physx_cpu" takes the baseline's GPU branch (one batched ManiSkill
    env under ManiSkillVectorEnv); with num_envs=1 and sim_backend="cpu" that branch runs here."""
    from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

    envs = make_eval_envs(ENV_ID, 1, "cpu", env_kwargs(), dict(obs_horizon=2), video_dir=str(tmp_path))
    try:
        assert isinstance(envs, ManiSkillVectorEnv)
        obs, _ = envs.reset(seed=0)
        assert isinstance(obs, torch.Tensor) and tuple(obs.shape) == (1, 2, OBS_DIM)
        for _ in range(STEPS):
            obs, _, _, truncated, info = envs.step(torch.zeros(1, 4))
        assert truncated.all() and "episode" in info["final_info"]
    finally:
        envs.close()
    videos = list(tmp_path.glob("*.mp4"))
    assert len(videos) == 1 and decode_mp4(videos[0]).shape[0] == STEPS + 1


def test_missing_obs_horizon_is_a_clear_error():
    with pytest.raises(ValueError, match="obs_horizon"):
        make_eval_envs(ENV_ID, 1, "physx_cpu", env_kwargs(), {})


# ---------------------------------------------------------------------------------------------- argument checks
@pytest.mark.parametrize(("change", "match"), [
    (dict(num_envs=0), r"num_envs=0 must be an integer >= 1"),
    (dict(num_envs=2.5), r"num_envs=2.5 must be an integer >= 1"),
    (dict(sim_backend="physx_cpux"), r"sim_backend='physx_cpux' is unknown; use one of .*physx_cpu"),
    (dict(env_id="PickCub-v1"), r"env_id='PickCub-v1' is not a registered environment; did you mean PickCube-v1"),
    (dict(env_kwargs=None), r"env_kwargs=None must be a dict"),
    (dict(keep="sometimes"), r"keep='sometimes' is not a filter; use one of"),
    (dict(record_kwargs=dict(video_fsp=30)), r"record_kwargs has unknown keys \['video_fsp'\]; use .*video_fps"),
    (dict(record_kwargs=dict(video_fps=0)), r"video_fps=0 must be a positive number"),
    (dict(log="mlflow"), r"log='mlflow' is not a logger; use one of 'tensorboard', 'wandb'"),
    (dict(episodes=0), r"episodes=0 must be an integer >= 1"),
    (dict(wrappers=["FrameStack"]), r"wrappers=\['FrameStack'\] must be a list of wrapper classes"),
    (dict(other_kwargs=dict(obs_horizon=0)), r"other_kwargs\['obs_horizon'\]=0 must be an integer >= 1"),
    (dict(other_kwargs=dict(obs_horizon="2")), r"other_kwargs\['obs_horizon'\]='2' must be an integer >= 1"),
    (dict(batched_render="yes"), r"batched_render='yes' must be None .*, True or False"),
    (dict(envs_per_process=0), r"envs_per_process=0: pass a positive int"),
    (dict(video_dir=None, log="tensorboard"), r"log='tensorboard' logs through the recorder.*pass video_dir="),
    (dict(video_dir=None, episodes=8), r"episodes=8 makes a sharded, recorded evaluation, which needs video_dir"),
])
def test_bad_arguments_are_refused_before_anything_is_made(tmp_path, change, match):
    kwargs = dict(
        env_id="PickCube-v1",
        num_envs=1,
        sim_backend="physx_cpu",
        env_kwargs=dict(),
        other_kwargs=dict(obs_horizon=2),
        video_dir=str(tmp_path / "videos"),
    )
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        make_eval_envs(**kwargs)
    assert list(tmp_path.iterdir()) == []


def test_a_file_as_video_dir_is_refused(tmp_path):
    (tmp_path / "videos").write_text("")
    with pytest.raises(ValueError, match=r"video_dir=.*videos' is a file, not a folder"):
        make_eval_envs("PickCube-v1", 1, "physx_cpu", {}, dict(obs_horizon=2), video_dir=str(tmp_path / "videos"))


def test_a_script_that_never_closes_still_saves_its_videos(tmp_path):
    """A script that never calls ``close``: the recorder's exit hook (`fastrecord.exits.close_at_exit`) still
    writes its finished episode's video whole, and the process exits cleanly."""
    import os
    import subprocess
    import sys

    script = f"""
from fastrecord import make_eval_envs
from fastrecord.system import use_lavapipe_if_no_gpu
use_lavapipe_if_no_gpu()
envs = make_eval_envs({ENV_ID!r}, 1, "physx_cpu", {env_kwargs(max_episode_steps=2)!r}, dict(obs_horizon=2),
                      video_dir={str(tmp_path)!r})
envs.reset(seed=0)
for _ in range(2):
    envs.step(envs.action_space.sample())
"""
    src = str(Path(__file__).parents[1] / "src")  # this checkout's code
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env,
                       cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    (video,) = tmp_path.glob("*.mp4")
    assert decode_mp4(video).shape == (3, CAMERA["height"], CAMERA["width"], 3)
