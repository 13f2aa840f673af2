"""num_envs > 1 batched-tensor semantics, through `BatchedDoubleEnv` (test double of ManiSkill's GPU env)."""

from __future__ import annotations

import json

import h5py
import numpy as np
import pytest
import torch
from mani_skill.vector.wrappers.gymnasium import ManiSkillVectorEnv

from fastrecord import RecordEpisode
from fastrecord.testing import BatchedDoubleEnv, frames_for
from fastrecord.testing import frame_psnr as psnr
from fastrecord.video import decode_mp4


def run(tmp_path, steps=12, num_envs=4, max_steps=6, success_step=(2, 0, 4, 0), **kwargs):
    base = BatchedDoubleEnv(num_envs=num_envs, max_episode_steps=max_steps, success_step=list(success_step))
    env = ManiSkillVectorEnv(RecordEpisode(base, tmp_path, trajectory_name="t", **kwargs), auto_reset=True,
                             ignore_terminations=False)
    env.reset(seed=list(range(num_envs)))
    for _ in range(steps):
        env.step(torch.ones(num_envs, 3))
    env.close()
    meta = json.loads((tmp_path / "t.json").read_text())
    return base, meta


def videos(tmp_path) -> dict[int, tuple[int, str]]:
    """episode id -> (env index, outcome) parsed from '{episode}_env{i}_{outcome}.mp4'."""
    out = {}
    for p in tmp_path.glob("*_env*.mp4"):
        ep, env, outcome = p.stem.split("_")
        out[int(ep)] = (int(env[3:]), outcome)
    return out


def test_partial_resets_round_trip(tmp_path):
    """Envs terminate at different steps and auto-reset; every episode's data and frames are its own."""
    base, meta = run(tmp_path)
    eps = meta["episodes"]
    vids = videos(tmp_path)
    assert len(vids) == len(eps)
    # env0 succeeds every 2 steps, env2 every 4, env1/env3 truncate at 6 (12 steps: 2 full episodes each)
    lengths = {}
    for e in eps:
        lengths.setdefault(vids[e["episode_id"]][0], []).append(e["elapsed_steps"])
    assert lengths == {0: [2] * 6, 1: [6, 6], 2: [4] * 3, 3: [6, 6]}
    with h5py.File(tmp_path / "t.h5") as f:
        for e in eps:
            g = f[f"traj_{e['episode_id']}"]
            env_idx, outcome = vids[e["episode_id"]]
            obs = g["obs"][:]
            T = e["elapsed_steps"]
            assert obs.shape == (T + 1, 4) and g["actions"].shape == (T, 3)
            np.testing.assert_array_equal(obs[:, 3], np.arange(T + 1))  # elapsed steps 0..T: no foreign rows
            np.testing.assert_allclose(np.diff(obs[:, 0]), 0.1, rtol=1e-5)  # each row follows the last
            assert g["success"][-1] == (outcome == "success") == e["success"]
            assert g["env_states/actors/box"].shape == (T + 1, 13)
            # the video is this env's frames: recompute them from the recorded state
            expected = frames_for(
                torch.as_tensor(obs[:, :3]), torch.as_tensor(obs[:, 3]).int(), base.size, env_idx
            ).numpy()
            decoded = decode_mp4(tmp_path / f"{e['episode_id']}_env{env_idx}_{outcome}.mp4")
            assert decoded.shape == expected.shape
            assert psnr(decoded, expected).min() > 30
            assert psnr(decoded[1:], expected[:-1]).max() < 25  # a shifted frame fails


def test_one_render_per_parallel_step(tmp_path):
    """Exactly one batched render per step; a reset adds one (the new episodes' first frames)."""
    base = BatchedDoubleEnv(num_envs=4, max_episode_steps=100)
    env = RecordEpisode(base, tmp_path, trajectory_name="t")
    env.reset(seed=0)
    for _ in range(10):
        env.step(torch.zeros(4, 3))
    assert base.render_calls == 1 + 10
    env.reset(options={"env_idx": torch.tensor([1, 2])})
    env.step(torch.zeros(4, 3))
    assert base.render_calls == 1 + 10 + 1 + 1
    env.close()


@pytest.mark.parametrize(
    "keep, expect_success",
    [("success", {True}), ("failure", {False}), ("all", {True, False}), (lambda info: bool(info["success"]), {True})],
)
def test_keep_filters(tmp_path, keep, expect_success):
    _, meta = run(tmp_path, keep=keep)
    assert {e["success"] for e in meta["episodes"]} == expect_success
    # 12 steps: env0 succeeds 6 times, env2 3 times; env1 and env3 time out twice each
    counts = {True: 6 + 3, False: 2 + 2}
    assert len(meta["episodes"]) == sum(counts[s] for s in expect_success)
    assert len(list(tmp_path.glob("*.mp4"))) == len(meta["episodes"])
    assert [e["episode_id"] for e in meta["episodes"]] == list(range(len(meta["episodes"])))


def test_success_once_keeps_episodes_that_succeeded_before_the_end(tmp_path):
    """ignore_terminations (make_eval_envs): success at step 2 then the episode runs on to the time limit."""
    base = BatchedDoubleEnv(num_envs=2, max_episode_steps=5, success_step=[2, 0])
    env = RecordEpisode(base, tmp_path, trajectory_name="t", keep="success_once")
    env.reset(seed=0)
    base.success_step[0] = 2
    for t in range(5):
        env.step(torch.zeros(2, 3))
        if t == 2:
            base.success_step[0] = 99  # success goes away again after step 3
    env.close()
    eps = json.loads((tmp_path / "t.json").read_text())["episodes"]
    assert len(eps) == 1 and eps[0]["elapsed_steps"] == 5 and eps[0]["success"] is False
    with h5py.File(tmp_path / "t.h5") as f:
        assert f["traj_0/success"][:].tolist() == [False, True, True, False, False]


def test_long_episodes_grow_the_buffer(tmp_path):
    """Episodes longer than buffer_capacity are kept whole (the buffer grows), never truncated."""
    base, meta = run(tmp_path, steps=14, max_steps=7, success_step=(0, 0, 0, 0), buffer_capacity=3)
    assert [e["elapsed_steps"] for e in meta["episodes"]] == [7] * 8
    with h5py.File(tmp_path / "t.h5") as f:
        for k in f:
            np.testing.assert_array_equal(f[k]["obs"][:, 3], np.arange(8))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_tiled_layout_matches_maniskill(tmp_path, device, monkeypatch):
    """video_layout='tiled': one video per batch of episodes ending together, ManiSkill's tile layout
    (RGB frames gathered through the staging memory in chunks, not converted to yuv420p on the device)."""
    from mani_skill.utils.visualization.misc import tile_images

    monkeypatch.setattr("fastrecord.hostcopy.CHUNK_BYTES", 1)  # one env per chunk of the gather
    base = BatchedDoubleEnv(num_envs=4, max_episode_steps=3, size=256, device=device)
    env = RecordEpisode(base, tmp_path, trajectory_name="t", video_layout="tiled")
    obs, _ = env.reset(seed=0)
    frames = [base.render()]
    for _ in range(3):
        env.step(torch.zeros(4, 3, device=device))
        frames.append(base.render())
    env.reset()
    env.close()
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == ["0.mp4"]
    ref = tile_images([f.cpu().numpy() for f in torch.stack(frames, dim=1)], nrows=2)
    decoded = decode_mp4(tmp_path / "0.mp4")
    assert decoded.shape == ref.shape == (4, 512, 512, 3)
    assert psnr(decoded, ref).min() > 30


def test_info_on_video_draws_text(tmp_path):
    base = BatchedDoubleEnv(num_envs=2, max_episode_steps=3)
    env = RecordEpisode(base, tmp_path / "plain", trajectory_name="t", save_trajectory=False)
    env2 = RecordEpisode(BatchedDoubleEnv(num_envs=2, max_episode_steps=3), tmp_path / "text", save_trajectory=False,
                         info_on_video=True)
    for e in (env, env2):
        e.reset(seed=0)
        for _ in range(3):
            e.step(torch.zeros(2, 3))
        e.close()
    plain = decode_mp4(tmp_path / "plain" / "0_env0_failure.mp4")
    text = decode_mp4(tmp_path / "text" / "0_env0_failure.mp4")
    assert psnr(plain[:1], text[:1]).min() > 40  # the reset frame carries no text (as ManiSkill)
    assert psnr(plain[1:], text[1:]).max() < 30  # later frames do


def test_save_video_trigger_skips_rendering(tmp_path):
    """Steps the trigger rejects are not rendered; episodes with missing frames get no video."""
    base = BatchedDoubleEnv(num_envs=2, max_episode_steps=3)
    env = RecordEpisode(base, tmp_path, trajectory_name="t", save_video_trigger=lambda step: step >= 3)
    env.reset(seed=0)
    for _ in range(3):
        env.step(torch.zeros(2, 3))  # steps 0-2: no frames
    env.reset()
    for _ in range(3):
        env.step(torch.zeros(2, 3))
    env.close()
    assert base.render_calls == 1 + 3  # the second reset and its 3 steps
    assert sorted(p.name for p in tmp_path.glob("*.mp4")) == ["2_env0_failure.mp4", "3_env1_failure.mp4"]
    assert len(json.loads((tmp_path / "t.json").read_text())["episodes"]) == 4  # trajectories regardless


@pytest.mark.gpu
def test_cuda_buffers_round_trip(tmp_path):
    """Frames and step data stay on the GPU until the episode ends; the files match what was rendered."""
    base = BatchedDoubleEnv(num_envs=8, max_episode_steps=5, size=64, device="cuda", success_step=[3, 0] * 4)
    env = RecordEpisode(base, tmp_path, trajectory_name="t", keep="success")
    env.reset(seed=list(range(8)))
    assert env.recorder.buffer.fields["frames"].device.type == "cuda"
    for _ in range(3):
        env.step(torch.ones(8, 3, device="cuda"))
    env.reset(options={"env_idx": torch.arange(0, 8, 2, device="cuda")})
    env.close()
    eps = json.loads((tmp_path / "t.json").read_text())["episodes"]
    assert len(eps) == 4 and all(e["success"] and e["elapsed_steps"] == 3 for e in eps)
    with h5py.File(tmp_path / "t.h5") as f:
        vids = videos(tmp_path)
        for e in eps:
            env_idx, outcome = vids[e["episode_id"]]
            obs = f[f"traj_{e['episode_id']}"]["obs"][:]
            expected = frames_for(torch.as_tensor(obs[:, :3]), torch.as_tensor(obs[:, 3]).int(), 64, env_idx).numpy()
            decoded = decode_mp4(tmp_path / f"{e['episode_id']}_env{env_idx}_{outcome}.mp4")
            assert psnr(decoded, expected).min() > 30


@pytest.mark.parametrize("render_device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_envs_at_different_steps_and_fields_on_their_devices(tmp_path, render_device):
    """Partial resets put envs at different steps (the indexed write path, then back to one step each);
    with CPU simulation and GPU rendering, frames stay on the GPU and flags and states on the CPU (no
    per-step copies between devices)."""
    base = BatchedDoubleEnv(num_envs=4, max_episode_steps=6, size=64, device="cpu", success_step=[2, 0, 2, 0])
    render = base.render
    base.render = lambda: render().to(render_device)
    env = RecordEpisode(base, tmp_path, trajectory_name="t")
    env.reset(seed=[0, 1, 2, 3])
    env.step(np.ones((4, 3), dtype=np.float32))
    env.reset(options={"env_idx": [1, 3]})  # envs 1, 3 restart: cursors differ from now on
    fields = env.recorder.buffer.fields
    assert fields["frames"].device.type == render_device and fields["actions"].device.type == "cpu"
    for _ in range(3):
        env.step(np.ones((4, 3), dtype=np.float32))
    env.reset()  # all envs at one step again (the strided-copy path)
    env.step(np.ones((4, 3), dtype=np.float32))
    env.close()
    eps = json.loads((tmp_path / "t.json").read_text())["episodes"]
    assert sorted(e["elapsed_steps"] for e in eps) == [1, 1, 1, 1, 1, 1, 3, 3, 4, 4]
    with h5py.File(tmp_path / "t.h5") as f:
        vids = videos(tmp_path)
        for e in eps:
            env_idx, outcome = vids[e["episode_id"]]
            obs = f[f"traj_{e['episode_id']}"]["obs"][:]
            assert len(obs) == e["elapsed_steps"] + 1
            expected = frames_for(torch.as_tensor(obs[:, :3]), torch.as_tensor(obs[:, 3]).int(), 64, env_idx).numpy()
            decoded = decode_mp4(tmp_path / f"{e['episode_id']}_env{env_idx}_{outcome}.mp4")
            assert psnr(decoded, expected).min() > 30


def test_staggered_ends_share_staging_and_every_video_is_its_episode(tmp_path, monkeypatch):
    """Per-env lengths drawn by the env at each reset and partial resets of the finished envs only (the
    GPU contract): the small gathers of each step share staging arenas, and every episode's video holds
    exactly its own frames."""
    from fastrecord import buffer as buffer_mod
    from fastrecord.staging import StagingPool

    pool = StagingPool(prefetch=False)
    monkeypatch.setattr(buffer_mod, "default_staging_pool", lambda: pool)
    n, size = 6, 128  # 128x128 frames: each gather is over 1 MiB, so it goes through staging
    base = BatchedDoubleEnv(num_envs=n, max_episode_steps=8, size=size,
                            episode_lengths=lambda env, seed: 3 + (7 * seed + env) % 6)
    env = RecordEpisode(base, tmp_path, trajectory_name="t")
    env.reset(seed=list(range(n)))
    seed = n
    ends = 0
    for _ in range(30):
        _, _, term, trunc, _ = env.step(torch.ones(n, 3))
        done = torch.nonzero(term | trunc).flatten()
        if len(done):
            ends += 1
            env.reset(seed=list(range(seed, seed + len(done))), options={"env_idx": done})
            seed += len(done)
    env.close()
    meta = json.loads((tmp_path / "t.json").read_text())
    eps = meta["episodes"]
    vids = videos(tmp_path)
    assert len(vids) == len(eps) > 2 * n and ends > 5
    assert pool.arenas_created < ends  # one arena served many steps' groups
    lengths = set()
    with h5py.File(tmp_path / "t.h5") as f:
        for e in eps:
            env_idx, outcome = vids[e["episode_id"]]
            obs = f[f"traj_{e['episode_id']}"]["obs"][:]
            lengths.add(e["elapsed_steps"])
            expected = frames_for(torch.as_tensor(obs[:, :3]), torch.as_tensor(obs[:, 3]).int(), size, env_idx).numpy()
            decoded = decode_mp4(tmp_path / f"{e['episode_id']}_env{env_idx}_{outcome}.mp4")
            assert decoded.shape == expected.shape  # no dropped or extra frames
            assert psnr(decoded, expected).min() > 30
    assert len(lengths) > 2  # episodes of different lengths
    pool.close()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_info_overlay_drawn_in_encoder_processes_matches_maniskills_text(tmp_path, device):
    """info_on_video: the encoder process draws the recorded scalars (nothing but the scalars is done on
    the stepping thread). Same lines as ManiSkill's ``put_info_on_image`` (its formatting: floats as
    %.3f), at the same place (top left, ManiSkill's 16 px font at 256 px), the scene elsewhere untouched;
    and exactly the picture `draw_overlay` makes in this process. CUDA frames reach the encoders as yuv420p
    (converted on the GPU) and the text is drawn on those: the picture of the RGB drawing converted."""
    from mani_skill.utils.visualization.misc import put_info_on_image

    from fastrecord.sinks.mp4 import Mp4Sink
    from fastrecord.video import VideoSettings, encode_mp4
    from fastrecord.video.overlay import Overlay, draw_overlay, maniskill_font, overlay_lines
    from fastrecord.video.yuv import Yuv420Frames, rgb_to_yuv420p

    n, size, steps = 2, 256, 4
    base = BatchedDoubleEnv(num_envs=n, max_episode_steps=steps, size=size, success_step=[3, 0], device=device)
    env = RecordEpisode(base, tmp_path / "ours", trajectory_name="t", save_trajectory=False, info_on_video=True)
    assert Mp4Sink(VideoSettings(), info_on_video=True).accepts_yuv420p  # per-env videos with text take yuv420p
    env.reset(seed=0)
    frames, infos = [base.render().cpu().numpy()], [{}]
    for _ in range(steps):
        _, rew, _, _, info = env.step(torch.ones(n, 3, device=device))
        frames.append(base.render().cpu().numpy())
        infos.append({k: info[k].cpu().numpy() for k in ("success", "fail", "elapsed_steps")}
                     | {"reward": rew.cpu().numpy()})
    env.close()
    for e in range(n):
        (path,) = (tmp_path / "ours").glob(f"*_env{e}_*.mp4")
        ours = decode_mp4(path)
        clip = np.stack([f[e] for f in frames])
        per_frame = [{}] + [
            {k: (float(v[e]) if k == "reward" else v[e].item()) for k, v in i.items()} for i in infos[1:]
        ]
        # ManiSkill's own overlay of the same info, encoded as ours (its `images_to_video` needs imageio's ffmpeg
        # plugin, which the GPU machine's kit lacks)
        theirs_frames = [clip[0]] + [put_info_on_image(clip[t], per_frame[t]) for t in range(1, steps + 1)]
        theirs = decode_mp4(encode_mp4(tmp_path / f"theirs{e}.mp4", np.stack(theirs_frames),
                                       VideoSettings(executor="thread")))
        assert ours.shape == theirs.shape == (steps + 1, size, size, 3)
        assert psnr(ours[:, size // 2 :], theirs[:, size // 2 :]).min() > 35  # the scene, below the text, untouched
        assert psnr(ours[:1], theirs[:1]).min() > 35  # the reset frame has no text (as ManiSkill)
        for t in range(1, steps + 1):
            for video in (ours, theirs):  # green text in the top-left quarter of both
                top = video[t, : size // 2, : size // 2].astype(int)
                assert ((top[..., 1] > 150) & (top[..., 0] < 100)).sum() > 100
            lines = set(overlay_lines(per_frame[t], 10, 80))
            assert lines == {f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in per_frame[t].items()}
        ref = draw_overlay(clip, Overlay.of_episode({k: np.array([i[k][e] for i in infos[1:]]) for k in infos[1]},
                                                    maniskill_font()))
        if device == "cpu":  # the same RGB frames into the same encoder: the same video
            ref_video = decode_mp4(encode_mp4(tmp_path / f"ref{e}.mp4", ref, VideoSettings(executor="thread")))
            assert psnr(ours, ref_video).min() > 45  # what this process draws, drawn by the encoder process
        else:  # drawn on yuv420p: within rounding of the RGB drawing converted (63 dB on the CPU machine), which
            # sends H.264 down other paths (two encodes 41-45 dB apart): as close to the RGB picture as its own encode
            ref_video = decode_mp4(encode_mp4(tmp_path / f"ref{e}.mp4", Yuv420Frames(
                rgb_to_yuv420p(torch.from_numpy(ref).cuda()).cpu().numpy()), VideoSettings(executor="thread")))
            assert (psnr(ours, ref) >= psnr(ref_video, ref) - 0.5).all()


def test_both_views_are_env_views_and_reset_only_the_given_envs():
    """`EnvView`: the recorder's one way to read an env; the views say how a partial reset is asked for."""
    import gymnasium as gym

    from fastrecord.envs import EnvView, ManiSkillView, VectorEnvView

    batched = ManiSkillView(BatchedDoubleEnv(num_envs=3))
    assert isinstance(batched, EnvView) and batched.per_env_seeds and not batched.unbatched
    assert batched.partial_reset_options([0, 2])["env_idx"].tolist() == [0, 2]
    assert not ManiSkillView(BatchedDoubleEnv(num_envs=1)).per_env_seeds  # one env: the caller's reset kwargs
    vector = gym.vector.SyncVectorEnv([lambda: BatchedDoubleEnv(num_envs=1)] * 3)
    try:
        view = VectorEnvView(vector)
        assert isinstance(view, EnvView) and view.per_env_seeds
        assert view.partial_reset_options([1])["reset_mask"].tolist() == [False, True, False]
    finally:
        vector.close()
